"""Tokenize a chat JSONL file into training rows with loss masks.

    TOKENIZERS_PARALLELISM=false python process_data.py \\
        --input-file data/chat.jsonl --output-dir data/chat_tkns \\
        --model-name-or-path Qwen/Qwen2.5-1.5B-Instruct \\
        --max-sample-num-tokens 128000 --num-proc 4

CPU only, no torchrun: tokenization runs in ``--num-proc`` worker processes.
``--output-file data/chat_tkns.jsonl`` (the older form) writes one file instead.
``--config FILE`` reads these flags' values from a YAML or JSON file (``config_files.py``).

Input: one JSON object per line with ``messages``, a list of
``{"role", "content"}`` (roles system, user, assistant, tool; assistant turns
may carry ``tool_calls`` and ``reasoning_content``), or a single
``{"role": "pretrain", "content": ...}`` message. A row's ``tools`` (JSON
schemas) is passed to the chat template. Other top-level fields (an ``id``, a
source tag) are copied to the output row unchanged.

Output, with ``--output-dir D`` (``--output-file F.jsonl``: ``F.jsonl``,
``F.summary.json``, ``F.rejected.jsonl``):
  D/data.jsonl      ``input_ids``, ``labels`` (-100 = masked, unshifted),
                    ``len``, ``num_loss_counted_tokens`` + the row's other fields
  D/rejected.jsonl  ``{"line": N, "reason": ..., "detail": ...}`` per unusable line
  D/summary.json    counts by outcome and reason, length statistics,
                    tokenizer, arguments and the label audit; written last

The label audit (docs/data.md) is on by default: the run exits non-zero, after
writing everything, when a reply's end-of-turn is not learned or more than
``--max-rejected-fraction`` of the chat rows is rejected (``--allow-audit-failures``
keeps going).

How replies are found and masked: see ``chat_masking.py``. Output files are
written under temporary names and renamed when complete; ``--num-proc N``
gives byte-identical output for every N.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import hashlib
import json
import multiprocessing
import os
import random
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chat_masking import ChatEncoder, SampleError, parse_chat_row, parse_row
from utils import IGNORE_INDEX, collect_errors, config_field, logger, parse_config, setup_logging


def _default_num_proc() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass
class ProcessDataConfig:
    input_file: str = config_field(help="input JSONL, one {\"messages\": [...]} object per line")
    model_name_or_path: str = config_field(help="Hugging Face tokenizer with a chat template (local folder or hub id)")
    output_dir: str | None = config_field(None, help="output folder: data.jsonl, summary.json, rejected.jsonl")
    output_file: str | None = config_field(None, help="single output JSONL (older form); the summary and "
                                                      "rejected files go beside it")
    max_sample_num_tokens: int = config_field(2147483647, help="longer samples are rejected (and counted)")
    chat_template: str | None = config_field(None, help="jinja file that replaces the tokenizer's chat template")
    end_of_turn_token: str | None = config_field(None, help="the string that ends an assistant turn (default: "
                                                            "the special token the template writes after a reply)")
    mask_reasoning: bool = config_field(False, help="mask reasoning (reasoning_content, <think> blocks) instead "
                                                    "of learning it with the reply")
    num_proc: int = config_field(default_factory=_default_num_proc, help="worker processes (default: CPUs)")
    string_for_printing_masks: str = config_field("<|mAsK|>", help="shown in place of masked label tokens "
                                                                    "in the printed examples")
    strict: bool = config_field(False, help="stop with file:line: reason at the first unusable line")
    overwrite: bool = config_field(False, help="replace existing output files")
    num_printed_samples: int = config_field(2, help="random samples printed at the end to eyeball masking")
    seed: int = config_field(42, help="seed for choosing the printed samples")
    chunk_size: int = config_field(256, help="lines per worker task (output is the same for any value)")
    logging_level: str = config_field("INFO", help="DEBUG, INFO, WARNING, ERROR")
    max_rejected_fraction: float = config_field(0.01, help="label audit: fail when more than this fraction of the "
                                                           "chat rows is rejected (blank lines not counted)")
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
    """What a worker returns for one chunk of lines; the main process only writes and counts."""

    data: bytes
    rejected: bytes
    row_bytes: list[int]
    lengths: list[int]
    num_loss_counted_tokens: list[int]
    num_pretrain: int
    reasons: Counter
    first_rejection: tuple[int, str] | None  # (line, "reason: detail")
    audit: ChunkAudit


NUM_AUDIT_EXAMPLES = 3  # decoded examples kept per rejection reason and per broken rule
EXAMPLE_CHARS = 400  # an example's text is cut to this many characters


@dataclass
class ChunkAudit:
    """The label audit's counts of one chunk (chat rows only; pretrain rows learn every token)."""

    num_chat_tokens: int = 0
    num_chat_loss_tokens: int = 0
    num_replies: int = 0
    num_replies_end_learned: int = 0
    rules: Counter = dataclasses.field(default_factory=Counter)  # rows by how their replies were located
    # reason (a rejection reason or "reply_end_not_learned") -> [{"line", "detail", "text"}]
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
        self.rules.update(other.rules)
        for reason, examples in other.examples.items():
            for example in examples:
                self.add_example(reason, example)


