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
import enum
import errno
import hashlib
import importlib
import json
import logging
import os
import pathlib
import pickle
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from utils import DistInfo, log_rank_0, logger, rng_state, set_rng_state

TRAINER_STATE = "trainer_state.json"
FORMAT_VERSION = 1
# Frozen weights (LoRA's base model) never change, so resume reloads them from the
# model itself; the checkpoint holds only what training moves.
# dcp.load fills exactly the keys get_state_dict listed, so a non-strict set only lets the
# frozen keys be absent.
STATE_OPTIONS = StateDictOptions(ignore_frozen_params=True)
LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


@dataclass
class TrainState:
    """Counters that advance every step."""

    step: int = 0
    samples_seen: int = 0          # stream position: samples consumed, dropped ones included
    samples_trained: int = 0       # real samples that contributed to an update
    last_checkpoint_samples: int = 0
    num_bad_steps: int = 0         # consecutive skipped (non-finite) steps
    best_val_loss: float | None = None          # best validation loss so far (--save-best-val-loss)
    num_validations_without_improvement: int = 0  # for --early-stopping-patience
    wandb_run_id: str | None = None               # a resumed run continues this wandb run


def full_state_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "full_state"


def fingerprint(model_config, dataset, lora=None) -> dict:
    """What must not change between a checkpoint and its resume: model shape, adapters and data.

    ``lora`` (``lora.LoraSettings`` or None) shapes the trainable parameters, so a
    checkpoint of other adapters (or of full fine-tuning) cannot be resumed; its
    base quantization (QLoRA) is part of it too.
    """
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    return {
        "model_type": model_config.model_type,
        "vocab_size": text_config.vocab_size,
        "hidden_size": text_config.hidden_size,
        "num_hidden_layers": text_config.num_hidden_layers,
        "num_data_samples": len(dataset),
        "data_lengths_sha1": hashlib.sha1(np.ascontiguousarray(dataset.lengths, dtype=np.int64)).hexdigest(),
        # QLoRA's base rounding changes every loss: appended only when on, so LoRA checkpoints still match.
        "lora": None if lora is None else ([lora.rank, lora.alpha, lora.target_modules, lora.use_rslora]
                                           + ([lora.quantize_data_type] if lora.quantize_data_type != "none"
                                              else [])),
    }


