"""``--optimizer-diagnostics``: each step's gradient norm and update-to-weight norm ratio, per parameter kind.

    torchrun --nproc-per-node=2 train.py ... --optimizer-diagnostics
    python train.py ... --optimizer-diagnostics        # one process, CPU included

Each step's metrics line then gains ``grad_norm/<kind>`` and ``update_ratio/<kind>`` for every kind that has
trainable parameters, among ``KINDS``. A parameter's kind comes from where it sits in the model, found once at
start-up (``parameter_kinds``), so a LoRA matrix inside ``q_proj`` is attention.

What a step costs, only with the flag on: one copy of this rank's shards of the trainable weights (from just
before ``optimizer.step()`` to just after it) and a few batched norms; the sums of all ranks ride on the step's
one all-reduce (``loop/step.reduce_step``), so there is no collective and no synchronisation of their own::

    before_update   grad^2 per kind (the gradient the optimizer sees: clipped), copy of W (local shards)
    optimizer.step()
    after_update    (W_after - W_before)^2 and W_before^2 per kind -> [3 * num_kinds] float64, local
    reduce_step     summed over ranks with the step's other sums
    metrics         grad_norm/<kind> = sqrt(sum grad^2);  update_ratio/<kind> = ||W_after - W_before|| / ||W_before||
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from minitrainer.common.log import log_rank_0
from minitrainer.model.heads import output_head
from minitrainer.model.loss import find_decoder_blocks

KINDS = ("attention", "mlp", "embeddings", "head", "norms", "other")
"""Every kind, in the order the metrics line lists them."""

ATTENTION_NAMES = ("attention",)
MLP_NAMES = ("mlp", "moe", "expert")
"""What the class name of a decoder block's child contains (case-insensitive) when it is that block's attention
or its feed-forward (dense, mixture of experts, its experts)."""


def parameter_kinds(model: nn.Module) -> dict[str, str]:
    """The kind of every parameter of the Hugging Face ``model``, by name (tied weights once, under their first).

    Strongest first: the input embeddings (a head tied to them counts as embeddings), the output embeddings
    (head), the weights of normalization modules (norms, also the q/k norms inside an attention module), the
    parameters under a decoder block's child whose class says it is attention or feed-forward (``ATTENTION_NAMES``,
    ``MLP_NAMES``; a sharded model's blocks are the modules ``fully_shard`` wrapped), and ``other``.
    """
    kinds: dict[int, str] = {}
    for block in _decoder_blocks(model):
        for child in block.children():
            kind = _block_child_kind(child)
            for param in child.parameters() if kind else ():
                kinds[id(param)] = kind
    for module in model.modules():
        if _is_norm(module):
            for param in module.parameters(recurse=False):
                kinds[id(param)] = "norms"
    for kind, module in (("head", output_head(model) if hasattr(model, "get_output_embeddings") else None),
                         ("embeddings", _embeddings(model, "get_input_embeddings"))):
        for param in module.parameters() if module is not None else ():
            kinds[id(param)] = kind
    return {name: kinds.get(id(param), "other") for name, param in model.named_parameters()}


def build_diagnostics(model: nn.Module, *, enabled: bool, device: torch.device) -> Diagnostics | None:
    """The run's diagnostics over the trainable parameters of the (sharded) Hugging Face ``model``, or None when
    off (then nothing of this module runs in a step). ``device``: where the step's sums are all-reduced."""
    if not enabled:
        return None
    kind_of = parameter_kinds(model)
    trainable = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    if not trainable:
        log_rank_0("--optimizer-diagnostics: the model has no trainable parameters; no diagnostics are logged",
                   level=logging.WARNING)
        return None
    counts: dict[str, int] = {}
    for name, param in trainable:
        counts[kind_of[name]] = counts.get(kind_of[name], 0) + param.numel()
    log_rank_0("optimizer diagnostics per kind (trainable parameters): " + ", ".join(
        f"{kind} {counts[kind]:,}" for kind in KINDS if kind in counts))
    return Diagnostics([param for _, param in trainable], [kind_of[name] for name, _ in trainable], device=device)


@dataclass
class BeforeUpdate:
    """What ``after_update`` compares with: this rank's part of the step before ``optimizer.step()``."""

    weights: list[torch.Tensor]  # copies of this rank's shards of the trainable weights
    grad_sums: torch.Tensor      # [num_kinds] float64: sum of grad^2 per kind, this rank's share


