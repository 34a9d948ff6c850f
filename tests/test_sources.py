"""File kinds (data/sources.py) through process_data.py: the same rows as JSON lines, a ``.json``
array, gzip, parquet, arrow (file and stream), csv, a ``save_to_disk`` folder, a folder and a glob
of shards, and a hub id through ``datasets.load_dataset`` give a byte-identical ``data.jsonl``;
table rows are numbered by row in ``rejected.jsonl`` and ``--strict``; readers stream.

    .venv/bin/python -m pytest -q tests/test_sources.py
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from minitrainer.data.cache import is_tokenized
from minitrainer.data.process_data import ProcessDataConfig, main, process_data
from minitrainer.data.sources import SPLIT_FLAG, open_input

ROOT = Path(__file__).resolve().parent.parent
ROWS = [{"id": i, "messages": [{"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
                               {"role": "assistant", "content": f"It is {2 * i}."}]} for i in range(10)]
ALPACA = [{"instruction": f"Double {i}.", "input": "" if i % 2 else f"{i}", "output": f"{2 * i}"} for i in range(7)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_table(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(rows)
    if path.suffix == ".parquet":
        pq.write_table(table, path, row_group_size=4)
    elif path.suffix == ".csv":
        pacsv.write_csv(table, path)
    else:
        new = pa.ipc.new_file if path.stem.endswith("file") else pa.ipc.new_stream
        with new(str(path), table.schema) as writer:
            for batch in table.to_batches(max_chunksize=3):
                writer.write_batch(batch)
    return path


def _zstd(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor().compress(data)


# kind -> (suffix, compress)
COMPRESSED = {"jsonl_gz": (".gz", gzip.compress), "jsonl_bz2": (".bz2", bz2.compress),
              "jsonl_xz": (".xz", lzma.compress), "jsonl_zst": (".zst", _zstd)}


def write_kind(tmp_path: Path, kind: str, rows: list[dict]) -> str:
    """``rows`` written as ``kind``; returns the ``--input-file`` value."""
    import datasets

    if kind == "jsonl":
        return str(write_jsonl(tmp_path / "in.jsonl", rows))
    if kind == "json_lines":
        return str(write_jsonl(tmp_path / "in.json", rows))
    if kind == "json_array":
        path = tmp_path / "in.json"
        path.write_text(json.dumps(rows, indent=2))
        return str(path)
    if kind == "json_object":  # SQuAD's shape, as json.dump(..., indent=2) writes it
        path = tmp_path / "in.json"
        path.write_text(json.dumps({"version": "1.0", "data": rows, "license": "CC-BY"}, indent=2))
        return str(path)
    if kind in COMPRESSED:
        path = tmp_path / f"in.jsonl{COMPRESSED[kind][0]}"
        path.write_bytes(COMPRESSED[kind][1]("".join(json.dumps(row) + "\n" for row in rows).encode()))
        return str(path)
    if kind in ("parquet", "csv"):
        return str(write_table(tmp_path / f"in.{kind}", rows))
    if kind in ("arrow_file", "arrow_stream"):
        return str(write_table(tmp_path / f"in_{kind}.arrow", rows))
    if kind == "save_to_disk":
        datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
        return str(tmp_path / "saved")
    if kind == "save_to_disk_dict":
        dataset = datasets.Dataset.from_list(rows)
        datasets.DatasetDict({"train": dataset.select([0]), "validation": dataset}).save_to_disk(str(tmp_path / "dd"))
        return str(tmp_path / "dd")
    folder = tmp_path / "shards"
    folder.mkdir()
    if kind == "folder":  # shards of three kinds, read in name order
        write_table(folder / "part-0.parquet", rows[:4])
        write_jsonl(folder / "part-1.jsonl", rows[4:5])
        write_table(folder / "part-2_stream.arrow", rows[5:])
        (folder / "README.md").write_text("not an input file\n")
        return str(folder)
    assert kind == "glob"
    for n, start in enumerate(range(0, len(rows), 3)):
        write_jsonl(folder / f"train-{n:05d}.jsonl", rows[start:start + 3])
    write_jsonl(folder / "test-00000.jsonl", [{"text": "not matched"}])
    return str(folder / "train-*.jsonl")


def tokenize(tmp_path: Path, name: str, input_file: str, model: Path, **overrides) -> tuple[bytes, dict]:
    out = tmp_path / f"out-{name}"
    settings = {"num_proc": 1, "num_printed_samples": 0, "chunk_size": 3, **overrides}
    summary = process_data(ProcessDataConfig(input_file=input_file, model_name_or_path=str(model),
                                             output_dir=str(out), **settings))
    return (out / "data.jsonl").read_bytes(), summary


KINDS = ["json_lines", "json_array", "json_object", *COMPRESSED, "parquet", "arrow_file", "arrow_stream", "save_to_disk",
         "save_to_disk_dict", "folder", "glob"]


@pytest.mark.parametrize("kind", KINDS)
def test_file_kind_gives_the_bytes_of_json_lines(tmp_path, tiny_models, kind):
    model = tiny_models["qwen25"]
    expected, _ = tokenize(tmp_path, "jsonl", write_kind(tmp_path, "jsonl", ROWS), model)
    split = {"split": "validation"} if kind == "save_to_disk_dict" else {}
    data, summary = tokenize(tmp_path, kind, write_kind(tmp_path, kind, ROWS), model, **split)
    assert data == expected
    assert summary["num_lines"] == len(ROWS) and summary["rows_by_format"] == {"messages": len(ROWS)}


@pytest.mark.parametrize("kind", ["json_lines", "json_array"])
def test_a_byte_order_mark_before_the_rows_is_skipped(tmp_path, tiny_models, kind):
    """Windows tools (PowerShell 5's Out-File, Notepad's 'UTF-8 with BOM') write one; a .json array was
    then read as one bad JSON line, and nothing was written."""
    model = tiny_models["qwen25"]
    expected, _ = tokenize(tmp_path, "jsonl", write_kind(tmp_path, "jsonl", ROWS), model)
    path = Path(write_kind(tmp_path, kind, ROWS))
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes().replace(b"\n", b"\r\n"))
    assert tokenize(tmp_path, kind, str(path), model)[0] == expected


def test_zstd_without_its_package_is_refused_in_one_line(tmp_path, tiny_models):
    path = write_kind(tmp_path, "jsonl_zst", ROWS)
    hide = "import sys; sys.modules['zstandard'] = None; import runpy; runpy.run_path('process_data.py', run_name='__main__')"
    result = subprocess.run([sys.executable, "-c", hide, "--input-file", path, "--output-dir", str(tmp_path / "out"),
                             "--model-name-or-path", str(tiny_models["chatml"]), "--num-proc", "1"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (f"process_data.py: error: {path} is zstd-compressed: "
                                                      "`pip install zstandard` reads it (or decompress it with `zstd -d`)")


def test_csv_of_alpaca_rows_reads_every_column_as_text(tmp_path, tiny_models):
    """pyarrow would guess '0' and '' to be a number and null: csv columns are strings."""
    model = tiny_models["llama3"]
    expected, _ = tokenize(tmp_path, "jsonl", write_kind(tmp_path, "jsonl", ALPACA), model)
    data, summary = tokenize(tmp_path, "csv", write_kind(tmp_path, "csv", ALPACA), model, num_proc=2)
    assert data == expected and summary["rows_by_format"] == {"alpaca": len(ALPACA)}


def test_tsv_is_read_as_datasets_reads_it(tmp_path, tiny_models):
    """A .tsv was read as JSON lines (every row invalid_json); datasets reads it as csv with sep="\\t". Written
    by pandas (datasets' to_csv), tabs and line breaks inside a reply and all."""
    import datasets

    rows = ALPACA + [{"instruction": "Indent a line.", "input": "x = 1", "output": "\tx = 1\n\tprint(x)"}]
    model = tiny_models["llama3"]
    expected, _ = tokenize(tmp_path, "jsonl", write_kind(tmp_path, "jsonl", rows), model)
    path = tmp_path / "in.tsv"
    datasets.Dataset.from_list(rows).to_csv(str(path), sep="\t", index=False)
    loaded = datasets.load_dataset(str(tmp_path), data_files=path.name, split="train")
    assert [{**row, "input": row["input"] or ""} for row in loaded] == rows  # pandas reads '' as a null
    data, summary = tokenize(tmp_path, "tsv", str(path), model, num_proc=2)
    assert data == expected and summary["rows_by_format"] == {"alpaca": len(rows)}
    # Compressed, as datasets infers from the name; train.py --data-path takes it for raw rows, not tokenized ones.
    compressed = tmp_path / "in.tsv.gz"
    compressed.write_bytes(gzip.compress(path.read_bytes()))
    assert tokenize(tmp_path, "tsv_gz", str(compressed), model)[0] == expected and not is_tokenized(compressed)


def test_compressed_ndjson_shards_in_a_folder_are_read(tmp_path, tiny_models):
    """datasets reads .ndjson as JSON lines, compressed too; a folder of .ndjson.gz shards was 'no data files'."""
    model = tiny_models["chatml"]
    expected, _ = tokenize(tmp_path, "jsonl", write_kind(tmp_path, "jsonl", ROWS), model)
    folder = tmp_path / "shards"
    folder.mkdir()
    for n, start in enumerate(range(0, len(ROWS), 4)):
        (folder / f"train-{n}.ndjson.gz").write_bytes(gzip.compress(
            "".join(json.dumps(row) + "\n" for row in ROWS[start:start + 4]).encode()))
    assert tokenize(tmp_path, "ndjson", str(folder), model)[0] == expected


def test_copied_columns_json_has_no_type_for_are_written_as_strict_json(tmp_path, tiny_models):
    """A timestamp column (WildChat's ``timestamp``, pandas' datetime64) stopped the run with a TypeError
    traceback; a float column's NaN was written as ``NaN``, which pyarrow's JSON reader refuses, so the
    ``datasets`` loader of train.py read the whole file through pandas, in memory."""
    import datetime
    import decimal

    import pyarrow as pa
    import pyarrow.json as paj
    import pyarrow.parquet as pq

    base = {"messages": ROWS[0]["messages"]}
    rows = [{**base, "timestamp": datetime.datetime(2024, 5, 1, 12, 30, tzinfo=datetime.timezone.utc),
             "day": datetime.date(2024, 5, 1), "price": decimal.Decimal("1.50"), "score": float("nan"),
             "scores": [1.0, float("inf")]},
            {**base, "timestamp": None, "day": None, "price": None, "score": 0.5, "scores": []}]
    path = tmp_path / "typed.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    tokenize(tmp_path, "typed", str(path), tiny_models["chatml"])
    output = tmp_path / "out-typed" / "data.jsonl"
    assert paj.read_json(output).num_rows == 2  # strict JSON
    written = [json.loads(line) for line in output.read_text().splitlines()]
    assert [{key: row[key] for key in ("timestamp", "day", "price", "score", "scores")} for row in written] == [
        {"timestamp": "2024-05-01T12:30:00+00:00", "day": "2024-05-01", "price": "1.50", "score": None,
         "scores": [1.0, None]},
        {"timestamp": None, "day": None, "price": None, "score": 0.5, "scores": []}]


def test_table_rows_are_numbered_by_row_and_shards_by_file(tmp_path, tiny_models):
    rows = [{"text": "First document."}, {"text": None}, {"text": "Third document."}]
    folder = tmp_path / "shards"
    folder.mkdir()
    write_table(folder / "a.parquet", rows)
    write_jsonl(folder / "b.jsonl", [{"text": "Fourth."}, {"id": 5}])
    argv = ["--model-name-or-path", str(tiny_models["chatml"]), "--num-proc", "1"]
    summary = main(["--input-file", str(folder), "--output-dir", str(tmp_path / "out"), *argv])
    rejected = [json.loads(line) for line in (tmp_path / "out" / "rejected.jsonl").read_text().splitlines()]
    assert [(r["file"], r.get("row"), r.get("line"), r["reason"]) for r in rejected] == [
        (str(folder / "a.parquet"), 2, None, "missing_content"), (str(folder / "b.jsonl"), None, 2, "missing_messages")]
    assert summary["num_written"] == 3 and summary["input_errors"]["num_rows"] == 2
    single = write_table(tmp_path / "one.parquet", rows)
    with pytest.raises(SystemExit) as err:
        main(["--input-file", str(single), "--output-dir", str(tmp_path / "strict"), "--strict", *argv])
    assert str(err.value) == f"process_data.py: error: {single}: row 2: missing_content: message 0 (pretrain) has no content"


def _hub_repository(root: Path, splits: dict[str, list[dict]]) -> Path:
    """A dataset repository as ``huggingface-cli download`` leaves it: a dataset card with a YAML header
    and no configs, ``data/<split>-0000N-of-0000M.parquet`` shards, git's attributes file."""
    (root / "data").mkdir(parents=True)
    (root / "README.md").write_text("---\nlicense: mit\ntask_categories:\n- text-generation\n---\n# Chat data\n")
    (root / ".gitattributes").write_text("*.parquet filter=lfs diff=lfs merge=lfs -text\n")
    for split, rows in splits.items():
        shards = [rows[:6], rows[6:]] if len(rows) > 6 else [rows]
        for n, shard in enumerate(shards):
            write_table(root / "data" / f"{split}-{n:05d}-of-{len(shards):05d}.parquet", shard)
    return root


def test_a_dataset_repository_folder_reads_only_the_split_asked_for(tmp_path, tiny_models):
    """Every shard of a downloaded repository was read before: its test split trained with the rest."""
    model = tiny_models["qwen25"]
    test_rows = [{"id": 100 + i, "messages": [{"role": "user", "content": f"Held out {i}?"},
                                              {"role": "assistant", "content": "Yes."}]} for i in range(3)]
    repo = str(_hub_repository(tmp_path / "repo", {"train": ROWS, "test": test_rows}))
    expected, _ = tokenize(tmp_path, "jsonl", write_kind(tmp_path, "jsonl", ROWS), model)
    data, summary = tokenize(tmp_path, "repo", repo, model)
    assert data == expected and summary["num_lines"] == len(ROWS)
    assert summary["input"].endswith("(parquet; split train by file names; not read: 1 file(s) of split test)")
    test_expected, _ = tokenize(tmp_path, "test_jsonl", str(write_jsonl(tmp_path / "test.jsonl", test_rows)), model)
    assert tokenize(tmp_path, "repo_test", repo, model, split="test")[0] == test_expected
    with pytest.raises(ValueError, match=r"has no split 'validation' \(--split, train.py's --data-split\): its file names give train, test$"):
        open_input(repo, split="validation")


def test_a_hub_cache_snapshot_of_symlinked_files_is_split_as_well(tmp_path):
    """``huggingface-cli download`` without ``--local-dir``: the snapshot's files link into ``blobs/``."""
    snapshot = tmp_path / "datasets--org--chat" / "snapshots" / "3f2a"
    (snapshot / "data").mkdir(parents=True)
    blobs = tmp_path / "datasets--org--chat" / "blobs"
    blobs.mkdir()
    for split in ("train", "test"):
        write_table(blobs / f"{split}-blob", ROWS[:2])
        (snapshot / "data" / f"{split}-00000-of-00001.parquet").symlink_to(blobs / f"{split}-blob")
    assert open_input(str(snapshot), split="test").files == (snapshot / "data" / "test-00000-of-00001.parquet",)


def test_split_names_of_files_and_folders_are_datasets_own(tmp_path):
    for name in ("names/train.jsonl", "names/dev.jsonl", "names/extra.jsonl", "names/nested/more/train-2.jsonl",
                 "dirs/train/a.jsonl", "dirs/validation/b.jsonl", "dirs/validation/c.jsonl"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(tmp_path / name, ROWS[:1])
    names = tmp_path / "names"
    assert open_input(str(names)).files == (names / "nested/more/train-2.jsonl", names / "train.jsonl")
    validation = open_input(str(names), split="validation")
    assert validation.files == (names / "dev.jsonl",)
    assert validation.note == "split validation by file names; not read: 2 file(s) of split train, 1 file(s) in no split"
    dirs = open_input(str(tmp_path / "dirs"), split="validation")
    assert dirs.files == (tmp_path / "dirs/validation/b.jsonl", tmp_path / "dirs/validation/c.jsonl")
    (tmp_path / "plain" / "a").mkdir(parents=True)
    write_jsonl(tmp_path / "plain" / "b.jsonl", ROWS[:1])
    write_jsonl(tmp_path / "plain" / "a" / "x.jsonl", ROWS[:1])
    assert open_input(str(tmp_path / "plain")).files == (tmp_path / "plain/a/x.jsonl", tmp_path / "plain/b.jsonl")
    with pytest.raises(ValueError, match=r"^'en' \(--subset, train.py's --data-subset\): input folder .* declares no configs"):
        open_input(str(tmp_path / "plain"), subset="en")


def test_readme_configs_choose_the_files_and_subset_picks_one(tmp_path):
    """A multi-config repository (smoltalk's layout): every config's files together would repeat rows."""
    for folder in ("all", "magpie", "code"):
        (tmp_path / "data" / folder).mkdir(parents=True)
        write_table(tmp_path / "data" / folder / "train-00000-of-00001.parquet", ROWS[:2])
    write_table(tmp_path / "data" / "all" / "test-00000-of-00001.parquet", ROWS[2:3])
    card = ("---\nconfigs:\n- config_name: all\n  data_files:\n  - split: train\n    path: data/all/train-*\n"
            "  - split: test\n    path: data/all/test-*\n- config_name: magpie\n  data_files: data/magpie/*.parquet\n"
            "- config_name: code\n  data_dir: data/code\n---\n")
    (tmp_path / "README.md").write_text(card)
    spec = str(tmp_path)
    with pytest.raises(ValueError, match=r"declares configs all, magpie, code in its README.md: pick one \(--subset, train.py's --data-subset\)$"):
        open_input(spec)
    assert open_input(spec, subset="all", split="test").files == (tmp_path / "data/all/test-00000-of-00001.parquet",)
    assert open_input(spec, subset="magpie").files == (tmp_path / "data/magpie/train-00000-of-00001.parquet",)
    assert open_input(spec, subset="code").files == (tmp_path / "data/code/train-00000-of-00001.parquet",)
    with pytest.raises(ValueError, match=r"has no config 'en' \(--subset, train.py's --data-subset\)"):
        open_input(spec, subset="en")
    (tmp_path / "README.md").write_text(card.replace("- config_name: magpie\n", "- config_name: magpie\n  default: true\n"))
    chosen = open_input(spec)
    assert chosen.files == (tmp_path / "data/magpie/train-00000-of-00001.parquet",)
    assert chosen.note == "split train by its README.md's config 'magpie'; not read: 3 file(s) in no split"
    (tmp_path / "README.md").write_text("---\nconfigs:\n- config_name: gone\n  data_files: data/gone/*.parquet\n---\n")
    with pytest.raises(ValueError, match=r"^input folder .*: its README.md's config 'gone' names none of its 4 data "
                                         r"files \(its data_files\)$"):
        open_input(spec)
    (tmp_path / "README.md").write_text("---\nconfigs: [\n  - config_name: all\n---\n")
    with pytest.raises(ValueError, match=r"^cannot read the configs in .*README.md: while parsing a flow node$"):
        open_input(spec)


@pytest.mark.parametrize(("spec", "message"), [
    ("absent/data.jsonl", "input file absent/data.jsonl does not exist"),
    ("empty_folder", "holds no .jsonl"),
    ("shards/*.parquet", "matches no file"),
])
def test_inputs_that_name_nothing_are_refused_in_one_line(tmp_path, monkeypatch, spec, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty_folder").mkdir()
    with pytest.raises(ValueError, match=message):
        open_input(spec)


def test_hub_id_is_loaded_through_load_dataset_with_split_and_subset(tmp_path, tiny_models, monkeypatch):
    """The hub is the boundary: load_dataset is recorded and served from a local parquet file by the
    real ``datasets.load_dataset`` (streaming, as for the hub)."""
    import datasets

    model = tiny_models["qwen25"]
    expected, _ = tokenize(tmp_path, "jsonl", write_kind(tmp_path, "jsonl", ROWS), model)
    local = write_table(tmp_path / "hub.parquet", ROWS)
    real_load_dataset, calls = datasets.load_dataset, []

    def hub(path, name=None, **kwargs):
        calls.append((path, name, kwargs))
        return real_load_dataset("parquet", data_files=str(local), split="train", streaming=kwargs["streaming"])

    monkeypatch.setattr(datasets, "load_dataset", hub)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)  # online, whatever the shell says
    monkeypatch.chdir(tmp_path)  # "org/chat-data" is no local path here
    data, summary = tokenize(tmp_path, "hub", "org/chat-data", model, split="validation", subset="en")
    assert data == expected
    assert calls and all(call == ("org/chat-data", "en", {"split": "validation", "streaming": True}) for call in calls)
    assert summary["input"] == "hub dataset org/chat-data (split validation, subset en)"


def test_unreachable_hub_is_refused_in_one_line(tmp_path, tiny_models, monkeypatch):
    import datasets

    def unreachable(path, name=None, **kwargs):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (ConnectTimeout)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)  # online, whatever the shell says
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^input org/chat-data is no local path and loading it as a hub dataset "
                                         r"failed: Couldn't reach 'org/chat-data' on the Hub \(ConnectTimeout\)"):
        tokenize(tmp_path, "hub", "org/chat-data", tiny_models["chatml"])


