"""Input file kinds: a path, folder, glob or hub dataset id -> chunks of rows, streamed.

``process_data.py`` reads its ``--input-file`` through ``open_input``; rows come in chunks of
``chunk_size`` with the file and the line (JSON) or row (tables) number of each, for
``rejected.jsonl`` and ``--strict``. Nothing is held whole: JSON lines are read line by line
(their parsing happens in the workers), tables in record batches (pyarrow), a hub dataset
through ``datasets.load_dataset(..., streaming=True)``.

    kind                         read by                             numbered by
    .jsonl / .json lines         line by line (decompressed when     line
      (.gz .zst .bz2 .xz)        the name ends so)
    .json, one array             an incremental JSON decoder        the line an element starts on
    .json, one object of lists   the same, the list under --split's  the line an element starts on
      (pretty-printed)           name or the object's one list
    .parquet                     pyarrow.parquet iter_batches        row
    .arrow                       pyarrow.ipc (file or stream)        row
    .csv, .tsv (.gz .zst ...)    pyarrow.csv, every column a string  row
                                 (cells may span lines; a malformed
                                 row or non-UTF-8 cell is one bad row)
    .txt (.gz .zst .bz2 .xz)     rows of text, as datasets' text     line (a paragraph's first)
                                 builder reads them (--text-sample-by
                                 line, paragraph or document)
    save_to_disk folder          datasets.load_from_disk (--split)   row
    folder of the above          --split's files, at any depth       per file
                                 (README.md configs or file names,
                                 as datasets splits a folder)
    glob of the above            each file in name order             per file
    org/name (not a local path)  datasets.load_dataset (--split, --subset, streaming)   row
                                 (offline: the hub cache's copy, as a folder)        per file

Any other file name is read as JSON lines (as before). A file that opens with a UTF-16 or UTF-32
byte order mark (what Windows PowerShell 5's ``>`` and ``Out-File`` write) is read as the text it
holds, re-encoded to UTF-8; a UTF-8 one loses its mark.
"""

from __future__ import annotations

import bz2
import codecs
import functools
import glob
import gzip
import io
import json
import lzma
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

TABLE_SUFFIXES = (".parquet", ".arrow", ".csv", ".tsv")
# Compressed JSON lines: gzip and the stdlib's bzip2 and xz; zstd (pretraining corpora such as SlimPajama
# ship .jsonl.zst) through the zstandard package when it is installed.
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".bz2": "bzip2", ".xz": "xz"}
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson") + tuple(base + suffix for suffix in COMPRESSIONS
                                                        for base in (".jsonl", ".json", ".ndjson"))
