"""Long context: per-rank peak memory and step time against one sample's length, for context-parallel sizes N.

    python -m bench.bench_long_context                                       # CPU: tiny shape, N = 1, 2, 4
    python -m bench.bench_long_context --shape Qwen2.5-1.5B --context-parallel-sizes 1 \\
        --lengths 32768,65536,131072 --liger --find-longest                  # one GPU (make gpu-check)

For each N the driver launches ``torchrun --nproc-per-node N -m bench.bench_long_context --worker``.
Each worker builds a random-init model of ``--shape`` exactly as ``bench/bench_train.py`` does (FSDP2
over its N ranks, fp32 master weights, bf16 compute on GPU, activation checkpointing, optional Liger)
with ``--context-parallel-size N``'s attention (``context_parallel`` around ``reference_varlen`` on
CPU, ``torch_varlen`` or flash-attn on GPU), and times one optimizer step (forward, backward,
AdamW) on ONE sample of each length, split over the group by ``context_parallel.shard_minibatch``.

Reported per (length, N): the slowest rank's step time, tokens/s per GPU, MFU (``flops.py``'s
model FLOPs of the whole sample over N GPUs, divided by the data-sheet bf16 peak; null on CPU)
and the per-rank peak memory: on GPU the allocator's peak, on CPU the growth of the process's
peak resident set over the model-loaded baseline (lengths run shortest first, so the high-water
mark is the current length's). The table puts each N's memory and time beside N = 1's as
ratios. ``--find-longest`` (GPU) binary-searches the longest single sample that trains.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from bench.bench_train import BenchConfig, build_model
from fixtures.e2e import ROOT
from minitrainer.setup.autotune import probe_max_tokens_per_gpu
from minitrainer.common.cli import comma_list, config_field, parse_config
from minitrainer.common.device import peak_memory_gb, reset_peak_memory, synchronize
from minitrainer.common.distributed import DistInfo, cleanup, first_error, init_distributed
from minitrainer.common.labels import IGNORE_INDEX
from minitrainer.data.sampler import collate_minibatch
from minitrainer.setup.flops import device_peak_tflops, training_flops
from minitrainer.model.attention import model_inputs, resolve_attn_implementation
from minitrainer.model.context_parallel import (CONTEXT_PARALLEL, inner_backend, new_context_group,
                                                register_context_parallel_backend, shard_minibatch)


@dataclass
class LongContextConfig:
    """One sample per step, several lengths, several context-parallel sizes."""

    shape: str = config_field("tiny", help="model shape (model/shapes.py), random init")
    lengths: str = config_field("1024,2048,4096,8192", help="comma-separated sample lengths in tokens")
    context_parallel_sizes: str = config_field("1,2,4", help="comma-separated N; each runs under torchrun with N ranks")
    liger: bool = config_field(False, help="Liger kernels and fused loss (CUDA)")
    activation_checkpointing: bool = config_field(True, help="recompute each decoder block in backward")
    repeats: int = config_field(2, help="timed steps per length (the fastest counts), after one warm-up step")
    find_longest: bool = config_field(False, help="binary-search the longest single sample that trains (GPU, N=1)")
    max_probe_tokens: int = config_field(262144, help="upper end of the --find-longest search")
    output_json: str = config_field("bench_long_context.json", help="where the results go")
    worker: bool = config_field(False, help="internal: this process is one rank of one N")

    @property
    def length_list(self) -> list[int]:
        return [int(value) for value in comma_list(self.lengths)]

    @property
    def size_list(self) -> list[int]:
        return [int(value) for value in comma_list(self.context_parallel_sizes)]


def one_sample(length: int, vocab_size: int, seed: int = 0):
    """A packed row of one sample: a masked 10% prompt, then learned tokens (``sampler.Minibatch``)."""
    ids = np.random.default_rng(seed).integers(0, vocab_size, size=length)
    labels = ids.copy()
    labels[: length // 10] = IGNORE_INDEX
    return collate_minibatch([(ids, labels)])


def peak_rank_memory_gb(device: torch.device, baseline_kb: int) -> float:
    """GPU: the allocator's peak. CPU: growth of the peak resident set since ``baseline_kb`` (Linux KiB). GB = 1e9 B."""
    if device.type == "cuda":
        return peak_memory_gb()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline_kb) * 1024 / 1e9


