"""Collectives per optimizer step, counted on the real training loop (2 gloo CPU ranks).

    python -m bench.bench_collectives                         # this checkout
    python -m bench.bench_collectives --repo /tmp/before      # another checkout, same model and data

Every rank runs ``train.py`` with ``torch.distributed``'s collective functions
wrapped by counters (FSDP2 looks them up on the module at call time, so the
wrappers see every all-gather, reduce-scatter and all-reduce it issues, plus
the trainer's own). Each strategy runs for 1 and for 2 optimizer steps; the
difference is one step's collectives, without start-up and the final export.
The budget forces several packed minibatches per step (the reported
``grad_accum``). Writes ``bench/collectives_results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COUNTED = ("all_gather_into_tensor", "all_gather_single", "all_gather", "reduce_scatter_tensor",
           "reduce_scatter_single", "all_reduce", "broadcast", "broadcast_object_list", "all_gather_object",
           "barrier")


def _worker(repo: Path, counts_path: Path, argv: list[str]) -> None:
    """Inside torchrun: count collective calls while train.py runs."""
    import torch.distributed as dist

    counts: Counter = Counter()
    for name in COUNTED:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(*args, __name=name, __original=original, **kwargs):
            counts[__name] += 1
            return __original(*args, **kwargs)

        setattr(dist, name, counted)
    sys.argv = [str(repo / "train.py"), *argv]
    import train  # the root entry script of the checkout under count, any version: PYTHONPATH=repo (see _run)

    train.main(argv)
    if os.environ.get("RANK", "0") == "0":
        counts_path.write_text(json.dumps(dict(counts)))


def _run(repo: Path, work: Path, strategy: str, steps: int, model: Path, data: Path) -> dict:
    out = work / f"{repo.name}_{strategy}_{steps}"
    counts_path = out.with_suffix(".json")
    train_args = ["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out),
                  "--batch-size", "12", "--max-tokens-per-gpu", "64", "--max-steps", str(steps),
                  "--min-samples-per-checkpoint", "1000000", "--num-data-workers", "0", "--no-resume",
                  "--fsdp-sharding-strategy", strategy, "--lr-scheduler", "constant", "--num-warmup-steps", "0"]
    # The worker is this file run by its path (it imports nothing of this checkout) and `train` comes from
    # the checkout under count, whose root is the workers' only import root: PYTHONPATH, as `python -m` would.
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
               str(Path(__file__).resolve()), "--worker", str(repo), str(counts_path), "--", *train_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(repo)}
    result = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{repo} {strategy} failed:\n{result.stderr[-4000:]}")
    metrics = [json.loads(line) for line in (out / "training_metrics_0.jsonl").read_text().splitlines()]
    return {"counts": json.loads(counts_path.read_text()), "grad_accum": metrics[-1]["grad_accum"]}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        split = sys.argv.index("--")
        _worker(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[split + 1:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", default=str(ROOT), help="checkout whose train.py is counted")
    parser.add_argument("--strategies", default="FULL_SHARD,SHARD_GRAD_OP,NO_SHARD")
    parser.add_argument("--output-json", default=str(ROOT / "bench" / "collectives_results.json"))
    args = parser.parse_args()
    from fixtures.e2e import write_tokenized_jsonl
    from minitrainer.tools.tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="bench_collectives_"))
    model = build_tiny_model("chatml", work / "model")
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    data = write_tokenized_jsonl(work / "data.jsonl", num_samples=40, vocab_size=vocab, seed=1)
    repo = Path(args.repo).resolve()
    results = {}
    print(f"{repo}: collectives in one optimizer step (rank 0), 12 samples, 64-token budget, 2 ranks")
    for strategy in args.strategies.split(","):
        one, two = (_run(repo, work, strategy, steps, model, data) for steps in (1, 2))
        per_step = {name: two["counts"].get(name, 0) - one["counts"].get(name, 0)
                    for name in sorted(set(one["counts"]) | set(two["counts"]))}
        per_step = {name: n for name, n in per_step.items() if n}
        results[strategy] = {"grad_accum_step2": two["grad_accum"], "per_step": per_step,
                             "total": sum(per_step.values())}
        print(f"{strategy:<14} grad_accum {two['grad_accum']}: total {sum(per_step.values())}  {per_step}")
    Path(args.output_json).write_text(json.dumps({"repo": str(repo), "results": results}, indent=2))


if __name__ == "__main__":
    main()
