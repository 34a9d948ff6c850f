"""``train.py --data-path`` on untokenized data: tokenized once by rank 0, into a cache under ``--output-dir``.

    torchrun --nproc-per-node=2 train.py --data-path data/chat.parquet --output-dir out ...
    # rank 0 runs process_data.py's pipeline once into
    #   out/tokenized_data/chat-<fingerprint>/{data.jsonl,summary.json,rejected.jsonl}
    # and every rank trains on that folder; a rerun or a resume finds it and tokenizes nothing.

A ``--data-path`` source is *tokenized* when its rows carry ``input_ids`` (a ``process_data.py``
output folder or jsonl, judged by its first row); anything else is *raw* input in any format
``process_data.py`` reads (``data/sources.py``, ``data/formats.py``).

The cache folder is named by a fingerprint of everything that decides its bytes:

* the input's content (every file's bytes, streamed through xxh3-128, with its name relative to
  the input), so an edited file makes a new cache and a touched one does not;
* the tokenizer as loaded (its serialised Rust tokenizer, special tokens) and the chat template
  used (``--chat-template``'s text or the tokenizer's own);
* the options: ``--max-sample-num-tokens``, ``--end-of-turn-token``, ``--mask-reasoning``,
  ``--input-format``, ``--columns``, the split and subset (``--data-split``, ``--data-subset``),
  ``--text-sample-by``;
* the code that turns rows into tokens and labels (the source of ``process_data.py``,
  ``chat_masking.py``, ``formats.py``, ``sources.py`` of ``minitrainer/data/``) and the transformers
  and tokenizers versions that render and encode: a fix to the masking never trains on labels the old code made.
  The cost of that choice is a re-tokenization after an upgrade, never a stale cache.

What only judges the data (``--allow-audit-failures``) is left out: changing it reuses the cache.
Each folder records those parts in ``fingerprint.json``, so a run that makes a new folder says in one line
which part changed since the newest earlier folder of the same input name (``why_not_reused``).
``process_data.py`` writes ``summary.json`` last, under a temporary name renamed when complete: a cache
folder with a summary is whole, and one without (a killed run) is tokenized again.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from minitrainer.common.log import logger
from minitrainer.data.mix import data_paths
from minitrainer.data.sources import data_files, held_out_split, is_table, is_text, json_document, open_binary

CACHE_FOLDER = "tokenized_data"
_BLOCK = 1 << 22


def is_tokenized(path: str | Path) -> bool:
    """Whether ``--data-path`` source ``path`` holds tokenized rows (``input_ids``), judged by its first row.

    A folder counts when it has ``data.jsonl`` or exactly one ``*.jsonl`` whose first row is tokenized
    (``sampler.resolve_data_file``'s choice). A line that is no JSON leaves the judgement to the next
    one (raw input may hold bad rows); a file of nothing but such lines goes to the tokenized reader,
    whose error names the first.
    """
    path = Path(path)
    if path.is_dir():
        named = path / "data.jsonl"
        candidates = [named] if named.is_file() else data_files(path)
        if not candidates and (path / "rejected.jsonl").is_file():
            return True  # the tokenized reader's refusal says why there is no data (sampler.resolve_data_file)
        if len(candidates) != 1:
            return False
        path = candidates[0]
    if not path.is_file() or is_table(path) or is_text(path) or json_document(path):
        return False  # a table, text, or one .json array or object of raw rows
    with open_binary(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                continue
            # A preference file's rows (process_data's pairs) hold each side's ids instead.
            return isinstance(row, dict) and ("input_ids" in row or "chosen_input_ids" in row)
    return True


def validation_split(config, source: str) -> str:
    """The split raw validation source ``source`` is read as: ``--validation-data-split``, else the held-out
    split of a dataset folder (``validation``, else ``test``), else ``--data-split``.

    Raises:
        ValueError: the last choice would validate on the rows a ``--data-path`` folder trains on.
    """
    if config.validation_data_split is not None:
        return config.validation_data_split
    held_out = held_out_split(source, config.data_subset)
    if held_out is not None:
        return held_out
    if Path(source).is_dir() and any(Path(path).resolve() == Path(source).resolve()
                                     for path in data_paths(config.data_path)):
        raise ValueError(f"--validation-data-path {source} has no validation or test split, so it would validate on "
                         f"the rows --data-path trains on (split {config.data_split}); name a held-out split with "
                         "--validation-data-split, or hold rows out with --validation-split")
    return config.data_split


def _hash_file(hasher, path: Path) -> None:
    with path.open("rb") as f:
        while block := f.read(_BLOCK):
            hasher.update(block)


def _input_files(source) -> list[Path]:
    """The files whose bytes are the input: those ``sources`` reads (a folder's files of the split
    read, not what else lies there), or every file of a ``save_to_disk`` folder."""
    if source.kind == "files":
        return list(source.files)
    return sorted(p for p in Path(source.spec).rglob("*") if p.is_file() and not p.name.startswith("."))


FINGERPRINT_FILE = "fingerprint.json"
"""What a cache folder was made from (``fingerprint_parts``): a later run that makes another says which part
changed."""
PART_NAMES = {"input": "input content", "tokenizer": "tokenizer or chat template", "options": "tokenizing options",
              "code": "tokenizing code", "versions": "transformers or tokenizers version"}


def fingerprint_parts(config, source, tokenizer, chat_template: str | None) -> dict:
    """What decides a cache's bytes (module docstring), each part digested on its own.

    Args:
        config: the tokenizing settings (``process_data.ProcessDataConfig``).
        source: its ``input_file`` opened (``sources.Input``), a local file, folder or glob.
        tokenizer: the loaded tokenizer (a fast one: its Rust serialisation is hashed).
        chat_template: the template the rows are rendered with (``--chat-template``'s text or the tokenizer's).

    Returns:
        ``{"input", "tokenizer", "code": 32 hex digits, "options": {flag: value}, "versions": [...]}``.
    """
    import tokenizers
    import transformers
    import xxhash

    from minitrainer.data import chat_masking, formats, process_data, sources

    content = xxhash.xxh3_128()
    root = Path(config.input_file)
    for path in _input_files(source):
        name = str(path.relative_to(root)) if path != root and path.is_relative_to(root) else path.name
        content.update(f"\0file {name}\0".encode())
        _hash_file(content, path)
    encoding = xxhash.xxh3_128(json.dumps({
        "tokenizer": tokenizer.backend_tokenizer.to_str(),
        "special": [tokenizer.eos_token, tokenizer.bos_token, tokenizer.pad_token],
        "chat_template": chat_template,
    }, sort_keys=True).encode())
    code = xxhash.xxh3_128()
    for module in (process_data, chat_masking, formats, sources):  # the code that turns rows into labels
        _hash_file(code, Path(module.__file__))
    options = {name: getattr(config, name) for name in ("max_sample_num_tokens", "split_long_text",
                                                        "end_of_turn_token", "mask_reasoning", "input_format",
                                                        "columns", "sharegpt_roles", "split", "subset",
                                                        "text_sample_by")}
    return {"input": content.hexdigest(), "tokenizer": encoding.hexdigest(), "code": code.hexdigest(),
            "options": json.loads(json.dumps(options, default=str)),
            "versions": [transformers.__version__, tokenizers.__version__]}


def fingerprint(parts: dict) -> str:
    """The cache key of ``fingerprint_parts``: 32 hex digits."""
    import xxhash

    return xxhash.xxh3_128(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def why_not_reused(folder: Path, parts: dict) -> str | None:
    """Why the newest whole cache of the same input name, beside ``folder``, is not ``parts``'s: the parts
    that differ, or that it predates recorded fingerprints (a cache made before the minitrainer package
    hashed the tokenizing code under other file names). None when there is no such cache."""
    stem = folder.name.rsplit("-", 1)[0]
    earlier = sorted((path for path in folder.parent.glob(f"{stem}-*") if path.name.rsplit("-", 1)[0] == stem
                      and path != folder and (path / "summary.json").is_file()),
                     key=lambda path: (path / "summary.json").stat().st_mtime)
    if not earlier:
        return None
    newest = earlier[-1]
    try:
        recorded = json.loads((newest / FINGERPRINT_FILE).read_text())
    except (OSError, ValueError):
        return (f"{newest} predates the fingerprints caches record (made before the tokenizing code moved into "
                "the minitrainer package, or by hand), so it cannot be told to match")
    changed = [PART_NAMES[name] for name in PART_NAMES if recorded.get(name) != parts[name]]
    options = [f"--{name.replace('_', '-')}" for name, value in parts["options"].items()
               if recorded.get("options", {}).get(name) != value]
    return (f"{newest} was made with other {', '.join(changed) or 'settings'}"
            + (f" ({', '.join(options)})" if options else ""))


def cache_folder(cache_root: str | Path, input_file: str, key: str) -> Path:
    """``<cache_root>/<input name>-<16 digits of the key>``: readable, and one per key."""
    stem = Path(input_file).name.split(".")[0] or "data"
    return Path(cache_root) / f"{stem}-{key[:16]}"


def tokenize_once(config) -> Path:
    """Rank 0: the cache folder of raw input ``config.input_file``, tokenized now unless a whole one exists.

    Args:
        config: a ``process_data.ProcessDataConfig`` whose ``output_dir`` is the cache root
            (``<--output-dir>/tokenized_data``); the data goes into a folder of it named by the fingerprint.

    Returns:
        The folder (``data.jsonl``, ``summary.json``, ``rejected.jsonl``).

    Raises:
        ValueError: one line, as ``process_data.py`` would stop (an unreadable input, no sample written). A
            failed label audit does not raise here: the dataset is kept, with its verdict in
            ``summary.json``, for the training-time gate (``selfcheck.audit_refusal``) to judge.
    """
    from minitrainer.data import process_data

    tokenizer, source, _ = process_data.check_run(config, process_data.OutputPaths.from_config(config))
    parts = fingerprint_parts(config, source, tokenizer, tokenizer.chat_template)
    key = fingerprint(parts)
    folder = cache_folder(config.output_dir, config.input_file, key)
    if (folder / "summary.json").is_file():
        summary = json.loads((folder / "summary.json").read_text())
        if summary.get("kind") == "preference":
            what = f"{summary['num_pairs']} preference pairs"
        else:
            what = (f"{summary['num_written']} samples ({summary['num_chat']} chat, "
                    f"{summary.get('num_prompt_completion', 0)} prompt/completion, {summary['num_pretrain']} pretrain)")
        logger.info("tokenized data: reusing %s (fingerprint %s of the input, tokenizer, template and options): "
                    "%s, %d tokens, from %s", folder, key[:16], what, summary["num_tokens"], config.input_file)
        return folder
    if (why := why_not_reused(folder, parts)) is not None:
        logger.info("tokenized data: %s: tokenizing %s again into %s (this run does not read the earlier folder; "
                    "remove it when no run needs it)", why, config.input_file, folder)
    else:
        logger.info("tokenized data: %s is raw input; tokenizing it once into %s (fingerprint %s of the input, "
                    "tokenizer, template and options)", config.input_file, folder, key[:16])
    try:
        process_data.process_data(dataclasses.replace(config, output_dir=str(folder), output_file=None,
                                                      overwrite=True))
    except ValueError:
        # A failed audit's verdict is the training-time gate's to give, so the dataset stays; any other
        # stop (nothing written, an unreadable input) is this run's error and leaves no cache behind.
        if not _audit_failed_only(folder / "summary.json"):
            shutil.rmtree(folder, ignore_errors=True)
            raise
    try:  # a report for a later run: the cache is whole without it
        (folder / FINGERPRINT_FILE).write_text(json.dumps(parts, indent=2) + "\n")
    except OSError as err:
        logger.warning("tokenized data: %s not written (%s): a run that tokenizes this input again cannot say "
                       "what changed", folder / FINGERPRINT_FILE, err.strerror or err)
    return folder


def _audit_failed_only(path: Path) -> bool:
    if not path.is_file():
        return False
    summary = json.loads(path.read_text())
    return summary["num_written"] > 0 and not summary["audit"]["passed"]
