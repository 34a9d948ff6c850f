"""``--optimizer adafactor``: ``torch.optim.Adafactor``'s update, stepped on the FSDP2 row shards.

Why not torch's class: it cannot step a ``Shard(0)`` DTensor (``param.norm(2)`` gives a ``_NormPartial``
placement on which ``aten.pow_.Scalar`` fails), and even where it ran, each rank would factor only its own block
of rows: Adafactor's column means and the mean of the row factor run over the whole matrix. So the update is
torch's ``_single_tensor_adafactor``, line for line, computed on each rank's local rows (``to_local()``), with
the whole-matrix quantities made explicit sums over the parameter's shard group:

    quantity                              local to the rows?      what is summed over the shard group
    row mean of g^2 (last dim)            yes                     nothing
    column mean of g^2 (over the rows)    no (2-D)                each rank's column sums of g^2
    mean of the row factor                no (2-D)                each rank's sum of its row factor
    RMS of the parameter (alpha)          no                      each rank's sum of squares
    RMS of the update (clipping)          no                      each rank's sum of squares
    1-D variance (biases, norms)          yes (elementwise)       nothing

The first four are known before anything is reduced, so they travel together: one ``all_reduce`` per step for
every parameter's partial sums, flattened into one float64 buffer (per shard group and device; one in practice).
The update's RMS depends on the reduced column means, so it needs a second one. Each partial is a norm or a sum
in the parameter's dtype, squared in float64, which holds a float32 (or bf16) square exactly, so on one process
(nothing reduced) the numbers are torch's bit for bit. A tensor of more than two dims is factored over its last two, as torch does; FSDP2 shards it
over the leading dim, so its factors are local and only the two RMS sums cross ranks. With HYBRID_SHARD the
sums run over the shard dim's group only: the replicas hold the same gradient (FSDP2 all-reduced it).

The update itself is not kept between the two reductions: it is recomputed from the (small) factors after the
second, so the transient is one update the size of one local shard, not one per parameter (what Adafactor is
picked for is its memory).

States, as torch names and shapes them (``step`` a float32 scalar; for an ``[..., m, n]`` parameter ``row_var``
``[..., m, 1]`` and ``col_var`` ``[..., 1, n]``; ``variance`` shaped like a 1-D parameter), are DTensors on the
parameter's mesh: ``row_var`` and ``variance`` with its placements (its rows), a 2-D parameter's ``col_var``
``Replicate()`` on every mesh dim (every rank holds the same, reduced values), a larger one's with the
parameter's placements (its leading dim). So DCP's ``get_state_dict``/``set_state_dict`` save and reshard them
like AdamW's moments, and a resume, on the same or another number of ranks, continues from the same state.

torch's ``lr`` is a cap on the relative step (``rho_t = min(lr, 1/sqrt(step))``) and the decoupled weight
decay's coefficient, not a step size: torch's default is 1e-2, and the trainer's ``--learning-rate`` default
(5e-6) would hardly move the weights; set it (e.g. ``--learning-rate 1e-2``). The schedule scales it as it
scales AdamW's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from minitrainer.optim.base import OptimizerChoice, OptimizerSetting


@dataclass(frozen=True)
class AdafactorArgs:
    """torch's ``Adafactor`` settings, with its defaults; ``eps1`` null means the parameter dtype's epsilon."""

    beta2_decay: float = -0.8
    eps1: float | None = None
    eps2: float = 1e-3
    d: float = 1.0
    maximize: bool = False

    def __post_init__(self):
        if self.eps1 is not None:
            # parse_args checks by annotation, and `float | None` is not one it checks.
            if isinstance(self.eps1, bool) or not isinstance(self.eps1, (int, float)):
                raise ValueError(f"eps1 must be a number or null, got {self.eps1!r}")
            object.__setattr__(self, "eps1", float(self.eps1))
            if self.eps1 < 0:
                raise ValueError(f"eps1 must be >= 0, got {self.eps1}")
        if self.beta2_decay > 0:
            raise ValueError(f"beta2_decay must be <= 0 (beta2 is 1 - step**beta2_decay), got {self.beta2_decay}")
        if self.eps2 < 0:
            raise ValueError(f"eps2 must be >= 0, got {self.eps2}")
        if not self.d > 0:
            raise ValueError(f"d (the update clipping threshold) must be > 0, got {self.d}")


class Adafactor(OptimizerChoice):
    """Factored second moments: an ``m x n`` matrix keeps ``(m + n) * 4`` bytes (a few thousandths of a byte
    per parameter for a hidden matrix), a 1-D tensor 4 bytes per element; 0.05 is an honest upper bound for
    the plan of a transformer, whose 1-D tensors are a sliver of its parameters."""

    name = "adafactor"
    Args = AdafactorArgs
    state_bytes_per_param = 0.05
    uses_adam_flags = False

    def build(self, param_groups: list[dict], setting: OptimizerSetting) -> torch.optim.Optimizer:
        args = self.args
        return ShardedAdafactor(param_groups, lr=setting.lr, beta2_decay=args.beta2_decay, eps1=args.eps1,
                                eps2=args.eps2, d=args.d, maximize=args.maximize)

    def describe(self, optimizer: torch.optim.Optimizer) -> str | None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        factored = sum(p.dim() > 1 for p in params)
        lr = optimizer.defaults["lr"]
        line = (f"adafactor: {factored} tensors with factored second moments (row and column means over the "
                f"whole matrix), {len(params) - factored} elementwise; lr {lr:g} caps the relative step")
        if lr < 1e-3:
            line += " (torch's default is 1e-2: a cap this small hardly moves the weights; set --learning-rate)"
        return line


class ShardedAdafactor(torch.optim.Optimizer):
    """``torch.optim.Adafactor`` (single-tensor update) for plain tensors and FSDP2 ``Shard(0)`` DTensors; the
    module docstring gives the design. ``eps`` is split into ``eps1``/``eps2`` group keys (no tuple holding a
    None in the saved groups)."""

    def __init__(self, params, lr: float = 1e-2, beta2_decay: float = -0.8, eps1: float | None = None,
                 eps2: float = 1e-3, d: float = 1.0, weight_decay: float = 0.0, *, maximize: bool = False):
        if not lr >= 0:
            raise ValueError(f"adafactor: lr must be >= 0, got {lr}")
        defaults = {"lr": lr, "beta2_decay": beta2_decay, "eps1": eps1, "eps2": eps2, "d": d,
                    "weight_decay": weight_decay, "maximize": maximize}
        super().__init__(params, defaults)
        for group in self.param_groups:
            if not group["weight_decay"] >= 0:
                raise ValueError(f"adafactor: weight_decay must be >= 0, got {group['weight_decay']}")
            for p in group["params"]:
                _shard_group(p)  # a placement it cannot step is refused at start-up, not at the first step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [_Work(group, p, self._state(p)) for group in self.param_groups for p in group["params"]
                if p.grad is not None]
        first = _Sums()
        for w in work:
            w.accumulate(first)
        first.reduce()
        second = _Sums()
        for w in work:
            w.finish_factors(first, second)
        second.reduce()
        for w in work:
            w.apply(second)
        return loss

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            if torch.is_complex(p):
                raise ValueError("adafactor: complex parameters are not supported (as torch's)")
            local = _local(p)
            state["step"] = torch.tensor(0.0, dtype=torch.float32)  # on the host, as torch keeps it
            if p.dim() > 1:
                state["row_var"] = _like(p, local.new_zeros((*local.shape[:-1], 1)), (*p.shape[:-1], 1),
                                         rows=True)
                # A 2-D parameter's column factor spans all its rows: whole on every rank.
                state["col_var"] = _like(p, local.new_zeros((*local.shape[:-2], 1, local.shape[-1])),
                                         (*p.shape[:-2], 1, p.shape[-1]), rows=p.dim() > 2)
            else:
                state["variance"] = _like(p, torch.zeros_like(local), tuple(p.shape), rows=True)
        return state


@dataclass(eq=False)
class _Work:
    """One parameter's step across the three phases (local sums, factors and update RMS, the update)."""

    group: dict
    p: torch.Tensor
    state: dict
    handles: dict = field(default_factory=dict)

    def __post_init__(self):
        self.x, self.g = _local(self.p), _local(self.p.grad)
        self.shard_group = _shard_group(self.p)
        self.reduce_on = _reduce_device(self.p, self.x)
        self.numel = self.p.numel()  # the global count, which the RMS divides by
        eps1 = self.group["eps1"]
        # torch takes the epsilon of the group's first parameter for all of them: the same for one dtype.
        self.eps1 = torch.finfo(self.x.dtype).eps if eps1 is None else eps1

    def accumulate(self, sums: _Sums) -> None:
        """The step count, the local moments, and this step's partial sums."""
        step_t = self.state["step"]
        step_t += 1
        step = step_t.item()
        self.weight = step ** self.group["beta2_decay"]  # torch's one_minus_beta2_t
        self.rho = min(self.group["lr"], 1 / (step ** 0.5))
        everyone = (self.shard_group, self.reduce_on)
        self.handles["param"] = sums.add(everyone, self.x.norm(2).double().square_(), scalar=True)
        # maximize negates the update rather than a copy of g (a gradient's worth of memory per parameter, held
        # to the last phase): the moments see only g squared, and the negated update is torch's bit for bit.
        g = self.g
        if g.dim() > 1:
            row_var = _local(self.state["row_var"])
            row_var.lerp_(torch.norm(g, dim=-1, keepdim=True).square_().div_(g.size(-1)), self.weight)
            # A larger tensor's rows are whole on each rank (FSDP2 shards its leading dim).
            rows_split = g.dim() == 2 and self.shard_group is not None
            where = everyone if rows_split else (None, self.x.device)
            self.handles["col"] = sums.add(where, torch.norm(g, dim=-2, keepdim=True).double().square_())
            self.handles["row"] = sums.add(where, row_var.sum(dim=-2, keepdim=True).double())
        else:
            _local(self.state["variance"]).lerp_(g * g, self.weight)

    def finish_factors(self, first: _Sums, second: _Sums) -> None:
        """The column factor and the row factor's mean from the summed parts, alpha, and the update's RMS."""
        rms = math.sqrt(first.scalar(self.handles["param"])) / (self.numel ** 0.5)
        self.alpha = max(self.group["eps2"], rms) * self.rho
        if self.g.dim() > 1:
            rows = self.p.shape[-2]
            dtype = self.x.dtype
            col_mean = first.vector(self.handles["col"], self.x.device).to(dtype).div_(rows)
            _local(self.state["col_var"]).lerp_(col_mean, self.weight)
            self.row_var_mean = first.vector(self.handles["row"], self.x.device).to(dtype).div_(rows)
            self.row_var_mean.clamp_(min=self.eps1)
        self.handles["update"] = second.add((self.shard_group, self.reduce_on),
                                            self._update().norm(2).double().square_(), scalar=True)

    def apply(self, second: _Sums) -> None:
        group = self.group
        rms = math.sqrt(second.scalar(self.handles["update"])) / (self.numel ** 0.5)
        denom = max(1.0, rms / group["d"])
        if group["weight_decay"] != 0:
            self.x.mul_(1 - group["lr"] * group["weight_decay"])
        self.x.add_(self._update(), alpha=-self.alpha / denom)

    def _update(self) -> torch.Tensor:
        """torch's update, from the factors; called twice (for its RMS, then to apply) rather than kept."""
        if self.g.dim() > 1:
            var_estimate = _local(self.state["row_var"]) @ _local(self.state["col_var"])
            var_estimate.div_(self.row_var_mean)
        else:
            var_estimate = _local(self.state["variance"]).clone()
        # eps1 squared: the square root is taken next.
        update = var_estimate.clamp_(min=self.eps1 * self.eps1).rsqrt_().mul_(self.g)
        return update.neg_() if self.group["maximize"] else update


