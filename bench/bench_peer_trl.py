"""process_data.py and TRL's SFTTrainer data preparation side by side: speed, memory, same labels.

    .venv/bin/pip install trl==1.16.0        # not a dependency of the toolkit; the bench says so without it
    .venv/bin/python -m bench.bench_peer_trl --num-samples 200000 --length-scale 0.1 --repeats 3

The input is ``bench.bench_process_data``'s ShareGPT parquet (built once in ``--work-dir`` and shared
with that bench), rewritten untimed as ``messages`` rows with ``user``/``assistant`` roles: TRL's
ShareGPT conversion renames the keys but keeps ``human``/``gpt`` as roles, so no turn is an assistant
turn and ``assistant_only_loss`` refuses the rows: a TRL user converts the roles first. Both sides read that parquet file:

- this toolkit: ``python process_data.py --num-proc N``, timed from process start to exit;
- TRL: ``SFTTrainer._prepare_dataset`` with ``assistant_only_loss=True`` and ``dataset_num_proc=N``
  (the code ``SFTTrainer.__init__`` runs on a train dataset), after ``datasets.load_dataset("parquet")``
  into a fresh cache, timed from process start to the end of the preparation. TRL's masking needs
  ``{% generation %}`` tags, so it is given the tokenizer's ChatML template with the reply and its
  ``<|im_end|>`` tagged: the same text, the same learned tokens as this toolkit's rule.

Plain-string prompt/completion rows (no template) are compared with TRL row by row, on real tokenizers, by
``tests/test_trl_boundary.py`` (through ``sft_prepare``): the completion starts where the tokens of the prompt
alone and of prompt + completion diverge, on both sides.

Runs alternate (``--repeats`` each, the order flipped every round); medians are reported with the
CPU time and the peak RSS of each process tree. Then every row of the last run of each side is
compared: ``input_ids`` and ``labels`` must be equal (the bench fails otherwise). Not part of the
test suite.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.bench_process_data import PARQUET_ROW_GROUP, BenchConfig, build_inputs, input_messages, run_timed
from minitrainer.common.cli import config_field, parse_config

ROOT = Path(__file__).resolve().parent.parent

# The bench tokenizer's ChatML template with each reply and its end-of-turn between generation tags.
TAGGED_CHATML = (
    "{%- for message in messages %}{%- if message['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@dataclass
class PeerConfig:
    work_dir: str = config_field("/tmp/bench_process_data", help="dataset and tokenizer of bench_process_data (reused)")
    num_samples: int = config_field(200000, help="rows in the generated ShareGPT parquet")
    length_scale: float = config_field(0.1, help="scales every row's target token length (as in bench_process_data)")
    num_proc: int = config_field(2, help="worker processes of each side")
    repeats: int = config_field(1, help="timed runs of each side; medians are reported")


def write_messages_parquet(sharegpt: Path, out: Path) -> None:
    """The ShareGPT rows as ``messages`` rows (roles user/assistant/system), a row group at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    conversations = input_messages(sharegpt)
    writer = None
    while batch := list(itertools.islice(conversations, PARQUET_ROW_GROUP)):
        table = pa.Table.from_pylist([{"messages": messages} for messages in batch])
        writer = writer or pq.ParquetWriter(out, table.schema)
        writer.write_table(table)
    writer.close()


def sft_prepare(dataset, tokenizer, *, output_dir: str, chat_template: str | None, assistant_only_loss: bool,
                completion_only_loss: bool | None, num_proc: int | None):
    """TRL's ``SFTTrainer`` data preparation of ``dataset`` (the code ``SFTTrainer.__init__`` runs on a train
    dataset): ``input_ids`` and ``labels`` per row. Also used by tests/test_trl_boundary.py."""
    import types

    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=output_dir, assistant_only_loss=assistant_only_loss, dataset_num_proc=num_proc,
                     max_length=None, report_to=[], use_cpu=True, bf16=False)
    # _prepare_dataset reads these three attributes of the trainer; a model is not needed to prepare data.
    trainer = types.SimpleNamespace(_tokenizer=tokenizer, chat_template=chat_template,
                                    completion_only_loss=completion_only_loss)
    return SFTTrainer._prepare_dataset(trainer, dataset, tokenizer, args, False, None, "train")


def trl_prepare(input_path: str, tokenizer_dir: str, num_proc: int, cache_dir: str, save_to: str,
                timing_path: str) -> None:
    """Run in its own process: load the parquet and prepare it as SFTTrainer does; write the timing as JSON."""
    import os
    import resource

    import psutil

    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import datasets
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    dataset = datasets.load_dataset("parquet", data_files=input_path, split="train", cache_dir=cache_dir)
    prepared = sft_prepare(dataset, tokenizer, output_dir=cache_dir, chat_template=TAGGED_CHATML,
                           assistant_only_loss=True, completion_only_loss=None, num_proc=num_proc)
    wall = time.time() - psutil.Process().create_time()
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    Path(timing_path).write_text(json.dumps({"wall_s": wall, "cpu_s": cpu, "rows": len(prepared)}))
    prepared.select_columns(["input_ids", "labels"]).save_to_disk(save_to)


