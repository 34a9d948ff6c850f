"""Training throughput: packed padding-free rows against padded batches of the same samples.

    python -m bench.bench_train --shape Qwen2.5-1.5B --max-tokens-per-gpu 32768 --find-max-tokens
    torchrun --nproc-per-node=2 -m bench.bench_train --shape Llama-3-8B --max-tokens-per-gpu 16384
    python -m bench.bench_train --shape tiny --max-tokens-per-gpu 2048 --median-len 64 --p99-len 850 \\
        --max-len 1024 --num-steps 4 --repeats 5 --layouts packed,packed_reference,padded   # CPU, ~2 min

A random-init model of a named shape (``model/shapes.py``, nothing downloaded) is
trained exactly as ``train.py`` trains it: FSDP2 (one rank is fine), fp32
master weights with bf16 compute on GPU, AdamW, the chunked or Liger loss of
``loss.CausalLMWithLoss``. Configurations:

* packed + torch_varlen (GPU) or packed + sdpa (CPU): rows of up to
  ``--max-tokens-per-gpu`` tokens, first-fit decreasing;
* packed + flash_attention_2, when ``flash_attn`` imports;
* packed + reference_varlen (``--layouts packed_reference``, not by default):
  one SDPA per sample, the CPU stand-in for the varlen kernels (no T x T mask);
* padded: the Hugging Face Trainer default, a fixed number of samples per
  batch padded to its longest, ``attention_mask``, sdpa. The batch size is the
  largest whose worst case fits the same token budget
  (``--max-tokens-per-gpu // --max-len``) unless ``--padded-batch-size`` says;

each with and without Liger (GPU) and activation checkpointing. Every
configuration trains on the same samples (lognormal lengths, median
``--median-len``, 99th percentile ``--p99-len``, clipped to ``--max-len``).

Reported per configuration: real (non-pad) tokens/s per GPU, MFU, time per
minibatch (the timed samples are one optimizer batch: forward and backward per
minibatch, one AdamW step, as ``train.py`` runs a batch), peak memory, and with
``--find-max-tokens`` the largest ``--max-tokens-per-gpu`` that trains (packed
only, GPU only, no safety margin). MFU = model FLOPs / time / the GPU's bf16
matmul rate, measured first on an 8192^3 matmul; model FLOPs are ``flops.py``'s:
6 N L plus causal attention 12 d_attn L (L + 1) / 2 per layer and sample of L
tokens (the masked half is not credited: flash kernels skip it), N = weight
matrices without the input embedding. Padded batches are
credited only their real tokens. On CPU MFU and peak memory read "n/a".
Writes the table and a JSON file (``--output-json``).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from minitrainer.setup.autotune import longest_first_plan, probe_max_tokens_per_gpu
from minitrainer.common.cli import comma_list, config_field, parse_config
from minitrainer.common.refusals import collect_errors
from minitrainer.common.device import gpu_name, peak_memory_gb, reset_peak_memory, synchronize
from minitrainer.common.distributed import DistInfo, cleanup, first_error, init_distributed
from minitrainer.common.labels import IGNORE_INDEX
from minitrainer.common.log import log_rank_0, setup_logging
from minitrainer.setup.flops import measure_bf16_matmul_tflops, model_flops, training_flops
from minitrainer.model.attention import (REFERENCE_VARLEN, TORCH_VARLEN, attention_inputs,
                                         flash_attn_unavailable_reason, register_attention_backends)
from minitrainer.model.loss import CausalLMWithLoss
from minitrainer.model.shapes import SHAPES, model_config

LAYOUTS = ("packed", "packed_flash", "packed_reference", "padded")
DEFAULT_LAYOUTS = "packed,packed_flash,padded"


@dataclass
class BenchConfig:
    """What to benchmark; every field is a CLI flag."""

    shape: str = config_field("Qwen2.5-1.5B", choices=tuple(SHAPES), help="model shape (random init)")
    max_tokens_per_gpu: int = config_field(32768, help="token budget of one packed row (and of padded batches)")
    num_steps: int = config_field(8, help="timed samples fill this many packed rows; padded trains the same samples")
    num_warmup_steps: int = config_field(2, help="untimed rows' worth of other samples, trained first")
    median_len: int = config_field(600, help="median sample length of the lognormal length distribution")
    p99_len: int = config_field(8000, help="99th percentile sample length")
    max_len: int = config_field(16384, help="longer samples are clipped to this length")
    padded_batch_size: int = config_field(0, help="samples per padded batch; 0 = max_tokens_per_gpu // max_len")
    layouts: str = config_field(DEFAULT_LAYOUTS, help=f"comma-separated subset of {', '.join(LAYOUTS)}")
    liger: Literal["both", "on", "off"] = config_field("both", help="Liger RMSNorm/RoPE/SwiGLU + fused CE (GPU)")
    activation_checkpointing: Literal["both", "on", "off"] = config_field("both", help="recompute each block")
    find_max_tokens: bool = config_field(False, help="binary-search the largest budget that trains (GPU, packed)")
    max_probe_tokens: int = config_field(262144, help="upper end of the --find-max-tokens search")
    repeats: int = config_field(1, help="time the timed rows this many times, keep the fastest (noisy hosts)")
    seed: int = config_field(0, help="seeds lengths, token ids and weights")
    output_json: str = config_field("bench/bench_train.json", help="where to write the results")

    def __post_init__(self) -> None:
        errors = []
        for name in ("max_tokens_per_gpu", "num_steps", "median_len", "p99_len", "max_len", "repeats"):
            if getattr(self, name) <= 0:
                errors.append(f"--{name.replace('_', '-')} must be positive")
        if self.p99_len < self.median_len:
            errors.append("--p99-len must be at least --median-len")
        if self.max_len > self.max_tokens_per_gpu:
            errors.append(f"--max-len {self.max_len} must fit in --max-tokens-per-gpu {self.max_tokens_per_gpu}")
        unknown = set(self.layout_list) - set(LAYOUTS)
        if unknown:
            errors.append(f"--layouts: unknown {', '.join(sorted(unknown))} (choose from {', '.join(LAYOUTS)})")
        collect_errors(errors)

    @property
    def layout_list(self) -> list[str]:
        return comma_list(self.layouts)


@dataclass
class Sample:
    input_ids: np.ndarray  # [L]
    labels: np.ndarray  # [L], shifted within the sample, last IGNORE_INDEX


# ----------------------------------------------------------------------------
# Data: lengths, packed rows, padded batches (pure functions)


def draw_samples(config: BenchConfig, num_tokens: int, vocab_size: int, rng: np.random.Generator) -> list[Sample]:
    """Lognormal lengths (median, p99 as configured) until ``num_tokens`` tokens are drawn."""
    sigma = np.log(config.p99_len / config.median_len) / 2.3263  # z of the 99th percentile
    samples, total = [], 0
    while total < num_tokens:
        length = int(np.clip(round(rng.lognormal(np.log(config.median_len), sigma)), 16, config.max_len))
        ids = rng.integers(0, vocab_size, size=length)
        samples.append(Sample(ids, np.append(ids[1:], IGNORE_INDEX)))
        total += length
    return samples


def pack_rows(samples: list[Sample], budget: int) -> list[list[Sample]]:
    """First-fit decreasing into rows of at most ``budget`` tokens."""
    rows: list[list[Sample]] = []
    loads: list[int] = []
    for sample in sorted(samples, key=lambda s: -len(s.input_ids)):
        for i, load in enumerate(loads):
            if load + len(sample.input_ids) <= budget:
                rows[i].append(sample)
                loads[i] += len(sample.input_ids)
                break
        else:
            rows.append([sample])
            loads.append(len(sample.input_ids))
    return rows


@dataclass
class PackedRow:
    """What sampler.Minibatch carries, for one row."""

    input_ids: torch.Tensor  # [1, T]
    labels: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    cu_seqlens: torch.Tensor  # int32 [num_samples + 1]
    max_seqlen: int


def collate_packed(row: list[Sample]) -> PackedRow:
    lengths = [len(s.input_ids) for s in row]
    return PackedRow(input_ids=torch.from_numpy(np.concatenate([s.input_ids for s in row]))[None],
                     labels=torch.from_numpy(np.concatenate([s.labels for s in row]))[None],
                     position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
                     cu_seqlens=torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32),
                     max_seqlen=max(lengths))


def collate_padded(batch: list[Sample], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample, as transformers' DataCollatorWithPadding does."""
    longest = max(len(s.input_ids) for s in batch)
    input_ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), longest), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for i, s in enumerate(batch):
        input_ids[i, :len(s.input_ids)] = torch.from_numpy(s.input_ids)
        labels[i, :len(s.labels)] = torch.from_numpy(s.labels)
        mask[i, :len(s.input_ids)] = 1
    position_ids = torch.arange(longest).expand(len(batch), -1)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "attention_mask": mask}


