"""The LM head and loss on learned positions only, against every position: time, peak memory, FLOPs.

    python -m bench.bench_loss                     # CPU: Qwen2.5-1.5B head (1536 x 151,936), 256 tokens, ~4 min
    python -m bench.bench_loss --tokens 1024 --masked-fraction 0.7 --repeats 3
    python -m bench.bench_loss --device cuda --dtype bf16 --tokens 32768 --liger   # a GPU (make gpu-check)

One row of ``--tokens`` positions, ``--masked-fraction`` of them prompt
(label -100), goes through forward + backward of the trainer's own loss code
(``loss.py``), twice per round, each in a fresh process so that its peak
memory is its own:

* ``all``: head + cross-entropy on every position (``--no-head-learned-positions-only``);
* ``learned``: ``loss.learned_positions`` + ``index_select`` first (the default),
  included in the timing.

Rounds alternate the two, so machine load hits both alike. Reported per mode:
median time of forward + backward (``--iters`` timed calls per process after
one warm-up), and the peak memory the calls add on top of the weight, the
hidden states and their gradient buffers (allocated beforehand): the logits
and their gradients (on CPU the process's peak RSS, on CUDA peak allocated).
The two losses are printed to show they agree.

FLOPs saved per step: the head costs ``6 * H * V`` FLOPs per position in
forward + backward (2 forward, 4 backward; the chunked path's recomputation
in backward adds ``2 * H * V`` more). Every prompt position is saved. The
masked fraction of real data comes from the shipped demo conversations
(``data/demo_chat.jsonl``) tokenized with the demo's tokenizer (``demo.py``),
or from ``--data`` (any ``process_data.py`` output). Writes
``bench/loss_results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# A fixed glibc mmap threshold: every large tensor gets its own mapping, returned to the system when
# freed, so the process's peak RSS follows the live tensors instead of a heap that only grows.
WORKER_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}

QWEN_1_5B_FLOPS_PER_TOKEN = 10.3e9
"""Training FLOPs per token of Qwen2.5-1.5B at 32k context, to put the head's share in scale."""


def measure(args: argparse.Namespace, mode: str) -> dict:
    """One process, one mode: times and added peak memory of the head's forward + backward."""
    import torch

    from minitrainer.model.loss import chunked_cross_entropy_sum, learned_positions, make_liger_fused_loss
    from minitrainer.model.loss_terms import LogitTransform
    from minitrainer.common.device import peak_memory_gb, reset_peak_memory, synchronize
    from minitrainer.common.labels import IGNORE_INDEX

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden, generator=generator) * 0.02).to(device, dtype).requires_grad_()
    hidden = torch.randn(args.tokens, args.hidden, generator=generator).to(device, dtype).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=generator)
    masked = torch.randperm(args.tokens, generator=generator)[:round(args.masked_fraction * args.tokens)]
    labels[masked] = IGNORE_INDEX
    labels = labels.to(device)
    liger = make_liger_fused_loss(LogitTransform()) if args.liger else None

    def step() -> float:
        h, y = hidden, labels
        if mode == "learned":
            positions = learned_positions(labels)
            h, y = hidden.index_select(0, positions), labels.index_select(0, positions)
        loss = liger(weight, h, y, None) if liger is not None else chunked_cross_entropy_sum(h, weight, None, y)
        loss.backward()
        return loss.item()

    # Gradient buffers exist before the baseline, so the peak below is the head's own transient memory
    # (logit chunks, their gradients, the selection), not the weight gradient both modes need.
    weight.grad, hidden.grad = torch.zeros_like(weight), torch.zeros_like(hidden)
    synchronize()
    reset_peak_memory()
    base_gb = peak_memory_gb()
    times, loss = [], None
    for i in range(args.iters + 1):
        start = time.perf_counter()
        loss = step()  # .item(): CPU-GPU sync point, so the time below is the device's
        synchronize()
        if i > 0:  # the first call is a warm-up (allocator, kernels), timed by neither mode
            times.append(time.perf_counter() - start)
    return {"mode": mode, "times": times, "peak_added_gb": peak_memory_gb() - base_gb, "loss": loss}


def masked_fraction_of(data_path: str) -> tuple[float, int]:
    """(prompt share of all positions, number of samples) of a tokenized dataset (targets already shifted)."""
    from minitrainer.data.sampler import load_tokenized_dataset

    dataset = load_tokenized_dataset(data_path)
    tokens = int(dataset.lengths.sum())
    return 1.0 - int(dataset.num_loss_counted_tokens.sum()) / tokens, len(dataset)


