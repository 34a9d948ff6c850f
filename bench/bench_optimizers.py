"""Every ``--optimizer`` side by side: optimizer-state bytes per trainable parameter, step time relative to AdamW,
peak memory (CUDA) and the losses after N steps on the same data.

    python -m bench.bench_optimizers                    # CPU, a 4-layer model 256 wide, all six, a few minutes
    python -m bench.bench_optimizers --optimizers adamw,muon --num-steps 40 --output-json optimizers.json

One process (FSDP2 over one rank: gloo on CPU, NCCL on a GPU) runs ``train.py``'s own steps (``setup_run``,
``train_step``, ``reduce_step``) for each optimizer from the same seed, model and data, each at its own learning
rate (``SETTINGS``: one learning rate does not fit them all, and the same one would bench a mistuned optimizer).

* state bytes: counted on ``optimizer.state`` as it is after the first step, over this rank's shards (torchao's
  quantized states as their codes, scales and code maps; Muon's momentum for the hidden matrices plus its AdamW
  part's moments for the rest; Adafactor's row and column factors), divided by the trainable parameters;
* step time: ``time.perf_counter`` around ``train_step`` + ``reduce_step`` (which reads the step's sums back, so a
  GPU's queued work is inside it), the median over the steps but the first two (warm-up; torchao compiles its
  update per parameter shape there), given as a ratio to adamw's in the same run. The absolute seconds are printed
  too, labelled: on a shared CPU with a 2.6M-parameter model they say little about a GPU run, where the update is
  a small part of a step; the ratio on CPU mostly shows the update's own cost;
* peak memory: on CUDA ``torch.cuda.max_memory_allocated`` over each optimizer's steps (reset before each); on CPU
  null, since the only figure there is the process's peak RSS, which spans every optimizer's run before it.
"""

from __future__ import annotations

import gc
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from fixtures.e2e import IGNORE_INDEX, model_vocab_size
from minitrainer.common.cli import comma_list, config_field, parse_config
from minitrainer.common.distributed import cleanup, init_distributed
from minitrainer.common.refusals import collect_errors
from minitrainer.loop.step import reduce_step, train_step
from minitrainer.optim.registry import OPTIMIZERS
from minitrainer.setup.run import batch_loader, close_run, setup_run
from minitrainer.tools.tiny_model import build_tiny_model
from minitrainer.train_config import TrainConfig

REFERENCE = "adamw"  # what the ratios divide by: the default, and what every recipe's learning rate is tuned for
WARMUP_STEPS = 2     # steps left out of the median step time
MARKOV_SUCCESSORS = 4
CPU_PEAK_MEMORY_NOTE = ("null on CPU: the only figure is this process's peak RSS, which never falls, so it spans "
                        "every earlier optimizer's run")


@dataclass(frozen=True)
class BenchSetting:
    """The learning rate and ``--optimizer-args`` an optimizer is benched at, and why those."""

    learning_rate: float
    args: dict[str, Any] = field(default_factory=dict)
    why: str = ""

    def train_flags(self, name: str) -> list[str]:
        """``train.py``'s flags for this setting (what ``bench/gpu_check.py``'s ``optimizers`` part runs)."""
        flags = ["--optimizer", name, "--learning-rate", repr(self.learning_rate)]
        return flags + (["--optimizer-args", json.dumps(self.args)] if self.args else [])


SETTINGS: dict[str, BenchSetting] = {
    "adamw": BenchSetting(1e-3, why="a usual rate for a small model trained from random init"),
    "adamw_8bit": BenchSetting(1e-3, why="AdamW's: the same update on quantized moments"),
    "adamw_4bit": BenchSetting(1e-3, why="AdamW's: the same update on quantized moments"),
    # SGD's step is lr x gradient (x 1/(1 - momentum) = 10 once momentum builds up); with the gradient clipped to
    # norm 1 over 2.6M parameters an element's gradient is ~6e-4, so 0.1 moves an element by ~6e-4 a step, near
    # AdamW's ~1e-3 (docs/optimizers.md: ~100x AdamW's). Nesterov: the usual SGDM of fine-tuning baselines.
    "sgd": BenchSetting(0.1, {"nesterov": True}, why="100x AdamW's: its step scales with the gradient's size"),
    "adafactor": BenchSetting(1e-2, why="torch's default: a cap on the relative step, not a step size"),
    # One --learning-rate drives both of Muon's parts. With "original" the usual 0.02 would also be the AdamW
    # part's rate (embeddings, head, norms: 20x adamw's); match_rms_adamw scales the matrices' update to AdamW's
    # RMS, so AdamW's rate fits both parts, and the AdamW part steps at the adamw row's rate.
    "muon": BenchSetting(1e-3, {"adjust_lr_fn": "match_rms_adamw"},
                         why="AdamW's, with match_rms_adamw: one rate for both parts"),
}