TEXT_SUFFIXES = (".txt",) + tuple(".txt" + suffix for suffix in COMPRESSIONS)
# A text file's rows, as datasets' text builder's sample_by: each line, each block between blank lines,
# or the whole file.
TEXT_SAMPLE_BY = ("line", "paragraph", "document")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_BLOCK = 1 << 20
# The flags that choose a split and a config, as process_data.py and train.py name them.
SPLIT_FLAG, SUBSET_FLAG = "--split, train.py's --data-split", "--subset, train.py's --data-subset"
_BOM = b"\xef\xbb\xbf"  # the UTF-8 byte order mark Windows tools write first (json.loads of bytes skips it)
# Wider encodings' marks, UTF-32 first: its little-endian mark starts with UTF-16's.
_WIDE_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
              (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


@dataclass
class Chunk:
    """Consecutive rows of one file. A row is a JSON line (``bytes``, parsed by the worker) or an
    already parsed value (a table row's dict, a JSON array's element)."""

    file: str
    unit: str  # "line" or "row": what ``numbers`` count
    numbers: list[int]  # 1-based, one per row
    rows: list[Any]

    @property
    def from_table(self) -> bool:
        """Rows of an Arrow table (parquet, arrow, csv, ``save_to_disk``, hub): a struct column gives
        each row every field any row has, the ones it lacks as ``None``."""
        return self.unit == "row"


@dataclass
class BadRow:
    """A row the reader could not make into a value (a malformed CSV record, a non-UTF-8 cell):
    it stays in the stream, in its place, so that it is counted and listed like any bad row."""

    reason: str
    detail: str
    text: str

    def __str__(self) -> str:
        return self.text


@dataclass
class Input:
    """What ``--input-file`` names: one or more files, a ``save_to_disk`` folder or a hub dataset."""

    spec: str
    kind: str  # "files", "saved", "hub"
    files: tuple[Path, ...] = ()
    split: str = "train"
    subset: str | None = None
    note: str = ""  # how a folder's split was chosen, and what it left out
    text_sample_by: str = "line"  # a text file's rows (TEXT_SAMPLE_BY)

    def describe(self) -> str:
        if self.kind == "hub":
            return f"hub dataset {self.spec} (split {self.split}{f', subset {self.subset}' if self.subset else ''})"
        if self.kind == "saved":
            return f"datasets folder {self.spec} (split {self.split})"
        kinds = sorted({_kind(path) for path in self.files})
        note = f"; {self.note}" if self.note else ""
        if any(kind.endswith("text") for kind in kinds):
            note += f"; a row per {'file' if self.text_sample_by == 'document' else self.text_sample_by} of text " \
                    "(--text-sample-by)"
        if len(self.files) == 1:
            if json_document(self.files[0]) == "object":
                note += f"; {_rows_member(self.files[0], self.split)[1]}"
            return f"{self.files[0]} ({kinds[0]}{note})"
        return f"{len(self.files)} files from {self.spec} ({', '.join(kinds)}{note})"

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
            for path in self.files:  # a file named by --input-file keeps its spelling in messages
                yield from _file_chunks(path, chunk_size, self.spec if self.files == (Path(self.spec),) else str(path),
                                        self.text_sample_by, self.split)


def open_input(spec: str, *, split: str = "train", subset: str | None = None, text_sample_by: str = "line") -> Input:
    """Resolve ``--input-file``; ``ValueError`` (one line) when it names nothing readable."""
    source = _open_input(spec, split, subset)
    source.text_sample_by = text_sample_by
    return source


def _open_input(spec: str, split: str, subset: str | None) -> Input:
    path = Path(spec)
    if path.is_file():
        return Input(spec, "files", (path,), split, subset)
    if path.is_dir():
        if _is_saved(path):
            return Input(spec, "saved", split=split, subset=subset)
        return _dataset_folder(spec, path, split, subset)
    if any(char in spec for char in "*?["):
        files = tuple(sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file()))
        if not files:
            raise ValueError(f"input pattern {spec} matches no file")
        return Input(spec, "files", files, split, subset)
    if _HUB_ID.fullmatch(spec) and not path.is_absolute() and _kind(path) == "unknown":
        return _hub_input(spec, split, subset)
    raise ValueError(f"input file {spec} does not exist")


def _hub_input(spec: str, split: str, subset: str | None) -> Input:
    """A hub dataset id, streamed through ``datasets.load_dataset``; offline (``HF_HUB_OFFLINE`` or
    ``HF_DATASETS_OFFLINE``), the copy ``huggingface-cli download`` left in the hub cache, read as a
    dataset folder: datasets itself cannot load that copy offline, and clusters' compute nodes often are.
    """
    import datasets

    if not datasets.config.HF_HUB_OFFLINE:
        return Input(spec, "hub", split=split, subset=subset)
    from huggingface_hub import constants, snapshot_download

    try:
        snapshot = snapshot_download(spec, repo_type="dataset", local_files_only=True)
    except (OSError, ValueError):  # LocalEntryNotFoundError: no copy in the cache
        raise ValueError(f"input {spec}: the hub is off (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE) and "
                         f"{constants.HF_HUB_CACHE} holds no copy of it; download it where the hub is reachable "
                         f"(huggingface-cli download --repo-type dataset {spec}) or pass a local path") from None
    source = _dataset_folder(snapshot, Path(snapshot), split, subset)
    source.note = f"the hub cache's copy of {spec}, offline; {source.note}"
    return source


