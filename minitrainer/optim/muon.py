"""``--optimizer muon``: torch's Muon (``torch.optim.Muon``'s math, bit for bit) for the hidden matrices, and
``torch.optim.AdamW`` for the rest, in one optimizer.

The split comes from the model, not from names: a trainable parameter of two or more dimensions is a Muon matrix
unless it is the input embeddings' or the output head's weight (``get_input_embeddings``/``get_output_embeddings``,
by identity); embeddings, head, norms and biases go to AdamW. A tensor of three or more dimensions (stacked experts,
``[E, out, in]``) is a batch of matrices, each orthogonalized by itself. It is one ``torch.optim.Optimizer``
(``MuonWithAdamW``) because the learning-rate schedule and the full state (DCP's ``get_state_dict``) take one; each
group says which part it is (``group["muon"]``).

Why an owner rank. Muon's Newton-Schulz iteration needs the whole momentum matrix, and FSDP2 gives each rank a block
of its rows (``Shard(0)``). Gathering every matrix on every rank would repeat each iteration on all of them; instead
each matrix has one owner in the shard group (the largest first, onto the least-loaded rank: the same answer on
every rank), which alone orthogonalizes it.

What is exchanged, per step: ONE ``all_to_all_single`` sends every rank's rows of each momentum update to the
matrix's owner, ONE more returns each rank its rows of the orthogonalized update; both in bfloat16, which torch's
iteration casts to first thing, so the cast before the transfer changes nothing. A stack of experts needs no
exchange: ``Shard(0)`` splits it between experts, so each rank holds its experts whole and orthogonalizes them
itself. Under HYBRID_SHARD each replica exchanges within its own shard group (its gradients are already those of
every replica). The exchange runs where the mesh's collectives run (the GPU under ``--cpu-offload``).

What the state is: per Muon matrix a ``momentum_buffer`` DTensor shaped and placed like the parameter (4 bytes per
parameter; the AdamW part keeps AdamW's ``step``, ``exp_avg`` and ``exp_avg_sq``, 8), in ``optimizer.state``, so
DCP saves and restores it sharded as it does AdamW's moments. Nothing else persists: the owners follow from the
shapes and the shard group's size, recomputed each step. So a resume from a full state continues exactly, and on
another number of ranks DCP reshards the buffers as it reshards the parameters.

The momentum, the weight decay (the group's, ``param.mul_(1 - lr * wd)``) and the update are elementwise and run on
each rank's shard; the learning rate of a matrix is adjusted from its whole shape (``adjust_lr_fn``), as torch does.
Each whole matrix meets torch's operations in torch's order and memory layout, so, given the same gradients, the
parameters move as under ``torch.optim.Muon`` bit for bit, on any number of ranks (tests/test_muon.py). The
exchange holds, for a moment, this rank's rows of every matrix in bf16 and the whole matrices it owns: about 4 bytes
per local Muon parameter, besides one iteration's intermediates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from minitrainer.model.heads import output_head
from minitrainer.optim.base import OptimizerChoice, OptimizerSetting

NOTHING_TO_ORTHOGONALIZE = (
    "--optimizer muon: no trainable parameter is a matrix (ndim >= 2) outside the embeddings and the output head; "
    "a method that flattens parameters to 1-D would make Muon AdamW silently: use --optimizer adamw")


@dataclass(frozen=True)
class MuonArgs:
    """torch.optim.Muon's settings, with its defaults (its weight decay is each group's ``weight_decay``)."""

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
    eps: float = 1e-7
    adjust_lr_fn: Literal["original", "match_rms_adamw"] = "original"

    def __post_init__(self):
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if not 1 <= self.ns_steps < 100:
            raise ValueError(f"ns_steps must be in [1, 100), got {self.ns_steps}")
        if len(self.ns_coefficients) != 3:
            raise ValueError(f"ns_coefficients must be 3 numbers (a, b, c), got {self.ns_coefficients}")
        if not self.eps > 0:
            raise ValueError(f"eps must be positive (it bounds the division by the update's norm), got {self.eps}")


class Muon(OptimizerChoice):
    """Muon for the hidden matrices, AdamW for the rest (module docstring). ``state_bytes_per_param`` counts the Muon
    part's momentum buffer (4 bytes); the AdamW part (embeddings, head, norms, biases) keeps AdamW's 8 bytes per
    parameter, which the one number leaves out."""

    name = "muon"
    Args = MuonArgs
    state_bytes_per_param = 4.0  # the hidden matrices'; ``planned_state_bytes`` averages in the AdamW part
    uses_adam_flags = True

    def build(self, param_groups: list[dict], setting: OptimizerSetting) -> torch.optim.Optimizer:
        if setting.model is None:
            raise ValueError("--optimizer muon needs the model to tell its embeddings and output head from the "
                             "hidden matrices (OptimizerSetting.model)")
        embeddings = _weight(setting.model.get_input_embeddings())
        head = _weight(output_head(setting.model))
        muon_groups, adamw_groups, kinds = [], [], set()
        for group in param_groups:
            options = {key: value for key, value in group.items() if key != "params"}
            matrices, others = [], []
            for param in group["params"]:
                is_matrix = _is_matrix(param, embeddings, head)
                (matrices if is_matrix else others).append(param)
                if not is_matrix:
                    kinds.add("embeddings" if param is embeddings else "output head" if param is head
                              else "norms and biases")
            muon_groups.append({**options, "params": matrices} if matrices else None)
            adamw_groups.append({**options, "params": others} if others else None)
        if not any(muon_groups):
            raise ValueError(NOTHING_TO_ORTHOGONALIZE)
        args = self.args
        optimizer = MuonWithAdamW(muon_groups, adamw_groups, lr=setting.lr, momentum=args.momentum,
                                  nesterov=args.nesterov, ns_steps=args.ns_steps,
                                  ns_coefficients=args.ns_coefficients, eps=args.eps, adjust_lr_fn=args.adjust_lr_fn,
                                  betas=setting.betas, adam_eps=setting.eps,
                                  fused=True if setting.device.type == "cuda" else None)
        optimizer.adamw_kinds = tuple(kind for kind in ("embeddings", "output head", "norms and biases")
                                      if kind in kinds)
        return optimizer

    def planned_state_bytes(self, model) -> float:
        """4 bytes for each hidden matrix's parameter, 8 (AdamW's) for the rest, averaged over the trainable."""
        embeddings, head = _weight(model.get_input_embeddings()), _weight(output_head(model))
        trainable = {id(p): p for p in model.parameters() if p.requires_grad}.values()
        matrices = sum(p.numel() for p in trainable if _is_matrix(p, embeddings, head))
        total = sum(p.numel() for p in trainable)
        return (4.0 * matrices + 8.0 * (total - matrices)) / max(total, 1)

    def method_error(self, method) -> str | None:
        """A method that acts after the update (OSFT, projecting the parameters onto its subspace) would change
        Muon's orthogonalized update after the fact: not proven exact, so refused."""
        if method.acts_after_update:
            return (f"--optimizer muon: {type(method).__name__} changes the parameters after each update (it "
                    "projects them), and Muon's orthogonalized update through that change is not proven exact: use "
                    "--optimizer adamw")
        return None

    def describe(self, optimizer: torch.optim.Optimizer) -> str | None:
        muon = [p for group in optimizer.param_groups if group["muon"] for p in group["params"]]
        adamw = [p for group in optimizer.param_groups if not group["muon"] for p in group["params"]]
        stacks = sum(1 for p in muon if p.ndim > 2)
        line = (f"muon: {len(muon)} matrices ({_count(sum(p.numel() for p in muon))} parameters) orthogonalized, "
                "each whole on an owner rank")
        if stacks:
            line += f" ({stacks} stacks of experts, each expert by itself on the rank that holds it)"
        kinds = getattr(optimizer, "adamw_kinds", ())
        if adamw:
            line += (f"; AdamW: {len(adamw)} tensors ({_count(sum(p.numel() for p in adamw))} parameters)"
                     + (": " + ", ".join(kinds) if kinds else ""))
        return line


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon over the groups marked ``"muon": True``, ``torch.optim.AdamW`` over the others.

    The AdamW part IS a ``torch.optim.AdamW``, stepping the very group dicts and the very ``state`` of this
    optimizer; ``load_state_dict`` replaces both, so they are linked again at every step.

    Args:
        muon_groups, adamw_groups: for each of the method's groups, its Muon part and its AdamW part (None where it
            has no such parameter), each keeping the group's ``weight_decay``; the order is kept, Muon part first.
    """

    def __init__(self, muon_groups: list[dict | None], adamw_groups: list[dict | None], *, lr: float,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315), eps: float = 1e-7,
                 adjust_lr_fn: str = "original", betas: tuple[float, float] = (0.9, 0.999), adam_eps: float = 1e-8,
                 fused: bool | None = None):
        muon_options = {"momentum": momentum, "nesterov": nesterov, "ns_steps": ns_steps,
                        "ns_coefficients": tuple(ns_coefficients), "eps": eps, "adjust_lr_fn": adjust_lr_fn}
        adamw = [{**group, "muon": False} for group in adamw_groups if group is not None]
        # AdamW fills in its own defaults (betas, eps, amsgrad, ...) in these dicts, which become this optimizer's.
        self._adamw = torch.optim.AdamW(adamw, lr=lr, betas=betas, eps=adam_eps, fused=fused) if adamw else None
        adamw_of = iter(adamw)
        groups = []
        for muon_group, adamw_group in zip(muon_groups, adamw_groups):
            if muon_group is not None:
                groups.append({**muon_options, **muon_group, "muon": True})
            if adamw_group is not None:
                groups.append(next(adamw_of))
        super().__init__(groups, {"lr": lr, "weight_decay": 0.0})
        for group in self.param_groups:
            for param in group["params"] if group["muon"] else ():
                _shard_of(param)  # a placement it cannot step is refused now, not at the first step
        self._link()

    def _link(self) -> None:
        if self._adamw is not None:
            self._adamw.param_groups = [group for group in self.param_groups if not group["muon"]]
            self._adamw.state = self.state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._link()
        if self._adamw is not None:
            self._adamw.step()
        self._muon_step()
        return loss

    def _muon_step(self) -> None:
        exchanged = []
        for group in self.param_groups:
            if not group["muon"]:
                continue
            momentum = group["momentum"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    # zeros_like keeps a DTensor's mesh and placements: DCP saves the buffer sharded like the param.
                    state["momentum_buffer"] = torch.zeros_like(param)
                grad, buf = _local(param.grad), _local(state["momentum_buffer"])
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                matrix = _Matrix(param, group, update)
                if matrix.shard_group is None:
                    # Whole here (one process, a shard group of one, a stack of experts): done at once, as torch
                    # does, so no more than one fp32 update is ever held.
                    matrix.apply(matrix.orthogonalize(update.to(matrix.device, torch.bfloat16, copy=True)))
                else:
                    # Only the bf16 rows wait for the exchange, not Nesterov's fp32 update.
                    matrix.update = update.to(matrix.device, torch.bfloat16)
                    exchanged.append(matrix)
        for shard_group, matrices in _by_shard_group(exchanged).items():
            for matrix, orthogonalized in zip(matrices, _orthogonalize_across(matrices, shard_group)):
                matrix.apply(orthogonalized)


class _Matrix:
    """One Muon parameter in this step: where its rows are, and its momentum update (this rank's rows, bf16) while
    it waits for the exchange."""

    def __init__(self, param: Tensor, group: dict, update: Tensor):
        self.param, self.group, self.device = param, group, _work_device(param)
        self.shard_group, self.rank, self.size = _shard_of(param)
        self.rows, self.cols = param.shape[0], param.shape[-1]
        if update.shape[0] != self.rows_of(self.rank):
            raise ValueError(f"--optimizer muon: a parameter of shape {tuple(param.shape)} holds {update.shape[0]} "
                             f"rows on rank {self.rank} of {self.size}, where FSDP2's Shard(0) would hold "
                             f"{self.rows_of(self.rank)}; Muon knows only fully_shard's even chunks")
        if param.ndim > 2:
            self.shard_group = None  # Shard(0) splits a stack between experts: each is whole on its rank
        self.tall = param.ndim == 2 and self.rows > self.cols
        self.update: Tensor | None = None

    def rows_of(self, rank: int) -> int:
        """Rows ``rank`` holds under ``Shard(0)``: torch.chunk's split, the last ranks maybe short or empty."""
        chunk = -(-self.rows // self.size)
        return min((rank + 1) * chunk, self.rows) - min(rank * chunk, self.rows)

    def first_row(self, rank: int) -> int:
        return min(rank * -(-self.rows // self.size), self.rows)

    def apply(self, orthogonalized: Tensor) -> None:
        """torch's decoupled weight decay and update, on this rank's rows; the lr adjusted from the whole shape."""
        group, param = self.group, _local(self.param)
        lr = _scalar(group["lr"])
        param.mul_(1 - lr * group["weight_decay"])
        param.add_(orthogonalized.to(param.device), alpha=-_adjust_lr(lr, group["adjust_lr_fn"],
                                                                      self.param.shape[-2:]))

    def cost(self) -> int:
        """Newton-Schulz's multiply-adds per step, up to the constant number of steps."""
        short, long = sorted(self.param.shape[-2:])
        return 2 * short * short * long + short ** 3

    def orthogonalize(self, update: Tensor) -> Tensor:
        group = self.group
        return newton_schulz_(update, group["ns_coefficients"], group["ns_steps"], group["eps"])


def newton_schulz_(x: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> Tensor:
    """``torch.optim._muon._zeropower_via_newtonschulz`` of a bf16 ``x`` (which it overwrites), in its very order of
    operations and memory layout, so the result is bitwise torch's; leading dimensions are a batch (``baddbmm``)."""
    a, b, c = coefficients
    if x.numel() == 0:
        return x
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    if x.ndim == 2:
        x.div_(x.norm().clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.mT
            gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, gram_update, x, beta=a)
        return x.mT if tall else x
    lead = x.shape[:-2]
    x = x.flatten(0, -3)
    x.div_(x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.mT
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, gram_update, x, beta=a)
    return (x.mT if tall else x).unflatten(0, lead)


def _orthogonalize_across(matrices: list[_Matrix], group: dist.ProcessGroup) -> list[Tensor]:
    """This rank's rows of each matrix's orthogonalized update: every matrix's rows to its owner, Newton-Schulz
    there, each rank's rows back; two ``all_to_all_single`` for all the matrices."""
    size, me, device = matrices[0].size, matrices[0].rank, matrices[0].device
    owners = owner_ranks([matrix.cost() for matrix in matrices], size)
    owned_by = [[i for i, owner in enumerate(owners) if owner == rank] for rank in range(size)]
    mine = [matrices[i] for i in owned_by[me]]
    # Elements this rank sends each owner (its rows of the owner's matrices), and receives from each rank (that
    # rank's rows of the matrices it owns); on the way back the two swap.
    sent_splits = [sum(matrices[i].update.numel() for i in owned_by[rank]) for rank in range(size)]
    received_splits = [sum(matrix.rows_of(rank) * matrix.cols for matrix in mine) for rank in range(size)]
    sent = _cat([matrices[i].update.reshape(-1) for rank in range(size) for i in owned_by[rank]], device)
    for matrix in matrices:
        matrix.update = None
    received = _exchange(sent, received_splits, sent_splits, group)
    del sent
    rows = [block.split([matrix.rows_of(rank) * matrix.cols for matrix in mine])
            for rank, block in enumerate(received.split(received_splits))]
    back: list[list[Tensor]] = [[] for _ in range(size)]
    for k, matrix in enumerate(mine):
        whole = torch.cat([rows[rank][k].view(-1, matrix.cols) for rank in range(size)])
        done = matrix.orthogonalize(whole)
        for rank in range(size):
            part = done[matrix.first_row(rank):matrix.first_row(rank) + matrix.rows_of(rank)]
            # A tall matrix's update travels as torch's lies in memory, transposed: its add then runs the very
            # loop (and rounding) torch's does.
            back[rank].append(part.mT.reshape(-1) if matrix.tall else part.reshape(-1))
    del received, rows
    returned = _exchange(_cat([piece for pieces in back for piece in pieces], device), sent_splits,
                         received_splits, group)
    orthogonalized: list[Tensor | None] = [None] * len(matrices)
    for rank, block in enumerate(returned.split(sent_splits)):
        ours = owned_by[rank]
        for i, piece in zip(ours, block.split([matrices[i].rows_of(me) * matrices[i].cols for i in ours])):
            matrix = matrices[i]
            orthogonalized[i] = (piece.view(matrix.cols, -1).mT if matrix.tall
                                 else piece.view(-1, matrix.cols))
    return orthogonalized


def owner_ranks(costs: list[int], size: int) -> list[int]:
    """The owner of each matrix: the costliest first, onto the least-loaded rank (the lowest on a tie), so every
    rank computes the same owners from the same shapes."""
    loads, owners = [0] * size, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owner = min(range(size), key=lambda rank: (loads[rank], rank))
        owners[i] = owner
        loads[owner] += costs[i]
    return owners


def _exchange(sent: Tensor, received_splits: list[int], sent_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    received = torch.empty(sum(received_splits), dtype=sent.dtype, device=sent.device)
    dist.all_to_all_single(received, sent, received_splits, sent_splits, group=group)  # gloo and NCCL carry bf16
    return received


def _cat(pieces: list[Tensor], device: torch.device) -> Tensor:
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.bfloat16, device=device)


def _by_shard_group(matrices: list[_Matrix]) -> dict[dist.ProcessGroup, list[_Matrix]]:
    """The matrices by the group that exchanges them, in first-seen order: the same on every rank of a group."""
    groups: dict = {}
    for matrix in matrices:
        groups.setdefault(matrix.shard_group, []).append(matrix)
    return groups


def _shard_of(param: Tensor) -> tuple[dist.ProcessGroup | None, int, int]:
    """``(group, rank in it, its size)`` of the ranks that hold the rows of ``param``; ``(None, 0, 1)`` when this
    rank holds it whole."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):
        return None, 0, 1
    shard_dims = [dim for dim, placement in enumerate(param.placements) if not isinstance(placement, Replicate)]
    if len(shard_dims) > 1 or any(type(param.placements[dim]) is not Shard or param.placements[dim].dim != 0
                                  for dim in shard_dims):
        raise ValueError(f"--optimizer muon steps FSDP2's Shard(0) parameters (replicated across the other mesh "
                         f"dimensions), not a parameter placed {param.placements}")
    if not shard_dims or param.device_mesh.size(shard_dims[0]) == 1:
        return None, 0, 1
    group = param.device_mesh.get_group(shard_dims[0])
    return group, dist.get_rank(group), dist.get_world_size(group)


def _work_device(param: Tensor) -> torch.device:
    """Where a matrix is exchanged and orthogonalized: where its mesh's collectives run (NCCL's GPU, also when
    ``--cpu-offload`` keeps the parameter on the host), else where it lives."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor) and param.device_mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return _local(param).device


def _local(tensor: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _adjust_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim._muon._adjust_lr of one matrix's shape (an expert's, in a stack)."""
    rows, cols = shape
    if adjust_lr_fn == "match_rms_adamw":
        return lr * (0.2 * math.sqrt(max(rows, cols)))
    return lr * math.sqrt(max(1, rows / cols))


def _scalar(value) -> float:
    return value.item() if isinstance(value, Tensor) else value


def _is_matrix(param: Tensor, embeddings: Tensor | None, head: Tensor | None) -> bool:
    # A stack whose matrices have a side of 1 (a depthwise conv's [C, 1, K]) is no stack of matrices.
    return ((param.ndim == 2 or param.ndim > 2 and min(param.shape[-2:]) > 1)
            and param is not embeddings and param is not head)


def _weight(module) -> Tensor | None:
    return getattr(module, "weight", None) if module is not None else None


def _count(n: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)