def setting_for(name: str) -> BenchSetting:
    """``SETTINGS[name]``, or AdamW's rate for an optimizer registered since (said so in ``why``)."""
    return SETTINGS.get(name) or BenchSetting(SETTINGS[REFERENCE].learning_rate,
                                              why="not in bench_optimizers.SETTINGS: AdamW's rate")


@dataclass(kw_only=True)
class OptimizersConfig:
    """What to compare."""

    optimizers: str = config_field(
        "", help="comma-separated --optimizer names (default: every one of the registry); adamw runs too when "
                 "left out, as the step-time and memory ratios divide by it")
    num_steps: int = config_field(30, help="optimizer steps per optimizer (the first two are not timed)")
    hidden_size: int = config_field(256, help="model width (tensors under 4096 elements keep fp32 8-bit states)")
    output_json: str | None = config_field(None, help="also write the rows (a JSON list) here")

    def __post_init__(self) -> None:
        errors = []
        unknown = [name for name in comma_list(self.optimizers) if name not in OPTIMIZERS]
        if unknown:
            errors.append(f"--optimizers: {', '.join(unknown)} not in the registry ({', '.join(OPTIMIZERS)})")
        if self.num_steps < 1:
            errors.append(f"--num-steps must be at least 1, got {self.num_steps}")
        collect_errors(errors)

    @property
    def names(self) -> list[str]:
        chosen = comma_list(self.optimizers) or list(OPTIMIZERS)
        return [REFERENCE, *(name for name in chosen if name != REFERENCE)]


def write_markov_jsonl(path: Path, *, num_samples: int, vocab_size: int, min_len: int, max_len: int,
                       seed: int) -> Path:
    """Tokenized rows (a masked prompt, then the reply) drawn from a random Markov chain in which each token has
    ``MARKOV_SUCCESSORS`` equally likely successors: something to learn (the loss can fall from ~ln V to
    ln 4 = 1.39), where uniform random tokens would leave every optimizer's loss at ln V and tell them apart by
    noise only."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab_size, size=(vocab_size, MARKOV_SUCCESSORS))
    with path.open("w") as f:
        for _ in range(num_samples):
            length = int(rng.integers(min_len, max_len + 1))
            ids = [int(rng.integers(vocab_size))]
            for choice in rng.integers(MARKOV_SUCCESSORS, size=length - 1):
                ids.append(int(successors[ids[-1], choice]))
            prompt = int(rng.integers(1, length))
            f.write(json.dumps({"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:], "len": length,
                                "num_loss_counted_tokens": length - prompt}) + "\n")
    return path


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's states on this rank (step counters included), each storage counted once."""
    seen, total = set(), 0
    for state in optimizer.state.values():
        for value in state.values():
            local = value.to_local() if isinstance(value, DTensor) else value
            if not isinstance(local, torch.Tensor):
                continue
            # torchao's OptimState8bit/4bit are tensor subclasses whose data are codes, scales and a code map.
            parts = [getattr(local, name) for name in getattr(local, "tensor_attrs", ())] or [local]
            for part in parts:
                if part.data_ptr() not in seen or part.data_ptr() == 0:
                    seen.add(part.data_ptr())
                    total += part.numel() * part.element_size()
    return total


def _train(name: str, config: OptimizersConfig, folder: Path, dist_info) -> dict:
    setting = setting_for(name)
    train_config = TrainConfig(model_name_or_path=str(folder / "model"), data_path=str(folder / "data.jsonl"),
                               output_dir=str(folder / f"out_{name}"), min_samples_per_checkpoint=10**9,
                               batch_size=16, max_tokens_per_gpu=512, max_steps=config.num_steps,
                               num_data_workers=0, optimizer=name, optimizer_args=dict(setting.args),
                               learning_rate=setting.learning_rate, num_warmup_steps=3, seed=7)
    cuda = dist_info.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    run = setup_run(train_config, dist_info)
    run.model.train()
    losses, seconds, num_bytes, peak = [], [], 0, 0
    try:
        with batch_loader(run) as loader:
            for _, batch in zip(range(config.num_steps), loader):
                began = time.perf_counter()
                result = train_step(run, batch)
                counts, _ = reduce_step(run, batch, result, preemption_requested=False)
                seconds.append(time.perf_counter() - began)
                losses.append(counts.loss_sum / max(counts.batch_num_loss_counted_tokens, 1))
                num_bytes = num_bytes or state_bytes(run.optimizer)
                if cuda:  # train_step resets the peak at each step's start: the run's peak is the steps' largest
                    peak = max(peak, torch.cuda.max_memory_allocated())
        num_params = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel()
                         for group in run.optimizer.param_groups for p in group["params"])
    finally:
        close_run(run)
    timed = seconds[WARMUP_STEPS:] or seconds
    return {"optimizer": name, "status": "ok", "learning_rate": setting.learning_rate,
            "optimizer_args": dict(setting.args), "why": setting.why,
            "state_bytes_per_param": num_bytes / num_params, "num_params": num_params,
            "median_step_seconds": statistics.median(timed), "num_timed_steps": len(timed), "step_seconds": seconds,
            "peak_memory_gb": peak / 1e9 if cuda else None,
            "first_loss": losses[0], "final_loss": losses[-1], "mean_last_5": sum(losses[-5:]) / len(losses[-5:])}


