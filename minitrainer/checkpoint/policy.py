"""What to save when, how many to keep, and whether it fits on the disk.

Two kinds of checkpoint, with separate knobs:

* Hugging Face exports (``hf_format/samples_N``, in ``--save-dtype``: ~2 bytes per parameter in
  bf16, the default, or fp16, 4 in fp32): every ``--min-samples-per-checkpoint`` samples and at
  the end, the newest ``--keep-last-n-checkpoints`` kept (all by default).
* Full training states (``full_state/samples_N``, parameters plus two fp32 AdamW
  moments, 12 bytes per parameter with fp32 master weights): every
  ``--min-samples-per-full-state`` samples (default: with each export), at the end
  and on preemption; the newest ``--keep-last-n-full-states`` kept (default 2, or
  ``--keep-last-n-checkpoints`` when that is smaller); ``--no-full-state`` writes none
  (the run can then not resume).

``plan_disk`` estimates the peak bytes of the planned checkpoints so rank 0 can
print it beside the free space and warn before training starts. Pure functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_FULL_STATES_KEPT = 2
FINAL_EXPORT_ONLY = 2**63 - 1
"""The export cadence of ``--min-samples-per-checkpoint 0``, no export on the way: a count of samples never
reached, so the final export, always written, is the only one."""
EXPORT_BYTES_PER_PARAM = 2  # bf16 safetensors, --save-dtype's default
ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, fp32


def full_states_kept(keep_last_n_full_states: int | None, keep_last_n_checkpoints: int | None) -> int:
    """Retention of full states: the explicit flag, else 2 (or fewer when --keep-last-n-checkpoints says so)."""
    if keep_last_n_full_states is not None:
        return keep_last_n_full_states
    if keep_last_n_checkpoints is not None:
        return min(DEFAULT_FULL_STATES_KEPT, keep_last_n_checkpoints)
    return DEFAULT_FULL_STATES_KEPT


def export_bytes(num_params: int, bytes_per_param: int = EXPORT_BYTES_PER_PARAM) -> int:
    return num_params * bytes_per_param


def full_state_bytes(num_params: int, param_bytes: int) -> int:
    """Sharded parameters in their training dtype plus AdamW's two fp32 moments."""
    return num_params * (param_bytes + ADAM_MOMENTS * 4)


def crossed(previous_samples: int, samples_seen: int, every: int) -> bool:
    """True when the stream crossed a multiple of ``every`` this step (resume-stable cadence)."""
    return samples_seen // every > previous_samples // every


@dataclass(frozen=True)
class DiskPlan:
    num_exports: int | None  # exports on disk at the end (None: unbounded)
    num_full_states: int | None
    export_bytes: int
    full_state_bytes: int

    @property
    def total_bytes(self) -> int | None:
        if self.num_exports is None or self.num_full_states is None:
            return None
        # One more of each exists briefly while a new one is written, before retention prunes.
        return ((self.num_exports + (self.num_exports > 0)) * self.export_bytes
                + (self.num_full_states + (self.num_full_states > 0)) * self.full_state_bytes)


def _count(total_samples: int | None, every: int, kept: int | None) -> int | None:
    written = None if total_samples is None else math.ceil(total_samples / every)
    if kept is None:
        return written
    return kept if written is None else min(kept, written)


def plan_disk(*, num_params: int, param_bytes: int, total_samples: int | None, export_every: int,
              keep_exports: int | None, full_state_every: int, keep_full_states: int,
              full_state: bool, export_bytes_per_param: int = EXPORT_BYTES_PER_PARAM) -> DiskPlan:
    """How many checkpoints of each kind the run leaves, and their sizes.

    Args:
        num_params: model parameters.
        param_bytes: bytes per parameter in training (4 for fp32 master weights).
        total_samples: samples the run will consume (None: no stop condition).
        export_every: --min-samples-per-checkpoint.
        keep_exports: --keep-last-n-checkpoints (None: all).
        full_state_every: the full-state cadence in samples.
        keep_full_states: full states kept.
        full_state: False with --no-full-state.
        export_bytes_per_param: bytes per parameter of ``--save-dtype`` (2 for bf16, 4 for fp32).
    """
    return DiskPlan(num_exports=_count(total_samples, export_every, keep_exports),
                    num_full_states=_count(total_samples, full_state_every, keep_full_states) if full_state else 0,
                    export_bytes=export_bytes(num_params, export_bytes_per_param),
                    full_state_bytes=full_state_bytes(num_params, param_bytes))


def disk_report(plan: DiskPlan, free_bytes: int, output_dir: str) -> tuple[str, str | None]:
    """``(info line, warning or None)`` for rank 0 to log before training."""
    gb = 1e9
    info = (f"checkpoint sizes: one Hugging Face export {plan.export_bytes / gb:.2f} GB, one full state "
            f"{plan.full_state_bytes / gb:.2f} GB; {output_dir} has {free_bytes / gb:.1f} GB free")
    total = plan.total_bytes
    if total is None:
        return info + "; planned: unbounded", (
            "no stop condition and unlimited retention: checkpoints accumulate until the disk is full; add "
            "--max-steps/--max-samples/--num-epochs or --keep-last-n-checkpoints")
    info += (f"; planned: {plan.num_exports} export(s) + {plan.num_full_states} full state(s), "
             f"peak {total / gb:.2f} GB")
    if total > free_bytes:
        return info, (f"the planned checkpoints need about {total / gb:.2f} GB but {output_dir} has "
                      f"{free_bytes / gb:.1f} GB free: lower the retention (--keep-last-n-checkpoints, "
                      "--keep-last-n-full-states), raise --min-samples-per-checkpoint, or free space")
    return info, None
