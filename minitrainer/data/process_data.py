"""Tokenize chat (or plain text) data into training rows with loss masks.

    TOKENIZERS_PARALLELISM=false python process_data.py \\
        --input-file data/chat.jsonl --output-dir data/chat_tkns \\
        --model-name-or-path Qwen/Qwen2.5-1.5B-Instruct \\
        --max-sample-num-tokens 128000 --num-proc 4

CPU only, no torchrun: tokenization runs in ``--num-proc`` worker processes.
``--output-file data/chat_tkns.jsonl`` (the older form) writes one file instead.
``--config FILE`` reads these flags' values from a YAML or JSON file (``config_files.py``).

Input rows: ``messages``, a list of ``{"role", "content"}`` (roles system,
user, assistant, tool; assistant turns may carry ``tool_calls`` and
``reasoning_content``), or a single ``{"role": "pretrain", "content": ...}``
message. A row's ``tools`` (JSON schemas) is passed to the chat template. Other
top-level fields (an ``id``, a source tag) are copied to the output row
unchanged. ShareGPT ``conversations``, TRL ``prompt``/``completion`` and
``text``, and alpaca ``instruction``/``input``/``output`` rows are recognised
row by row and converted (``data/formats.py``). ``--input-file`` is a JSON lines
file (or ``.json`` array, ``.gz``, ``.zst``, ``.bz2``, ``.xz``), ``.parquet``, ``.arrow``, ``.csv``, ``.tsv``,
``.txt`` (text rows, one per ``--text-sample-by`` line, paragraph or file), a ``save_to_disk``
folder, a folder (its ``--split``, as datasets splits a dataset repository) or glob of such files,
or a hub dataset id (``data/sources.py``).

Preference pairs (a row with ``chosen`` and ``rejected``, whatever else it holds: TRL's
forms, UltraFeedback binarized, Tulu 3, hh-rlhf, Intel/orca_dpo_pairs; docs/preference.md)
make a preference file, decided by its first convertible row; each pair becomes one row of
``chosen_input_ids``, ``chosen_labels``, ``rejected_input_ids``, ``rejected_labels``, ``len``
and ``num_loss_counted_tokens`` (both sides'), each side learned as the prompt/completion row
of its reply, and ``margin`` (a float) when the file's first pair has one (TRL's RewardTrainer's
per-pair margin; every pair must then have a finite one); the input's columns no pair reads are
named once (``columns_not_read``).

Unpaired feedback rows (TRL's ``prompt``, ``completion`` and a bool ``label``, KTO's data) make an
unpaired file, decided the same way; each row is tokenized exactly as its prompt/completion row
without the label, and gains ``desirable``, the label, which is not copied (docs/data.md).

Output, with ``--output-dir D`` (``--output-file F.jsonl``: ``F.jsonl``,
``F.summary.json``, ``F.rejected.jsonl``):
  D/data.jsonl      ``input_ids``, ``labels`` (-100 = masked, unshifted),
                    ``len``, ``num_loss_counted_tokens`` + the row's other fields
                    (a preference file: the pair fields above; an unpaired file:
                    ``desirable`` first among the other fields)
  D/rejected.jsonl  ``{"line": N, "reason": ..., "detail": ...}`` per unusable row
                    (``"row"`` for table rows, ``"file"`` when several files)
  D/summary.json    counts by outcome, format and reason, length statistics,
                    tokenizer, arguments and the label audit; written last

A run that writes no row stops with one line (the counts by reason, the first
rejected row) and leaves no ``data.jsonl`` or ``summary.json``: only the
rejected rows' listing, which a rerun replaces.

Bad rows (bad JSON, an unknown shape, a missing field...) are input errors:
counted, listed and skipped; they never stop the run (``--strict`` makes the
first one fatal). The label audit (docs/data.md) judges the masking only: the
run exits non-zero, after writing everything, when a reply's end-of-turn is not
learned or more than ``--max-rejected-fraction`` of the conversations the chat
template was given could not be masked (``--allow-audit-failures`` keeps going).

How replies are found and masked: see ``chat_masking.py``. Output files are
written under temporary names and renamed when complete; ``--num-proc N``
gives byte-identical output for every N.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import errno
import hashlib
import json
import multiprocessing
import os
import random
import signal
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minitrainer.common.cli import config_field, parse_config
from minitrainer.common.refusals import collect_errors
from minitrainer.common.labels import IGNORE_INDEX
from minitrainer.common.leftovers import remove_dead_leftovers, temporary_name
from minitrainer.common.log import logger, setup_logging
from minitrainer.data.chat_masking import ChatEncoder, ChatRow, SampleError
from minitrainer.data.formats import (ACCEPTED, INPUT_FORMATS, MARGIN_COLUMN, parse_columns, parse_sharegpt_roles,
                                      read_pair, read_row, read_unpaired, suggest_columns, unread_system)
from minitrainer.data.sources import Chunk, Input, open_input
from minitrainer.data.tokenizing_flags import tokenizing_field, tokenizing_settings


def _default_num_proc() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass
class ProcessDataConfig:
    input_file: str = config_field(help="input rows: JSON lines (.json array, .gz), .parquet, .arrow, .csv/.tsv, .txt, a "
                                        "folder or glob of them, or a hub dataset id")
    model_name_or_path: str = config_field(help="Hugging Face tokenizer with a chat template (local folder or hub id)")
    output_dir: str | None = config_field(None, help="output folder: data.jsonl, summary.json, rejected.jsonl")
    output_file: str | None = config_field(None, help="single output JSONL (older form); the summary and "
                                                      "rejected files go beside it")
    max_sample_num_tokens: int = tokenizing_field("max_sample_num_tokens")
    split_long_text: bool = tokenizing_field("split_long_text")
    chat_template: str | None = tokenizing_field("chat_template")
    end_of_turn_token: str | None = tokenizing_field("end_of_turn_token")
    mask_reasoning: bool = tokenizing_field("mask_reasoning")
    num_proc: int = config_field(default_factory=_default_num_proc, help="worker processes (default: CPUs)")
    string_for_printing_masks: str = config_field("<|mAsK|>", help="shown in place of masked label tokens "
                                                                    "in the printed examples")
    strict: bool = config_field(False, help="stop with file:line: reason at the first unusable line")
    overwrite: bool = config_field(False, help="replace existing output files")
    num_printed_samples: int = config_field(2, help="random samples printed at the end to eyeball masking")
    seed: int = config_field(42, help="seed for choosing the printed samples")
    chunk_size: int = config_field(256, help="lines per worker task (output is the same for any value)")
    logging_level: str = config_field("INFO", help="DEBUG, INFO, WARNING, ERROR")
    input_format: str = tokenizing_field("input_format")
    columns: str | None = tokenizing_field("columns")
    sharegpt_roles: str | None = tokenizing_field("sharegpt_roles")
    split: str = tokenizing_field("data_split")
    subset: str | None = tokenizing_field("data_subset")
    text_sample_by: str = tokenizing_field("text_sample_by")
    max_rejected_fraction: float = config_field(0.01, help="label audit: fail when more than this fraction of the "
                                                           "conversations cannot be masked by the template")
    allow_audit_failures: bool = config_field(False, help="label audit: write the dataset and exit 0 even when a "
                                                          "rule is broken (a warning instead of an error)")

    def __post_init__(self):
        errors = []
        if (self.output_dir is None) == (self.output_file is None):
            errors.append("give exactly one of --output-dir and --output-file")
        if self.output_file is not None and not self.output_file.endswith(".jsonl"):
            errors.append(f"--output-file must end in .jsonl, got {self.output_file!r}")
        if self.max_sample_num_tokens < 1:
            errors.append(f"--max-sample-num-tokens must be >= 1, got {self.max_sample_num_tokens}")
        elif self.split_long_text and self.max_sample_num_tokens < 2:
            errors.append("--split-long-text needs --max-sample-num-tokens >= 2 "
                          "(a piece of one token predicts nothing)")
        if self.num_proc < 1:
            errors.append(f"--num-proc must be >= 1, got {self.num_proc}")
        if self.chunk_size < 1:
            errors.append(f"--chunk-size must be >= 1, got {self.chunk_size}")
        if self.num_printed_samples < 0:
            errors.append(f"--num-printed-samples must be >= 0, got {self.num_printed_samples}")
        if not self.string_for_printing_masks:
            errors.append("--string-for-printing-masks must not be empty")
        if self.end_of_turn_token == "":
            errors.append("--end-of-turn-token must not be empty")
        if self.input_format not in INPUT_FORMATS:
            errors.append(f"--input-format must be one of {', '.join(INPUT_FORMATS)}, got {self.input_format!r}")
        for parse, value in ((parse_columns, self.columns), (parse_sharegpt_roles, self.sharegpt_roles)):
            try:
                parse(value)
            except ValueError as err:
                errors.append(str(err))
        if not 0.0 <= self.max_rejected_fraction <= 1.0:
            errors.append(f"--max-rejected-fraction must be in [0, 1], got {self.max_rejected_fraction}")
        collect_errors(errors)


@dataclass(frozen=True)
class OutputPaths:
    data: Path
    summary: Path
    rejected: Path

    @classmethod
    def from_config(cls, config: ProcessDataConfig) -> OutputPaths:
        if config.output_dir is not None:
            root = Path(config.output_dir)
            return cls(root / "data.jsonl", root / "summary.json", root / "rejected.jsonl")
        data = Path(config.output_file)
        stem = data.name[: -len(".jsonl")]
        return cls(data, data.with_name(stem + ".summary.json"), data.with_name(stem + ".rejected.jsonl"))

    def all(self) -> tuple[Path, ...]:
        return self.data, self.rejected, self.summary


@dataclass
class ChunkResult:
    """What a worker returns for one chunk of rows; the main process only writes and counts."""

    data: bytes
    rejected: bytes
    row_bytes: list[int]
    lengths: list[int]
    num_loss_counted_tokens: list[int]
    num_pretrain: int
    reasons: Counter  # every rejection, by reason
    first_rejection: str | None  # "file:line: reason: detail"
    audit: ChunkAudit  # the label audit's counts, its findings (rejected by the template or masking) included
    input_errors: ChunkAudit  # rows rejected for their input (bad JSON, shape, content), examples by reason
    formats: Counter  # rows by the format they were read as
    num_split_rows: int = 0  # text rows longer than --max-sample-num-tokens, cut (--split-long-text)
    num_pieces: int = 0  # the samples they were cut into
    num_prompt_completion: int = 0  # plain prompt/completion rows (no template, the prompt masked)
    num_prompt_completion_tokens: int = 0
    num_prompt_completion_loss_tokens: int = 0
    not_read: Counter = dataclasses.field(default_factory=Counter)  # a pair file's columns no side uses: rows
    num_desirable: int = 0  # an unpaired file's rows written, by their label
    num_undesirable: int = 0
    # ShareGPT turns read under a name the format does not define (chatgpt, --sharegpt-roles'), by name
    sharegpt_roles_mapped: Counter = dataclasses.field(default_factory=Counter)


NUM_AUDIT_EXAMPLES = 3  # decoded examples kept per rejection reason and per broken rule
EXAMPLE_CHARS = 400  # an example's text is cut to this many characters


@dataclass
class ChunkAudit:
    """The label audit's counts of one chunk (chat rows only; pretrain rows learn every token, plain
    prompt/completion rows are counted by ``ChunkResult``)."""

    num_chat_tokens: int = 0
    num_chat_loss_tokens: int = 0
    num_replies: int = 0
    num_replies_end_learned: int = 0
    num_replies_marked: int = 0  # shown but not learned, as the row marks them (_TRAINING_MARKS)
    reasons: Counter = dataclasses.field(default_factory=Counter)  # rejected rows by reason
    rules: Counter = dataclasses.field(default_factory=Counter)  # rows by how their replies were located
    # reason (a rejection reason or "reply_end_not_learned") -> [{"line", "detail", "text"}], "file" first when
    # the input has several
    examples: dict[str, list[dict]] = dataclasses.field(default_factory=dict)

    def add_example(self, reason: str, example: dict) -> None:
        kept = self.examples.setdefault(reason, [])
        if len(kept) < NUM_AUDIT_EXAMPLES:
            kept.append(example)

    def merge(self, other: ChunkAudit) -> None:
        self.num_chat_tokens += other.num_chat_tokens
        self.num_chat_loss_tokens += other.num_chat_loss_tokens
        self.num_replies += other.num_replies
        self.num_replies_end_learned += other.num_replies_end_learned
        self.num_replies_marked += other.num_replies_marked
        self.reasons.update(other.reasons)
        self.rules.update(other.rules)
        for reason, examples in other.examples.items():
            for example in examples:
                self.add_example(reason, example)


def _reject(chunk: Chunk, offset: int, error: SampleError, *, named: bool, reasons: Counter, audit: ChunkAudit,
            input_errors: ChunkAudit) -> str:
    """Count one rejected row (in ``reasons`` and the audit or the input errors, with an example) and
    return its ``rejected.jsonl`` line."""
    number = chunk.numbers[offset]
    reasons[error.reason] += 1
    where = {"file": chunk.file} if named else {}
    record = {**where, chunk.unit: number, "reason": error.reason, "detail": error.detail}
    kept = audit if error.audit else input_errors
    kept.reasons[error.reason] += 1
    if len(kept.examples.get(error.reason, ())) < NUM_AUDIT_EXAMPLES:
        raw = chunk.rows[offset]
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else \
            json.dumps(raw, ensure_ascii=False, default=str)
        kept.add_example(error.reason, {**where, chunk.unit: number, "detail": error.detail,
                                        "text": _cut(text.strip())})
    return json.dumps(record, ensure_ascii=False, default=str) + "\n"


def _where(chunk: Chunk, offset: int, error: SampleError) -> str:
    """``file:line: reason: detail``, as --strict stops with."""
    number = chunk.numbers[offset]
    where = f"{chunk.file}:{number}" if chunk.unit == "line" else f"{chunk.file}: row {number}"
    return f"{where}: {error.reason}: {error.detail}"


def _cut(text: str) -> str:
    return text if len(text) <= EXAMPLE_CHARS else text[:EXAMPLE_CHARS] + f"... ({len(text)} chars)"


# ----------------------------------------------------------------------------
# Workers


_ENCODER: ChatEncoder | None = None  # one per worker process, set by _init_worker (the Pool initializer pattern)
_CONFIG: ProcessDataConfig | None = None
_KIND = "sft"
_MARGINS = False  # a pair file whose first pair has a margin (_Scan.has_margin)
KINDS = ("sft", "preference", "unpaired")  # a file's kind: its first convertible row's (_scan)


def _init_worker(config: ProcessDataConfig, chat_template: str | None, end_of_turn_tokens: tuple[str, ...],
                 kind: str = "sft", margins: bool = False) -> None:
    global _ENCODER, _CONFIG, _KIND, _MARGINS
    # Pool.terminate ends its workers with SIGTERM and then waits for them. A Python handler inherited from the
    # run (StopBeforeTraining's) runs only between bytecodes; a worker idle in the pool's queue lock was seen
    # under load to outlive it, and the run hung in that wait. The default action ends a worker in the kernel.
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)
    # N worker processes already use the cores; Rust threads inside each would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tokenizer = load_tokenizer(config.model_name_or_path)
    tokenizer.chat_template = chat_template
    # The main process probed the end-of-turn tokens once: workers take them as given.
    _ENCODER = make_encoder(config, tokenizer, end_of_turn=end_of_turn_tokens)
    _CONFIG = config
    _KIND = kind
    _MARGINS = margins


def make_encoder(config: ProcessDataConfig, tokenizer, *, end_of_turn: str | tuple[str, ...] | None,
                 probe_tools: list[dict] | None = None) -> ChatEncoder:
    """The encoder; ``probe_tools`` (the rows' tools) make tool-only templates renderable when probing."""
    return ChatEncoder(tokenizer, max_sample_num_tokens=config.max_sample_num_tokens, end_of_turn_token=end_of_turn,
                       mask_reasoning=config.mask_reasoning, probe_tools=probe_tools,
                       split_long_text=config.split_long_text)


def _process_chunk(chunk: Chunk) -> ChunkResult:
    assert _ENCODER is not None and _CONFIG is not None, "worker not initialised"
    return encode_chunk(_ENCODER, chunk, config=_CONFIG, kind=_KIND, margins=_MARGINS)


def convert_rows(chunk: Chunk, config: ProcessDataConfig, kind: str = "sft", *,
                 mapped: Counter | None = None, margins: bool = False) -> list[tuple | SampleError]:
    """Each row of the chunk in the ``messages`` format, with the format it was read as, or why it cannot be;
    for ``kind`` ``"preference"``, its ``formats.Pair`` (with its margin when ``margins``); for ``"unpaired"``,
    read by ``formats.read_unpaired``. ``mapped`` counts the ShareGPT turns read under a name the format does
    not define (``formats.read_row``)."""
    columns = parse_columns(config.columns)
    roles = parse_sharegpt_roles(config.sharegpt_roles)
    converted: list[tuple | SampleError] = []
    for raw in chunk.rows:
        try:
            if kind == "preference":
                converted.append(read_pair(raw, input_format=config.input_format, columns=columns,
                                           from_table=chunk.from_table, margins=margins))
            elif kind == "unpaired":
                converted.append(read_unpaired(raw, columns=columns, from_table=chunk.from_table))
            else:
                converted.append(read_row(raw, input_format=config.input_format, columns=columns,
                                          from_table=chunk.from_table, roles=roles, mapped=mapped))
        except SampleError as err:
            converted.append(err)
    return converted


def encode_chunk(encoder: ChatEncoder, chunk: Chunk, *, config: ProcessDataConfig, kind: str = "sft",
                 margins: bool = False) -> ChunkResult:
    """Convert and encode one chunk of rows into output bytes and counts (``margins``: a pair file's, as
    ``encode_pair_chunk``)."""
    if kind == "preference":
        return encode_pair_chunk(encoder, chunk, config=config, margins=margins)
    data, rejected, row_bytes, lengths, num_loss = [], [], [], [], []
    reasons: Counter = Counter()
    formats: Counter = Counter()
    first_rejection = None
    num_pretrain = num_split_rows = num_pieces = 0
    num_prompt_completion = num_prompt_completion_tokens = num_prompt_completion_loss_tokens = 0
    num_desirable = num_undesirable = 0
    audit, input_errors = ChunkAudit(), ChunkAudit()
    mapped: Counter = Counter()
    converted = convert_rows(chunk, config, kind, mapped=mapped)
    encoded = iter(encoder.encode_rows([item[1] for item in converted if not isinstance(item, SampleError)]))
    named = chunk.file != config.input_file  # one of several files: rejected rows and examples say which
    for offset, item in enumerate(converted):
        number = chunk.numbers[offset]
        if isinstance(item, SampleError):
            result = item
            if item.row_format is not None:
                formats[item.row_format] += 1
        else:
            formats[item[0]] += 1
            result = next(encoded)
            if not isinstance(result, SampleError):
                pieces = result.pieces(encoder.max_sample_num_tokens)
                try:
                    lines = [piece.to_json_line(encoder.id_strings) for piece in pieces]
                except SampleError as err:
                    result = err
        if isinstance(result, SampleError):
            rejected.append(_reject(chunk, offset, result, named=named, reasons=reasons, audit=audit,
                                    input_errors=input_errors))
            if first_rejection is None:
                first_rejection = _where(chunk, offset, result)
            continue
        if len(pieces) > 1:
            num_split_rows += 1
            num_pieces += len(pieces)
        for piece, line in zip(pieces, lines):
            data.append(line)
            row_bytes.append(len(line))
            lengths.append(len(piece.input_ids))
            num_loss.append(piece.num_loss_counted_tokens)
        num_pretrain += result.is_pretrain * len(pieces)
        if kind == "unpaired":
            num_desirable += result.extra["desirable"] * len(pieces)
            num_undesirable += (not result.extra["desirable"]) * len(pieces)
        if result.is_prompt_completion:
            num_prompt_completion += len(pieces)
            num_prompt_completion_tokens += len(result.input_ids)
            num_prompt_completion_loss_tokens += result.num_loss_counted_tokens
        elif not result.is_pretrain:
            audit.num_chat_tokens += len(result.input_ids)
            audit.num_chat_loss_tokens += result.num_loss_counted_tokens
            audit.num_replies += result.num_replies
            audit.num_replies_end_learned += result.num_replies_end_learned
            audit.num_replies_marked += result.num_replies_marked
            audit.rules[result.rule] += 1
            if result.num_replies_end_learned < result.num_replies:
                audit.add_example("reply_end_not_learned", {
                    **({"file": chunk.file} if named else {}), chunk.unit: number,
                    "detail": f"{result.num_replies - result.num_replies_end_learned} of {result.num_replies} replies "
                              "have no learned end-of-turn",
                    "text": _cut(render_labels(encoder.tokenizer, result.input_ids, result.labels, "<|mAsK|>"))})
    return ChunkResult(b"".join(data), "".join(rejected).encode("utf-8"), row_bytes, lengths, num_loss,
                       num_pretrain, reasons, first_rejection, audit, input_errors, formats, num_split_rows,
                       num_pieces, num_prompt_completion, num_prompt_completion_tokens,
                       num_prompt_completion_loss_tokens, num_desirable=num_desirable,
                       num_undesirable=num_undesirable, sharegpt_roles_mapped=mapped)


def encode_pair_chunk(encoder: ChatEncoder, chunk: Chunk, *, config: ProcessDataConfig,
                      margins: bool = False) -> ChunkResult:
    """``encode_chunk`` for a preference file: one output row per pair (``PairSample``), ending in its
    ``margin`` when ``margins`` (the file's first pair has one: a pair without a finite one is rejected). The
    audit counts each conversational pair once and both sides' replies; a plain-string pair counts as one
    plain prompt/completion row. The columns a pair does not read are counted (``not_read``)."""
    data, rejected, row_bytes, lengths, num_loss = [], [], [], [], []
    reasons: Counter = Counter()
    formats: Counter = Counter()
    first_rejection = None
    num_plain = num_plain_tokens = num_plain_loss_tokens = 0
    audit, input_errors = ChunkAudit(), ChunkAudit()
    not_read: Counter = Counter()
    converted = convert_rows(chunk, config, kind="preference", margins=margins)
    encoded = iter(encoder.encode_pairs([(item.chosen, item.rejected) for item in converted
                                         if not isinstance(item, SampleError)]))
    named = chunk.file != config.input_file
    for offset, item in enumerate(converted):
        if isinstance(item, SampleError):
            result = item
            if item.row_format is not None:
                formats[item.row_format] += 1
        else:
            formats[item.format] += 1
            not_read.update(item.not_read)
            result = next(encoded)
        if isinstance(result, SampleError):
            rejected.append(_reject(chunk, offset, result, named=named, reasons=reasons, audit=audit,
                                    input_errors=input_errors))
            if first_rejection is None:
                first_rejection = _where(chunk, offset, result)
            continue
        line = result.to_json_line(encoder.id_strings)
        if margins:
            # The margin is the input's, not the tokens': it joins the row last, so the tokens' fields stay
            # byte for byte what the pair gives without it. repr is the shortest text that reads back to the
            # same float64, with a '.' or an exponent, so a JSON reader types the column as float.
            assert line.endswith(b"}\n"), "a pair's row is one JSON object"
            line = line[:-2] + b',"' + MARGIN_COLUMN.encode() + b'":' + repr(item.margin).encode() + b"}\n"
        data.append(line)
        row_bytes.append(len(line))
        lengths.append(result.num_tokens)
        num_loss.append(result.num_loss_counted_tokens)
        if result.chosen.is_prompt_completion:
            num_plain += 1
            num_plain_tokens += result.num_tokens
            num_plain_loss_tokens += result.num_loss_counted_tokens
            continue
        for side in (result.chosen, result.rejected):
            audit.num_chat_tokens += len(side.input_ids)
            audit.num_chat_loss_tokens += side.num_loss_counted_tokens
            audit.num_replies += side.num_replies
            audit.num_replies_end_learned += side.num_replies_end_learned
            audit.num_replies_marked += side.num_replies_marked
        audit.rules[result.chosen.rule] += 1
    return ChunkResult(b"".join(data), "".join(rejected).encode("utf-8"), row_bytes, lengths, num_loss, 0, reasons,
                       first_rejection, audit, input_errors, formats, num_prompt_completion=num_plain,
                       num_prompt_completion_tokens=num_plain_tokens,
                       num_prompt_completion_loss_tokens=num_plain_loss_tokens, not_read=not_read)


# ----------------------------------------------------------------------------
# Main process


def load_tokenizer(model_name_or_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_name_or_path)


_SCAN_ROWS = 1000  # rows read before tokenizing: formats, the rows' tools for the end-of-turn probe
_PROBE_TOOL = [{"type": "function", "function": {"name": "probe_tool", "description": "A tool.", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}}}}]


