"""Full training state for exact resume: ``<output-dir>/full_state/samples_<N>/``.

Layout of one checkpoint folder::

    full_state/samples_480/
        .metadata, __0_0.distcp, __1_0.distcp, ...   torch.distributed.checkpoint: sharded model
                                                     and AdamW state, one file per rank, no gather
        rng_rank0.pt, rng_rank1.pt, ...             Python/NumPy/torch RNG states of every rank
        trainer_state.json                          step and sample counters, sampler position,
                                                    LR scheduler, metrics-file position, a
                                                    fingerprint of the model and data, and the
                                                    checksum of every shard and RNG file

A checkpoint is written into ``.samples_<N>.tmp`` and renamed once every rank
has finished, so a crash or kill mid-save leaves the previous one intact. DCP
reshards on load, so a run may resume on a different number of ranks.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import pickle
import shutil
from pathlib import Path

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from minitrainer.checkpoint import resume_policy
from minitrainer.checkpoint.train_state import TrainState
from minitrainer.common import fault_injection
from minitrainer.common.distributed import DistInfo, first_error
from minitrainer.common.log import log_rank_0, logger
from minitrainer.common.rng import rng_state, set_rng_state

TRAINER_STATE = "trainer_state.json"
CHECKSUMS = "checksums"
"""trainer_state.json's map of every shard and RNG file to its ``file_digest``, checked before a resume loads."""
FORMAT_VERSION = 1

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions
# torch.distributed.checkpoint is imported where a full state is written or read (about 0.2 s beyond DTensor, 0.8 s
# without it): a process that only lists checkpoints or refuses its flags does not pay for it.


def _options(model) -> tuple[StateDictOptions, StateDictOptions]:
    """``(save options, load options)`` for this model (the FSDP-wrapped ``CausalLMWithLoss``).

    Frozen weights (a frozen base model) never change, so a resume reloads them from the model itself and
    the checkpoint holds only what training moves, unless the method says they must be saved
    (``FineTuningMethod.saves_frozen_weights``). dcp.load fills exactly the keys get_state_dict listed, so
    a non-strict load only lets the frozen keys be absent.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    ignore_frozen = not model.method.saves_frozen_weights(model)
    return (StateDictOptions(ignore_frozen_params=ignore_frozen),
            StateDictOptions(ignore_frozen_params=ignore_frozen, strict=False))


def full_state_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "full_state"


def tmp_folder(final: Path) -> Path:
    """Where ``final`` (``samples_N``) is written before its rename: ``.samples_N.tmp``. Hidden and not
    starting with ``samples_``, so no glob of finished checkpoints (``samples_*``, ``*``) lists it."""
    return final.with_name(f".{final.name}.tmp")


def save_full_state(model, optimizer, scheduler, *, output_dir: str | Path, num_samples: int,
                    trainer_state: dict, model_fingerprint: dict, dist_info: DistInfo,
                    keep_last_n: int | None) -> Path:
    """Write the sharded training state (collective: every rank calls this).

    Raises:
        SystemExit: on every rank when any rank failed to write (disk full,
            unwritable folder); the previous checkpoint is untouched.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = full_state_root(output_dir)
    final = root / f"samples_{int(num_samples)}"
    tmp = tmp_folder(final)
    error = None
    try:
        if dist_info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
    except OSError as err:
        error = f"cannot create {tmp}: {_cause(err)}"
    _abort_save_on_error(first_error(error), final, is_main=dist_info.is_main)
    digests = {}
    try:
        model_state, optim_state = get_state_dict(model, optimizer, options=_options(model)[0])
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
        torch.save(rng_state(), tmp / f"rng_rank{dist_info.rank}.pt")  # tensors and numbers: no pickle needed
        digests = {path.name: file_digest(path) for path in _files_of_rank(tmp, dist_info.rank)}
    except (OSError, dcp.CheckpointException, RuntimeError) as err:
        error = f"writing {tmp} failed: {_cause(err, folder=tmp)}"
    _abort_save_on_error(first_error(error), final, is_main=dist_info.is_main)
    # Each rank hashed the files it wrote, in parallel; rank 0 records them all.
    gathered = [None] * dist_info.world_size if dist_info.is_main else None
    dist.gather_object(digests, gathered, dst=0)
    if dist_info.is_main:
        state = {**trainer_state, "format_version": FORMAT_VERSION, "world_size": dist_info.world_size,
                 "scheduler": _plain_numbers(scheduler.state_dict()), "fingerprint": model_fingerprint,
                 CHECKSUMS: {name: digest for part in gathered for name, digest in sorted(part.items())}}
        try:
            (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=2, sort_keys=True))
        except OSError as err:
            error = f"writing {tmp / TRAINER_STATE} failed: {_cause(err)}"
    _abort_save_on_error(first_error(error), final, is_main=dist_info.is_main)
    if dist_info.is_main:
        fault_injection.kill_at(fault_injection.KILL_DURING_SAVE, num_samples)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if keep_last_n:
            for old in complete_checkpoints(root)[:-keep_last_n]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    fault_injection.kill_at(fault_injection.KILL_AFTER_SAVE, num_samples)
    return final


