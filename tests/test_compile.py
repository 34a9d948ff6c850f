"""``--compile``: compiled blocks train like eager ones, never recompile for a new row length, resume exactly.

    .venv/bin/python -m pytest -q tests/test_compile.py      # ~6-10 min on 2 loaded CPU cores

Real fresh ``torchrun`` runs of train.py for every compiled run (a compile is
process-wide), 2 gloo CPU processes, inductor's C++ backend, on the tiny 2-block
model; the eager reference is a warm 2-rank run (``fixtures/warm_jobs.py``). Packed rows change length every step; the
runs are logged with ``TORCH_LOGS=recompiles``, which prints one "Recompiling
function" line per recompilation, and none may appear. The start-up
self-check is skipped: its no-grad and unpacked forwards are further compiled
variants (minutes on a loaded CPU) and it is exercised eagerly elsewhere.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fixtures.e2e import assert_ok, model_vocab_size, read_metrics, torchrun, write_tokenized_jsonl
from minitrainer.checkpoint.full_state import complete_checkpoints
from minitrainer.setup.model import compile_refusal

BATCH = 12
STEPS = 6
CHECKPOINT_EVERY = 3 * BATCH
RECOMPILE_LOGS = {"TORCH_LOGS": "recompiles"}


@pytest.fixture(scope="module")
def data_path(tmp_path_factory, chatml_model) -> Path:
    vocab = model_vocab_size(chatml_model)
    return write_tokenized_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", num_samples=60,
                                 vocab_size=vocab, seed=3)


def _args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out),
            "--batch-size", str(BATCH), "--max-tokens-per-gpu", "96", "--seed", "11",
            "--learning-rate", "1e-3", "--num-warmup-steps", "2", "--lr-scheduler", "cosine",
            "--max-steps", str(STEPS), "--min-samples-per-checkpoint", str(CHECKPOINT_EVERY),
            "--num-data-workers", "0", "--skip-objective-check", *extra]


def _recompiles(result) -> int:
    return (result.stdout + result.stderr).count("Recompiling function")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, chatml_model, data_path) -> tuple[Path, int]:
    out = tmp_path_factory.mktemp("compiled")
    result = torchrun(_args(chatml_model, data_path, out, "--compile"), env=RECOMPILE_LOGS, timeout=900)
    assert_ok(result)
    assert "torch.compile: 2 decoder blocks" in result.stderr
    return out, _recompiles(result)


def test_compiled_losses_equal_eager_without_a_recompile_per_length(tmp_path, chatml_model, data_path, compiled):
    out, recompiles = compiled
    eager = tmp_path / "eager"
    assert_ok(torchrun(_args(chatml_model, data_path, eager), warm=True))  # the reference's numbers only
    a, b = read_metrics(eager), read_metrics(out)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    lengths = {r["num_total_tokens"] for r in b}
    assert len(lengths) == STEPS, f"every step should pack rows of another length, got {lengths}"
    assert recompiles == 0, "a new packed length recompiled the blocks"
    # fp32 on both sides; inductor fuses and reorders reductions (RMSNorm, softmax, bias-free matmul
    # epilogues), so the last bits move, and 6 AdamW steps at lr 1e-3 carry them on. Seen: <= 1.1e-7.
    for ra, rb in zip(a, b):
        for key in ("loss", "grad_norm"):
            assert math.isclose(rb[key], ra[key], rel_tol=1e-5), (ra["step"], key, ra[key], rb[key])
        assert ra["num_loss_counted_tokens"] == rb["num_loss_counted_tokens"]


def test_compiled_run_killed_and_resumed_equals_uninterrupted(tmp_path, chatml_model, data_path, compiled):
    uninterrupted, _ = compiled
    out = tmp_path / "resumed"
    killed = torchrun(_args(chatml_model, data_path, out, "--compile"), timeout=900,
                      env={"MINI_TRAINER_TEST_KILL_AFTER_SAVE": str(CHECKPOINT_EVERY)})
    assert killed.returncode != 0
    assert [p.name for p in complete_checkpoints(out / "full_state")] == [f"samples_{CHECKPOINT_EVERY}"]
    resumed = torchrun(_args(chatml_model, data_path, out, "--compile"), env=RECOMPILE_LOGS, timeout=900)
    assert_ok(resumed)
    assert "resumed from" in resumed.stderr
    assert _recompiles(resumed) == 0
    # One dynamic graph whatever length came first: the resumed run runs the same kernels.
    a, b = read_metrics(uninterrupted), read_metrics(out)
    assert [r["step"] for r in b] == [r["step"] for r in a]
    for ra, rb in zip(a, b):
        for key in ("loss", "grad_norm", "lr"):
            assert math.isclose(rb[key], ra[key], rel_tol=1e-6, abs_tol=1e-12), (ra["step"], key)
    final_a = load_file(complete_checkpoints(uninterrupted / "hf_format")[-1] / "model.safetensors")
    final_b = load_file(complete_checkpoints(out / "hf_format")[-1] / "model.safetensors")
    for name in final_a:
        torch.testing.assert_close(final_b[name], final_a[name], rtol=0, atol=0, msg=name)


def test_compile_without_a_cpp_compiler_is_refused_in_one_line():
    from torch._inductor import config

    assert compile_refusal("cpu") is None  # g++ is installed here
    with config.patch({"cpp.cxx": ("no-such-c++-compiler",)}):
        error = compile_refusal("cpu")
    assert error is not None and error.startswith("--compile: inductor's CPU backend needs a C++ compiler")
    assert "\n" not in error


COMPILE_LIGER_SCRIPT = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM
from minitrainer.model.attention import model_inputs
from minitrainer.model.loss import CausalLMWithLoss, find_decoder_blocks, make_liger_fused_loss
from minitrainer.model.recomputation import set_policy
from minitrainer.data.sampler import collate_minibatch
from minitrainer.setup.model import apply_liger_kernels, compile_blocks
torch.manual_seed(0)
gen = torch.Generator().manual_seed(1)
samples = []
for n in (9, 17, 5):
    ids = torch.randint(0, int(sys.argv[2]), (n,), generator=gen)
    labels = ids.clone(); labels[:3] = -100
    samples.append((ids.numpy(), labels.numpy()))
minibatch = collate_minibatch(samples)
results = {}
for compiled in (False, True):
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32, attn_implementation="sdpa")
    applied = apply_liger_kernels(model, device_type="cuda", compile=compiled) if compiled else None
    set_policy(model, "full")
    if compiled:
        compile_blocks(find_decoder_blocks(model), device_type="cpu")
    wrapper = CausalLMWithLoss(model)
    wrapper.liger_loss = make_liger_fused_loss(wrapper.logit_transform)  # the GPU path, on CPU via the interpreter
    wrapper.train()
    loss = wrapper(**model_inputs(minibatch, "sdpa", torch.device("cpu")))
    loss.backward()
    results[str(compiled)] = {"loss": loss.item(), "liger_blocks": applied,
                              "grads": {n: p.grad.flatten().tolist() for n, p in wrapper.named_parameters()}}
print("RESULTS" + json.dumps(results))
"""


def test_compile_with_liger_keeps_the_fused_loss_and_equals_eager(chatml_model):
    """``--compile --use-liger-kernels``: compiled blocks (Liger's block kernels left to inductor, full
    recomputation) under Liger's fused linear cross-entropy give eager's loss and gradients. Liger runs on
    CPU tensors under Triton's interpreter, in a subprocess that sets it before triton is imported."""
    import json
    import os
    import subprocess
    import sys

    from fixtures.e2e import ROOT

    pytest.importorskip("liger_kernel")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-c", COMPILE_LIGER_SCRIPT, str(chatml_model),
                             str(model_vocab_size(chatml_model))], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    [line] = [ln for ln in result.stdout.splitlines() if ln.startswith("RESULTS")]
    eager, compiled = json.loads(line.removeprefix("RESULTS")).values()
    assert compiled["liger_blocks"] is False  # under compile only the loss is Liger's
    # inductor fuses and reorders fp32 reductions (test above): the last bits move.
    assert math.isclose(compiled["loss"], eager["loss"], rel_tol=1e-5)
    for name, grad in eager["grads"].items():
        torch.testing.assert_close(torch.tensor(compiled["grads"][name]), torch.tensor(grad), rtol=1e-4, atol=1e-6,
                                   msg=name)