def _run_one(name: str, config: OptimizersConfig, folder: Path, dist_info) -> dict:
    """One optimizer's row; one that fails is a row saying so, and the others still run."""
    # Each starts from an empty compile cache, as its own train.py process would: torchao's 8-bit and 4-bit
    # updates are one compiled function, and the 4-bit run inheriting the 8-bit one's graphs (and its share of
    # dynamo's recompile limit) once failed here with "wrong number of dimensions1 for op: input".
    torch._dynamo.reset()
    try:
        return _train(name, config, folder, dist_info)
    except Exception as err:  # noqa: BLE001 - any optimizer's failure is one line of the table, not the end
        line = (str(err).strip().splitlines() or [""])[0]
        print(f"{name}: failed: {type(err).__name__}: {line}", flush=True)
        setting = setting_for(name)
        return {"optimizer": name, "status": f"failed: {type(err).__name__}: {line}",
                "learning_rate": setting.learning_rate, "optimizer_args": dict(setting.args), "why": setting.why}
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the next optimizer's peak starts from the model alone


def add_ratios(rows: list[dict]) -> None:
    """Each row's step time and peak memory over adamw's (None where either is missing)."""
    reference = next((r for r in rows if r["optimizer"] == REFERENCE and r["status"] == "ok"), None)
    for row in rows:
        for key, ratio in (("median_step_seconds", "step_time_vs_adamw"), ("peak_memory_gb", "peak_memory_vs_adamw")):
            ok = reference and row["status"] == "ok" and row.get(key) is not None and reference.get(key)
            row[ratio] = row[key] / reference[key] if ok else None


def table(rows: list[dict], num_steps: int, device: str) -> list[str]:
    def fmt(value, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    lines = [f"| `--optimizer` | lr | `--optimizer-args` | state bytes/param | step time vs adamw | "
             f"step s ({device}) | peak GB | loss step 1 | loss step {num_steps} | mean of the last 5 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        args = f"`{json.dumps(r['optimizer_args'])}`" if r["optimizer_args"] else ""
        if r["status"] != "ok":
            lines.append(f"| `{r['optimizer']}` | {r['learning_rate']:g} | {args} | {r['status']} |||||||")
            continue
        lines.append(f"| `{r['optimizer']}` | {r['learning_rate']:g} | {args} | {r['state_bytes_per_param']:.2f} | "
                     f"{fmt(r['step_time_vs_adamw'], '.2f')} | {r['median_step_seconds']:.3f} | "
                     f"{fmt(r['peak_memory_gb'], '.2f')} | {r['first_loss']:.4f} | {r['final_loss']:.4f} | "
                     f"{r['mean_last_5']:.4f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    config = parse_config(OptimizersConfig, argv, description=__doc__.split("\n\n")[0])
    dist_info = init_distributed()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            model_dir = build_tiny_model("chatml", folder / "model", hidden_size=config.hidden_size, num_layers=4,
                                         intermediate_size=2 * config.hidden_size)
            write_markov_jsonl(folder / "data.jsonl", num_samples=600, vocab_size=model_vocab_size(model_dir),
                               min_len=16, max_len=64, seed=2)
            rows = [_run_one(name, config, folder, dist_info) for name in config.names]
    finally:
        cleanup()
    add_ratios(rows)
    device = dist_info.device.type
    print("\n".join(table(rows, config.num_steps, device)))
    print(f"\nstep s: the median of train_step + reduce_step over steps {WARMUP_STEPS + 1}..{config.num_steps}, "
          f"absolute seconds on this {device}" + (" (only the ratio carries over to a GPU)" if device == "cpu" else ""))
    if device != "cuda":
        print(f"peak GB: {CPU_PEAK_MEMORY_NOTE}")
    if config.output_json:
        for row in rows:
            row["device"] = device
            if device != "cuda":
                row["peak_memory_note"] = CPU_PEAK_MEMORY_NOTE
        Path(config.output_json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
