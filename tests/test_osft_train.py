"""``--osft`` through the CLI: real torchrun runs of train.py on the tiny model, gloo on CPU.

    .venv/bin/python -m pytest -q tests/test_osft_train.py

The C-numbers are issue 31's checks: C6 the export is a plain checkpoint equal to the OSFT model, C8 ratio
1.0 is bit for bit a run without ``--osft``, C10 two ranks (FULL_SHARD) and four (HYBRID_SHARD, two
"nodes" of two) equal one rank after three steps, C11 a kill -9 and resume equals the uninterrupted run; and the
2-rank run's own updates leave every weight's frozen subspace as it was. Runs are shared through module fixtures;
those whose numbers are the subject are warm calls (``fixtures/e2e.py``), the 4-rank two-node run and the kill -9
are fresh torchrun launches.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fixtures.e2e import assert_ok, model_vocab_size, read_metrics, torchrun, torchrun_two_nodes, write_tokenized_jsonl
from minitrainer.api import config_to_argv
from minitrainer.checkpoint.full_state import complete_checkpoints
from minitrainer.common.cli import parse_config
from minitrainer.common.fault_injection import KILL_AFTER_SAVE
from minitrainer.methods.osft import FACTORS, FROZEN, apply_osft, osft_export_state, osft_targets, reconstruct
from minitrainer.train_config import TrainConfig

BATCH = 8
STEPS = 3
SAVE_EVERY = 2 * BATCH  # full state after step 2 (the kill point) and at the end
RATIO = ["--osft", "--osft-unfreeze-rank-ratio", "0.25"]
C10_TOLERANCE = 1e-6  # fp32, absolute: every loss, gradient norm and AdamW moment
# Parameters: 2% of one step's learning rate (1e-3). AdamW's update m / (sqrt(v) + eps) of an entry whose
# gradient is near eps (1e-8) turns a last-bit difference of the reduction order into up to a percent of
# the learning rate: full fine-tuning's LM head differs by 2.2e-6 between 1 and 2 ranks, OSFT's by 1.1e-5.
C10_PARAMETER_TOLERANCE = 2e-5
FROZEN_SHARE_BOUND = 1e-4
"""Largest share of a weight's change over a run that may lie in its frozen directions: rounding only. Measured:
at most 1.4e-5 with the projection after each step, 0.12 to 0.27 without it."""
MOVED_AT_LEAST = 0.02
"""Smallest change ||dW|| / ||W|| of a decomposed weight over that run (measured 0.066 to 0.11): the SVD rounds the
starting weight by ~1e-6 of its norm, which must stay far below the bound's share of the change."""


@pytest.fixture(scope="module")
def data_path(tmp_path_factory, chatml_model) -> Path:
    return write_tokenized_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", num_samples=48,
                                 vocab_size=model_vocab_size(chatml_model), seed=7)


def _args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    # 96 tokens per minibatch: gradient accumulation on every rank count, and calls on both sides of
    # OSFTLinear's rebuild-or-factors threshold (64 for attention, 128 for the MLP's matrices).
    return ["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out),
            "--batch-size", str(BATCH), "--max-tokens-per-gpu", "96", "--seed", "5", "--learning-rate", "1e-3",
            "--num-warmup-steps", "0", "--lr-scheduler", "constant", "--max-steps", str(STEPS),
            "--min-samples-per-checkpoint", str(SAVE_EVERY), "--num-data-workers", "0", *extra]


def _full_state(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the newest full state (model and AdamW state), unsharded, in one process."""
    reader = FileSystemReader(str(complete_checkpoints(out / "full_state")[-1]))
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in reader.read_metadata().state_dict_metadata.items()
             if isinstance(meta, TensorStorageMetadata)}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def _model_state(full_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The Hugging Face model's keys (the full state nests it as ``model.`` + the wrapper's ``model.``)."""
    return {key.removeprefix("model.model."): value for key, value in full_state.items() if key.startswith("model.")}


def _steps(out: Path) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in read_metrics(out)]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, chatml_model, data_path) -> Path:
    out = tmp_path_factory.mktemp("one_rank")
    assert_ok(torchrun(_args(chatml_model, data_path, out, *RATIO), nproc=1, warm=True))
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, chatml_model, data_path) -> Path:
    out = tmp_path_factory.mktemp("two_ranks")
    result = torchrun(_args(chatml_model, data_path, out, *RATIO), warm=True)
    assert_ok(result)
    assert "OSFT: 14 matrices decomposed (7 on this rank" in result.stderr  # the SVDs were split
    return out


