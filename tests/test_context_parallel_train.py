"""Context parallelism through the CLI: ``--context-parallel-size N`` trains as one rank does, on CPU/gloo.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_context_parallel_train.py

One 1-rank run with a budget of 128 tokens is the reference. Every other run
has the same global batch (8 samples a step, 3 steps) with groups of N ranks
at 128 / N tokens per GPU, so each group packs exactly as the reference rank
does and the data holds a 128-token sample: 2x a GPU's budget with N = 2 and
4x with N = 4. Loss, gradient norm, loss-token counts, the validation loss
and every fp32 parameter of the final full state equal the reference's
(<= 1e-6 after 3 AdamW steps). The runs are independent, so they run side by
side: the fresh torchrun launches (4 ranks, two nodes, the SIGKILLed run) in
threads while the 1- and 2-rank runs, whose numbers are the subject, are warm
calls one after another (``fixtures/e2e.py``), as is the killed run's resume.
"""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fixtures.e2e import model_vocab_size, read_metrics, torchrun, torchrun_two_nodes, write_tokenized_jsonl
from minitrainer.setup import run as setup_run
from minitrainer.checkpoint.full_state import complete_checkpoints
from minitrainer.common import fault_injection
from minitrainer.model import context_parallel
from minitrainer.model.attention import AttentionNeeds
from minitrainer.train_config import TrainConfig

BATCH = 8
STEPS = 3
GROUP_BUDGET = 128  # tokens a group (or the reference rank) packs per minibatch; also the long sample's length
TOLERANCE = 1e-6
LR = 2e-5
"""AdamW divides each gradient element by its own running scale, so an fp32 rounding difference in a
gradient element near Adam's eps (1e-8) moves that parameter by a visible fraction of the learning rate:
at lr 1e-2 a few of 8k elements differ by 2e-5 between 1 and 2 plain data-parallel ranks (1e-4 with
context parallelism, whose attention sums in another order). At this rate that noise stays below 3e-7,
while a wrong gradient would move parameters by up to 2 x LR = 4e-5 per step, 40x the tolerance."""
EXACT = ("num_loss_counted_tokens", "batch_num_loss_counted_tokens", "num_total_tokens", "num_samples",
         "model_flops_per_token", "num_dropped_samples")
"""Metrics a context-parallel run reports exactly as the reference (counted from documents, not shards)."""


@pytest.fixture(scope="module")
def data_path(tmp_path_factory, chatml_model) -> Path:
    """23 short samples (4-48 tokens) and one of GROUP_BUDGET tokens; one epoch is the 3 steps."""
    vocab = model_vocab_size(chatml_model)
    path = write_tokenized_jsonl(tmp_path_factory.mktemp("cp_data") / "train.jsonl", num_samples=BATCH * STEPS - 1,
                                 vocab_size=vocab, seed=3)
    ids = np.random.default_rng(5).integers(0, vocab, size=GROUP_BUDGET).tolist()
    with path.open("a") as f:
        f.write(json.dumps({"input_ids": ids, "labels": [-100] * 10 + ids[10:], "len": GROUP_BUDGET,
                            "num_loss_counted_tokens": GROUP_BUDGET - 10}) + "\n")
    return path


