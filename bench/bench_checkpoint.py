"""Time and disk cost of a full-state save, a resume, and a Hugging Face export.

    .venv/bin/python -m bench.bench_checkpoint --nproc 2 --hidden-size 256 --num-layers 4

Builds a random model of the given shape (tiny_model.py), trains 2 steps with
a checkpoint after each (2 gloo CPU processes, or one process per GPU when
run on a GPU node), then re-runs the same command for 1 more step so it
resumes; parses the trainer's own timing lines. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from minitrainer.tools.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parent.parent

SAVE_LINE = re.compile(r"saved (Hugging Face checkpoint|full training state) (\S+) in ([\d.]+)s \(([\d.]+) MB\)")
RESUME_LINE = re.compile(r"resume took ([\d.]+)s")


def write_data(path: Path, vocab_size: int, num_samples: int = 64) -> None:
    rng = np.random.default_rng(0)
    with path.open("w") as f:
        for _ in range(num_samples):
            ids = rng.integers(0, vocab_size, size=int(rng.integers(16, 128))).tolist()
            f.write(json.dumps({"input_ids": ids, "labels": ids}) + "\n")


def run(args: argparse.Namespace, model: Path, data: Path, out: Path, max_steps: int) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}", str(ROOT / "train.py"),
           "--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out),
           "--batch-size", "8", "--max-tokens-per-gpu", "512", "--min-samples-per-checkpoint", "8",
           "--max-steps", str(max_steps), "--num-data-workers", "0", "--learning-rate", "1e-4"]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": args.gpus})
    if result.returncode != 0:
        raise SystemExit(result.stderr[-4000:])
    return result.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="processes (ranks)")
    parser.add_argument("--hidden-size", type=int, default=256, help="model width")
    parser.add_argument("--num-layers", type=int, default=4, help="decoder blocks")
    parser.add_argument("--vocab-size", type=int, default=4096, help="tokenizer vocabulary to train")
    parser.add_argument("--gpus", default="", help="CUDA_VISIBLE_DEVICES for the runs ('' = CPU)")
    parser.add_argument("--json", default="bench/bench_checkpoint.json", help="where to write results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_tiny_model("chatml", tmp / "model", vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                                 num_layers=args.num_layers, intermediate_size=4 * args.hidden_size)
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model).vocab_size
        write_data(tmp / "data.jsonl", vocab)
        first = run(args, model, tmp / "data.jsonl", tmp / "out", max_steps=2)
        second = run(args, model, tmp / "data.jsonl", tmp / "out", max_steps=3)
    saves = [(kind, float(sec), float(mb)) for kind, _, sec, mb in SAVE_LINE.findall(first)]
    results = {
        "nproc": args.nproc, "hidden_size": args.hidden_size, "num_layers": args.num_layers, "vocab_size": vocab,
        "hf_export_s": [s for k, s, _ in saves if k.startswith("Hugging")],
        "hf_export_mb": [m for k, _, m in saves if k.startswith("Hugging")][-1],
        "full_state_s": [s for k, s, _ in saves if k.startswith("full")],
        "full_state_mb": [m for k, _, m in saves if k.startswith("full")][-1],
        "resume_s": float(RESUME_LINE.search(second).group(1)),
    }
    print(f"{'what':<22}{'seconds':>20}{'MB':>10}")
    print(f"{'HF export (bf16)':<22}{str(results['hf_export_s']):>20}{results['hf_export_mb']:>10.1f}")
    print(f"{'full state (fp32+adam)':<22}{str(results['full_state_s']):>20}{results['full_state_mb']:>10.1f}")
    print(f"{'resume':<22}{results['resume_s']:>20.2f}")
    Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
