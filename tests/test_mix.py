"""Weighted data mixing: the spec syntax, the stream's proportions and determinism, exact resume with a mix.

    .venv/bin/python -m pytest -q tests/test_mix.py

The stream is a pure function of (seed, position): any start position gives
the continuation of the uninterrupted stream, and over many samples each
source's share is within binomial tolerance of its weight. End to end, a
SIGKILLed run on a mix (a fresh torchrun) resumes to the same steps as an
uninterrupted one (the resume, the reference and the refusal are warm runs of
2 gloo ranks, ``fixtures/warm_jobs.py``: their numbers are the subject).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from fixtures.e2e import model_vocab_size, read_metrics, torchrun, write_tokenized_jsonl
from minitrainer.checkpoint.full_state import complete_checkpoints
from minitrainer.data.mix import MixedDataset, MixedStream, Source, data_paths, parse_data_spec
from minitrainer.data.sampler import load_tokenized_dataset


def test_single_path_is_not_a_mix(tmp_path):
    assert parse_data_spec("./data/chat_tkns") is None
    assert parse_data_spec(str(tmp_path / "train.jsonl")) is None
    assert data_paths("./data/chat_tkns") == ["./data/chat_tkns"]


def test_inline_and_file_specs_agree(tmp_path):
    inline = parse_data_spec("a/x.jsonl:3,b/y:1")
    assert inline == [Source("a/x.jsonl", 0.75), Source("b/y", 0.25)]
    (tmp_path / "mix.yaml").write_text("sources:\n  - {path: x.jsonl, weight: 3}\n  - {path: /abs/y, weight: 1}\n")
    (tmp_path / "mix.json").write_text(json.dumps({"x.jsonl": 3, "/abs/y": 1}))
    expected = [Source(str(tmp_path / "x.jsonl"), 0.75), Source("/abs/y", 0.25)]
    assert parse_data_spec(str(tmp_path / "mix.yaml")) == expected
    assert parse_data_spec(str(tmp_path / "mix.json")) == expected
    for bad in ("a:0.5,b", "a:0,b:1", "a:-1"):
        with pytest.raises(ValueError):
            parse_data_spec(bad)


@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.5, 0.3, 0.2], [0.05, 0.95]])
def test_proportions_within_binomial_tolerance(weights):
    sizes = [13, 50, 7][: len(weights)]
    stream = MixedStream(sizes, weights, seed=1)
    n = 50_000
    rows = stream.take(n)
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    source = np.searchsorted(offsets, rows, side="right") - 1
    for s, weight in enumerate(weights):
        share = np.mean(source == s)
        assert abs(share - weight) < 5 * math.sqrt(weight * (1 - weight) / n), (s, share, weight)
        # Within a source, every row comes up once per epoch.
        drawn = rows[source == s] - offsets[s]
        full = (drawn.size // sizes[s]) * sizes[s]
        assert np.array_equal(np.bincount(drawn[:full], minlength=sizes[s]), np.full(sizes[s], full // sizes[s]))


@pytest.mark.parametrize("start", [0, 1, 1023, 1024, 5000])
def test_stream_resumes_exactly_from_any_position(start):
    whole = MixedStream([13, 50], [0.6, 0.4], seed=9).take(7000)
    resumed = MixedStream([13, 50], [0.6, 0.4], seed=9, position=start)
    pieces = [resumed.take(k) for k in (1, 500, 7000 - start - 501)]
    assert np.array_equal(np.concatenate(pieces), whole[start:])
    assert not np.array_equal(MixedStream([13, 50], [0.6, 0.4], seed=10).take(7000), whole)


# ----------------------------------------------------------------------------
# End to end

BATCH = 10
STEPS = 6


@pytest.fixture(scope="module")
def mix_spec(tmp_path_factory, chatml_model) -> str:
    vocab = model_vocab_size(chatml_model)
    root = tmp_path_factory.mktemp("mix")
    a = write_tokenized_jsonl(root / "a.jsonl", num_samples=25, vocab_size=vocab, seed=1)
    b = write_tokenized_jsonl(root / "b.jsonl", num_samples=9, vocab_size=vocab, seed=2, max_len=20)
    return f"{a}:0.7,{b}:0.3"


def _args(model: Path, data: str, out: Path, *extra: str) -> list[str]:
    return ["--model-name-or-path", str(model), "--data-path", data, "--output-dir", str(out),
            "--batch-size", str(BATCH), "--max-tokens-per-gpu", "96", "--seed", "3", "--learning-rate", "1e-3",
            "--num-warmup-steps", "1", "--lr-scheduler", "cosine", "--max-steps", str(STEPS),
            "--min-samples-per-checkpoint", str(3 * BATCH), "--num-data-workers", "0", *extra]


def test_sigkill_then_rerun_with_a_mix_matches_uninterrupted(tmp_path, chatml_model, mix_spec):
    reference = tmp_path / "a"
    result = torchrun(_args(chatml_model, mix_spec, reference), warm=True)
    assert result.returncode == 0, result.stderr[-4000:]
    out = tmp_path / "b"
    killed = torchrun(_args(chatml_model, mix_spec, out), env={"MINI_TRAINER_TEST_KILL_AFTER_SAVE": str(3 * BATCH)})
    assert killed.returncode != 0
    assert [p.name for p in complete_checkpoints(out / "full_state")] == [f"samples_{3 * BATCH}"]
    resumed = torchrun(_args(chatml_model, mix_spec, out), warm=True)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    a, b = read_metrics(reference), read_metrics(out)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    for ra, rb in zip(a, b, strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-6) and rb["lr"] == ra["lr"]
        assert rb["samples_seen_per_source"] == ra["samples_seen_per_source"]
        assert rb["batch_num_loss_counted_tokens"] == ra["batch_num_loss_counted_tokens"]
    # The per-source counts are the stream's own, and sum to the stream position.
    last = b[-1]
    assert sum(last["samples_seen_per_source"].values()) == last["samples_seen"] == STEPS * BATCH
    datasets = [load_tokenized_dataset(s.path) for s in parse_data_spec(mix_spec)]
    expected = MixedDataset(parse_data_spec(mix_spec), datasets).source_metrics(3, STEPS * BATCH)
    assert last["epoch_per_source"] == pytest.approx(expected["epoch_per_source"])
    # Changing the weights is a changed run parameter.
    refused = torchrun(_args(chatml_model, mix_spec.replace("0.7", "0.8").replace("0.3", "0.2"), out,
                             "--max-steps", str(STEPS + 2)), warm=True)
    assert refused.returncode != 0 and "data_mix_weights" in refused.stderr
