"""Tiny random configs of any causal-LM architecture transformers ships, for the sweep and the test matrix.

``tiny_config(model_type, vocab_size)`` starts from the architecture's own
defaults (``AutoConfig.for_model``) and shrinks every size it finds, whatever
the attribute is called in that family (``SIZE_ATTRIBUTES``: hidden size,
heads, experts, MLA ranks, linear-attention and SSM heads...), and turns every
dropout off (``RANDOM_ATTRIBUTE_MARKERS``). Per-layer
patterns (``layer_types`` and friends) keep one layer of each kind, so a
hybrid stays hybrid. Nothing here names a model: the shape of the config
decides.
"""

from __future__ import annotations

SIZE_ATTRIBUTES = {
    # attribute: tiny value (set only where the family's config has it)
    "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "max_position_embeddings": 256, "n_positions": 256, "n_ctx": 256,
    "ffn_hidden_size": 64, "intermediate_size_mlp": 64, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_k": 2, "moe_topk": 2, "top_k": 2,
    "n_shared_experts": 1, "num_shared_experts": 1, "n_group": 1, "topk_group": 1, "num_expert_group": 1,
    "first_k_dense_replace": 1,
    # multi-head latent attention: value heads narrower than query/key heads (qk 8 = 4 + 4, v 4)
    "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 4,
    # linear attention / SSM
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_head_dim": 8, "linear_num_heads": 4, "mamba_n_heads": 4, "mamba_d_head": 8, "mamba_d_state": 8,
    "mamba_n_groups": 1, "mamba_expand": 2, "state_size": 8, "n_groups": 1, "ssm_state_size": 8,
    "mamba_headdim": 8, "time_step_rank": 4, "lru_width": 32, "block_out_channels": 32,
    # Gemma-3n/4 per-layer embeddings ("PLE"): the per-layer table's vocabulary follows vocab_size
    "hidden_size_per_layer_input": 8,
    # windows short enough to bind on 48-token samples
    "sliding_window": 8, "attention_chunk_size": 8,
    # logits far from uniform, so a leak or a skipped transform moves the loss well beyond float noise (OPT and
    # XGLM call it init_std: at their default 0.02 OPT's packed-row leak cost only 1.3e-5 of the step-1 loss)
    "initializer_range": 0.3, "init_std": 0.3, "use_cache": False,
    # random router noise in training mode would make step 1 differ from the (eval-mode) reference
    "router_jitter_noise": 0.0, "input_jitter_noise": 0.0,
}
RANDOM_ATTRIBUTE_MARKERS = ("dropout", "pdrop")
"""A float config attribute whose name holds one of these is a dropout probability, set to 0: the sweep compares
a training-mode step with an eval-mode reference (Seed-OSS's residual_dropout=0.1, missed by a list of names,
cost 1e-2)."""
LAYER_PATTERN_ATTRIBUTES = ("layer_types", "layers_block_type", "block_types", "hybrid_override_pattern",
                            "mlp_layer_types", "attn_layer_indices")
MAX_LAYERS = 4
TOKEN_ID_ATTRIBUTES = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id")


