"""Divergence: a finite step whose loss or gradient says the model is broken, and what the run does then.

A learning rate that blows up, or a poisoned batch, rarely gives a NaN (that is the
non-finite skip, ``--max-bad-steps``): the loss jumps by orders of magnitude, and the
model then often collapses to a constant prediction, whose loss sits at ln(vocabulary
size) with a gradient norm of exactly 0. Two rules catch both (``detect``):

* the step's per-token loss is above ``--divergence-loss-factor`` times the median of
  the last ``HISTORY`` finite steps' losses (a median below 1 counts as 1, so a run
  that has learnt its data well is not stopped by one harder batch);
* the gradient norm is exactly 0 while the batch has loss tokens to learn from.

``--on-divergence`` says what follows: ``warn`` (one warning line; the run goes on,
and no later validation is taken as the best export), ``stop`` (the default: one
line naming the step and its samples, exit status 1, no export of the diverged
model), or ``rewind`` (as large pretraining runs do: load the newest full state
from before the diverged batch, in the same process, and go on from there with that
batch skipped; ``TrainState.skipped_batches`` holds the skipped ranges, so a resume
skips them too). Pure functions; the loop's side is ``loop.step.report_divergence``
and ``loop.actions.rewind``.
"""

from __future__ import annotations

import math
import statistics

from pathlib import Path

POLICIES = ("warn", "stop", "rewind")
MAX_SKIPPED_BATCHES = 5
"""``rewind`` stops instead once this many batches were skipped: a divergence that follows every
rewind is the learning rate's, not one batch's."""
HISTORY = 20
"""Steps of loss history the loss rule compares with (kept in ``TrainState.recent_losses``, so a resume keeps it)."""
LOSS_FLOOR = 1.0
"""The median a loss is compared with never counts below this (nats per token)."""


def detect(*, loss: float, grad_norm: float, num_loss_tokens: int, recent_losses: list[float],
           loss_factor: float) -> str | None:
    """Why this finite step is a divergence, or None.

    Args:
        loss: the step's per-token mean loss over the whole batch.
        grad_norm: the step's total gradient norm (before clipping).
        num_loss_tokens: loss-counted tokens in the whole batch.
        recent_losses: the losses of the previous finite steps, oldest first (at most ``HISTORY``).
        loss_factor: ``--divergence-loss-factor``; 0 turns the loss rule off.
    """
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        return None  # the non-finite skip handles these
    # A loss of exactly 0 has a zero gradient by right (DPO's hinge once every pair is past its margin).
    if grad_norm == 0.0 and num_loss_tokens > 0 and loss != 0.0:
        return f"gradient norm 0 with {num_loss_tokens} loss tokens to learn from (loss {loss:.4g})"
    if loss_factor and recent_losses:
        median = statistics.median(recent_losses)
        if loss > loss_factor * max(median, LOSS_FLOOR):
            return (f"loss {loss:.4g} is over {loss_factor:g}x the median {median:.4g} of the previous "
                    f"{len(recent_losses)} steps (grad norm {grad_norm:.4g})")
    return None


def remember(recent_losses: list[float], loss: float) -> list[float]:
    """The history after a step that did not diverge: its loss appended, the oldest dropped past ``HISTORY``."""
    return [*recent_losses, loss][-HISTORY:]


def rewind_target(full_states: list[Path], diverged_start: int) -> Path | None:
    """The newest full state (``samples_N`` folders, oldest first) written at or before the diverged batch's start.

    Its weights gave the losses of the steps up to that batch, none of which diverged.
    """
    before = [path for path in full_states if int(path.name.removeprefix("samples_")) <= diverged_start]
    return before[-1] if before else None


def is_skipped(skipped_batches: list, start: int, end: int) -> bool:
    return [start, end] in [list(pair) for pair in skipped_batches]
