"""Orthogonal Subspace Fine-Tuning (OSFT): fine-tune while each weight's top singular directions stay frozen.

Each target weight W (N x M, r = min(N, M)) is split by an SVD, W = U diag(S) V^T, into::

    frozen     U_high (N x k)      S_high (k)      V_high (M x k)       the k largest directions
    trainable  U_low  (N x r-k)    S_low  (r-k)    V_low  (M x r-k)     the rest

with k = floor(r * (1 - unfreeze_rank_ratio)), at most r - 1. ``OSFTLinear`` computes
y = x W^T + b with W = U_high S_high V_high^T + U_low S_low V_low^T, either through the factors or by
rebuilding W first, whichever costs fewer FLOPs for the call's token count (training: rebuilding).
Training keeps U_low orthogonal to U_high and V_low to V_high: the gradients are projected before
clipping (``project_gradients``), the parameters again after the optimizer step
(``project_parameters``), because AdamW's per-element scaling moves a projected gradient back into
the frozen subspace. ``osft_export_state`` writes W back under ``<module>.weight``.

Ratio 1.0 freezes nothing: no module is replaced and the model is untouched (OSFT off). Ratio 0.0
leaves one trainable direction per matrix. Matrices whose k is 0 (rank-1 gates) stay ``nn.Linear``.

Sharded start-up (FSDP2)::

    targets = osft_targets(model, blocks=find_decoder_blocks(model), patterns=None)   # meta model
    apply_osft(model, targets, unfreeze_rank_ratio=0.25)    # meta shells, before fully_shard
    fully_shard(...); model.to_empty(...)                   # factors sharded on dim 0
    fill_osft_factors(model, dense_weights_on_rank_0)       # SVDs split across ranks by FLOPs

Tests: ``.venv/bin/python -m pytest -q tests/test_osft.py``.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import time
from pathlib import Path
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from minitrainer.common.device import peak_memory_gb, reset_peak_memory
from minitrainer.common.log import log_rank_0
from minitrainer.methods.base import FineTuningMethod, ModelBuild
from minitrainer.model.loss import find_decoder_blocks

# torch.distributed.tensor (0.4 s) is imported where a sharded factor is met: every --config or flag check imports
# this module through the methods' registry, and a launcher that only checks flags never shards anything.

FROZEN = ("U_high", "S_high", "V_high")
TRAINABLE = ("U_low", "S_low", "V_low")
FACTORS = FROZEN + TRAINABLE
EXPERT_COUNT_ATTRIBUTES = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def num_frozen_directions(out_features: int, in_features: int, unfreeze_rank_ratio: float) -> int:
    """k = floor(r * (1 - ratio)), capped at r - 1 so at least one direction trains; 0 at ratio 1.0."""
    if not 0.0 <= unfreeze_rank_ratio <= 1.0:
        raise ValueError(f"--osft-unfreeze-rank-ratio must lie in [0, 1], got {unfreeze_rank_ratio}")
    rank = min(out_features, in_features)
    # The 1e-9 keeps a product that lands a rounding error below an integer (64 * (1 - 0.75)) on it.
    return min(math.floor(rank * (1.0 - unfreeze_rank_ratio) + 1e-9), rank - 1)


UPCAST_DTYPES = {"float32": torch.float32, "float64": torch.float64}
RECONSTRUCTION_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10}
"""Largest relative error ||U S V^T - W|| / ||W|| accepted at start-up per factor dtype (measured
~1e-6 in fp32): far below a wrong factor, a transposed V or a swapped shard, which give O(1)."""


@dataclass(frozen=True)
class OSFTSettings:
    """What ``--osft`` and its flags resolve to (``TrainConfig.osft``)."""

    unfreeze_rank_ratio: float
    target_patterns: list[str] | None  # None: every nn.Linear of the decoder blocks
    upcast_dtype: torch.dtype

    def describe(self) -> str:
        targets = ",".join(self.target_patterns) if self.target_patterns else "every linear layer of the decoder blocks"
        return (f"OSFT: unfreeze rank ratio {self.unfreeze_rank_ratio:g} on {targets}, SVD in "
                f"{str(self.upcast_dtype).removeprefix('torch.')}")


def osft_targets(model: nn.Module, *, blocks: list[nn.Module], patterns: list[str] | None = None) -> list[str]:
    """Names of the ``nn.Linear`` modules whose weights OSFT decomposes.

    Default: every ``nn.Linear`` inside the decoder blocks (attention and MLP projections, whatever
    the family calls them), except MoE routers, recognised as out-features equal to the config's
    expert count. Embeddings, the LM head, norms, biases and fused 3-D expert weights are never
    targets: they train normally.

    Args:
        model: the causal LM (a meta model is fine: only structure is read).
        blocks: its decoder blocks (``loss.find_decoder_blocks``).
        patterns: ``--osft-target-patterns``: each a substring of the module name, or an fnmatch
            glob when it holds ``*?[`` (``q_proj``, ``*.mlp.down_proj``); replaces the default, and
            may select any ``nn.Linear`` except the embeddings and LM head.

    Returns:
        Module names in ``named_modules`` order; ``<name>.weight`` is the decomposed weight.
    """
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    expert_counts = {getattr(config, name, None) for name in EXPERT_COUNT_ATTRIBUTES} - {None}
    embeddings = []
    if hasattr(model, "get_input_embeddings"):  # a Hugging Face model (tests also pass plain nn.Modules)
        embeddings = [m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None]
    in_blocks = {id(sub) for block in blocks for sub in block.modules()}
    names, used = [], set()
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or any(module is e for e in embeddings):
            continue
        if patterns:
            hits = {p for p in patterns if (fnmatch.fnmatchcase(name, p) if any(c in p for c in "*?[") else p in name)}
            used |= hits
            if hits:
                names.append(name)
        elif id(module) in in_blocks and module.out_features not in expert_counts:
            names.append(name)
    unused = [p for p in (patterns or []) if p not in used]
    if unused:
        raise ValueError(f"--osft-target-patterns: {unused} match no nn.Linear module of {type(model).__name__}")
    return names


@dataclass
class OSFTFactors:
    """One weight's SVD split: W = U_high diag(S_high) V_high^T + U_low diag(S_low) V_low^T."""

    U_high: torch.Tensor  # (N, k)
    S_high: torch.Tensor  # (k,)
    V_high: torch.Tensor  # (M, k)
    U_low: torch.Tensor  # (N, r-k)
    S_low: torch.Tensor  # (r-k,)
    V_low: torch.Tensor  # (M, r-k)
    exact_solver_redid: bool = False  # the fast GPU SVD missed svd_tolerance and gesvd redid it


def svd_tolerance(shape: tuple[int, int], dtype: torch.dtype) -> float:
    """Relative reconstruction error above which an SVD is redone exactly: 2 eps sqrt(max(N, M)).

    An exact (backward-stable) SVD still rounds: CPU LAPACK in fp32 reproduced decaying-spectrum
    matrices to 0.24-0.66 eps sqrt(max(N, M)) from 896 x 4864 to 4096 x 14336 (9.5e-6 there;
    ``bench.bench_osft --part svd``), so a fixed 1e-5 would redo nearly every matrix of a 70B model.
    cuSOLVER's Jacobi miss on the H100 (5e-4 at 1536 x 8960) was 44 eps sqrt(max(N, M)).
    """
    return 2 * torch.finfo(dtype).eps * max(shape) ** 0.5


def svd(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """``torch.linalg.svd`` (thin) that reproduces ``matrix`` to ``svd_tolerance`` on every device.

    On CUDA, torch's default cuSOLVER driver is Jacobi (gesvdj), fast but inexact on large matrices:
    on an H100 (torch 2.11, cu130) Qwen2.5-1.5B's weights came back reproduced only to 5e-4 in fp32,
    which failed the start-up self-check. Where it misses, the QR-based gesvd (slower, exact) redoes
    that matrix, so the cost is paid only where the fast answer is wrong. CPU LAPACK is exact already.

    Returns:
        U, S, V^T, and whether gesvd redid it (counted in the start-up log).
    """
    U, S, Vh = torch.linalg.svd(matrix, full_matrices=False)  # (N, r), (r,), (r, M)
    if (matrix.device.type == "cuda"
            and relative_error((U * S) @ Vh, matrix) > svd_tolerance(tuple(matrix.shape), matrix.dtype)):
        return *torch.linalg.svd(matrix, full_matrices=False, driver="gesvd"), True
    return U, S, Vh, False


def relative_error(approximation: torch.Tensor, exact: torch.Tensor) -> float:
    """||approximation - exact|| / ||exact|| (Frobenius)."""
    return float((approximation - exact).norm() / exact.norm().clamp_min(1e-30))


def decompose(weight: torch.Tensor, num_frozen: int, *, upcast_dtype: torch.dtype = torch.float32,
              dtype: torch.dtype | None = None) -> OSFTFactors:
    """SVD of ``weight`` in ``upcast_dtype``; the factors are returned in ``dtype`` (default: the weight's)."""
    dtype = dtype or weight.dtype
    U, S, Vh, redone = svd(weight.to(upcast_dtype))
    V = Vh.T
    k = num_frozen
    parts = (U[:, :k], S[:k], V[:, :k], U[:, k:], S[k:], V[:, k:])
    return OSFTFactors(*(p.to(dtype).contiguous() for p in parts), exact_solver_redid=redone)


def reconstruct(factors: OSFTFactors | dict[str, torch.Tensor], *, upcast_dtype: torch.dtype = torch.float32
                ) -> torch.Tensor:
    """W = U_high diag(S_high) V_high^T + U_low diag(S_low) V_low^T, summed in ``upcast_dtype``."""
    f = factors if isinstance(factors, dict) else vars(factors)
    up = {name: f[name].to(upcast_dtype) for name in FACTORS}
    return (up["U_high"] * up["S_high"]) @ up["V_high"].T + (up["U_low"] * up["S_low"]) @ up["V_low"].T


class OSFTLinear(nn.Module):
    """``nn.Linear`` as frozen top-k and trainable remaining SVD factors.

    The frozen factors are parameters with ``requires_grad=False``, not buffers: ``fully_shard``
    shards parameters on dim 0 but replicates buffers, so as parameters their memory divides by the
    shard group like everything else. V is stored as (M x r), not V^T (r x M), so that dim-0 sharding
    splits input features for V exactly as it splits output features for U: both projections are
    then a reduction over the sharded dimension (one small k x (r-k) all-reduce), never a gather of
    V_high.
    """

    def __init__(self, in_features: int, out_features: int, num_frozen: int, *, bias: nn.Parameter | None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        assert 0 < num_frozen < min(in_features, out_features), "OSFT needs frozen and trainable directions"
        self.in_features, self.out_features = in_features, out_features
        k, r = num_frozen, min(in_features, out_features)
        shapes = {"U_high": (out_features, k), "S_high": (k,), "V_high": (in_features, k),
                  "U_low": (out_features, r - k), "S_low": (r - k,), "V_low": (in_features, r - k)}
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(torch.empty(shape, device=device, dtype=dtype),
                                             requires_grad=name in TRAINABLE))
        self.bias = bias  # the replaced layer's own Parameter object (optimizer groups, tying stay valid)

    @classmethod
    def from_linear(cls, linear: nn.Linear, num_frozen: int, *, upcast_dtype: torch.dtype = torch.float32
                    ) -> OSFTLinear:
        """Decompose ``linear.weight`` now (meta weights give empty shells to fill later)."""
        weight = linear.weight
        module = cls(linear.in_features, linear.out_features, num_frozen, bias=linear.bias,
                     device=weight.device, dtype=weight.dtype)
        if weight.device.type != "meta":
            module.load_factors(decompose(weight.detach(), num_frozen, upcast_dtype=upcast_dtype))
        return module

    @torch.no_grad()
    def load_factors(self, factors: OSFTFactors) -> None:
        """Copy whole factors in, keeping only this rank's shard of DTensor parameters."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        for name in FACTORS:
            param, full = getattr(self, name), getattr(factors, name)
            if isinstance(param, DTensor):
                # Each rank already holds the whole factor: src_data_rank=None cuts locally, no communication.
                full = distribute_tensor(full, param.device_mesh, param.placements,
                                         src_data_rank=None).to_local()
                param = param.to_local()
            param.copy_(full)

    def dense_weight(self) -> torch.Tensor:
        """W = U_high diag(S_high) V_high^T + U_low diag(S_low) V_low^T, (N, M), in the factors' dtype."""
        return torch.addmm((self.U_high * self.S_high) @ self.V_high.T, self.U_low * self.S_low, self.V_low.T)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., M) -> (..., N)
        # Whichever costs fewer FLOPs, both exact. Through the factors: 2 (N + M) r per token. Rebuilding
        # W first: 2 N M r once, then the dense 2 N M per token. With r = min(N, M), (N + M) r - N M = r^2,
        # so rebuilding wins once the call holds more than N M / r = max(N, M) tokens: every training
        # minibatch of a real model (thousands of tokens); autograd carries dW into the trainable factors.
        if x.numel() > self.in_features * max(self.in_features, self.out_features):
            return F.linear(x, self.dense_weight(), self.bias)
        y = ((x @ self.V_high) * self.S_high) @ self.U_high.T + ((x @ self.V_low) * self.S_low) @ self.U_low.T
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"frozen={self.S_high.shape[0]}, trainable={self.S_low.shape[0]}, bias={self.bias is not None}")


