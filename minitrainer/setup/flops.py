"""Model FLOPs of a training step, from the model's config alone (pure arithmetic), and the MFU denominator.

    python -m minitrainer.setup.flops --shape Qwen2.5-1.5B --lengths 4096,32768      # GFLOP per trained token

Training FLOPs of one sample of L tokens (the PaLM / torchtitan "model FLOPs", so
recomputation by activation checkpointing is not credited):

    6 N L                                  every weight matrix: 2 FLOPs per weight and token forward,
                                           4 backward (input and weight gradients)
  + 12 sum_layers d_attn P(L, window)      QK^T and PV: 2 d_attn FLOPs each per (query, key) pair
                                           forward, twice that backward

N counts the weight matrices a token passes through: attention and MLP
projections and the LM head, not the input embedding (a lookup). Biases and
norms are elementwise and left out. A MoE layer counts its router, its shared
experts and only ``num_experts_per_tok`` of its routed experts (the active
parameters). ``P(L, w)`` is the number of (query, key) pairs a causal mask
lets through: L (L + 1) / 2, or with a sliding window of w keys,
w (w + 1) / 2 + (L - w) w once L > w. Flash kernels skip the masked half, so
the square is not credited. With frozen base weights (LoRA) the weight
gradients of the base are not computed: 4 N instead of 6 N.

Every count comes from config fields (hidden size, heads, head_dim, intermediate
sizes, expert counts, sliding window / layer_types), never from a list of model
names. Architectures outside that vocabulary (multi-head latent attention, linear
attention) are counted as if they were standard attention.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from minitrainer.common.device import gpu_name, synchronize

if TYPE_CHECKING:
    from minitrainer.methods.base import FineTuningMethod


@dataclass(frozen=True)
class ModelFlops:
    """What the FLOPs of one trained token depend on; built by ``model_flops(config)``."""

    num_matmul_params: int          # every weight matrix but the input embedding (all experts)
    num_active_matmul_params: int   # those a token passes through (MoE: top-k experts only)
    attention_dims: tuple[int, ...]  # per layer: num_attention_heads * head_dim
    attention_windows: tuple[int | None, ...]  # per layer: sliding window in keys, None = full causal


DECODER_SHAPE_ATTRIBUTES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
"""What ``model_flops`` reads without a default: a config without one of them is not counted."""


def _get(config: Any, *names: str, default: Any = None) -> Any:
    """The first of ``names`` the config sets to something other than None."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _moe_layers(config: Any, num_layers: int, num_experts: int) -> list[bool]:
    """Which decoder layers route to experts (Qwen-MoE ``mlp_only_layers``/``decoder_sparse_step``,
    DeepSeek ``first_k_dense_replace``); every layer when the config says nothing."""
    if not num_experts:
        return [False] * num_layers
    dense = set(_get(config, "mlp_only_layers", default=[]))
    step = _get(config, "decoder_sparse_step", default=1) or 1
    first_dense = _get(config, "first_k_dense_replace", default=0)
    return [i not in dense and (i + 1) % step == 0 and i >= first_dense for i in range(num_layers)]


def _attention_windows(config: Any, layers: list[Any]) -> tuple[int | None, ...]:
    """Per-layer sliding window: ``layer_types`` when the config lists them, else ``sliding_window``
    on every layer (Mistral) unless ``use_sliding_window`` is off (Qwen2); each layer's own window."""
    layer_types = _get(config, "layer_types")
    if layer_types is not None:
        return tuple(_get(layer, "sliding_window") if kind == "sliding_attention" else None
                     for layer, kind in zip(layers, layer_types))
    if getattr(config, "use_sliding_window", True) is False:
        return (None,) * len(layers)
    return tuple(_get(layer, "sliding_window") for layer in layers)


def layer_configs(config: Any, num_layers: int) -> list[Any]:
    """One config per decoder layer: ``config.per_layer_config`` where transformers marks the config
    heterogeneous (5.24+: Gemma-4's full-attention layers have their own ``head_dim`` and key/value
    heads, and reading those from the global config raises), else the config itself for every layer."""
    if getattr(config, "is_heterogeneous", False):
        return list(config.per_layer_config)[:num_layers]
    return [config] * num_layers


