"""Distributed start-up and how ranks stop together: ``init_distributed()`` joins the torchrun job (cuda+nccl
with a GPU, cpu+gloo otherwise, or a one-process group without torchrun) and ``cleanup()`` leaves it; a
refusal on any rank stops every rank (``fail_together``), and a lost rank is named in one line."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

from minitrainer.common.device import device_type
from minitrainer.common.exits import EXIT_FAILED
from minitrainer.common.log import log_rank_0, logger, note_exit_line


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    local_rank: int
    world_size: int
    device: Any  # torch.device; typed loosely so this module imports without torch
    processes: tuple[tuple[str, int], ...] = ()  # (host, pid) of every rank, by rank; () when unknown

    @property
    def is_main(self) -> bool:
        return self.rank == 0




def process_group_backend(device: str, *, cpu_offload: bool = False) -> str:
    """nccl for cuda, gloo for cpu; with CPU offload on a GPU both, since gradient
    clipping then reduces norms of CPU-resident shards (a CPU collective)."""
    import torch.distributed as dist

    if device == "cuda" and cpu_offload:
        return "cuda:nccl,cpu:gloo"
    return dist.Backend.default_device_backend_map[device]


def positive_env_number(name: str, default: float) -> float:
    """``float(os.environ[name])`` or ``default``; a ValueError naming the variable unless positive."""
    value = float(os.environ.get(name, default))
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def init_distributed(timeout_minutes: float = 30.0, *, cpu_offload: bool = False) -> DistInfo:
    """Join the torchrun job (or become a one-process job without torchrun).

    The backend is ``process_group_backend``'s. ``MINI_TRAINER_DIST_TIMEOUT_MINUTES``
    overrides the collective timeout, the longest any rank waits in a collective
    for a peer that died (torch reads no variable for it; the SLURM script sets it).
    """
    import datetime

    import torch
    import torch.distributed as dist

    timeout_minutes = positive_env_number("MINI_TRAINER_DIST_TIMEOUT_MINUTES", timeout_minutes)
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    dtype = device_type()
    if dtype == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        # Plain `python train.py`: a one-process group keeps one code path. Its store lives in this process:
        # a TCP port picked free and bound a moment later can be taken meanwhile (EADDRINUSE on a busy host).
        alone = "MASTER_ADDR" not in os.environ and world_size == 1
        dist.init_process_group(
            backend=process_group_backend(dtype, cpu_offload=cpu_offload),
            store=dist.HashStore() if alone else None,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes),
            device_id=device if dtype == "cuda" else None,
        )
    processes: list[tuple[str, int] | None] = [None] * world_size
    dist.all_gather_object(processes, (socket.gethostname(), os.getpid()))  # lets a survivor name a lost rank
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=device,
                    processes=tuple(tuple(p) for p in processes))


def lost_ranks(dist_info: DistInfo) -> list[str]:
    """The ranks on this host whose process is gone (killed: the out-of-memory killer, ``kill -9``),
    as ``"rank R (pid P on HOST)"``; a rank on another host cannot be checked from here."""
    host = socket.gethostname()
    lost = []
    for rank, (peer_host, pid) in enumerate(dist_info.processes):
        if rank != dist_info.rank and peer_host == host and not pid_alive(pid):
            lost.append(f"rank {rank} (pid {pid} on {peer_host})")
    return lost


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process holds that pid
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True  # no /proc (macOS): the signal test above is all there is


def first_error(error: str | None) -> str | None:
    """The lowest rank's error line (each rank passes its own, or None), the same on every rank.

    The one way ranks agree in this toolkit: a refusal or failure seen on any rank
    (rank 0's checks, one rank's failed write) reaches every rank, so they stop
    together instead of waiting in their next collective for a rank that left.
    Collective: every rank calls it. Not for the hot path (it pickles).
    """
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return error
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((line for line in errors if line is not None), None)


def fail_together(error: str | None) -> None:
    """Exit every rank with code 1 when any rank has an error line; rank 0 logs it."""
    error = first_error(error)
    if error is not None:
        log_rank_0(error, level=logging.ERROR)
        note_exit_line(error)
        raise SystemExit(EXIT_FAILED)


@contextlib.contextmanager
def stop_in_one_line(dist_info: DistInfo):
    """Around the training loop: the failures a cluster causes end this rank with one line, exit code 1.

    * An ``OSError`` of this rank's own writes (the metrics file on a disk another writer filled):
      its message names the file and the cause.
    * A collective that failed because a peer rank is gone (it stopped on its own error, or the
      out-of-memory killer took it): the line names the lost rank, rather than gloo's traceback.

    Anything else propagates unchanged. Used inside the preemption flag's scope, so a SIGTERM
    from torchrun arriving meanwhile finds its handler (which also names the lost rank).
    """
    try:
        yield
    except OSError as err:
        logger.error("stopping: %s; the newest complete full state is intact: rerun the same command to resume "
                     "from it", err)
        raise SystemExit(1) from None
    except RuntimeError as err:  # gloo: "Connection closed by peer"; NCCL raises nothing, it waits
        lost = _wait_for_lost_ranks(dist_info, err)
        if not lost:
            raise
        logger.error("%s is gone (it stopped on its own error, logged there, or was killed, e.g. by the "
                     "out-of-memory killer): stopping this rank too; rerun the same command to resume from the "
                     "newest full state", ", ".join(lost))
        raise SystemExit(1) from None


def _wait_for_lost_ranks(dist_info: DistInfo, err: BaseException, timeout: float = 10.0) -> list[str]:
    """The peers that are gone after ``err``; a peer that closed its connection may still be exiting."""
    import time

    closed = any(text in str(err) for text in ("Connection closed by peer", "Connection reset by peer"))
    deadline = time.monotonic() + (timeout if closed else 0.0)
    while True:
        lost = lost_ranks(dist_info)
        if lost or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if not lost and closed:
        lost = ["a rank on another host"]
    return lost


def reshard(model) -> None:
    """Free what no-grad forwards of ``model`` (an FSDP2-sharded module) left gathered: the root is not resharded after its forward (backward needs
    the LM head first), nor anything with SHARD_GRAD_OP (reshard_after_forward=False); without a backward
    nothing else would, and the first training step or the optimizer then meets unsharded parameters."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def cleanup() -> None:
    """Leave the process group, pairing with ``init_distributed``."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