def apply_osft(model: nn.Module, targets: list[str], *, unfreeze_rank_ratio: float,
               upcast_dtype: torch.dtype = torch.float32) -> list[str]:
    """Replace each target ``nn.Linear`` in place (same attribute) by an ``OSFTLinear``.

    Real weights are decomposed here (one process); meta weights give empty shells with the
    factor shapes, for ``fully_shard`` and then ``fill_osft_factors``. Call before ``fully_shard``.

    Returns:
        The names replaced: targets whose k is 0 are left alone, so ratio 1.0 replaces nothing.
    """
    replaced = []
    for name in targets:
        linear = model.get_submodule(name)
        k = num_frozen_directions(linear.out_features, linear.in_features, unfreeze_rank_ratio)
        if k == 0:
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, OSFTLinear.from_linear(linear, k, upcast_dtype=upcast_dtype))
        replaced.append(name)
    return replaced


def osft_modules(model: nn.Module) -> list[tuple[str, OSFTLinear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, OSFTLinear)]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def shard_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The ranks that split the OSFT factors' dim 0 (the FSDP2 mesh's shard dimension: the whole mesh
    under FULL_SHARD, ``mesh["shard"]`` under HYBRID_SHARD), for the projections; None without any
    sharded OSFT module."""
    from torch.distributed.tensor import DTensor, Shard

    modules = osft_modules(model)
    param = modules[0][1].U_low if modules else None
    if not isinstance(param, DTensor):
        return None
    [dim] = [i for i, placement in enumerate(param.placements) if isinstance(placement, Shard)]
    return param.device_mesh.get_group(dim)


def _check_group(param: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """The group must be exactly the ranks that split this parameter's dim 0 (never the replicas)."""
    from torch.distributed.tensor import DTensor, Shard

    num_shards = 1
    if isinstance(param, DTensor):
        num_shards = math.prod(param.device_mesh.size(i) for i, p in enumerate(param.placements)
                               if isinstance(p, Shard))
    group_size = 1 if group is None else dist.get_world_size(group)
    if group_size != num_shards:
        raise ValueError(f"OSFT projection: the factors are split across {num_shards} ranks but the process "
                         f"group has {group_size}: pass the shard group (mesh['shard'].get_group())")