HELD_OUT_SPLITS = ("validation", "test")  # datasets' names for dev/valid/val and eval/testing files too


def held_out_split(spec: str, subset: str | None = None) -> str | None:
    """The held-out split of a dataset or ``save_to_disk`` folder: ``validation``, else ``test``; None
    for a file, or a folder that has neither (its names mark no split, say)."""
    path = Path(spec)
    if not path.is_dir():
        return None
    if _is_saved(path):  # a DatasetDict lists its splits; one Dataset has none
        splits = path / "dataset_dict.json"
        names = json.loads(splits.read_text()).get("splits", []) if splits.is_file() else []
    else:
        names = _folder_splits(spec, path, subset)[0]
    return next((name for name in HELD_OUT_SPLITS if name in names), None)


def _is_saved(path: Path) -> bool:
    """A ``save_to_disk`` folder: of one Dataset (``state.json``) or a DatasetDict (``dataset_dict.json``)."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _dataset_folder(spec: str, path: Path, split: str, subset: str | None) -> Input:
    """``--split``'s files of a folder, split as ``datasets.load_dataset(folder)`` splits it.

    A hub dataset repository as downloaded holds every split (``data/train-00000-of-00002.parquet``,
    ``data/test-00000-of-00001.parquet``) and maybe several configs: reading all its files would
    train on the test split, or on a config twice. So the files of a known kind, at any depth, are
    split by the ``configs`` its README.md declares (``--subset`` picks one when there are several
    and none is the default) or else by their names (``train.jsonl``, ``validation/``...), with
    datasets' own patterns; a folder whose names mark no split is all ``train``.
    """
    splits, files, by = _folder_splits(spec, path, subset)
    if split not in splits:
        raise ValueError(f"input folder {spec} has no split {split!r} ({SPLIT_FLAG}): its {by} give "
                         f"{', '.join(splits)}")
    left = [f"{len(chosen)} file(s) of split {name}" for name, chosen in splits.items() if name != split]
    if num_outside := len(set(files).difference(*splits.values())):
        left.append(f"{num_outside} file(s) in no split")
    note = f"split {split} by {by}" + (f"; not read: {', '.join(left)}" if left else "")
    return Input(spec, "files", tuple(splits[split]), split, subset, note=note)


def _folder_splits(spec: str, path: Path, subset: str | None) -> tuple[dict[str, list[Path]], list[Path], str]:
    """``({split: its files}, every data file, what decided the splits)``, paths in ``spec``'s spelling."""
    base = Path(os.path.abspath(path))
    files = sorted((p for p in base.rglob("*") if p.is_file() and _kind(p) != "unknown"
                    and not any(part.startswith((".", "__")) for part in p.relative_to(base).parts)),
                   key=lambda p: p.relative_to(base).parts)
    if not files:
        raise ValueError(f"input folder {spec} holds no {', '.join(JSON_SUFFIXES + TABLE_SUFFIXES + TEXT_SUFFIXES)} "
                         "file and is no datasets save_to_disk folder")
    # As datasets reads a folder as its most common kind: a LICENSE.txt beside the data is no data (and is
    # counted among the files in no split).
    data = [p for p in files if not _kind(p).endswith("text")] or files
    patterns, by, root = _split_patterns(spec, base, subset)
    from datasets.data_files import resolve_pattern

    splits: dict[str, list[Path]] = {}
    for name, split_patterns in patterns.items():
        matched: set[str] = set()
        for pattern in split_patterns:
            try:
                matched.update(resolve_pattern(pattern, str(root)))
            except FileNotFoundError:
                continue
        chosen = [p for p in data if str(p) in matched]
        if chosen:
            splits[str(name)] = chosen
    if not splits and by != "file names":
        raise ValueError(f"input folder {spec}: {by} names none of its {len(data)} data files (its data_files)")
    if not splits:
        import datasets

        raise ValueError(f"input folder {spec}: datasets {datasets.__version__} finds none of its {len(data)} data "
                         "files (symlinks and an old fsspec?), so its splits are unknown; give a glob of the files "
                         "to read, or upgrade datasets")
    spelled = {name: [path / p.relative_to(base) for p in chosen] for name, chosen in splits.items()}
    return spelled, [path / p.relative_to(base) for p in files], by