class _Sums:
    """Float64 partial sums, added up over their shard group: one ``all_reduce`` per (group, device), with the
    numbers the host needs first, so one read brings them all. Group None: nothing to add (whole here)."""

    def __init__(self):
        self._buckets: dict[tuple, tuple[list, list]] = {}
        self._done: dict[tuple, tuple[list[float], list[torch.Tensor]]] = {}

    def add(self, where: tuple, part: torch.Tensor, *, scalar: bool = False) -> tuple:
        scalars, vectors = self._buckets.setdefault(where, ([], []))
        kept = scalars if scalar else vectors
        kept.append(part)
        return where, scalar, len(kept) - 1

    def reduce(self) -> None:
        for where, (scalars, vectors) in self._buckets.items():
            group, device = where
            flat = torch.cat([part.reshape(-1).to(device) for part in scalars + vectors])
            if group is not None:
                dist.all_reduce(flat, group=group)
            host = flat[:len(scalars)].tolist()
            sizes = [part.numel() for part in vectors]
            pieces = flat[len(scalars):].split(sizes)
            self._done[where] = host, [piece.view(part.shape) for piece, part in zip(pieces, vectors)]

    def scalar(self, handle: tuple) -> float:
        where, _, index = handle
        return self._done[where][0][index]

    def vector(self, handle: tuple, device: torch.device) -> torch.Tensor:
        where, _, index = handle
        return self._done[where][1][index].to(device)


