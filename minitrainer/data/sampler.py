"""From a tokenized jsonl to the packed tensors one rank feeds its model.

    dataset = load_tokenized_dataset("data/chat_tkns")          # memory-mapped arrow
    batches = make_batch_loader(dataset, batch_size=128, max_tokens_per_rank=10000,
                                rank=rank, world_size=world_size, seed=42)
    step_batch = next(batches)                                   # StepBatch
    for minibatch in step_batch.minibatches: ...                 # Minibatch, [1, T] tensors

Pipeline, per optimizer step ``k`` (every rank computes the same plan):

1. ``InfiniteSampler``: stream positions ``[start + k*B, start + (k+1)*B)`` map to
   dataset rows; epoch ``e`` is ``default_rng(seed + e).permutation(N)``.
2. Rows longer than ``max_tokens_per_rank`` are dropped, counted and logged.
3. ``packing.plan_minibatches`` splits the rest into minibatches x ranks from
   the lengths array alone; this rank reads only its own rows from disk.
4. ``collate_minibatch`` packs each minibatch into one row (no padding)::

       sample a: input_ids a0 a1 a2 a3     labels -100 -100 a2 a3
       sample b: input_ids b0 b1 b2        labels -100 b1 b2

       input_ids     a0   a1   a2   a3   b0   b1   b2
       labels        -100 a2   a3   -100 b1   b2   -100    <- shifted per sample
       position_ids  0    1    2    3    0    1    2
       cu_seqlens    [0, 4, 7]

   Labels are shifted here, in the collator: ``labels[t]`` is the target of
   position ``t``; each sample's last position gets -100, so no target crosses
   a sample boundary. The model side must NOT shift again (pass these labels
   to a plain per-token cross entropy, not to HF's shifting ``loss_function``).
5. Steps run in torch DataLoader worker processes (``num_workers > 0``), so
   the training loop never waits on Python.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import itertools
import json
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from minitrainer.common.labels import IGNORE_INDEX
from minitrainer.common.log import logger
from minitrainer.data.packing import plan_minibatches, sample_costs
from minitrainer.data.preference import PreferenceDataset, is_preference_table
from minitrainer.data.rows import is_pairs
from minitrainer.data.unpaired import UNPAIRED_COLUMN, UnpairedDataset
from minitrainer.data.sources import data_files

BALANCE_CHOICES = ("tokens", "attention")
DUMMY_TOKEN_ID = 0
"""Token of the 1-token dummy sample a rank with no work in a minibatch gets;
any in-vocabulary id works since its label is IGNORE_INDEX."""


# ----------------------------------------------------------------------------
# Dataset


def resolve_data_file(data_path: str | Path) -> Path:
    """The jsonl behind ``--data-path``: the file itself, or a folder's
    ``data.jsonl``, or a folder's only ``*.jsonl`` (``data_files``)."""
    path = Path(data_path)
    if path.is_file():
        return path
    if path.is_dir():
        if (path / "data.jsonl").is_file():
            return path / "data.jsonl"
        candidates = data_files(path)
        if len(candidates) == 1:
            return candidates[0]
        if not candidates and (path / "rejected.jsonl").is_file():
            raise ValueError(f"{path} holds only rejected.jsonl: the process_data.py run that wrote it kept no row "
                             "(each is listed there with its reason); fix those rows and tokenize again")
        found = ", ".join(c.name for c in candidates) or "none"
        raise ValueError(f"{path}: expected data.jsonl or exactly one *.jsonl in the folder, found {found}")
    raise ValueError(f"{path}: no such file or folder")


