"""``--optimizer`` side by side: optimizer-state bytes per trainable parameter, and the loss after N steps on
the same data.

    python -m bench.bench_optimizers                    # CPU, a 4-layer model 256 wide, ~3 min
    python -m bench.bench_optimizers --num-steps 40 --output-json optimizers.json

One process (FSDP2 over one gloo rank) runs ``train.py``'s own steps (``setup_run``, ``train_step``,
``reduce_step``) for each optimizer from the same seed, model and data; the state bytes are counted on the
optimizer's states after the first step (for torchao's 8-bit states: the codes and their fp32 scales),
over this rank's shards.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from fixtures.e2e import model_vocab_size, write_tokenized_jsonl
from minitrainer.common.cli import config_field, parse_config
from minitrainer.common.distributed import cleanup, init_distributed
from minitrainer.optim.optimizers import OPTIMIZERS
from minitrainer.setup.run import batch_loader, setup_run
from minitrainer.tools.tiny_model import build_tiny_model
from minitrainer.train_config import TrainConfig
from minitrainer.loop.step import reduce_step, train_step


@dataclass(kw_only=True)
class OptimizersConfig:
    """What to compare."""

    num_steps: int = config_field(30, help="optimizer steps per optimizer")
    hidden_size: int = config_field(256, help="model width (tensors under 4096 elements keep fp32 8-bit states)")
    learning_rate: float = config_field(1e-3, help="peak learning rate (constant after 3 warmup steps)")
    output_json: str | None = config_field(None, help="also write the figures here")


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's states on this rank (step counters included)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            local = value.to_local() if isinstance(value, DTensor) else value
            if not isinstance(local, torch.Tensor):
                continue
            # torchao's OptimState8bit is a tensor subclass holding uint8 codes and fp32 scales.
            parts = [getattr(local, name) for name in ("codes", "scale", "qmap") if hasattr(local, name)] or [local]
            total += sum(part.numel() * part.element_size() for part in parts)
    return total


def _train(name: str, config: OptimizersConfig, folder: Path, dist_info) -> dict:
    train_config = TrainConfig(model_name_or_path=str(folder / "model"), data_path=str(folder / "data.jsonl"),
                               output_dir=str(folder / f"out_{name}"), min_samples_per_checkpoint=10**9,
                               batch_size=16, max_tokens_per_gpu=512, max_steps=config.num_steps,
                               num_data_workers=0, optimizer=name, learning_rate=config.learning_rate,
                               num_warmup_steps=3, seed=7)
    run = setup_run(train_config, dist_info)
    run.model.train()
    losses, num_bytes = [], 0
    with batch_loader(run) as loader:
        for _, batch in zip(range(config.num_steps), loader):
            result = train_step(run, batch)
            counts, _ = reduce_step(run, batch, result, preemption_requested=False)
            losses.append(counts.loss_sum / max(counts.batch_num_loss_counted_tokens, 1))
            num_bytes = num_bytes or state_bytes(run.optimizer)
    num_params = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel()
                     for group in run.optimizer.param_groups for p in group["params"])
    if run.metrics is not None:
        run.metrics.close()
    return {"optimizer": name, "state_bytes_per_param": num_bytes / num_params, "num_params": num_params,
            "first_loss": losses[0], "final_loss": losses[-1], "mean_last_5": sum(losses[-5:]) / len(losses[-5:])}


def main(argv: list[str] | None = None) -> None:
    config = parse_config(OptimizersConfig, argv, description=__doc__.split("\n\n")[0])
    dist_info = init_distributed()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            model_dir = build_tiny_model("chatml", folder / "model", hidden_size=config.hidden_size, num_layers=4,
                                         intermediate_size=2 * config.hidden_size)
            write_tokenized_jsonl(folder / "data.jsonl", num_samples=600, vocab_size=model_vocab_size(model_dir),
                                  min_len=16, max_len=64, seed=2)
            results = [_train(name, config, folder, dist_info) for name in OPTIMIZERS]
    finally:
        cleanup()
    print(f"{'optimizer':<11} {'bytes/param':>11} {'params':>9} {'loss step 1':>11} {'loss step N':>11} "
          f"{'mean last 5':>11}   (N = {config.num_steps})")
    for r in results:
        print(f"{r['optimizer']:<11} {r['state_bytes_per_param']:>11.2f} {r['num_params']:>9} {r['first_loss']:>11.4f} "
              f"{r['final_loss']:>11.4f} {r['mean_last_5']:>11.4f}")
    if config.output_json:
        Path(config.output_json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
