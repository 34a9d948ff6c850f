"""Benchmark process_data.py end to end on a realistic chat dataset.

    .venv/bin/python -m bench.bench_process_data --num-proc 2
    .venv/bin/python -m bench.bench_process_data --num-samples 2000 --no-verify   # quick look
    git worktree add /tmp/old_pd HEAD~1   # or: git archive HEAD~1 | tar -x -C /tmp/old_pd
    .venv/bin/python -m bench.bench_process_data --baseline-dir /tmp/old_pd --repeats 3   # old vs new
    .venv/bin/python -m bench.bench_process_data --mix reasoning_tools --no-verify   # what reasoning/tools cost
    .venv/bin/python -m bench.bench_process_data --input-kind sharegpt_parquet --num-samples 1000000 \
        --length-scale 0.1 --no-verify   # scale: 1M ShareGPT rows in parquet, peak memory vs rows

Builds once into ``--work-dir`` (reused on later runs):
  - a ChatML tokenizer trained to a 32k vocabulary on Python's own prose
    (the pydoc topics and standard-library docstrings) and code (stdlib source);
  - ``--num-samples`` rows with heavy-tailed token lengths (target median ~640,
    p90 ~1.6k, p99 ~8.7k, max ~16k), 1-6 user/assistant exchanges, ~18% with a
    system message, ~10% pretrain, prose and fenced code as content. With
    ``--mix reasoning_tools`` the same rows, but every reply carries
    ``reasoning_content`` (a quarter of its tokens) and 40% of the chat rows open
    with a tool call and its result under a ``tools`` schema; they are rendered
    with Qwen3's real template (``fixtures/chat_templates``), which drops the
    reasoning of turns before the last user message. With ``--input-kind
    sharegpt_parquet`` the chat rows as ShareGPT ``conversations`` in a parquet file
    (written in row groups of 10k, so generating 1M rows holds 10k in memory);
    ``--length-scale`` shrinks every row's target length (0.1: median ~64 tokens),
    so a million rows fit a scale run.

Then times ``python process_data.py`` as a subprocess (process start to exit),
sampling the RSS of its whole process tree with psutil every 20 ms, and checks
every output row against an independent slow reference: ``apply_chat_template``
token-level incremental rendering (``input_ids`` equal, labels equal). Beside
it, in the same run, the Rust encode alone of the same texts on one core, with and
without character offsets: the faster of the two is the ceiling no tokenizing
pipeline can pass on this machine (the texts are streamed and encoded 1024 at a
time, only the encode timed, so it too runs in flat memory). Prints a table and
writes ``results.json`` in the work dir. Not part of the test suite.

``--baseline-dir`` times another checkout's ``process_data.py`` on the same
input in the same run, alternating with this one (``--repeats`` runs each,
the order flipped every round so drift in the machine's load hits both
sides alike), and reports the medians and their ratio.
"""

from __future__ import annotations

import ast
import json
import multiprocessing
import os
import random
import subprocess
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from minitrainer.common.cli import config_field, parse_config
from minitrainer.common.refusals import collect_errors
from minitrainer.common.labels import IGNORE_INDEX
from minitrainer.tools.tiny_model import build_tokenizer

ROOT = Path(__file__).resolve().parent.parent

CHARS_PER_TOKEN = {"prose": 4.3, "code": 3.4}


@dataclass
class BenchConfig:
    work_dir: str = config_field("/tmp/bench_process_data", help="dataset, tokenizer and outputs (reused)")
    num_samples: int = config_field(20000, help="rows in the generated dataset")
    num_proc: int = config_field(2, help="--num-proc passed to process_data.py")
    vocab_size: int = config_field(32000, help="BPE vocabulary of the ChatML tokenizer")
    seed: int = config_field(0, help="seed for the generated data")
    verify: bool = config_field(True, help="check every output row against the slow reference")
    regenerate: bool = config_field(False, help="rebuild the dataset and tokenizer even if present")
    baseline_dir: str | None = config_field(None, help="another checkout whose process_data.py is timed "
                                                      "on the same input, alternating with this one")
    repeats: int = config_field(1, help="timed runs of each side; medians are reported")
    mix: str = config_field("chat", choices=("chat", "reasoning_tools"),
                            help="chat: plain conversations; reasoning_tools: every reply with reasoning_content, "
                                 "40%% of rows with a tool call, rendered with Qwen3's template (no --verify)")
    input_kind: str = config_field("jsonl", choices=("jsonl", "sharegpt_parquet"),
                                   help="the generated input: messages JSON lines, or ShareGPT rows in parquet "
                                        "(chat rows only; no --verify)")
    length_scale: float = config_field(1.0, help="scales every row's target token length (0.1 for scale runs)")

    def __post_init__(self):
        errors = []
        if self.repeats < 1:
            errors.append(f"--repeats must be >= 1, got {self.repeats}")
        if self.input_kind != "jsonl" and self.mix != "chat":
            errors.append("--input-kind sharegpt_parquet takes --mix chat")
        if not self.length_scale > 0:
            errors.append(f"--length-scale must be positive, got {self.length_scale}")
        if self.baseline_dir and not (Path(self.baseline_dir) / "process_data.py").is_file():
            errors.append(f"--baseline-dir {self.baseline_dir} has no process_data.py")
        collect_errors(errors)