def agree(ok: bool, device: torch.device) -> bool:
    """True only if every rank says ok (one tiny all-reduce), so ranks fail together, never hang."""
    flag = torch.tensor([1.0 if ok else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


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
    if not agree(error is None, dist_info.device):
        _abort_save(error, final, dist_info)
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
    if not agree(error is None, dist_info.device):
        _abort_save(error, final, dist_info)
    if dist_info.is_main:
        _test_hook("MINI_TRAINER_TEST_KILL_DURING_SAVE", num_samples)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if keep_last_n:
            for old in complete_checkpoints(root)[:-keep_last_n]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    _test_hook("MINI_TRAINER_TEST_KILL_AFTER_SAVE", num_samples)
    return final


def _abort_save(error: str | None, final: Path, dist_info: DistInfo) -> None:
    if error is None:
        error = "another rank failed to write its part (its log names the cause)"
    logger.error("full-state checkpoint %s could not be saved: %s. Earlier checkpoints are intact; "
                 "re-run the same command to resume from the newest one.", final, error)
    raise SystemExit(1)


def _cause(err: BaseException) -> str:
    """The error itself, plus advice only where the advice fits the cause."""
    leaf = err
    while not isinstance(leaf, OSError) and (leaf.__cause__ or leaf.__context__) is not None:
        leaf = leaf.__cause__ or leaf.__context__
    if isinstance(leaf, OSError) and leaf.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{leaf} (the disk or quota is full: free space)"
    if isinstance(leaf, OSError) and leaf.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{leaf} (fix the folder's permissions)"
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


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


def checkpoint_error_cause(err: BaseException) -> str:
    """One line naming what went wrong: DCP (torch <= 2.11 on load, every version on save) wraps each
    rank's error in a ``CheckpointException`` whose own first line names only the ranks."""
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
        reader = MetadataSafeReader(path)
        try:
            model_state, optim_state = get_state_dict(model, optimizer, options=STATE_OPTIONS)
            dcp.load({"model": model_state, "optim": optim_state}, storage_reader=reader)
            set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                           options=LOAD_OPTIONS)
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


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop metric lines logged after the checkpoint we resume from, so no step appears twice."""
    if not path.is_file():
        return
    kept = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            # A kill mid-write leaves half a line; it is dropped (its step is re-run) rather than
            # crashing rank 0 while the other ranks wait for it.
            logger.warning("%s line %d is not complete JSON (a kill mid-write?): dropped", path, number)
            continue
        if record.get("step", 0) <= last_step:
            kept.append(line)
    path.write_text("".join(line + "\n" for line in kept))


def _test_hook(name: str, num_samples: int) -> None:
    """Test-only fault injection: SIGKILL this process at a chosen point (env var = sample count)."""
    if os.environ.get(name) == str(int(num_samples)):
        logging.getLogger("mini_trainer").warning("%s: killing this process now", name)
        os.kill(os.getpid(), 9)


def resume_train_state(model, optimizer, scheduler, *, output_dir: str | Path, resume: bool,
                       resume_from: str | None, model_fingerprint: dict, dist_info: DistInfo) -> TrainState:
    """Continue from the newest complete full-state checkpoint (or ``resume_from``), else start fresh.

    Restores model, optimizer and scheduler in place and returns the counters.
    Exits every rank with a message when the checkpoint does not match.
    """
    if not resume:
        log_rank_0("--no-resume: starting fresh")
        return TrainState()
    if resume_from:
        candidates = [Path(resume_from)]
    else:
        candidates = complete_checkpoints(full_state_root(output_dir))
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


class PreemptionFlag:
    """SIGTERM/SIGUSR1 (SLURM's warning before a kill) ask for a checkpoint at the end of the step."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.requested = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def _handle(self, signum, frame) -> None:
        self.requested = True
        logger.warning("received %s: will checkpoint and exit after this step", signal.Signals(signum).name)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# DCP's .metadata is a pickle: left to ``pickle.load`` (as torch's own reader does), a crafted
# checkpoint folder could run code at resume. It is made of a few of torch's own dataclasses and
# enums, tensor sizes, dtypes and layouts, and the folder path; nothing else may be loaded.
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_METADATA_PATHS = ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")


def metadata_global(module: str, name: str) -> Any:
    """The object a DCP ``.metadata`` pickle may refer to as ``module.name``; UnpicklingError otherwise."""
    if module in _METADATA_MODULES:
        found = getattr(importlib.import_module(module), name, None)
        if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
            return found
    elif module == "torch":
        found = getattr(torch, name, None)
        if found is torch.Size or isinstance(found, torch.dtype):
            return found
    elif (module, name) == ("torch.serialization", "_get_layout"):
        return torch.serialization._get_layout  # a lookup of a layout by its name
    elif module in ("pathlib", "pathlib._local") and name in _METADATA_PATHS:  # 3.13 names the latter
        return getattr(pathlib, name)
    elif module in ("builtins", "__builtin__") and name == "getattr":
        return enum_member_by_name
    raise pickle.UnpicklingError(f"refusing {module}.{name}: not part of a checkpoint's metadata "
                                 "(a checkpoint folder must not be able to run code)")


def enum_member_by_name(owner: Any, name: Any) -> enum.Enum:
    """The only ``getattr`` a DCP ``.metadata`` pickle may call: some CPython patch releases (Debian 12's
    3.11.2 among them) pickle an enum member as ``getattr(EnumClass, 'MEMBER')`` where others pickle it by
    value. So the lookup is allowed for a member name of an enum class that is itself allowed, nothing else."""
    allowed = (isinstance(owner, type) and issubclass(owner, enum.Enum)
               and _is_allowed_global(owner.__module__, owner.__qualname__, owner))
    if allowed and isinstance(name, str) and name in owner.__members__:
        return owner[name]
    shown = owner.__qualname__ if isinstance(owner, type) else type(owner).__qualname__
    raise pickle.UnpicklingError(f"refusing getattr({shown}, {name!r}): only a member of an allowed enum may be "
                                 "looked up by name in a checkpoint's metadata")


def _is_allowed_global(module: str, name: str, expected: Any) -> bool:
    try:
        return metadata_global(module, name) is expected
    except pickle.UnpicklingError:
        return False


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return metadata_global(module, name)


class MetadataSafeReader(dcp.FileSystemReader):
    """torch's FileSystemReader, reading ``.metadata`` with an allowlist instead of plain pickle
    (the tensor files it reads already go through ``torch.load(weights_only=True)``)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        try:
            with open(Path(self.path) / name, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (OSError, pickle.UnpicklingError, EOFError) as err:
            # Kept for the warning: torch <= 2.11's dcp.load swallows this (then tries a per-rank
            # __<rank>.metadata, which is absent) and reports only "metadata is None".
            if rank is None:
                self.metadata_error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            raise
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