def _split_patterns(spec: str, base: Path, subset: str | None) -> tuple[dict, str, Path]:
    """``({split: [glob patterns]}, what decided them, the folder they are relative to)``."""
    from datasets.data_files import sanitize_patterns

    configs = _readme_configs(base)
    if not configs:
        if subset is not None:
            raise ValueError(f"{subset!r} ({SUBSET_FLAG}): input folder {spec} declares no configs (in a README.md)")
        return _data_patterns(base), "file names", base
    if subset is None:
        defaults = [name for name, config in configs.items() if config.get("default")]
        if len(configs) > 1 and len(defaults) != 1:
            raise ValueError(f"input folder {spec} declares configs {', '.join(configs)} in its README.md: "
                             f"pick one ({SUBSET_FLAG})")
        subset = defaults[0] if defaults else next(iter(configs))
    if subset not in configs:
        raise ValueError(f"input folder {spec} has no config {subset!r} ({SUBSET_FLAG}): its README.md declares "
                         f"{', '.join(configs)}")
    config = configs[subset]
    root = base / config.get("data_dir", "")
    data_files = config.get("data_files")
    patterns = sanitize_patterns(data_files) if data_files else _data_patterns(root)
    return patterns, f"its README.md's config {subset!r}", root


def _data_patterns(root: Path) -> dict:
    from datasets.data_files import get_data_patterns

    try:
        return get_data_patterns(str(root))
    except FileNotFoundError:  # datasets lists no data file there: the caller says so
        return {}


def _readme_configs(base: Path) -> dict[str, dict]:
    """The ``configs`` of the folder's dataset card (README.md's YAML header), as datasets reads them."""
    readme = base / "README.md"
    if not readme.is_file() or not readme.read_text(errors="replace").startswith("---"):
        return {}
    import yaml
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard

    try:
        return dict(MetadataConfigs.from_dataset_card_data(DatasetCard.load(readme).data))
    except (ValueError, yaml.YAMLError) as err:
        raise ValueError(f"cannot read the configs in {readme}: {str(err).strip().splitlines()[0]}") from None


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(TABLE_SUFFIXES):
        return name.rsplit(".", 1)[1]
    for suffix, compression in COMPRESSIONS.items():
        if name.endswith(suffix):
            if name.endswith((".jsonl" + suffix, ".json" + suffix, ".ndjson" + suffix)):
                return f"{compression} json"
            if name.endswith((".csv" + suffix, ".tsv" + suffix)):  # datasets reads these too
                return name.removesuffix(suffix)[-3:]
            return f"{compression} text" if name.endswith(".txt" + suffix) else "unknown"
    if name.endswith(".txt"):
        return "text"
    return "json" if name.endswith(JSON_SUFFIXES) else "unknown"


def is_table(path: Path) -> bool:
    """A file read as a table (``TABLE_SUFFIXES``, compressed csv and tsv too)."""
    return _kind(path) in ("parquet", "arrow", "csv", "tsv")