def _cut(text: str) -> str:
    return text if len(text) <= EXAMPLE_CHARS else text[:EXAMPLE_CHARS] + f"... ({len(text)} chars)"


# ----------------------------------------------------------------------------
# Workers


_ENCODER: ChatEncoder | None = None  # one per worker process, set by _init_worker (the Pool initializer pattern)


def _init_worker(config: ProcessDataConfig, chat_template: str | None, end_of_turn_tokens: tuple[str, ...]) -> None:
    global _ENCODER
    # N worker processes already use the cores; Rust threads inside each would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tokenizer = load_tokenizer(config.model_name_or_path)
    tokenizer.chat_template = chat_template
    # The main process probed the end-of-turn tokens once: workers take them as given.
    _ENCODER = make_encoder(config, tokenizer, end_of_turn=end_of_turn_tokens)


def make_encoder(config: ProcessDataConfig, tokenizer, *, end_of_turn: str | tuple[str, ...] | None,
                 probe_tools: list[dict] | None = None) -> ChatEncoder:
    """The encoder; ``probe_tools`` (the rows' tools) make tool-only templates renderable when probing."""
    return ChatEncoder(tokenizer, max_sample_num_tokens=config.max_sample_num_tokens, end_of_turn_token=end_of_turn,
                       mask_reasoning=config.mask_reasoning, probe_tools=probe_tools)


def _process_chunk(first_line: int, lines: list[bytes]) -> ChunkResult:
    assert _ENCODER is not None, "worker not initialised"
    return encode_chunk(_ENCODER, first_line, lines)


def encode_chunk(encoder: ChatEncoder, first_line: int, lines: list[bytes]) -> ChunkResult:
    """Encode lines ``first_line, first_line + 1, ...`` (1-based) into output bytes and counts."""
    data, rejected, row_bytes, lengths, num_loss = [], [], [], [], []
    reasons: Counter = Counter()
    first_rejection = None
    num_pretrain = 0
    audit = ChunkAudit()
    for offset, result in enumerate(encoder.encode_rows(lines)):
        line_no = first_line + offset
        if isinstance(result, SampleError):
            reasons[result.reason] += 1
            rejected.append(json.dumps({"line": line_no, "reason": result.reason, "detail": result.detail},
                                       ensure_ascii=False) + "\n")
            if first_rejection is None:
                first_rejection = (line_no, f"{result.reason}: {result.detail}")
            if len(audit.examples.get(result.reason, ())) < NUM_AUDIT_EXAMPLES:
                audit.add_example(result.reason, {"line": line_no, "detail": result.detail,
                                                  "text": _cut(lines[offset].decode("utf-8", "replace").strip())})
            continue
        encoded = result.to_json_line(encoder.id_strings)
        data.append(encoded)
        row_bytes.append(len(encoded))
        lengths.append(len(result.input_ids))
        num_loss.append(result.num_loss_counted_tokens)
        num_pretrain += result.is_pretrain
        if not result.is_pretrain:
            audit.num_chat_tokens += len(result.input_ids)
            audit.num_chat_loss_tokens += result.num_loss_counted_tokens
            audit.num_replies += result.num_replies
            audit.num_replies_end_learned += result.num_replies_end_learned
            audit.rules[result.rule] += 1
            if result.num_replies_end_learned < result.num_replies:
                audit.add_example("reply_end_not_learned", {
                    "line": line_no, "detail": f"{result.num_replies - result.num_replies_end_learned} of "
                                               f"{result.num_replies} replies have no learned end-of-turn",
                    "text": _cut(render_labels(encoder.tokenizer, result.input_ids, result.labels, "<|mAsK|>"))})
    return ChunkResult(b"".join(data), "".join(rejected).encode("utf-8"), row_bytes, lengths, num_loss,
                       num_pretrain, reasons, first_rejection, audit)