# ----------------------------------------------------------------------------
# Model, one training step, one configuration


def build_model(config: BenchConfig, *, attn: str, liger: bool, ac: bool, dist_info: DistInfo):
    """Random init on the device, then the setup_model order: Liger, AC, fully_shard blocks, root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    from minitrainer.model.loss import find_decoder_blocks
    from minitrainer.setup.model import apply_liger_kernels

    register_attention_backends()
    hf_config = model_config(config.shape, max_position_embeddings=max(32768, config.max_probe_tokens))
    torch.manual_seed(config.seed)
    with dist_info.device:
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, attn_implementation=attn)
    if liger:
        apply_liger_kernels(model, device_type=dist_info.device.type)
    if ac:  # as setup_model does: transformers 5 renamed the switch
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    wrapper = CausalLMWithLoss(model, use_liger_kernels=liger)
    on_gpu = dist_info.device.type == "cuda"
    fsdp = {"mesh": init_device_mesh(dist_info.device.type, (dist_info.world_size,)),
            "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16 if on_gpu else torch.float32,
                                              reduce_dtype=torch.float32)}
    for block in find_decoder_blocks(model):
        fully_shard(block, **fsdp)
    fully_shard(wrapper, **fsdp)
    wrapper.train()
    optimizer = torch.optim.AdamW(wrapper.parameters(), lr=1e-6)
    return wrapper, optimizer, model_flops(hf_config)


def train_batch(wrapper, optimizer, minibatches: list, to_inputs) -> None:
    """One optimizer step over ``minibatches`` with gradient accumulation, as train.py runs a batch."""
    for minibatch in minibatches:
        wrapper(**to_inputs(minibatch)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def packed_inputs(row: PackedRow, attn: str, device: torch.device) -> dict:
    inputs = {"input_ids": row.input_ids.to(device), "position_ids": row.position_ids.to(device),
              "labels": row.labels.to(device)}
    return {**inputs, **attention_inputs(row, attn, device)}


def run_configuration(config: BenchConfig, dist_info: DistInfo, *, layout: str, attn: str, liger: bool, ac: bool,
                      warmup: list[Sample], timed: list[Sample], peak_tflops: float | None) -> dict:
    """Train on ``timed`` (after ``warmup``) in one layout; returns the table row."""
    device = dist_info.device
    wrapper, optimizer, shape = build_model(config, attn=attn, liger=liger, ac=ac, dist_info=dist_info)
    padded_batch = config.padded_batch_size or max(1, config.max_tokens_per_gpu // config.max_len)
    if layout == "padded":
        steps = [collate_padded(timed[i:i + padded_batch]) for i in range(0, len(timed), padded_batch)]
        warm = [collate_padded(warmup[i:i + padded_batch]) for i in range(0, len(warmup), padded_batch)]
        to_inputs = lambda batch: {name: t.to(device) for name, t in batch.items()}  # noqa: E731
        num_padded = sum(b["input_ids"].numel() for b in steps)
    else:
        steps = [collate_packed(r) for r in pack_rows(timed, config.max_tokens_per_gpu)]
        warm = [collate_packed(r) for r in pack_rows(warmup, config.max_tokens_per_gpu)]
        to_inputs = lambda row: packed_inputs(row, attn, device)  # noqa: E731
        num_padded = sum(r.input_ids.numel() for r in steps)
    lengths = [len(s.input_ids) for s in timed]
    if warm:
        train_batch(wrapper, optimizer, warm, to_inputs)
    synchronize()
    reset_peak_memory()
    elapsed = float("inf")
    for _ in range(config.repeats):
        # Both layouts train the same samples as one optimizer batch, so neither pays more optimizer steps.
        start = time.perf_counter()
        train_batch(wrapper, optimizer, steps, to_inputs)
        synchronize()  # CPU-GPU sync point: the timed region ends here
        elapsed = min(elapsed, time.perf_counter() - start)
    peak = peak_memory_gb() if device.type == "cuda" else None
    totals = torch.tensor([float(sum(lengths)), training_flops(shape, lengths), elapsed], dtype=torch.float64,
                          device=device)
    dist.all_reduce(totals[:2])
    dist.all_reduce(totals[2:], op=dist.ReduceOp.MAX)
    num_tokens, flops, elapsed = totals.tolist()
    result = {"layout": layout, "attention": attn, "liger": liger, "activation_checkpointing": ac,
              "tokens_per_second_per_gpu": num_tokens / dist_info.world_size / elapsed,
              "mfu": flops / dist_info.world_size / elapsed / (peak_tflops * 1e12) if peak_tflops else None,
              "minibatch_time_s": elapsed / len(steps), "num_minibatches": len(steps), "peak_memory_gb": peak,
              "real_token_fraction": sum(lengths) / num_padded, "max_tokens_per_gpu_that_fits": None,
              "status": "ok"}
    if config.find_max_tokens and layout != "padded" and device.type == "cuda":
        pool = timed + warmup

        def try_step(num_tokens: int) -> None:
            plan = longest_first_plan(np.array([len(s.input_ids) for s in pool]), num_tokens)
            row = [Sample(pool[i].input_ids[:take], np.append(pool[i].labels[:take - 1], IGNORE_INDEX))
                   for i, take in plan]
            try:
                train_batch(wrapper, optimizer, [collate_packed(row)], lambda r: packed_inputs(r, attn, device))
            finally:
                optimizer.zero_grad(set_to_none=True)
                for module in wrapper.modules():
                    if isinstance(module, FSDPModule):
                        module.reshard()  # a step that died half-way may have left a block gathered

        result["max_tokens_per_gpu_that_fits"] = probe_max_tokens_per_gpu(
            try_step, device_type=device.type, lower=4096, upper=config.max_probe_tokens, safety=1.0,
            resolution=1024, agree=lambda ok: first_error(None if ok else "trial failed") is None)
    del wrapper, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.accelerator.empty_cache()
    return result


# ----------------------------------------------------------------------------
# Driver


def configurations(config: BenchConfig, device_type: str) -> list[tuple[str, str, bool, bool]]:
    """(layout, attention, liger, ac) to run here, with a warning for each that cannot."""
    from minitrainer.model.attention import torch_varlen_unavailable_reason

    on_gpu = device_type == "cuda"
    attn_for = {"padded": "sdpa", "packed_reference": REFERENCE_VARLEN}
    varlen_missing = torch_varlen_unavailable_reason()
    attn_for["packed"] = TORCH_VARLEN if on_gpu and varlen_missing is None else "sdpa"
    if attn_for["packed"] == "sdpa":
        log_rank_0(f"packed rows use sdpa with a block-diagonal mask: "
                   f"{'no GPU' if not on_gpu else varlen_missing}", level=logging.WARNING)
    layouts = config.layout_list
    if "packed_flash" in layouts:
        missing = flash_attn_unavailable_reason("flash_attention_2") if on_gpu else "no GPU"
        if missing:
            log_rank_0(f"skipping packed_flash: {missing}", level=logging.WARNING)
            layouts = [name for name in layouts if name != "packed_flash"]
        attn_for["packed_flash"] = "flash_attention_2"
    ligers = {"both": [False, True], "on": [True], "off": [False]}[config.liger]
    if not on_gpu and True in ligers:
        log_rank_0("Liger needs a GPU: benchmarking without it", level=logging.WARNING)
        ligers = [False]
    acs = {"both": [False, True], "on": [True], "off": [False]}[config.activation_checkpointing]
    return [(layout, attn_for[layout], liger, ac) for layout in layouts for liger in ligers for ac in acs]


def format_table(results: list[dict]) -> str:
    head = f"{'layout':<18}{'attention':<18}{'liger':<7}{'AC':<5}{'tok/s/GPU':>11}{'MFU':>7}{'mb s':>9}" \
           f"{'peak GB':>9}{'real tok':>9}{'max tok':>9}  status"
    lines = [head, "-" * len(head)]
    for r in results:
        def fmt(value, spec):
            return "n/a" if value is None else format(value, spec)

        lines.append(f"{r['layout']:<18}{r['attention']:<18}{'on' if r['liger'] else 'off':<7}"
                     f"{'on' if r['activation_checkpointing'] else 'off':<5}"
                     f"{fmt(r.get('tokens_per_second_per_gpu'), '.0f'):>11}{fmt(r.get('mfu'), '.1%'):>7}"
                     f"{fmt(r.get('minibatch_time_s'), '.3f'):>9}{fmt(r.get('peak_memory_gb'), '.1f'):>9}"
                     f"{fmt(r.get('real_token_fraction'), '.0%'):>9}"
                     f"{fmt(r.get('max_tokens_per_gpu_that_fits'), 'd'):>9}  {r['status']}")
    return "\n".join(lines)


def bench(config: BenchConfig) -> list[dict]:
    import transformers

    dist_info = init_distributed()
    setup_logging("INFO", rank=dist_info.rank)
    try:
        device = dist_info.device
        peak_tflops = measure_bf16_matmul_tflops(device)
        log_rank_0(f"device {gpu_name()}, world size {dist_info.world_size}, bf16 matmul "
                   f"{'n/a' if peak_tflops is None else f'{peak_tflops:.0f} TFLOP/s'}")
        vocab_size = SHAPES[config.shape]["vocab_size"]
        rng = np.random.default_rng(config.seed + 1000 * dist_info.rank)
        timed = draw_samples(config, config.num_steps * config.max_tokens_per_gpu, vocab_size, rng)
        warmup = draw_samples(config, config.num_warmup_steps * config.max_tokens_per_gpu, vocab_size, rng) \
            if config.num_warmup_steps else []
        lengths = np.array([len(s.input_ids) for s in timed])
        log_rank_0(f"{len(timed)} timed samples, {lengths.sum()} tokens; length median {np.median(lengths):.0f}, "
                   f"p99 {np.percentile(lengths, 99):.0f}, max {lengths.max()}")
        results = []
        for layout, attn, liger, ac in configurations(config, device.type):
            log_rank_0(f"running {layout} {attn} liger={liger} ac={ac}")
            try:
                results.append(run_configuration(config, dist_info, layout=layout, attn=attn, liger=liger, ac=ac,
                                                 warmup=warmup, timed=timed, peak_tflops=peak_tflops))
            except torch.OutOfMemoryError:
                results.append({"layout": layout, "attention": attn, "liger": liger, "activation_checkpointing": ac,
                                "status": "OOM"})
                gc.collect()
                torch.accelerator.empty_cache()
        if dist_info.is_main:
            print(format_table(results))
            padded = {(r["liger"], r["activation_checkpointing"]): r for r in results
                      if r["layout"] == "padded" and r["status"] == "ok"}
            for r in results:
                base = padded.get((r["liger"], r["activation_checkpointing"]))
                if r["layout"] != "padded" and r["status"] == "ok" and base:
                    r["speedup_vs_padded"] = r["tokens_per_second_per_gpu"] / base["tokens_per_second_per_gpu"]
                    print(f"{r['layout']} {r['attention']} liger={'on' if r['liger'] else 'off'} "
                          f"ac={'on' if r['activation_checkpointing'] else 'off'}: "
                          f"{r['speedup_vs_padded']:.2f}x the padded tokens/s")
            report = {"config": dataclasses.asdict(config), "device": gpu_name(),
                      "world_size": dist_info.world_size, "bf16_matmul_tflops": peak_tflops,
                      "padded_batch_size": config.padded_batch_size
                      or max(1, config.max_tokens_per_gpu // config.max_len),
                      "num_timed_samples": len(timed), "num_timed_tokens": int(lengths.sum()),
                      "torch_version": torch.__version__, "transformers_version": transformers.__version__,
                      "results": results}
            Path(config.output_json).write_text(json.dumps(report, indent=2))
            print(f"wrote {config.output_json}")
        return results
    finally:
        cleanup()


def main(argv: list[str] | None = None) -> None:
    bench(parse_config(BenchConfig, argv, description=__doc__.split("\n\n")[0]))


if __name__ == "__main__":
    main()
