"""OSFT against full fine-tuning: step time and peak memory side by side, and how much each forgets.

    python -m bench.bench_osft                                   # CPU: both parts, a few minutes
    python -m bench.bench_osft --part speed --hidden-size 512 --num-layers 4 --max-tokens-per-gpu 4096
    python -m bench.bench_osft --part forgetting --phase-two-steps 120
    python -m bench.bench_osft --part svd --svd-shapes 1536x8960,4096x4096,4096x14336 [--svd-device cuda]

``speed``: a random Qwen2-style model (``tiny_model.build_model``) trains with ``train.py`` as full
fine-tuning and as ``--osft --osft-unfreeze-rank-ratio 0.25`` on the same data and flags, runs
alternating so machine load hits both alike; reported per mode: median ``time_per_batch`` over the
steps after the first, the metrics' ``peak_memory_usage_GB`` (GPU peak; on CPU the peak RSS) and the
process tree's peak RSS. Also one layer alone (forward and backward of an N x N projection over T tokens):
dense, OSFT through the factors, and OSFT rebuilding W first (what ``OSFTLinear`` picks by FLOPs).

``forgetting``: two synthetic "languages" A and B, each a random sparse Markov chain over the
vocabulary (every token has ``--num-successors`` successors; the best possible loss is
ln(num_successors)). A random model learns A (phase one, full fine-tuning); from that export,
phase two trains on B once with full fine-tuning and once with OSFT. Reported: A's held-out loss
before and after phase two (the rise is the forgetting) and B's held-out loss (what was learned).
Single-process ``python train.py`` runs.

``svd``: how exactly each SVD solver reproduces a weight-like matrix (columns scaled by j^-0.5, so
the spectrum decays) of each shape, and its seconds: the device's default driver and, on CUDA,
``gesvd``; each error also as a multiple of eps sqrt(max(N, M)), against ``osft.svd_tolerance``,
above which the start-up redoes a GPU SVD with ``gesvd``.

Writes ``bench/osft_results.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.bench_process_data import run_timed
from fixtures.e2e import IGNORE_INDEX, ROOT, model_vocab_size, write_tokenized_jsonl

OSFT_FLAGS = ["--osft", "--osft-unfreeze-rank-ratio", "0.25"]


def _train(model: Path, data: Path, out: Path, *extra) -> list[dict]:
    """One single-process train.py run; returns its metrics lines."""
    command = [sys.executable, str(ROOT / "train.py"), "--model-name-or-path", str(model), "--data-path", str(data),
               "--output-dir", str(out), "--num-data-workers", "0", "--num-warmup-steps", "0",
               "--lr-scheduler", "constant", "--min-samples-per-checkpoint", str(10**9), "--no-full-state",
               *map(str, extra)]
    _, _, peak_gib, code = run_timed(command)
    if code != 0:
        raise SystemExit(f"train.py failed ({code}): {' '.join(command)}")
    records = [json.loads(line) for line in (out / "training_metrics_0.jsonl").read_text().splitlines()]
    records[-1]["peak_rss_gib"] = peak_gib
    return records


def speed(args, work: Path) -> dict:
    from minitrainer.tools.tiny_model import build_tiny_model

    model = build_tiny_model("chatml", work / "speed_model", hidden_size=args.hidden_size,
                             num_layers=args.num_layers, intermediate_size=int(args.hidden_size * 2.75) // 8 * 8,
                             num_heads=max(args.hidden_size // 64, 1), num_kv_heads=max(args.hidden_size // 128, 1))
    data = write_tokenized_jsonl(work / "speed.jsonl", num_samples=4 * args.batch_size,
                                 vocab_size=model_vocab_size(model),
                                 min_len=args.max_tokens_per_gpu // 8, max_len=args.max_tokens_per_gpu // 2)
    modes = {"full": [], "osft_0.25": OSFT_FLAGS}
    rows: dict[str, list[dict]] = {mode: [] for mode in modes}
    for repeat in range(args.repeats):
        for mode, extra in modes.items():
            records = _train(model, data, work / f"speed_{mode}_{repeat}", "--batch-size", args.batch_size,
                             "--max-tokens-per-gpu", args.max_tokens_per_gpu, "--max-steps", args.num_steps,
                             "--learning-rate", 1e-5, "--skip-objective-check", *extra)
            rows[mode].append({"step_s": statistics.median(r["time_per_batch"] for r in records[1:]),
                               "peak_memory_gb": max(r["peak_memory_usage_GB"] for r in records),
                               "peak_rss_gib": records[-1]["peak_rss_gib"],
                               "tokens_per_second": statistics.median(r["tokens_per_second"] for r in records[1:])})
    result = {mode: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for mode, runs in rows.items()}
    result["osft_0.25"]["step_time_vs_full"] = result["osft_0.25"]["step_s"] / result["full"]["step_s"]
    result["osft_0.25"]["peak_memory_vs_full"] = result["osft_0.25"]["peak_memory_gb"] / result["full"]["peak_memory_gb"]
    result["layer"] = layer_timing(args.hidden_size, args.max_tokens_per_gpu)
    return result


def layer_timing(width: int, num_tokens: int, repeats: int = 5) -> dict:
    """Forward + backward seconds of one width x width projection over ``num_tokens`` tokens, three ways."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    from minitrainer.methods.osft import OSFTLinear

    torch.manual_seed(0)
    dense = nn.Linear(width, width, bias=False)
    layer = OSFTLinear.from_linear(dense, int(width * 0.75))
    x = torch.randn(num_tokens, width)

    def factored(x):
        return ((x @ layer.V_high) * layer.S_high) @ layer.U_high.T + ((x @ layer.V_low) * layer.S_low) @ layer.U_low.T

    ways = {"dense": dense, "osft_factors": factored, "osft_rebuild": lambda x: F.linear(x, layer.dense_weight())}
    seconds = {}
    for name, fn in ways.items():
        times = []
        for _ in range(repeats + 1):
            began = time.perf_counter()
            fn(x).square().sum().backward()
            times.append(time.perf_counter() - began)
        seconds[name] = statistics.median(times[1:])
    return {"width": width, "tokens": num_tokens, **{f"{k}_s": v for k, v in seconds.items()},
            "factors_vs_dense": seconds["osft_factors"] / seconds["dense"],
            "rebuild_vs_dense": seconds["osft_rebuild"] / seconds["dense"]}