def _offline_argv(tmp_path: Path, model: Path, *extra: str) -> list[str]:
    return ["--input-file", "org/chat-data", "--output-dir", str(tmp_path / "out"), "--model-name-or-path", str(model),
            "--num-proc", "1", "--num-printed-samples", "0", *extra]


def test_offline_a_hub_id_reads_the_hub_caches_copy(tmp_path, tiny_models, monkeypatch, capfd):
    """What ``huggingface-cli download --repo-type dataset org/chat-data`` leaves in the cache, files linked
    into blobs/: datasets.load_dataset cannot load it offline, process_data.py reads it as a dataset folder.
    The refusal is a real process with the shell's HF_HOME and HF_HUB_OFFLINE (read when the libraries import);
    the read is ``main`` in this one, with what the libraries made of those two."""
    import datasets
    from huggingface_hub import constants

    model = tiny_models["qwen25"]
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, str(ROOT / "process_data.py"), *_offline_argv(tmp_path, model)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "process_data.py: error: input org/chat-data: the hub is off (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE) and "
        f"{tmp_path / 'hf_home' / 'hub'} holds no copy of it; download it where the hub is reachable "
        "(huggingface-cli download --repo-type dataset org/chat-data) or pass a local path")

    cache = tmp_path / "hf_home" / "hub" / "datasets--org--chat-data"
    repo = _hub_repository(tmp_path / "repo", {"train": ROWS, "test": ROWS[:2]})
    (cache / "refs").mkdir(parents=True)
    (cache / "refs" / "main").write_text("3f2a")
    (cache / "blobs").mkdir()
    for file in sorted(repo.rglob("*.parquet")):
        (cache / "blobs" / file.name).write_bytes(file.read_bytes())
        link = cache / "snapshots" / "3f2a" / file.relative_to(repo)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(cache / "blobs" / file.name)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf_home" / "hub"))
    monkeypatch.chdir(tmp_path)  # "org/chat-data" is no local path here
    capfd.readouterr()
    main(_offline_argv(tmp_path, model, "--overwrite"))  # returns: exit status 0
    assert "the hub cache's copy of org/chat-data, offline; split train by file names; not read: 1 file(s) of " \
           "split test" in capfd.readouterr().err
    expected, _ = tokenize(tmp_path, "jsonl", write_kind(tmp_path, "jsonl", ROWS), model)
    assert (tmp_path / "out" / "data.jsonl").read_bytes() == expected