def is_text(path: Path) -> bool:
    """A text file (``TEXT_SUFFIXES``) that holds text, not JSON lines or a JSON array under a .txt name
    (read as JSON, as before .txt was a kind of its own)."""
    if not _kind(path).endswith("text"):
        return False
    with open_binary(path) as f:
        for line in f:
            line = line.removeprefix(_BOM).strip()
            if line:
                if line.startswith(b"[") and line[1:].lstrip()[:1] in (b"", b"{", b"]"):
                    return False  # an array of rows opens; "[1] Introduction" is text
                try:
                    return not isinstance(json.loads(line), dict)
                except ValueError:
                    return True
    return True


def _count_rows(path: Path) -> int | None:
    kind = _kind(path)
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    if kind == "arrow":
        return sum(batch.num_rows for batch in _arrow_batches(path))
    if kind in ("csv", "tsv") or kind.endswith((" json", "text")) or json_document(path):
        return None
    with open(path, "rb") as f:
        if _wide_encoding(f.read(4)):  # its newlines are not b"\n" bytes
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


def open_binary(path: Path):
    """The file's bytes, decompressed by its last suffix (``COMPRESSIONS``) and, when it opens with a
    UTF-16 or UTF-32 byte order mark, re-encoded to UTF-8; ``ValueError`` (one line) for a zstd file
    without the zstandard package."""
    compression = next((name for suffix, name in COMPRESSIONS.items() if path.name.lower().endswith(suffix)), None)
    if compression == "zstd":
        try:
            import zstandard
        except ImportError:
            raise ValueError(f"{path} is zstd-compressed: `pip install zstandard` reads it (or decompress it with "
                             "`zstd -d`)") from None
        binary = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    elif compression is None:
        binary = open(path, "rb")
    else:
        binary = {"gzip": gzip.open, "bzip2": bz2.open, "xz": lzma.open}[compression](path, "rb")
    encoding = _wide_encoding(binary.peek(4)[:4])
    return io.BufferedReader(_Utf8Reader(binary, encoding, path), _BLOCK) if encoding else binary


def _wide_encoding(head: bytes) -> str | None:
    """``"utf-16"`` or ``"utf-32"`` when ``head`` (a file's first bytes) is that encoding's byte order mark."""
    return next((encoding for bom, encoding in _WIDE_BOMS if head.startswith(bom)), None)