def _assert_close_runs(out: Path, reference: Path) -> dict[str, float]:
    """Losses and gradient norms, AdamW moments (the gradients) and parameters of the final full state
    against ``reference``; returns the worst absolute gap of each."""
    worst = {"metrics": 0.0, "moments": 0.0, "parameters": 0.0}
    for (loss, norm), (ref_loss, ref_norm) in zip(_steps(out), _steps(reference), strict=True):
        worst["metrics"] = max(worst["metrics"], abs(loss - ref_loss), abs(norm - ref_norm))
    state, expected = _full_state(out), _full_state(reference)
    assert state.keys() == expected.keys()
    assert any(key.endswith("U_low") for key in state) and any(key.endswith("U_high") for key in state)
    for key, value in expected.items():
        kind = "moments" if key.startswith("optim.") else "parameters"
        if value.numel():
            worst[kind] = max(worst[kind], float((state[key].double() - value.double()).abs().max()))
    assert worst["metrics"] <= C10_TOLERANCE and worst["moments"] <= C10_TOLERANCE, worst
    assert worst["parameters"] <= C10_PARAMETER_TOLERANCE, worst
    return worst


def test_c10_two_ranks_full_shard_equal_one_rank(one_rank, two_ranks):
    """Every AdamW moment is in the full state, so the (projected) gradients are compared too."""
    _assert_close_runs(two_ranks, one_rank)


def test_c10_four_ranks_hybrid_shard_equal_one_rank(tmp_path, chatml_model, data_path, one_rank):
    """2 x 2 HYBRID_SHARD: projections sum over the two ranks of a node, never over the replicas."""
    out = tmp_path / "hybrid"
    nodes = torchrun_two_nodes(_args(chatml_model, data_path, out, *RATIO, "--fsdp-sharding-strategy", "HYBRID_SHARD"),
                               nproc_per_node=2)
    for result in nodes:
        assert_ok(result)
    assert "mesh (2, 2)" in nodes[0].stderr
    _assert_close_runs(out, one_rank)


def test_c11_kill_and_resume_equals_the_uninterrupted_run(tmp_path, chatml_model, data_path, two_ranks):
    out = tmp_path / "killed"
    killed = torchrun(_args(chatml_model, data_path, out, *RATIO), env={KILL_AFTER_SAVE: str(SAVE_EVERY)})
    assert killed.returncode != 0
    resumed = torchrun(_args(chatml_model, data_path, out, *RATIO), warm=True)  # the numbers are the subject
    assert_ok(resumed)
    assert f"resumed from {out / 'full_state' / f'samples_{SAVE_EVERY}'}" in resumed.stderr
    assert "OSFT: 14 matrices decomposed" in resumed.stderr  # then overwritten by the saved factors
    assert _steps(out) == _steps(two_ranks)
    state, expected = _full_state(out), _full_state(two_ranks)
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


def _frozen_share(before: torch.Tensor, factors: dict[str, torch.Tensor]) -> tuple[float, float]:
    """The share of a weight's change dW that lies in its frozen directions, ||dW - (1 - P_U) dW (1 - P_V)|| / ||dW||
    with P_U, P_V the projections on U_high's and V_high's columns (what OSFT keeps U_low and V_low orthogonal to),
    and ||dW|| / ||W||; in float64."""
    factors = {name: tensor.double() for name, tensor in factors.items()}
    update = reconstruct(factors, upcast_dtype=torch.float64) - before.double()
    U, V = factors["U_high"], factors["V_high"]
    trainable = update - U @ (U.T @ update)
    trainable = trainable - (trainable @ V) @ V.T
    return float((update - trainable).norm() / update.norm()), float(update.norm() / before.double().norm())


@pytest.fixture(scope="module")
def two_ranks_fast(tmp_path_factory, chatml_model, data_path) -> Path:
    """The 2-rank run at 10x the learning rate: the change dwarfs the SVD's rounding of the starting weight."""
    out = tmp_path_factory.mktemp("two_ranks_fast")
    assert_ok(torchrun(_args(chatml_model, data_path, out, *RATIO, "--learning-rate", "1e-2"), warm=True))
    return out