def worker(config: LongContextConfig) -> None:
    """One rank of one N: every length in turn; rank 0 writes the rows."""
    dist_info: DistInfo = init_distributed()
    try:
        size = dist_info.world_size
        device = dist_info.device
        attn = resolve_attn_implementation("auto", device.type)
        inner, reason = inner_backend(attn, device.type)
        if inner is None:
            raise SystemExit(reason)
        register_context_parallel_backend(inner)
        attn = inner if size == 1 else CONTEXT_PARALLEL  # N = 1 measures the plain varlen path
        longest_length = max(config.length_list)
        # Only the model fields matter here (the sample lengths are this bench's own).
        bench = BenchConfig(shape=config.shape, max_tokens_per_gpu=longest_length, max_len=longest_length,
                            median_len=1, p99_len=1,
                            max_probe_tokens=max(config.max_probe_tokens, max(config.length_list)),
                            output_json=os.devnull)
        wrapper, optimizer, shape = build_model(bench, attn=attn, liger=config.liger,
                                                ac=config.activation_checkpointing, dist_info=dist_info)
        vocab = wrapper.model.config.vocab_size
        context = new_context_group(size, dist_info)
        peak_tflops, _ = device_peak_tflops(device)

        def step(length: int) -> None:
            minibatch = one_sample(length, vocab)
            if size > 1:
                minibatch = shard_minibatch(minibatch, context, device=device)
            try:
                wrapper(**model_inputs(minibatch, attn, device)).backward()
                optimizer.step()
            finally:
                optimizer.zero_grad(set_to_none=True)
                for module in wrapper.modules():
                    if isinstance(module, FSDPModule):
                        module.reshard()  # a step that died half-way may have left a block gathered

        rows = []
        baseline_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for length in sorted(config.length_list):
            status, elapsed = "ok", float("inf")
            reset_peak_memory()
            try:
                step(length)  # warm-up: allocator, kernels
                for _ in range(config.repeats):
                    synchronize()
                    began = time.perf_counter()
                    step(length)
                    synchronize()  # CPU-GPU sync point: the timed region ends here
                    elapsed = min(elapsed, time.perf_counter() - began)
            except torch.OutOfMemoryError:
                status = "out of memory"
                torch.accelerator.empty_cache()
            peak = peak_rank_memory_gb(device, baseline_kb)
            slowest = torch.tensor([elapsed, peak], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            elapsed, peak = slowest.tolist()
            flops = training_flops(shape, [length])
            ok = status == "ok" and np.isfinite(elapsed)
            rows.append({"length": length, "context_parallel_size": size, "attention": attn if size == 1 else
                         f"{CONTEXT_PARALLEL} over {inner}", "liger": config.liger, "status": status,
                         "step_time_s": elapsed if ok else None,
                         "tokens_per_second_per_gpu": length / size / elapsed if ok else None,
                         "mfu": flops / size / elapsed / (peak_tflops * 1e12) if ok and peak_tflops else None,
                         "peak_memory_gb_per_rank": peak})
        longest = None
        if config.find_longest and device.type == "cuda":
            longest = probe_max_tokens_per_gpu(
                step, device_type=device.type, lower=4096, upper=config.max_probe_tokens, safety=1.0,
                resolution=1024, agree=lambda ok: first_error(None if ok else "trial failed") is None)
        if dist_info.is_main:
            Path(config.output_json).write_text(json.dumps({"rows": rows, "longest_sample": longest}))
    finally:
        cleanup()


def run_all(config: LongContextConfig) -> dict:
    """Each N under torchrun; the rows together, with ratios to N = 1."""
    rows, longest = [], {}
    with tempfile.TemporaryDirectory(prefix="bench_long_context_") as scratch:
        for size in config.size_list:
            output = Path(scratch) / f"n{size}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={size}", "-m", "bench.bench_long_context", "--worker", "--shape", config.shape,
                   "--lengths", config.lengths, "--repeats", str(config.repeats), "--output-json", str(output),
                   "--max-probe-tokens", str(config.max_probe_tokens),
                   "--liger" if config.liger else "--no-liger",
                   "--activation-checkpointing" if config.activation_checkpointing
                   else "--no-activation-checkpointing", *(["--find-longest"] if config.find_longest else [])]
            subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            result = json.loads(output.read_text())
            rows += result["rows"]
            longest[size] = result["longest_sample"]
    base = {row["length"]: row for row in rows if row["context_parallel_size"] == 1}
    for row in rows:
        ref = base.get(row["length"])
        both = ref is not None and row["step_time_s"] and ref["step_time_s"]
        row["memory_vs_n1"] = (row["peak_memory_gb_per_rank"] / ref["peak_memory_gb_per_rank"]
                               if both and ref["peak_memory_gb_per_rank"] > 0 else None)
        row["time_vs_n1"] = row["step_time_s"] / ref["step_time_s"] if both else None
    report = {"shape": config.shape, "rows": rows, "longest_sample_by_n": longest}
    Path(config.output_json).write_text(json.dumps(report, indent=2))
    return report


def format_table(rows: list[dict]) -> str:
    """One line per length; per N: peak memory per rank and step time, with their ratios to N = 1."""
    sizes = sorted({row["context_parallel_size"] for row in rows})
    by_key = {(row["length"], row["context_parallel_size"]): row for row in rows}
    head = "| tokens | " + " | ".join(f"N={n} GB/rank | N={n} s/step" for n in sizes) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(sizes))]
    fmt = (lambda value, spec: "n/a" if value is None else format(value, spec))
    for length in sorted({row["length"] for row in rows}):
        cells = []
        for n in sizes:
            row = by_key.get((length, n), {})
            memory, seconds = row.get("peak_memory_gb_per_rank"), row.get("step_time_s")
            ratio_m = "" if n == 1 or row.get("memory_vs_n1") is None else f" ({row['memory_vs_n1']:.2f}x)"
            ratio_t = "" if n == 1 or row.get("time_vs_n1") is None else f" ({row['time_vs_n1']:.2f}x)"
            cells += [fmt(memory, ".3f") + ratio_m, fmt(seconds, ".3f") + ratio_t]
        lines.append(f"| {length} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    config = parse_config(LongContextConfig, argv, description=__doc__.split("\n\n")[0])
    if config.worker:
        worker(config)
        return
    report = run_all(config)
    print(format_table(report["rows"]))
    print(f"wrote {config.output_json}")


if __name__ == "__main__":
    main()