@dataclass
class _Scan:
    """What the first ``_SCAN_ROWS`` rows show, before any tokenizing."""

    num_rows: int = 0  # non-blank rows
    formats: Counter = dataclasses.field(default_factory=Counter)  # rows of a recognised format
    unknown: list[str] = dataclasses.field(default_factory=list)  # first detail of a row of no accepted format
    tools: list[dict] | None = None  # the first row's tools
    suggestions: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # --columns for the first unknown
    calls_tools: bool = False
    unread_system: Counter = dataclasses.field(default_factory=Counter)  # system-like columns nothing reads
    # "preference" when the first convertible row is a pair, "unpaired" when it is a labelled prompt/completion
    # row, else "sft" (KINDS)
    kind: str | None = None
    first_of_kind: str | None = None  # where the row that made the file a pair or unpaired one stands
    pair_has_messages: bool = False  # the first pair's unread 'messages'
    # The first pair has a 'margin' (under --columns' name): every pair's is read, and must be a number
    has_margin: bool = False
    # The first unknown row is of this kind but does not convert (a pair with no prompt found, a label "true")
    unknown_kind: str | None = None

    @property
    def probe_tools(self) -> list[dict] | None:
        """The rows' tools, or a stand-in schema when rows call tools without one, so the end-of-turn
        probe renders the way the rows will be rendered."""
        return self.tools or (_PROBE_TOOL if self.calls_tools else None)


