"""The divergence guard and the non-finite abort, on real divergences.

    .venv/bin/python -m pytest -q tests/test_divergence.py

The rules are pure functions (``divergence.detect``); the runs are real ``torchrun`` launches of
train.py (2 gloo CPU processes) on the tiny model, diverging by their learning rate: 1e3 makes the
loss jump by six orders of magnitude and then sit at ln(vocabulary size) with a gradient norm of 0;
1e30 makes every later step non-finite.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from divergence import HISTORY, detect, remember
from fixtures.e2e import assert_ok, model_vocab_size, read_metrics, torchrun, write_tokenized_jsonl
from full_state import complete_checkpoints

BATCH = 8


@pytest.mark.parametrize(("loss", "grad_norm", "tokens", "recent", "factor", "diverged"), [
    (6.0, 1.3, 50, [6.1], 5.0, False),
    (2.1e7, 1.5e15, 50, [6.1], 5.0, True),                  # the jump of a learning rate that blows up
    (6.07, 0.0, 50, [6.1], 5.0, True),                      # the collapse after it: nothing left to learn from
    (6.07, 0.0, 0, [6.1], 5.0, False),                      # no loss tokens: a zero gradient is expected
    (0.8, 0.5, 50, [0.05] * 10, 5.0, False),                # a harder batch after the data is learnt: floor 1
    (5.5, 0.5, 50, [0.05] * 10, 5.0, True),
    (2.1e7, 1.5e15, 50, [], 5.0, False),                    # no history yet
    (2.1e7, 1.5e15, 50, [6.1], 0.0, False),                 # the loss rule off
    (math.nan, math.nan, 50, [6.1], 5.0, False),            # non-finite: the skip rule's
])
def test_detect(loss, grad_norm, tokens, recent, factor, diverged):
    why = detect(loss=loss, grad_norm=grad_norm, num_loss_tokens=tokens, recent_losses=recent, loss_factor=factor)
    assert (why is not None) == diverged, why


def test_history_keeps_the_newest():
    recent = []
    for loss in range(HISTORY + 5):
        recent = remember(recent, float(loss))
    assert recent == [float(x) for x in range(5, HISTORY + 5)]


@pytest.fixture(scope="module")
def data_path(tmp_path_factory, chatml_model) -> Path:
    return write_tokenized_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", num_samples=48,
                                 vocab_size=model_vocab_size(chatml_model), seed=5)


def _args(model: Path, data: Path, out: Path, learning_rate: str, *extra: str) -> list[str]:
    return ["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out),
            "--batch-size", str(BATCH), "--max-tokens-per-gpu", "96", "--seed", "7", "--learning-rate", learning_rate,
            "--lr-scheduler", "constant_with_warmup", "--num-warmup-steps", "0", "--max-steps", "5",
            "--min-samples-per-checkpoint", str(BATCH), "--num-data-workers", "0", *extra]


def test_a_learning_rate_that_blows_up_stops_before_the_diverged_model_is_exported(tmp_path, chatml_model,
                                                                                    data_path):
    out = tmp_path / "run"
    result = torchrun(_args(chatml_model, data_path, out, "1e3"))
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    [line] = [line for line in output.splitlines() if "[rank0] ERROR" in line]
    assert "divergence at step 2 (samples 8..16 of the stream)" in line and "--on-divergence warn" in line, line
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [1, 2]
    # Step 2's loss revealed the divergence: no export or full state was written after it.
    assert [p.name for p in complete_checkpoints(out / "hf_format")] == [f"samples_{BATCH}"]
    assert [p.name for p in complete_checkpoints(out / "full_state")] == [f"samples_{BATCH}"]


def test_warn_goes_on_and_never_takes_a_later_validation_as_best(tmp_path, chatml_model, data_path):
    out = tmp_path / "run"
    assert_ok(torchrun(_args(chatml_model, data_path, out, "1e3", "--on-divergence", "warn",
                             "--validation-split", "0.2", "--validation-every-n-steps", "1", "--save-best-val-loss")))
    records = read_metrics(out)
    val_losses = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val_losses) == 5 and min(val_losses[1:]) < val_losses[0], "later validations look better"
    best = json.loads((out / "hf_format" / "best" / "best_val_loss.json").read_text())
    assert best["step"] == 1, "an export after the divergence (step 2) is never the best"
    state = json.loads((complete_checkpoints(out / "full_state")[-1] / "trainer_state.json").read_text())
    assert state["diverged_at_step"] == 2


def test_non_finite_steps_in_a_row_abort_naming_every_steps_samples(tmp_path, chatml_model, data_path):
    out = tmp_path / "run"
    result = torchrun(_args(chatml_model, data_path, out, "1e30", "--max-bad-steps", "3"))
    output = result.stdout + result.stderr
    assert result.returncode != 0
    [line] = [line for line in output.splitlines() if "[rank0] ERROR" in line]
    assert "samples 8..16, 16..24, 24..32 of the stream" in line, line