@torch.no_grad()
def _project_out(pairs: list[tuple[torch.Tensor, torch.Tensor]], group: dist.ProcessGroup | None,
                 comm_device: torch.device | None) -> None:
    """x <- x - Q (Q^T x) for each (Q, x), both (rows, .) local shards of the same row split.

    Q^T x sums over rows, so each shard's partial (k x m) is all-reduced over ``group``.
    """
    pairs = [(_local(q), _local(x)) for q, x in pairs]
    coeffs = [q.T.to(torch.promote_types(x.dtype, torch.float32)) @ x for q, x in pairs]
    if group is not None and dist.get_world_size(group) > 1:
        flat = torch.cat([c.flatten() for c in coeffs])
        on_device = flat.to(comm_device) if comm_device is not None else flat
        dist.all_reduce(on_device, group=group)
        flat = on_device.to(flat.device)
        coeffs = [part.view_as(c) for part, c in zip(flat.split([c.numel() for c in coeffs]), coeffs)]
    for (q, x), c in zip(pairs, coeffs):
        x.sub_((q.to(c.dtype) @ c).to(x.dtype))


def project_gradients(model: nn.Module, *, group: dist.ProcessGroup | None = None,
                      comm_device: torch.device | None = None) -> None:
    """Remove the frozen subspace from the trainable factors' gradients, in place.

    dU_low <- dU_low - U_high (U_high^T dU_low);  dV_low <- dV_low - V_high (V_high^T dV_low).
    Call after backward and before clipping, so the clip measures what is applied.

    Args:
        model: holds ``OSFTLinear`` modules (plain or FSDP2-sharded); no-op without any.
        group: the ranks that shard each parameter's dim 0 (FSDP2 mesh's ``shard`` dimension); None
            in one process. Never the world group under HYBRID_SHARD: it would sum the replicas.
        comm_device: device for the all-reduce when the shards live elsewhere (CPU offload + NCCL).
    """
    modules = [m for _, m in osft_modules(model) if m.U_low.grad is not None]
    if modules:
        _check_group(modules[0].U_low, group)
    for m in modules:
        _project_out([(m.U_high, m.U_low.grad), (m.V_high, m.V_low.grad)], group, comm_device)