_SHAPE_REASONS = ("missing_messages", "ambiguous_format", "missing_field")


def _scan(source: Input, config: ProcessDataConfig) -> _Scan:
    scan = _Scan()
    with contextlib.closing(source.chunks(min(config.chunk_size, _SCAN_ROWS))) as chunks:
        for chunk in chunks:
            converted = convert_rows(chunk, config)
            for number, raw, item, pair, feedback in zip(chunk.numbers, chunk.rows, converted,
                                                         _pairs_of(chunk, config, converted),
                                                         _unpaired_of(chunk, config, converted)):
                scan.num_rows += not (isinstance(raw, bytes) and not raw.strip())
                if feedback is not None and scan.kind in (None, "unpaired"):
                    if isinstance(feedback, SampleError):
                        # While the kind is open, a row that does not decide it, and says why no row may.
                        if not scan.unknown:
                            scan.unknown_kind = "unpaired"
                            scan.unknown.append(f"{chunk.file} {chunk.unit} {number}: {feedback.reason}: "
                                                f"{feedback.detail}")
                        continue
                    if scan.kind is None:
                        scan.kind, scan.first_of_kind = "unpaired", f"{chunk.file} {chunk.unit} {number}"
                    item = feedback
                elif pair is not None and not isinstance(pair, SampleError):
                    if scan.kind is None:
                        scan.kind, scan.first_of_kind = "preference", f"{chunk.file} {chunk.unit} {number}"
                        scan.pair_has_messages = "messages" in pair.not_read
                        scan.has_margin = _has_margin(pair, config)
                    scan.formats[pair.format] += 1
                    for side in (pair.chosen, pair.rejected):
                        _scan_tools(scan, side)
                    continue
                if isinstance(item, SampleError) and item.reason == "preference_row" and scan.kind != "sft":
                    # A pair that does not convert: while the kind is open, a shape to suggest --columns for.
                    if not scan.unknown:
                        scan.unknown_kind = "preference"
                        scan.unknown.append(f"{chunk.file} {chunk.unit} {number}: {pair.reason}: {pair.detail}")
                        scan.suggestions = suggest_columns(raw, input_format=config.input_format,
                                                           columns=config.columns, from_table=chunk.from_table)
                    continue
                if isinstance(item, SampleError):
                    if item.row_format is not None:
                        scan.formats[item.row_format] += 1
                    elif item.reason in _SHAPE_REASONS and not scan.unknown:
                        scan.unknown.append(f"{chunk.file} {chunk.unit} {number}: {item.detail}")
                        scan.suggestions = suggest_columns(raw, input_format=config.input_format,
                                                           columns=config.columns, from_table=chunk.from_table)
                    continue
                scan.kind = scan.kind or "sft"
                scan.formats[item[0]] += 1
                if unread := unread_system(*item):
                    scan.unread_system[unread] += 1
                _scan_tools(scan, item[1])
            if scan.num_rows >= _SCAN_ROWS:
                break
    return scan