def demo_data(folder: Path) -> str:
    """The shipped demo conversations tokenized as ``demo.py`` does (its BPE tokenizer, masked prompts)."""
    from minitrainer.tools.demo import DEMO_DATA, DemoConfig, build_demo_model
    from minitrainer.data.process_data import ProcessDataConfig, process_data

    model_dir = build_demo_model(folder / "model", DemoConfig(hidden_size=32, num_layers=1))
    process_data(ProcessDataConfig(input_file=str(DEMO_DATA), output_dir=str(folder / "data"),
                                   model_name_or_path=str(model_dir), num_proc=1, num_printed_samples=0))
    return str(folder / "data")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="positions in the row")
    parser.add_argument("--hidden", type=int, default=1536, help="hidden size (Qwen2.5-1.5B)")
    parser.add_argument("--vocab", type=int, default=151936, help="vocabulary (Qwen2.5)")
    parser.add_argument("--masked-fraction", type=float, default=0.6, help="share of prompt positions in the row")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of (all, learned), one process each")
    parser.add_argument("--iters", type=int, default=1, help="timed forward + backward calls per process")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="weight and hidden dtype")
    parser.add_argument("--liger", action="store_true", help="Liger's fused linear cross-entropy (CUDA)")
    parser.add_argument("--data", default=None, help="tokenized data for the real masked fraction "
                                                     "(default: the demo conversations, tokenized here)")
    parser.add_argument("--step-tokens", type=int, default=32768, help="tokens per step for the FLOPs figure")
    parser.add_argument("--output", default=str(ROOT / "bench" / "loss_results.json"), help="results JSON")
    parser.add_argument("--worker", choices=("all", "learned"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT" + json.dumps(measure(args, args.worker)), flush=True)
        return

    forwarded = [a for a in sys.argv[1:] if a != "--worker"]
    runs: dict[str, list[dict]] = {"all": [], "learned": []}
    for _ in range(args.repeats):
        for mode in runs:
            done = subprocess.run([sys.executable, "-m", "bench.bench_loss", *forwarded, "--worker", mode], cwd=ROOT,
                                  capture_output=True, text=True, check=False, env=WORKER_ENV)
            if done.returncode != 0:
                raise SystemExit(f"{mode} run failed:\n{done.stderr[-3000:]}")
            [line] = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")]
            runs[mode].append(json.loads(line.removeprefix("RESULT")))

    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or demo_data(Path(tmp))
        real_masked, num_samples = masked_fraction_of(data)
    per_position = 6 * args.hidden * args.vocab
    summary = {mode: {"median_s": statistics.median(t for r in rs for t in r["times"]),
                      "peak_added_gb": max(r["peak_added_gb"] for r in rs), "loss": rs[0]["loss"]}
               for mode, rs in runs.items()}
    saved = real_masked * args.step_tokens * per_position
    saved_at_row_fraction = args.masked_fraction * args.step_tokens * per_position
    result = {"command": " ".join([Path(sys.executable).name, "-m", "bench.bench_loss", *forwarded]),
              "shape": {"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "dtype": args.dtype,
                        "device": args.device, "liger": args.liger, "masked_fraction": args.masked_fraction},
              "modes": summary, "speedup": summary["all"]["median_s"] / summary["learned"]["median_s"],
              "data": {"path": args.data or "data/demo_chat.jsonl (demo tokenizer)", "samples": num_samples,
                       "masked_fraction": real_masked},
              "flops": {"head_per_position": per_position, "step_tokens": args.step_tokens,
                        "saved_per_step": saved, "saved_per_step_at_masked_fraction": saved_at_row_fraction,
                        "saved_share_of_qwen_1_5b_step": saved / (args.step_tokens * QWEN_1_5B_FLOPS_PER_TOKEN)}}
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")

    print(f"head {args.hidden} x {args.vocab}, {args.tokens} positions, {args.masked_fraction:.0%} prompt, "
          f"{args.dtype} on {args.device}{' (Liger)' if args.liger else ''}, {args.repeats} x {args.iters} calls")
    print(f"{'mode':<10}{'fwd+bwd s':>12}{'peak +GB':>10}{'loss':>16}")
    for mode, s in summary.items():
        print(f"{mode:<10}{s['median_s']:>12.3f}{s['peak_added_gb']:>10.2f}{s['loss']:>16.4f}")
    print(f"speedup {result['speedup']:.2f}x")
    print(f"data {result['data']['path']}: {num_samples} samples, {real_masked:.1%} of positions are prompt")
    print(f"FLOPs saved per {args.step_tokens}-token step: {saved / 1e12:.2f} TFLOP "
          f"({result['flops']['saved_share_of_qwen_1_5b_step']:.1%} of a Qwen2.5-1.5B step at "
          f"{QWEN_1_5B_FLOPS_PER_TOKEN / 1e9:g} GFLOP/token); at {args.masked_fraction:.0%} prompt "
          f"{saved_at_row_fraction / 1e12:.2f} TFLOP "
          f"({saved_at_row_fraction / (args.step_tokens * QWEN_1_5B_FLOPS_PER_TOKEN):.1%})")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