def project_parameters(model: nn.Module, *, group: dist.ProcessGroup | None = None,
                       comm_device: torch.device | None = None) -> None:
    """Project U_low and V_low themselves off the frozen subspace, in place; call after ``optimizer.step()``.

    Arguments as ``project_gradients``.
    """
    modules = [m for _, m in osft_modules(model)]
    if modules:
        _check_group(modules[0].U_low, group)
    for m in modules:
        _project_out([(m.U_high, m.U_low), (m.V_high, m.V_low)], group, comm_device)


def osft_export_state(state_dict: dict[str, torch.Tensor], *, upcast_dtype: torch.dtype = torch.float32
                      ) -> dict[str, torch.Tensor]:
    """A full (unsharded) state dict with each OSFT module's factors replaced by ``<module>.weight``.

    The weight is summed in ``upcast_dtype`` and stored in the factors' dtype, where its factors
    stood in the key order; no OSFT key is left, so the result is a plain Hugging Face state dict.
    """
    prefixes = {key.removesuffix(".U_high") for key in state_dict if key.endswith(".U_high")}
    out = {}
    for key, value in state_dict.items():
        prefix, _, leaf = key.rpartition(".")
        if prefix not in prefixes or leaf not in FACTORS:
            out[key] = value
        elif leaf == "U_high":
            factors = {name: state_dict[f"{prefix}.{name}"] for name in FACTORS}
            out[f"{prefix}.weight"] = reconstruct(factors, upcast_dtype=upcast_dtype).to(value.dtype)
    return out