def test_the_trainers_updates_leave_the_frozen_subspace(two_ranks_fast, chatml_model):
    """Over a 2-rank run, every decomposed weight moves only in its trainable directions: U_high^T dW = 0 and
    dW V_high = 0 up to rounding, dW the change from the starting model to the trained one. The gradients are
    projected before the step, but AdamW's per-element scaling moves them back into the frozen subspace: a trainer
    that skips the projection after the step puts a large share of each change there. Read from the fp32 full
    state: the bf16 export's rounding alone is far larger than the bound."""
    before = load_file(chatml_model / "model.safetensors")
    trained = _model_state(_full_state(two_ranks_fast))
    prefixes = sorted(key.removesuffix(".U_high") for key in trained if key.endswith(".U_high"))
    assert len(prefixes) == 14
    shares = {}
    for prefix in prefixes:
        factors = {name: trained[f"{prefix}.{name}"] for name in FACTORS}
        weight = before[f"{prefix}.weight"].double()
        # The frozen factors are still the starting weight's own top singular directions.
        U, S, V = (factors[name].double() for name in FROZEN)
        torch.testing.assert_close(U.T @ weight @ V, torch.diag(S), rtol=0, atol=1e-5 * float(S[0]), msg=prefix)
        shares[prefix], moved = _frozen_share(weight, factors)
        assert moved > MOVED_AT_LEAST, (prefix, moved)
    assert max(shares.values()) < FROZEN_SHARE_BOUND, shares


def test_c6_export_is_a_plain_checkpoint_equal_to_the_osft_model(one_rank, chatml_model):
    from transformers import AutoModelForCausalLM

    export = complete_checkpoints(one_rank / "hf_format")[-1]
    assert export.name == f"samples_{STEPS * BATCH}"
    dense, info = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    saved = load_file(export / "model.safetensors")
    assert not [key for key in saved if key.rpartition(".")[2] in FACTORS]

    # The trained OSFT model itself, from the final full state (fp32).
    trained = _model_state(_full_state(one_rank))
    model = AutoModelForCausalLM.from_pretrained(chatml_model, dtype=torch.float32)
    apply_osft(model, osft_targets(model, blocks=list(model.model.layers)), unfreeze_rank_ratio=0.25)
    model.load_state_dict(trained, strict=True)
    exact = osft_export_state(trained)
    assert exact.keys() == saved.keys()
    for key, tensor in saved.items():  # the file is the fp32 export rounded once to bf16
        assert torch.equal(tensor, exact[key].to(torch.bfloat16)), key
    dense_fp32 = AutoModelForCausalLM.from_pretrained(chatml_model, dtype=torch.float32)
    dense_fp32.load_state_dict(exact, strict=True)

    input_ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(input_ids=input_ids).logits
        torch.testing.assert_close(dense_fp32(input_ids=input_ids).logits, reference, rtol=0, atol=1e-5)
        scale = reference.abs().max()
        assert (dense(input_ids=input_ids).logits - reference).abs().max() <= 2e-2 * scale  # bf16 weights


def test_c8_ratio_one_is_bit_identical_to_no_osft(tmp_path, chatml_model, data_path):
    runs = {}
    for name, extra in (("plain", []), ("ratio_one", ["--osft", "--osft-unfreeze-rank-ratio", "1.0"])):
        out = tmp_path / name
        result = torchrun(_args(chatml_model, data_path, out, "--max-steps", "2", *extra), nproc=1, warm=True)
        assert_ok(result)
        runs[name] = out
    assert "freezes no direction" in result.stderr
    assert _steps(runs["ratio_one"]) == _steps(runs["plain"])
    exports = [complete_checkpoints(out / "hf_format")[-1] / "model.safetensors" for out in runs.values()]
    assert exports[0].read_bytes() == exports[1].read_bytes()
    state, expected = _full_state(runs["ratio_one"]), _full_state(runs["plain"])
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[key], value) for key, value in expected.items())


def _config(**fields) -> TrainConfig:
    return TrainConfig(model_name_or_path="m", data_path="d", output_dir="/tmp/unused", min_samples_per_checkpoint=1, **fields)


@pytest.mark.parametrize("fields,message", [
    ({"osft": True}, "--osft needs --osft-unfreeze-rank-ratio"),
    ({"osft": True, "osft_unfreeze_rank_ratio": 1.5}, "must lie in [0, 1]"),
    ({"osft": True, "osft_unfreeze_rank_ratio": 0.25, "lora_rank": 8}, "--osft with --lora-rank"),
    ({"osft": True, "osft_unfreeze_rank_ratio": 0.25, "compile": True}, "--osft with --compile"),
    ({"osft_unfreeze_rank_ratio": 0.25}, "only apply with --osft"),
])
def test_refused_combinations_name_the_flag(fields, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _config(**fields)


def test_python_api_and_cli_give_the_same_settings():
    config = _config(osft=True, osft_unfreeze_rank_ratio=0.25, osft_target_patterns="q_proj, *.down_proj",
                     osft_upcast_dtype="float64")
    assert parse_config(TrainConfig, config_to_argv(config)) == config  # what run_training launches
    settings = config.osft_settings
    assert settings.target_patterns == ["q_proj", "*.down_proj"] and settings.upcast_dtype == torch.float64
    assert math.isclose(settings.unfreeze_rank_ratio, 0.25) and _config().osft_settings is None