def model_flops(config: Any) -> ModelFlops:
    """Matmul parameter counts and attention shape of a Hugging Face decoder config.

    Args:
        config: a ``transformers`` config (or any object with the same attributes); a
            multimodal config's ``text_config`` is used when present. Attention and MLP sizes
            are read per layer where the config is heterogeneous (``layer_configs``).

    Returns:
        ModelFlops with total and active matmul parameters and per-layer attention.
    """
    config = _get(config, "text_config", default=config)
    hidden = config.hidden_size
    num_layers = config.num_hidden_layers
    layers = layer_configs(config, num_layers)
    total = active = 0
    attention_dims = []
    for layer, is_moe in zip(layers, _moe_layers(config, num_layers, _num_experts(config)), strict=True):
        num_heads = layer.num_attention_heads
        num_kv_heads = _get(layer, "num_key_value_heads", default=num_heads)
        head_dim = _get(layer, "head_dim", default=hidden // num_heads)
        attn_dim = num_heads * head_dim
        # q and o: hidden x attn_dim each; k and v: hidden x (kv heads * head_dim) each.
        attention = 2 * hidden * attn_dim + 2 * hidden * num_kv_heads * head_dim
        mlp_total, mlp_active = _mlp_params(layer, hidden, is_moe=is_moe)
        total += attention + mlp_total
        active += attention + mlp_active
        attention_dims.append(attn_dim)
    # Per-layer embeddings (Gemma-3n/4 "PLE"): one projection of the hidden state to every layer's slice,
    # then in each layer a gate into its slice and a projection back; the per-layer table is a lookup.
    per_layer_input = _get(config, "hidden_size_per_layer_input", default=0)
    ple = hidden * num_layers * per_layer_input + num_layers * 2 * hidden * per_layer_input
    total += ple
    active += ple
    head = hidden * _head_outputs(config)  # the LM head's matmul runs even when tied to the embedding
    return ModelFlops(num_matmul_params=total + head, num_active_matmul_params=active + head,
                      attention_dims=tuple(attention_dims),
                      attention_windows=_attention_windows(config, layers))


def _head_outputs(config: Any) -> int:
    """The head's outputs: the vocabulary, or a sequence classifier's labels (a reward model's score head)."""
    from minitrainer.model.heads import sequence_classification_class

    return config.num_labels if sequence_classification_class(config) is not None else config.vocab_size


def _num_experts(config: Any) -> int:
    if getattr(config, "enable_moe_block", True) is False:  # Gemma-4 sets an expert count with its MoE block off
        return 0
    return _get(config, "num_experts", "num_local_experts", "n_routed_experts", default=0)


def _mlp_params(layer: Any, hidden: int, *, is_moe: bool) -> tuple[int, int]:
    """``(all, active)`` matmul parameters of one layer's MLP, from that layer's config."""
    intermediate = _get(layer, "intermediate_size", default=4 * hidden)
    if not is_moe:
        return 3 * hidden * intermediate, 3 * hidden * intermediate  # gated MLP: gate, up, down (fused or not)
    num_experts = _num_experts(layer)
    top_k = _get(layer, "num_experts_per_tok", "num_experts_per_token", default=0)
    expert = 3 * hidden * _get(layer, "moe_intermediate_size", default=intermediate)
    shared = 0
    if _get(layer, "shared_expert_intermediate_size"):  # Qwen2-MoE: one shared expert plus its 1-wide gate
        shared = 3 * hidden * layer.shared_expert_intermediate_size + hidden
    elif _get(layer, "n_shared_experts"):  # DeepSeek: n shared experts of the routed experts' width
        shared = layer.n_shared_experts * expert
    router = hidden * num_experts
    return router + shared + num_experts * expert, router + shared + top_k * expert


def matmul_params_of(model: Any, method: FineTuningMethod | None = None) -> int:
    """What ``model_flops`` counts, counted on the model itself: its weight matrices (2-D, or 3-D fused
    experts) but the embedding tables (lookups: the input embedding, Gemma-4's per-layer table), plus
    the LM head's matmul once (tied or not). Biases, norms and sinks are elementwise. A fine-tuning
    method's own parameters count as it says (``FineTuningMethod.added_matrices``: adapters not at all,
    factors as the dense weight they stand for). Sharded parameters (DTensor) report their global size."""
    from torch import nn  # torch: only where a model exists (the shape tables need none)

    from minitrainer.model.heads import output_head

    head = output_head(model).weight
    lookups = {id(module.weight) for module in model.modules() if isinstance(module, nn.Embedding)}
    lookups.add(id(model.get_input_embeddings().weight))
    added, stands_for = method.added_matrices(model) if method is not None else (set(), 0)
    count = sum(p.numel() for name, p in model.named_parameters()
                if p.ndim >= 2 and not name.endswith("bias")
                and id(p) not in lookups and p is not head and id(p) not in added)
    return count + head.numel() + stands_for


def checked_model_flops(model: Any, method: FineTuningMethod | None = None) -> tuple[ModelFlops | None, str]:
    """``model_flops(model.config)`` where it describes exactly the matrices the model holds, else None
    (MFU and model FLOPs are then logged as null rather than guessed: the config-based count does
    not know every layer kind, e.g. MLA projections, linear attention or state-space mixers).
    Never raises on a config it cannot read: FLOPs are an optional metric and must not stop a run.

    Args:
        model: the Hugging Face model (sharded or not).
        method: the fine-tuning method that converted it (``matmul_params_of``); None: full fine-tuning.

    Returns:
        The shape or None, and one line saying which and why, for the start-up log.
    """
    name = type(model).__name__
    try:
        config = _get(model.config, "text_config", default=model.config)
        missing = [attr for attr in DECODER_SHAPE_ATTRIBUTES if _get(config, attr) is None]
        if missing:  # e.g. Mamba, FalconMamba: no attention heads to count (reading them raised at start-up)
            return None, f"FLOPs per token: the config of {name} has no {', '.join(missing)}; {NULL_FLOPS}"
        shape = model_flops(model.config)
    # A config layout this arithmetic does not know: a missing or None size (AttributeError, TypeError),
    # a zero head count (ZeroDivisionError), or transformers refusing a read, as 5.24 does for a per-layer
    # attribute of a heterogeneous config (AmbiguousGlobalPerLayerAttributeError, a RuntimeError).
    except (AttributeError, TypeError, ValueError, ArithmeticError, RuntimeError) as err:
        first_sentence = str(err).split(". ")[0]  # transformers' messages go on with advice for model authors
        return None, (f"FLOPs per token: cannot read the config of {name} ({type(err).__name__}: "
                      f"{first_sentence}); {NULL_FLOPS}")
    real = matmul_params_of(model, method)
    if shape.num_matmul_params != real:
        return None, (f"FLOPs per token: the config of {name} describes {shape.num_matmul_params:,} matrix "
                      f"parameters but the model holds {real:,}; {NULL_FLOPS}")
    return shape, f"FLOPs per token from the config: {shape.num_active_matmul_params:,} active matrix parameters"


NULL_FLOPS = "mfu and model FLOPs are logged as null"


def attended_pairs(length: int, window: int | None = None) -> int:
    """(query, key) pairs a causal mask (with an optional sliding window of ``window`` keys) allows
    in a sample of ``length`` tokens: each query sees itself and up to ``window - 1`` earlier keys."""
    if window is None or length <= window:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def training_flops(shape: ModelFlops, lengths: Sequence[int], *, frozen_base: bool = False) -> float:
    """Model FLOPs of forward plus backward over samples of ``lengths`` tokens (see module docstring).

    Args:
        shape: from ``model_flops``; None where the config does not describe the model (the FLOPs
            keys are then None).
        lengths: real (unpadded) sample lengths, e.g. every packed row's samples of one step.
        frozen_base: the base weights get no gradient (``FineTuningMethod.frozen_base``), so matmuls
            cost 4 N per token, not 6 N.
    """
    num_tokens = int(sum(lengths))
    per_weight = 4 if frozen_base else 6
    attention = 0
    for length in lengths:
        for dim, window in zip(shape.attention_dims, shape.attention_windows, strict=True):
            attention += dim * attended_pairs(int(length), window)
    return float(per_weight * shape.num_active_matmul_params * num_tokens + 12 * attention)


def speed_metrics(shape: ModelFlops | None, lengths: Sequence[int], *, num_loss_counted_tokens: int, seconds: float,
                  world_size: int, peak_tflops: float | None, frozen_base: bool = False) -> dict:
    """The throughput keys of one step's metrics line.

    Args:
        shape: from ``model_flops``; None where the config does not describe the model (the FLOPs
            keys are then None).
        lengths: every real sample of the step, all ranks.
        num_loss_counted_tokens: targets that count in the loss, all ranks.
        seconds: the step's wall time.
        world_size: number of devices the step ran on.
        peak_tflops: one device's peak dense bf16 rate, or None where unknown (CPU): ``mfu`` is then None.

    Returns:
        ``mfu``, ``model_flops_per_token``, ``model_tflops_per_second_per_gpu``,
        ``loss_tokens_per_second`` and ``loss_tokens_per_second_per_gpu``.
    """
    num_tokens = int(sum(lengths))
    if shape is None:
        per_device = flops = None
    else:
        flops = training_flops(shape, lengths, frozen_base=frozen_base)
        per_device = flops / seconds / world_size if seconds > 0 else float("nan")
    return {
        "mfu": per_device / (peak_tflops * 1e12) if peak_tflops and per_device is not None else None,
        "model_flops_per_token": flops / num_tokens if num_tokens and flops is not None else None,
        "model_tflops_per_second_per_gpu": per_device / 1e12 if per_device is not None else None,
        "loss_tokens_per_second": num_loss_counted_tokens / seconds if seconds > 0 else float("nan"),
        "loss_tokens_per_second_per_gpu": num_loss_counted_tokens / seconds / world_size if seconds > 0
        else float("nan"),
    }


# ----------------------------------------------------------------------------
# The MFU denominator: one device's peak bf16 rate


# Dense (no sparsity) bf16 tensor-core peaks from the vendors' data sheets, in TFLOP/s. The first
# entry whose every word appears in torch's device name wins, so the specific names come first.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),   # SXM5 ("NVIDIA H100 80GB HBM3")
    ("H800 PCIe", 756.0),
    ("H800", 989.4),
    ("H200 NVL", 835.0),
    ("H200", 989.4),   # same SXM5 compute as the H100
    ("GH200", 989.4),
    ("B200", 2250.0),
    ("B100", 1750.0),
    ("A100", 312.0),   # SXM4 and PCIe, 40 and 80 GB
    ("A800", 312.0),
    ("L40S", 362.05),
    ("L40", 181.05),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("A6000 Ada", 364.2),
    ("A6000", 154.8),
    ("MI300X", 1307.4),
    ("MI325X", 1307.4),
    ("MI250X", 383.0),
)