class TokenizedDataset:
    """Tokenized samples, memory-mapped through arrow, with lengths in memory.

    Attributes:
        path: the jsonl file read.
        lengths: int64 ``[N]``, tokens per sample.
        num_loss_counted_tokens: int64 ``[N]``, shifted targets per sample,
            ``count(labels[1:] != IGNORE_INDEX)`` (the first token is never a target).
    """

    sequences_per_unit = 1  # data/rows.py: SampleRows

    def __init__(self, path: str, table: pa.Table, dataset: object) -> None:
        self.path = path
        self._dataset = dataset  # keeps the memory map alive; pickles by file path
        self._table = table
        self.lengths, self.num_loss_counted_tokens = _validate_and_count(path, table)
        self._chunk_starts = _chunk_starts(table.column("input_ids"))
        self._views: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
        self._digest: str | None = None

    def __len__(self) -> int:
        return int(self.lengths.size)

    def content_digest(self) -> str:
        """A hash of every row's ``input_ids`` and ``labels`` (computed once, streamed chunk by chunk
        over the memory map): what a resume compares, so a re-tokenized file of the same lengths is
        not taken for the data a checkpoint was trained on. xxh3-128 (``xxhash``, a dependency of
        ``datasets``) hashes about 8 GB/s, sha256 about 0.5: this runs at every start."""
        if self._digest is None:
            import xxhash

            digest = xxhash.xxh3_128()
            for name in ("input_ids", "labels"):
                digest.update(name.encode())
                for chunk in self._table.column(name).chunks:
                    values = chunk.flatten().to_numpy(zero_copy_only=False)
                    digest.update(np.ascontiguousarray(values, dtype=np.int64))
            self._digest = digest.hexdigest()
        return self._digest

    def max_token_id(self) -> int | None:
        """The largest input id in the file (one pass over the column), None when empty."""
        return pc.max(pc.list_flatten(self._table.column("input_ids"))).as_py()

    def sample(self, index: int) -> tuple[list[int], list[int]]:
        """``(input_ids, labels)`` of one row, labels unshifted."""
        input_ids, labels = self.sample_arrays(index)
        return input_ids.tolist(), labels.tolist()

    def sample_arrays(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Like ``sample`` but as int64 numpy arrays (zero-copy views where possible)."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        chunk = int(np.searchsorted(self._chunk_starts, index, side="right")) - 1
        local = index - int(self._chunk_starts[chunk])
        return self._row("input_ids", chunk, local), self._row("labels", chunk, local)

    def _row(self, column: str, chunk: int, local: int) -> np.ndarray:
        key = (column, chunk)
        if key not in self._views:
            array = self._table.column(column).chunk(chunk)
            # Offsets index into the (unsliced) child values; both views are zero-copy.
            offsets = array.offsets.to_numpy()
            values = array.values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
            self._views[key] = (offsets, values)
        offsets, values = self._views[key]
        return values[offsets[local] : offsets[local + 1]]

    def __getstate__(self) -> dict:
        # Numpy views into the memory map do not pickle; rebuild them lazily.
        state = self.__dict__.copy()
        state["_views"] = {}
        return state


def load_tokenized_dataset(data_path: str, *, cache_dir: str | None = None,
                           ) -> TokenizedDataset | PreferenceDataset | UnpairedDataset:
    """Open a tokenized jsonl (or ``process_data.py`` output folder) memory-mapped: SFT rows, preference
    pairs when its rows have ``chosen_input_ids`` (``preference.py``), or unpaired feedback when they have
    ``desirable`` (``unpaired.py``).

    The jsonl is converted once to an arrow file in the Hugging Face datasets
    cache; later calls (other ranks, after a barrier) reuse it. Every row is
    validated and per-row lengths and loss-token counts are computed here,
    vectorized over the arrow columns.

    Args:
        data_path: a jsonl file, or a folder holding ``data.jsonl`` (or exactly one ``*.jsonl``).
        cache_dir: datasets cache folder; the Hugging Face default when None.

    Returns:
        The dataset.

    Raises:
        ValueError: ``path:row: reason`` for the first broken row (1-based row
            number, the line number when the file has no blank lines).
    """
    import datasets

    path = resolve_data_file(data_path)
    if not _has_content(path):
        raise ValueError(_empty_file_line(path))
    try:
        dataset = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=cache_dir)
    except datasets.exceptions.DatasetGenerationError as err:
        raise ValueError(_first_bad_json_line(path) or f"{path}: cannot be read as JSON lines ({err})") from None
    table = dataset.data.table
    # The columns say what a row is: chosen/rejected pairs, one sample with a desirable flag, or one sample.
    if is_preference_table(table):
        return PreferenceDataset(str(path), table, lambda side: TokenizedDataset(str(path), side, dataset))
    if UNPAIRED_COLUMN in table.column_names:
        return UnpairedDataset(str(path), TokenizedDataset(str(path), table, dataset), _desirable(path, table))
    return TokenizedDataset(str(path), table, dataset)


def _desirable(path: Path, table: pa.Table) -> np.ndarray:
    """The ``desirable`` column of unpaired feedback rows as bools; a row without one is named."""
    column = table.column(UNPAIRED_COLUMN)
    if not pa.types.is_boolean(column.type) or column.null_count:
        values = column.to_pylist()
        row = next(index for index, value in enumerate(values) if not isinstance(value, bool))
        raise ValueError(f"{path}:{row + 1}: '{UNPAIRED_COLUMN}' must be true or false (an unpaired feedback row), "
                         f"got {values[row]!r}")
    return column.to_numpy(zero_copy_only=False).astype(bool)