def _args(model: Path, data: Path, out: Path, size: int, *extra: str, validate: bool = True) -> list[str]:
    validation = ("--validation-data-path", str(data), "--validation-every-n-steps", str(STEPS)) if validate else ()
    return ["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out),
            "--batch-size", str(BATCH), "--max-steps", str(STEPS), "--max-tokens-per-gpu", str(GROUP_BUDGET // size),
            "--context-parallel-size", str(size), "--seed", "7", "--learning-rate", str(LR), "--num-warmup-steps", "0",
            "--lr-scheduler", "constant", "--min-samples-per-checkpoint", "1000", "--num-data-workers", "0",
            *validation, *extra]


def _ok(results) -> None:
    for result in results if isinstance(results, list) else [results]:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, chatml_model, data_path) -> dict[str, Path]:
    """Every run of this file, side by side (the killed run's resume follows it)."""
    root = tmp_path_factory.mktemp("cp_runs")
    # The start-up self-check runs in the reference and cp2 only (it exercises the backend's path without a
    # plan); validation everywhere but in the LoRA and killed runs: each costs CPU time, not coverage.
    fast = ("--skip-objective-check",)
    lora = ("--lora-rank", "4", *fast)
    every_step = ("--min-samples-per-checkpoint", str(BATCH), *fast)
    jobs = {  # name: (context-parallel size, ranks, HYBRID_SHARD over two nodes, validate, extra flags, env)
        "reference": (1, 1, False, True, (), None),
        "cp2": (2, 2, False, True, (), None),
        "cp2x2": (2, 4, False, True, fast, None),
        "cp2x2_hybrid": (2, 4, True, True, ("--fsdp-sharding-strategy", "HYBRID_SHARD", *fast), None),
        "cp4": (4, 4, False, True, fast, None),
        "lora_reference": (1, 1, False, False, lora, None),
        "lora_cp2": (2, 2, False, False, lora, None),
        "killed_cp2": (2, 2, False, False, every_step, {fault_injection.KILL_AFTER_SAVE: str(BATCH)}),
    }

    def launch(name: str, *, warm: bool = False):
        size, ranks, hybrid, validate, extra, env = jobs[name]
        args = _args(chatml_model, data_path, root / name, size, *extra, validate=validate)
        if hybrid:
            return torchrun_two_nodes(args, nproc_per_node=ranks // 2, timeout=600)
        return torchrun(args, nproc=ranks, env=env, timeout=600, warm=warm)

    fresh = [name for name, (_, ranks, hybrid, _, _, env) in jobs.items() if ranks > 2 or hybrid or env]
    with ThreadPoolExecutor(max_workers=len(fresh)) as pool:
        launched = {name: pool.submit(launch, name) for name in fresh}
        results = {name: launch(name, warm=True) for name in jobs if name not in fresh}
        results.update({name: future.result() for name, future in launched.items()})
    killed = results.pop("killed_cp2")
    assert killed.returncode != 0, "the kill after the first full state did not happen"
    for result in results.values():
        _ok(result)
    _ok(torchrun(_args(chatml_model, data_path, root / "killed_cp2", 2, *every_step, validate=False), nproc=2,
                 timeout=600, warm=True))
    return {name: root / name for name in jobs}


def _full_state_model(out: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The fp32 parameters of the run's newest full state (DCP), by name."""
    target = tmp / f"{out.name}.pt"
    dcp_to_torch_save(str(complete_checkpoints(out / "full_state")[-1]), str(target))
    return torch.load(target, weights_only=True)["model"]


def _assert_same_run(run: Path, reference: Path, tmp: Path, *, param_tolerance: float = TOLERANCE) -> None:
    ours, theirs = read_metrics(run), read_metrics(reference)
    train = [r for r in ours if "loss" in r]
    train_ref = [r for r in theirs if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for a, b in zip(train, train_ref, strict=True):
        for key in ("loss", "grad_norm"):
            np.testing.assert_allclose(a[key], b[key], rtol=TOLERANCE, err_msg=f"{run.name} step {a['step']} {key}")
        assert {k: a.get(k) for k in EXACT} == {k: b.get(k) for k in EXACT}, run.name
    validations, validations_ref = [r for r in ours if "val_loss" in r], [r for r in theirs if "val_loss" in r]
    assert len(validations) == len(validations_ref)
    for val, val_ref in zip(validations, validations_ref):
        np.testing.assert_allclose(val["val_loss"], val_ref["val_loss"], rtol=TOLERANCE, err_msg=run.name)
        assert val["val_num_loss_counted_tokens"] == val_ref["val_num_loss_counted_tokens"]
    params, params_ref = _full_state_model(run, tmp), _full_state_model(reference, tmp)
    assert params.keys() == params_ref.keys()
    for name, tensor in params_ref.items():
        torch.testing.assert_close(params[name], tensor, rtol=param_tolerance, atol=param_tolerance,
                                   msg=f"{run.name} {name}")


@pytest.mark.parametrize("name", ["cp2", "cp2x2", "cp2x2_hybrid", "cp4"])
def test_context_parallel_trains_as_one_rank(runs, name, tmp_path):
    """N=2 on 2 ranks, N=2 x 2 data ranks (FULL_SHARD and two-node HYBRID_SHARD), N=4 on 4 ranks: the
    128-token sample is 4x the cp4 run's --max-tokens-per-gpu 32, and it trains with the 1-rank loss."""
    _assert_same_run(runs[name], runs["reference"], tmp_path)
    if name in ("cp2", "cp4"):  # one data rank, as the reference: the same minibatches
        assert ([r["grad_accum"] for r in read_metrics(runs[name]) if "loss" in r]
                == [r["grad_accum"] for r in read_metrics(runs["reference"]) if "loss" in r])
    params = json.loads((runs[name] / "training_params.json").read_text())
    assert params["context_parallel_size"] == int(name[2]) and params["context_parallel_inner"] == "reference_varlen"


def test_context_parallel_with_lora(runs, tmp_path):
    # lora_A's gradient is proportional to lora_B, which starts at 0 and is about LR after one step: step 2's
    # gradients of A sit near Adam's eps, where rounding noise is amplified most (one element of 256 at 3e-6).
    _assert_same_run(runs["lora_cp2"], runs["lora_reference"], tmp_path, param_tolerance=1e-5)


def test_killed_and_resumed_equals_the_uninterrupted_run_and_exports_match_one_rank(runs):
    resumed, uninterrupted = read_metrics(runs["killed_cp2"]), read_metrics(runs["cp2"])
    assert [r["step"] for r in resumed if "loss" in r] == list(range(1, STEPS + 1))
    assert ([(r["loss"], r["grad_norm"]) for r in resumed if "loss" in r]
            == [(r["loss"], r["grad_norm"]) for r in uninterrupted if "loss" in r])
    exports = {name: load_file(complete_checkpoints(runs[name] / "hf_format")[-1] / "model.safetensors")
               for name in ("killed_cp2", "cp2", "reference")}
    for name, tensor in exports["reference"].items():
        assert torch.equal(exports["killed_cp2"][name], exports["cp2"][name]), name
        # bf16 exports of fp32 weights equal to 1e-6: at most one bf16 rounding step apart.
        torch.testing.assert_close(exports["cp2"][name].float(), tensor.float(), rtol=1e-2, atol=1e-3, msg=name)


def test_a_sample_longer_than_the_group_is_refused_at_start_up(tmp_path):
    """Without context parallelism such a sample is dropped and counted; with it, the run refuses to start."""
    config = TrainConfig(model_name_or_path="m", data_path="d", output_dir=str(tmp_path), min_samples_per_checkpoint=1, context_parallel_size=2,
                         max_tokens_per_gpu=32)
    rows = type("Rows", (), {"lengths": np.array([10, 64, 128, 40]), "__len__": lambda self: 4})()
    assert setup_run._budget_error(config, rows, "d.jsonl") == (
        "--context-parallel-size 2 x --max-tokens-per-gpu 32 holds 64 tokens per sample, but row 2 of d.jsonl "
        "has 128: it needs --context-parallel-size 4 or --max-tokens-per-gpu 64")
    assert setup_run._budget_error(dataclasses.replace(config, max_tokens_per_gpu=64), rows, "d.jsonl") is None
    assert setup_run._budget_error(dataclasses.replace(config, context_parallel_size=1), rows, "d.jsonl") is None


def test_what_context_parallelism_refuses_is_one_line(tmp_path):
    needs = AttentionNeeds(model_class="M", supports_sdpa=True, supports_flash=True, softcap=None, sinks=False,
                           sliding_window=None)
    assert context_parallel.refusal(2, world_size=4, needs=needs, num_recurrent_mixers=0, router_loss=False) is None
    assert "world size divisible by 4, got 6" in context_parallel.refusal(
        4, world_size=6, needs=needs, num_recurrent_mixers=0, router_loss=False)
    for changed, mixers, router, expected in (({"sliding_window": 64}, 0, False, "sliding-window"),
                                              ({"softcap": 50.0}, 0, False, "softcapping"),
                                              ({"sinks": True}, 0, False, "sinks"),
                                              ({}, 3, False, "3 linear-attention/SSM layers"),
                                              ({}, 0, True, "router loss")):
        line = context_parallel.refusal(2, world_size=2, needs=dataclasses.replace(needs, **changed),
                                        num_recurrent_mixers=mixers, router_loss=router)
        assert line.startswith("--context-parallel-size 2 does not support") and expected in line
        assert "\n" not in line
    base = {"output_dir": str(tmp_path), "model_name_or_path": "m", "data_path": "d", "context_parallel_size": 2}
    for extra, expected in (({"compile": True}, "--compile"),
                            ({"lora_rank": 4, "lora_quantize_data_type": "nf4"}, "QLoRA"),
                            ({"max_tokens_per_gpu": "auto"}, "--max-tokens-per-gpu auto"),
                            ({"context_parallel_size": 0}, "at least 1")):
        with pytest.raises(ValueError, match="--context-parallel-size") as err:
            TrainConfig(**{**base, **extra})
        assert expected in str(err.value)