def peak_bf16_tflops_for(name: str) -> float | None:
    """The data-sheet dense bf16 peak of a device named ``name`` (as torch names it), or None."""
    words = name.replace("-", " ").split()
    for key, tflops in PEAK_BF16_TFLOPS:
        if all(word in words for word in key.split()):
            return tflops
    return None


def measure_bf16_matmul_tflops(device: Any, *, n: int = 8192, iters: int = 20) -> float | None:
    """Sustained rate of an ``n``^3 bf16 matmul on ``device`` in TFLOP/s; None on CPU, where no
    meaningful peak exists (MFU is reported as null there rather than guessed)."""
    return time_bf16_matmul(device, n=n, iters=iters) if device.type == "cuda" else None


def time_bf16_matmul(device: Any, *, n: int, iters: int = 20) -> float:
    """TFLOP/s of ``iters`` ``n``^3 bf16 matmuls on any device (gpu_check times the CPU too)."""
    import time

    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    synchronize()  # CPU-GPU sync point: the timed region ends here
    return 2 * n**3 * iters / (time.perf_counter() - start) / 1e12


def device_peak_tflops(device: Any) -> tuple[float | None, str]:
    """One device's peak bf16 rate for MFU and where it came from: the data sheet of a known GPU,
    else one 8192^3 matmul measured now; (None, reason) on CPU."""
    if device.type != "cuda":
        return None, "no GPU: MFU is logged as null"
    name = gpu_name()
    known = peak_bf16_tflops_for(name)
    if known is not None:
        return known, f"{name}: data-sheet dense bf16 peak {known:g} TFLOP/s"
    measured = measure_bf16_matmul_tflops(device)
    return measured, f"{name} is not in flops.PEAK_BF16_TFLOPS: measured 8192^3 bf16 matmul {measured:.0f} TFLOP/s"


def main(argv: list[str] | None = None) -> None:
    """Print GFLOP per trained token of a bench shape or a local/hub config at given sample lengths."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--shape", default="Qwen2.5-1.5B", help="a shape of model/shapes.py")
    parser.add_argument("--model-name-or-path", default=None, help="read this config instead of --shape")
    parser.add_argument("--lengths", default="4096,32768", help="comma-separated sample lengths")
    args = parser.parse_args(argv)
    if args.model_name_or_path:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(args.model_name_or_path)
    else:
        from minitrainer.model.shapes import model_config

        config = model_config(args.shape)
    shape = model_flops(config)
    print(f"{args.model_name_or_path or args.shape}: {shape.num_active_matmul_params / 1e9:.4f} B active matmul "
          f"parameters ({shape.num_matmul_params / 1e9:.4f} B in all); 6N = "
          f"{6 * shape.num_active_matmul_params / 1e9:.3f} GFLOP/token")
    for length in (int(n) for n in args.lengths.split(",")):
        print(f"  one sample of {length} tokens: {training_flops(shape, [length]) / length / 1e9:.3f} GFLOP/token")


if __name__ == "__main__":
    main()
