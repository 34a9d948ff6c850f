"""FLOPs per trained token from a config (flops.py) and the MFU peak table.

    .venv/bin/python -m pytest -q tests/test_flops.py
"""

from __future__ import annotations

import math

import pytest
import torch

from fixtures.architectures import ARCHITECTURES, COMMON
from minitrainer.setup.flops import (ModelFlops, attended_pairs, checked_model_flops, matmul_params_of, model_flops,
                               peak_bf16_tflops_for, speed_metrics, training_flops)


def _meta_model(arch, vocab_size: int = 100):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(arch.model_type, vocab_size=vocab_size,
                                  **{"pad_token_id": 0, **COMMON, **arch.overrides})
    with torch.device("meta"):
        return config, AutoModelForCausalLM.from_config(config)


# The families flops.py's config arithmetic was written for: their count must be exact. For the
# others (MLA, linear attention, state-space mixers, ...) it must be exact or refused (None), never off.
COUNTED_FROM_CONFIG = {"llama", "qwen2_tied_swa", "qwen3", "mistral_swa", "phi3", "olmo2", "granite", "cohere",
                       "gemma2", "gemma3", "qwen3_moe_aux", "mixtral", "granitemoe_aux", "gpt_oss", "gemma4"}


@pytest.mark.parametrize("arch", ARCHITECTURES, ids=lambda a: a.name)
def test_matmul_parameters_match_the_real_model(arch):
    config, model = _meta_model(arch)
    shape, reason = checked_model_flops(model)
    if arch.name in COUNTED_FROM_CONFIG:
        assert shape is not None, reason
    if shape is None:
        assert "logged as null" in reason and model_flops(config).num_matmul_params != matmul_params_of(model)
        return
    assert shape.num_matmul_params == matmul_params_of(model)
    assert len(shape.attention_dims) == config.num_hidden_layers
    if not arch.moe:
        assert shape.num_active_matmul_params == shape.num_matmul_params


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a.moe and a.name in COUNTED_FROM_CONFIG],
                         ids=lambda a: a.name)
def test_moe_counts_only_the_routed_top_k_experts(arch):
    config, model = _meta_model(arch)
    shape = model_flops(config)
    # By hand: every layer is a MoE layer with 4 experts of 3 * hidden * width, 2 of them active per token.
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    inactive = (4 - 2) * 3 * config.hidden_size * width * config.num_hidden_layers
    assert shape.num_matmul_params - shape.num_active_matmul_params == inactive


def test_a_refused_count_logs_null_flops_not_a_guess():
    metrics = speed_metrics(None, [100, 50], num_loss_counted_tokens=80, seconds=2.0, world_size=2,
                            peak_tflops=989.0)
    assert metrics["mfu"] is None and metrics["model_flops_per_token"] is None
    assert metrics["model_tflops_per_second_per_gpu"] is None and metrics["loss_tokens_per_second"] == 40.0


@pytest.mark.parametrize("model_type", ["mamba", "falcon_mamba"])
def test_a_config_without_attention_heads_logs_null_flops_instead_of_raising(model_type):
    """FalconMamba's config raises on num_attention_heads: start-up crashed there (bench_architectures sweep)."""
    from transformers import AutoModelForCausalLM

    from fixtures.tiny_configs import tiny_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(model_type, 100))
    shape, reason = checked_model_flops(model)
    assert shape is None and "has no num_attention_heads" in reason and "logged as null" in reason