def file_digest(path: Path) -> str:
    """xxh3-128 of a file's bytes, read in 8 MiB blocks. A checksum against disk and copy corruption, not
    against tampering (whoever can rewrite a shard can rewrite trainer_state.json too). xxh3 (``xxhash``, a
    dependency of ``datasets``) hashes about 8 GB/s on one core where sha256 does 0.5: it adds well under
    a second to a rank's save of a 1.5B model's full state (about 2.3 GB per rank on 8 ranks)."""
    import xxhash

    digest = xxhash.xxh3_128()
    with path.open("rb") as f:
        while block := f.read(1 << 23):
            digest.update(block)
    return digest.hexdigest()


def _files_of_rank(folder: Path, rank: int) -> list[Path]:
    """The files one rank writes into a full state: its DCP shard(s) and its RNG state. ``.metadata``
    is not checksummed: it is checked by being parsed (``safe_metadata``), and a checkpoint whose
    metadata was rewritten by another interpreter (``tests/test_resume.py``) must still resume."""
    return sorted(folder.glob(f"__{rank}_*.distcp")) + [folder / f"rng_rank{rank}.pt"]


def verify(path: Path, state: dict, *, rank: int, world_size: int) -> str | None:
    """Why ``path`` must not be loaded, as a warning line (its ``.metadata`` does not parse, or a file
    differs from the checksum written with it), or None.

    Every rank parses the metadata (DCP reads it on every rank, and prints a traceback per failed
    read); the checksummed files are split over the ranks, so each file is read once.
    """
    from minitrainer.checkpoint.safe_metadata import MetadataSafeReader

    try:
        MetadataSafeReader(path).read_metadata()
    except (EOFError, OSError, pickle.UnpicklingError) as err:
        return f"skipping unreadable checkpoint {path}: .metadata: {str(err) or type(err).__name__}"
    checksums = state.get(CHECKSUMS)
    if checksums is None:  # written before checksums were: nothing to compare
        return None
    for name in sorted(checksums)[rank::world_size]:
        if not (path / name).is_file():
            return f"skipping corrupt checkpoint {path}: {name} is missing"
        if file_digest(path / name) != checksums[name]:
            return (f"skipping corrupt checkpoint {path}: {name} does not match the checksum written with it "
                    "(its bytes changed on disk since)")
    return None


def _abort_save_on_error(error: str | None, final: Path, *, is_main: bool) -> None:
    """Every rank stops when any rank could not write its part; each names the first cause.
    The half-written ``.tmp`` is removed (rank 0), giving back the space a full disk needs."""
    if error is None:
        return
    if is_main:
        shutil.rmtree(tmp_folder(final), ignore_errors=True)
    logger.error("full-state checkpoint %s could not be saved: %s. Earlier checkpoints are intact; "
                 "re-run the same command to resume from the newest one.", final, error)
    raise SystemExit(1)