# ----------------------------------------------------------------------------
# Main process


def load_tokenizer(model_name_or_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_name_or_path)


def _read_chunks(path: Path, chunk_size: int):
    """Yield ``(first_line, lines)``; the file is streamed, never held whole."""
    with open(path, "rb") as f:
        lines: list[bytes] = []
        first_line = 1
        for line_no, line in enumerate(f, 1):
            lines.append(line)
            if len(lines) == chunk_size:
                yield first_line, lines
                lines, first_line = [], line_no + 1
        if lines:
            yield first_line, lines


def _count_lines(path: Path) -> int:
    """Lines in the file (a final line without a newline counts), reading 1 MiB blocks."""
    num_lines, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            num_lines += block.count(b"\n")
            last = block[-1:]
    return num_lines + (last != b"\n")


def check_run(config: ProcessDataConfig, paths: OutputPaths):
    """Whole-run problems, before any heavy work: raise ValueError with one clear line.

    Returns:
        The loaded tokenizer.
    """
    input_file = Path(config.input_file)
    if not input_file.is_file():
        raise ValueError(f"input file {input_file} does not exist")
    if not any(line.strip() for line in _first_lines(input_file)):
        raise ValueError(f"input file {input_file} is empty")
    if not config.overwrite:
        for path in paths.all():
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
        with open(input_file, "rb") as f:
            for line_no, line in enumerate(f, 1):
                try:
                    messages, _ = parse_row(line)
                except SampleError:
                    continue
                if messages[0]["role"] != "pretrain":
                    raise ValueError(f"tokenizer {config.model_name_or_path!r} has no chat template, but "
                                     f"{input_file}:{line_no} is a conversation")
    return tokenizer


def _first_lines(path: Path):
    """Lines up to the first non-blank one, for the empty-input check."""
    with open(path, "rb") as f:
        for line in f:
            yield line
            if line.strip():
                return