def _dtensor_types():
    # torch.distributed.tensor costs about a second to import; a process that only lists the optimizers or
    # refuses its flags should not pay it.
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor, Replicate


def _local(t: torch.Tensor) -> torch.Tensor:
    DTensor, _ = _dtensor_types()
    return t.to_local() if isinstance(t, DTensor) else t


def _shard_group(p: torch.Tensor):
    """The process group over which ``p``'s rows are split, or None where each rank holds all of it."""
    DTensor, _ = _dtensor_types()
    if not isinstance(p, DTensor):
        return None
    shard_dims = []
    for mesh_dim, placement in enumerate(p.placements):
        if placement.is_shard():
            if placement.dim != 0:
                raise ValueError(f"adafactor steps row shards (Shard(0), as fully_shard places them); a "
                                 f"{tuple(p.shape)} parameter is placed {p.placements}: shard it with fully_shard "
                                 "alone or use --optimizer adamw")
            shard_dims.append(mesh_dim)
        elif not placement.is_replicate():
            raise ValueError(f"adafactor cannot step a {tuple(p.shape)} parameter placed {p.placements} (only "
                             "Shard(0) and Replicate()); use --optimizer adamw")
    if len(shard_dims) > 1:
        raise ValueError(f"adafactor steps rows split over one mesh dim; a {tuple(p.shape)} parameter is placed "
                         f"{p.placements} (split over {len(shard_dims)}): use fully_shard alone or --optimizer adamw")
    if not shard_dims or p.device_mesh.size(shard_dims[0]) == 1:
        return None
    return p.device_mesh.get_group(shard_dims[0])


def _reduce_device(p: torch.Tensor, local: torch.Tensor) -> torch.device:
    """Where the sums are reduced: on the mesh's device type, which its backend takes (NCCL takes no host
    tensor, and CPU-offloaded shards live on the host)."""
    DTensor, _ = _dtensor_types()
    return torch.device(p.device_mesh.device_type) if isinstance(p, DTensor) else local.device


def _like(p: torch.Tensor, local: torch.Tensor, shape: tuple[int, ...], *, rows: bool) -> torch.Tensor:
    """``local`` as a state of ``p``: a DTensor on its mesh, split like its rows (``rows``) or whole on every rank,
    with the global shape given, since FSDP2's shards are uneven (torch.chunk's)."""
    DTensor, Replicate = _dtensor_types()
    if not isinstance(p, DTensor):
        return local
    placements = p.placements if rows else [Replicate()] * p.device_mesh.ndim
    stride, size = [], 1
    for extent in reversed(shape):
        stride.insert(0, size)
        size *= extent
    return DTensor.from_local(local, p.device_mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=tuple(stride))
