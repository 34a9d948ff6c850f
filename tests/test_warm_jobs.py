"""Warm jobs (``fixtures/warm_jobs.py``) give what a fresh torchrun gives: the same run warm and fresh logs the same
numbers to the last bit and writes the same weights, after another call in the same job refused its flags; and what
must be fresh is refused before any job starts.

    .venv/bin/python -m pytest -q tests/test_warm_jobs.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fixtures.e2e import assert_ok, model_vocab_size, read_metrics, torchrun, write_tokenized_jsonl
from fixtures.warm_jobs import WarmRefused
from minitrainer.checkpoint.full_state import complete_checkpoints

TIMING = {"elapsed", "time", "tokens_per_second", "samples_per_second", "step_time", "timestamp"}


def _args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out), "--batch-size", "12",
            "--max-tokens-per-gpu", "64", "--seed", "5", "--learning-rate", "1e-2", "--num-warmup-steps", "1",
            "--lr-scheduler", "cosine", "--max-steps", "3", "--min-samples-per-checkpoint", "24",
            "--num-data-workers", "0", *extra]


def _numbers(record: dict) -> dict:
    """A metrics line without what depends on the clock."""
    return {key: value for key, value in record.items()
            if key not in TIMING and not any(word in key for word in ("time", "per_second", "mfu", "memory"))}


def test_a_warm_run_equals_a_fresh_one_bit_for_bit(tmp_path, chatml_model):
    data = write_tokenized_jsonl(tmp_path / "data.jsonl", num_samples=40, vocab_size=model_vocab_size(chatml_model),
                                 seed=2)
    fresh, warm = tmp_path / "fresh", tmp_path / "warm"
    assert_ok(torchrun(_args(chatml_model, data, fresh)))
    refused = torchrun(_args(chatml_model, data, tmp_path / "refused", "--max-stepz", "2"), warm=True)
    assert refused.returncode == 1 and refused.rank_codes == [2, 2]
    assert "train.py: error: unknown flag --max-stepz; did you mean --max-steps?" in refused.stderr
    assert_ok(torchrun(_args(chatml_model, data, warm), warm=True))
    fresh_steps, warm_steps = read_metrics(fresh), read_metrics(warm)
    assert [record["step"] for record in warm_steps] == [1, 2, 3]
    assert [_numbers(record) for record in warm_steps] == [_numbers(record) for record in fresh_steps]
    for kind in ("hf_format", "full_state"):
        assert [p.name for p in complete_checkpoints(warm / kind)] == [p.name for p in complete_checkpoints(fresh / kind)]
    a = load_file(complete_checkpoints(fresh / "hf_format")[-1] / "model.safetensors")
    b = load_file(complete_checkpoints(warm / "hf_format")[-1] / "model.safetensors")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)
    # The refusal before it in the same processes left nothing behind: no exit line of its own.
    assert json.loads((warm / "run_status.json").read_text())["message"] is None


@pytest.mark.parametrize(("call", "refusal"), [
    ({"args": ["--compile"]}, "--compile runs fresh"),
    ({"args": ["--use-liger-kernels"]}, "--use-liger-kernels runs fresh"),
    ({"args": ["--trust-remote-code"]}, "--trust-remote-code runs fresh"),
    ({"nproc": 4}, "a warm job has 1 or 2 ranks, not 4"),
    ({"module": "fixtures.matrix_train"}, "a warm job runs train.main, not fixtures.matrix_train"),
    ({"env": {"MINI_TRAINER_TEST_NAN": "1:0"}}, "MINI_TRAINER_TEST_NAN need a fresh process"),
    ({"env": {"HF_HOME": "/tmp/elsewhere"}}, "HF_HOME need a fresh process"),
    ({"env": {"PYTHONPATH": "/tmp"}}, "PYTHONPATH need a fresh process"),
])
def test_what_must_be_fresh_is_refused_before_a_job_starts(call, refusal):
    from fixtures import warm_jobs

    jobs = dict(warm_jobs._jobs)
    with pytest.raises(WarmRefused, match=refusal.replace("-", r"\-")):
        torchrun(call.get("args", []), nproc=call.get("nproc", 2), module=call.get("module"), env=call.get("env"),
                 warm=True)
    assert warm_jobs._jobs == jobs
