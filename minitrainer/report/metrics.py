"""Per-step metrics: one JSON object per optimizer step, appended to a JSONL file.

``step_record`` is pure (numbers in, dict out) so its arithmetic is tested
without a model; ``MetricsWriter`` only appends and flushes.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from minitrainer.common.log import logger


@dataclass(frozen=True)
class StepCounts:
    """Whole-job counts for one optimizer step (already summed over ranks)."""

    loss_sum: float                      # summed token cross-entropy over the optimizer batch
    backward_loss_sum: float             # what backward() saw, summed over minibatches and ranks
    batch_num_loss_counted_tokens: int   # the loss denominator
    num_loss_counted_tokens: int         # loss tokens actually processed (equals the denominator)
    num_samples: int
    num_total_tokens: int
    num_dropped_samples: int
    num_minibatches: int                 # gradient-accumulation steps per rank
    forward_backward_time: float = 0.0   # seconds in forward+backward on the rank writing the line (device time)
    router_aux_loss_sum: float | None = None  # MoE: summed per-sample router loss (objective.py), else None
    grad_norm: float = 0.0               # the clipped gradients' total norm before clipping (the same on every rank)
    objective_sums: tuple[float, ...] = ()  # the objective's own sums, all ranks (TrainingObjective.sum_names)


def step_record(*, step: int, lr: float, grad_norm: float, counts: StepCounts, world_size: int,
                time_per_batch: float, total_samples_accumulated: int, samples_seen: int, epoch: int,
                peak_memory_usage_gb: float, skipped: bool = False) -> dict:
    """The metrics line of one optimizer step (the original mini_trainer's keys, plus a few).

    ``loss`` is the exact per-token mean over the whole optimizer batch (a preference objective's ``record``
    replaces it with the mean over the batch's pairs, ``objectives/pairs.py``). The
    original's keys keep the original's meaning: ``avg_loss_backward`` is the
    loss backward saw per minibatch (``loss`` / ``grad_accum`` when the scaling is
    right), ``avg_time_per_minibatch`` times forward plus backward only (rank 0's
    device time, read after the step's one synchronisation; FSDP's collectives keep the ranks in
    step), ``peak_memory_usage_GB`` is in GB (10**9 bytes).
    ``loss_backward`` (new) undoes the world-size factor over the whole step and
    equals ``loss``: a cheap end-to-end check of the scaling.
    """
    denominator = max(counts.batch_num_loss_counted_tokens, 1)
    loss = counts.loss_sum / denominator
    return {
        "step": step,
        "lr": lr,
        "grad_norm": grad_norm,
        "loss": loss,
        "avg_loss_backward": counts.backward_loss_sum / world_size / max(counts.num_minibatches, 1),
        "loss_backward": counts.backward_loss_sum / world_size,
        "num_samples": counts.num_samples,
        "num_loss_counted_tokens": counts.num_loss_counted_tokens,
        "batch_num_loss_counted_tokens": counts.batch_num_loss_counted_tokens,
        "num_total_tokens": counts.num_total_tokens,
        "num_dropped_samples": counts.num_dropped_samples,
        "grad_accum": counts.num_minibatches,
        "avg_time_per_minibatch": counts.forward_backward_time / max(counts.num_minibatches, 1),
        "time_per_batch": time_per_batch,
        "tokens_per_second": counts.num_total_tokens / time_per_batch,
        "tokens_per_second_per_gpu": counts.num_total_tokens / time_per_batch / world_size,
        "samples_per_second": counts.num_samples / time_per_batch,
        "total_samples_accumulated": total_samples_accumulated,
        "samples_seen": samples_seen,
        "epoch": epoch,
        "skipped": skipped,
        "peak_memory_usage_GB": peak_memory_usage_gb,
        # MoE models whose config sets output_router_logits: the mean per-sample load-balancing loss
        # (before router_aux_loss_coef); loss_backward includes coef times it.
        **({} if counts.router_aux_loss_sum is None
           else {"router_aux_loss": counts.router_aux_loss_sum / max(counts.num_samples, 1)}),
        "timestamp": time.time(),
    }


def json_safe(record: dict) -> dict:
    """The record with every non-finite float replaced by None."""
    return {key: None if isinstance(value, float) and not math.isfinite(value) else value
            for key, value in record.items()}


class MetricsWriter:
    """Append-and-flush JSONL writer (rank 0 only)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, record: dict) -> None:
        # Strict JSON: NaN/Infinity are not JSON, so a non-finite value becomes null (its step says skipped).
        try:
            self._file.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
            self._file.flush()
        except OSError as err:  # the flush's own error does not say which file (a full disk)
            raise OSError(err.errno, err.strerror, str(self.path)) from err

    def close(self) -> None:
        self._file.close()


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