def datasets_cache_dir(fallback: Path) -> tuple[str | None, str | None]:
    """Where ``load_tokenized_dataset`` may write its arrow file: the ``datasets`` cache, else ``fallback``.

    The ``datasets`` cache (``HF_DATASETS_CACHE``, by default ``~/.cache/huggingface/datasets``)
    is used where it can be written. A read-only home (a container's, a cluster's) moves the cache
    to ``fallback`` (the run's output folder), with a note saying so; a ``HF_DATASETS_CACHE`` the
    user set is never overridden.

    Returns:
        ``(cache_dir, note)``: ``cache_dir`` None for the ``datasets`` default; ``note`` a line to
        log when the fallback is used, else None.

    Raises:
        ValueError: one line naming ``HF_DATASETS_CACHE`` when nothing usable can be written.
    """
    import os

    import datasets.config

    default = Path(datasets.config.HF_DATASETS_CACHE)
    problem = cannot_write(default)
    if problem is None:
        return None, None
    if os.environ.get("HF_DATASETS_CACHE"):
        raise ValueError(f"HF_DATASETS_CACHE={default} cannot be written ({problem}): point it at a writable "
                         "folder (the tokenized data is converted to an arrow file there)")
    fallback_problem = cannot_write(fallback)
    if fallback_problem is not None:
        raise ValueError(f"the datasets cache {default} ({problem}) and {fallback} ({fallback_problem}) cannot be "
                         "written: set HF_DATASETS_CACHE to a writable folder")
    return str(fallback), (f"the datasets cache {default} is not writable ({problem}): the arrow file of the "
                           f"data goes to {fallback} instead (HF_DATASETS_CACHE chooses another folder)")


def cannot_write(folder: Path) -> str | None:
    """Why a file cannot be created in ``folder`` (made if missing), or None: the check is a real write."""
    import tempfile

    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as err:
        return err.strerror or str(err)