def svd_flops(out_features: int, in_features: int) -> int:
    """Relative cost of one SVD: N * M * min(N, M)."""
    return out_features * in_features * min(out_features, in_features)


def assign_by_flops(shapes: list[tuple[int, int]], num_ranks: int) -> list[int]:
    """Owner rank of each matrix: largest SVD first onto the least-loaded rank (LPT), by FLOPs not count."""
    loads, owners = [0] * num_ranks, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: -svd_flops(*shapes[i])):
        owner = min(range(num_ranks), key=lambda r: (loads[r], r))
        owners[i] = owner
        loads[owner] += svd_flops(*shapes[i])
    return owners


@dataclass(frozen=True)
class DecompositionReport:
    """What ``fill_osft_factors`` did on this rank, for the start-up log."""

    num_matrices: int
    num_decomposed_here: int
    gflop_here: float  # SVD cost units (N*M*min(N,M)) / 1e9 decomposed on this rank
    seconds: float
    peak_memory_gb: float  # device.peak_memory_gb: device peak on GPU, process peak RSS on CPU
    max_reconstruction_error: float = 0.0  # max over all matrices (all ranks) of ||U S V^T - W|| / ||W||
    num_redone_here: int = 0  # SVDs on this rank that the fast GPU solver missed and gesvd redid

    def describe(self) -> str:
        redone = f", {self.num_redone_here} redone by gesvd" if self.num_redone_here else ""
        return (f"OSFT: {self.num_matrices} matrices decomposed ({self.num_decomposed_here} on this rank{redone}, "
                f"{self.gflop_here:.2f} G SVD units) in {self.seconds:.1f}s, peak memory {self.peak_memory_gb:.2f} GB; "
                f"factors reproduce the weights to {self.max_reconstruction_error:.1e} (relative)")


