"""Test-side architecture matrix: tiny random causal LMs of many families, sharing one tokenizer.

Each is built with ``AutoConfig.for_model(model_type, ...)`` (hand-set sizes,
``COMMON``) or, for the families marked ``generic``, with the sweep's
``tiny_configs.tiny_config`` (``bench/bench_architectures.py``: the CI sample
of that sweep), and ``save_pretrained`` into its own folder beside a copy of the chatml tokenizer, then loaded through
``from_pretrained`` like any downloaded checkpoint. ``initializer_range`` is
large enough that logits are far from uniform, so a skipped logit transform
or router loss moves the loss well beyond float noise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from tiny_configs import tiny_config

COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=256, initializer_range=0.3,
              attention_dropout=0.0)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _shipped(model_type: str) -> bool:
    from transformers import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING


@dataclass(frozen=True)
class Arch:
    name: str
    model_type: str
    exercises: str
    overrides: dict = field(default_factory=dict)
    moe: bool = False
    stored_dtype: torch.dtype = torch.float32  # bf16 exercises rank 0's load in the stored dtype
    generic: bool = False  # config from tiny_configs.tiny_config (the sweep's builder) instead of COMMON


ARCHITECTURES = (
    Arch("llama", "llama", "dense baseline, stored in bf16", {"tie_word_embeddings": False},
         stored_dtype=torch.bfloat16),
    Arch("qwen2_tied_swa", "qwen2", "tied embeddings, sliding window on one layer",
         {"tie_word_embeddings": True, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    Arch("qwen3", "qwen3", "dense, q/k norm", {"tie_word_embeddings": False}),
    Arch("mistral_swa", "mistral", "sliding window attention", {"sliding_window": 8}),
    Arch("phi3", "phi3", "fused qkv / gate-up projections", {"pad_token_id": 0}),
    Arch("olmo2", "olmo2", "post-norm blocks", {}),
    Arch("granite", "granite", "logits_scaling (divide), residual/embedding multipliers",
         {"logits_scaling": 0.25, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
          "attention_multiplier": 0.2}),
    Arch("cohere", "cohere", "logit_scale (multiply), tied embeddings", {"logit_scale": 3.0}),
    Arch("gemma2", "gemma2", "final + attention logit softcapping, sliding window, refuses sdpa",
         {"final_logit_softcapping": 2.0, "attn_logit_softcapping": 5.0, "sliding_window": 8,
          "query_pre_attn_scalar": 8}),
    Arch("gemma3", "gemma3_text", "sliding window layer pattern, final softcapping",
         {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
          "final_logit_softcapping": 3.0, "query_pre_attn_scalar": 8}),
    Arch("qwen3_moe_aux", "qwen3_moe", "MoE with router load-balancing loss",
         {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
          "mlp_only_layers": [], "output_router_logits": True, "router_aux_loss_coef": 0.5}, moe=True),
    Arch("mixtral", "mixtral", "MoE without router loss",
         {"num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": False,
          "sliding_window": None}, moe=True),
    Arch("granitemoe_aux", "granitemoe", "MoE with router loss + logits_scaling",
         {"num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": True,
          "router_aux_loss_coef": 0.5, "logits_scaling": 0.5}, moe=True),
    Arch("gpt_oss", "gpt_oss", "attention sinks, sliding window, MoE with biases, refuses sdpa",
         {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
          "layer_types": ["sliding_attention", "full_attention"], "output_router_logits": False}, moe=True),
    Arch("deepseek_v3_mla", "deepseek_v3", "multi-head latent attention (value heads 4 < query/key heads 8), MoE",
         {"q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 4,
          "head_dim": 4, "num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
          "moe_intermediate_size": 16, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1}, moe=True),
    Arch("kimi_linear", "kimi_linear", "MLA full attention + delta-attention linear layers, MoE",
         {"kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 4, "head_dim": 4,
          "num_key_value_heads": 4, "num_experts": 4, "num_experts_per_token": 2, "moe_intermediate_size": 16,
          "linear_head_dim": 8, "linear_num_heads": 4, "layer_types": ["linear_attention", "full_attention"]},
         moe=True),
    Arch("llama4_text", "llama4_text", "chunked attention, NoPE layer, MoE; get_decoder() returns the model itself",
         {"intermediate_size_mlp": 64, "num_local_experts": 4, "num_experts_per_tok": 1, "attention_chunk_size": 8,
          "layer_types": ["chunked_attention", "full_attention"], "no_rope_layer_interval": 2}, moe=True),
    Arch("qwen3_5_moe", "qwen3_5_moe_text", "gated delta net linear attention + full attention, MoE",
         {"linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
          "linear_num_value_heads": 4, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
          "num_experts": 4, "num_experts_per_tok": 2, "layer_types": ["linear_attention", "full_attention"]},
         moe=True),
    Arch("olmo_hybrid", "olmo_hybrid", "gated delta net linear attention + full attention",
         {"linear_key_head_dim": 8, "linear_value_head_dim": 16, "linear_num_key_heads": 4,
          "linear_num_value_heads": 4, "layer_types": ["linear_attention", "full_attention"]}),
    # The CI sample of bench/bench_architectures.py: built by the sweep's generic tiny_config.
    Arch("deepseek_v2", "deepseek_v2", "MLA, MoE with shared experts", generic=True, moe=True),
    Arch("minicpm3", "minicpm3", "MLA, scaled embeddings/residuals/logits", generic=True),
    Arch("cohere2", "cohere2", "sliding/full layer pattern, logit_scale", generic=True),
    Arch("exaone4", "exaone4", "sliding/full layer pattern, post-norm", generic=True),
    Arch("smollm3", "smollm3", "NoPE layers", generic=True),
    Arch("gpt2", "gpt2", "learned absolute positions, Conv1D projections", generic=True),
    Arch("olmoe", "olmoe", "MoE", generic=True, moe=True),
    Arch("glm4_moe", "glm4_moe", "MoE with shared experts, partial rotary", generic=True, moe=True),
    Arch("phimoe", "phimoe", "MoE with sparse-mixer routing", generic=True, moe=True),
    Arch("nemotron_h", "nemotron_h", "hybrid SSM: Mamba-2 + attention + MLP layers", generic=True),
    Arch("lfm2", "lfm2", "hybrid short convolutions + attention", generic=True),
    Arch("qwen3_next", "qwen3_next", "hybrid gated delta net + gated attention, MoE", generic=True, moe=True),
    Arch("qwen3_5", "qwen3_5_text", "dense hybrid gated delta net + attention", generic=True),
    Arch("gemma4", "gemma4_text", "per-layer head_dim (a heterogeneous config from transformers 5.24), per-layer "
         "embeddings", generic=True),
    Arch("seed_oss", "seed_oss", "q/k/v biases without an output bias; residual dropout (tiny_config turns it off)",
         generic=True),
)
ARCH_BY_NAME = {arch.name: arch for arch in ARCHITECTURES}
UPSTREAM_BROKEN = {("granitemoe_aux", "5.17.0"): "its own forward(labels=...) raises with output_router_logits "
                                                 "(AttributeError: 'int' object has no attribute 'to'; fixed in 5.18)"}
"""(family, transformers version) pairs whose model fails in transformers itself, not in the trainer."""
NOT_SHIPPED = tuple(arch.name for arch in ARCHITECTURES if not _shipped(arch.model_type)
                    or (arch.name, _transformers_version()) in UPSTREAM_BROKEN)
"""Families the installed transformers does not have (``make test-deps`` runs releases back to 4.57, before
Qwen3.5, OLMo-hybrid or Gemma-4), or breaks (``UPSTREAM_BROKEN``): left out of the matrix, and named in
``tests/test_architectures.py``'s skip reasons."""
ARCHITECTURES = tuple(arch for arch in ARCHITECTURES if arch.name not in NOT_SHIPPED)


def build_architecture(arch: Arch, tokenizer_dir: Path, output_dir: Path, *, seed: int = 0) -> Path:
    """Save ``arch`` as a random tiny model with the tokenizer of ``tokenizer_dir``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.save_pretrained(output_dir)
    if arch.generic:
        config = tiny_config(arch.model_type, len(tokenizer), arch.overrides,
                             token_ids={"eos_token_id": tokenizer.eos_token_id,
                                        "bos_token_id": tokenizer.bos_token_id,
                                        "pad_token_id": tokenizer.pad_token_id})
    else:
        config = AutoConfig.for_model(arch.model_type, vocab_size=len(tokenizer), **{**COMMON, **arch.overrides})
    config.eos_token_id = tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id
    if isinstance(config.pad_token_id, int) and config.pad_token_id >= len(tokenizer):
        config.pad_token_id = tokenizer.pad_token_id  # the family's default id is outside this tiny vocabulary
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(arch.stored_dtype)
    model.config.dtype = arch.stored_dtype
    model.save_pretrained(output_dir)
    return output_dir