def process_data(config: ProcessDataConfig) -> dict[str, Any]:
    """Tokenize ``config.input_file`` and write the output files.

    Args:
        config: the run's settings.

    Returns:
        The summary (also written to the summary JSON).

    Raises:
        ValueError: a whole-run problem, or with ``strict`` the first unusable line as ``file:line: reason``.
    """
    start = time.perf_counter()
    paths = OutputPaths.from_config(config)
    tokenizer = check_run(config, paths)
    probe_tools = _rows_tools(Path(config.input_file))
    encoder = make_encoder(config, tokenizer, end_of_turn=config.end_of_turn_token, probe_tools=probe_tools)
    num_lines = _count_lines(Path(config.input_file))
    num_proc = min(config.num_proc, max(1, -(-num_lines // config.chunk_size)))
    logger.info("tokenizer %s (%s, %d tokens, eos %r), chat template from %s, end of turn %s (%s)",
                config.model_name_or_path, type(tokenizer).__name__, len(tokenizer), tokenizer.eos_token,
                config.chat_template or "the tokenizer", " or ".join(map(repr, encoder.end_of_turn_tokens)),
                "--end-of-turn-token" if config.end_of_turn_token else
                "probed " + ("with the rows' tools" if probe_tools else "without tools") + ", with and without "
                "a system prompt")
    logger.info("%d lines from %s, %d worker process(es)%s", num_lines, config.input_file, num_proc,
                "" if num_proc == config.num_proc else f" (--num-proc {config.num_proc}: fewer chunks than that)")

    paths.data.parent.mkdir(parents=True, exist_ok=True)
    if config.overwrite:
        # The summary marks a complete dataset: drop the old one before touching anything else.
        paths.summary.unlink(missing_ok=True)
    tmp = {path: path.with_name(f".{path.name}.tmp-{os.getpid()}") for path in (paths.data, paths.rejected)}
    totals = _Totals()
    try:
        # closing(): on --strict's early exit the worker pool is shut down at once, not at garbage collection.
        with open(tmp[paths.data], "wb") as data_f, open(tmp[paths.rejected], "wb") as rejected_f, \
                contextlib.closing(_run_chunks(config, encoder, num_proc, num_lines)) as chunks:
            for chunk in chunks:
                if config.strict and chunk.first_rejection is not None:
                    line_no, reason = chunk.first_rejection
                    raise ValueError(f"{config.input_file}:{line_no}: {reason}")
                data_f.write(chunk.data)
                rejected_f.write(chunk.rejected)
                totals.add(chunk)
        for path, tmp_path in tmp.items():
            os.replace(tmp_path, path)
    finally:
        for tmp_path in tmp.values():
            tmp_path.unlink(missing_ok=True)

    elapsed = time.perf_counter() - start
    summary = _summary(config, tokenizer, encoder, paths, totals, num_lines, elapsed)
    tmp_summary = paths.summary.with_name(f".{paths.summary.name}.tmp-{os.getpid()}")
    tmp_summary.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp_summary, paths.summary)
    _log_summary(summary)
    _print_samples(config, tokenizer, paths.data, totals)
    if not summary["num_written"]:
        raise ValueError(f"no sample written from {num_lines} line(s); rejected: "
                         + ", ".join(f"{reason} {count}" for reason, count in summary["rejected_by_reason"].items())
                         + f" (see {paths.rejected})")
    _log_audit(summary["audit"], config)
    if summary["audit"]["broken_rules"] and not config.allow_audit_failures:
        raise ValueError(f"label audit failed: {'; '.join(summary['audit']['broken_rules'])} (details in "
                         f"{paths.summary} under 'audit'; --allow-audit-failures keeps the dataset anyway)")
    return summary


_PROBE_SCAN_LINES = 1000  # lines read for the rows' tools before the end-of-turn probe
_PROBE_TOOL = [{"type": "function", "function": {"name": "probe_tool", "description": "A tool.", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}}}}]


def _rows_tools(path: Path) -> list[dict] | None:
    """The first ``tools`` of the file's first lines (a stand-in schema when rows call tools without
    one), so the end-of-turn probe renders the way the rows will be rendered."""
    calls_tools = False
    with open(path, "rb") as f:
        for _, line in zip(range(_PROBE_SCAN_LINES), f):
            try:
                messages, tools, _ = parse_chat_row(line)
            except SampleError:
                continue
            if tools:
                return tools
            calls_tools = calls_tools or any("tool_calls" in message for message in messages)
    return _PROBE_TOOL if calls_tools else None


def _run_chunks(config: ProcessDataConfig, encoder: ChatEncoder, num_proc: int, num_lines: int):
    """Yield ChunkResults in input order, with a progress bar and a bounded number of chunks in flight."""
    from tqdm import tqdm

    chunks = _read_chunks(Path(config.input_file), config.chunk_size)
    with tqdm(total=num_lines, unit="line", desc="tokenizing", mininterval=1.0, file=sys.stderr) as progress:
        if num_proc == 1:
            for first_line, lines in chunks:
                yield encode_chunk(encoder, first_line, lines)
                progress.update(len(lines))
            return
        # fork: workers inherit the imported modules instead of importing transformers again.
        context = multiprocessing.get_context("fork")
        with context.Pool(num_proc, initializer=_init_worker,
                          initargs=(config, encoder.chat_template, encoder.end_of_turn_tokens)) as pool:
            in_flight: deque = deque()
            for first_line, lines in chunks:
                in_flight.append((len(lines), pool.apply_async(_process_chunk, (first_line, lines))))
                # Back-pressure: at most 2 chunks per worker are read ahead, so memory stays flat.
                if len(in_flight) >= 2 * num_proc:
                    num, result = in_flight.popleft()
                    yield result.get()
                    progress.update(num)
            while in_flight:
                num, result = in_flight.popleft()
                yield result.get()
                progress.update(num)


