"""Full training state for exact resume: ``<output-dir>/full_state/samples_<N>/``.

Layout of one checkpoint folder::

    full_state/samples_480/
        .metadata, __0_0.distcp, __1_0.distcp, ...   torch.distributed.checkpoint: sharded model
                                                     and AdamW state, one file per rank, no gather
        rng_rank0.pt, rng_rank1.pt, ...             Python/NumPy/torch RNG states of every rank
        trainer_state.json                          step and sample counters, sampler position,
                                                    LR scheduler, metrics-file position, and a
                                                    fingerprint of the model and data

A checkpoint is written into ``samples_<N>.tmp`` and renamed once every rank
has finished, so a crash or kill mid-save leaves the previous one intact. DCP
reshards on load, so a run may resume on a different number of ranks.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import pickle
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import fault_injection
from safe_metadata import MetadataSafeReader
from train_state import TrainState
from utils import DistInfo, first_error, log_rank_0, logger, rng_state, set_rng_state

TRAINER_STATE = "trainer_state.json"
FORMAT_VERSION = 1
# Frozen weights (LoRA's base model) never change, so resume reloads them from the
# model itself; the checkpoint holds only what training moves.
# dcp.load fills exactly the keys get_state_dict listed, so a non-strict set only lets the
# frozen keys be absent.
STATE_OPTIONS = StateDictOptions(ignore_frozen_params=True)
LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


def full_state_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "full_state"


def save_full_state(model, optimizer, scheduler, *, output_dir: str | Path, num_samples: int,
                    trainer_state: dict, model_fingerprint: dict, dist_info: DistInfo,
                    keep_last_n: int | None) -> Path:
    """Write the sharded training state (collective: every rank calls this).

    Raises:
        SystemExit: on every rank when any rank failed to write (disk full,
            unwritable folder); the previous checkpoint is untouched.
    """
    root = full_state_root(output_dir)
    final = root / f"samples_{int(num_samples)}"
    tmp = final.with_name(final.name + ".tmp")
    error = None
    try:
        if dist_info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
    except OSError as err:
        error = f"cannot create {tmp}: {_cause(err)}"
    _abort_save_on_error(first_error(error), final, is_main=dist_info.is_main)
    try:
        model_state, optim_state = get_state_dict(model, optimizer, options=STATE_OPTIONS)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
        torch.save(rng_state(), tmp / f"rng_rank{dist_info.rank}.pt")  # tensors and numbers: no pickle needed
        if dist_info.is_main:
            state = {**trainer_state, "format_version": FORMAT_VERSION, "world_size": dist_info.world_size,
                     "scheduler": scheduler.state_dict(), "fingerprint": model_fingerprint}
            (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=2, sort_keys=True))
    except (OSError, dcp.CheckpointException, RuntimeError) as err:
        error = f"writing {tmp} failed: {_cause(err)}"
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


def _abort_save_on_error(error: str | None, final: Path, *, is_main: bool) -> None:
    """Every rank stops when any rank could not write its part; each names the first cause.
    The half-written ``.tmp`` is removed (rank 0), giving back the space a full disk needs."""
    if error is None:
        return
    if is_main:
        shutil.rmtree(final.with_name(final.name + ".tmp"), ignore_errors=True)
    logger.error("full-state checkpoint %s could not be saved: %s. Earlier checkpoints are intact; "
                 "re-run the same command to resume from the newest one.", final, error)
    raise SystemExit(1)


def _cause(err: BaseException) -> str:
    """The error itself, plus advice only where the advice fits the cause."""
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
    return f"{type(leaf).__name__}: {str(leaf).splitlines()[0] if str(leaf) else ''}"


def remove_leftover_tmp(output_dir: str | Path) -> list[Path]:
    """Delete ``samples_N.tmp`` folders a kill mid-save left behind (rank 0, at start)."""
    removed = []
    for root in (full_state_root(output_dir), Path(output_dir) / "hf_format"):
        if root.is_dir():
            for path in root.glob("samples_*.tmp"):
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


def load_full_state(candidates: list[Path], model, optimizer, scheduler, *, model_fingerprint: dict,
                    dist_info: DistInfo) -> dict:
    """Restore from the newest loadable candidate; corrupt ones are skipped with a warning.

    Returns:
        The restored ``trainer_state`` dict (counters, sampler position, ...).

    Raises:
        ValueError: the checkpoint belongs to another model or dataset, or none loads.
    """
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
        mismatch = {k: (state["fingerprint"].get(k), v) for k, v in model_fingerprint.items()
                    if state["fingerprint"].get(k) != v}
        if mismatch:
            details = ", ".join(f"{k}: checkpoint {old!r} vs now {new!r}" for k, (old, new) in mismatch.items())
            raise ValueError(f"{path} was written for another model or dataset ({details}); "
                             "use --no-resume or another --output-dir")
        try:
            model_state, optim_state = get_state_dict(model, optimizer, options=STATE_OPTIONS)
            dcp.load({"model": model_state, "optim": optim_state}, storage_reader=MetadataSafeReader(path))
            set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                           options=LOAD_OPTIONS)
        except (OSError, dcp.CheckpointException, RuntimeError, pickle.UnpicklingError) as err:
            logger.warning("skipping unreadable checkpoint %s: %s", path, str(err).splitlines()[0])
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


