"""A short CPU run's numbers, pinned: restructuring the trainer must not move them.

    .venv/bin/python -m pytest -q tests/test_pinned_run.py

Two gloo ranks, several packed minibatches per step, warmup then cosine decay,
gradient clipping, a validation split checked every two steps, Hugging Face
exports and full states on a cadence, an epoch boundary: every part of the
loop takes part. The values were recorded from the trainer before issue 24
split ``train.py``; the restructured trainer reproduced them bit for bit (the
metrics lines without their timings and every checkpoint file's bytes). The
pins carry a relative tolerance of 1e-6 rather than bit equality so that a
machine with other vector instructions does not fail them; any change of the
step's arithmetic (scaling, clipping, schedule, skip rules, sample order) moves
them by far more.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fixtures.e2e import model_vocab_size, read_metrics, torchrun, write_tokenized_jsonl
from minitrainer.tools.tiny_model import build_tiny_model

# (step, loss, grad_norm, lr) of each optimizer step (lr: the rate its update used, issue 54), then (step, val_loss) of each validation.
PINNED_STEPS = [
    (1, 6.071906340037677, 1.1901334524154663, 0.0),
    (2, 6.082779875898783, 1.398505449295044, 0.0025),
    (3, 6.1021001906622026, 1.740736484527588, 0.005),
    (4, 6.095651154470916, 1.3118926286697388, 0.00375),
    (5, 5.6852712107228704, 1.5384103059768677, 0.0012500000000000007),
]
PINNED_VALIDATIONS = [(2, 6.124430847167969), (4, 6.143282117341694), (5, 6.146391738088507)]
PINNED_LOSS_TOKENS = [141, 113, 63, 101, 91]
# sum, sum of squares and a position-weighted sum of every weight of the final export, in name order.
PINNED_WEIGHTS = (307.6095230933279, 376.1000975416119, 1249.2724334262311)
REL = 1e-6


@pytest.fixture(scope="module")
def pinned_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pinned")
    model = build_tiny_model("chatml", root / "model")
    vocab = model_vocab_size(model)
    data = write_tokenized_jsonl(root / "train.jsonl", num_samples=40, vocab_size=vocab, seed=3)
    out = root / "out"
    result = torchrun(["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out),
                       "--batch-size", "8", "--max-tokens-per-gpu", "64", "--seed", "11",
                       "--learning-rate", "5e-3", "--num-warmup-steps", "2", "--lr-scheduler", "cosine",
                       "--max-steps", "5", "--max-grad-norm", "0.5", "--min-samples-per-checkpoint", "16",
                       "--validation-split", "0.2", "--validation-every-n-steps", "2",
                       "--num-data-workers", "0", "--no-resume"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return out


def test_losses_grad_norms_and_schedule_are_pinned(pinned_run):
    lines = read_metrics(pinned_run)
    steps = [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in lines if "loss" in r]
    assert [s[0] for s in steps] == [p[0] for p in PINNED_STEPS]
    for got, pinned in zip(steps, PINNED_STEPS):
        assert got[1:] == pytest.approx(pinned[1:], rel=REL, abs=1e-12), f"step {got[0]}"
    assert [r["num_loss_counted_tokens"] for r in lines if "loss" in r] == PINNED_LOSS_TOKENS
    validations = [(r["step"], r["val_loss"]) for r in lines if "val_loss" in r]
    assert [v[0] for v in validations] == [p[0] for p in PINNED_VALIDATIONS]
    assert [v[1] for v in validations] == pytest.approx([p[1] for p in PINNED_VALIDATIONS], rel=REL)


def test_checkpoint_cadence_and_final_weights_are_pinned(pinned_run):
    assert sorted(p.name for p in (pinned_run / "hf_format").iterdir()) == ["samples_16", "samples_32",
                                                                            "samples_40"]
    assert sorted(p.name for p in (pinned_run / "full_state").iterdir()) == ["samples_32", "samples_40"]
    weights = load_file(pinned_run / "hf_format" / "samples_40" / "model.safetensors")
    flat = torch.cat([weights[name].double().flatten() for name in sorted(weights)])
    position_weight = torch.arange(flat.numel(), dtype=torch.float64) % 7 + 1
    fingerprint = (flat.sum().item(), (flat * flat).sum().item(), (flat * position_weight).sum().item())
    assert fingerprint == pytest.approx(PINNED_WEIGHTS, rel=REL)