def _has_margin(pair, config: ProcessDataConfig) -> bool:
    """The pair (read without margins, so its margin column is among those not read) has a ``margin``.

    A key present counts, null or not: a table's column is in every row, so its first row's null must
    be refused (``missing_margin``), not make the whole file one whose margins go unread."""
    columns = parse_columns(config.columns)  # the input's column -> the accepted name
    return any(columns.get(name, name) == MARGIN_COLUMN for name in pair.not_read)


def _pairs_of(chunk: Chunk, config: ProcessDataConfig, converted: list) -> list:
    """``read_pair`` of each row the SFT reader (``converted``) refused as a pair (``preference_row``);
    None for the others."""
    pairs = []
    for raw, item in zip(chunk.rows, converted):
        if not (isinstance(item, SampleError) and item.reason == "preference_row"):
            pairs.append(None)
            continue
        try:
            pairs.append(read_pair(raw, input_format=config.input_format, columns=parse_columns(config.columns),
                                   from_table=chunk.from_table))
        except SampleError as err:
            pairs.append(err)
    return pairs


def _unpaired_of(chunk: Chunk, config: ProcessDataConfig, converted: list) -> list:
    """``read_unpaired`` of each row the SFT reader (``converted``) read as a prompt/completion row with a
    ``label`` (or refused for its label false), when the formats are detected; None for the others."""
    if config.input_format != "auto":  # a format given reads every row as that format's SFT rows
        return [None] * len(converted)
    columns = parse_columns(config.columns)
    found = []
    for raw, item in zip(chunk.rows, converted):
        try:
            found.append(read_unpaired(raw, columns=columns, from_table=chunk.from_table) if _labelled(item) else None)
        except SampleError as err:
            found.append(err)
    return found