class Diagnostics:
    """Per-kind sums of one step over this rank's shards, and the metrics from their sums over all ranks.

    Every rank holds its parameters' shards (``Shard(0)`` DTensors) or, for a plain tensor, the whole of it. A
    sum over all ranks of the default group counts each element once per copy: the replicas of HYBRID_SHARD's
    and NO_SHARD's ``Replicate`` mesh dimension, every rank for a plain tensor. Each parameter's local sums are
    weighted by one over its number of copies, so the one all-reduce over all ranks gives each element once.
    """

    def __init__(self, params: list[torch.Tensor], kinds: list[str], *, device: torch.device) -> None:
        self.params = params
        self.kinds = [kind for kind in KINDS if kind in kinds]
        self.device = device
        self.local_device = _local(params[0]).device  # the host with --cpu-offload
        self.index = torch.tensor([self.kinds.index(kind) for kind in kinds], device=self.local_device)
        self.weights = torch.tensor([1.0 / _num_copies(param) for param in params], dtype=torch.float64,
                                    device=self.local_device)

    @torch.no_grad()
    def before_update(self) -> BeforeUpdate:
        """Right before ``optimizer.step()``: the gradients as it sees them (after clipping), a copy of the weights."""
        grads = [None if param.grad is None else _local(param.grad) for param in self.params]
        return BeforeUpdate(weights=[_local(param).detach().clone() for param in self.params],
                            grad_sums=self._sums_of_squares(grads))

    @torch.no_grad()
    def after_update(self, before: BeforeUpdate) -> torch.Tensor:
        """Right after the update (and the method's ``after_update``, which is part of it).

        Returns:
            [3 * num_kinds] float64 on ``device``: this rank's weighted sums of grad^2, (W_after - W_before)^2 and
            W_before^2 per kind, to be summed over all ranks (``metrics`` reads the sums).
        """
        weight_sums = self._sums_of_squares(before.weights)
        # In place: the copy is spent once the difference is taken.
        torch._foreach_sub_(before.weights, [_local(param).detach() for param in self.params])
        update_sums = self._sums_of_squares(before.weights)
        return torch.cat([before.grad_sums, update_sums, weight_sums]).to(self.device, non_blocking=True)

    def metrics(self, totals: list[float] | tuple[float, ...], *, applied: bool) -> dict[str, float | None]:
        """The metrics line's keys from ``after_update``'s sums over all ranks; a skipped step moved nothing
        (ratio 0). A kind whose weights are all zero has no ratio (None, written as null)."""
        num = len(self.kinds)
        grads, updates, weights = totals[:num], totals[num:2 * num], totals[2 * num:3 * num]
        record: dict[str, float | None] = {f"grad_norm/{kind}": math.sqrt(grad)
                                           for kind, grad in zip(self.kinds, grads)}
        for kind, update, weight in zip(self.kinds, updates, weights):
            record[f"update_ratio/{kind}"] = (0.0 if not applied else None if weight <= 0
                                              else math.sqrt(update / weight))
        return record

    def _sums_of_squares(self, tensors: list[torch.Tensor | None]) -> torch.Tensor:
        """[num_kinds] float64: the weighted sum of squares of ``tensors`` (one per parameter; None: no gradient)."""
        present = [tensor for tensor in tensors if tensor is not None]
        # Batched, as clip_grad_norm_ does: one kernel per device and dtype rather than one per tensor.
        norms = iter(torch._foreach_norm(present) if present else ())
        zero = torch.zeros((), device=self.local_device)
        squares = torch.stack([zero if tensor is None else next(norms).to(self.local_device)
                               for tensor in tensors]).double().square()
        sums = torch.zeros(len(self.kinds), dtype=torch.float64, device=self.local_device)
        return sums.index_add_(0, self.index, squares * self.weights)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _num_copies(param: torch.Tensor) -> int:
    """How many ranks of the default group hold each element of ``param``: its mesh's replicas (FSDP2's mesh
    spans the whole job), or every rank for a tensor that is not sharded."""
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        return math.prod(mesh.size(dim) for dim, placement in enumerate(param.placements)
                         if placement.is_replicate())
    return dist.get_world_size() if dist.is_initialized() else 1


def _decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks ``setup_model`` sharded one by one (``fully_shard`` renames their classes, so
    ``find_decoder_blocks`` would no longer recognise them); an unsharded model's found as it finds them. None
    found: one warning, and attention and feed-forward weights count as ``other``."""
    sharded = [module for module in model.modules() if isinstance(module, FSDPModule) and module is not model]
    if sharded:
        return sharded
    try:
        return find_decoder_blocks(model)
    except ValueError as err:
        log_rank_0(f"--optimizer-diagnostics: {err}; attention and MLP weights are counted as 'other'",
                   level=logging.WARNING)
        return []


def _block_child_kind(child: nn.Module) -> str | None:
    name = type(child).__name__.lower()
    if any(part in name for part in ATTENTION_NAMES):
        return "attention"
    if any(part in name for part in MLP_NAMES):
        return "mlp"
    return None


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith("Norm")


def _embeddings(model: nn.Module, getter: str) -> nn.Module | None:
    """``model.get_input_embeddings()`` or ``get_output_embeddings()``; None where the model has none."""
    try:
        return getattr(model, getter)()
    except (AttributeError, NotImplementedError):  # transformers raises the latter for a model without them
        return None
