"""Tokenized preference pairs (``process_data.py`` rows with ``chosen_*`` and ``rejected_*`` columns).

A pair is one unit of the sampler and the packer: its length is both sides' tokens, and both sides go into
the same packed minibatch on the same rank, chosen first (``sequences``). Each side is read as a
``sampler.TokenizedDataset`` of its own over the same memory-mapped table (the sampler opens the file and
hands the sides' reader in), so a side is validated and counted exactly as an SFT row is. A pair's
``margin`` (TRL's RewardTrainer's, in ``-logsigmoid(r_chosen - r_rejected - margin)``), when the file has
the column, is read as float64, one per pair.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa

SIDES = ("chosen", "rejected")
MARGIN_COLUMN = "margin"  # as process_data.py writes it (formats.MARGIN_COLUMN)


def is_preference_table(table: pa.Table) -> bool:
    return "chosen_input_ids" in table.column_names or "rejected_input_ids" in table.column_names


class PreferenceDataset:
    """Pairs, memory-mapped.

    Attributes:
        lengths: int64 ``[N]``, tokens of both sides (the packer's unit size).
        num_loss_counted_tokens: int64 ``[N]``, shifted targets of both sides.
        side_loss_tokens: int64 ``[N, 2]``, shifted targets of the chosen and the rejected side: a side's
            log-probability is a sum over these, and the chosen count is the SFT term's denominator.
        margins: float64 ``[N]``, each pair's ``margin``; None when the file has no such column.
    """

    sequences_per_unit = 2  # data/rows.py: PairRows

    def __init__(self, path: str, table: pa.Table, read_side: Callable[[pa.Table], object]) -> None:
        """``read_side``: a table with ``input_ids`` and ``labels`` -> a dataset of single sequences."""
        self.path = path
        self._sides = [_side_dataset(path, table, read_side, side) for side in SIDES]
        self.side_lengths = np.stack([side.lengths for side in self._sides], axis=1)
        self.side_loss_tokens = np.stack([side.num_loss_counted_tokens for side in self._sides], axis=1)
        self.lengths = self.side_lengths.sum(axis=1)
        self.num_loss_counted_tokens = self.side_loss_tokens.sum(axis=1)
        self.margins = _margins(path, table) if MARGIN_COLUMN in table.column_names else None
        self._digest: str | None = None

    def __len__(self) -> int:
        return int(self.lengths.size)

    def sequences(self, index: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """``[(chosen input_ids, labels), (rejected input_ids, labels)]`` of pair ``index``, labels unshifted."""
        return [side.sample_arrays(index) for side in self._sides]

    def content_digest(self) -> str:
        if self._digest is None:
            import xxhash

            parts = [f"{name}:{side.content_digest()}" for name, side in zip(SIDES, self._sides)]
            if self.margins is not None:  # other margins are other data; a file without any keeps its old digest
                parts.append(f"{MARGIN_COLUMN}:{xxhash.xxh3_128(self.margins.tobytes()).hexdigest()}")
            self._digest = xxhash.xxh3_128("|".join(parts).encode()).hexdigest()
        return self._digest

    def max_token_id(self) -> int | None:
        found = [value for value in (side.max_token_id() for side in self._sides) if value is not None]
        return max(found) if found else None

    def sides(self) -> SideRows:
        """Every side as a sample of its own: what the checks made for SFT rows read (the objective
        self-check, the vocabulary check, the token-budget probe)."""
        return SideRows(self)


class SideRows:
    """A pair dataset seen as ``2N`` plain samples: row ``2i`` is pair ``i``'s chosen side, ``2i + 1`` its
    rejected side."""

    sequences_per_unit = 1  # data/rows.py: SampleRows

    def __init__(self, pairs: PreferenceDataset) -> None:
        self.pairs = pairs
        self.path = pairs.path
        self.lengths = pairs.side_lengths.reshape(-1)
        self.num_loss_counted_tokens = pairs.side_loss_tokens.reshape(-1)

    def __len__(self) -> int:
        return int(self.lengths.size)

    def sample_arrays(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self.pairs.sequences(index // 2)[index % 2]

    def sample(self, index: int) -> tuple[list[int], list[int]]:
        input_ids, labels = self.sample_arrays(index)
        return input_ids.tolist(), labels.tolist()

    def max_token_id(self) -> int | None:
        return self.pairs.max_token_id()

    def content_digest(self) -> str:
        return self.pairs.content_digest()  # the same rows, seen side by side


def _margins(path: str, table: pa.Table) -> np.ndarray:
    """The ``margin`` column as float64 ``[N]``, read from the arrow buffers (no Python object per row); the
    first row without a finite number is named."""
    import pyarrow.compute as pc

    column = table.column(MARGIN_COLUMN)
    if not (pa.types.is_floating(column.type) or pa.types.is_integer(column.type)) or column.null_count:
        values = column.to_pylist()
        row = next((index for index, value in enumerate(values)
                    if isinstance(value, bool) or not isinstance(value, (int, float))), 0)
        raise ValueError(f"{path}:{row + 1}: '{MARGIN_COLUMN}' must be a number (a pair's margin), got "
                         f"{values[row]!r}")
    margins = pc.cast(column, pa.float64()).to_numpy()
    bad = np.flatnonzero(~np.isfinite(margins))
    if bad.size:
        raise ValueError(f"{path}:{bad[0] + 1}: '{MARGIN_COLUMN}' must be a finite number (a pair's margin), got "
                         f"{float(margins[bad[0]])!r}")
    return margins


def _side_dataset(path: str, table: pa.Table, read_side: Callable[[pa.Table], object], side: str):
    """One side's columns under the names an SFT row has; a broken row is named by its own column."""
    names = [f"{side}_input_ids", f"{side}_labels"]
    missing = [name for name in names if name not in table.column_names]
    if missing:
        raise ValueError(f"{path}:1: a preference file without '{missing[0]}' (no row has it)")
    try:
        return read_side(table.select(names).rename_columns(["input_ids", "labels"]))
    except ValueError as err:
        raise ValueError(str(err).replace("'input_ids'", f"'{names[0]}'").replace("'labels'", f"'{names[1]}'")) \
            from None
