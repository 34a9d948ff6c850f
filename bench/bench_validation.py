"""Cost of the validation pass on the demo model and data, and training throughput with and without it.

    .venv/bin/python -m bench.bench_validation --nproc 2 --max-steps 30 --every 5

Builds the demo's tokenizer and random model (demo.py) and tokenizes
data/demo_chat.jsonl, then runs train.py twice under torchrun with the same
settings: once with ``--validation-split FRACTION --validation-every-n-steps N``
and once without validation. From the metrics files it reports the median
validation pass time against the median training step time (and per token),
and samples/s over the run (first to last step line, so the validation passes
in between are included) side by side. Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from minitrainer.tools.demo import DEMO_DATA, DemoConfig, build_demo_model

ROOT = Path(__file__).resolve().parent.parent


def run(args: argparse.Namespace, model: Path, data: Path, out: Path, *extra: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}", str(ROOT / "train.py"),
           "--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out),
           "--batch-size", str(args.batch_size), "--max-tokens-per-gpu", str(args.max_tokens_per_gpu),
           "--min-samples-per-checkpoint", str(10**9), "--max-steps", str(args.max_steps), "--num-data-workers",
           "0", "--learning-rate", "1e-3", "--no-activation-checkpointing", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": args.gpus}
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if result.returncode != 0:
        raise SystemExit(result.stderr[-4000:])
    return [json.loads(line) for line in (out / "training_metrics_0.jsonl").read_text().splitlines()]


def summarise(records: list[dict]) -> dict:
    steps = [r for r in records if "loss" in r]
    vals = [r for r in records if "val_loss" in r]
    # Validation passes between the first and last step line count against throughput.
    window = steps[-1]["timestamp"] - steps[0]["timestamp"]
    samples = steps[-1]["samples_seen"] - steps[0]["samples_seen"]
    summary = {"num_steps": len(steps), "median_step_s": float(np.median([r["time_per_batch"] for r in steps])),
               "median_step_tokens": float(np.median([r["num_total_tokens"] for r in steps])),
               "samples_per_s": samples / window, "num_validations": len(vals)}
    if vals:
        summary.update(median_val_s=float(np.median([r["val_time_s"] for r in vals])),
                       val_samples=vals[0]["val_num_samples"], val_loss_tokens=vals[0]["val_num_loss_counted_tokens"])
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="processes (ranks)")
    parser.add_argument("--max-steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--every", type=int, default=5, help="--validation-every-n-steps of the validated run")
    parser.add_argument("--split", type=float, default=0.1, help="--validation-split of the validated run")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per step (the demo's)")
    parser.add_argument("--max-tokens-per-gpu", type=int, default=1024, help="token budget (the demo's)")
    parser.add_argument("--gpus", default="", help="CUDA_VISIBLE_DEVICES for the runs ('' = CPU)")
    parser.add_argument("--json", default="bench/bench_validation.json", help="where to write results")
    args = parser.parse_args()

    from minitrainer.data.process_data import ProcessDataConfig, process_data

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_demo_model(tmp / "model", DemoConfig())
        process_data(ProcessDataConfig(input_file=str(DEMO_DATA), output_dir=str(tmp / "data"),
                                       model_name_or_path=str(model), num_proc=1, num_printed_samples=0))
        with_val = summarise(run(args, model, tmp / "data", tmp / "val", "--validation-split", str(args.split),
                                 "--validation-every-n-steps", str(args.every)))
        without = summarise(run(args, model, tmp / "data", tmp / "none"))
    results = {"args": vars(args), "with_validation": with_val, "without_validation": without,
               "val_pass_over_train_step": with_val["median_val_s"] / with_val["median_step_s"],
               "throughput_ratio": with_val["samples_per_s"] / without["samples_per_s"]}
    print(f"validation set: {with_val['val_samples']} samples, {with_val['val_loss_tokens']} loss tokens "
          f"({args.split:g} of the demo data); training step: {args.batch_size} samples, "
          f"~{with_val['median_step_tokens']:.0f} tokens")
    print(f"one validation pass: {with_val['median_val_s']:.3f} s = "
          f"{results['val_pass_over_train_step']:.2f} x one training step ({with_val['median_step_s']:.3f} s)")
    print(f"{'':32}{'samples/s':>12}{'validations':>14}")
    print(f"{'every ' + str(args.every) + ' steps':32}{with_val['samples_per_s']:>12.1f}{with_val['num_validations']:>14}")
    print(f"{'none':32}{without['samples_per_s']:>12.1f}{without['num_validations']:>14}")
    print(f"throughput with validation / without: {results['throughput_ratio']:.3f}")
    Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