@pytest.mark.parametrize("kind", ["json_array", "json_object", "jsonl_gz", "jsonl_zst"])
def test_readers_stream(tmp_path, kind):
    """Memory stays flat: reading a 12 MB input in chunks peaks far below its size."""
    text = "x" * 200
    rows = [{"id": i, "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": text}]}
            for i in range(25_000)]
    spec = write_kind(tmp_path, kind, rows)
    del rows
    num_rows = 0
    tracemalloc.start()
    try:
        for chunk in open_input(spec).chunks(64):
            assert len(chunk.rows) <= 64
            num_rows += len(chunk.rows)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert num_rows == 25_000 and peak < 6_000_000, peak


def test_parquet_reader_holds_a_row_group_not_the_file(tmp_path):
    """pyarrow's own allocations while the chunks of a 30-row-group parquet file are read stay far below
    the file's size (its default pre_buffer kept every column chunk read: memory grew with the file,
    0.23 GB at 1M ShareGPT rows)."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    table = pa.Table.from_pylist([{"conversations": [{"from": "human", "value": f"{i} {rng.randbytes(100).hex()}"},
                                                     {"from": "gpt", "value": rng.randbytes(100).hex()}]}
                                  for i in range(60_000)])
    path = tmp_path / "in.parquet"
    pq.write_table(table, path, row_group_size=2_000)
    del table
    peak = 0
    for chunk in open_input(str(path)).chunks(256):
        assert len(chunk.rows) <= 256
        peak = max(peak, pa.total_allocated_bytes())
    assert peak < path.stat().st_size / 5, (peak, path.stat().st_size)


def test_json_array_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n  {"text": "a"},\n  {"text": "b"\n  {"text": "c"}\n]\n')
    with pytest.raises(ValueError, match=r"bad.json:3: invalid JSON in the array"):
        list(open_input(str(path)).chunks(10))


# ----------------------------------------------------------------------------
# Text files: rows of text, as datasets' text builder makes them

CORPUS = ("The first paragraph's first line.\nIts second line.\n\nA paragraph of one line.\n\n"
          "Ünïcode in the last paragraph,\nwhich ends the file with a line break.\n")


@pytest.mark.parametrize("sample_by", ["line", "paragraph", "document"])
@pytest.mark.parametrize("suffix", [".txt", ".txt.gz", "windows.txt"])
def test_a_text_file_gives_datasets_text_rows(tmp_path, tiny_models, sample_by, suffix):
    """Each line, paragraph or the whole file is one text row, as ``load_dataset("text", sample_by=...)``
    reads it, except that blank lines are no rows and a row does not end with the file's line break.
    Windows line breaks inside a paragraph were kept as \\r\\n, where datasets reads \\n."""
    import datasets

    content = (CORPUS.replace("\n", "\r\n") if suffix.startswith("windows") else CORPUS).encode()
    plain = tmp_path / "corpus.txt"
    plain.write_bytes(content)
    path = tmp_path / f"corpus{suffix}"
    if suffix == ".txt.gz":
        path.write_bytes(gzip.compress(content))
    elif suffix != ".txt":
        path = plain
    theirs = datasets.load_dataset("text", data_files=str(plain), sample_by=sample_by, split="train",
                                   cache_dir=str(tmp_path / "hf"))["text"]
    rows = [{"text": text.removesuffix("\n")} for text in theirs if text.strip()]
    model = tiny_models["llama3"]
    expected, _ = tokenize(tmp_path, "jsonl", write_kind(tmp_path, "jsonl", rows), model)
    data, summary = tokenize(tmp_path, "text", str(path), model, text_sample_by=sample_by)
    assert data == expected and summary["rows_by_format"] == {"text": len(rows)}
    assert len(rows) == {"line": 5, "paragraph": 3, "document": 1}[sample_by] and not summary["num_rejected"]


def test_a_text_files_bad_utf8_is_one_bad_row_and_json_under_a_txt_name_stays_json(tmp_path, tiny_models):
    model = tiny_models["llama3"]
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"Good line one.\n\xff\xfe not UTF-8\nGood line three.\n")
    data, summary = tokenize(tmp_path, "bad", str(path), model)
    rejected = [json.loads(line) for line in (tmp_path / "out-bad" / "rejected.jsonl").read_text().splitlines()]
    assert len(data.splitlines()) == 2 and [(r["line"], r["reason"]) for r in rejected] == [(2, "invalid_utf8")]
    bracket = tmp_path / "notes.txt"  # text that opens with a bracket is text
    bracket.write_text("[1] Introduction\nText.\n")
    assert tokenize(tmp_path, "bracket", str(bracket), model)[1]["num_written"] == 2
    # JSON lines and a JSON array named .txt were read as JSON before .txt was a kind: still are.
    expected, _ = tokenize(tmp_path, "jsonl", write_kind(tmp_path, "jsonl", ROWS), model)
    for name, text in (("lines", "".join(json.dumps(row) + "\n" for row in ROWS)), ("array", json.dumps(ROWS))):
        (tmp_path / f"{name}.txt").write_text(text)
        assert tokenize(tmp_path, name, str(tmp_path / f"{name}.txt"), model)[0] == expected


def test_a_text_file_beside_data_files_is_no_data(tmp_path):
    """As datasets reads a folder as its most common kind: a LICENSE.txt beside parquet shards is left out
    (and counted), a folder of text files is read."""
    folder = tmp_path / "repo"
    folder.mkdir()
    write_table(folder / "part-0.parquet", ROWS[:3])
    (folder / "LICENSE.txt").write_text("MIT License\n")
    source = open_input(str(folder))
    assert source.files == (folder / "part-0.parquet",) and "1 file(s) in no split" in source.describe()
    texts = tmp_path / "texts"
    texts.mkdir()
    for name in ("a.txt", "b.txt"):
        (texts / name).write_text(f"{name} line\n")
    rows = [row for chunk in open_input(str(texts)).chunks(8) for row in chunk.rows]
    assert rows == [{"text": b"a.txt line"}, {"text": b"b.txt line"}]


@pytest.mark.parametrize("sample_by", ["line", "paragraph"])
def test_a_text_file_streams(tmp_path, sample_by):
    path = tmp_path / "corpus.txt"
    with path.open("w") as f:
        for i in range(25_000):
            f.write(f"{i} " + "y" * 400 + ("\n\n" if i % 5 == 4 else "\n"))
    num_rows = 0
    tracemalloc.start()
    try:
        for chunk in open_input(str(path), text_sample_by=sample_by).chunks(64):
            num_rows += len(chunk.rows)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert num_rows == {"line": 25_000, "paragraph": 5_000}[sample_by] and peak < 6_000_000, peak


# ----------------------------------------------------------------------------
# Files as Windows tools and spreadsheets write them: UTF-16 and UTF-32, CSV records over many lines,
# malformed records and cells in another encoding

# name -> (byte order mark, codec): Python's "utf-16" and "utf-32" codecs write the little-endian ones.
WIDE = {"utf-16-le": (b"\xff\xfe", "utf-16-le"), "utf-16-be": (b"\xfe\xff", "utf-16-be"),
        "utf-32-le": (b"\xff\xfe\x00\x00", "utf-32-le")}


def _read_rows(spec: str) -> list[tuple[str, int, object]]:
    return [(chunk.unit, number, row) for chunk in open_input(spec).chunks(4)
            for number, row in zip(chunk.numbers, chunk.rows)]


def _wide_copy(path: Path, encoding: str, compress=None) -> Path:
    bom, codec = WIDE[encoding]
    data = bom + path.read_bytes().decode("utf-8").encode(codec)
    wide = path.with_name(f"{encoding}-{path.name}")
    wide.write_bytes(compress(data) if compress else data)
    return wide


@pytest.mark.parametrize("encoding", WIDE)
@pytest.mark.parametrize("kind", ["jsonl", "json_array", "jsonl_gz", "csv", "text"])
def test_a_utf16_or_utf32_file_reads_as_its_utf8_twin(tmp_path, kind, encoding):
    """Windows PowerShell 5 writes UTF-16 with a byte order mark (``>`` and ``Out-File``): its lines used to be
    cut at the first byte of each '\\n', and every row after the first was lost or garbled."""
    rows = [{"instruction": f"Traduis «{i}» 🚀", "input": "", "output": f"Réponse\r\nsur deux lignes {i}"}
            for i in range(9)]
    if kind == "text":
        path = tmp_path / "corpus.txt"
        path.write_text(CORPUS, encoding="utf-8")
    elif kind == "csv":
        path = Path(write_kind(tmp_path, kind, rows))
    else:  # the characters themselves, not JSON's \u escapes
        path = tmp_path / ("in.json" if kind == "json_array" else "in.jsonl")
        path.write_text(json.dumps(rows, ensure_ascii=False, indent=1) if kind == "json_array" else
                        "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))  # as Windows writes lines
    wide = _wide_copy(path, encoding, gzip.compress if kind == "jsonl_gz" else None)
    if kind == "jsonl_gz":
        wide = wide.rename(wide.with_name(wide.name + ".gz"))
    expected = _read_rows(str(path))
    assert _read_rows(str(wide)) == expected and len(expected) == (5 if kind == "text" else len(rows))


def test_a_powershell_utf16_file_gives_the_tokens_of_its_utf8_twin_and_a_lone_surrogate_is_one_bad_row(
        tmp_path, tiny_models):
    model = tiny_models["qwen25"]
    path = Path(write_kind(tmp_path, "jsonl", ROWS))
    expected, _ = tokenize(tmp_path, "utf8", str(path), model)
    wide = path.with_name("powershell.jsonl")
    wide.write_bytes(b"\xff\xfe" + path.read_text().replace("\n", "\r\n").encode("utf-16-le"))
    data, summary = tokenize(tmp_path, "wide", str(wide), model, num_proc=2)
    assert data == expected and summary["num_lines"] == len(ROWS)
    # An unpaired surrogate (UTF-16 that JavaScript strings can hold) spoils its row only.
    lines = wide.read_bytes()[2:].decode("utf-16-le").split("\r\n")
    lines[3] = lines[3].replace("plus", "plus\ud800")
    wide.write_bytes(b"\xff\xfe" + "\r\n".join(lines).encode("utf-16-le", "surrogatepass"))
    data, summary = tokenize(tmp_path, "surrogate", str(wide), model)
    rejected = [json.loads(line) for line in (tmp_path / "out-surrogate" / "rejected.jsonl").read_text().splitlines()]
    assert [(r["line"], r["reason"]) for r in rejected] == [(4, "lone_surrogate")]
    assert data.splitlines() == expected.splitlines()[:3] + expected.splitlines()[4:]


def test_csv_cells_over_many_lines_past_the_first_block(tmp_path):
    """A reply with code spans lines. pyarrow cut the file at line breaks and stopped, past its first
    1 MiB block, with "CSV parser got out of sync with chunker": no CSV of such rows over 1 MiB was read."""
    import csv

    rows = [{"instruction": f'Write "f{i}", then explain it, briefly.', "input": "",
             "output": "```python\ndef f():\n" + "".join(f"    x{j} = {j}\n" for j in range(i % 40)) + "```\nDone."}
            for i in range(6000)]
    path = tmp_path / "code.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    assert path.stat().st_size > 2**20  # pyarrow reads 1 MiB blocks
    assert [row for _, _, row in _read_rows(str(path))] == rows


def test_a_malformed_csv_record_or_a_cell_not_in_utf8_is_one_bad_row_in_its_place(tmp_path, tiny_models):
    """Each used to stop the run with pyarrow's error, which named neither the file nor the row."""
    model = tiny_models["llama3"]
    expected, _ = tokenize(tmp_path, "jsonl", write_kind(tmp_path, "jsonl", ALPACA[:4]), model)
    path = tmp_path / "sheet.csv"
    path.write_bytes(b"instruction,input,output\r\n"
                     b"Double 0.,0,0\r\n"
                     b"one,two,three,four\r\n"       # row 2: a cell too many
                     b"Double 1.,,2\r\n"
                     b"\"Caf\xe9\",,cp1252\r\n"      # row 4: Excel's 'CSV' saves Windows-1252
                     b"Double 2.,2,4\r\n"
                     b"alone\r\n"                    # row 6: cells too few
                     b"Double 3.,,6\r\n")
    data, summary = tokenize(tmp_path, "csv", str(path), model, num_proc=2)
    rejected = [json.loads(line) for line in (tmp_path / "out-csv" / "rejected.jsonl").read_text().splitlines()]
    assert data == expected and summary["num_lines"] == 7
    assert [(r["row"], r["reason"], r["detail"]) for r in rejected] == [
        (2, "invalid_csv_row", "expected 3 cells, got 4"),
        (4, "invalid_utf8", "column 'instruction' is not UTF-8 (unexpected end of data at byte 3 of the cell); "
                            "save the file as UTF-8"),
        (6, "invalid_csv_row", "expected 3 cells, got 1")]
    argv = ["--input-file", str(path), "--model-name-or-path", str(model), "--num-proc", "1"]
    with pytest.raises(SystemExit) as err:
        main([*argv, "--output-dir", str(tmp_path / "strict"), "--strict"])
    assert str(err.value) == f"process_data.py: error: {path}: row 2: invalid_csv_row: expected 3 cells, got 4"