FULL_DISK_BYTES = 64 * 2**20
"""A write that failed without an errno, on a file system with less free space than this, is taken for a full disk."""


def _plain_numbers(state: dict) -> dict:
    """The scheduler's state with one-number tensors as numbers: torchao's 8-bit AdamW keeps its learning
    rates as tensors, which the scheduler records (``base_lrs``, ``_last_lr``) and JSON cannot hold."""
    def plain(value):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return value.item()
        if isinstance(value, list):
            return [plain(item) for item in value]
        return value

    return {key: plain(value) for key, value in state.items()}


def _cause(err: BaseException, *, folder: Path | None = None) -> str:
    """The error itself, plus advice only where the advice fits the cause.

    torch's zip writer (inside DCP's save too) reports a full disk as ``RuntimeError: ... unexpected pos
    704 vs 598``, and DCP passes other ranks' errors on without their chained OSError; so a failure
    that names no errno is checked against the free space of ``folder``."""
    import torch.distributed.checkpoint as dcp

    leaf = err
    while not isinstance(leaf, OSError):
        if isinstance(leaf, dcp.CheckpointException) and leaf.failures:
            # DCP gathers each rank's exception as (exception, traceback); its own str is only the rank list.
            leaf = next(iter(leaf.failures.values()))[0]
        elif (leaf.__cause__ or leaf.__context__) is not None:
            leaf = leaf.__cause__ or leaf.__context__
        else:
            break
    if isinstance(leaf, OSError) and leaf.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{leaf} (the disk or quota is full: free space)"
    if isinstance(leaf, OSError) and leaf.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{leaf} (fix the folder's permissions)"
    if not isinstance(leaf, OSError) and folder is not None:
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            free = None
        if free is not None and free < FULL_DISK_BYTES:
            return (f"No space left on device: {folder} has {free / 2**20:.1f} MiB free (the disk or quota is full: "
                    f"free space); the write failed with {type(leaf).__name__}: {str(leaf).splitlines()[0]}")
    return f"{type(leaf).__name__}: {str(leaf).splitlines()[0] if str(leaf) else ''}"


def remove_leftover_tmp(output_dir: str | Path) -> list[Path]:
    """Delete the temporary folders a kill mid-save left behind (rank 0, at start): ``.samples_N.tmp``,
    and ``samples_N.tmp`` of versions that named them so."""
    removed = []
    for root in (full_state_root(output_dir), Path(output_dir) / "hf_format"):
        if root.is_dir():
            for path in [*root.glob(".samples_*.tmp"), *root.glob("samples_*.tmp")]:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Finished checkpoint folders, oldest first (``.tmp`` leftovers are not listed)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        name = path.name
        if path.is_dir() and name.startswith("samples_") and name.removeprefix("samples_").isdigit():
            found.append((int(name.removeprefix("samples_")), path))
    return [path for _, path in sorted(found)]


def checkpoint_error_cause(err: BaseException) -> str:
    """One line naming what went wrong: DCP (torch <= 2.11 on load, every version on save) wraps each
    rank's error in a ``CheckpointException`` whose own first line names only the ranks."""
    import torch.distributed.checkpoint as dcp

    if isinstance(err, dcp.CheckpointException) and err.failures:
        rank, (cause, _) = next(iter(sorted(err.failures.items(), key=lambda item: item[0])))
        first = str(cause).splitlines()[0] if str(cause) else ""
        return f"rank {rank}: {type(cause).__name__}: {first}"
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def load_full_state(candidates: list[Path], model, optimizer, scheduler, *, model_fingerprint: dict,
                    dist_info: DistInfo) -> dict:
    """Restore from the newest loadable candidate; corrupt ones are skipped with a warning.

    Returns:
        The restored ``trainer_state`` dict (counters, sampler position, ...).

    Raises:
        ValueError: the checkpoint belongs to another model or dataset, or none loads.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from minitrainer.checkpoint.safe_metadata import MetadataSafeReader

    for path in reversed(candidates):
        state_file = path / TRAINER_STATE
        if not state_file.is_file() or not (path / ".metadata").is_file():
            logger.warning("skipping incomplete checkpoint %s (no %s or .metadata)", path, TRAINER_STATE)
            continue
        try:
            state = json.loads(state_file.read_text())
        except (OSError, json.JSONDecodeError) as err:
            logger.warning("skipping corrupt checkpoint %s: %s", path, err)
            continue
        details, _ = resume_policy.fingerprint_mismatch(state["fingerprint"], model_fingerprint)
        if details:  # fields a checkpoint predates were already warned about (resume_policy.check_resume)
            raise ValueError(f"{path} was written for another model or dataset ({details}); "
                             "use --no-resume or another --output-dir")
        # Agreed, so every rank skips the same checkpoint; before any byte of it is loaded.
        problem = first_error(verify(path, state, rank=dist_info.rank, world_size=dist_info.world_size))
        if problem is not None:
            log_rank_0(problem, level=logging.WARNING)
            continue
        reader = MetadataSafeReader(path)
        try:
            save_options, load_options = _options(model)
            model_state, optim_state = get_state_dict(model, optimizer, options=save_options)
            dcp.load({"model": model_state, "optim": optim_state}, storage_reader=reader)
            set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                           options=load_options)
        except (OSError, dcp.CheckpointException, RuntimeError, pickle.UnpicklingError) as err:
            logger.warning("skipping unreadable checkpoint %s: %s", path,
                           getattr(reader, "metadata_error", None) or checkpoint_error_cause(err))
            continue
        scheduler.load_state_dict(state["scheduler"])
        rng_file = path / f"rng_rank{dist_info.rank}.pt"
        if state["world_size"] == dist_info.world_size and rng_file.is_file():
            # weights_only: a checkpoint folder must never be able to run code on load.
            try:
                set_rng_state(torch.load(rng_file, weights_only=True))
            except (pickle.UnpicklingError, KeyError) as err:
                logger.warning("RNG state %s not restored (%s): RNG streams re-seeded", rng_file,
                               str(err).splitlines()[0])
        else:
            logger.info("world size changed (%d -> %d): RNG streams re-seeded rather than restored",
                        state["world_size"], dist_info.world_size)
        state["path"] = str(path)
        return state
    raise ValueError(f"no loadable full-state checkpoint among {[str(p) for p in candidates]}")


def resume_candidates(output_dir: str | Path, *, resume: bool, resume_from: str | None) -> list[Path]:
    """The full states a resume may load, oldest first: ``resume_from`` alone, else every complete one."""
    if not resume:
        return []
    return [Path(resume_from)] if resume_from else complete_checkpoints(full_state_root(output_dir))


def resume_train_state(model, optimizer, scheduler, *, candidates: list[Path], resume: bool,
                       model_fingerprint: dict, dist_info: DistInfo) -> TrainState:
    """Continue from the newest loadable of ``candidates`` (``resume_candidates``), else start fresh.

    Restores model, optimizer and scheduler in place and returns the counters.
    Exits every rank with a message when the checkpoint does not match.
    """
    if not resume:
        log_rank_0("--no-resume: starting fresh")
        return TrainState()
    if not candidates:
        return TrainState()
    try:
        restored = load_full_state(candidates, model, optimizer, scheduler, model_fingerprint=model_fingerprint,
                                   dist_info=dist_info)
    except ValueError as err:
        if dist_info.is_main:
            logger.error("cannot resume: %s", err)
        raise SystemExit(1) from err
    fields = {f.name for f in dataclasses.fields(TrainState)}
    state = TrainState(**{k: v for k, v in restored.items() if k in fields})
    log_rank_0("resumed from %s: step %d, %d samples consumed (epoch %d), lr %.3g, written by %d ranks, "
               "now %d", restored["path"], state.step, state.samples_seen,
               state.samples_seen // max(int(restored["fingerprint"]["num_data_samples"]), 1),
               scheduler.get_last_lr()[0], restored["world_size"], dist_info.world_size)
    return state


