"""Architecture matrix: every family trains on the model's own objective, through real torchrun.

    .venv/bin/python -m pytest -q tests/test_architectures.py

Thirty-four tiny random causal LMs (``fixtures/architectures.py``: dense, tied
embeddings, Granite's logits_scaling, Cohere's logit_scale, Gemma's
softcapping, sliding windows, attention sinks, MoE with and without the router
loss, DeepSeek-V2/V3 and MiniCPM3 multi-head latent attention, Llama-4's
chunked attention, NoPE layers, the linear-attention hybrids Kimi-Linear,
Qwen3.5(-MoE), Qwen3-Next and OLMo-hybrid, the Mamba-2 hybrid Nemotron-H and
LFM2's short convolutions, Gemma-4's per-layer head_dim, Seed-OSS's biases; the last fifteen are the CI sample of
``bench/bench_architectures.py``, built by its generic ``fixtures/tiny_configs.py``) are trained for one step in ONE ``torchrun --nproc-per-node=2`` job
(``fixtures/matrix_train.py`` runs ``train.main`` once per architecture), with a
token budget that forces several packed minibatches per rank. The invariant:
the logged step-1 loss (and router loss, and for one dense and one MoE model
the gradient norm) equals the model's own ``forward(input_ids, labels=...)``
computed unpacked, sample by sample, on one process; GPT-OSS, whose packed
rows leak across samples under the only attention that honours its sinks,
is stopped by the self-check instead of training wrongly. The start-up self-check
is shown to stop a run whose objective is wrong (test-only switch that drops
the logit scale), and ``--skip-objective-check`` to skip it. Each trained family
also runs with ``--lora-rank 4`` (peft adapters, base frozen): its step-1 loss is the base model's own.
"""

from __future__ import annotations

import json

import pytest

from fixtures.architectures import (ARCHITECTURES, ARCH_BY_NAME, NOT_SHIPPED, build_architecture, matrix_args,
                                    reference_step_one)
from fixtures.e2e import read_metrics, torchrun, write_tokenized_jsonl
from minitrainer.common.fault_injection import DROP_LOGIT_SCALE

REFUSED = "gpt_oss"
"""Its forward builds the attention mask without position_ids, so eager lets packed samples see each other,
and no boundary-aware backend here implements its attention sinks: the self-check must stop it."""
TRAINED = [arch.name for arch in ARCHITECTURES if arch.name != REFUSED]
FUSED_EXPERTS = "matches ParamWrapper layers; only linear layers can be adapted and merged here"
LORA_REFUSED = {"nemotron_h": "peft cannot adapt NemotronHForCausalLM", "qwen3_next": FUSED_EXPERTS,
                "deepseek_v3_mla": FUSED_EXPERTS, "deepseek_v2": FUSED_EXPERTS, "glm4_moe": FUSED_EXPERTS}
