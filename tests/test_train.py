"""End-to-end training tests: 2 gloo CPU ranks under torchrun, tiny local model.

    .venv/bin/python -m pytest -q tests/test_train.py

The invariants: the logged loss of a packed, sharded, accumulated step equals
the per-token mean computed unpacked, sample by sample, on one process; so do
the gradient norm and the updated weights; the checkpoint reloads with
transformers; stop conditions, sharding strategies and bad inputs behave.

The runs' numbers and refusals are the subject here, so they are warm runs (``fixtures/warm_jobs.py``: real
ranks, a real gloo group, bit for bit a fresh run's); only the two-node job is a fresh pair of torchruns.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from fixtures.e2e import (assert_ok, model_vocab_size, read_metrics, torchrun, torchrun_two_nodes, unpacked_loss_sum,
                          write_tokenized_jsonl)
from minitrainer.common.cli import parse_config
from minitrainer.data.sampler import InfiniteSampler, load_tokenized_dataset
from minitrainer.train_config import TrainConfig

BATCH = 12
BUDGET = 64  # tokens per rank per minibatch: forces several minibatches for 12 samples of up to 48 tokens
SEED = 7
LR = 1e-2


@pytest.fixture(scope="module")
def data_path(tmp_path_factory, chatml_model) -> Path:
    vocab = model_vocab_size(chatml_model)
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    return write_tokenized_jsonl(path, num_samples=40, vocab_size=vocab, seed=1)


def _args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out),
            "--batch-size", str(BATCH), "--max-tokens-per-gpu", str(BUDGET), "--seed", str(SEED),
            "--learning-rate", str(LR), "--num-warmup-steps", "0", "--lr-scheduler", "constant",
            "--num-data-workers", "0", *extra]


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory, chatml_model, data_path) -> Path:
    out = tmp_path_factory.mktemp("one_step")
    assert_ok(torchrun(_args(chatml_model, data_path, out, "--max-steps", "1", "--max-grad-norm", "0"), warm=True))
    return out


def _reference_step(model_dir: Path, data_path: Path):
    """Unpacked, unsharded, single-process loss, grad norm and AdamW update of step 1."""
    dataset = load_tokenized_dataset(str(data_path))
    indices = InfiniteSampler(len(dataset), SEED).take(BATCH)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loss_sum, num_tokens = unpacked_loss_sum(
        model, [dataset.sample(int(index)) for index in indices if dataset.lengths[index] <= BUDGET])
    loss = loss_sum / num_tokens
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())).item()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    optimizer.step()
    return loss.item(), grad_norm, {k: v.detach() for k, v in model.state_dict().items()}


def test_packed_sharded_step_equals_unpacked_reference(one_step_run, chatml_model, data_path):
    [record] = read_metrics(one_step_run)
    ref_loss, ref_grad_norm, ref_state = _reference_step(chatml_model, data_path)
    assert record["grad_accum"] >= 2, "the budget should force gradient accumulation"
    assert record["loss"] == pytest.approx(ref_loss, rel=1e-5)
    # The original's meaning: the loss backward saw, per minibatch; loss_backward is the whole step's.
    assert record["avg_loss_backward"] == pytest.approx(ref_loss / record["grad_accum"], rel=1e-5)
    assert record["loss_backward"] == pytest.approx(ref_loss, rel=1e-5)
    assert record["grad_norm"] == pytest.approx(ref_grad_norm, rel=1e-4)
    [checkpoint] = (one_step_run / "hf_format").iterdir()
    saved = load_file(checkpoint / "model.safetensors")
    for name, tensor in saved.items():
        assert tensor.dtype == torch.bfloat16
        expected = ref_state[name].to(torch.bfloat16).float()
        # bf16 export: equal up to one rounding step; a wrong update direction is off by ~2*LR.
        torch.testing.assert_close(tensor.float(), expected, atol=4e-3, rtol=1e-2, msg=name)


def test_checkpoint_round_trip_and_artifacts(one_step_run, chatml_model):
    params = json.loads((one_step_run / "training_params.json").read_text())
    assert params["world_size"] == 2 and params["batch_size"] == BATCH and "torch_version" in params
    folders = sorted(p.name for p in (one_step_run / "hf_format").iterdir())
    assert folders == [f"samples_{BATCH}"]
    checkpoint = one_step_run / "hf_format" / folders[0]
    names = {p.name for p in checkpoint.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    assert not any(name.endswith(".tmp") for name in names)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert model.config.use_cache and tokenizer.eos_token == "<|im_end|>"
    saved = load_file(checkpoint / "model.safetensors")
    for name, param in model.state_dict().items():
        torch.testing.assert_close(param.to(torch.bfloat16), saved[name], msg=name)


def test_metrics_line_has_every_documented_key(one_step_run):
    [record] = read_metrics(one_step_run)
    keys = {"step", "lr", "grad_norm", "loss", "avg_loss_backward", "num_samples", "num_loss_counted_tokens",
            "batch_num_loss_counted_tokens", "num_total_tokens", "grad_accum", "avg_time_per_minibatch",
            "time_per_batch", "tokens_per_second", "total_samples_accumulated", "samples_per_second",
            "peak_memory_usage_GB", "timestamp", "epoch"}
    assert keys <= set(record)
    assert record["num_loss_counted_tokens"] == record["batch_num_loss_counted_tokens"] > 0
    assert isinstance(record["num_loss_counted_tokens"], int)
    assert 0 < record["avg_time_per_minibatch"] * record["grad_accum"] < record["time_per_batch"]
    assert record["step"] == 1 and record["lr"] == pytest.approx(LR)
    # Speed keys: MFU is null on CPU rather than guessed; FLOPs come from the real sample lengths.
    assert record["mfu"] is None
    assert record["model_flops_per_token"] > 0 and record["model_tflops_per_second_per_gpu"] > 0
    assert record["loss_tokens_per_second"] == pytest.approx(
        record["num_loss_counted_tokens"] / record["time_per_batch"])
    assert record["loss_tokens_per_second_per_gpu"] == pytest.approx(record["loss_tokens_per_second"] / 2)


def test_stop_conditions_and_checkpoint_cadence(tmp_path, chatml_model, data_path):
    out = tmp_path / "epochs"
    # 40 samples, 12 per step: one epoch ends after ceil(40/12) = 4 steps.
    assert_ok(torchrun(_args(chatml_model, data_path, out, "--num-epochs", "1", "--min-samples-per-checkpoint", "20"),
                       warm=True))
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[-1]["samples_seen"] == 48
    folders = sorted(int(p.name.removeprefix("samples_")) for p in (out / "hf_format").iterdir())
    assert folders == [24, 48]


def test_strategies_and_deferred_reduction_in_one_scenario(tmp_path, chatml_model, data_path):
    """The same seed and config give identical losses; every sharding strategy trains as FULL_SHARD (a
    reduction every minibatch) does, losses and weights: NO_SHARD skips reductions until a step's last
    minibatch, two-node HYBRID_SHARD skips the cross-node all-reduce until then."""
    runs = {}
    for name, strategy, two_nodes in (
            ("FULL_SHARD", "FULL_SHARD", False), ("FULL_SHARD_again", "FULL_SHARD", False),
            ("SHARD_GRAD_OP", "SHARD_GRAD_OP", False), ("HYBRID_SHARD", "HYBRID_SHARD", False),
            ("NO_SHARD", "NO_SHARD", False), ("HYBRID_SHARD_two_nodes", "HYBRID_SHARD", True)):
        out = tmp_path / name
        # No --min-samples-per-checkpoint: its default, 0, writes the final export alone.
        args = _args(chatml_model, data_path, out, "--max-steps", "3", "--fsdp-sharding-strategy", strategy)
        for result in (torchrun_two_nodes(args) if two_nodes else [torchrun(args, warm=True)]):
            assert_ok(result)
        records = read_metrics(out)
        assert min(r["grad_accum"] for r in records) >= 2
        [export] = (out / "hf_format").iterdir()
        runs[name] = ([r["loss"] for r in records], load_file(export / "model.safetensors"))
    reference_losses, reference_weights = runs["FULL_SHARD"]
    assert runs["FULL_SHARD_again"][0] == reference_losses, "same seed and config must give identical losses"
    for name, (losses, weights) in runs.items():
        np.testing.assert_allclose(losses, reference_losses, rtol=1e-5, err_msg=name)
        for key, tensor in reference_weights.items():
            # bf16 exports of fp32 weights that may differ in the last bits of a reduction order.
            torch.testing.assert_close(weights[key].float(), tensor.float(), rtol=1e-2, atol=1e-3, msg=f"{name} {key}")


@pytest.mark.parametrize("case", ["missing_data", "bad_row", "bad_model", "budget_too_small", "unwritable"])
def test_bad_input_fails_fast_on_every_rank(tmp_path, chatml_model, data_path, case):
    model, data, out = chatml_model, data_path, tmp_path / "out"
    extra: list[str] = []
    expected = {"missing_data": "no such file", "bad_row": "input_ids", "bad_model": "cannot load a model",
                "budget_too_small": "below every sample", "unwritable": "not writable"}[case]
    if case == "missing_data":
        data = tmp_path / "nope.jsonl"
    elif case == "bad_row":
        data = tmp_path / "broken.jsonl"
        data.write_text(data_path.read_text().splitlines()[0] + "\n" + json.dumps({"labels": [1, 2]}) + "\n")
    elif case == "bad_model":
        model = tmp_path / "not_a_model"
        model.mkdir()
    elif case == "budget_too_small":
        extra = ["--max-tokens-per-gpu", "2"]
    elif case == "unwritable":
        blocker = tmp_path / "file"
        blocker.write_text("x")
        out = blocker / "sub"
    args = _args(model, data, out)
    args += extra
    result = torchrun(args, timeout=120, warm=True)
    assert result.returncode != 0 and all(result.rank_codes), result.rank_codes
    assert expected in (result.stdout + result.stderr)


def test_decaying_scheduler_without_stop_condition_is_refused():
    from minitrainer.train import TrainConfig

    with pytest.raises(ValueError, match="--max-steps"):
        TrainConfig(model_name_or_path="m", data_path="d", output_dir="x", min_samples_per_checkpoint=1, lr_scheduler="cosine")
    TrainConfig(model_name_or_path="m", data_path="d", output_dir="x", min_samples_per_checkpoint=1, lr_scheduler="cosine", max_samples=100)


@pytest.mark.parametrize("flag,value", [("learning_rate", float("nan")), ("learning_rate", float("inf")),
                                        ("learning_rate", -1e-5), ("weight_decay", float("nan")),
                                        ("max_grad_norm", float("inf"))])
def test_non_finite_or_negative_optimizer_numbers_are_refused_with_the_others(flag, value):
    """``nan < 0`` is False: a NaN learning rate passed the check and failed inside torch after the model loaded."""
    from minitrainer.train import TrainConfig

    with pytest.raises(ValueError) as err:
        TrainConfig(model_name_or_path="m", data_path="d", output_dir="x", min_samples_per_checkpoint=-1, **{flag: value})
    problems = str(err.value).splitlines()[1:]
    assert f"  - --{flag.replace('_', '-')} must be a finite number >= 0, got {value}" in problems
    assert any("--min-samples-per-checkpoint" in line for line in problems), "reported with the other problems"


def test_learning_rate_nan_is_one_usage_line_on_the_command_line(tmp_path, capsys):
    """A NaN learning rate is one usage line, status 2, from the parse ``train.main`` runs (here in-process; the
    whole output of a refused ``python train.py`` is tests/test_config_files.py's)."""
    with pytest.raises(SystemExit) as stop:
        parse_config(TrainConfig, ["--output-dir", str(tmp_path), "--data-path", "x", "--model-name-or-path", "x",
                                   "--min-samples-per-checkpoint", "8", "--learning-rate", "nan"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err
    assert "--learning-rate must be a finite number >= 0, got nan" in err


@pytest.mark.parametrize("name", ["cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay"])
def test_every_offered_scheduler_builds_and_reaches_its_floor(name):
    from minitrainer.setup.schedule import build_scheduler
    from minitrainer.train import TrainConfig

    config = TrainConfig(model_name_or_path="m", data_path="d", output_dir="x", min_samples_per_checkpoint=1, lr_scheduler=name, max_steps=20,
                         num_warmup_steps=2, learning_rate=1.0, min_lr_ratio=0.25, decay_fraction=0.5)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=config.learning_rate)
    scheduler = build_scheduler(config, optimizer, 20)
    lrs = []
    for _ in range(20):
        optimizer.step()
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    assert max(lrs) == pytest.approx(1.0)
    assert min(lrs) >= 0.25 - 1e-9 and lrs[-1] == pytest.approx(0.25, abs=0.01)
    if name == "warmup_stable_decay":
        assert lrs[2:9] == [pytest.approx(1.0)] * 7, "warmup 2, then constant until the last 10 steps decay"
    with pytest.raises(ValueError, match="--min-lr-ratio"):
        TrainConfig(model_name_or_path="m", data_path="d", output_dir="x", min_samples_per_checkpoint=1, lr_scheduler=name, max_steps=20, min_lr_ratio=2)


def test_impossible_schedule_fails_before_the_model_loads(tmp_path, chatml_model, data_path):
    result = torchrun(_args(chatml_model, data_path, tmp_path / "out", "--lr-scheduler", "warmup_stable_decay",
                            "--max-steps", "4", "--num-warmup-steps", "4"), timeout=120, warm=True)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "exceed the run's 4 steps" in output
    assert "sharded with" not in output, "the model must not have been loaded"


def test_batch_without_loss_tokens_does_not_move_the_weights(tmp_path, chatml_model):
    """All labels masked: zero gradients, and AdamW's weight decay must not run either."""
    vocab = model_vocab_size(chatml_model)
    data = tmp_path / "masked.jsonl"
    rng = np.random.default_rng(0)
    with data.open("w") as f:
        for _ in range(24):
            ids = rng.integers(0, vocab, size=int(rng.integers(4, 30))).tolist()
            f.write(json.dumps({"input_ids": ids, "labels": [-100] * len(ids), "len": len(ids),
                                "num_loss_counted_tokens": 0}) + "\n")
    out = tmp_path / "out"
    assert_ok(torchrun(_args(chatml_model, data, out, "--max-steps", "2", "--weight-decay", "0.5"), warm=True))
    records = read_metrics(out)
    assert [r["skipped"] for r in records] == [True, True]
    assert [r["total_samples_accumulated"] for r in records] == [0, 0]
    [checkpoint] = (out / "hf_format").iterdir()
    saved = load_file(checkpoint / "model.safetensors")
    initial = AutoModelForCausalLM.from_pretrained(chatml_model, dtype=torch.float32).state_dict()
    for name, tensor in saved.items():
        torch.testing.assert_close(tensor, initial[name].to(torch.bfloat16), rtol=0, atol=0, msg=name)


def test_logged_lr_is_the_rate_the_step_applied(tmp_path, chatml_model, data_path):
    """Linear warmup from 0 over 2 steps: step 1 updates with lr 0 (its export is the initial model), step 2
    with half the peak (its weights move), step 3 with the peak. The metrics line says so, step by step."""
    out = tmp_path / "out"
    # The later flag wins (argparse): these override _args' constant schedule and rare exports.
    assert_ok(torchrun(_args(chatml_model, data_path, out, "--max-steps", "3", "--lr-scheduler",
                             "constant_with_warmup", "--num-warmup-steps", "2",
                             "--min-samples-per-checkpoint", str(BATCH)), nproc=1, warm=True))
    assert [r["lr"] for r in read_metrics(out)] == [0.0, pytest.approx(LR / 2), pytest.approx(LR)]
    initial = AutoModelForCausalLM.from_pretrained(chatml_model, dtype=torch.float32).state_dict()
    step_1 = load_file(out / "hf_format" / f"samples_{BATCH}" / "model.safetensors")
    step_2 = load_file(out / "hf_format" / f"samples_{2 * BATCH}" / "model.safetensors")
    for name, tensor in step_1.items():
        torch.testing.assert_close(tensor, initial[name].to(torch.bfloat16), rtol=0, atol=0, msg=name)
    assert any(not torch.equal(step_2[name], step_1[name]) for name in step_1), "lr > 0 must move the weights"


def test_step_counts_are_summed_exactly_past_fp32_precision():
    import torch.distributed as dist

    from minitrainer.data.sampler import StepBatch
    from minitrainer.loop.step import reduce_step_counts
    from minitrainer.common.distributed import init_distributed

    info = init_distributed()
    tokens = 2**24 + 1  # the first integer fp32 cannot hold
    batch = StepBatch(minibatches=[], batch_num_loss_counted_tokens=tokens, num_samples=1, num_dropped_samples=0,
                      num_total_tokens=tokens, start_position=0, end_position=1, epoch=0, dropped_indices=[])
    counts, preempted = reduce_step_counts(torch.tensor(1.0), torch.tensor(1.0), tokens, 0.5, batch, info, False)
    assert counts.num_loss_counted_tokens == tokens and not preempted
    dist.destroy_process_group()


@pytest.mark.parametrize("max_norm", [0.0, 0.5, 1e6])
def test_clipping_scales_the_gradients_to_the_bound_and_reports_the_norm_before(max_norm):
    """AdamW is nearly blind to a gradient's scale on its first step, so a run's weights barely show whether
    clipping happened (only the pinned 5-step run would): the bound is checked on the gradients themselves."""
    from minitrainer.loop.step import clip_grad_norm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model(torch.randn(5, 4)).pow(2).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in before]))
    assert total > 0.5, "the test needs a gradient above the middle bound"
    norm = clip_grad_norm(model, max_norm)
    torch.testing.assert_close(norm, total)
    after = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
    expected = total if max_norm == 0 or max_norm >= total else torch.tensor(max_norm)
    torch.testing.assert_close(after, expected, rtol=1e-5, atol=0)


def test_cpu_offload_on_gpu_gets_a_cpu_collective_backend():
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    from minitrainer.common.distributed import process_group_backend

    mixed = BackendConfig(Backend(process_group_backend("cuda", cpu_offload=True))).get_device_backend_map()
    assert mixed == {"cuda": "nccl", "cpu": "gloo"}
    assert process_group_backend("cuda") == "nccl" and process_group_backend("cpu", cpu_offload=True) == "gloo"


def test_cpu_offload_clips_over_cpu_shards_like_the_plain_run(tmp_path, chatml_model, data_path):
    """The CPU-collective path: clipping reduces norms of CPU-resident shards over gloo."""
    records = {}
    for name, extra in (("plain", []), ("offload", ["--cpu-offload"])):
        out = tmp_path / name
        assert_ok(torchrun(_args(chatml_model, data_path, out, "--max-steps", "2", "--max-grad-norm", "0.5", *extra),
                           warm=True))
        records[name] = read_metrics(out)
    for a, b in zip(records["plain"], records["offload"]):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