def tiny_config(model_type: str, vocab_size: int, overrides: dict | None = None, *,
                token_ids: dict | None = None):
    """The tiny config of ``model_type`` (a ``MODEL_FOR_CAUSAL_LM_MAPPING`` key), ``overrides`` last."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    if hasattr(config, "get_text_config") and config.get_text_config() is not config:
        config = config.get_text_config()  # a multimodal wrapper's causal LM is its text model
    per_layer = config.to_dict().get("per_layer_config") or {}
    if per_layer:  # transformers 5.24+ heterogeneous config (Gemma-4): per-layer values are shrunk below
        config.allow_global_per_layer_attribute_access = True
    updates = {"vocab_size": vocab_size}
    # transformers 4.x configs carry generation defaults (top_k 50...): a size named like one is not shrunk there
    generation_defaults = getattr(type(config), "_get_global_generation_defaults", None)
    generation_names = set(generation_defaults()) if callable(generation_defaults) else set()
    if "vocab_size_per_layer_input" in config.to_dict():
        updates["vocab_size_per_layer_input"] = vocab_size
    for name, value in SIZE_ATTRIBUTES.items():
        if name in generation_names:
            continue
        current = getattr(config, name, None)
        if name in config.to_dict() or (current is not None and name in getattr(config, "attribute_map", {})):
            if isinstance(current, bool) or (current is not None and not isinstance(current, type(value))
                                            and not (isinstance(value, int) and isinstance(current, float))):
                continue
            updates[name] = value
    for name, value in config.to_dict().items():
        if isinstance(value, float) and any(marker in name for marker in RANDOM_ATTRIBUTE_MARKERS):
            updates[name] = 0.0
    num_layers = _num_layers(config)
    pattern_name, pattern = _layer_pattern(config)
    if pattern is not None:
        indices = _one_of_each(pattern)
        num_layers = len(indices)
        for name in LAYER_PATTERN_ATTRIBUTES:  # every per-layer list keeps the same layers
            value = getattr(config, name, None)
            if isinstance(value, (list, tuple, str)) and len(value) == len(pattern) and \
                    not isinstance(getattr(type(config), name, None), property):
                kept = [value[i] for i in indices]
                updates[name] = "".join(kept) if isinstance(value, str) else kept
    if "kv_lora_rank" in updates and "num_attention_heads" in updates:
        updates["num_key_value_heads"] = updates["num_attention_heads"]  # MLA expands keys to every head
    for name in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
        if name in config.to_dict():
            updates[name] = num_layers
    for name, value in (token_ids or {}).items():
        updates[name] = value
    for name in TOKEN_ID_ATTRIBUTES:
        current = getattr(config, name, None)
        if isinstance(current, int) and current >= vocab_size and name not in (token_ids or {}):
            updates[name] = 0
    if "qk_rope_head_dim" in updates and "head_dim" in updates:
        updates["head_dim"] = updates["qk_rope_head_dim"]  # MLA: head_dim sizes the rotary part
    if "rotary_dim" in config.to_dict():
        updates["rotary_dim"] = 4  # partial rotary (GPT-J, CodeGen): within the tiny head
    if per_layer:  # the kept layers' own sizes, twice the tiny value so they stay distinct from the global one
        kept = indices if pattern is not None else list(range(num_layers))
        by_index = {int(index): layer for index, layer in per_layer.items()}
        updates["per_layer_config"] = {
            new: {name: 2 * SIZE_ATTRIBUTES[name] if name in SIZE_ATTRIBUTES and isinstance(value, int) else value
                  for name, value in by_index[old].items()} for new, old in enumerate(kept) if old in by_index}
    updates.update(overrides or {})
    # Derived attributes (MLA's qk_head_dim, per-layer lists) are computed in __init__: build anew.
    settable = {name: value for name, value in updates.items()
                if not isinstance(getattr(type(config), name, None), property) or name == "per_layer_config"}
    return AutoConfig.for_model(config.model_type, **{**_init_dict(config), **settable})


def _init_dict(config) -> dict:
    """The config's own values, minus what its __init__ derives or refuses as a keyword."""
    values = config.to_dict()
    for name in ("model_type", "transformers_version", "architectures", "_name_or_path"):
        values.pop(name, None)
    return {name: value for name, value in values.items()
            if not isinstance(getattr(type(config), name, None), property)}


def _num_layers(config) -> int:
    return min(int(getattr(config, "num_hidden_layers", 2) or 2), 2)


def _layer_pattern(config):
    for name in LAYER_PATTERN_ATTRIBUTES:
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple, str)) and len(value) > 1 and \
                not isinstance(getattr(type(config), name, None), property):
            return name, value
    return None, None


def _one_of_each(pattern) -> list[int]:
    """Indices of the first layer of each kind, in order, at most ``MAX_LAYERS``, and at least two layers."""
    kept, seen = [], set()
    for index, kind in enumerate(pattern):
        if repr(kind) not in seen:
            seen.add(repr(kind))
            kept.append(index)
    kept = kept[:MAX_LAYERS]
    return kept if len(kept) > 1 else [0, 1]