class _Totals:
    """Running counts over chunks; per-row numbers kept in compact arrays (8 bytes a row)."""

    def __init__(self):
        self.lengths = array.array("q")
        self.num_loss = array.array("q")
        self.row_offsets = array.array("q", [0])
        self.reasons: Counter = Counter()
        self.num_pretrain = 0
        self.audit = ChunkAudit()

    def add(self, chunk: ChunkResult) -> None:
        self.lengths.extend(chunk.lengths)
        self.num_loss.extend(chunk.num_loss_counted_tokens)
        for size in chunk.row_bytes:
            self.row_offsets.append(self.row_offsets[-1] + size)
        self.reasons.update(chunk.reasons)
        self.num_pretrain += chunk.num_pretrain
        self.audit.merge(chunk.audit)


def _stats(values: array.array) -> dict[str, float]:
    import numpy as np

    if not values:
        return {}
    arr = np.frombuffer(values, dtype=np.int64)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"min": int(arr.min()), "mean": round(float(arr.mean()), 2), "p50": float(p50), "p90": float(p90),
            "p99": float(p99), "max": int(arr.max()), "sum": int(arr.sum())}


def _summary(config, tokenizer, encoder, paths, totals, num_lines, elapsed) -> dict[str, Any]:
    import tokenizers
    import transformers

    num_written = len(totals.lengths)
    template = encoder.chat_template or ""
    return {
        "num_lines": num_lines,
        "num_written": num_written,
        "num_chat": num_written - totals.num_pretrain,
        "num_pretrain": totals.num_pretrain,
        "num_rejected": sum(totals.reasons.values()),
        "rejected_by_reason": dict(sorted(totals.reasons.items())),
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
        },
        "audit": _audit(config, totals, num_lines),
        "versions": {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
        "config": dataclasses.asdict(config),
        "elapsed_s": round(elapsed, 3),
        "lines_per_s": round(num_lines / elapsed, 1) if elapsed > 0 else None,
    }


def _audit(config: ProcessDataConfig, totals: _Totals, num_lines: int) -> dict[str, Any]:
    """The label audit: what is learned, per dataset, and which rule is broken.

    Rules: every reply's end-of-turn is learned (else the model never learns to stop), and at most
    ``max_rejected_fraction`` of the chat rows is rejected (blank lines and pretrain rows aside).
    """
    audit = totals.audit
    num_blank = totals.reasons.get("blank_line", 0)
    num_rejected = sum(totals.reasons.values()) - num_blank
    num_chat_in = num_lines - num_blank - totals.num_pretrain
    rejected_fraction = num_rejected / num_chat_in if num_chat_in else 0.0
    broken = []
    if audit.num_replies_end_learned < audit.num_replies:
        broken.append(f"{audit.num_replies - audit.num_replies_end_learned} of {audit.num_replies} replies have no "
                      "learned end-of-turn (see --end-of-turn-token)")
    if rejected_fraction > config.max_rejected_fraction:
        broken.append(f"{num_rejected} of {num_chat_in} chat rows rejected ({rejected_fraction:.1%} > "
                      f"--max-rejected-fraction {config.max_rejected_fraction:g})")
    return {
        "num_chat_rows_in": num_chat_in,
        "num_chat_rows_written": len(totals.lengths) - totals.num_pretrain,
        "learned_token_fraction": round(audit.num_chat_loss_tokens / audit.num_chat_tokens, 4)
        if audit.num_chat_tokens else 0.0,
        "num_replies": audit.num_replies,
        "num_replies_end_of_turn_learned": audit.num_replies_end_learned,
        "num_rows_zero_learned": totals.reasons.get("no_loss_tokens", 0),
        "num_rejected": num_rejected,
        "rejected_fraction": round(rejected_fraction, 4),
        "max_rejected_fraction": config.max_rejected_fraction,
        "rejected_by_reason": {reason: count for reason, count in sorted(totals.reasons.items())
                               if reason != "blank_line"},
        "rows_by_rule": dict(sorted(audit.rules.items())),
        "examples": {reason: audit.examples[reason] for reason in sorted(audit.examples)},
        "broken_rules": broken,
        "passed": not broken,
    }


