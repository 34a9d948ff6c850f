"""LoRA through peft: low-rank adapters on the decoder's linear layers, base weights frozen.

    torchrun --nproc-per-node=2 train.py ... --lora-rank 16 --lora-alpha 32

peft injects its ``LoraLayer`` modules into the Hugging Face model in place,
so the model keeps its class (``get_decoder``, ``get_output_embeddings`` and
the loss module work unchanged) and each decoder block holds its frozen base
weights and its trainable adapters together: ``fully_shard`` per block gathers
both in one collective, and only the adapters get gradients, reductions and
optimizer state. Inside the model a targeted ``q_proj`` becomes::

    q_proj.base_layer.weight          frozen, [out, in]
    q_proj.lora_A.default.weight      trainable, [r, in]
    q_proj.lora_B.default.weight      trainable, [out, r], zero at start

so the forward is ``W x + scaling * B (A x)`` with ``scaling = alpha / r``
(``alpha / sqrt(r)`` with rsLoRA). This module maps that layout to the two
files users load (``export_states``): peft's adapter format and a merged
model whose ``W' = W + scaling * B @ A`` carries the original key names.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from utils import comma_list

ADAPTER_NAME = "default"
ALL_LINEAR = "all-linear"
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\." + ADAPTER_NAME + r"\.weight$")
_BASE_LAYER = ".base_layer."


@dataclass(frozen=True)
class LoraSettings:
    """The LoRA flags of ``TrainConfig``, resolved."""

    rank: int
    alpha: float
    dropout: float
    target_modules: str
    use_rslora: bool
    merge_on_export: bool = True
    quantize_data_type: str = "none"  # "nf4": QLoRA, base weights of adapted layers in NF4 (qlora.py)

    def peft_config(self, model: nn.Module | None = None):
        """peft's ``LoraConfig``; with a model, ``all-linear`` becomes the names of its plain ``nn.Linear`` layers.

        peft's own ``all-linear`` also wraps MoE experts stored as fused 3-D parameters
        (transformers 5), whose adapters have no ``W + B @ A`` merge into the original keys.
        """
        from peft import LoraConfig

        targets = self.target_modules
        if targets != ALL_LINEAR:
            targets = comma_list(targets)
        elif model is not None:
            head = model.get_output_embeddings()
            targets = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                              if _is_projection(module) and module is not head})
        # GPT-2-style Conv1D stores its weight as [in, out]: peft must know, and so must the merged export.
        fan_in_fan_out = model is not None and _targets_are_conv1d(model, targets)
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=targets,
                          use_rslora=self.use_rslora, bias="none", task_type="CAUSAL_LM",
                          fan_in_fan_out=fan_in_fan_out)


def _is_projection(module: nn.Module) -> bool:
    """A plain linear map peft's LoRA layer can wrap: ``nn.Linear`` or transformers' ``Conv1D``.

    A Linear subclass with its own forward (Llama-4's router returns (scores, logits)) is not:
    its output is not one tensor.
    """
    from transformers.pytorch_utils import Conv1D

    return (isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward) or isinstance(module, Conv1D)


def _targets_are_conv1d(model: nn.Module, targets) -> bool:
    from transformers.pytorch_utils import Conv1D

    names = set(targets) if not isinstance(targets, str) else set()
    kinds = {isinstance(module, Conv1D) for name, module in model.named_modules()
             if name.rsplit(".", 1)[-1] in names and _is_projection(module)}
    return kinds == {True}


def apply_lora(model: nn.Module, settings: LoraSettings):
    """Inject adapters into ``model`` in place and freeze everything else.

    Works on a meta-device model too (the adapters are then meta as well).

    Returns:
        The resolved ``peft.LoraConfig`` (``target_modules`` expanded to the
        module names it matched), which the adapter export saves.

    Raises:
        ValueError: nothing matched, a target is not a linear layer, or peft
            refuses the architecture; one line, naming the flag.
    """
    from peft import get_peft_model

    try:
        peft_model = get_peft_model(model, settings.peft_config(model))
    except (ValueError, TypeError, NotImplementedError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"--lora-target-modules {settings.target_modules}: peft cannot adapt "
                         f"{type(model).__name__} ({first})") from err
    config = peft_model.peft_config[ADAPTER_NAME]
    from transformers.pytorch_utils import Conv1D

    adapted = [m for m in model.modules() if hasattr(m, "lora_A")]
    bases = [m.get_base_layer() for m in adapted]
    not_linear = sorted({type(m).__name__ for m, base in zip(adapted, bases)
                         if not isinstance(base, (nn.Linear, Conv1D))})
    if not_linear:
        raise ValueError(f"--lora-target-modules {settings.target_modules} matches {', '.join(not_linear)} "
                         "layers; only linear layers can be adapted and merged here")
    if len({isinstance(base, Conv1D) for base in bases}) > 1:
        # One adapter config holds one weight layout, which the merged export follows.
        raise ValueError(f"--lora-target-modules {settings.target_modules} matches both nn.Linear and Conv1D "
                         "layers; name the modules of one kind")
    if hasattr(model.get_output_embeddings(), "lora_A"):
        # The loss multiplies the hidden states by the head's weight itself (chunked or Liger
        # cross-entropy), so an adapter on the head would be silently left out of every step.
        raise ValueError(f"--lora-target-modules {settings.target_modules} adapts the LM head, which the "
                         "loss reads as a plain weight: leave it out (all-linear already does)")
    # peft swapped the modules inside ``model`` in place; the PeftModel shell is not needed.
    return config


def lora_preflight(model_config, settings: LoraSettings, *, shard_size: int = 1) -> str | None:
    """Adapt (and quantize, for QLoRA) a meta-device copy of the architecture: the error line, or None.

    No memory and no weights are touched. ``shard_size`` is the FSDP shard group's
    size, which decides which weights split into whole NF4 groups.
    """
    from multimodal import auto_model_class, detach_non_text, is_multimodal

    with torch.device("meta"):
        model = auto_model_class(model_config).from_config(model_config)
    if is_multimodal(model_config):
        detach_non_text(model)  # adapters go on the language model only, as in training
    try:
        apply_lora(model, settings)
        if settings.quantize_data_type != "none":
            from qlora import quantize_base_weights

            quantize_base_weights(model, shard_size=shard_size, dtype=torch.float32)
    except ValueError as err:
        return str(err)
    return None


def lora_scaling(config) -> float:
    """The factor of ``B @ A`` in peft's forward, from a ``peft.LoraConfig``."""
    return config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; works on meta and sharded models (global counts)."""
    trainable = total = 0
    for param in model.parameters():
        numel = param.numel()
        total += numel
        trainable += numel if param.requires_grad else 0
    return trainable, total


def export_states(state: dict[str, torch.Tensor], *, scaling: float,
                  fan_in_fan_out: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split a gathered state dict of the adapted model into (merged model, peft adapter).

    Args:
        state: full state dict of the model with injected adapters (keys as in
            the module docstring).
        scaling: ``alpha / r`` (or rsLoRA's ``alpha / sqrt(r)``).
        fan_in_fan_out: the base layers store ``[in, out]`` (GPT-2's Conv1D).

    Returns:
        ``merged``: the original model's key names, every adapted weight
        replaced by ``W + scaling * B @ A`` computed in fp32; ``adapter``:
        peft's ``adapter_model.safetensors`` keys
        (``base_model.model.<module>.lora_A.weight``).
    """
    factors: dict[str, dict[str, torch.Tensor]] = {}
    merged: dict[str, torch.Tensor] = {}
    adapter: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        match = _LORA_KEY.match(key)
        if match:
            factors.setdefault(match["module"], {})[match["which"]] = tensor
            adapter[f"base_model.model.{match['module']}.lora_{match['which']}.weight"] = tensor
        else:
            merged[key.replace(_BASE_LAYER, ".")] = tensor
    for module, pair in factors.items():
        key = f"{module}.weight"
        delta = (pair["B"].float() @ pair["A"].float()) * scaling  # [out, r] @ [r, in] = [out, in]
        if fan_in_fan_out:
            delta = delta.T
        merged[key] = (merged[key].float() + delta).to(merged[key].dtype)
    return merged, adapter