def _labelled(item: tuple | SampleError) -> bool:
    """A prompt/completion row with a ``label``, as the SFT reader read it or refused it (its label false)."""
    if isinstance(item, SampleError):
        return item.reason == "undesirable_completion"
    return item[0] == "prompt_completion" and "label" in item[1].fields


def _scan_tools(scan: _Scan, row: ChatRow) -> None:
    messages, tools = row.fields.get("messages"), row.fields.get("tools")
    if isinstance(tools, list) and tools and scan.tools is None:
        scan.tools = tools
    if isinstance(messages, list):
        scan.calls_tools = scan.calls_tools or any(
            isinstance(message, dict) and "tool_calls" in message for message in messages)


def check_run(config: ProcessDataConfig, paths: OutputPaths):
    """Whole-run problems, before any heavy work: raise ValueError with one clear line.

    Returns:
        ``(tokenizer, source, scan)``: the loaded tokenizer, the input and what its first rows show.
    """
    source = open_input(config.input_file, split=config.split, subset=config.subset,
                        text_sample_by=config.text_sample_by)
    scan = _scan(source, config)
    if not scan.num_rows:
        raise ValueError(f"input file {config.input_file} is empty")
    if not scan.formats and scan.unknown_kind == "unpaired":
        raise ValueError(f"no unpaired feedback row that converts in the first {scan.num_rows} rows of "
                         f"{config.input_file} ({scan.unknown[0]})")
    if not scan.formats and scan.unknown:
        accepted = "" if ACCEPTED in scan.unknown[0] else f"; accepted: {ACCEPTED}"
        offers = "; ".join(f"--columns {text} reads it as {fmt}" for text, fmt in scan.suggestions)
        what = "no pair that converts" if scan.unknown_kind == "preference" else "no row of an accepted format"
        raise ValueError(f"{what} in the first {scan.num_rows} rows of {config.input_file} "
                         f"({scan.unknown[0]}){accepted}; --columns maps other column names"
                         + (f": {offers}" if offers else ""))
    if not config.overwrite:
        # The rejected rows' listing alone is what a run that wrote no row left: no dataset to guard.
        kept = paths.all() if paths.data.exists() or paths.summary.exists() else ()
        for path in kept:
            if path.exists() and path.stat().st_size > 0:
                raise ValueError(f"output {path} exists and is not empty; pass --overwrite to replace it")
    if config.output_dir is not None and Path(config.output_dir).exists() and not Path(config.output_dir).is_dir():
        raise ValueError(f"--output-dir {config.output_dir} exists and is not a folder")
    try:
        tokenizer = load_tokenizer(config.model_name_or_path)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot load tokenizer {config.model_name_or_path!r}: {err}") from None
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"tokenizer {config.model_name_or_path!r} has no fast (Rust) backend; offsets are needed")
    if tokenizer.eos_token is None or tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {config.model_name_or_path!r} has no eos_token (ends pretrain rows)")
    if config.chat_template is not None:
        try:
            tokenizer.chat_template = Path(config.chat_template).read_text()
        except OSError as err:
            raise ValueError(f"cannot read --chat-template {config.chat_template}: {err}") from None
    if not tokenizer.chat_template:
        with contextlib.closing(source.chunks(config.chunk_size)) as chunks:
            for chunk in chunks:
                for number, item in zip(chunk.numbers, convert_rows(chunk, config, scan.kind)):
                    messages = None if isinstance(item, SampleError) else item[1].fields["messages"]
                    if (isinstance(messages, list) and messages and isinstance(messages[0], dict)
                            and messages[0].get("role") != "pretrain"):
                        raise ValueError(f"tokenizer {config.model_name_or_path!r} has no chat template, but "
                                         f"{chunk.file}:{number} is a conversation")
    return tokenizer, source, scan


def tokenizing_config(settings: Any, input_file: str, *, output_dir: str, split: str | None = None,
                      **options: Any) -> ProcessDataConfig:
    """These settings for raw ``input_file``, tokenized as a run tokenizes it (``data/cache.py`` writes under
    ``output_dir``): ``settings`` (a ``TrainConfig``, an ``InspectDataConfig``) gives ``model_name_or_path`` and
    the ``tokenizing_flags``; ``split`` replaces ``data_split`` (a validation source's); ``options`` sets other
    fields; the rest are process_data.py's defaults."""
    fields = tokenizing_settings(settings)
    if split:
        fields["split"] = split
    return ProcessDataConfig(input_file=input_file, model_name_or_path=settings.model_name_or_path,
                             output_dir=output_dir, overwrite=True, **fields, **options)

