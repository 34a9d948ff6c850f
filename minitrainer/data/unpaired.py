"""Unpaired feedback (KTO's data): one completion per row, desirable or not, and the mismatched KL sequences.

A tokenized unpaired row is an SFT prompt/completion row plus ``desirable`` (``process_data.py`` writes it from
TRL's ``label``). A preference file is unpaired on the way in (``unpair``): each pair gives its chosen side as a
desirable row and its rejected side as an undesirable one, in the order TRL's ``unpair_preference_dataset``
gives them (per batch of ``UNPAIR_BATCH`` pairs of its ``map``: the batch's chosen sides, then its rejected).

KTO estimates its KL baseline from mismatched prompt/completion pairs (``KLUnits``): row i's prompt with the
completion of the row before it, cyclic within each chunk of ``chunk`` rows of file order, as TRL builds them when
it prepares the data (chunks of ``per_device_train_batch_size``)::

    rows (chunk 4)    (x0, y0) (x1, y1) (x2, y2) (x3, y3) | (x4, y4) (x5, y5)
    KL sequences      (x0, y3) (x1, y0) (x2, y1) (x3, y2) | (x4, y5) (x5, y4)

The pairing depends on the file and the chunk alone, so the same data gives the same KL sequences on any number of
ranks, minibatches, shuffles and resumes. A row's prompt is everything before its first learned token; its
completion is the rest, unlearned tail included (its log-probability counts the learned tokens alone).

A KTO unit is a row's own sequence and its KL sequence, packed next to each other on one rank as a pair's sides are
(``rows.PairRows``: ``side_lengths[:, 0]`` the own sequence, ``[:, 1]`` the KL one).
"""

from __future__ import annotations

import numpy as np

from minitrainer.common.labels import IGNORE_INDEX
from minitrainer.data.preference import SideRows

UNPAIRED_COLUMN = "desirable"
UNPAIR_BATCH = 1000
"""Pairs per batch of TRL's ``unpair_preference_dataset`` map (``datasets``' default ``batch_size``)."""


def is_unpaired(rows) -> bool:
    """Rows that carry a desirable flag per unit (``UnpairedDataset``, ``KLUnits`` or a subset of either)."""
    return getattr(rows, "desirable", None) is not None


