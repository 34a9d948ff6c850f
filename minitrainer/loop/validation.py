"""Validation loss: the exact per-token mean over a held-out set, across ranks.

    torchrun --nproc-per-node=2 train.py ... --validation-split 0.05 --validation-every-n-steps 50
    torchrun --nproc-per-node=2 train.py ... --validation-data-path ./data/val_tkns

The held-out rows and their packing: ``minitrainer/data/held_out.py``.

A pass packs the held-out samples exactly as training packs a batch
(``packing.plan_minibatches``, the sampler's collation, the same attention
inputs and summed loss), in groups of ``group_size`` samples, forward only
under ``torch.no_grad()``. Memory is bounded by the token budget of one
minibatch. Every rank makes the same number of forward calls (a rank with no
work in a minibatch gets the 1-token dummy), because FSDP all-gathers in each.
One all-reduce of (loss sum, token count) at the end (the pass is the objective's,
``objectives/base.py``; DPO's reports the pairs' loss and reward accuracy) gives

    val_loss = sum of token cross-entropies / number of loss-counted tokens

over the whole set, written as its own metrics line::

    {"step": 120, "val_loss": 1.93, "val_num_loss_counted_tokens": 48211, "val_time_s": 3.2, ...}

and said on the console in the objective's terms (``validation_line``): over tokens for SFT's per-token mean,
over pairs with the objective's ``console_metrics`` for a preference objective's mean over pairs.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from minitrainer.common.log import log_rank_0
from minitrainer.report.progress import console_fields


def validation_record(*, step: int, samples_seen: int, val_loss: float, num_loss_counted_tokens: int,
                      num_samples: int, elapsed: float, extra: dict | None = None) -> dict:
    """The metrics line of one validation pass (told apart from step lines by ``val_loss``); ``extra``: the
    objective's own fields (DPO's reward accuracy)."""
    return {"step": step, "val_loss": val_loss, "val_num_loss_counted_tokens": num_loss_counted_tokens,
            "val_num_samples": num_samples, "val_time_s": elapsed, "samples_seen": samples_seen,
            **(extra or {}), "timestamp": time.time()}


def validation_line(*, step: int, val_loss: float, unit: str, num_units: int, num_loss_counted_tokens: int,
                    metrics: dict[str, float | None], seconds: float) -> str:
    """The console's line of one validation pass.

    SFT's loss (``unit`` ``samples``) is the per-token mean, so the line counts tokens:
    ``step 50: validation loss 1.9300 over 48211 tokens (3.20s)``. Any other objective's loss is the mean over
    its units, so the line counts those and adds ``metrics`` (the objective's ``console_metrics``, read from
    the pass's ``val_`` fields): ``step 5: validation loss 0.5334 over 35 pairs, acc 0.83, margin 1.234 (1.52s)``.
    """
    if unit == "samples":
        over = f"{num_loss_counted_tokens} tokens"
    else:
        over = f"{num_units} {unit}" + "".join(f", {name} {value}" for name, value in console_fields(metrics))
    return f"step {step}: validation loss {val_loss:.4f} over {over} ({seconds:.2f}s)"


def should_validate(*, step: int, every_n_steps: int | None, samples_seen: int, previous_samples: int,
                    every_n_samples: int | None) -> bool:
    """The cadence: every N steps, and/or when this step's samples crossed a multiple of N.

    ``previous_samples`` is the stream position before this step, so the cadence depends
    only on positions and is the same whether or not the run was resumed in between.
    """
    if every_n_steps and step % every_n_steps == 0:
        return True
    return bool(every_n_samples) and samples_seen // every_n_samples > previous_samples // every_n_samples


def is_improvement(val_loss: float, best: float | None, threshold: float) -> bool:
    """Better than the best so far by more than ``threshold`` (a non-finite loss never is)."""
    return math.isfinite(val_loss) and (best is None or val_loss < best - threshold)


def update_best(state, val_loss: float, *, config, save_best: Callable[[], None]) -> str | None:
    """Track the best loss in ``state`` (saved with the full state), export it, and decide early stopping.

    Returns:
        A stop reason when ``--early-stopping-patience`` validations in a row did not improve, else None.
    """
    if state.diverged_at_step is not None and is_improvement(val_loss, state.best_val_loss,
                                                             config.val_loss_improvement_threshold):
        log_rank_0("validation loss %.6g is not taken as the best: the run diverged at step %d", val_loss,
                   state.diverged_at_step, level=logging.WARNING)
    elif is_improvement(val_loss, state.best_val_loss, config.val_loss_improvement_threshold):
        state.best_val_loss = val_loss
        state.num_validations_without_improvement = 0
        if config.save_best_val_loss:
            save_best()
        return None
    state.num_validations_without_improvement += 1
    patience = config.early_stopping_patience
    if patience and state.num_validations_without_improvement >= patience:
        return (f"early stopping: {patience} validations in a row without improving on {state.best_val_loss:.6g} "
                f"by more than {config.val_loss_improvement_threshold:g}")
    return None


BEST_DIR = "best"
BEST_RECORD = "best_val_loss.json"


def save_best_export(model, *, output_dir: str | Path, step: int, samples_seen: int, val_loss: float, tokenizer,
                     generation_config, rank: int, dtype: torch.dtype) -> Path:
    """Export the model to ``hf_format/best/`` (collective), in ``dtype`` (``--save-dtype``, resolved), replacing
    the previous best only once complete.

    The export is written to a staging folder first; rank 0 then swaps it in with two
    renames (the old one goes to ``best.old`` and is deleted), so ``best/`` is never half written.
    """
    from minitrainer.checkpoint.hf_export import save_hf_checkpoint

    root = Path(output_dir) / "hf_format"
    staging_root = root / ".best_staging"
    staged = save_hf_checkpoint(model, output_dir=staging_root, num_samples=samples_seen, tokenizer=tokenizer,
                                generation_config=generation_config, rank=rank, dtype=dtype)
    final = root / BEST_DIR
    if rank == 0:
        (staged / BEST_RECORD).write_text(json.dumps({"step": step, "samples_seen": samples_seen,
                                                      "val_loss": val_loss}, indent=2))
        old = root / (BEST_DIR + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(staged, final)
        shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(staging_root, ignore_errors=True)
        log_rank_0("new best validation loss %.6g at step %d: exported to %s", val_loss, step, final)
    dist.barrier()
    return final
