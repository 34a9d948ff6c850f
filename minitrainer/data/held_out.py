"""Held-out rows: the validation set's rows and how a pass packs them.

The held-out samples come from ``--validation-data-path`` (a tokenized file or
folder, as ``--data-path``) or from ``--validation-split FRACTION`` of
``--data-path``: ``split_rows`` draws the held-out rows from the seed alone, so
every rank and every resume gets the same split, and training then samples
only from the remaining rows (``RowSubset``). ``plan_validation`` packs the
held-out samples once, as training packs a batch (``packing.plan_minibatches``);
the pass itself and what a run does with its loss: ``minitrainer/loop/validation.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minitrainer.common.log import log_rank_0
from minitrainer.data.packing import plan_minibatches
from minitrainer.data.rows import Rows, is_pairs

SPLIT_SEED_SALT = 0x5E11
"""Mixed into the seed so the split does not correlate with epoch 0's shuffle (seed + 0)."""


class RowSubset:
    """A view of some rows of another dataset (``data/rows.py``: of the same kind as ``base``).

    Row ``i`` of the view is row ``rows[i]`` of ``base``.
    """

    def __init__(self, base: Rows, rows: np.ndarray) -> None:
        self.base = base
        self.rows = np.asarray(rows, dtype=np.int64)
        self.path = base.path
        self.lengths = base.lengths[self.rows]
        self.num_loss_counted_tokens = base.num_loss_counted_tokens[self.rows]
        self.sequences_per_unit = base.sequences_per_unit
        if is_pairs(base):  # preference pairs: the per-side columns the sampler and objective read
            self.side_lengths = base.side_lengths[self.rows]
            self.side_loss_tokens = base.side_loss_tokens[self.rows]
            margins = getattr(base, "margins", None)  # a reward model's pairs: each pair's margin
            self.margins = None if margins is None else margins[self.rows]
        if getattr(base, "desirable", None) is not None:  # unpaired feedback: each unit's label
            self.desirable = base.desirable[self.rows]

    def __len__(self) -> int:
        return int(self.rows.size)

    def sample(self, index: int) -> tuple[list[int], list[int]]:
        return self.base.sample(int(self.rows[index]))

    def content_digest(self) -> str:
        """The base file's content hash, and which of its rows this view holds."""
        import xxhash

        return xxhash.xxh3_128(self.base.content_digest().encode() + self.rows.tobytes()).hexdigest()

    def sample_arrays(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self.base.sample_arrays(int(self.rows[index]))

    def sequences(self, index: int) -> list[tuple[np.ndarray, np.ndarray]]:
        return self.base.sequences(int(self.rows[index]))

    def sides(self):
        return self.base.sides()


def split_rows(num_samples: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic train/validation split of ``range(num_samples)``.

    Args:
        num_samples: rows of the dataset.
        fraction: share held out, in (0, 1); at least one row each side.
        seed: the run's seed.

    Returns:
        ``(train_rows, validation_rows)``, each sorted ascending, disjoint, covering every row.
    """
    if not 0 < fraction < 1:
        raise ValueError(f"validation fraction must be in (0, 1), got {fraction}")
    if num_samples < 2:
        raise ValueError(f"cannot split {num_samples} sample(s) into training and validation")
    num_val = min(max(1, round(fraction * num_samples)), num_samples - 1)
    order = np.random.default_rng((seed, SPLIT_SEED_SALT)).permutation(num_samples)
    return np.sort(order[num_val:]), np.sort(order[:num_val])


@dataclass(frozen=True)
class ValidationPlan:
    """Which rows each rank packs into each validation minibatch (same on every rank).

    ``minibatches[m][rank]`` lists dataset rows; ``[]`` means the dummy.
    """

    minibatches: list[list[list[int]]]
    num_samples: int  # samples evaluated
    num_dropped_samples: int  # longer than the token budget: not evaluated
    num_loss_counted_tokens: int  # the denominator, known before any forward


def plan_validation(lengths: np.ndarray, loss_counts: np.ndarray, *, max_tokens_per_rank: int, num_ranks: int,
                    group_size: int, balance: str = "tokens") -> ValidationPlan:
    """Pack every row (in order, ``group_size`` at a time) into per-rank minibatches. Pure.

    Args:
        lengths: tokens per validation sample.
        loss_counts: loss-counted (shifted) targets per sample.
        max_tokens_per_rank: training's token budget; longer samples are dropped and counted.
        num_ranks: world size.
        group_size: samples planned together (training's batch size): larger groups pack tighter.
        balance: packing cost, as in training.
    """
    keep = np.flatnonzero(lengths <= max_tokens_per_rank)
    minibatches: list[list[list[int]]] = []
    for start in range(0, keep.size, group_size):
        rows = keep[start:start + group_size]
        plan = plan_minibatches(lengths[rows], max_tokens_per_rank=max_tokens_per_rank, num_ranks=num_ranks,
                                cost=balance)
        for minibatch in plan:
            minibatches.append([[int(rows[i]) for i in slot if i != -1] for slot in minibatch])
    return ValidationPlan(minibatches=minibatches, num_samples=int(keep.size),
                          num_dropped_samples=int(lengths.size - keep.size),
                          num_loss_counted_tokens=int(loss_counts[keep].sum()))


def announce(plan: ValidationPlan, source: str, unit: str = "samples") -> None:
    log_rank_0("validation %s: %d %s, %d loss tokens, %d minibatches per pass%s", source, plan.num_samples, unit,
               plan.num_loss_counted_tokens, len(plan.minibatches),
               f"; {plan.num_dropped_samples} longer than --max-tokens-per-gpu are not evaluated"
               if plan.num_dropped_samples else "")
