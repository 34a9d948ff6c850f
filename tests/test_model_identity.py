"""The model's identity in the resume check: another checkpoint of the same shape is refused in one line.

    .venv/bin/python -m pytest -q tests/test_model_identity.py

Two tiny models saved from different seeds with one config (the same shape, other weights) are
pointed in turn at one output folder, through warm 2-rank runs of train.py (``fixtures/warm_jobs.py``: the
refusal's text and the folder left as it was are the subject, not the processes' life).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fixtures.e2e import assert_ok, model_vocab_size, read_metrics, torchrun, write_tokenized_jsonl
from minitrainer.checkpoint import resume_policy
from minitrainer.checkpoint.resume_policy import check_resume, fingerprint_mismatch
from minitrainer.tools.tiny_model import build_model

BATCH = 8


@pytest.fixture(scope="module")
def other_model(tmp_path_factory, chatml_model) -> Path:
    """The same config and tokenizer as ``chatml_model``, weights from another seed."""
    return build_model(chatml_model, tmp_path_factory.mktemp("other_model"), seed=1)


@pytest.fixture(scope="module")
def data_path(tmp_path_factory, chatml_model) -> Path:
    return write_tokenized_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", num_samples=40,
                                 vocab_size=model_vocab_size(chatml_model), seed=5)


def _args(model: Path, data: Path, out: Path, steps: int) -> list[str]:
    return ["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out),
            "--batch-size", str(BATCH), "--max-tokens-per-gpu", "96", "--seed", "7", "--learning-rate", "1e-3",
            "--lr-scheduler", "constant_with_warmup", "--num-warmup-steps", "0", "--max-steps", str(steps),
            "--min-samples-per-checkpoint", str(2 * BATCH), "--num-data-workers", "0"]


def test_weights_digest_tells_two_seeds_of_one_shape_apart(chatml_model, other_model, tmp_path):
    assert resume_policy.weights_digest(str(chatml_model)) != resume_policy.weights_digest(str(other_model))
    moved = shutil.copytree(chatml_model, tmp_path / "moved")
    assert resume_policy.weights_digest(str(moved)) == resume_policy.weights_digest(str(chatml_model)), \
        "a moved folder is the same model"
    assert resume_policy.weights_digest("Org/model", commit_hash="abc") == "hub:Org/model@abc"


def test_large_weight_files_are_sampled_and_still_told_apart(tmp_path):
    size = 64 * 2**20
    first, second = tmp_path / "a", tmp_path / "b"
    for folder, fill in ((first, b"\1"), (second, b"\2")):
        folder.mkdir()
        with (folder / "model.safetensors").open("wb") as f:
            f.truncate(size)  # sparse: only the bytes a sample reads are ever written
            f.seek(size // 2)
            f.write(fill * 2**20)  # one MiB in the middle: sampled, since samples are 1 MiB apart at most
    assert resume_policy.weights_digest(str(first)) != resume_policy.weights_digest(str(second))


def test_a_checkpoint_without_the_model_identity_resumes_with_a_warning(tmp_path):
    current = {"model_type": "qwen2", "model_source": "/m", "model_weights_xxh3": "x", "data_content_xxh3": "d"}
    old = tmp_path / "samples_8"
    old.mkdir()
    saved = {k: v for k, v in current.items() if k not in ("model_source", "model_weights_xxh3")}
    (old / "trainer_state.json").write_text(json.dumps({"fingerprint": saved}))
    error, notice = check_resume([old], {}, allow_change=False, fingerprint=current)
    assert error is None and "predates model_weights_xxh3" in notice and "model's weights" in notice
    assert fingerprint_mismatch({**current, "model_source": "/elsewhere"}, current) == (None, [])


def test_another_model_of_the_same_shape_is_refused_finished_or_not(tmp_path, chatml_model, other_model, data_path):
    out = tmp_path / "run"
    assert_ok(torchrun(_args(chatml_model, data_path, out, steps=2), warm=True))
    first_losses = [r["loss"] for r in read_metrics(out)]
    for steps in (2, 4):  # the folder holds a finished run (2 steps), then an unfinished one (of 4)
        result = torchrun(_args(other_model, data_path, out, steps=steps), warm=True)
        output = result.stdout + result.stderr
        assert result.returncode != 0, output[-3000:]
        refusals = [line for line in output.splitlines() if "cannot resume" in line]
        assert refusals and str(chatml_model) in refusals[0] and str(other_model) in refusals[0], output[-3000:]
        assert "--no-resume" in refusals[0]
        assert "already finished" not in output
    assert [r["loss"] for r in read_metrics(out)] == first_losses, "the refused runs wrote nothing"
    moved = shutil.copytree(chatml_model, tmp_path / "moved_model")
    assert_ok(torchrun(_args(moved, data_path, out, steps=4), warm=True))
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4], "the same weights moved still resume"