def test_gemma4_head_dim_and_key_value_heads_are_read_per_layer():
    """transformers 5.24 refuses ``config.head_dim`` on Gemma-4 (its full-attention layers have their own):
    start-up crashed there. The count reads each layer's config and matches the model's matrices."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from fixtures.tiny_configs import tiny_config

    if "gemma4_text" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no Gemma-4")
    config = tiny_config("gemma4_text", 100)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shape, reason = checked_model_flops(model)
    assert shape is not None, reason
    assert shape.num_matmul_params == matmul_params_of(model)
    # Each layer's query width as its own attention module has it (heads x that layer's head_dim).
    assert shape.attention_dims == tuple(layer.self_attn.q_proj.out_features for layer in model.model.layers)
    assert shape.attention_windows == (8, None)


def test_a_config_the_count_cannot_read_logs_null_instead_of_raising():
    """A per-layer attribute the count reads globally: transformers raises on the read; FLOPs go null."""
    config, model = _meta_model(ARCHITECTURES[0])
    if not hasattr(config, "per_layer_config"):
        pytest.skip("this transformers has no heterogeneous (per-layer) configs")
    model.config.per_layer_config = {0: {"hidden_size": 64}}
    shape, reason = checked_model_flops(model)
    assert shape is None
    assert "cannot read the config" in reason and "AmbiguousGlobalPerLayerAttributeError" in reason
    assert "logged as null" in reason and "\n" not in reason


def test_qwen2_moe_shared_expert_and_dense_layers():
    from transformers import AutoConfig

    config = AutoConfig.for_model("qwen2_moe", vocab_size=100, **COMMON, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=16, shared_expert_intermediate_size=48,
                                  mlp_only_layers=[0])
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config)
    shape = model_flops(config)
    assert shape.num_matmul_params == matmul_params_of(model)
    assert shape.num_matmul_params - shape.num_active_matmul_params == 2 * 3 * 32 * 16  # one MoE layer


def test_sliding_windows_follow_the_config():
    by_name = {a.name: a for a in ARCHITECTURES}
    assert model_flops(_meta_model(by_name["mistral_swa"])[0]).attention_windows == (8, 8)
    assert model_flops(_meta_model(by_name["gemma3"])[0]).attention_windows == (8, None)
    assert model_flops(_meta_model(by_name["qwen2_tied_swa"])[0]).attention_windows == (None, 8)
    assert model_flops(_meta_model(by_name["llama"])[0]).attention_windows == (None, None)


@pytest.mark.parametrize("length,window,pairs", [
    (1, None, 1), (4, None, 10), (4, 8, 10), (8, 8, 36),
    (10, 4, 4 * 5 // 2 + 6 * 4),  # 10 keys visible to the first 4 queries (1+2+3+4), then 4 each
    (3, 1, 3),  # a window of one key: each token sees itself
])
def test_attended_pairs_by_hand(length, window, pairs):
    assert attended_pairs(length, window) == pairs


def test_training_flops_by_hand():
    # Two layers of d_attn 64, one with a window of 2; samples of 3 and 1 tokens; N = 1000.
    shape = ModelFlops(num_matmul_params=1000, num_active_matmul_params=1000, attention_dims=(64, 64),
                       attention_windows=(None, 2))
    # Full layer: pairs 6 + 1; windowed layer: 1 + 2 + 2 = 5, then 1.
    attention = 12 * 64 * ((6 + 1) + (5 + 1))
    assert training_flops(shape, [3, 1]) == 6 * 1000 * 4 + attention
    assert training_flops(shape, [3, 1], frozen_base=True) == 4 * 1000 * 4 + attention


def test_qwen2_5_1_5b_shape_is_about_10_gflop_per_token():
    """The issue's ~10.3 GFLOP per trained token: 6N = 9.26 G, plus attention at a few thousand tokens."""
    from transformers import Qwen2Config

    config = Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
    shape = model_flops(config)
    assert shape.num_active_matmul_params == 28 * (2 * 1536 * 1536 + 2 * 1536 * 256 + 3 * 1536 * 8960) \
        + 151936 * 1536
    assert 6 * shape.num_active_matmul_params / 1e9 == pytest.approx(9.261, abs=1e-3)
    assert training_flops(shape, [4096]) / 4096 / 1e9 == pytest.approx(10.32, abs=0.01)


def test_speed_metrics_keys_and_null_mfu_without_a_peak():
    shape = ModelFlops(num_matmul_params=10**9, num_active_matmul_params=10**9, attention_dims=(),
                       attention_windows=())
    cpu = speed_metrics(shape, [100, 300], num_loss_counted_tokens=200, seconds=2.0, world_size=2,
                        peak_tflops=None)
    assert cpu["mfu"] is None
    assert cpu["model_flops_per_token"] == 6e9
    assert cpu["model_tflops_per_second_per_gpu"] == pytest.approx(6e9 * 400 / 2 / 2 / 1e12)
    assert (cpu["loss_tokens_per_second"], cpu["loss_tokens_per_second_per_gpu"]) == (100, 50)
    gpu = speed_metrics(shape, [100, 300], num_loss_counted_tokens=200, seconds=2.0, world_size=2,
                        peak_tflops=1.2)
    assert gpu["mfu"] == pytest.approx(0.6 / 1.2)
    empty = speed_metrics(shape, [], num_loss_counted_tokens=0, seconds=1.0, world_size=1, peak_tflops=1.0)
    assert empty["model_flops_per_token"] is None and empty["mfu"] == 0


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.4), ("NVIDIA H200 NVL", 835.0), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100-PCIE-40GB", 312.0), ("NVIDIA L40S", 362.05), ("NVIDIA L40", 181.05), ("NVIDIA L4", 121.0),
    ("NVIDIA A10G", 70.0), ("NVIDIA GH200 480GB", 989.4), ("cpu", None), ("Tesla V100-SXM2-16GB", None),
])
def test_peak_table_matches_device_names(name, peak):
    got = peak_bf16_tflops_for(name)
    assert got == peak or (peak is not None and math.isclose(got, peak))