def _has_content(path: Path) -> bool:
    """Whether the file holds anything but whitespace (reads only up to the first such byte)."""
    with path.open("rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return True
    return False


def _empty_file_line(path: Path) -> str:
    """Why ``path`` holds no rows, in one line: the ``process_data.py`` run that made it wrote none (before it
    left no dataset then, it left an empty one, with the summary that says why beside it), or it is empty."""
    line = f"{path}: the file is empty (no rows)"
    stem = path.name.removesuffix(".jsonl")
    summary_path = path.with_name("summary.json" if path.name == "data.jsonl" else f"{stem}.summary.json")
    try:
        summary = json.loads(summary_path.read_text())
        if summary["num_written"]:
            return line
        rejected = ", ".join(f"{reason} {count}" for reason, count in summary["rejected_by_reason"].items())
        num_lines, listing = int(summary["num_lines"]), summary["outputs"]["rejected"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return line
    return (f"{line}: the process_data.py run that wrote it kept none of its {num_lines} input row(s) (rejected: "
            f"{rejected or 'none'}; listed in {listing}, counted in {summary_path}); fix those rows and tokenize again")


def _first_bad_json_line(path: Path) -> str | None:
    """``path:line: reason`` for the first line that is not a JSON object (a truncated write), or None.
    Only read after the fast reader failed, so a good file is never parsed twice."""
    with path.open(encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as err:
                return f"{path}:{number}: not valid JSON ({err.msg} at character {err.pos}; a truncated line?)"
            if not isinstance(row, dict):
                return f"{path}:{number}: not a JSON object"
    return None


def _validate_and_count(path: str, table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    num_rows = table.num_rows
    if num_rows == 0:
        raise ValueError(f"{path}: no rows")
    for name in ("input_ids", "labels"):
        if name not in table.column_names:
            raise ValueError(f"{path}:1: missing '{name}' (no row has it)")
        kind = table.schema.field(name).type
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not (
            pa.types.is_integer(kind.value_type) or pa.types.is_null(kind.value_type)
        ):
            raise ValueError(f"{path}: '{name}' must be a list of integers, got arrow type {kind}")
    input_ids, labels = table.column("input_ids"), table.column("labels")
    problems = [
        (input_ids.is_null(), "missing 'input_ids'"),
        (labels.is_null(), "missing 'labels'"),
    ]
    lengths = pc.list_value_length(input_ids).fill_null(0)
    label_lengths = pc.list_value_length(labels).fill_null(0)
    problems.append((pc.equal(lengths, 0), "empty 'input_ids'"))
    problems.append((pc.not_equal(lengths, label_lengths), "'input_ids' and 'labels' have different lengths"))
    for name, column in (("input_ids", input_ids), ("labels", labels)):
        # A null inside a list, e.g. [1, null].
        if pc.list_flatten(column).null_count:
            problems.append((_rows_with_inner_nulls(column), f"null value inside '{name}'"))
    for mask, reason in problems:
        mask = np.asarray(mask.to_numpy(zero_copy_only=False), dtype=bool)
        if mask.any():
            bad = np.flatnonzero(mask)
            more = f" ({bad.size} rows with this problem)" if bad.size > 1 else ""
            raise ValueError(f"{path}:{int(bad[0]) + 1}: {reason}{more}")
    lengths_np = np.asarray(lengths.to_numpy(zero_copy_only=False), dtype=np.int64)
    return lengths_np, _shifted_loss_counts(labels)


def _rows_with_inner_nulls(column: pa.ChunkedArray) -> pa.ChunkedArray:
    masks = []
    for chunk in column.chunks:
        lengths = pc.list_value_length(chunk).fill_null(0).to_numpy(zero_copy_only=False)
        nulls = pc.is_null(pc.list_flatten(chunk)).to_numpy(zero_copy_only=False).astype(np.int64)
        ends = np.cumsum(lengths)
        per_row = np.add.reduceat(nulls, ends - lengths) if nulls.size else np.zeros(len(chunk), np.int64)
        per_row = np.where(lengths > 0, per_row, 0)
        masks.append(pa.array(per_row > 0))
    return pa.chunked_array(masks, type=pa.bool_())


def _shifted_loss_counts(labels: pa.ChunkedArray) -> np.ndarray:
    """``count(labels[1:] != IGNORE_INDEX)`` per row, chunk by chunk (bounded memory)."""
    counts = []
    for chunk in labels.chunks:
        lengths = pc.list_value_length(chunk).to_numpy(zero_copy_only=False).astype(np.int64)
        counted = pc.list_flatten(chunk).to_numpy(zero_copy_only=False) != IGNORE_INDEX
        cumulative = np.concatenate(([0], np.cumsum(counted, dtype=np.int64)))
        ends = np.cumsum(lengths)
        starts = ends - lengths
        # Rows are non-empty (validated), so starts + 1 <= ends.
        counts.append(cumulative[ends] - cumulative[starts + 1])
    return np.concatenate(counts).astype(np.int64) if counts else np.zeros(0, dtype=np.int64)


def _chunk_starts(column: pa.ChunkedArray) -> np.ndarray:
    return np.concatenate(([0], np.cumsum([len(chunk) for chunk in column.chunks])))[:-1].astype(np.int64)


# ----------------------------------------------------------------------------
# Sampler


def batch_lengths_to_minibatches(
    batch_lengths: Sequence[int], max_tokens_per_rank: int, num_ranks: int, rank: int
) -> list[list[int]]:
    """This rank's minibatches (lists of batch indices, ``[-1]`` for a dummy): the original mini_trainer's
    public per-rank packer, with its signature, import path (``from minitrainer.data.sampler import ...``) and contract, over
    ``packing.plan_minibatches``. Samples longer than ``max_tokens_per_rank`` are left out of every
    minibatch with a warning (its collator dropped them), not an error. The loader below does not call it:
    it drops such samples itself before planning, so it counts them.
    """
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank {rank} outside 0..{num_ranks - 1}")
    sizes = np.asarray(batch_lengths, dtype=np.int64)
    keep = np.flatnonzero(sizes <= max_tokens_per_rank)
    if keep.size < sizes.size:
        over = np.flatnonzero(sizes > max_tokens_per_rank)
        warnings.warn(f"left out {over.size} sample(s) longer than max_tokens_per_rank={max_tokens_per_rank}: "
                      f"batch indices {over[:5].tolist()}{' ...' if over.size > 5 else ''}", stacklevel=2)
        sizes = sizes[keep]
    plan = plan_minibatches(sizes, max_tokens_per_rank=max_tokens_per_rank, num_ranks=num_ranks)
    if keep.size == len(batch_lengths):
        return [minibatch[rank] for minibatch in plan]
    return [[int(keep[i]) if i >= 0 else -1 for i in minibatch[rank]] for minibatch in plan]


class InfiniteSampler:
    """Endless stream of dataset indices, reshuffled every epoch.

    Epoch ``e`` is ``np.random.default_rng(seed + e).permutation(num_samples)``,
    so every rank with the same seed sees the same stream. ``position`` counts
    samples consumed; ``epoch = position // num_samples`` and
    ``offset = position % num_samples``.
    """

    def __init__(self, num_samples: int, seed: int, position: int = 0) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if seed < 0 or position < 0:
            raise ValueError(f"seed and position must be >= 0, got seed={seed}, position={position}")
        self.num_samples = num_samples
        self.seed = seed
        self.position = position
        self._cached_epoch = -1
        self._cached_permutation = np.zeros(0, dtype=np.int64)

    @property
    def epoch(self) -> int:
        return self.position // self.num_samples

    @property
    def offset(self) -> int:
        return self.position % self.num_samples

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of epoch ``epoch`` (the last one is cached)."""
        if epoch != self._cached_epoch:
            self._cached_permutation = np.random.default_rng(self.seed + epoch).permutation(self.num_samples)
            self._cached_epoch = epoch
        return self._cached_permutation

    def take(self, n: int) -> np.ndarray:
        """The next ``n`` indices (possibly across epochs); advances ``position``."""
        parts = []
        while n > 0:
            epoch, offset = self.epoch, self.offset
            count = min(n, self.num_samples - offset)
            parts.append(self.permutation(epoch)[offset : offset + count])
            self.position += count
            n -= count
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def state_dict(self) -> dict:
        return {
            "seed": self.seed,
            "num_samples": self.num_samples,
            "position": self.position,
            "epoch": self.epoch,
            "offset": self.offset,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed or state["num_samples"] != self.num_samples:
            raise ValueError(
                f"sampler state is for seed={state['seed']}, num_samples={state['num_samples']}; "
                f"this run has seed={self.seed}, num_samples={self.num_samples}"
            )
        self.position = int(state["position"])


# ----------------------------------------------------------------------------
# Collation


@dataclass
class Minibatch:
    """One packed row for one rank (shapes ``[1, T]``, no padding)."""

    input_ids: torch.Tensor  # [1, T] int64
    labels: torch.Tensor  # [1, T] int64, shifted per sample: the target of position t
    position_ids: torch.Tensor  # [1, T] int64, restarting at 0 per sample
    cu_seqlens: torch.Tensor  # [num_seqs + 1] int32, sample boundaries for varlen attention
    max_seqlen: int
    num_loss_counted_tokens: int  # targets != IGNORE_INDEX in this row
    num_samples: int  # real samples (a dummy counts 0)
    num_tokens: int  # T
    # A context-parallel rank's shard of the group's row carries its attention plan
    # (a context_parallel.ContextParallelPlan; that module builds it, this one cannot import it).
    context_parallel_plan: object | None = None
    # The dataset rows packed here, in order: with preference pairs, sequences 2i and 2i + 1 of the row
    # are row rows[i]'s chosen and rejected sides (the objective looks their reference log-probs up).
    rows: tuple[int, ...] = ()

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> Minibatch:
        return dataclasses.replace(
            self, **{name: getattr(self, name).to(device, non_blocking=non_blocking) for name in _TENSOR_FIELDS}
        )

    def pin_memory(self) -> Minibatch:
        """Called by DataLoader(pin_memory=True)."""
        return dataclasses.replace(self, **{name: getattr(self, name).pin_memory() for name in _TENSOR_FIELDS})


_TENSOR_FIELDS = ("input_ids", "labels", "position_ids", "cu_seqlens")


@dataclass
class StepBatch:
    """What one rank gets for one optimizer step; counts marked "all ranks" are global."""

    minibatches: list[Minibatch]  # same length on every rank (gradient accumulation steps)
    batch_num_loss_counted_tokens: int  # loss denominator: targets over the whole batch, all ranks
    num_samples: int  # real samples in the batch after dropping, all ranks
    num_dropped_samples: int  # samples longer than max_tokens_per_rank, all ranks
    num_total_tokens: int  # tokens of the real samples, all ranks
    start_position: int  # sampler stream position of the batch's first sample
    end_position: int  # stream position after the batch: resume from here
    epoch: int  # epoch of the batch's first sample
    dropped_indices: list[int] = dataclasses.field(default_factory=list)  # dataset rows dropped
    kept_indices: list[int] = dataclasses.field(default_factory=list)  # dataset rows trained, all ranks
    sample_lengths: list[int] = dataclasses.field(default_factory=list)  # real sequences' lengths, all ranks (FLOPs)

    @property
    def num_minibatches(self) -> int:
        return len(self.minibatches)

    def pin_memory(self) -> StepBatch:
        return dataclasses.replace(self, minibatches=[m.pin_memory() for m in self.minibatches])


def collate_minibatch(samples: Sequence[tuple[Sequence[int], Sequence[int]]]) -> Minibatch:
    """Pack ``(input_ids, unshifted labels)`` samples into one row, shifting labels per sample.

    An empty list gives the dummy: one token ``DUMMY_TOKEN_ID`` with label
    IGNORE_INDEX, counting 0 samples and 0 loss tokens.
    """
    num_samples = len(samples)
    if not samples:
        samples = [([DUMMY_TOKEN_ID], [IGNORE_INDEX])]
    ids = [np.asarray(input_ids, dtype=np.int64) for input_ids, _ in samples]
    lengths = np.array([a.size for a in ids], dtype=np.int64)
    shifted = []
    for (_, labels), length in zip(samples, lengths.tolist(), strict=True):
        labels = np.asarray(labels, dtype=np.int64)
        assert labels.size == length, "input_ids and labels differ in length"
        # labels[t] becomes the target of position t: the next token's label.
        shifted.append(np.concatenate((labels[1:], [IGNORE_INDEX])))
    input_ids = np.concatenate(ids)
    labels = np.concatenate(shifted)
    total = int(lengths.sum())
    cu_seqlens = np.concatenate(([0], np.cumsum(lengths)))
    position_ids = np.arange(total, dtype=np.int64) - np.repeat(cu_seqlens[:-1], lengths)
    return Minibatch(
        input_ids=torch.from_numpy(input_ids).unsqueeze(0),
        labels=torch.from_numpy(labels).unsqueeze(0),
        position_ids=torch.from_numpy(position_ids).unsqueeze(0),
        cu_seqlens=torch.from_numpy(cu_seqlens.astype(np.int32)),
        max_seqlen=int(lengths.max()),
        num_loss_counted_tokens=int((labels != IGNORE_INDEX).sum()),
        num_samples=num_samples,
        num_tokens=total,
    )


def collate_units(dataset, rows: Sequence[int]) -> Minibatch:
    """Pack whole units of ``dataset`` (a sample, or a preference pair's two sides, chosen first) into one row;
    ``num_samples`` counts units."""
    if not is_pairs(dataset):
        return dataclasses.replace(collate_minibatch([dataset.sample_arrays(row) for row in rows]), rows=tuple(rows))
    packed = collate_minibatch([sequence for row in rows for sequence in dataset.sequences(row)])
    return dataclasses.replace(packed, num_samples=len(rows), rows=tuple(rows))


def sequence_lengths(dataset, rows: np.ndarray) -> np.ndarray:
    """The lengths of the packed sequences of ``rows``: a pair's two sides are two attention documents (FLOPs)."""
    if not is_pairs(dataset):
        return dataset.lengths[rows]
    return dataset.side_lengths[rows].reshape(-1)


def unit_costs(dataset, rows: np.ndarray, balance: str):
    """The packer's balance cost of ``rows``: by name for single samples; for pairs under ``attention``, the
    sum of each side's cost, since each side is an attention document of its own."""
    if not is_pairs(dataset) or balance == "tokens":
        return balance
    sides = dataset.side_lengths[rows]
    costs = sample_costs(sides[:, 0], balance) + sample_costs(sides[:, 1], balance)
    return lambda _lengths: costs


# ----------------------------------------------------------------------------
# Loader


class _StepDataset(torch.utils.data.Dataset):
    """Map-style dataset whose item ``k`` is optimizer step ``k``'s StepBatch for one rank."""

    def __init__(
        self,
        dataset: TokenizedDataset,
        *,
        batch_size: int,
        max_tokens_per_rank: int,
        rank: int,
        world_size: int,
        seed: int,
        start_position: int,
        balance: str,
    ) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.max_tokens_per_rank = max_tokens_per_rank
        self.rank = rank
        self.world_size = world_size
        self.start_position = start_position
        self.balance = balance
        # A weighted mix (mix.MixedDataset) brings its own stream; one dataset keeps the plain one.
        self.sampler = dataset.stream(seed) if hasattr(dataset, "stream") else InfiniteSampler(len(dataset), seed)

    def __getitem__(self, step: int) -> StepBatch:
        start = self.start_position + step * self.batch_size
        self.sampler.position = start
        indices = self.sampler.take(self.batch_size)
        lengths = self.dataset.lengths[indices]
        keep = lengths <= self.max_tokens_per_rank
        dropped = indices[~keep]
        if dropped.size and self.rank == 0:
            listed = ", ".join(f"{i} ({n} tokens)" for i, n in zip(dropped[:5].tolist(), lengths[~keep][:5].tolist()))
            logger.warning(
                "batch of stream positions %d..%d: dropped %d sample(s) longer than max_tokens_per_rank=%d: "
                "rows %s%s", start, start + self.batch_size - 1, dropped.size, self.max_tokens_per_rank, listed,
                ", ..." if dropped.size > 5 else "",
            )  # fmt: skip
        kept = indices[keep]
        kept_lengths = lengths[keep]
        plan = plan_minibatches(
            kept_lengths, max_tokens_per_rank=self.max_tokens_per_rank, num_ranks=self.world_size,
            cost=unit_costs(self.dataset, kept, self.balance),
        )
        if not plan:
            # Every sample was dropped: one all-dummy minibatch keeps the step shape.
            plan = [[[-1]] * self.world_size]
        minibatches = []
        for minibatch in plan:
            rows = [int(kept[i]) for i in minibatch[self.rank] if i != -1]
            packed = collate_units(self.dataset, rows)
            assert packed.num_loss_counted_tokens == int(self.dataset.num_loss_counted_tokens[rows].sum())
            minibatches.append(packed)
        return StepBatch(
            minibatches=minibatches,
            batch_num_loss_counted_tokens=int(self.dataset.num_loss_counted_tokens[kept].sum()),
            num_samples=int(kept.size),
            num_dropped_samples=int(dropped.size),
            num_total_tokens=int(kept_lengths.sum()),
            start_position=start,
            end_position=start + self.batch_size,
            epoch=start // len(self.dataset),
            dropped_indices=dropped.tolist(),
            kept_indices=kept.tolist(),
            sample_lengths=sequence_lengths(self.dataset, kept).tolist(),
        )


def _identity(item: StepBatch) -> StepBatch:
    return item


PARENT_POLL_S = 0.5  # the parent-watch fallback's interval (``_die_with_parent``)


def _worker_init(worker_id: int, *, parent_pid: int, pdeathsig: bool) -> None:
    # Collation is numpy plus small copies: extra intra-op threads only contend.
    torch.set_num_threads(1)
    # SLURM and torchrun signal the whole process group at preemption (torchrun passes
    # Ctrl-C on as SIGINT). A worker that died of SIGTERM would make the main process
    # raise before it could write its preemption checkpoint; the main process decides,
    # and shuts workers down.
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    _die_with_parent(parent_pid, pdeathsig=pdeathsig)


def _die_with_parent(parent_pid: int, *, pdeathsig: bool) -> None:
    """SIGKILL this worker as soon as its rank (``parent_pid``) dies, however it dies (an out-of-memory kill
    included), rather than leave it orphaned.

    A forked worker holds copies of its rank's sockets: while it lives, the peers' collectives see no
    closed connection from a rank the out-of-memory killer took, and wait. torch's own check (every 5 s)
    only ends the worker's loop, and its exit can then block for good flushing a queue whose read end
    its sibling workers still hold open (seen: orphans with parent pid 1 for over 10 minutes).

    ``pdeathsig`` (Linux, a loader built on the main thread): the kernel sends SIGKILL when the parent
    dies, with no delay. The kernel ties that request to the *thread* that forked, so a loader built on
    another thread, or another platform, gets a daemon thread that polls the parent pid every
    ``PARENT_POLL_S`` instead. Either way a parent that died before the request is caught here.
    """
    if pdeathsig and sys.platform == "linux":
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))
    else:
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="parent-watch").start()
    if os.getppid() != parent_pid:  # already orphaned: no signal will come
        os.kill(os.getpid(), signal.SIGKILL)


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    # SIGKILL, not sys.exit: an exit would join the queue's feeder thread, which can block forever.
    os.kill(os.getpid(), signal.SIGKILL)


def make_batch_loader(
    dataset: TokenizedDataset,
    *,
    batch_size: int,
    max_tokens_per_rank: int,
    rank: int,
    world_size: int,
    seed: int,
    start_position: int = 0,
    num_workers: int = 1,
    balance: str = "tokens",
    pin_memory: bool = False,
    prefetch_factor: int = 2,
) -> BatchLoader:
    """Endless iterator of this rank's StepBatch, one per optimizer step.

    Batch ``k`` covers stream positions ``[start_position + k*batch_size,
    start_position + (k+1)*batch_size)``. Every rank plans the whole batch from
    ``dataset.lengths`` and reads only its own rows.

    Args:
        dataset: from ``load_tokenized_dataset``.
        batch_size: samples per optimizer step, whole job.
        max_tokens_per_rank: token budget of one rank's packed minibatch;
            longer samples are dropped (counted in ``num_dropped_samples``).
        rank: this rank.
        world_size: number of ranks.
        seed: shuffling seed (epoch e uses seed + e).
        start_position: stream position to start from (a checkpoint's ``end_position``).
        num_workers: DataLoader worker processes; 0 builds batches in-process.
        balance: "tokens" or "attention" (see ``packing.sample_costs``).
        pin_memory: pin the tensors (for faster host-to-GPU copies).
        prefetch_factor: steps each worker prepares ahead (num_workers > 0).

    Returns:
        An infinite iterator of StepBatch; ``close()`` (or ``with``) stops its workers.
    """
    errors = []
    if batch_size < 1:
        errors.append(f"batch_size must be >= 1, got {batch_size}")
    if max_tokens_per_rank < 1:
        errors.append(f"max_tokens_per_rank must be >= 1, got {max_tokens_per_rank}")
    if world_size < 1 or not 0 <= rank < world_size:
        errors.append(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if seed < 0 or start_position < 0 or num_workers < 0:
        errors.append(f"seed, start_position and num_workers must be >= 0, got {seed}, {start_position}, {num_workers}")
    if balance not in BALANCE_CHOICES:
        errors.append(f"balance must be one of {BALANCE_CHOICES}, got {balance!r}")
    if errors:
        raise ValueError("invalid batch loader arguments:\n  - " + "\n  - ".join(errors))

    too_long = int(np.count_nonzero(dataset.lengths > max_tokens_per_rank))
    if too_long and rank == 0:
        logger.warning(
            "%d of %d samples (%.2f%%) in %s are longer than max_tokens_per_rank=%d (longest %d); "
            "they are dropped whenever drawn and counted as num_dropped_samples",
            too_long, len(dataset), 100 * too_long / len(dataset), dataset.path,
            max_tokens_per_rank, int(dataset.lengths.max()),
        )  # fmt: skip
    steps = _StepDataset(
        dataset,
        batch_size=batch_size,
        max_tokens_per_rank=max_tokens_per_rank,
        rank=rank,
        world_size=world_size,
        seed=seed,
        start_position=start_position,
        balance=balance,
    )
    loader = torch.utils.data.DataLoader(
        steps,
        batch_size=None,
        sampler=itertools.count(),  # step k -> steps[k], forever, in order
        num_workers=num_workers,
        collate_fn=_identity,
        pin_memory=pin_memory,
        # The workers fork when iter() runs below, on this thread: whether it is the main thread decides how they
        # learn of their rank's death (_die_with_parent).
        worker_init_fn=functools.partial(_worker_init, parent_pid=os.getpid(),
                                         pdeathsig=threading.current_thread() is threading.main_thread())
        if num_workers else None,
        prefetch_factor=prefetch_factor if num_workers else None,
    )
    return BatchLoader(iter(loader))


class BatchLoader:
    """The loader's iterator, closed explicitly when the loop ends, however it ends (``with``).

    Why: the workers ignore SIGTERM (``_worker_init``), and at interpreter exit
    ``multiprocessing`` stops its daemonic children with SIGTERM and then joins them.
    A loop left by an exception (a failed save, a lost peer) keeps the iterator alive
    in the traceback, so its own shutdown never runs and every rank hung at exit,
    joining a worker that ignored the signal. ``close`` sends each worker its stop
    sentinel and joins it, which is what the iterator's ``__del__`` would do.
    """

    def __init__(self, iterator: Iterator[StepBatch]) -> None:
        self._iterator = iterator

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> StepBatch:
        return next(self._iterator)

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        shutdown = getattr(self._iterator, "_shutdown_workers", None)  # torch's worker shutdown (num_workers > 0)
        if shutdown is not None:
            shutdown()