# ----------------------------------------------------------------------------
# Text sources: Python's own documentation (prose) and standard library (code)


def load_sources() -> tuple[str, str]:
    import pydoc_data.topics

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prose_parts = [text for text in pydoc_data.topics.topics.values()]
    code_parts = []
    for path in sorted(stdlib.glob("*.py")):
        source = path.read_text(encoding="utf-8", errors="replace")
        code_parts.append(source)
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:
                    prose_parts.append(doc)
    return "\n\n".join(prose_parts), "\n\n".join(code_parts)


def take(text: str, num_chars: int, rng: random.Random) -> str:
    """A slice of about ``num_chars`` starting and ending at whitespace, stripped."""
    num_chars = max(8, min(num_chars, len(text) - 1))
    start = rng.randrange(0, len(text) - num_chars)
    start = text.find(" ", start) + 1 if text.find(" ", start) >= 0 else start
    end = text.rfind(" ", start, start + num_chars)
    end = end if end > start else start + num_chars
    piece = text[start:end].strip()
    return piece or "Hello there, this is a sample."


def target_num_tokens(rng: random.Random) -> int:
    """Heavy tail: mostly log-normal around 640, 4% log-uniform from 1.5k up, capped at 16k."""
    if rng.random() < 0.04:
        return int(min(16000, np.exp(rng.uniform(np.log(1500), np.log(18000)))))
    return int(min(16000, max(24, rng.lognormvariate(np.log(640), 0.68))))


def make_content(num_tokens: int, prose: str, code: str, rng: random.Random, *, allow_code: bool) -> str:
    if allow_code and rng.random() < 0.3:
        lead = take(prose, int(0.3 * num_tokens * CHARS_PER_TOKEN["prose"]), rng)
        snippet = take(code, int(0.7 * num_tokens * CHARS_PER_TOKEN["code"]), rng)
        return f"{lead}\n\n```python\n{snippet}\n```"
    return take(prose, int(num_tokens * CHARS_PER_TOKEN["prose"]), rng)


QWEN3_TEMPLATE = ROOT / "fixtures" / "chat_templates" / "Qwen-Qwen3-0.6B.jinja"
BENCH_TOOLS = [{"type": "function", "function": {"name": "search_docs", "description": "Search the documentation.",
                                                 "parameters": {"type": "object", "properties": {
                                                     "query": {"type": "string"}}, "required": ["query"]}}}]


