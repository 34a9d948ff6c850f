"""What the loop does between steps: validate, save on the checkpoint cadences, and decide when; rewind
after a divergence (``--on-divergence rewind``) and the batch stream that restarts after it."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

from minitrainer.loop import divergence, validation
from minitrainer.report.metrics import MetricsWriter, truncate_metrics
from minitrainer.checkpoint import policy as checkpoint_policy
from minitrainer.checkpoint.full_state import complete_checkpoints, full_state_root, load_full_state, save_full_state
from minitrainer.checkpoint.hf_export import save_hf_checkpoint
from minitrainer.checkpoint.train_state import TrainState
from minitrainer.common.exits import EXIT_PREEMPTED
from minitrainer.common.log import log_rank_0, logger, note_exit_line
from minitrainer.data.sampler import StepBatch
from minitrainer.model.context_parallel import shard_minibatch
from minitrainer.setup.run import Run, batch_loader


def validation_due(run: Run, batch: StepBatch, *, done: str | None, preempted: bool) -> bool:
    """On its step or sample cadence, and always at the end (a preempted step leaves it to the rerun)."""
    config = run.config
    return run.val_plan is not None and not preempted and bool(done or validation.should_validate(
        step=run.state.step, every_n_steps=config.validation_every_n_steps, samples_seen=run.state.samples_seen,
        previous_samples=batch.start_position, every_n_samples=config.validation_every_n_samples))


def validate(run: Run) -> str | None:
    """One validation pass, its metrics line, the best export; returns an early-stopping reason."""
    state, dist_info = run.state, run.dist_info
    began = time.perf_counter()
    val_loss, val_tokens, extra = run.objective.validation_loss(
        run.model, run.val_dataset, run.val_plan, rank=run.context.data_rank, device=dist_info.device,
        attn=run.resolved.attn_implementation,
        shard=(functools.partial(shard_minibatch, context=run.context, device=dist_info.device)
               if run.context.size > 1 else None))
    record = validation.validation_record(step=state.step, samples_seen=state.samples_seen, val_loss=val_loss,
                                          num_loss_counted_tokens=val_tokens, num_samples=run.val_plan.num_samples,
                                          elapsed=time.perf_counter() - began, extra=extra)
    if run.metrics is not None:
        run.metrics.write(record)
    run.tracker.log(record)
    log_rank_0("%s", validation.validation_line(
        step=state.step, val_loss=val_loss, unit=run.objective.unit, num_units=run.val_plan.num_samples,
        num_loss_counted_tokens=val_tokens, seconds=record["val_time_s"],
        metrics={name: extra.get(f"val_{name}") for name in run.objective.console_metrics}))
    return validation.update_best(state, val_loss, config=run.config, save_best=lambda: validation.save_best_export(
        run.model, output_dir=run.config.output_dir, step=state.step, samples_seen=state.samples_seen,
        val_loss=val_loss, tokenizer=run.tokenizer, generation_config=run.generation_config, rank=dist_info.rank,
        dtype=run.resolved.export_dtype))


def checkpoints_due(run: Run, batch: StepBatch, *, done: str | None, preempted: bool) -> tuple[bool, bool]:
    """``(Hugging Face export due, full state due)`` after this step."""
    config, state = run.config, run.state
    # A preemption on the last step (or on a cadence step) still writes the export that step owes:
    # the rerun finds nothing left to train and would never write it.
    export_due = (bool(done) or state.samples_seen - state.last_checkpoint_samples >= config.export_every
                  or config.checkpoint_at_epoch and checkpoint_policy.crossed(batch.start_position, state.samples_seen,
                                                                              len(run.dataset)))
    full_due = bool(done) or (checkpoint_policy.crossed(batch.start_position, state.samples_seen,
                                                        config.min_samples_per_full_state)
                              if config.min_samples_per_full_state else export_due)
    if preempted:
        log_rank_0("preemption signal received: saving full state at step %d and exiting", state.step)
        full_due = True
        export_due = export_due or not config.full_state  # with --no-full-state an export is all there is
    return export_due, full_due


def save(run: Run, *, hf_export: bool, full_state: bool = True) -> Path | None:
    """The Hugging Face export and/or the full state (resume needs it), each on its own cadence."""
    config, state = run.config, run.state
    exported = None
    if hf_export:
        # Recorded before the full state is written, so a resume keeps the same cadence.
        state.last_checkpoint_samples = state.samples_seen
        began = time.perf_counter()
        exported = save_hf_checkpoint(
            run.model, output_dir=config.output_dir, num_samples=state.samples_seen, tokenizer=run.tokenizer,
            generation_config=run.generation_config, rank=run.dist_info.rank,
            keep_last_n=config.keep_last_n_checkpoints, dtype=run.resolved.export_dtype)
        log_rank_0("saved Hugging Face checkpoint %s in %.2fs (%.1f MB)", exported,
                   time.perf_counter() - began, _folder_mb(exported))
    if full_state and config.full_state:
        began = time.perf_counter()
        saved = save_full_state(
            run.model, run.optimizer, run.scheduler, output_dir=config.output_dir, num_samples=state.samples_seen,
            trainer_state={**dataclasses.asdict(state), "run_params": run.run_params},
            model_fingerprint=run.model_fingerprint, dist_info=run.dist_info,
            keep_last_n=checkpoint_policy.full_states_kept(config.keep_last_n_full_states,
                                                           config.keep_last_n_checkpoints))
        log_rank_0("saved full training state %s in %.2fs (%.1f MB)", saved, time.perf_counter() - began,
                   _folder_mb(saved))
    return exported


def stop_preempted(run: Run) -> NoReturn:
    """End a run whose preemption save is done: one line telling what to do, and the preempted status."""
    config, state = run.config, run.state
    kind = "full_state" if config.full_state else "hf_format"  # with --no-full-state an export is all there is
    folder = Path(config.output_dir) / kind / f"samples_{state.samples_seen}"
    line = f"preempted at step {state.step}, state saved in {folder}; run the same command to resume"
    log_rank_0(line, level=logging.WARNING)
    note_exit_line(line, override=True)
    raise SystemExit(EXIT_PREEMPTED)


def _folder_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / 2**20


@contextlib.contextmanager
def batches(run: Run) -> Iterator[Iterator[StepBatch]]:
    """The run's batch stream (``setup.run.batch_loader``) without the batches a rewind skips; after a
    rewind (the run's position moved back) it restarts from the restored position."""
    def stream() -> Iterator[StepBatch]:
        while True:
            with batch_loader(run) as loader:
                for batch in loader:
                    if divergence.is_skipped(run.state.skipped_batches, batch.start_position, batch.end_position):
                        continue
                    yield batch
                    if run.state.samples_seen < batch.end_position:
                        break  # rewound: the loader's workers are shut down and a new one starts there
                else:
                    return

    generator = stream()
    try:
        yield generator
    finally:
        generator.close()  # leaves the loader's ``with``: its workers go however the loop ended


def rewind(run: Run, batch: StepBatch) -> None:
    """``--on-divergence rewind``: load the newest full state from before ``batch`` into the model, optimizer,
    scheduler and counters, in place; the skipped batches are kept (``batches`` skips them)."""
    state, config = run.state, run.config
    target = divergence.rewind_target(complete_checkpoints(full_state_root(config.output_dir)), batch.start_position)
    if target is None:
        logger.error("stopping: no full state was saved before samples %d..%d, so there is nothing to rewind to; "
                     "save full states more often (--min-samples-per-full-state) or lower --learning-rate",
                     batch.start_position, batch.end_position)
        raise SystemExit(1)
    skipped = state.skipped_batches
    restored = load_full_state([target], run.model, run.optimizer, run.scheduler,
                               model_fingerprint=run.model_fingerprint, dist_info=run.dist_info)
    for field in dataclasses.fields(TrainState):  # in place: fault_injection's hooks hold this object
        setattr(state, field.name, restored.get(field.name, getattr(TrainState(), field.name)))
    state.skipped_batches = skipped
    if run.metrics is not None:  # the steps after the full state are trained again: their lines go
        run.metrics.close()
        truncate_metrics(run.metrics.path, state.step)
        run.metrics = MetricsWriter(run.metrics.path)
    log_rank_0("rewound to %s (step %d); samples %s are skipped", target, state.step,
               ", ".join(f"{start}..{end}" for start, end in skipped))