class UnpairedDataset:
    """Samples, each desirable or not: ``samples`` (a ``rows.SampleRows``) and a bool ``[N]`` array."""

    sequences_per_unit = 1  # data/rows.py: SampleRows

    def __init__(self, path: str, samples, desirable: np.ndarray, *, unpaired_from: int | None = None) -> None:
        self.path = path
        self.samples = samples
        self.desirable = np.asarray(desirable, dtype=bool)
        self.lengths = samples.lengths
        self.num_loss_counted_tokens = samples.num_loss_counted_tokens
        self.unpaired_from = unpaired_from
        """The number of pairs these rows were unpaired from (None: an unpaired file)."""

    def __len__(self) -> int:
        return int(self.lengths.size)

    def sample_arrays(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self.samples.sample_arrays(index)

    def sample(self, index: int) -> tuple[list[int], list[int]]:
        input_ids, labels = self.sample_arrays(index)
        return input_ids.tolist(), labels.tolist()

    def max_token_id(self) -> int | None:
        return self.samples.max_token_id()

    def content_digest(self) -> str:
        import xxhash

        return xxhash.xxh3_128(self.samples.content_digest().encode() + self.desirable.tobytes()).hexdigest()


class _PairSides:
    """The sides of a pair dataset as samples, in ``unpair``'s order: row r is side ``side[r]`` of pair
    ``pair[r]``."""

    sequences_per_unit = 1

    def __init__(self, pairs, pair: np.ndarray, side: np.ndarray) -> None:
        self.pairs, self.pair, self.side = pairs, pair, side
        self.path = pairs.path
        self.lengths = pairs.side_lengths[pair, side]
        self.num_loss_counted_tokens = pairs.side_loss_tokens[pair, side]

    def __len__(self) -> int:
        return int(self.lengths.size)

    def sample_arrays(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self.pairs.sequences(int(self.pair[index]))[int(self.side[index])]

    def max_token_id(self) -> int | None:
        return self.pairs.max_token_id()

    def content_digest(self) -> str:
        return self.pairs.content_digest()  # the same tokens; the desirable flags and the order follow from them


def unpair(pairs) -> UnpairedDataset:
    """A preference dataset as ``2N`` unpaired rows: chosen desirable, rejected undesirable, in TRL's order."""
    num_pairs = len(pairs)
    pair, side = [], []
    for start in range(0, num_pairs, UNPAIR_BATCH):
        block = np.arange(start, min(start + UNPAIR_BATCH, num_pairs), dtype=np.int64)
        pair += [block, block]
        side += [np.zeros(block.size, np.int64), np.ones(block.size, np.int64)]
    pair = np.concatenate(pair) if pair else np.zeros(0, np.int64)
    side = np.concatenate(side) if side else np.zeros(0, np.int64)
    return UnpairedDataset(pairs.path, _PairSides(pairs, pair, side), side == 0, unpaired_from=num_pairs)


def kl_partners(num_rows: int, chunk: int) -> np.ndarray:
    """For each row, the row whose completion its KL sequence takes: the one before it in its chunk of
    ``chunk`` rows, the chunk's first taking its last. Pure."""
    index = np.arange(num_rows, dtype=np.int64)
    start = index - index % chunk
    size = np.minimum(start + chunk, num_rows) - start
    return start + (index - start - 1) % np.maximum(size, 1)


def prompt_lengths(rows) -> np.ndarray:
    """Each row's tokens before its first learned one (its whole length when it learns nothing)."""
    lengths = np.empty(len(rows), dtype=np.int64)
    for index in range(len(rows)):
        learned = np.flatnonzero(rows.sample_arrays(index)[1] != IGNORE_INDEX)
        lengths[index] = learned[0] if learned.size else rows.lengths[index]
    return lengths


class KLUnits:
    """KTO's units over unpaired rows: row i's own sequence, then its KL sequence (``kl_partners``)."""

    sequences_per_unit = 2  # data/rows.py: PairRows

    def __init__(self, rows: UnpairedDataset, chunk: int) -> None:
        self.rows = rows
        self.chunk = chunk
        self.path = rows.path
        self.desirable = rows.desirable
        self.partner = kl_partners(len(rows), chunk)
        self.prompt_lengths = prompt_lengths(rows)
        own = np.asarray(rows.lengths, dtype=np.int64)
        completion = own - self.prompt_lengths
        kl_lengths = self.prompt_lengths + completion[self.partner]
        learned = self._learned_counts()
        # A target is a learned token with a token before it: a KL sequence without prompt loses its first.
        kl_targets = learned[self.partner] - ((self.prompt_lengths == 0) & (learned[self.partner] > 0))
        self.side_lengths = np.stack([own, kl_lengths], axis=1)
        self.side_loss_tokens = np.stack([np.asarray(rows.num_loss_counted_tokens, np.int64), kl_targets], axis=1)
        self.lengths = self.side_lengths.sum(axis=1)
        self.num_loss_counted_tokens = self.side_loss_tokens.sum(axis=1)

    def _learned_counts(self) -> np.ndarray:
        """Each row's learned tokens, its first included (a target only with a token before it)."""
        counts = np.asarray(self.rows.num_loss_counted_tokens, dtype=np.int64).copy()
        first_learned = self.prompt_lengths == 0
        counts[first_learned & (self.prompt_lengths < self.rows.lengths)] += 1
        return counts

    def __len__(self) -> int:
        return int(self.lengths.size)

    def sequences(self, index: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """``[(own input_ids, labels), (KL input_ids, labels)]`` of unit ``index``, labels unshifted."""
        own_ids, own_labels = self.rows.sample_arrays(index)
        partner = int(self.partner[index])
        other_ids, other_labels = self.rows.sample_arrays(partner)
        cut, other_cut = int(self.prompt_lengths[index]), int(self.prompt_lengths[partner])
        kl_ids = np.concatenate([own_ids[:cut], other_ids[other_cut:]])
        kl_labels = np.concatenate([np.full(cut, IGNORE_INDEX, np.int64), other_labels[other_cut:]])
        return [(own_ids, own_labels), (kl_ids, kl_labels)]

    def sides(self) -> SideRows:
        return SideRows(self)

    def max_token_id(self) -> int | None:
        return self.rows.max_token_id()

    def content_digest(self) -> str:
        import xxhash

        return xxhash.xxh3_128(f"{self.rows.content_digest()}|kl_chunk:{self.chunk}".encode()).hexdigest()
