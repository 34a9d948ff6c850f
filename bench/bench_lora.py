"""Full fine-tuning, LoRA and QLoRA side by side: step time, peak memory, checkpoint sizes.

    python -m bench.bench_lora                      # CPU: demo model, 2 gloo ranks, ~6 min
    python -m bench.bench_lora --nproc-per-node 1 --lora-ranks 8,64 --repeats 3

Every mode trains the demo model (``demo.py``'s tokenizer, data and random
Qwen2-style model, 256 wide by default so that every projection holds whole
NF4 groups on 2 ranks) through ``torchrun train.py`` with identical flags but
``--lora-rank`` (and ``--lora-quantize-data-type nf4`` for QLoRA); runs alternate
(full, LoRA, QLoRA, full, ...) so machine load hits all alike. Reported per
mode: median ``time_per_batch`` over the steps after the first, the peak RSS of
the whole process tree (psutil, every 50 ms), the metrics'
``peak_memory_usage_GB`` (rank 0's peak GPU memory; on CPU its peak RSS), and
the size of one full-state checkpoint and one Hugging Face export.

Also printed: the training-state bytes per mode for large shapes, counted on a
meta-device model (no memory, nothing downloaded): master weights at 4 B per
parameter (QLoRA: the NF4 base weights at their quantized size, ~0.52 B, as
sharded 8 ways) plus, per trainable parameter, a gradient and AdamW's two
moments (12 B). Writes ``bench/lora_results.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench.bench_process_data import run_timed

ROOT = Path(__file__).resolve().parent.parent

SHAPES = ("Qwen2.5-1.5B", "Llama-3-8B", "Llama-3-70B")  # of model/shapes.py: the state-bytes table


def state_bytes(shape: str, lora_rank: int, *, quantize: bool = False,
                shard_size: int = 8) -> tuple[int, int, float]:
    """(parameters, trainable parameters, GiB of weights + fp32 grads + AdamW state) of a named shape."""
    import torch
    from transformers import AutoModelForCausalLM

    from minitrainer.methods.base import count_parameters
    from minitrainer.methods.lora import LoraSettings, apply_lora
    from minitrainer.model.shapes import model_config
    from minitrainer.methods.qlora import quantize_base_weights

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(shape))
    if lora_rank:
        apply_lora(model, LoraSettings(rank=lora_rank, alpha=2.0 * lora_rank, dropout=0.0,
                                       target_modules="all-linear", use_rslora=False))
    trainable, total = count_parameters(model)
    weight_bytes = 4 * total
    if quantize:
        # The NF4 weights replace their fp32 masters; they dequantize to the GPU compute dtype (bf16).
        report = quantize_base_weights(model, shard_size=shard_size, dtype=torch.bfloat16)
        weight_bytes += report.num_nf4_bytes - 4 * report.num_quantized_elements
    return total, trainable, (weight_bytes + 12 * trainable) / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--lora-ranks", default="16", help="comma-separated LoRA ranks to compare with full")
    parser.add_argument("--hidden-size", type=int, default=256,
                        help="demo model width (QLoRA needs whole 64x256-weight NF4 groups per shard)")
    parser.add_argument("--num-steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output-json", default=str(ROOT / "bench" / "lora_results.json"))
    args = parser.parse_args()

    from minitrainer.tools.demo import DEMO_DATA, DemoConfig, build_demo_model
    from minitrainer.data.process_data import ProcessDataConfig, process_data

    work = Path(tempfile.mkdtemp(prefix="bench_lora_"))
    demo = DemoConfig(output_dir=str(work), hidden_size=args.hidden_size)
    model_dir = build_demo_model(work / "model", demo)
    process_data(ProcessDataConfig(input_file=str(DEMO_DATA), output_dir=str(work / "data"),
                                   model_name_or_path=str(model_dir), num_proc=1, num_printed_samples=0))
    modes = {"full": []}
    for r in args.lora_ranks.split(","):
        modes |= {f"lora r={r}": ["--lora-rank", r],
                  f"qlora r={r}": ["--lora-rank", r, "--lora-quantize-data-type", "nf4"]}
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for repeat in range(args.repeats):
        for mode, extra in modes.items():
            out = work / f"run_{mode.replace(' ', '_').replace('=', '')}_{repeat}"
            command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc_per_node}",
                       "--standalone", str(ROOT / "train.py"), "--model-name-or-path", str(model_dir),
                       "--data-path", str(work / "data"), "--output-dir", str(out),
                       "--batch-size", str(demo.batch_size), "--max-tokens-per-gpu", str(demo.max_tokens_per_gpu),
                       "--learning-rate", "1e-3", "--max-steps", str(args.num_steps),
                       "--min-samples-per-checkpoint", str(10**9), "--num-data-workers", "0", *extra]
            wall, _, peak_gib, code = run_timed(command)
            if code != 0:
                raise SystemExit(f"{mode} failed with exit code {code}")
            metrics = [json.loads(line) for line in (out / "training_metrics_0.jsonl").read_text().splitlines()]
            size = {kind: sum(f.stat().st_size for f in next((out / kind).iterdir()).rglob("*") if f.is_file())
                    for kind in ("full_state", "hf_format")}
            runs[mode].append({"step_s": statistics.median(m["time_per_batch"] for m in metrics[1:]),
                               "peak_rss_gib": peak_gib, "metrics_peak_gb": max(m["peak_memory_usage_GB"] for m in metrics),
                               "full_state_mb": size["full_state"] / 2**20, "hf_export_mb": size["hf_format"] / 2**20,
                               "wall_s": wall})
    results = {"nproc_per_node": args.nproc_per_node, "num_steps": args.num_steps, "runs": runs, "shapes": {}}
    full_step = statistics.median(r["step_s"] for r in runs["full"])
    print(f"\ndemo model ({demo.hidden_size} wide, {demo.num_layers} layers), {args.nproc_per_node} ranks, "
          f"median of {args.repeats} runs")
    print(f"{'mode':<12} {'step s':>8} {'vs full':>8} {'peak RSS GiB':>13} {'rank-0 peak GB':>14} "
          f"{'full state MB':>14} {'HF export MB':>13}")
    for mode, rows in runs.items():
        med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        print(f"{mode:<12} {med['step_s']:>8.4f} {med['step_s'] / full_step:>8.2f} {med['peak_rss_gib']:>13.3f} "
              f"{med['metrics_peak_gb']:>14.2f} {med['full_state_mb']:>14.2f} {med['hf_export_mb']:>13.2f}")
    print(f"\n{'shape':<14} {'mode':<12} {'params':>14} {'trainable':>14} {'weights+grads+AdamW GiB':>24}")
    for name in SHAPES:
        for mode in modes:
            rank = 0 if mode == "full" else int(mode.split("=")[1])
            total, trainable, gib = state_bytes(name, rank, quantize=mode.startswith("qlora"))
            results["shapes"][f"{name} {mode}"] = {"params": total, "trainable": trainable, "state_gib": gib}
            print(f"{name:<14} {mode:<12} {total:>14,} {trainable:>14,} {gib:>24.1f}")
    Path(args.output_json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