def _log_audit(audit: dict[str, Any], config: ProcessDataConfig) -> None:
    logger.info("label audit: %.1f%% of chat tokens learned; %d of %d replies end with a learned end-of-turn; "
                "%d chat rows with zero learned tokens; %d of %d chat rows rejected (%.2f%%, max %.2f%%)%s",
                100 * audit["learned_token_fraction"], audit["num_replies_end_of_turn_learned"], audit["num_replies"],
                audit["num_rows_zero_learned"], audit["num_rejected"], audit["num_chat_rows_in"],
                100 * audit["rejected_fraction"], 100 * audit["max_rejected_fraction"],
                "" if audit["rows_by_rule"].get("incremental", 0) == 0 else
                f"; {audit['rows_by_rule']['incremental']} rows located by the incremental fallback "
                "(the template rewrites replies)")
    for reason, examples in audit["examples"].items():
        for example in examples:
            logger.info("audit example %s, line %d: %s\n%s", reason, example["line"], example["detail"], example["text"])
    for rule in audit["broken_rules"]:
        (logger.warning if config.allow_audit_failures else logger.error)("label audit: %s", rule)


def _log_summary(summary: dict[str, Any]) -> None:
    logger.info("wrote %d samples (%d chat, %d pretrain, %d tokens, %d loss-counted) to %s in %.1fs (%.0f lines/s)",
                summary["num_written"], summary["num_chat"], summary["num_pretrain"], summary["num_tokens"],
                summary["num_loss_counted_tokens"], summary["outputs"]["data"], summary["elapsed_s"],
                summary["lines_per_s"] or 0)
    if summary["len"]:
        logger.info("len: p50 %.0f, p90 %.0f, p99 %.0f, max %d", summary["len"]["p50"], summary["len"]["p90"],
                    summary["len"]["p99"], summary["len"]["max"])
    if summary["num_rejected"]:
        logger.warning("rejected %d line(s), listed in %s: %s", summary["num_rejected"], summary["outputs"]["rejected"],
                       ", ".join(f"{reason} {count}" for reason, count in summary["rejected_by_reason"].items()))


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


def _print_samples(config: ProcessDataConfig, tokenizer, data_path: Path, totals: _Totals) -> None:
    num_written = len(totals.lengths)
    rows = sorted(random.Random(config.seed).sample(range(num_written), min(num_written, config.num_printed_samples)))
    try:
        with open(data_path, "rb") as f:
            for index in rows:
                f.seek(totals.row_offsets[index])
                row = json.loads(f.readline())
                logger.info("sample %d input:\n%s", index, tokenizer.decode(row["input_ids"]))
                logger.info("sample %d labels:\n%s", index, render_labels(
                    tokenizer, row["input_ids"], row["labels"], config.string_for_printing_masks))
    # Printing is for the eye only: a tokenizer whose decode fails (remote code, a broken decoder) or an
    # unreadable file must not fail a run whose data is already written. OverflowError: decode of a huge id.
    except (OSError, ValueError, TypeError, KeyError, IndexError, OverflowError) as err:
        logger.warning("printing samples stopped (%s: %s); the data is written", type(err).__name__, err)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    config = parse_config(ProcessDataConfig, argv, description=__doc__.split("\n")[0])
    setup_logging(config.logging_level)
    logger.info("arguments: %s", json.dumps(dataclasses.asdict(config), default=str))  # never fails on a value
    try:
        return process_data(config)
    except ValueError as err:
        raise SystemExit(f"process_data.py: error: {err}") from None


if __name__ == "__main__":
    main()
