"""``--optimizer``: fused AdamW's on-device skip, and the 8-bit AdamW (torchao) training and resuming exactly.

    .venv/bin/python -m pytest -q tests/test_optimizers.py      # ~5 min on 2 loaded CPU cores

The resume test runs train.py on 2 gloo CPU ranks (the tiny model): a fresh ``torchrun`` SIGKILLed after a
full-state save, then the uninterrupted run, the resume and a refused resume as warm calls (``fixtures/e2e.py``):
the resumed run's losses and final weights equal the uninterrupted run's.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fixtures.e2e import assert_ok, model_vocab_size, read_metrics, torchrun, write_tokenized_jsonl
from minitrainer.checkpoint.full_state import complete_checkpoints
from minitrainer.optim.optimizers import build_optimizer, skips_on_device, step_unless

BATCH = 12
STEPS = 6
CHECKPOINT_EVERY = 3 * BATCH


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(128, 64, generator=gen)), torch.nn.Parameter(torch.randn(64, generator=gen))]


@pytest.mark.parametrize("found_inf", [0.0, 1.0])
def test_fused_adamw_skips_a_non_finite_step_on_the_device(found_inf):
    params = _params()
    optimizer = torch.optim.AdamW([{"params": params, "weight_decay": 0.1}], lr=1e-2, fused=True)
    reference = _params()
    plain = torch.optim.AdamW([{"params": reference, "weight_decay": 0.1}], lr=1e-2, fused=True)
    assert skips_on_device(optimizer)
    for p, q in zip(params, reference):
        p.grad = torch.ones_like(p)
        q.grad = torch.ones_like(q)
    plain.step()
    optimizer.step()  # a first, normal step: moments exist
    before = [p.detach().clone() for p in params]
    moments = [optimizer.state[p]["exp_avg"].clone() for p in params]
    step_unless(optimizer, torch.tensor(found_inf))
    if found_inf:
        for p, b, m in zip(params, before, moments):
            torch.testing.assert_close(p.detach(), b, rtol=0, atol=0)
            torch.testing.assert_close(optimizer.state[p]["exp_avg"], m, rtol=0, atol=0)
        assert optimizer.state[params[0]]["step"].item() == 1
    else:
        plain.step()
        for p, q in zip(params, reference):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)
    assert not hasattr(optimizer, "found_inf")


def test_adamw_on_cpu_is_unchanged_and_cannot_skip_by_itself():
    params = _params()
    optimizer = build_optimizer("adamw", [{"params": params, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.95),
                                device=torch.device("cpu"))
    assert optimizer.defaults["fused"] is None and not skips_on_device(optimizer)


def test_8bit_adamw_keeps_8bit_moments():
    pytest.importorskip("torchao", reason="the 8-bit AdamW needs torchao (requirements-dev.txt)")
    params = _params()
    optimizer = build_optimizer("adamw_8bit", [{"params": params, "weight_decay": 0.0}], lr=1e-3,
                                betas=(0.9, 0.95), device=torch.device("cpu"))
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    big = optimizer.state[params[0]]["exp_avg"]
    assert type(big).__name__ == "OptimState8bit" and big.codes.dtype == torch.uint8
    assert not skips_on_device(optimizer)


@pytest.fixture(scope="module")
def data_path(tmp_path_factory, chatml_model) -> Path:
    return write_tokenized_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", num_samples=60,
                                 vocab_size=model_vocab_size(chatml_model), seed=3)


def _args(model: Path, data: Path, out: Path) -> list[str]:
    return ["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out),
            "--batch-size", str(BATCH), "--max-tokens-per-gpu", "96", "--seed", "11",
            "--learning-rate", "1e-3", "--num-warmup-steps", "2", "--lr-scheduler", "cosine",
            "--max-steps", str(STEPS), "--min-samples-per-checkpoint", str(CHECKPOINT_EVERY),
            "--num-data-workers", "0", "--optimizer", "adamw_8bit"]


def test_8bit_adamw_killed_and_resumed_equals_uninterrupted(tmp_path, chatml_model, data_path):
    pytest.importorskip("torchao", reason="the 8-bit AdamW needs torchao (requirements-dev.txt)")
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert_ok(torchrun(_args(chatml_model, data_path, whole), timeout=900, warm=True))
    killed = torchrun(_args(chatml_model, data_path, resumed), timeout=900,
                      env={"MINI_TRAINER_TEST_KILL_AFTER_SAVE": str(CHECKPOINT_EVERY)})
    assert killed.returncode != 0
    assert [p.name for p in complete_checkpoints(resumed / "full_state")] == [f"samples_{CHECKPOINT_EVERY}"]
    rerun = torchrun(_args(chatml_model, data_path, resumed), timeout=900, warm=True)
    assert_ok(rerun)
    assert "resumed from" in rerun.stderr
    a, b = read_metrics(whole), read_metrics(resumed)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    for ra, rb in zip(a, b):
        for key in ("loss", "grad_norm", "lr"):
            assert math.isclose(rb[key], ra[key], rel_tol=1e-6, abs_tol=1e-12), (ra["step"], key, ra[key], rb[key])
    final_a = load_file(complete_checkpoints(whole / "hf_format")[-1] / "model.safetensors")
    final_b = load_file(complete_checkpoints(resumed / "hf_format")[-1] / "model.safetensors")
    for name in final_a:
        torch.testing.assert_close(final_b[name], final_a[name], rtol=0, atol=0, msg=name)
    # A resume with another optimizer is refused before the model loads (its states would not fit).
    other = torchrun([*_args(chatml_model, data_path, resumed)[:-2], "--max-steps", str(STEPS + 1)], timeout=300,
                     warm=True)
    assert other.returncode != 0 and "optimizer" in other.stderr
