"""The fixed cost of a training step: host-device synchronisations counted, and the time that does not
scale with tokens.

    python -m bench.bench_step_cost                                  # tiny model, CPU, ~1 min
    python -m bench.bench_step_cost --optimizer adamw_8bit --optimizer-path as-built
    python -m bench.bench_step_cost --output-json step_cost.json

One process (FSDP2 over one gloo rank) runs ``train.py``'s own step on a tiny random model and tokenized
data written to a scratch folder: ``setup_run``, then ``train_step``, ``reduce_step`` and ``log_step``, as
the loop calls them.

* Synchronisations: ``fixtures.sync_count.SyncCounter`` counts the host's reads of values the device
  computed during one whole step (after two warm-up steps): the trainer's, and apart the model's own
  (CPU runs sdpa, whose mask code in transformers reads the packed position ids). ``--optimizer-path gpu`` (default) builds
  the optimizer as a GPU run does (``adamw``: fused, which skips a non-finite step on the device), so the
  count is a GPU run's, read for read; ``as-built`` keeps what this device builds (CPU: foreach AdamW).
* Fixed cost: steps at several token budgets, timed whole; a least-squares line ``time = fixed + per_token x
  tokens`` gives the part that does not scale with tokens, and the optimizer's step (timed by its own
  hooks), ``reduce_step`` (the all-reduce and the one read-back) and ``log_step`` are timed apart.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from fixtures.e2e import model_vocab_size, write_tokenized_jsonl
from fixtures.sync_count import SyncCounter
from minitrainer.setup import schedule
from minitrainer.common.cli import config_field, parse_config
from minitrainer.common.distributed import cleanup, init_distributed
from minitrainer.report.progress import Progress
from minitrainer.setup.run import batch_loader, setup_run
from minitrainer.tools.tiny_model import build_tiny_model
from minitrainer.train_config import TrainConfig
from minitrainer.loop.step import log_step, reduce_step, train_step


@dataclass(kw_only=True)
class StepCostConfig:
    """What to measure."""

    optimizer: Literal["adamw", "adamw_8bit"] = config_field("adamw", help="--optimizer of the measured run")
    optimizer_path: Literal["gpu", "as-built"] = config_field(
        "gpu", help="gpu: build the optimizer as a GPU run does (fused AdamW); as-built: as this device does")
    token_budgets: str = config_field("128,256,512", help="comma-separated --max-tokens-per-gpu values to fit")
    num_steps: int = config_field(6, help="timed steps per budget (after 2 warm-up steps and the counted one)")
    output_json: str | None = config_field(None, help="also write the figures here")


def _run(config: StepCostConfig, folder: Path, max_tokens: int, dist_info):
    model_dir = build_tiny_model("chatml", folder / "model")
    data = write_tokenized_jsonl(folder / "data.jsonl", num_samples=400, vocab_size=model_vocab_size(model_dir),
                                 min_len=16, max_len=64, seed=1)
    train_config = TrainConfig(model_name_or_path=str(model_dir), data_path=str(data),
                               output_dir=str(folder / f"out_{max_tokens}"), min_samples_per_checkpoint=10**9,
                               batch_size=max(4, max_tokens // 40), max_tokens_per_gpu=max_tokens, max_steps=100,
                               num_data_workers=0, skip_objective_check=True, optimizer=config.optimizer,
                               learning_rate=1e-4)
    run = setup_run(train_config, dist_info)
    if config.optimizer_path == "gpu" and config.optimizer == "adamw":
        groups = [{"params": group["params"], "weight_decay": group["weight_decay"]} for group in run.optimizer.param_groups]
        optimizer = torch.optim.AdamW(groups, lr=train_config.learning_rate,
                                      betas=train_config.adam_betas, fused=True)
        run = dataclasses.replace(run, optimizer=optimizer,
                                  scheduler=schedule.build_scheduler(train_config, optimizer, run.total_steps))
    return run


def measure(config: StepCostConfig) -> dict:
    dist_info = init_distributed()
    budgets = [int(b) for b in config.token_budgets.split(",")]
    results: dict = {"optimizer": config.optimizer, "optimizer_path": config.optimizer_path, "budgets": []}
    progress = Progress("none", total=None)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for budget in budgets:
                run = _run(config, Path(tmp), budget, dist_info)
                optimizer_times, began = [], []
                run.optimizer.register_step_pre_hook(lambda *_: began.append(time.perf_counter()))
                run.optimizer.register_step_post_hook(
                    lambda *_: optimizer_times.append(time.perf_counter() - began[-1]))
                step_times, reduce_times, log_times, tokens, sites = [], [], [], [], None
                run.model.train()
                with batch_loader(run) as loader:
                    for index, batch in zip(range(config.num_steps + 3), loader):  # 2 warm-up, 1 counted
                        counting = index == 2 and sites is None
                        counter = SyncCounter(run.model, run.optimizer) if counting else None
                        start = time.perf_counter()
                        if counter:
                            counter.__enter__()
                        try:
                            result = train_step(run, batch)
                            middle = time.perf_counter()
                            counts, _ = reduce_step(run, batch, result, preemption_requested=False)
                            reduced = time.perf_counter()
                            log_step(run, batch, result, counts, progress=progress)
                        finally:
                            if counter:
                                counter.__exit__(None, None, None)
                        end = time.perf_counter()
                        if counter:
                            sites = counter.sites
                        elif index >= 2:
                            step_times.append(end - start)
                            reduce_times.append(reduced - middle)
                            log_times.append(end - reduced)
                            tokens.append(batch.num_total_tokens)
                timed = optimizer_times[-len(step_times):]
                results["budgets"].append({
                    "max_tokens_per_gpu": budget, "mean_tokens": statistics.mean(tokens),
                    "step_ms": 1e3 * statistics.median(step_times), "optimizer_step_ms": 1e3 * statistics.median(timed),
                    "reduce_step_ms": 1e3 * statistics.median(reduce_times),
                    "log_step_ms": 1e3 * statistics.median(log_times),
                    "syncs_per_step": len([site for site in sites if " via " not in site]),
                    "model_syncs_per_step": len([site for site in sites if " via " in site]), "sync_sites": sites,
                    "_points": list(zip(tokens, step_times))})
                run.metrics.close() if run.metrics is not None else None
    finally:
        cleanup()
    # The fastest step of each budget: on a shared machine the others wait for the CPU, not for the work.
    points = [(b["mean_tokens"], min(s for _, s in b.pop("_points"))) for b in results["budgets"]]
    if len(points) > 1:
        per_token, fixed = np.polyfit([t for t, _ in points], [s for _, s in points], 1)
        results.update(fixed_ms=1e3 * float(fixed), per_token_us=1e6 * float(per_token))
    return results


def main(argv: list[str] | None = None) -> None:
    config = parse_config(StepCostConfig, argv, description=__doc__.split("\n\n")[0])
    results = measure(config)
    print(f"optimizer {results['optimizer']} ({results['optimizer_path']} path)")
    print(f"{'budget':>7} {'tokens':>7} {'step ms':>8} {'optim ms':>9} {'reduce ms':>10} {'log ms':>7} {'syncs':>6} "
          f"{'model':>6}")
    for b in results["budgets"]:
        print(f"{b['max_tokens_per_gpu']:>7} {b['mean_tokens']:>7.0f} {b['step_ms']:>8.1f} {b['optimizer_step_ms']:>9.2f} "
              f"{b['reduce_step_ms']:>10.2f} {b['log_step_ms']:>7.2f} {b['syncs_per_step']:>6} "
              f"{b['model_syncs_per_step']:>6}  {b['sync_sites']}")
    print("syncs: the trainer's reads of device values per step; model: the model's own (sdpa's mask code in "
          "transformers reading packed positions; none with the varlen backends a GPU run picks)")
    if "fixed_ms" in results:
        print(f"fixed cost per step {results['fixed_ms']:.1f} ms; {results['per_token_us']:.1f} us per token "
              "(least squares over each budget's fastest step)")
    if config.output_json:
        Path(config.output_json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