def compare(ours: Path, theirs: Path) -> tuple[int, int]:
    """(rows, rows whose input_ids or labels differ or that one side lacks): process_data's JSON lines
    against TRL's prepared dataset, row by row."""
    import datasets

    prepared = datasets.load_from_disk(str(theirs))
    num_rows = num_diff = 0
    with open(ours, "rb") as f:
        for line, row in itertools.zip_longest(f, prepared):
            num_rows += 1
            if line is None or row is None:
                num_diff += 1
                continue
            ours_row = json.loads(line)
            num_diff += ours_row["input_ids"] != row["input_ids"] or ours_row["labels"] != row["labels"]
    return num_rows, num_diff


def main(argv: list[str] | None = None) -> None:
    import shutil
    import tempfile

    config = parse_config(PeerConfig, argv, description="process_data.py vs TRL's SFTTrainer data preparation")
    try:
        import trl
    except ImportError:
        raise SystemExit("TRL is not installed: pip install trl (the bench was measured with 1.16.0)") from None
    work = Path(config.work_dir)
    sharegpt, tokenizer_dir = build_inputs(BenchConfig(work_dir=config.work_dir, num_samples=config.num_samples,
                                                       length_scale=config.length_scale,
                                                       input_kind="sharegpt_parquet"), work)
    messages = sharegpt.with_name(sharegpt.stem.replace("sharegpt", "messages") + ".parquet")
    if not messages.exists():
        write_messages_parquet(sharegpt, messages)
    ours_out, trl_out = work / "output_peer", work / "output_trl"
    timings: dict[str, list[tuple[float, float, float]]] = {"this": [], "trl": []}
    for round_index in range(config.repeats):
        for side in ("this", "trl")[:: 1 if round_index % 2 == 0 else -1]:
            if side == "this":
                command = [sys.executable, str(ROOT / "process_data.py"), "--input-file", str(messages),
                           "--output-dir", str(ours_out), "--model-name-or-path", str(tokenizer_dir),
                           "--num-proc", str(config.num_proc), "--overwrite"]
                wall, cpu, peak, returncode = run_timed(command)
                if returncode != 0:
                    raise SystemExit(f"process_data.py exited with {returncode}")
            else:
                cache = tempfile.mkdtemp(prefix="trl_cache_", dir=work)
                shutil.rmtree(trl_out, ignore_errors=True)
                timing = work / "trl_timing.json"
                code = (f"from bench.bench_peer_trl import trl_prepare; trl_prepare({str(messages)!r}, "
                        f"{str(tokenizer_dir)!r}, {config.num_proc}, {cache!r}, {str(trl_out)!r}, {str(timing)!r})")
                _, _, peak, returncode = run_timed([sys.executable, "-c", code])
                shutil.rmtree(cache, ignore_errors=True)
                if returncode != 0:
                    raise SystemExit("the TRL side failed (its output is printed above)")
                measured = json.loads(timing.read_text())
                wall, cpu = measured["wall_s"], measured["cpu_s"]
            timings[side].append((wall, cpu, peak))
            print(f"round {round_index + 1} {side}: wall {wall:.2f}s, CPU {cpu:.2f}s, peak RSS {peak:.3f} GiB")
    num_rows, num_diff = compare(ours_out / "data.jsonl", trl_out)
    results = {"trl_version": trl.__version__, "num_rows": num_rows, "rows_differing": num_diff,
               "config": vars(config)}
    for side, runs in timings.items():
        wall, cpu, peak = (statistics.median(run[k] for run in runs) for k in range(3))
        results[side] = {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "samples_per_s": round(num_rows / wall, 1),
                         "samples_per_cpu_s": round(num_rows / cpu, 1), "peak_rss_tree_gib": round(peak, 3),
                         "runs": [[round(v, 2) for v in run] for run in runs]}
    results["speed_this_vs_trl_wall"] = round(results["trl"]["wall_s"] / results["this"]["wall_s"], 2)
    results["speed_this_vs_trl_cpu"] = round(results["trl"]["cpu_s"] / results["this"]["cpu_s"], 2)
    (work / "peer_trl_results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    if num_diff:
        raise SystemExit(f"{num_diff} of {num_rows} rows differ between process_data.py and TRL")


if __name__ == "__main__":
    main()
