"""A fine-tuning method: what the model becomes, what trains, what runs around the optimizer step, what an
export writes, what a resume compares. ``FineTuningMethod`` is the interface and, as it stands, full
fine-tuning: every hook does what training all the weights needs, which is mostly nothing.

The other methods are one module each, a subclass overriding the hooks it needs:

    lora.py   LoRA      peft adapters on a frozen base; merged and adapter exports
    qlora.py  QLoRA     LoRA whose frozen base is NF4 (torchao); rank 0 quantizes, the bytes are broadcast
    osft.py   OSFT      weights split into frozen and trainable SVD factors; projections around the step

``TrainConfig.fine_tuning_method`` is the one place that picks a method from the flags; nothing else
names one. Where each hook runs::

    setup_run            preflight (rank 0, before any weight is read), fingerprint, describe, param_groups
    setup_model_fsdp     convert_loaded (rank 0's loaded model) -> convert (meta model) -> [kernels, AC,
                         compile] -> ignored_params -> fully_shard -> hold_back -> broadcast -> fill
    train_step           before_clip (after backward), after_update (after optimizer.step); frozen_base (FLOPs)
    hf_export            gather_full_state, export_state
    full_state           saves_frozen_weights
    flops                added_matrices

docs/code-layout.md, "How to add a fine-tuning method", walks through a new one.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from minitrainer.model.multimodal import MultimodalExport


@dataclass(frozen=True)
class ModelBuild:
    """What ``setup.model.setup_model`` has resolved when it calls a method's model hooks."""

    model_name_or_path: str
    multimodal_export: MultimodalExport | None  # how an image-text-to-text checkpoint is exported; None: causal LM
    shard_size: int                 # ranks each parameter is split across (the FSDP mesh's last dimension)
    param_dtype: torch.dtype        # the compute dtype (bf16 on GPU, fp32 on CPU)
    device: torch.device            # this rank's device: where collectives run
    weights_device: torch.device    # where the sharded parameters live (the host under --cpu-offload)


NO_DECAY_NAME_PATTERNS = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
"""transformers' ``Trainer.get_decay_parameter_names`` (which TRL and axolotl use): a parameter whose lowercased
name matches one of these, or that belongs to an ``nn.LayerNorm``, gets no weight decay."""


def param_groups(model: nn.Module, *, weight_decay: float) -> list[dict]:
    """AdamW's parameter groups: weight matrices and embeddings decay by ``weight_decay``; biases and
    norm weights do not (transformers' Trainer convention, ``NO_DECAY_NAME_PATTERNS``). Only trainable
    parameters get optimizer state (with LoRA: the adapters alone). At ``--weight-decay 0`` there is one
    group, as before the split, so full states of such runs still load (DCP restores groups by position)."""
    patterns = [re.compile(pattern) for pattern in NO_DECAY_NAME_PATTERNS]
    layer_norms = {id(p) for module in model.modules() if isinstance(module, nn.LayerNorm)
                   for p in module.parameters(recurse=False)}
    trainable = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    if weight_decay == 0:
        return [{"params": [param for _, param in trainable], "weight_decay": 0.0}]
    decay, no_decay = [], []
    for name, param in trainable:
        exempt = id(param) in layer_norms or any(pattern.search(name.lower()) for pattern in patterns)
        (no_decay if exempt else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; works on meta and sharded models (global counts)."""
    trainable = total = 0
    for param in model.parameters():
        numel = param.numel()
        total += numel
        trainable += numel if param.requires_grad else 0
    return trainable, total


class FineTuningMethod:
    """Full fine-tuning, and the hooks every method may override (module docstring: where each runs)."""

    frozen_base = False
    """FLOPs: True when the base weights get no gradient, so their matmuls cost 4 N per token, not 6 N."""

    acts_after_update = False
    """True when ``after_update`` does work: the host must then know whether the step ran, so the optimizer
    cannot skip a non-finite step on the device alone (``loop/step.py``)."""

    def describe(self) -> str:
        """What the start-up line on trainable parameters adds (", LoRA rank 16, ..."); empty here."""
        return ""

    def fingerprint(self) -> dict:
        """Fields of the resume fingerprint (``resume_policy.fingerprint``): a checkpoint whose fields differ
        holds parameters of other shapes or meaning and is never resumed. A field absent here counts as None."""
        return {}

    def preflight(self, model_config, *, meta_model: Callable[[], nn.Module], shard_size: int) -> str | None:
        """Rank 0, before any weight is read: why this model cannot take the method (one line), or None.
        ``meta_model()`` is the architecture on the meta device, built once for every check."""
        return None

    def convert_loaded(self, model: nn.Module, build: ModelBuild) -> None:
        """Rank 0, first: change the model loaded from the checkpoint as ``convert`` changes the meta model.
        Whatever it initialises from the seeded RNG (adapters) reaches the other ranks with the weights."""

    def convert(self, model: nn.Module, build: ModelBuild) -> None:
        """Change the meta model in place (every rank), before kernels, AC, compile and ``fully_shard``:
        the layers it replaces or wraps, and which parameters train (``requires_grad``)."""

    def ignored_params(self, model: nn.Module, build: ModelBuild) -> set[nn.Parameter]:
        """Parameters ``fully_shard`` must leave alone."""
        return set()

    def weights_it_fills(self, model: nn.Module) -> set[str]:
        """Keys of the sharded model's state dict that ``fill`` fills rather than the broadcast."""
        return set()

    def hold_back(self, model: nn.Module, full_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rank 0: remove from the loaded state dict, and return, what ``fill`` takes instead of the broadcast."""
        return {}

    def fill(self, model: nn.Module, held: dict[str, torch.Tensor], build: ModelBuild) -> None:
        """Collective, after the broadcast: fill ``weights_it_fills`` from rank 0's ``held`` ({} elsewhere)."""

    def param_groups(self, model: nn.Module, *, weight_decay: float) -> list[dict]:
        """The optimizer's parameter groups over the trainable parameters."""
        return param_groups(model, weight_decay=weight_decay)

    def before_clip(self, model: nn.Module, *, device: torch.device) -> None:
        """After backward, before the gradient norm is measured and clipped (collective)."""

    def after_update(self, model: nn.Module, *, device: torch.device) -> None:
        """After ``optimizer.step()`` (collective)."""

    def saves_frozen_weights(self, model: nn.Module) -> bool:
        """A full state holds the frozen parameters too; else a resume reloads them from the model itself."""
        return False

    def gather_full_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """All-gather the model's state dict into rank 0's host memory (empty on other ranks); collective.
        ``cpu_offload`` moves each tensor off the device as it arrives: a large model never needs its full
        size in device memory."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def export_state(self, state: dict[str, torch.Tensor], folder: Path, *, multimodal_export: MultimodalExport | None,
                     dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
        """Rank 0: the gathered state as the original model's state dict, the export's weights (the export casts
        them to ``dtype``, ``--save-dtype``); files of the method's own (a peft adapter) go into ``folder``, in
        ``dtype`` where they are the export's only weights. None: the export holds no model weights."""
        return state

    def added_matrices(self, model: nn.Module) -> tuple[set[int], int]:
        """FLOPs: ``(ids of the parameters the method added, which the model's config knows nothing of;
        the entries of the dense weight matrices they stand for)``."""
        return set(), 0