def process_data(config: ProcessDataConfig) -> dict[str, Any]:
    """Tokenize ``config.input_file`` and write the output files.

    Args:
        config: the run's settings.

    Returns:
        The summary (also written to the summary JSON and logged, as the command line logs it): among its
        keys ``num_lines`` (rows read), ``num_written``, ``num_chat``, ``num_prompt_completion``,
        ``num_pretrain``, ``num_rejected`` and ``rejected_by_reason`` (rows dropped, by reason),
        ``num_tokens``, ``num_loss_counted_tokens`` (learned tokens) and ``audit`` (the label audit).

    Raises:
        ValueError: a whole-run problem, or with ``strict`` the first unusable row as ``file:line: reason``.
    """
    if not logger.handlers:
        # Called from Python with logging left unset: log the counts and the audit as the command line does,
        # not only the warnings Python's last-resort handler would show.
        setup_logging(config.logging_level)
    start = time.perf_counter()
    paths = OutputPaths.from_config(config)
    tokenizer, source, scan = check_run(config, paths)
    encoder = make_encoder(config, tokenizer, end_of_turn=config.end_of_turn_token, probe_tools=scan.probe_tools)
    kind = scan.kind or "sft"
    num_rows = source.num_rows()
    num_proc = min(config.num_proc, max(1, -(-num_rows // config.chunk_size))) if num_rows else config.num_proc
    logger.info("tokenizer %s (%s, %d tokens, eos %r), chat template from %s, end of turn %s (%s)",
                config.model_name_or_path, type(tokenizer).__name__, len(tokenizer), tokenizer.eos_token,
                config.chat_template or "the tokenizer", " or ".join(map(repr, encoder.end_of_turn_tokens)),
                "--end-of-turn-token" if config.end_of_turn_token else
                "probed " + ("with the rows' tools" if scan.probe_tools else "without tools") + ", with and without "
                "a system prompt")
    logger.info("input %s: %s rows, %d worker process(es)%s", source.describe(),
                "unknown number of" if num_rows is None else num_rows, num_proc,
                "" if num_proc == config.num_proc else f" (--num-proc {config.num_proc}: fewer chunks than that)")
    logger.info("row format %s in the first %d rows: %s", "detected" if config.input_format == "auto" else
                f"--input-format {config.input_format}", scan.num_rows, _counts(scan.formats) or "none recognised")
    if kind == "preference":
        logger.info("a preference file: its first convertible row (%s) has 'chosen' and 'rejected', which make a "
                    "row a pair whatever else it holds%s; one row per pair, --max-sample-num-tokens bounds both "
                    "sides together%s%s", scan.first_of_kind,
                    " (its 'messages' column is not read; --input-format messages reads the file as SFT rows)"
                    if scan.pair_has_messages else "",
                    "; --split-long-text does not apply to pairs" if config.split_long_text else "",
                    "; it has a 'margin', so every pair keeps its own (a reward model's Bradley-Terry margin) and "
                    "a pair without a finite one is rejected" if scan.has_margin else "")
    elif kind == "unpaired":
        logger.info("an unpaired feedback file (KTO's data): its first convertible row (%s) has 'prompt', "
                    "'completion' and 'label'; each row is tokenized as its prompt/completion row and gains "
                    "'desirable', its label (--input-format prompt_completion reads the file as SFT rows)",
                    scan.first_of_kind)
    for column, count in scan.unread_system.items():
        logger.warning("%d of the first %d rows have no system message and a %r column, which is copied to the "
                       "output, not read: --columns system=%s makes it the system message", count, scan.num_rows,
                       column, column)

    paths.data.parent.mkdir(parents=True, exist_ok=True)
    if config.overwrite:
        # The summary marks a complete dataset: drop the old one before touching anything else.
        paths.summary.unlink(missing_ok=True)
    remove_dead_leftovers(paths.all())
    # Every file is written under a temporary name and renamed once all three are complete (the summary
    # last: it marks a complete dataset), so a full disk or a kill leaves no partial output.
    tmp = {path: temporary_name(path) for path in paths.all()}
    totals = _Totals()
    try:
        # closing(): on --strict's early exit the worker pool is shut down at once, not at garbage collection.
        with open(tmp[paths.data], "wb") as data_f, open(tmp[paths.rejected], "wb") as rejected_f, \
                contextlib.closing(_run_chunks(config, encoder, source, num_proc, num_rows, kind,
                                               scan.has_margin)) as chunks:
            for chunk in chunks:
                if config.strict and chunk.first_rejection is not None:
                    raise ValueError(chunk.first_rejection)
                data_f.write(chunk.data)
                rejected_f.write(chunk.rejected)
                totals.add(chunk)
        summary = _summary(config, tokenizer, encoder, paths, totals, source, time.perf_counter() - start, kind,
                           has_margin=scan.has_margin)
        if summary["num_written"]:
            tmp[paths.summary].write_text(json.dumps(summary, indent=2) + "\n")
            for path in paths.all():
                os.replace(tmp[path], path)
        else:
            # No row: no dataset is left, not even an empty one (train.py would read it as an empty dataset,
            # an --overwrite'n one as the old data). The listing of the rejected rows stays: the refusal names it.
            for path in (paths.data, paths.summary):
                path.unlink(missing_ok=True)
            os.replace(tmp[paths.rejected], paths.rejected)
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise ValueError(_disk_full(err, paths, tmp, totals.num_rows, num_rows)) from None
    finally:
        for tmp_path in tmp.values():
            tmp_path.unlink(missing_ok=True)

    if not summary["num_written"]:
        raise ValueError(f"no {'pair' if kind == 'preference' else 'sample'} written from the {totals.num_rows} "
                         f"row(s) of {config.input_file}; rejected: {_counts(totals.reasons)} (first: "
                         f"{totals.first_rejection}; each listed in {paths.rejected}); no {paths.data.name} or "
                         "summary was left: fix the rows and run again")
    _log_summary(summary)
    _print_samples(config, tokenizer, paths.data, totals, kind)
    _log_audit(summary["audit"], config)
    if summary["audit"]["broken_rules"] and not config.allow_audit_failures:
        raise ValueError(f"label audit failed: {'; '.join(summary['audit']['broken_rules'])} (details in "
                         f"{paths.summary} under 'audit'; --allow-audit-failures keeps the dataset anyway)")
    return summary


def _disk_full(err: OSError, paths: OutputPaths, tmp: dict[Path, Path], num_read: int, num_rows: int | None) -> str:
    """One line for a write that met a full disk (or quota): where, how much was written, what is kept."""
    written = sum(path.stat().st_size for path in tmp.values() if path.exists())
    folder = paths.data.parent
    of = f" of {num_rows}" if num_rows is not None else ""
    return (f"{os.strerror(err.errno).lower()} for the output in {folder}: {written / 1e6:.1f} MB written from "
            f"the first {num_read}{of} input rows before it filled; nothing was kept (the partial files are "
            "removed): free space there or choose another output, then rerun the same command")


def _counts(counter: Counter) -> str:
    return ", ".join(f"{key} {count}" for key, count in counter.most_common())


def _run_chunks(config: ProcessDataConfig, encoder: ChatEncoder, source: Input, num_proc: int, num_rows: int | None,
                kind: str = "sft", margins: bool = False):
    """Yield ChunkResults in input order, with a progress bar and a bounded number of chunks in flight."""
    from tqdm import tqdm

    chunks = source.chunks(config.chunk_size)
    with tqdm(total=num_rows, unit="row", desc="tokenizing", mininterval=1.0, file=sys.stderr, disable=None) as progress, \
            contextlib.closing(chunks):
        if num_proc == 1:
            for chunk in chunks:
                yield encode_chunk(encoder, chunk, config=config, kind=kind, margins=margins)
                progress.update(len(chunk.rows))
            return
        # fork: workers inherit the imported modules instead of importing transformers again.
        context = multiprocessing.get_context("fork")
        with context.Pool(num_proc, initializer=_init_worker,
                          initargs=(config, encoder.chat_template, encoder.end_of_turn_tokens, kind,
                                    margins)) as pool:
            in_flight: deque = deque()
            for chunk in chunks:
                in_flight.append((len(chunk.rows), pool.apply_async(_process_chunk, (chunk,))))
                # Back-pressure: at most 2 chunks per worker are read ahead, so memory stays flat.
                if len(in_flight) >= 2 * num_proc:
                    num, result = in_flight.popleft()
                    yield result.get()
                    progress.update(num)
            while in_flight:
                num, result = in_flight.popleft()
                yield result.get()
                progress.update(num)
            # Every chunk is back: the workers end on the pool's own sentinels, with no signal to deliver
            # (the with block's terminate() remains for a generator closed early or an error).
            pool.close()
            pool.join()


class _Totals:
    """Running counts over chunks; per-row numbers kept in compact arrays (8 bytes a row)."""

    def __init__(self):
        self.lengths = array.array("q")
        self.num_loss = array.array("q")
        self.row_offsets = array.array("q", [0])
        self.reasons: Counter = Counter()
        self.formats: Counter = Counter()
        self.num_rows = 0
        self.num_pretrain = 0
        self.num_prompt_completion = self.num_prompt_completion_tokens = self.num_prompt_completion_loss_tokens = 0
        self.num_split_rows = self.num_pieces = 0
        self.audit = ChunkAudit()
        self.input_errors = ChunkAudit()
        self.not_read: Counter = Counter()
        self.sharegpt_roles_mapped: Counter = Counter()
        self.num_desirable = self.num_undesirable = 0
        self.first_rejection: str | None = None  # "file:line: reason: detail"

    def add(self, chunk: ChunkResult) -> None:
        if self.first_rejection is None:
            self.first_rejection = chunk.first_rejection
        self.lengths.extend(chunk.lengths)
        self.num_loss.extend(chunk.num_loss_counted_tokens)
        for size in chunk.row_bytes:
            self.row_offsets.append(self.row_offsets[-1] + size)
        self.reasons.update(chunk.reasons)
        self.formats.update(chunk.formats)
        self.num_rows += len(chunk.lengths) - chunk.num_pieces + chunk.num_split_rows + sum(chunk.reasons.values())
        self.num_pretrain += chunk.num_pretrain
        self.num_prompt_completion += chunk.num_prompt_completion
        self.num_prompt_completion_tokens += chunk.num_prompt_completion_tokens
        self.num_prompt_completion_loss_tokens += chunk.num_prompt_completion_loss_tokens
        self.num_split_rows += chunk.num_split_rows
        self.num_pieces += chunk.num_pieces
        self.audit.merge(chunk.audit)
        self.input_errors.merge(chunk.input_errors)
        self.not_read.update(chunk.not_read)
        self.sharegpt_roles_mapped.update(chunk.sharegpt_roles_mapped)
        self.num_desirable += chunk.num_desirable
        self.num_undesirable += chunk.num_undesirable


def _stats(values: array.array) -> dict[str, float]:
    import numpy as np

    if not values:
        return {}
    arr = np.frombuffer(values, dtype=np.int64)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"min": int(arr.min()), "mean": round(float(arr.mean()), 2), "p50": float(p50), "p90": float(p90),
            "p99": float(p99), "max": int(arr.max()), "sum": int(arr.sum())}


def _summary(config, tokenizer, encoder, paths, totals, source: Input, elapsed, kind: str = "sft", *,
             has_margin: bool = False) -> dict[str, Any]:
    import tokenizers
    import transformers

    num_written = len(totals.lengths)
    template = encoder.chat_template or ""
    errors = totals.input_errors
    return {
        "kind": kind,
        "num_lines": totals.num_rows,
        "num_written": num_written,
        "num_pairs": num_written if kind == "preference" else 0,
        # A pair file whose first pair has a 'margin': each pair row keeps it (false in other files).
        "has_margin": has_margin,
        # An unpaired file's rows by their label (0 in other kinds).
        "num_desirable": totals.num_desirable,
        "num_undesirable": totals.num_undesirable,
        "num_chat": num_written - totals.num_pretrain - totals.num_prompt_completion,
        "num_prompt_completion": totals.num_prompt_completion,
        "num_pretrain": totals.num_pretrain,
        "num_split_rows": totals.num_split_rows,
        "num_split_samples": totals.num_pieces,
        "num_rejected": sum(totals.reasons.values()),
        "rejected_by_reason": dict(sorted(totals.reasons.items())),
        "input": source.describe(),
        "rows_by_format": dict(totals.formats.most_common()),
        # ShareGPT turns read under a name the format does not define (chatgpt, --sharegpt-roles'), by name.
        "sharegpt_roles_mapped": dict(totals.sharegpt_roles_mapped.most_common()),
        # A pair file's output holds the pairs' tokens only: the input's columns no pair reads, by rows.
        "columns_not_read": dict(sorted(totals.not_read.items())),
        "input_errors": {
            "num_rows": sum(errors.reasons.values()),
            "by_reason": dict(sorted(errors.reasons.items())),
            "examples": {reason: errors.examples[reason] for reason in sorted(errors.examples)},
        },
        "num_tokens": int(sum(totals.lengths)),
        "num_loss_counted_tokens": int(sum(totals.num_loss)),
        "len": _stats(totals.lengths),
        "num_loss_counted_tokens_per_sample": _stats(totals.num_loss),
        "outputs": {"data": str(paths.data), "rejected": str(paths.rejected), "summary": str(paths.summary)},
        "tokenizer": {
            "name_or_path": config.model_name_or_path,
            "class": type(tokenizer).__name__,
            "num_tokens": len(tokenizer),
            "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token,
            "chat_template_source": config.chat_template or "tokenizer",
            "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest() if template else None,
            "chat_template": template or None,
            "end_of_turn_token": encoder.end_of_turn_token,
            "end_of_turn_tokens": list(encoder.end_of_turn_tokens),
            "mask_reasoning": config.mask_reasoning,
            "masking": encoder.masking_method,
            "developer_messages_as": "system" if encoder.developer_as_system else "developer",
        },
        "audit": _audit(config, totals, kind=kind),
        "versions": {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
        "config": dataclasses.asdict(config),
        "elapsed_s": round(elapsed, 3),
        "lines_per_s": round(totals.num_rows / elapsed, 1) if elapsed > 0 else None,
    }


def _audit(config: ProcessDataConfig, totals: _Totals, num_lines: int | None = None, *,
           kind: str = "sft") -> dict[str, Any]:
    """The label audit: what is learned, per dataset, and which rule is broken.

    It judges the masking only, never the input: its rows are the conversations the chat template
    was given (input errors, pretrain and plain prompt/completion rows aside); in a preference file
    (``kind``), the conversational pairs, each counted once, with both sides' replies and tokens. Rules: every
    reply's end-of-turn is learned (else the model never learns to stop), and at most
    ``max_rejected_fraction`` of those rows is rejected by the template or the masking (a finding:
    ``SampleError.audit``). ``num_lines`` is unused (kept for callers of the older signature).
    """
    unit = "pairs" if kind == "preference" else "conversations"
    audit = totals.audit
    num_rejected = sum(audit.reasons.values())
    num_chat_written = len(totals.lengths) - totals.num_pretrain - totals.num_prompt_completion
    num_chat_in = num_chat_written + num_rejected
    rejected_fraction = num_rejected / num_chat_in if num_chat_in else 0.0
    broken = []
    if audit.num_replies_end_learned < audit.num_replies:
        broken.append(f"{audit.num_replies - audit.num_replies_end_learned} of {audit.num_replies} replies have no "
                      "learned end-of-turn (see --end-of-turn-token)")
    if rejected_fraction > config.max_rejected_fraction:
        broken.append(f"{num_rejected} of {num_chat_in} {unit} could not be masked ({rejected_fraction:.1%} > "
                      f"--max-rejected-fraction {config.max_rejected_fraction:g})")
    return {
        "unit": unit,  # what the row counts below count: conversations, or the pairs of a preference file
        "num_chat_rows_in": num_chat_in,
        "num_chat_rows_written": num_chat_written,
        "learned_token_fraction": round(audit.num_chat_loss_tokens / audit.num_chat_tokens, 4)
        if audit.num_chat_tokens else 0.0,
        # Plain prompt/completion rows: no template, so no reply to audit; their learned share apart.
        "num_prompt_completion_rows": totals.num_prompt_completion,
        "prompt_completion_learned_token_fraction":
            round(totals.num_prompt_completion_loss_tokens / totals.num_prompt_completion_tokens, 4)
            if totals.num_prompt_completion_tokens else 0.0,
        "num_replies": audit.num_replies,
        "num_replies_end_of_turn_learned": audit.num_replies_end_learned,
        "num_replies_marked_not_learned": audit.num_replies_marked,
        "num_rows_zero_learned": audit.reasons.get("no_loss_tokens", 0),
        "num_rejected": num_rejected,
        "rejected_fraction": round(rejected_fraction, 4),
        "max_rejected_fraction": config.max_rejected_fraction,
        "rejected_by_reason": dict(sorted(audit.reasons.items())),
        "rows_by_rule": dict(sorted(audit.rules.items())),
        "examples": {reason: audit.examples[reason] for reason in sorted(audit.examples)},
        "broken_rules": broken,
        "passed": not broken,
    }


def _log_audit(audit: dict[str, Any], config: ProcessDataConfig) -> None:
    pairs = audit.get("unit") == "pairs"
    if audit.get("num_prompt_completion_rows"):
        logger.info("label audit: %.1f%% of the tokens of %d plain %s learned (the completions and EOS)",
                    100 * audit["prompt_completion_learned_token_fraction"], audit["num_prompt_completion_rows"],
                    "string pairs (both sides)" if pairs else "prompt/completion rows")
        if not audit["num_chat_rows_in"]:  # no conversation: "0.0% of chat tokens learned" would mislead
            _log_broken(audit, config)
            return
    unit = "pairs" if pairs else "conversations"
    logger.info("label audit: %.1f%% of %s learned; %d of %d replies %s end with a learned end-of-turn; "
                "%d %s but zero learned tokens; %d of %d %s could not be masked "
                "(%.2f%%, max %.2f%%)%s%s",
                100 * audit["learned_token_fraction"], "the sides' tokens" if pairs else "chat tokens",
                audit["num_replies_end_of_turn_learned"], audit["num_replies"],
                f"(both sides of {audit['num_chat_rows_written']} pairs)" if pairs else "",
                audit["num_rows_zero_learned"], "pairs with a side that has replies" if pairs else
                "conversations with replies", audit["num_rejected"],
                audit["num_chat_rows_in"], unit, 100 * audit["rejected_fraction"], 100 * audit["max_rejected_fraction"],
                f"; {audit['num_replies_marked_not_learned']} more replies shown but not learned, as their rows "
                "mark them (weight 0, train / training / loss false)" if audit["num_replies_marked_not_learned"] else "",
                "" if audit["rows_by_rule"].get("incremental", 0) == 0 else
                f"; {audit['rows_by_rule']['incremental']} rows located by the incremental fallback "
                "(the template rewrites replies)")
    _log_examples("audit example", audit["examples"])
    _log_broken(audit, config)


def _log_broken(audit: dict[str, Any], config: ProcessDataConfig) -> None:
    for rule in audit["broken_rules"]:
        (logger.warning if config.allow_audit_failures else logger.error)("label audit: %s", rule)


def _log_examples(what: str, examples: dict[str, list[dict]]) -> None:
    for reason, kept in examples.items():
        for example in kept:
            where = f"line {example['line']}" if "line" in example else f"row {example['row']}"
            where = f"{example['file']} {where}" if "file" in example else where
            logger.info("%s %s, %s: %s\n%s", what, reason, where, example["detail"], example["text"])


def _log_summary(summary: dict[str, Any]) -> None:
    pairs = summary["kind"] == "preference"
    if pairs:
        logger.info("wrote %d preference pairs (%d conversational, %d plain strings; %d tokens, %d loss-counted, "
                    "both sides) to %s in %.1fs (%.0f rows/s)", summary["num_pairs"], summary["num_chat"],
                    summary["num_prompt_completion"], summary["num_tokens"], summary["num_loss_counted_tokens"],
                    summary["outputs"]["data"], summary["elapsed_s"], summary["lines_per_s"] or 0)
    elif summary["kind"] == "unpaired":
        logger.info("wrote %d unpaired feedback rows (%d desirable, %d undesirable; %d conversational, %d plain "
                    "strings; %d tokens, %d loss-counted) to %s in %.1fs (%.0f rows/s)", summary["num_written"],
                    summary["num_desirable"], summary["num_undesirable"], summary["num_chat"],
                    summary["num_prompt_completion"], summary["num_tokens"], summary["num_loss_counted_tokens"],
                    summary["outputs"]["data"], summary["elapsed_s"], summary["lines_per_s"] or 0)
    else:
        logger.info("wrote %d samples (%d chat, %d prompt/completion, %d pretrain, %d tokens, %d loss-counted) to %s "
                    "in %.1fs (%.0f rows/s)", summary["num_written"], summary["num_chat"],
                    summary["num_prompt_completion"], summary["num_pretrain"], summary["num_tokens"],
                    summary["num_loss_counted_tokens"], summary["outputs"]["data"], summary["elapsed_s"],
                    summary["lines_per_s"] or 0)
    logger.info("rows by format: %s", ", ".join(f"{fmt} {count}" for fmt, count in summary["rows_by_format"].items())
                or "none recognised")
    if mapped := summary.get("sharegpt_roles_mapped"):
        roles = parse_sharegpt_roles(summary["config"]["sharegpt_roles"])
        logger.info("read %d ShareGPT turns under other names: %s", sum(mapped.values()),
                    ", ".join(f"{count} {name} as {roles[name]}" for name, count in mapped.items()))
    if summary.get("columns_not_read"):
        logger.info("not read: %s (columns no pair uses; the output holds the pairs' tokens only)",
                    ", ".join(summary["columns_not_read"]))
    if summary["len"]:
        logger.info("%s: p50 %.0f, p90 %.0f, p99 %.0f, max %d", "pair len (both sides)" if pairs else "len",
                    summary["len"]["p50"], summary["len"]["p90"], summary["len"]["p99"], summary["len"]["max"])
    if summary["num_split_rows"]:
        logger.info("cut %d text rows longer than --max-sample-num-tokens into %d samples (--split-long-text)",
                    summary["num_split_rows"], summary["num_split_samples"])
    errors = summary["input_errors"]
    if errors["num_rows"]:
        _log_examples("input error example", errors["examples"])
        logger.warning("skipped %d bad input row(s), listed in %s: %s", errors["num_rows"],
                       summary["outputs"]["rejected"],
                       ", ".join(f"{reason} {count}" for reason, count in errors["by_reason"].items()))


def render_labels(tokenizer, input_ids: list[int], labels: list[int], mask_string: str) -> str:
    """Decode ``labels`` with each masked run shown as ``mask_string``."""
    pieces, run, masked = [], [], None
    for token_id, label in zip(input_ids, labels):
        is_masked = label == IGNORE_INDEX
        if run and is_masked != masked:
            pieces.append(mask_string if masked else tokenizer.decode(run))
            run = []
        masked = is_masked
        run.append(token_id)
    if run:
        pieces.append(mask_string if masked else tokenizer.decode(run))
    return "".join(pieces)


def _print_samples(config: ProcessDataConfig, tokenizer, data_path: Path, totals: _Totals, kind: str = "sft") -> None:
    num_written = len(totals.lengths)
    rows = sorted(random.Random(config.seed).sample(range(num_written), min(num_written, config.num_printed_samples)))
    try:
        with open(data_path, "rb") as f:
            for index in rows:
                f.seek(totals.row_offsets[index])
                row = json.loads(f.readline())
                for side in ("chosen_", "rejected_") if kind == "preference" else ("",):
                    what = f"pair {index} {side[:-1]}" if side else f"sample {index}"
                    if MARGIN_COLUMN in row and kind == "preference":
                        what += f" (margin {row[MARGIN_COLUMN]:g})"
                    if kind == "unpaired":
                        what += " (desirable)" if row["desirable"] else " (undesirable)"
                    logger.info("%s input:\n%s", what, tokenizer.decode(row[side + "input_ids"]))
                    logger.info("%s labels:\n%s", what, render_labels(
                        tokenizer, row[side + "input_ids"], row[side + "labels"], config.string_for_printing_masks))
    # Printing is for the eye only: a tokenizer whose decode fails (remote code, a broken decoder) or an
    # unreadable file must not fail a run whose data is already written. OverflowError: decode of a huge id.
    except (OSError, ValueError, TypeError, KeyError, IndexError, OverflowError) as err:
        logger.warning("printing samples stopped (%s: %s); the data is written", type(err).__name__, err)


def main(argv: list[str] | None = None, *, prog: str = "process_data.py") -> dict[str, Any]:
    """Parse ``argv`` and tokenize; a bad input ends the process with one ``prog: error: ...`` line."""
    config = parse_config(ProcessDataConfig, argv, description=__doc__.split("\n")[0])
    setup_logging(config.logging_level)
    logger.info("arguments: %s", json.dumps(dataclasses.asdict(config), default=str))  # never fails on a value
    try:
        return process_data(config)
    # ImportError: a library below its floor that transformers refuses to use (jinja2 < 3.1.6 renders no template).
    except (ValueError, ImportError) as err:
        raise SystemExit(f"{prog}: error: {err}") from None


def cli() -> None:
    """The command line (``python process_data.py``, ``minitrainer-process-data``): ``main`` under the name it
    was run by, its summary left in ``summary.json`` rather than returned."""
    main(prog=Path(sys.argv[0]).name)


if __name__ == "__main__":
    cli()