"""LoRA that stops at start-up with one line instead of a traceback: peft refuses Mamba layers' out_proj/conv1d
(Nemotron-H); all-linear's names reach fused 3-D experts beside same-named shared-expert projections, whose
adapters have no merge into the original keys."""
WITH_GRADIENTS = ("llama", "qwen3_moe_aux")
DROPPED = "granite_scale_dropped_unchecked"
NO_RESUME = ("--no-full-state",)
"""The matrix reads step 1's metrics line, never a resume: each of its ~65 runs skips the final full state's save."""
LORA = "_lora"
"""Suffix of the same architectures trained with --lora-rank 4: adapters start with B = 0, so step 1's loss
is the base model's own."""


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, chatml_model) -> dict:
    """Build every architecture, train each one step in one torchrun job."""
    root = tmp_path_factory.mktemp("matrix")
    models = {arch.name: build_architecture(arch, chatml_model, root / "models" / arch.name)
              for arch in ARCHITECTURES}
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(chatml_model))
    data = write_tokenized_jsonl(root / "data.jsonl", num_samples=40, vocab_size=vocab, seed=3)
    runs = [{"name": name, "args": matrix_args(path, data, root / "runs" / name, *NO_RESUME)}
            for name, path in models.items()]
    runs += [{"name": f"{name}{LORA}", "args": matrix_args(models[name], data, root / "runs" / f"{name}{LORA}",
                                                      "--lora-rank", "4", *NO_RESUME)} for name in TRAINED]
    runs.append({"name": DROPPED, "env": {DROP_LOGIT_SCALE: "1"},
                 "args": matrix_args(models["granite"], data, root / "runs" / DROPPED, "--skip-objective-check",
                                     *NO_RESUME)})
    result = torchrun([json.dumps(run) for run in runs], module="fixtures.matrix_train", timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    exits = json.loads((root / "runs" / "results_0.json").read_text())
    return {"root": root, "models": models, "data": data, "exits": exits, "log": result.stderr}


@pytest.mark.skipif(not NOT_SHIPPED, reason="the installed transformers ships every family of the matrix")
def test_families_this_transformers_lacks_are_named():
    pytest.skip(f"transformers {__import__('transformers').__version__} lacks or breaks {', '.join(NOT_SHIPPED)}: "
                "left out (fixtures/architectures.py)")


@pytest.mark.parametrize("name", TRAINED)
def test_step_one_equals_the_models_own_forward(matrix, name):
    assert matrix["exits"][name] == 0
    [record] = read_metrics(matrix["root"] / "runs" / name)
    assert record["grad_accum"] >= 2, "the budget should force several packed minibatches per rank"
    ref = reference_step_one(matrix["models"][name], matrix["data"], with_gradients=name in WITH_GRADIENTS)
    error = abs(record["loss"] - ref["loss"]) / ref["loss"]
    print(f"\nMATRIX {name} | {ARCH_BY_NAME[name].exercises} | loss {record['loss']:.6f} "
          f"ref {ref['loss']:.6f} rel err {error:.1e}")
    assert record["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert record["loss_backward"] == pytest.approx(ref["objective"], rel=1e-5)
    if ref["router_aux_loss"] is None:
        assert "router_aux_loss" not in record
    else:
        assert record["router_aux_loss"] == pytest.approx(ref["router_aux_loss"], rel=1e-5)
        assert record["loss_backward"] > record["loss"]
    if ref["grad_norm"] is not None:
        assert record["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)


def test_attention_choice_and_objective_are_logged(matrix):
    log = matrix["log"]
    assert "attention: eager (not sdpa: Gemma2ForCausalLM does not support sdpa)" in log
    assert "attention: eager (not sdpa: GptOssForCausalLM does not support sdpa)" in log
    assert "logit processing x 4 (from config logits_scaling=0.25)" in log
    assert "logit processing softcap 2 (from config final_logit_softcapping=2)" in log
    assert log.count("objective self-check: the trainer's loss equals") == 2 * len(TRAINED) - len(LORA_REFUSED)


def test_packing_that_leaks_across_samples_is_refused(matrix):
    assert matrix["exits"][REFUSED] == 1
    [line] = [ln for ln in matrix["log"].splitlines() if "objective self-check failed for GptOssForCausalLM" in ln]
    assert "packed into one" in line and "attention eager lets packed samples see each other" in line
    assert not (matrix["root"] / "runs" / REFUSED / "training_metrics_0.jsonl").exists()


def test_skipped_check_lets_a_wrong_objective_train(matrix):
    """The test-only switch really changes the objective: without the check, the loss moves."""
    assert matrix["exits"][DROPPED] == 0
    [wrong] = read_metrics(matrix["root"] / "runs" / DROPPED)
    [right] = read_metrics(matrix["root"] / "runs" / "granite")
    assert abs(wrong["loss"] - right["loss"]) / right["loss"] > 1e-2


def test_self_check_stops_a_wrong_objective(matrix, tmp_path):
    out = tmp_path / "out"
    result = torchrun(matrix_args(matrix["models"]["granite"], matrix["data"], out), env={DROP_LOGIT_SCALE: "1"},
                      timeout=300)
    assert result.returncode != 0
    # Our log line; torchrun's failure report repeats it as the root cause (its error file, docs/training.md).
    [line] = [ln for ln in result.stderr.splitlines() if "objective self-check failed" in ln and " ERROR " in ln]
    assert f"traceback : {line.split(' ERROR ', 1)[1]}" in result.stderr
    assert "GraniteForCausalLM" in line and "'granite'" in line and "--skip-objective-check" in line
    assert "own forward(labels=...) gives" in line
    assert not (out / "training_metrics_0.jsonl").exists()


@pytest.mark.parametrize("name", [name for name in TRAINED if name not in LORA_REFUSED])
def test_lora_trains_every_architecture_on_its_own_objective(matrix, name):
    """peft adapts every family of the matrix; with B = 0 at the start, step 1 is the base model's own loss
    (self-check on, activation checkpointing on), and the adapters are all that trains."""
    assert matrix["exits"][f"{name}{LORA}"] == 0
    [record] = read_metrics(matrix["root"] / "runs" / f"{name}{LORA}")
    ref = reference_step_one(matrix["models"][name], matrix["data"], with_gradients=False)
    assert record["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert record["loss_backward"] == pytest.approx(ref["objective"], rel=1e-5)


@pytest.mark.parametrize("name", sorted(set(LORA_REFUSED) & set(TRAINED)))
def test_lora_that_cannot_be_merged_stops_with_one_line(matrix, name):
    assert matrix["exits"][f"{name}{LORA}"] == 1
    assert any(LORA_REFUSED[name] in ln and "--lora-target-modules all-linear" in ln
               for ln in matrix["log"].splitlines())
