"""What every dataset kind offers the sampler, the packer, the start-up checks and the objectives.

A dataset is a list of **units**, each the sampler's and the packer's indivisible item: a sample (one
sequence) or a preference pair (two sequences, chosen then rejected, packed next to each other on one rank).
The kinds: ``sampler.TokenizedDataset`` (a tokenized file), ``mix.MixedDataset`` (several, weighted),
``held_out.RowSubset`` (some rows of another), ``preference.PreferenceDataset`` (pairs) and
``preference.SideRows`` (a pair dataset's sides as samples), ``unpaired.UnpairedDataset`` (samples with a
desirable flag) and ``unpaired.KLUnits`` (KTO's units: a row's own sequence and its KL sequence, packed as a pair's
sides are). A new data kind declares what it is here and the rest of the run reads it through these names; an
objective turns the rows a file holds into the units it trains (``TrainingObjective.training_rows``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Rows(Protocol):
    """Units of ``sequences_per_unit`` sequences each, indexed ``0 .. len - 1``."""

    path: str
    """Where the rows came from, as the user named it: what a refusal names."""
    lengths: np.ndarray
    """int64 ``[N]``: each unit's tokens, all its sequences together (the packer's size)."""
    num_loss_counted_tokens: np.ndarray
    """int64 ``[N]``: each unit's learned (shifted) targets, all its sequences together."""
    sequences_per_unit: int
    """1: a unit is a sample (``SampleRows``); 2: two sequences packed side by side (``PairRows``): a preference
    pair, or a KTO row and its KL sequence."""

    def __len__(self) -> int: ...

    def content_digest(self) -> str:
        """A hash of the rows' content: what a resume and a stored reference are keyed by."""
        ...


@runtime_checkable
class SampleRows(Rows, Protocol):
    """Units of one sequence: samples."""

    def sample_arrays(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids, labels)`` of sample ``index``, labels unshifted."""
        ...


@runtime_checkable
class PairRows(Rows, Protocol):
    """Units of two sequences: a preference pair's chosen and rejected sides."""

    side_lengths: np.ndarray
    """int64 ``[N, 2]``: the chosen and the rejected side's tokens."""
    side_loss_tokens: np.ndarray
    """int64 ``[N, 2]``: the chosen and the rejected side's learned targets (a side's log-probability sums
    over these; the chosen count is an SFT term's denominator)."""

    def sequences(self, index: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """``[(chosen input_ids, labels), (rejected input_ids, labels)]`` of unit ``index``, labels unshifted."""
        ...

    def sides(self) -> SampleRows:
        """Every side as a one-sequence unit of its own (row ``2i``: pair ``i``'s chosen side, ``2i + 1``: its
        rejected side): what the checks made for samples read."""
        ...


def is_pairs(rows: Rows) -> bool:
    return rows.sequences_per_unit == 2
