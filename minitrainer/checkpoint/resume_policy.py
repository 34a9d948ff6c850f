"""Safe resume: continue a run only with the parameters it was started with.

Every full-state checkpoint records ``run_params``, the values that shape the
optimisation (``RUN_PARAM_FIELDS`` plus the number of scheduled steps of a
decaying schedule). Before the model loads, rank 0 compares them with this
command's values:

* equal: resume as usual;
* different: refuse, naming each changed field, unless ``--allow-config-change``
  is given, in which case the checkpoint's weights, optimizer and stream
  position are kept and the new values apply from the next step;
* ``--no-resume`` in a folder that already holds checkpoints: they are moved,
  with the run's metrics and ``training_params.json``, into
  ``<output-dir>/superseded_<UTC time>/`` (logged), so a later plain run or
  retention never mixes the two runs;
* a run that already met its stop condition says so, with how to continue.

All functions here are pure or touch only rank 0's files; no collectives.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import numpy as np

from minitrainer.data.mix import parse_data_spec

RUN_PARAM_FIELDS = ("learning_rate", "lr_scheduler", "num_warmup_steps", "batch_size", "seed", "weight_decay",
                    "adam_betas", "max_grad_norm")
"""TrainConfig fields a resumed run must keep (stop conditions may grow; see ``run_params``). The data
itself (and the validation split carved from it) is checked by content in ``fingerprint``,
so a moved or renamed data folder still resumes."""

MOVABLE = ("full_state", "hf_format", "training_params.json")


ADDED_LATER = ("data_content_xxh3", "model_weights_xxh3")
"""Fingerprint fields that checkpoints of older versions lack: their absence is not a mismatch (the
other fields still are compared), so a run started before the field existed still resumes, with a warning."""

NOT_COMPARED = ("model_source",)
"""Fingerprint fields that only name things for the messages: a model folder that moved still resumes
(its weights digest is what is compared)."""

WEIGHT_SUFFIXES = (".safetensors", ".bin")
WHOLE_FILE_BYTES = 16 * 2**20
"""Weight files up to this size are hashed whole; larger ones by their head, tail and evenly spaced samples."""
HEAD_BYTES = 2**20     # a safetensors header (names, shapes, offsets): well under 1 MiB even for 70B shards
NUM_SAMPLES = 64
SAMPLE_BYTES = 64 * 2**10


def fingerprint(model_config, dataset, method, *, data_digest: str, model_source: str, weights_digest: str) -> dict:
    """What must not change between a checkpoint and its resume: model (shape and weights), fine-tuning
    method and data.

    ``method`` (``methods.base.FineTuningMethod``) adds what shapes its trainable parameters
    (``FineTuningMethod.fingerprint``: another adapter rank, factors of other shapes), so a checkpoint of
    another method or other settings cannot be resumed; a field it leaves out counts as None.
    ``data_digest`` is ``dataset.content_digest()``: every token id and label, so a file
    re-tokenized with the same lengths (another template, other masks) is not resumed on.
    ``weights_digest`` is ``weights_digest(model_source, ...)``: another checkpoint of the same shape
    (another seed, another fine-tune of the same family) is another model.
    """
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    return {
        "model_type": model_config.model_type,
        "vocab_size": text_config.vocab_size,
        "hidden_size": text_config.hidden_size,
        "num_hidden_layers": text_config.num_hidden_layers,
        "num_data_samples": len(dataset),
        "data_lengths_sha1": hashlib.sha1(np.ascontiguousarray(dataset.lengths, dtype=np.int64)).hexdigest(),
        "data_content_xxh3": data_digest,
        "model_source": model_source,
        "model_weights_xxh3": weights_digest,
        **method.fingerprint(),
    }


def weights_digest(model_name_or_path: str, *, commit_hash: str | None = None) -> str:
    """A cheap identity of a model's weights: xxh3-128 of each weight file's name, size and bytes.

    A file up to ``WHOLE_FILE_BYTES`` is hashed whole; a larger one by its first ``HEAD_BYTES`` (the
    safetensors header: every tensor's name, dtype, shape and offset), its last ``SAMPLE_BYTES`` and
    ``NUM_SAMPLES`` blocks of ``SAMPLE_BYTES`` evenly spaced between: about 5 MiB read per file whatever
    its size. Two trainings of one architecture differ in every tensor, so the samples tell them apart;
    two checkpoints that differ only in bytes between the samples (one tensor edited) are not told apart.
    A hub id (no local folder) is identified by its resolved commit (``commit_hash``): the download
    happens later, on rank 0 only.
    """
    import xxhash

    folder = Path(model_name_or_path)
    if not folder.is_dir():
        return f"hub:{model_name_or_path}@{commit_hash}"
    digest = xxhash.xxh3_128()
    for path in sorted(p for p in folder.iterdir() if p.name.endswith(WEIGHT_SUFFIXES) and p.is_file()):
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            if size <= WHOLE_FILE_BYTES:
                while block := f.read(2**22):
                    digest.update(block)
                continue
            digest.update(f.read(HEAD_BYTES))
            stride = (size - HEAD_BYTES) // (NUM_SAMPLES + 1)
            for offset in [HEAD_BYTES + stride * (i + 1) for i in range(NUM_SAMPLES)] + [size - SAMPLE_BYTES]:
                f.seek(offset)
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


OMITTED_AT_DEFAULT = {"optimizer": "adamw", "optimizer_args": {}, "adam_eps": 1e-8}
"""``run_params`` fields left out at these values, so full states written before the flags existed resume."""


def run_params(config, total_steps: int | None, *, objective, schedule_has_total: bool) -> dict:
    """The values a checkpoint records and a resume compares (JSON-safe).

    ``total_steps`` is only part of it for decaying schedules: there it shapes the
    learning rate of every step; with constant ones a longer run is a plain continuation.
    """
    params = {name: getattr(config, name) for name in RUN_PARAM_FIELDS}
    params["adam_betas"] = list(params["adam_betas"])
    if config.optimizer != "adamw":  # absent for the default, so full states written before the choice resume
        params["optimizer"] = config.optimizer
    if config.optimizer_args:  # absent when empty, so full states written before the flag resume
        params["optimizer_args"] = config.optimizer_args
    if config.adam_eps != 1e-8:  # the same: absent for AdamW's default, which states before the flag trained with
        params["adam_eps"] = config.adam_eps
    params.update(objective.run_params())  # the run's TrainingObjective: none for SFT, as before objectives existed
    if schedule_has_total:
        params["scheduled_steps"] = total_steps
    sources = parse_data_spec(config.data_path)
    if sources is not None:
        params["data_mix_weights"] = [round(source.weight, 12) for source in sources]
    return params


def fingerprint_mismatch(saved: dict, current: dict) -> tuple[str | None, list[str]]:
    """``(what differs as one phrase or None, fields the checkpoint predates)`` of two fingerprints."""
    missing = [name for name in ADDED_LATER if name in current and name not in saved]
    # Both sides' fields: a method's field is absent where it is off (None), on either side.
    changes = {name: pair for name, pair in changed_fields(saved, {**dict.fromkeys(saved), **current}).items()
               if name not in missing and name not in NOT_COMPARED}
    if "model_weights_xxh3" in changes:  # the model first, by name: the weights digests alone mean nothing to a person
        old, new = changes.pop("model_weights_xxh3")
        changes = {"model": (f"{saved.get('model_source')} (weights {old})",
                             f"{current.get('model_source')} (weights {new})"), **changes}
    listed = ", ".join(f"{k}: checkpoint {old!r} vs now {new!r}" for k, (old, new) in changes.items())
    return listed or None, missing


PREDATES = {"data_content_xxh3": "the data's token ids and labels (only its sample count and lengths are compared)",
            "model_weights_xxh3": "the model's weights (only its shape is compared)"}


def predates_message(path: Path, missing: list[str]) -> str:
    return (f"{path} predates {', '.join(missing)}: resuming without comparing "
            f"{'; nor '.join(PREDATES[name] for name in missing)} with what it was trained on")


def changed_fields(saved: dict, current: dict) -> dict[str, tuple]:
    """``{field: (checkpoint value, this run's value)}`` for every field that differs; a field recorded only
    away from its default (``OMITTED_AT_DEFAULT``) differs when either side holds another value."""
    changes = {name: (saved.get(name), value) for name, value in current.items() if saved.get(name) != value}
    for name, default in OMITTED_AT_DEFAULT.items():
        old, new = saved.get(name, default), current.get(name, default)
        if old != new:
            changes[name] = (old, new)
    return changes


def refusal_message(checkpoint: Path, changes: dict[str, tuple]) -> str:
    listed = "; ".join(f"{name}: checkpoint {old!r}, now {new!r}" for name, (old, new) in sorted(changes.items()))
    return (f"cannot resume from {checkpoint}: the training parameters changed ({listed}). Either start a "
            "separate run with a new --output-dir, or pass --allow-config-change to continue this run's "
            "weights, optimizer and data position with the new values")


def newest_trainer_state(checkpoints: list[Path]) -> tuple[Path, dict] | None:
    """The newest checkpoint whose trainer_state.json reads (the one a resume would start from)."""
    for path in reversed(checkpoints):
        try:
            return path, json.loads((path / "trainer_state.json").read_text())
        except (OSError, json.JSONDecodeError):
            continue
    return None


def check_resume(checkpoints: list[Path], current: dict, *, allow_change: bool,
                 fingerprint: dict | None = None) -> tuple[str | None, str | None]:
    """Rank 0's verdict before the model loads.

    Args:
        checkpoints: the full-state folders a resume would consider, oldest first.
        current: ``run_params`` of this command.
        allow_change: ``--allow-config-change``.
        fingerprint: ``fingerprint`` of this model and data; a mismatch is never resumable.

    Returns:
        ``(error, notice)``: an error line that stops every rank, or a notice to log (either may be None).
    """
    found = newest_trainer_state(checkpoints)
    if found is None:
        return None, None
    path, state = found
    notices = []
    if fingerprint is not None:
        listed, missing = fingerprint_mismatch(state.get("fingerprint", {}), fingerprint)
        if listed:
            return (f"cannot resume: {path} was written for another model or dataset ({listed}); "
                    "to start fresh in this folder add --no-resume (the old run is moved aside), or use another "
                    "--output-dir"), None
        if missing:
            notices.append(predates_message(path, missing))
    error, notice = _compare_run_params(path, state, current, allow_change=allow_change)
    return error, "; ".join(notices + ([notice] if notice else [])) or None


def _compare_run_params(path: Path, state: dict, current: dict, *, allow_change: bool) -> tuple[str | None, str | None]:
    saved = state.get("run_params")
    if saved is None:
        return None, (f"{path} predates recorded run parameters: resuming without comparing learning rate, "
                      "schedule, batch size, seed or data")
    changes = changed_fields(saved, current)
    if not changes:
        return None, None
    old_decay, new_decay = changes.get("weight_decay", (0, 0))
    if bool(old_decay) != bool(new_decay):  # FineTuningMethod.param_groups: one group at 0, two (decayed, exempt) above
        return (f"cannot resume {path} with --weight-decay {new_decay}: it was written with {old_decay}, and "
                "turning decay on or off changes the optimizer's parameter groups (biases and norms are "
                "exempt); use --no-resume or another --output-dir"), None
    kept = sorted(name for name in ("optimizer", "optimizer_args") if name in changes)
    if kept:  # the restored states and groups are the old optimizer's: new ones would not fit, or not apply
        listed = ", ".join(f"--{name.replace('_', '-')} {old!r} -> {new!r}" for name, (old, new) in
                           ((name, changes[name]) for name in kept))
        return (f"cannot resume {path} with another optimizer or its settings ({listed}), not even with "
                "--allow-config-change: its states and settings come back with the full state; use the old "
                "ones, --no-resume or another --output-dir"), None
    if allow_change:
        listed = ", ".join(f"{name} {old!r} -> {new!r}" for name, (old, new) in sorted(changes.items()))
        return None, f"--allow-config-change: resuming {path} with new values: {listed}"
    return refusal_message(path, changes), None


def move_aside(output_dir: str | Path, *, now: float | None = None) -> Path | None:
    """``--no-resume``: move an earlier run's checkpoints and metrics into ``superseded_<UTC time>/``.

    Returns:
        The folder they were moved to, or None when there was nothing to move.
    """
    output_dir = Path(output_dir)
    found = [output_dir / name for name in MOVABLE if (output_dir / name).exists()]
    found += sorted(output_dir.glob("training_metrics_*.jsonl"))
    if not any((output_dir / name).exists() for name in ("full_state", "hf_format")):
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now if now is not None else time.time()))
    target = output_dir / f"superseded_{stamp}"
    suffix = 1
    while target.exists():
        target = output_dir / f"superseded_{stamp}_{suffix}"
        suffix += 1
    target.mkdir()
    for path in found:
        shutil.move(str(path), str(target / path.name))
    return target


def finished_message(reason: str, *, lr_scheduler_decays: bool) -> str:
    """What a rerun of a finished run prints instead of training."""
    how = ("raise the stop condition (e.g. a larger --max-steps, --max-samples or --num-epochs) and rerun the "
           "same command")
    if lr_scheduler_decays:
        how += (" with --allow-config-change (the decaying --lr-scheduler is rescheduled over the new total), "
                "or use a new --output-dir")
    return (f"this run is already finished ({reason}); nothing was trained. To train further, {how}; "
            "to start over in this folder, add --no-resume (the old checkpoints are moved aside)")


def apply_new_hyperparameters(optimizer, scheduler, config) -> None:
    """After an ``--allow-config-change`` resume: the restored optimizer and scheduler carry the
    checkpoint's learning rate, betas and weight decay; put this command's values in their place.

    The scheduler's lambdas were already built from this command's warmup and total steps;
    only its base learning rates come from the checkpoint.
    """
    scheduler.base_lrs = [config.learning_rate for _ in optimizer.param_groups]
    factors = [lr_lambda(scheduler.last_epoch) for lr_lambda in scheduler.lr_lambdas]
    for group, factor in zip(optimizer.param_groups, factors, strict=True):
        group.update(initial_lr=config.learning_rate, lr=config.learning_rate * factor,
                     weight_decay=config.weight_decay if group["weight_decay"] else 0.0)  # biases and norms keep 0
        if "betas" in group:  # the groups of optimizers that take the AdamW flags (not SGD's, Adafactor's)
            group.update(betas=tuple(config.adam_betas), eps=config.adam_eps)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
