"""Input file kinds: a path, folder, glob or hub dataset id -> chunks of rows, streamed.

``process_data.py`` reads its ``--input-file`` through ``open_input``; rows come in chunks of
``chunk_size`` with the file and the line (JSON) or row (tables) number of each, for
``rejected.jsonl`` and ``--strict``. Nothing is held whole: JSON lines are read line by line
(their parsing happens in the workers), tables in record batches (pyarrow), a hub dataset
through ``datasets.load_dataset(..., streaming=True)``.

    kind                         read by                             numbered by
    .jsonl / .json lines / .gz   line by line (gzip when .gz)        line
    .json, one array             an incremental JSON decoder        the line an element starts on
    .parquet                     pyarrow.parquet iter_batches        row
    .arrow                       pyarrow.ipc (file or stream)        row
    .csv                         pyarrow.csv, every column a string  row
    save_to_disk folder          datasets.load_from_disk (--split)   row
    folder / glob of the above   each file in name order             per file
    org/name (not a local path)  datasets.load_dataset (--split, --subset, streaming)   row

Any other file name is read as JSON lines (as before).
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

TABLE_SUFFIXES = (".parquet", ".arrow", ".csv")
JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".ndjson")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_BLOCK = 1 << 20


@dataclass
class Chunk:
    """Consecutive rows of one file. A row is a JSON line (``bytes``, parsed by the worker) or an
    already parsed value (a table row's dict, a JSON array's element)."""

    file: str
    unit: str  # "line" or "row": what ``numbers`` count
    numbers: list[int]  # 1-based, one per row
    rows: list[Any]


@dataclass
class Input:
    """What ``--input-file`` names: one or more files, a ``save_to_disk`` folder or a hub dataset."""

    spec: str
    kind: str  # "files", "saved", "hub"
    files: tuple[Path, ...] = ()
    split: str = "train"
    subset: str | None = None

    def describe(self) -> str:
        if self.kind == "hub":
            return f"hub dataset {self.spec} (split {self.split}{f', subset {self.subset}' if self.subset else ''})"
        if self.kind == "saved":
            return f"datasets folder {self.spec} (split {self.split})"
        kinds = sorted({_kind(path) for path in self.files})
        if len(self.files) == 1:
            return f"{self.files[0]} ({kinds[0]})"
        return f"{len(self.files)} files from {self.spec} ({', '.join(kinds)})"

    def num_rows(self) -> int | None:
        """The number of rows where it is cheap to know (lines of plain JSON files, table metadata)."""
        if self.kind == "saved":
            return len(_load_saved(self))
        if self.kind == "hub":
            return None
        total = 0
        for path in self.files:
            count = _count_rows(path)
            if count is None:
                return None
            total += count
        return total

    def chunks(self, chunk_size: int) -> Iterator[Chunk]:
        """Every row, in order, in chunks of at most ``chunk_size`` (never across files)."""
        if self.kind == "saved":
            batches = _load_saved(self).with_format("arrow").iter(batch_size=chunk_size)
            yield from _batched_tables(self.spec, batches, chunk_size)
        elif self.kind == "hub":
            yield from _hub_chunks(self, chunk_size)
        else:
            for path in self.files:  # one file keeps --input-file's spelling in messages
                yield from _file_chunks(path, chunk_size, self.spec if len(self.files) == 1 else str(path))


def open_input(spec: str, *, split: str = "train", subset: str | None = None) -> Input:
    """Resolve ``--input-file``; ``ValueError`` (one line) when it names nothing readable."""
    path = Path(spec)
    if path.is_file():
        return Input(spec, "files", (path,), split, subset)
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return Input(spec, "saved", split=split, subset=subset)
        files = tuple(sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith(".")
                             and _kind(p) != "unknown"))
        if not files:
            raise ValueError(f"input folder {spec} holds no {', '.join(JSON_SUFFIXES + TABLE_SUFFIXES)} file "
                             "and is no datasets save_to_disk folder")
        return Input(spec, "files", files, split, subset)
    if any(char in spec for char in "*?["):
        files = tuple(sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file()))
        if not files:
            raise ValueError(f"input pattern {spec} matches no file")
        return Input(spec, "files", files, split, subset)
    if _HUB_ID.fullmatch(spec) and not path.is_absolute() and _kind(path) == "unknown":
        return Input(spec, "hub", split=split, subset=subset)
    raise ValueError(f"input file {spec} does not exist")


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(TABLE_SUFFIXES):
        return name.rsplit(".", 1)[1]
    if name.endswith(".gz"):
        return "gzip json" if name.endswith((".jsonl.gz", ".json.gz")) else "unknown"
    return "json" if name.endswith(JSON_SUFFIXES) else "unknown"


def _count_rows(path: Path) -> int | None:
    kind = _kind(path)
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    if kind == "arrow":
        return sum(batch.num_rows for batch in _arrow_batches(path))
    if kind in ("csv", "gzip json") or _starts_array(path):
        return None
    return count_lines(path)


def count_lines(path: Path) -> int:
    """Lines in the file (a final line without a newline counts), reading 1 MiB blocks."""
    num_lines, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            num_lines += block.count(b"\n")
            last = block[-1:]
    return num_lines + (last != b"\n")


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


def _starts_array(path: Path) -> bool:
    """A JSON file whose first non-blank character is ``[``: one array, not JSON lines."""
    if _kind(path) not in ("json", "gzip json", "unknown"):
        return False
    with _open_binary(path) as f:
        while block := f.read(4096):
            stripped = block.lstrip()
            if stripped:
                return stripped.startswith(b"[")
    return False


def _file_chunks(path: Path, chunk_size: int, label: str) -> Iterator[Chunk]:
    kind = _kind(path)
    if kind == "parquet":
        import pyarrow.parquet as pq

        # pre_buffer (pyarrow's default) keeps every column chunk it has read until the file is closed:
        # about 240 bytes a row of ShareGPT data, 0.23 GB at 1M rows. Without it memory stays flat.
        batches = pq.ParquetFile(path, pre_buffer=False).iter_batches(batch_size=chunk_size)
        yield from _batched_tables(label, batches, chunk_size)
    elif kind == "arrow":
        yield from _batched_tables(label, _arrow_batches(path), chunk_size)
    elif kind == "csv":
        yield from _batched_tables(label, _csv_batches(path), chunk_size)
    elif _starts_array(path):
        yield from _chunked(label, "line", _json_array(path), chunk_size)
    else:
        with _open_binary(path) as f:
            yield from _chunked(label, "line", enumerate(f, 1), chunk_size)


def _chunked(file: str, unit: str, numbered: Iterator[tuple[int, Any]], chunk_size: int) -> Iterator[Chunk]:
    numbers, rows = [], []
    for number, row in numbered:
        numbers.append(number)
        rows.append(row)
        if len(rows) == chunk_size:
            yield Chunk(file, unit, numbers, rows)
            numbers, rows = [], []
    if rows:
        yield Chunk(file, unit, numbers, rows)


def _batched_tables(file: str, batches, chunk_size: int) -> Iterator[Chunk]:
    """Record batches (or tables) -> chunks of ``chunk_size`` row dicts."""
    def numbered():
        number = 0
        for batch in batches:
            for row in batch.to_pylist():
                number += 1
                yield number, row

    yield from _chunked(file, "row", numbered(), chunk_size)


def _arrow_batches(path: Path):
    """An Arrow IPC file (Feather v2) or stream (what ``datasets`` writes), memory-mapped."""
    import pyarrow as pa

    source = pa.memory_map(str(path))
    try:
        reader = pa.ipc.open_file(source)
        return (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:
        source.seek(0)
        return iter(pa.ipc.open_stream(source))


def _csv_batches(path: Path):
    """CSV record batches with every column read as a string (no guessed numbers)."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    header = pacsv.open_csv(path).schema.names
    options = pacsv.ConvertOptions(column_types={name: pa.string() for name in header})
    return pacsv.open_csv(path, convert_options=options)


def _json_array(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line, element)`` of a file holding one JSON array, decoded incrementally (1 MiB blocks).

    A syntax error stops the run (``ValueError`` naming the line): nothing after it can be read.
    """
    decoder = json.JSONDecoder()
    with io.TextIOWrapper(_open_binary(path), encoding="utf-8") as reader:
        buf, pos, line = "", 0, 1

        def read_on() -> bool:
            nonlocal buf, pos
            block = reader.read(_BLOCK)
            buf, pos = buf[pos:] + block, 0  # what lies before pos is consumed
            return bool(block)

        def next_char() -> str:
            """The next non-blank character, not consumed ('' at the end of the file)."""
            nonlocal pos, line
            while True:
                start = pos
                while pos < len(buf) and buf[pos] in " \t\r\n":
                    pos += 1
                line += buf.count("\n", start, pos)
                if pos < len(buf):
                    return buf[pos]
                if not read_on():
                    return ""

        assert next_char() == "[", "the caller checked _starts_array"
        pos += 1
        if next_char() == "]":
            return
        while True:
            next_char()
            try:
                value, end = decoder.raw_decode(buf, pos)
                if end == len(buf) and read_on():  # a bare number may go on in the next block
                    continue
            except ValueError as err:
                if read_on():
                    continue
                raise ValueError(f"{path}:{line}: invalid JSON in the array: {err}") from None
            yield line, value
            line += buf.count("\n", pos, end)
            pos = end
            separator = next_char()
            if separator == "]":
                return
            if separator != ",":
                raise ValueError(f"{path}:{line}: expected ',' or ']' after an array element, got "
                                 f"{separator!r}" if separator else f"{path}:{line}: the JSON array is not closed")
            pos += 1


def _load_saved(source: Input):
    import datasets

    loaded = datasets.load_from_disk(source.spec)
    if isinstance(loaded, datasets.DatasetDict):
        if source.split not in loaded:
            raise ValueError(f"{source.spec} has no split {source.split!r} (--split); it has {', '.join(loaded)}")
        loaded = loaded[source.split]
    return loaded


def load_hub(source: Input):
    """``datasets.load_dataset(id, subset, split=..., streaming=True)``; one line when it fails."""
    import datasets

    try:
        return datasets.load_dataset(source.spec, source.subset, split=source.split, streaming=True)
    except (OSError, ValueError) as err:  # ConnectionError, DatasetNotFoundError (OSErrors), a bad split
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"input {source.spec} is no local path and loading it as a hub dataset failed: {first} "
                         "(a local file, folder or glob is read directly)") from None


def _hub_chunks(source: Input, chunk_size: int) -> Iterator[Chunk]:
    number = 0
    for batch in load_hub(source).iter(batch_size=chunk_size):
        columns = list(batch)
        size = len(batch[columns[0]]) if columns else 0
        rows = [{name: batch[name][i] for name in columns} for i in range(size)]
        yield Chunk(source.spec, "row", list(range(number + 1, number + size + 1)), rows)
        number += size