def fill_osft_factors(model: nn.Module, dense_weights: dict[str, torch.Tensor], *,
                      group: dist.ProcessGroup | None = None, upcast_dtype: torch.dtype = torch.float32,
                      comm_device: torch.device | None = None) -> DecompositionReport:
    """Fill every ``OSFTLinear`` shell (sharded or not) from the dense weights held by the group's rank 0.

    1. rank 0 sends each weight to its owner (``assign_by_flops``), one point-to-point send each;
    2. every rank decomposes the weights it owns, all ranks at once;
    3. each matrix's factors are broadcast from its owner; every rank keeps only its shard.
    No rank ever holds more than its share of the SVD work plus one matrix's factors in flight.

    Args:
        model: ``apply_osft`` shells, materialised (after ``fully_shard`` and ``to_empty``).
        dense_weights: on the group's rank 0, ``{module name: weight}`` for every OSFT module (any
            dtype; popped as they are sent); ``{}`` on the other ranks.
        group: every rank that needs the factors (the world group: replicas need them too); None in
            one process.
        upcast_dtype: dtype of the SVD (``--osft-upcast-dtype``).
        comm_device: device for the transfers (the accelerator under CPU offload + NCCL); default:
            where the factors live.

    Returns:
        This rank's ``DecompositionReport``.
    """
    modules = osft_modules(model)
    distributed = group is not None or dist.is_initialized()
    rank, size = (dist.get_rank(group), dist.get_world_size(group)) if distributed else (0, 1)
    owners = assign_by_flops([(m.out_features, m.in_features) for _, m in modules], size)
    reset_peak_memory()
    began = time.perf_counter()
    mine: dict[str, torch.Tensor] = {}
    for (name, m), owner in zip(modules, owners):
        device, dtype = comm_device or _local(m.U_low).device, m.U_low.dtype
        if rank == 0:
            weight = dense_weights.pop(name)
            if owner == 0:
                mine[name] = weight
            else:
                dist.send(weight.to(device=device, dtype=dtype).contiguous(), group_dst=owner, group=group)
        elif owner == rank:
            mine[name] = torch.empty((m.out_features, m.in_features), device=device, dtype=dtype)
            dist.recv(mine[name], group_src=0, group=group)
    cost = sum(svd_flops(m.out_features, m.in_features) for (_, m), owner in zip(modules, owners) if owner == rank)
    factors, worst, redone = {}, 0.0, 0
    for (name, m), owner in zip(modules, owners):
        if owner == rank:
            device = comm_device or _local(m.U_low).device
            weight = mine.pop(name).to(device)
            factors[name] = decompose(weight, m.S_high.shape[0], upcast_dtype=upcast_dtype, dtype=m.U_low.dtype)
            redone += factors[name].exact_solver_redid
            # The factors as training holds them (their dtype) against the weight: the start-up self-check.
            dense = weight.to(upcast_dtype)
            worst = max(worst, relative_error(reconstruct(factors[name], upcast_dtype=upcast_dtype), dense))
    for (name, m), owner in zip(modules, owners):
        if size > 1:
            shapes = [tuple(getattr(m, f).shape) for f in FACTORS]
            if owner == rank:
                own = factors.pop(name)
                flat = torch.cat([getattr(own, f).flatten() for f in FACTORS])
            else:
                flat = torch.empty(sum(math.prod(s) for s in shapes), dtype=m.U_low.dtype,
                                   device=comm_device or _local(m.U_low).device)
            dist.broadcast(flat, group_src=owner, group=group)
            parts = [p.view(s) for p, s in zip(flat.split([math.prod(s) for s in shapes]), shapes)]
            factors[name] = OSFTFactors(*parts)
        m.load_factors(factors.pop(name))
    if size > 1 and modules:
        worst_tensor = torch.tensor([worst], dtype=torch.float64, device=comm_device or _local(modules[0][1].U_low).device)
        dist.all_reduce(worst_tensor, op=dist.ReduceOp.MAX, group=group)
        worst = float(worst_tensor)
    return DecompositionReport(num_matrices=len(modules), num_decomposed_here=sum(o == rank for o in owners),
                               gflop_here=cost / 1e9, seconds=time.perf_counter() - began,
                               peak_memory_gb=peak_memory_gb(), max_reconstruction_error=worst,
                               num_redone_here=redone)