def test_a_json_line_or_array_not_in_utf8_is_named(tmp_path, tiny_models):
    model = tiny_models["llama3"]
    lines = tmp_path / "latin.jsonl"
    lines.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    tokenize(tmp_path, "lines", str(lines), model)
    rejected = [json.loads(line) for line in (tmp_path / "out-lines" / "rejected.jsonl").read_text().splitlines()]
    assert [(r["line"], r["reason"]) for r in rejected] == [(2, "invalid_utf8")]
    array = tmp_path / "latin.json"
    array.write_bytes(b'[{"text": "caf\xe9"}]')
    with pytest.raises(ValueError, match=r"^\S+latin.json is not UTF-8 \(invalid continuation byte: b'\\xe9'\): "
                                         r"save it as UTF-8$"):
        _read_rows(str(array))
    cut = tmp_path / "cut.jsonl"  # a UTF-16 file cut in the middle of a character
    cut.write_bytes(b"\xff\xfe" + '{"text": "a"}\n'.encode("utf-16-le")[:-1])
    with pytest.raises(ValueError, match=r"cut.jsonl opens with a UTF-16 byte order mark but is not UTF-16 "
                                         r"\(truncated data\): save it as UTF-8$"):
        _read_rows(str(cut))


def test_a_json_object_of_splits_gives_the_split_asked_for_and_an_unclear_one_is_refused(tmp_path, tiny_models):
    """``{"train": [...], "test": [...]}``, pretty-printed, was read as JSON lines: every line a bad row, then
    "no row of an accepted format". The rows are the member --split names; without one, the one list of rows."""
    model = tiny_models["llama3"]
    path = tmp_path / "splits.json"
    path.write_text(json.dumps({"train": ALPACA[:4], "test": ALPACA[4:]}, indent=2))
    for split, rows in (("train", ALPACA[:4]), ("test", ALPACA[4:])):
        expected, _ = tokenize(tmp_path, f"jsonl-{split}", write_kind(tmp_path, "jsonl", rows), model)
        assert tokenize(tmp_path, split, str(path), model, split=split)[0] == expected
    assert open_input(str(path)).describe() == f"{path} (json; the rows under 'train' ({SPLIT_FLAG}))"
    assert not is_tokenized(path)  # train.py tokenizes it (every line of it had been no JSON: "tokenized")
    path.write_text(json.dumps({"a": ALPACA[:4], "b": ALPACA[4:], "meta": {"n": 7}}, indent=2))
    with pytest.raises(ValueError, match=r"^\S+splits.json holds one JSON object with several lists of rows, "
                                         r"'a' \(4 rows\), 'b' \(3 rows\), and none is named 'train': choose one"):
        _read_rows(str(path))
    path.write_text(json.dumps({"version": "1.0", "count": 7}, indent=2))
    with pytest.raises(ValueError, match="holds one JSON object, not rows, and none of its members is a list of rows"):
        _read_rows(str(path))
    # JSON lines whose first row is cut short stay JSON lines: that row is one bad row.
    lines = tmp_path / "lines.jsonl"
    lines.write_text('{"instruction": "cut\n' + "".join(json.dumps(row) + "\n" for row in ALPACA))
    assert [row for _, _, row in _read_rows(str(lines))][1:] == [json.dumps(row).encode() + b"\n" for row in ALPACA]
