"""The divergence guard and the non-finite abort, on real divergences.

    .venv/bin/python -m pytest -q tests/test_divergence.py

The rules are pure functions (``divergence.detect``); the runs are ``train.main`` calls in a warm 2-rank
torchrun job (``fixtures/warm_jobs.py``: real gloo CPU ranks, started once; no fault is injected, so nothing
here needs a fresh process) on the tiny model, diverging by their learning rate: 1e3 makes the
loss jump by six orders of magnitude and then sit at ln(vocabulary size) with a gradient norm of 0;
1e30 makes every later step non-finite. The poisoned batch is real data: one long row whose labels
are arbitrary tokens among short rows of a pattern the model learns within a few steps.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fixtures.e2e import assert_ok, model_vocab_size, read_metrics, torchrun, write_tokenized_jsonl
from minitrainer.checkpoint.full_state import complete_checkpoints
from minitrainer.loop.divergence import HISTORY, detect, remember, rewind_target

BATCH = 8


@pytest.mark.parametrize(("loss", "grad_norm", "tokens", "recent", "factor", "diverged"), [
    (6.0, 1.3, 50, [6.1], 5.0, False),
    (2.1e7, 1.5e15, 50, [6.1], 5.0, True),                  # the jump of a learning rate that blows up
    (6.07, 0.0, 50, [6.1], 5.0, True),                      # the collapse after it: nothing left to learn from
    (6.07, 0.0, 0, [6.1], 5.0, False),                      # no loss tokens: a zero gradient is expected
    (0.0, 0.0, 50, [0.3], 5.0, False),                      # DPO's hinge past every margin: zero loss, zero grad
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


def test_rewind_target_is_the_newest_full_state_before_the_batch(tmp_path):
    states = [tmp_path / f"samples_{n}" for n in (8, 16, 24)]
    assert rewind_target(states, 24) == states[2] and rewind_target(states, 20) == states[1]
    assert rewind_target(states, 4) is None


@pytest.fixture(scope="module")
def poisoned_data(tmp_path_factory) -> Path:
    """60 short rows of one pattern and, at row 30, one long row whose labels are arbitrary tokens."""
    path = tmp_path_factory.mktemp("poisoned") / "train.jsonl"
    with path.open("w") as f:
        for index in range(61):
            input_ids = [5, 6, 7, 8] * (22 if index == 30 else 2)
            labels = [(37 * j) % 200 + 100 for j in range(len(input_ids))] if index == 30 else input_ids
            f.write(json.dumps({"input_ids": input_ids, "labels": labels, "len": len(input_ids),
                                "num_loss_counted_tokens": len(input_ids)}) + "\n")
    return path


def _args(model: Path, data: Path, out: Path, learning_rate: str, *extra: str, steps: int = 5) -> list[str]:
    return ["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out),
            "--batch-size", str(BATCH), "--max-tokens-per-gpu", "96", "--seed", "7", "--learning-rate", learning_rate,
            "--lr-scheduler", "constant_with_warmup", "--num-warmup-steps", "0", "--max-steps", str(steps),
            "--min-samples-per-checkpoint", str(BATCH), "--num-data-workers", "0", *extra]


def test_a_learning_rate_that_blows_up_stops_before_the_diverged_model_is_exported(tmp_path, chatml_model,
                                                                                    data_path):
    out = tmp_path / "run"
    result = torchrun(_args(chatml_model, data_path, out, "1e3"), warm=True)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    [line] = [line for line in output.splitlines() if "[rank0] ERROR" in line]
    assert "divergence at step 2 (samples 8..16 of the stream)" in line and "--on-divergence rewind" in line, line
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [1, 2]
    # Step 2's loss revealed the divergence: no export or full state was written after it.
    assert [p.name for p in complete_checkpoints(out / "hf_format")] == [f"samples_{BATCH}"]
    assert [p.name for p in complete_checkpoints(out / "full_state")] == [f"samples_{BATCH}"]


def test_warn_goes_on_and_never_takes_a_later_validation_as_best(tmp_path, chatml_model, data_path):
    out = tmp_path / "run"
    assert_ok(torchrun(_args(chatml_model, data_path, out, "1e3", "--on-divergence", "warn",
                             "--validation-split", "0.2", "--validation-every-n-steps", "1", "--save-best-val-loss"),
                       warm=True))
    records = read_metrics(out)
    val_losses = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val_losses) == 5 and min(val_losses[1:]) < val_losses[0], "later validations look better"
    best = json.loads((out / "hf_format" / "best" / "best_val_loss.json").read_text())
    assert best["step"] == 1, "an export after the divergence (step 2) is never the best"
    state = json.loads((complete_checkpoints(out / "full_state")[-1] / "trainer_state.json").read_text())
    assert state["diverged_at_step"] == 2


def test_non_finite_steps_in_a_row_abort_naming_every_steps_samples(tmp_path, chatml_model, data_path):
    out = tmp_path / "run"
    result = torchrun(_args(chatml_model, data_path, out, "1e30", "--max-bad-steps", "3"), warm=True)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    [line] = [line for line in output.splitlines() if "[rank0] ERROR" in line]
    assert "samples 8..16, 16..24, 24..32 of the stream" in line, line


def test_rewind_skips_the_poisoned_batch_like_a_run_resumed_without_it(tmp_path, chatml_model, poisoned_data):
    """The poisoned row lands in step 6's batch (samples 40..48, seed 7). The rewinding run must equal a run
    that stopped after step 5 and was resumed from that full state with those samples skipped."""
    rewound = tmp_path / "rewound"
    result = torchrun(_args(chatml_model, poisoned_data, rewound, "5e-2", "--on-divergence", "rewind", steps=7),
                      warm=True)
    assert_ok(result)
    output = result.stdout + result.stderr
    assert "divergence at step 6 (samples 40..48 of the stream)" in output, output[-3000:]
    assert f"rewound to {rewound / 'full_state' / 'samples_40'} (step 5)" in output

    reference = tmp_path / "reference"
    assert_ok(torchrun(_args(chatml_model, poisoned_data, reference, "5e-2", steps=5), warm=True))
    state_file = reference / "full_state" / "samples_40" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "skipped_batches": [[40, 48]]}))
    assert_ok(torchrun(_args(chatml_model, poisoned_data, reference, "5e-2", steps=7), warm=True))

    ours, theirs = read_metrics(rewound), read_metrics(reference)
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == list(range(1, 8)), "no step logged twice"
    assert [r["samples_seen"] for r in ours][4:] == [40, 56, 64]
    for a, b in zip(ours, theirs):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), a["step"]
    assert max(r["loss"] for r in ours) < 7, "no step trained on the poisoned batch"
    [ours_export], [their_export] = (complete_checkpoints(out / "hf_format")[-1:] for out in (rewound, reference))
    theirs_weights = load_file(their_export / "model.safetensors")
    for name, tensor in load_file(ours_export / "model.safetensors").items():
        torch.testing.assert_close(tensor, theirs_weights[name], rtol=0, atol=0, msg=name)