def write_chain(path: Path, *, seed: int, num_samples: int, length: int, vocab_size: int, num_successors: int,
                sample_seed: int) -> Path:
    """Rows of a random sparse Markov chain: the chain from ``seed``, the rows from ``sample_seed``."""
    successors = np.random.default_rng(seed).integers(0, vocab_size, size=(vocab_size, num_successors))
    rng = np.random.default_rng(sample_seed)
    with path.open("w") as f:
        for _ in range(num_samples):
            tokens = [int(rng.integers(vocab_size))]
            for _ in range(length - 1):
                tokens.append(int(successors[tokens[-1], rng.integers(num_successors)]))
            f.write(json.dumps({"input_ids": tokens, "labels": [IGNORE_INDEX] + tokens[1:], "len": length,
                                "num_loss_counted_tokens": length - 1}) + "\n")
    return path


def heldout_loss(export: Path, data: Path) -> float:
    """Per-token mean cross-entropy of the export (loaded in fp32) over ``data``, one sample at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    from fixtures.e2e import unpacked_loss_sum

    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    with torch.no_grad():
        total, count = unpacked_loss_sum(model, [(r["input_ids"], r["labels"]) for r in rows])
    return float(total) / count


def forgetting(args, work: Path) -> dict:
    from minitrainer.tools.tiny_model import build_tiny_model

    model = build_tiny_model("chatml", work / "forget_model", hidden_size=128, num_layers=2, intermediate_size=352,
                             num_heads=4, num_kv_heads=2)
    chain = {"num_samples": 256, "length": 64, "vocab_size": model_vocab_size(model),
             "num_successors": args.num_successors}
    data = {f"{name}_{split}": write_chain(work / f"{name}_{split}.jsonl", seed=seed, sample_seed=seed * 10 + i,
                                           **{**chain, "num_samples": 256 if split == "train" else 32})
            for name, seed in (("A", 1), ("B", 2)) for i, split in enumerate(("train", "heldout"))}
    flags = ["--batch-size", 32, "--max-tokens-per-gpu", 2048, "--learning-rate", args.learning_rate]
    phase_one = work / "phase_one"
    _train(model, data["A_train"], phase_one, *flags, "--max-steps", args.phase_one_steps)
    base = next((phase_one / "hf_format").iterdir())
    result = {"optimum": math.log(args.num_successors), "phase_one_steps": args.phase_one_steps,
              "phase_two_steps": args.phase_two_steps, "learning_rate": args.learning_rate,
              "after_A": {"A_heldout": heldout_loss(base, data["A_heldout"]),
                          "B_heldout": heldout_loss(base, data["B_heldout"])}}
    for mode, extra in (("full", []), ("osft_0.25", OSFT_FLAGS)):
        out = work / f"phase_two_{mode}"
        _train(base, data["B_train"], out, *flags, "--max-steps", args.phase_two_steps, *extra)
        export = next((out / "hf_format").iterdir())
        a, b = heldout_loss(export, data["A_heldout"]), heldout_loss(export, data["B_heldout"])
        result[mode] = {"A_heldout": a, "B_heldout": b, "A_rise": a - result["after_A"]["A_heldout"]}
    return result


def svd_accuracy(shapes: list[tuple[int, int]], device: str) -> list[dict]:
    """Per shape and driver: relative reconstruction error, its multiple of eps sqrt(max(N, M)), seconds."""
    import torch

    from minitrainer.methods.osft import relative_error, svd_tolerance

    drivers = [None, "gesvd"] if device.startswith("cuda") else [None]
    eps = torch.finfo(torch.float32).eps
    rows = []
    for shape in shapes:
        generator = torch.Generator().manual_seed(0)
        weight = (torch.randn(shape, generator=generator) * torch.arange(1, shape[1] + 1) ** -0.5).to(device)
        for driver in drivers:
            kwargs = {"driver": driver} if driver else {}
            torch.linalg.svd(weight[:64, :64], full_matrices=False, **kwargs)  # solver set-up out of the timing
            synchronize = torch.cuda.synchronize if weight.is_cuda else (lambda: None)
            synchronize()
            began = time.perf_counter()
            U, S, Vh = torch.linalg.svd(weight, full_matrices=False, **kwargs)
            synchronize()
            seconds = time.perf_counter() - began
            error = relative_error((U * S) @ Vh, weight)
            rows.append({"shape": f"{shape[0]}x{shape[1]}", "device": device, "driver": driver or "default",
                         "seconds": seconds, "relative_error": error,
                         "error_over_eps_sqrt_max": error / (eps * max(shape) ** 0.5),
                         "redo_tolerance": svd_tolerance(shape, torch.float32)})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("all", "speed", "forgetting", "svd"), default="all")
    parser.add_argument("--hidden-size", type=int, default=256, help="speed: model width")
    parser.add_argument("--num-layers", type=int, default=2, help="speed: decoder blocks")
    parser.add_argument("--batch-size", type=int, default=16, help="speed: samples per step")
    parser.add_argument("--max-tokens-per-gpu", type=int, default=1024, help="speed: tokens per minibatch")
    parser.add_argument("--num-steps", type=int, default=6, help="speed: steps per run (the first is not timed)")
    parser.add_argument("--repeats", type=int, default=2, help="speed: runs per mode, alternating")
    parser.add_argument("--phase-one-steps", type=int, default=150, help="forgetting: steps learning A")
    parser.add_argument("--phase-two-steps", type=int, default=60, help="forgetting: steps learning B")
    parser.add_argument("--learning-rate", type=float, default=3e-3, help="forgetting: both phases")
    parser.add_argument("--num-successors", type=int, default=4, help="forgetting: branching of each chain")
    parser.add_argument("--svd-shapes", default="896x4864,4864x896,1536x8960",
                        help="svd: comma list of NxM fp32 matrices to decompose")
    parser.add_argument("--svd-device", default="cpu", help="svd: where the SVDs run (cpu, cuda)")
    parser.add_argument("--output-json", default=str(ROOT / "bench" / "osft_results.json"))
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="bench_osft_"))
    results = {}
    if args.part in ("all", "speed"):
        results["speed"] = s = speed(args, work)
        print(f"\nspeed: {args.hidden_size} wide, {args.num_layers} layers, {args.max_tokens_per_gpu} tokens per "
              f"minibatch, median of {args.repeats} runs")
        print(f"{'mode':<10} {'step s':>8} {'vs full':>8} {'peak GB':>8} {'peak RSS GiB':>13}")
        for mode in ("full", "osft_0.25"):
            row = s[mode]
            print(f"{mode:<10} {row['step_s']:>8.4f} {row['step_s'] / s['full']['step_s']:>8.2f} "
                  f"{row['peak_memory_gb']:>8.3f} {row['peak_rss_gib']:>13.3f}")
        layer = s["layer"]
        print(f"one {layer['width']}x{layer['width']} layer, {layer['tokens']} tokens, forward+backward: dense "
              f"{layer['dense_s'] * 1e3:.2f} ms, OSFT through the factors {layer['factors_vs_dense']:.2f}x, "
              f"rebuilding W {layer['rebuild_vs_dense']:.2f}x")
    if args.part in ("all", "forgetting"):
        results["forgetting"] = f = forgetting(args, work)
        print(f"\nforgetting: A learned for {f['phase_one_steps']} steps, then B for {f['phase_two_steps']} "
              f"(best possible loss {f['optimum']:.3f})")
        print(f"{'model':<22} {'A held-out':>11} {'A rise':>8} {'B held-out':>11}")
        print(f"{'after A':<22} {f['after_A']['A_heldout']:>11.3f} {'':>8} {f['after_A']['B_heldout']:>11.3f}")
        for mode in ("full", "osft_0.25"):
            print(f"{'then B, ' + mode:<22} {f[mode]['A_heldout']:>11.3f} {f[mode]['A_rise']:>+8.3f} "
                  f"{f[mode]['B_heldout']:>11.3f}")
    if args.part in ("all", "svd"):
        shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.svd_shapes.split(",")]
        results["svd"] = rows = svd_accuracy(shapes, args.svd_device)
        print(f"\nsvd (fp32, on {args.svd_device}): error is ||U S V^T - W|| / ||W||; above the tolerance "
              "(2 eps sqrt(max(N, M))) a GPU start-up redoes it with gesvd")
        print(f"{'shape':<12} {'driver':<8} {'seconds':>8} {'error':>9} {'/ eps sqrt(max)':>16} {'tolerance':>10}")
        for row in rows:
            print(f"{row['shape']:<12} {row['driver']:<8} {row['seconds']:>8.2f} {row['relative_error']:>9.2e} "
                  f"{row['error_over_eps_sqrt_max']:>16.2f} {row['redo_tolerance']:>10.2e}")
    Path(args.output_json).write_text(json.dumps(results, indent=2))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