class OSFT(FineTuningMethod):
    """Orthogonal Subspace Fine-Tuning (module docstring): factor shells on meta, SVDs split across the ranks
    at start-up, projections around the optimizer step, dense weights in every export."""

    acts_after_update = True  # the projection after each update

    def __init__(self, settings: OSFTSettings) -> None:
        self.settings = settings

    def describe(self) -> str:
        return f", OSFT unfreeze rank ratio {self.settings.unfreeze_rank_ratio:g}"

    def fingerprint(self) -> dict:
        settings = self.settings
        if settings.unfreeze_rank_ratio == 1.0:  # splits nothing: full fine-tuning
            return {}
        # The factors' shapes follow from the ratio and targets; the SVD's dtype changes their rounding.
        return {"osft": [settings.unfreeze_rank_ratio, settings.target_patterns,
                         str(settings.upcast_dtype).removeprefix("torch.")]}

    def preflight(self, model_config, *, meta_model, shard_size: int) -> str | None:
        # A pattern that matches nothing is refused here, in seconds, not after the weights load.
        model = meta_model()
        try:
            osft_targets(model, blocks=find_decoder_blocks(model), patterns=self.settings.target_patterns)
        except ValueError as err:
            return str(err)
        return None

    def convert(self, model: nn.Module, build: ModelBuild) -> None:
        """Replace the targets of the meta model by empty factor layers (``fill`` decomposes the weights)."""
        settings = self.settings
        log_rank_0(settings.describe())
        targets = osft_targets(model, blocks=find_decoder_blocks(model), patterns=settings.target_patterns)
        names = apply_osft(model, targets, unfreeze_rank_ratio=settings.unfreeze_rank_ratio,
                           upcast_dtype=settings.upcast_dtype)
        if not names:
            log_rank_0(f"OSFT: ratio {settings.unfreeze_rank_ratio:g} freezes no direction of any of the "
                       f"{len(targets)} targets: plain full fine-tuning", level=logging.WARNING)
            return
        num_frozen = sum(model.get_submodule(name).S_high.numel() for name in names)
        num_trainable = sum(model.get_submodule(name).S_low.numel() for name in names)
        log_rank_0(f"OSFT: {len(names)} of {len(targets)} target matrices decomposed ({len(targets) - len(names)} "
                   f"too small to freeze a direction); {num_frozen:,} singular directions frozen, "
                   f"{num_trainable:,} trainable")

    def weights_it_fills(self, model: nn.Module) -> set[str]:
        return {f"{name}.{factor}" for name, _ in osft_modules(model) for factor in FACTORS}

    def hold_back(self, model: nn.Module, full_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The dense weights of the decomposed layers: ``fill`` decomposes them instead of broadcasting them."""
        names = [name for name, _ in osft_modules(model)]
        held = {name: full_state.pop(f"{name}.weight") for name in names}
        if names:
            # The broadcast is not strict (the factors are absent from it); every other key must still match.
            expected = {key for key in model.state_dict() if key.rpartition(".")[2] not in FACTORS}
            assert expected == set(full_state), f"state dict keys differ: {sorted(expected ^ set(full_state))[:5]}"
        return held

    def fill(self, model: nn.Module, held: dict[str, torch.Tensor], build: ModelBuild) -> None:
        """Decompose the weights across the ranks (by SVD FLOPs), check the factors reproduce them, log it."""
        modules = osft_modules(model)
        if not modules:
            return
        # Every rank needs the factors (the replicas of HYBRID_SHARD too): the world group.
        report = fill_osft_factors(model, held, upcast_dtype=self.settings.upcast_dtype, comm_device=build.device)
        tolerance = RECONSTRUCTION_TOLERANCE[modules[0][1].U_low.dtype]
        log_rank_0(report.describe())
        if report.max_reconstruction_error > tolerance:  # the same number on every rank (all-reduced): all exit
            log_rank_0(f"OSFT self-check failed: the factors reproduce a weight only to "
                       f"{report.max_reconstruction_error:.1e} (tolerance {tolerance:.0e}); --osft-upcast-dtype "
                       "float64 decomposes more exactly", level=logging.ERROR)
            raise SystemExit(1)

    def before_clip(self, model: nn.Module, *, device: torch.device) -> None:
        # The gradients lose their frozen-subspace part first, so the clip measures what is applied. The sums
        # run over the shard group only (HYBRID_SHARD's replicas hold the same shards).
        project_gradients(model, group=shard_group(model), comm_device=device)

    def after_update(self, model: nn.Module, *, device: torch.device) -> None:
        # AdamW's per-element scaling moves a projected gradient back into the frozen subspace: project again.
        project_parameters(model, group=shard_group(model), comm_device=device)

    def saves_frozen_weights(self, model: nn.Module) -> bool:
        # The frozen factors come from an SVD at start-up, which need not round the same on another rank
        # count, thread count or device: they are saved, so a resume continues the very same factors.
        return bool(osft_modules(model))

    def export_state(self, state: dict[str, torch.Tensor], folder: Path, *, multimodal_export,
                     dtype: torch.dtype) -> dict[str, torch.Tensor]:
        # W is summed in the upcast dtype and kept in the factors' (fp32): the export rounds it to ``dtype`` once.
        return osft_export_state(state, upcast_dtype=self.settings.upcast_dtype)

    def added_matrices(self, model: nn.Module) -> tuple[set[int], int]:
        # An OSFT layer computes x W^T with W (N x M) rebuilt from its factors: it counts as its N x M.
        factored = osft_modules(model)
        return ({id(param) for _, module in factored for param in module.parameters()},
                sum(module.out_features * module.in_features for _, module in factored))