class _Utf8Reader(io.RawIOBase):
    """A UTF-16 or UTF-32 stream's text as UTF-8 bytes, so that every reader here takes it as it
    takes a UTF-8 file. A lone surrogate passes through (as ``json.loads`` lets one through): its
    row is one bad row (``lone_surrogate``, or ``invalid_utf8`` in text and CSV), not the end of the run."""

    def __init__(self, binary, encoding: str, path: Path):
        super().__init__()
        self._text = io.TextIOWrapper(binary, encoding=encoding, errors="surrogatepass", newline="")
        self._encoding, self._path = encoding, path
        self._pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._pending:
            try:
                text = self._text.read(_BLOCK // 4)
            except UnicodeDecodeError as err:
                raise ValueError(f"{self._path} opens with a {self._encoding.upper()} byte order mark but is not "
                                 f"{self._encoding.upper()} ({err.reason}): save it as UTF-8") from None
            if not text:
                return 0
            self._pending = text.encode("utf-8", "surrogatepass")
        size = min(len(buffer), len(self._pending))
        buffer[:size] = self._pending[:size]
        self._pending = self._pending[size:]
        return size

    def close(self) -> None:
        if not self.closed:
            self._text.close()
        super().close()


def _file_chunks(path: Path, chunk_size: int, label: str, text_sample_by: str, split: str) -> Iterator[Chunk]:
    kind = _kind(path)
    if kind == "parquet":
        import pyarrow.parquet as pq

        # pre_buffer (pyarrow's default) keeps every column chunk it has read until the file is closed:
        # about 240 bytes a row of ShareGPT data, 0.23 GB at 1M rows. Without it memory stays flat.
        batches = pq.ParquetFile(path, pre_buffer=False).iter_batches(batch_size=chunk_size)
        yield from _batched_tables(label, batches, chunk_size)
    elif kind == "arrow":
        yield from _batched_tables(label, _arrow_batches(path), chunk_size)
    elif kind in ("csv", "tsv"):  # tab-separated as datasets reads a .tsv: its csv builder with sep="\t"
        yield from _chunked(label, "row", _csv_rows(path, "\t" if kind == "tsv" else ","), chunk_size)
    elif is_text(path):
        yield from _chunked(label, "line", _text_rows(path, text_sample_by), chunk_size)
    elif (document := json_document(path)) == "array":
        yield from _chunked(label, "line", _json_array(path), chunk_size)
    elif document == "object":
        yield from _chunked(label, "line", _member_rows(path, _rows_member(path, split)[0]), chunk_size)
    else:
        with open_binary(path) as f:
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


def _csv_rows(path: Path, delimiter: str = ",") -> Iterator[tuple[int, dict[str, str] | BadRow]]:
    """``(row, {column: text})`` of a CSV (or TSV) file with a header, every cell a string (no guessed
    numbers).

    A cell may span lines (a reply with code does): without ``newlines_in_values`` pyarrow cuts the
    file into blocks at line breaks and stops, once past its first block, "out of sync with chunker".
    A record with too many or too few cells and a cell that is not UTF-8 are each one ``BadRow`` in
    its place; the rows around it keep their numbers.
    """
    import pyarrow as pa
    import pyarrow.csv as pacsv

    malformed: list[tuple[int | None, BadRow]] = []

    def keep(row) -> str:
        detail = f"expected {row.expected_columns} cells, got {row.actual_columns}"
        # pyarrow numbers records from 1 with the header's: a data row's number is one less.
        malformed.append((None if row.number is None else row.number - 1,
                          BadRow("invalid_csv_row", detail, row.text)))
        return "skip"

    def parse_options(handler):
        return pacsv.ParseOptions(delimiter=delimiter, newlines_in_values=True, invalid_row_handler=handler)

    with open_binary(path) as f:
        header = pacsv.open_csv(f, parse_options=parse_options(lambda row: "skip")).schema.names
    options = pacsv.ConvertOptions(column_types={name: pa.binary() for name in header})
    number = 0
    with open_binary(path) as f:
        for batch in pacsv.open_csv(f, parse_options=parse_options(keep), convert_options=options,
                                    read_options=pacsv.ReadOptions(use_threads=False)):
            for cells in batch.to_pylist():
                # The bad records read so far that lie before this row (one of unknown number: now).
                while malformed and (malformed[0][0] or 0) <= number + 1:
                    number += 1
                    yield number, malformed.pop(0)[1]
                number += 1
                yield number, _decoded_cells(cells)
        for _, bad in malformed:
            number += 1
            yield number, bad


def _decoded_cells(cells: dict[str, bytes | None]) -> dict[str, str | None] | BadRow:
    decoded = {}
    for name, value in cells.items():
        try:
            decoded[name] = None if value is None else value.decode("utf-8")
        except UnicodeDecodeError as err:
            text = ",".join("" if cell is None else cell.decode("utf-8", "replace") for cell in cells.values())
            return BadRow("invalid_utf8", f"column {name!r} is not UTF-8 ({err.reason} at byte {err.start} of "
                                          "the cell); save the file as UTF-8", text)
    return decoded


def _text_rows(path: Path, sample_by: str) -> Iterator[tuple[int, dict]]:
    """``(line, {"text": ...})`` rows of a text file, as datasets' text builder makes them: each line
    (``line``), each block of lines between blank lines (``paragraph``) or the whole file
    (``document``), without the final line break; blank lines are separators, not rows. Windows line
    breaks inside a row are ``\\n``, as datasets reads text (Python's universal newlines). The text
    stays bytes here: the workers decode it (``formats``), and bad UTF-8 is one bad row."""
    with open_binary(path) as f:
        if sample_by == "document":
            text = _row_text(f.read().removeprefix(_BOM))
            if text.strip():
                yield 1, {"text": text}
            return
        first, block = 0, []
        for number, line in enumerate(f, 1):
            if number == 1:
                line = line.removeprefix(_BOM)
            if not line.strip():
                if block:
                    yield first, {"text": _row_text(b"".join(block))}
                    block = []
            elif sample_by == "line":
                yield number, {"text": line.rstrip(b"\r\n")}
            else:
                first = first if block else number
                block.append(line)
        if block:
            yield first, {"text": _row_text(b"".join(block))}


def _row_text(text: bytes) -> bytes:
    """A paragraph's or document's text: without its final line break, Windows line breaks as ``\\n``."""
    return text.rstrip(b"\r\n").replace(b"\r\n", b"\n")


class _JsonDocument:
    """One JSON document (not JSON lines) read incrementally, 1 MiB at a time: values are decoded one
    at a time, so memory holds one element of an array, never the file. A syntax error stops the run
    (``ValueError`` naming the line): nothing after it can be read."""

    def __init__(self, path: Path, what: str):
        self.path, self.what = path, what
        self._reader = io.TextIOWrapper(open_binary(path), encoding="utf-8-sig")
        self._decoder = json.JSONDecoder()
        self.buf, self.pos, self.line = "", 0, 1

    def __enter__(self) -> _JsonDocument:
        return self

    def __exit__(self, *exc) -> None:
        self._reader.close()

    def _read_on(self) -> bool:
        try:
            block = self._reader.read(_BLOCK)
        except UnicodeDecodeError as err:  # one document: no row after the bad byte can be found
            raise ValueError(f"{self.path} is not UTF-8 ({err.reason}: {err.object[err.start:err.end]!r}): "
                             "save it as UTF-8") from None
        self.buf, self.pos = self.buf[self.pos:] + block, 0  # what lies before pos is consumed
        return bool(block)

    def peek(self) -> str:
        """The next non-blank character, not consumed ('' at the end of the file)."""
        while True:
            start = self.pos
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            self.line += self.buf.count("\n", start, self.pos)
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self._read_on():
                return ""

    def take(self, expected: str, after: str) -> str:
        """Consume the next character, one of ``expected``; ``ValueError`` naming the line otherwise."""
        char = self.peek()
        if not char or char not in expected:
            got = f"got {char!r}" if char else f"the JSON {self.what} is not closed"
            raise ValueError(f"{self.path}:{self.line}: expected {' or '.join(map(repr, expected))} after {after}, "
                             f"{got}")
        self.pos += 1
        return char

    def value(self) -> tuple[int, Any]:
        """The next value and the line it starts on."""
        self.peek()
        while True:
            try:
                value, end = self._decoder.raw_decode(self.buf, self.pos)
                if end == len(self.buf) and self._read_on():  # a bare number may go on in the next block
                    continue
            except ValueError as err:
                if self._read_on():
                    continue
                raise ValueError(f"{self.path}:{self.line}: invalid JSON in the {self.what}: {err}") from None
            line = self.line
            self.line += self.buf.count("\n", self.pos, end)
            self.pos = end
            return line, value

    def elements(self) -> Iterator[tuple[int, Any]]:
        """``(line, element)`` of the array that opens here."""
        self.take("[", "the start")
        if self.peek() == "]":
            self.pos += 1
            return
        while True:
            yield self.value()
            if self.take(",]", "an array element") == "]":
                return

    def members(self) -> Iterator[str]:
        """The keys of the object that opens here; after each, the caller reads or skips its value."""
        self.take("{", "the start")
        if self.peek() == "}":
            self.pos += 1
            return
        while True:
            _, key = self.value()
            self.take(":", f"the key {key!r}")
            yield key
            if self.take(",}", "a member") == "}":
                return

    def skip(self) -> tuple[int, bool]:
        """Read past the next value: (how many elements, whether all are objects) for an array, else (0, False)."""
        if self.peek() != "[":
            self.value()
            return 0, False
        count, objects = 0, True
        for _, element in self.elements():
            count += 1
            objects = objects and isinstance(element, dict)
        return count, objects and count > 0


def json_document(path: Path) -> str | None:
    """``"array"`` for a JSON file whose first non-blank character is ``[``; ``"object"`` for one whose
    first non-blank line opens an object that goes on past it, into a next line that opens no row of
    its own (a pretty-printed ``{"data": [...]}``); None for JSON lines (a bad first row among them too)
    and the other kinds."""
    if is_table(path):
        return None
    with open_binary(path) as f:
        block = f.read(4096).removeprefix(_BOM)
        while block and not block.lstrip():
            block = f.read(4096)
        stripped = block.lstrip()
        if stripped.startswith(b"["):
            return "array"
        if not stripped.startswith(b"{"):
            return None
        first, rest = stripped.split(b"\n", 1) if b"\n" in stripped else (stripped + f.readline(), b"")
        try:
            json.loads(first)
            return None
        except ValueError:  # a bad first row, or an object going on: its next line is no row of its own
            following = rest.lstrip()
            while not following and (line := f.readline()):
                following = line.lstrip()
            return "object" if following and not following.startswith(b"{") else None


def _json_array(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line, element)`` of a file holding one JSON array."""
    with _JsonDocument(path, "array") as document:
        yield from document.elements()


def _rows_member(path: Path, split: str = "train") -> tuple[str, str]:
    """``_rows_of_object`` of the file as it is now: asked when the input is described, then when it is read."""
    stat = path.stat()
    return _rows_of_object(path, split, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _rows_of_object(path: Path, split: str, mtime_ns: int, size: int) -> tuple[str, str]:
    """The member of a file holding one JSON object whose array of objects are its rows, and why: the
    member named ``split`` when there is one (``{"train": [...], "test": [...]}``), else the one array
    of objects (SQuAD's ``{"version": ..., "data": [...]}``). ``ValueError`` (one line) when neither is."""
    with _JsonDocument(path, "object") as document:
        arrays = {}
        for key in document.members():
            count, objects = document.skip()
            if objects:
                arrays[key] = count
    if split in arrays:
        return split, f"the rows under {split!r} ({SPLIT_FLAG})"
    if len(arrays) == 1:
        (key,) = arrays
        return key, f"the rows under {key!r}"
    if not arrays:
        raise ValueError(f"{path} holds one JSON object, not rows, and none of its members is a list of rows: "
                         "write one JSON object per line, or one array of them")
    listed = ", ".join(f"{key!r} ({count} rows)" for key, count in arrays.items())
    raise ValueError(f"{path} holds one JSON object with several lists of rows, {listed}, and none is named "
                     f"{split!r}: choose one with {SPLIT_FLAG}")


def _member_rows(path: Path, member: str) -> Iterator[tuple[int, Any]]:
    """``(line, element)`` of the array under ``member`` of a file holding one JSON object."""
    with _JsonDocument(path, "object") as document:
        for key in document.members():
            if key == member:
                yield from document.elements()
                return
            document.skip()


def _load_saved(source: Input):
    import datasets

    loaded = datasets.load_from_disk(source.spec)
    if isinstance(loaded, datasets.DatasetDict):
        if source.split not in loaded:
            raise ValueError(f"{source.spec} has no split {source.split!r} ({SPLIT_FLAG}); it has {', '.join(loaded)}")
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


def data_files(folder: Path) -> list[Path]:
    """A folder's ``*.jsonl`` that may be data: not ``rejected.jsonl``, process_data.py's listing of the rows it
    could not use (all a run that kept none leaves behind)."""
    return sorted(p for p in folder.glob("*.jsonl") if p.is_file() and not p.name.endswith("rejected.jsonl"))