def add_reasoning_and_tools(row: dict, prose: str, rng: random.Random) -> dict:
    """The ``reasoning_tools`` mix: reasoning on every reply, a tool call before the first one in 40% of rows."""
    if row["messages"][0]["role"] == "pretrain":
        return row
    messages = []
    for message in row["messages"]:
        if message["role"] == "assistant":
            reasoning_chars = max(40, len(message["content"]) // 4)
            message = {**message, "reasoning_content": take(prose, reasoning_chars, rng)}
        messages.append(message)
    if rng.random() < 0.4:
        first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
        call = {"type": "function", "function": {"name": "search_docs",
                                                 "arguments": {"query": take(prose, 60, rng)}}}
        messages[first_user + 1:first_user + 1] = [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": take(prose, 400, rng)}]
        row = {**row, "tools": BENCH_TOOLS}
    return {**row, "messages": messages}


def make_row(index: int, prose: str, code: str, rng: random.Random, *, length_scale: float = 1.0,
             pretrain: bool = True) -> dict:
    total = target_num_tokens(rng) if length_scale == 1.0 else max(24, int(target_num_tokens(rng) * length_scale))
    if rng.random() < 0.10 and pretrain:
        source = code if rng.random() < 0.3 else prose
        kind = "code" if source is code else "prose"
        content = take(source, int(total * CHARS_PER_TOKEN[kind]), rng)
        return {"id": f"bench-{index}", "source": "pretrain", "messages": [{"role": "pretrain", "content": content}]}
    messages = []
    if rng.random() < 0.18:
        system_tokens = rng.randint(10, 120)
        messages.append({"role": "system", "content": take(prose, int(system_tokens * 4.3), rng)})
        total = max(24, total - system_tokens)
    num_turns = min(6, 1 + int(rng.expovariate(0.7)))
    per_turn = max(12, total // num_turns - 10)
    for _ in range(num_turns):
        user_tokens = max(4, int(per_turn * rng.uniform(0.1, 0.4)))
        messages.append({"role": "user", "content": make_content(user_tokens, prose, code, rng, allow_code=False)})
        messages.append({"role": "assistant",
                         "content": make_content(per_turn - user_tokens, prose, code, rng, allow_code=True)})
    return {"id": f"bench-{index}", "source": "chat", "messages": messages}


SHAREGPT_NAMES = {"system": "system", "user": "human", "assistant": "gpt"}
PARQUET_ROW_GROUP = 10_000


def to_sharegpt(row: dict) -> dict:
    return {"id": row["id"], "conversations": [{"from": SHAREGPT_NAMES[m["role"]], "value": m["content"]}
                                               for m in row["messages"]]}


def from_sharegpt(row: dict) -> list[dict]:
    roles = {name: role for role, name in SHAREGPT_NAMES.items()}
    return [{"role": roles[turn["from"]], "content": turn["value"]} for turn in row["conversations"]]


def input_name(config: BenchConfig) -> str:
    """The generated file's name: the default chat JSON lines keep their old name (reused by earlier runs)."""
    scale = "" if config.length_scale == 1.0 else f"_x{config.length_scale:g}"
    if config.input_kind == "sharegpt_parquet":
        return f"input_sharegpt_{config.num_samples}{scale}.parquet"
    return ("input" if config.mix == "chat" else f"input_{config.mix}") + scale + ".jsonl"


def write_sharegpt_parquet(config: BenchConfig, path: Path, prose: str, code: str, rng: random.Random) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    writer, rows = None, []
    for index in range(config.num_samples):
        rows.append(to_sharegpt(make_row(index, prose, code, rng, length_scale=config.length_scale, pretrain=False)))
        if len(rows) == PARQUET_ROW_GROUP or index == config.num_samples - 1:
            table = pa.Table.from_pylist(rows)
            writer = writer or pq.ParquetWriter(path, table.schema)
            writer.write_table(table)
            rows = []
    writer.close()


def build_inputs(config: BenchConfig, work: Path) -> tuple[Path, Path]:
    data_path = work / input_name(config)
    tokenizer_dir = work / "tokenizer"
    if data_path.exists() and (tokenizer_dir / "tokenizer.json").exists() and not config.regenerate:
        return data_path, tokenizer_dir
    work.mkdir(parents=True, exist_ok=True)
    prose, code = load_sources()
    rng = random.Random(config.seed)
    start = time.perf_counter()
    corpus = [take(prose, 2000, rng) for _ in range(3000)] + [take(code, 2000, rng) for _ in range(1500)]
    if not (tokenizer_dir / "tokenizer.json").exists() or config.regenerate:
        build_tokenizer("chatml", tokenizer_dir, vocab_size=config.vocab_size, corpus=corpus)
        print(f"trained {config.vocab_size}-token ChatML tokenizer in {time.perf_counter() - start:.0f}s")
    if config.input_kind == "sharegpt_parquet":
        write_sharegpt_parquet(config, data_path, prose, code, rng)
    else:
        with open(data_path, "w") as f:
            for index in range(config.num_samples):
                row = make_row(index, prose, code, rng, length_scale=config.length_scale)
                if config.mix == "reasoning_tools":
                    row = add_reasoning_and_tools(row, prose, rng)
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {config.num_samples} rows to {data_path} ({data_path.stat().st_size / 2**20:.0f} MiB)")
    return data_path, tokenizer_dir


# ----------------------------------------------------------------------------
# Timing


def run_timed(command: list[str], cwd: Path = ROOT) -> tuple[float, float, float, int]:
    """(wall s, CPU s of the tree, peak RSS of the tree in GiB, exit code); RSS sampled every 50 ms.

    The CPU time (user + sys of every reaped descendant) is what contention from
    other jobs on the machine distorts least; wall clock is the headline figure.
    The command's output goes to a file, not a pipe read at the end: a run long enough for
    its progress bar to fill the 64 KiB pipe buffer would block on it (1M rows did, for minutes).
    """
    import resource
    import tempfile

    import psutil

    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    output = tempfile.TemporaryFile()
    proc = subprocess.Popen(command, cwd=cwd, stdout=output, stderr=subprocess.STDOUT)
    parent = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            tree = [parent] + parent.children(recursive=True)
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.05)
    wall = time.perf_counter() - start
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    output.seek(0)
    if proc.returncode != 0:
        print(output.read().decode(errors="replace"))
    output.close()
    return wall, cpu, peak / 2**30, proc.returncode


# ----------------------------------------------------------------------------
# Slow reference: token-level incremental apply_chat_template


_TOKENIZER = None


def _init_reference(tokenizer_dir: str) -> None:
    global _TOKENIZER
    from transformers import AutoTokenizer

    _TOKENIZER = AutoTokenizer.from_pretrained(tokenizer_dir)


def reference_labels(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Labels from token-level diffs: each assistant turn's tokens up to and including the EOS."""
    def ids(msgs, add_generation_prompt=False):
        return list(tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=add_generation_prompt)
                    ["input_ids"])

    if messages[0]["role"] == "pretrain":
        input_ids = tokenizer.encode(messages[0]["content"], add_special_tokens=False) + [tokenizer.eos_token_id]
        return input_ids, list(input_ids)
    input_ids = ids(messages)
    labels = [IGNORE_INDEX] * len(input_ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, after = ids(messages[:i], True), ids(messages[: i + 1])
        assert after[: len(before)] == before and input_ids[: len(after)] == after, "not token-incremental"
        end = after.index(tokenizer.eos_token_id, len(before)) + 1
        labels[len(before):end] = input_ids[len(before):end]
    return input_ids, labels


def _verify_pair(pair: tuple[bytes, bytes]) -> str | None:
    in_line, out_line = pair
    row, out = json.loads(in_line), json.loads(out_line)
    try:
        input_ids, labels = reference_labels(_TOKENIZER, row["messages"])
    except AssertionError as err:
        return f"{row['id']}: reference failed: {err}"
    if out["input_ids"] != input_ids:
        return f"{row['id']}: input_ids differ from apply_chat_template"
    if out["labels"] != labels:
        return f"{row['id']}: labels differ from the reference"
    if out["len"] != len(input_ids) or out["num_loss_counted_tokens"] != sum(x != IGNORE_INDEX for x in labels):
        return f"{row['id']}: len / num_loss_counted_tokens wrong"
    if out["id"] != row["id"] or out["source"] != row["source"]:
        return f"{row['id']}: carried fields lost"
    return None


def verify(input_path: Path, output_dir: Path, tokenizer_dir: Path, num_proc: int) -> tuple[int, list[str]]:
    """Check every written row; rejected input lines (none expected) are skipped."""
    with open(output_dir / "rejected.jsonl") as f:
        rejected = {json.loads(line)["line"] for line in f}
    with open(input_path, "rb") as fin, open(output_dir / "data.jsonl", "rb") as fout:
        kept = (line for line_no, line in enumerate(fin, 1) if line_no not in rejected)
        pairs = list(zip(kept, fout))
    with multiprocessing.get_context("fork").Pool(num_proc, _init_reference, (str(tokenizer_dir),)) as pool:
        problems = [p for p in pool.imap(_verify_pair, pairs, chunksize=64) if p]
    return len(pairs), problems


def input_messages(input_path: Path):
    """Each input row's messages, streamed (JSON lines, or ShareGPT parquet converted back)."""
    if input_path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(input_path, pre_buffer=False).iter_batches(batch_size=ENCODE_BATCH):
            for row in batch.to_pylist():
                yield from_sharegpt(row)
        return
    with open(input_path, "rb") as f:
        for line in f:
            yield json.loads(line)["messages"]


ENCODE_BATCH = 1024


def encode_alone(input_path: Path, tokenizer_dir: Path, with_offsets: bool) -> dict[str, float]:
    """Samples/s, tokens/s and samples per CPU-second of the Rust encode alone on one core, over the
    whole dataset: with character offsets (``encode_batch``, what a masker uses: labels are character
    spans of the rendering mapped to tokens) or without (``encode_batch_fast``).

    Texts are rendered with the public ``apply_chat_template`` (untimed) and encoded ``ENCODE_BATCH``
    at a time: no parsing, masking or writing. Meant for a fresh process of its own (``encode_ceiling``).
    """
    import itertools

    from transformers import AutoTokenizer

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core, like one worker process
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    backend = tokenizer.backend_tokenizer
    encode = backend.encode_batch if with_offsets else backend.encode_batch_fast
    num_texts, num_tokens, wall, cpu = 0, 0, 0.0, 0.0
    rows = input_messages(input_path)
    while batch := list(itertools.islice(rows, ENCODE_BATCH)):
        texts = [messages[0]["content"] if messages[0]["role"] == "pretrain"
                 else tokenizer.apply_chat_template(messages, tokenize=False) for messages in batch]
        start, start_cpu = time.perf_counter(), time.process_time()
        encodings = encode(texts, add_special_tokens=False)
        wall += time.perf_counter() - start
        cpu += time.process_time() - start_cpu
        num_texts += len(texts)
        num_tokens += sum(len(encoding.ids) for encoding in encodings)
    return {"samples_per_s": num_texts / wall, "tokens_per_s": num_tokens / wall, "samples_per_cpu_s": num_texts / cpu}


def encode_ceiling(input_path: Path, tokenizer_dir: Path) -> dict[str, dict[str, float]]:
    """``encode_alone`` without offsets (``bare``) and with (``with_offsets``), each in a fresh process.

    No tokenizer pipeline can go faster per core than the faster of the two, so ``--num-proc`` times
    that is the ceiling for ``process_data.py``. Timed in one process, the two encodes changed each
    other's speed (one BPE cache, one heap): on full-length rows the bare encode measured 565 samples
    per CPU-second there, 737 alone. On a machine other jobs load, wall clock undercounts the
    ceiling; CPU time (the single-threaded process's own) does not, and is compared with
    ``process_data.py``'s.
    """
    import multiprocessing

    encodes = {}
    for name in ("bare", "with_offsets"):
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            encodes[name] = pool.apply(encode_alone, (input_path, tokenizer_dir, name == "with_offsets"))
    return encodes


def main(argv: list[str] | None = None) -> None:
    config = parse_config(BenchConfig, argv, description="benchmark process_data.py")
    work = Path(config.work_dir)
    input_path, tokenizer_dir = build_inputs(config, work)
    output_dir = work / "output"
    sides = {"this": (ROOT, output_dir)}
    if config.baseline_dir:
        sides["baseline"] = (Path(config.baseline_dir).resolve(), work / "output_baseline")
    timings: dict[str, list[tuple[float, float, float]]] = {side: [] for side in sides}
    # The older process_data.py has no label audit; this side's audit must not stop the timing run.
    template_args = [] if config.mix == "chat" else ["--chat-template", str(QWEN3_TEMPLATE)]
    audit_args = {"this": ["--allow-audit-failures"], "baseline": []}
    for round_index in range(config.repeats):
        for side in list(sides)[:: 1 if round_index % 2 == 0 else -1]:
            root, out = sides[side]
            command = [sys.executable, str(root / "process_data.py"), "--input-file", str(input_path),
                       "--output-dir", str(out), "--model-name-or-path", str(tokenizer_dir),
                       "--num-proc", str(config.num_proc), "--overwrite", *template_args,
                       *audit_args[side]]
            wall, cpu, peak_gib, returncode = run_timed(command, cwd=root)
            if returncode != 0:
                raise SystemExit(f"{root / 'process_data.py'} exited with {returncode}")
            timings[side].append((wall, cpu, peak_gib))
            print(f"round {round_index + 1} {side}: wall {wall:.2f}s, CPU {cpu:.2f}s")
    wall, cpu, peak_gib = (float(np.median([t[k] for t in timings["this"]])) for k in range(3))
    command = [sys.executable, str(ROOT / "process_data.py"), "--input-file", str(input_path),
               "--output-dir", str(output_dir), "--model-name-or-path", str(tokenizer_dir),
               "--num-proc", str(config.num_proc), "--overwrite", *template_args]
    summary = json.loads((output_dir / "summary.json").read_text())
    num_samples = summary["num_lines"]
    results = {
        "command": " ".join(command),
        "num_samples": num_samples,
        "num_written": summary["num_written"],
        "num_rejected": summary["num_rejected"],
        "num_tokens": summary["num_tokens"],
        "len": summary["len"],
        "wall_s": round(wall, 2),
        "samples_per_s": round(num_samples / wall, 1),
        "tokens_per_s": round(summary["num_tokens"] / wall),
        "cpu_s": round(cpu, 2),
        "samples_per_cpu_s": round(num_samples / cpu, 1),
        "peak_rss_tree_gib": round(peak_gib, 3),
        "load_average_1min_after": round(os.getloadavg()[0], 2),
        "runs": {side: [{"wall_s": round(w, 2), "cpu_s": round(c, 2)} for w, c, _ in runs]
                 for side, runs in timings.items()},
        "config": asdict(config),
    }
    if "baseline" in timings:
        base_wall, base_cpu = (float(np.median([t[k] for t in timings["baseline"]])) for k in range(2))
        results["baseline"] = {"dir": str(sides["baseline"][0]), "wall_s": round(base_wall, 2),
                               "cpu_s": round(base_cpu, 2), "samples_per_s": round(num_samples / base_wall, 1),
                               "samples_per_cpu_s": round(num_samples / base_cpu, 1),
                               "speed_vs_baseline_wall": round(base_wall / wall, 3),
                               "speed_vs_baseline_cpu": round(base_cpu / cpu, 3)}
    encodes = encode_ceiling(input_path, tokenizer_dir)
    fastest = max(encodes.values(), key=lambda encode: encode["samples_per_cpu_s"])
    ceiling = config.num_proc * fastest["samples_per_s"]
    results["encode_one_core"] = {name: {key: round(value, 1) for key, value in encode.items()}
                                  for name, encode in encodes.items()}
    results["ceiling_samples_per_s"] = round(ceiling, 1)
    results["share_of_ceiling"] = round(results["samples_per_s"] / ceiling, 3)
    # The same share in CPU time: what the pipeline costs per sample against the encode alone, whatever
    # share of the cores other jobs took meanwhile.
    results["share_of_ceiling_cpu"] = round(results["samples_per_cpu_s"] / fastest["samples_per_cpu_s"], 3)
    if config.verify and config.input_kind != "jsonl":
        print("--verify skipped: the slow reference reads messages JSON lines")
    elif config.verify and config.mix != "chat":
        print("--verify skipped: the slow reference is incremental, Qwen3's template is not")
    elif config.verify:
        start = time.perf_counter()
        num_checked, problems = verify(input_path, output_dir, tokenizer_dir, config.num_proc)
        results["verified_rows"] = num_checked
        results["verify_problems"] = problems[:20]
        results["num_verify_problems"] = len(problems)
        print(f"verified {num_checked} rows against the slow reference in {time.perf_counter() - start:.0f}s: "
              f"{len(problems)} problem(s)")
    rows = [("samples", num_samples), ("tokens", summary["num_tokens"]),
            ("len p50 / p90 / p99 / max", "{p50:.0f} / {p90:.0f} / {p99:.0f} / {max}".format(**summary["len"])),
            ("wall clock (s)", results["wall_s"]), ("samples/s", results["samples_per_s"]),
            ("tokens/s", results["tokens_per_s"]), ("CPU time, process tree (s)", results["cpu_s"]),
            ("samples per CPU-second", results["samples_per_cpu_s"]),
            ("peak RSS, process tree (GiB)", results["peak_rss_tree_gib"]),
            *((f"encode {name.replace('_', ' ')}, one core: samples/s, samples per CPU-s",
               f"{encode['samples_per_s']} / {encode['samples_per_cpu_s']}")
              for name, encode in results["encode_one_core"].items()),
            (f"ceiling: {config.num_proc} x the faster encode (samples/s)", results["ceiling_samples_per_s"]),
            ("share of the ceiling reached", results["share_of_ceiling"]),
            ("share of the ceiling, in CPU time", results["share_of_ceiling_cpu"]),
            ("load average after (1 min)", results["load_average_1min_after"])]
    if "verified_rows" in results:
        rows.append(("rows verified / problems", f"{results['verified_rows']} / {results['num_verify_problems']}"))
    if "baseline" in results:
        base = results["baseline"]
        rows += [(f"baseline samples/s (median of {config.repeats})", base["samples_per_s"]),
                 ("baseline samples per CPU-second", base["samples_per_cpu_s"]),
                 ("speed vs baseline: wall / CPU",
                  f"{base['speed_vs_baseline_wall']} / {base['speed_vs_baseline_cpu']}")]
    width = max(len(name) for name, _ in rows)
    print(f"\nprocess_data.py, --num-proc {config.num_proc}")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    (work / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {work / 'results.json'}")
    if results.get("num_verify_problems"):
        raise SystemExit("\n".join(problems[:20]))


if __name__ == "__main__":
    main()
