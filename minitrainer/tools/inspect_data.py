"""Look at a tokenized dataset before launching GPUs: lengths, loss tokens, and the packing plan.

    python -m minitrainer.tools.inspect_data --data-path data/chat_tkns --batch-size 128 \\
        --max-tokens-per-gpu 10000 --world-size 8
    python -m minitrainer.tools.inspect_data --data-path demo_output/data --batch-size 16 --max-tokens-per-gpu 1024 --world-size 2
    python -m minitrainer.tools.inspect_data --data-path data/chat.parquet --model-name-or-path Qwen/Qwen2.5-1.5B-Instruct \\
        --tokenized-data-dir out/tokenized_data --batch-size 128 --max-tokens-per-gpu 10000 --world-size 8

``--data-path`` takes what ``train.py --data-path`` takes: a tokenized jsonl or ``process_data.py``
folder, raw data in any format ``process_data.py`` reads, or a mix of those (``a:0.7,b:0.3``, a mix
file, drawn from by the mix's own stream as the trainer draws). Raw data is tokenized
once with ``--model-name-or-path`` (and the same raw-data flags as ``train.py``) into a cache folder
under ``--tokenized-data-dir`` (``data/cache.py``, the code ``train.py`` runs): give it the run's
``<--output-dir>/tokenized_data`` and the training run reuses the tokens.

No GPU, no torchrun: it reads the lengths the trainer reads and runs the same
planner the trainer runs (``sampler.InfiniteSampler`` -> drop samples over the
budget -> ``packing.plan_minibatches``), for the first ``--num-steps`` steps
with the same ``--seed``. It prints:

  * a length histogram (tokens per sample) and the share of tokens that count
    towards the loss;
  * how many samples exceed ``--max-tokens-per-gpu`` (the trainer drops them);
  * per step: minibatches per rank (= gradient-accumulation steps),
    utilization (tokens / (minibatches x world size x budget)) and balance
    (mean rank load / max rank load within a minibatch, 1.0 = perfect).

Use it to pick ``--batch-size`` and ``--max-tokens-per-gpu``: the budget is
a memory limit (raise it until a step nearly fills the GPU), the batch size
sets the optimization, and more minibatches per step only cost time.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minitrainer.common.cli import config_field, parse_config
from minitrainer.common.refusals import collect_errors
from minitrainer.common.log import setup_logging
from minitrainer.data.tokenizing_flags import tokenizing_field

HISTOGRAM_WIDTH = 40


@dataclass
class InspectDataConfig:
    data_path: str = config_field(help="train.py --data-path: tokenized data, raw data (tokenized once with "
                                       "--model-name-or-path), or a mix (`a:0.7,b:0.3`, a mix file)")
    batch_size: int = config_field(1024, help="samples per optimizer step, whole job (train.py --batch-size)")
    max_tokens_per_gpu: int = config_field(10000, help="token budget of one packed minibatch on one rank")
    world_size: int = config_field(8, help="ranks (GPUs) of the job to plan for: nnodes x nproc-per-node")
    num_steps: int = config_field(5, help="optimizer steps to plan and show")
    seed: int = config_field(42, help="train.py --seed (the data order)")
    balance: str = config_field("tokens", choices=("tokens", "attention"), help="train.py --balance")
    # Raw data: train.py's flags of the same names (data/tokenizing_flags.py).
    model_name_or_path: str | None = config_field(None, help="raw data: the tokenizer (train.py --model-name-or-path)")
    tokenized_data_dir: str | None = config_field(
        None, help="raw data: the cache of its tokens (default: in the temp folder); a run's "
                   "<--output-dir>/tokenized_data shares it with train.py")
    chat_template: str | None = tokenizing_field("chat_template", run=True)
    end_of_turn_token: str | None = tokenizing_field("end_of_turn_token", run=True)
    mask_reasoning: bool = tokenizing_field("mask_reasoning", run=True)
    max_sample_num_tokens: int = tokenizing_field("max_sample_num_tokens", run=True)
    split_long_text: bool = tokenizing_field("split_long_text", run=True)
    input_format: str = tokenizing_field("input_format", run=True)
    columns: str | None = tokenizing_field("columns", run=True)
    data_split: str = tokenizing_field("data_split", run=True)
    data_subset: str | None = tokenizing_field("data_subset", run=True)
    text_sample_by: str = tokenizing_field("text_sample_by", run=True)
    sharegpt_roles: str | None = tokenizing_field("sharegpt_roles", run=True)

    def __post_init__(self) -> None:
        errors = [f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}"
                  for name in ("batch_size", "max_tokens_per_gpu", "world_size", "num_steps")
                  if getattr(self, name) < 1]
        if self.seed < 0:
            errors.append(f"--seed must be >= 0, got {self.seed}")
        collect_errors(errors)


@dataclass(frozen=True)
class StepPlan:
    step: int
    num_samples: int
    num_dropped: int
    num_minibatches: int
    num_tokens: int
    max_rank_tokens: int
    utilization: float
    balance: float


def length_histogram(lengths: np.ndarray) -> list[tuple[int, int, int]]:
    """``(low, high, count)`` rows over power-of-two length bins ``[2^k, 2^(k+1) - 1]``."""
    if lengths.size == 0:
        return []
    low_exp = int(math.floor(math.log2(max(int(lengths.min()), 1))))
    high_exp = int(math.floor(math.log2(max(int(lengths.max()), 1))))
    rows = []
    for exp in range(low_exp, high_exp + 1):
        low, high = 2**exp, 2 ** (exp + 1) - 1
        rows.append((low, high, int(np.count_nonzero((lengths >= low) & (lengths <= high)))))
    return rows


def plan_steps(lengths: np.ndarray, config: InspectDataConfig, sampler=None) -> list[StepPlan]:
    """The trainer's plan for the first ``config.num_steps`` steps, summarised per step; ``sampler`` is the
    trainer's stream of indices (a mix's own, ``MixedDataset.stream``), by default the plain one."""
    from minitrainer.data.packing import plan_minibatches, rank_loads
    from minitrainer.data.sampler import InfiniteSampler

    sampler = sampler or InfiniteSampler(len(lengths), config.seed)
    plans = []
    for step in range(1, config.num_steps + 1):
        indices = sampler.take(config.batch_size)
        batch_lengths = lengths[indices]
        kept = batch_lengths[batch_lengths <= config.max_tokens_per_gpu]
        plan = plan_minibatches(kept, max_tokens_per_rank=config.max_tokens_per_gpu, num_ranks=config.world_size,
                                cost=config.balance)
        loads = rank_loads(plan, kept)  # [minibatches, ranks]
        num_minibatches = len(plan)
        capacity = num_minibatches * config.world_size * config.max_tokens_per_gpu
        row_max = loads.max(axis=1) if num_minibatches else np.zeros(0)
        balance = float(np.mean(loads.mean(axis=1) / np.maximum(row_max, 1))) if num_minibatches else 0.0
        plans.append(StepPlan(step=step, num_samples=int(kept.size), num_dropped=int(batch_lengths.size - kept.size),
                              num_minibatches=num_minibatches, num_tokens=int(kept.sum()),
                              max_rank_tokens=int(row_max.max()) if num_minibatches else 0,
                              utilization=float(kept.sum()) / capacity if capacity else 0.0, balance=balance))
    return plans


def tokenized_path(config: InspectDataConfig, source: str) -> Path:
    """``source`` (one source of ``--data-path``) when it is tokenized; else the cache folder of its tokens, made
    now unless a whole one exists (``data/cache.py``'s ``tokenize_once``, as ``train.py`` tokenizes raw data)."""
    import tempfile

    from minitrainer.data import cache
    from minitrainer.data.process_data import tokenizing_config

    if cache.is_tokenized(source):
        return Path(source)
    if config.model_name_or_path is None:
        raise ValueError(f"--data-path {source} is raw data (its rows have no input_ids): pass "
                         "--model-name-or-path to tokenize it as train.py does")
    cache_root = config.tokenized_data_dir or str(Path(tempfile.gettempdir()) / "minitrainer-tokenized_data")
    return cache.tokenize_once(tokenizing_config(config, source, output_dir=cache_root))


def inspect_data(config: InspectDataConfig) -> dict:
    """Print the report; return its numbers (for tests and notebooks).

    Returns:
        ``num_samples``, ``num_tokens``, ``num_loss_counted_tokens``, ``loss_token_share``,
        ``num_over_budget``, ``histogram`` (list of (low, high, count)) and ``steps`` (list of StepPlan).
    """
    from minitrainer.data.mix import load_data
    from minitrainer.data.sampler import load_tokenized_dataset

    # One source or a mix (`a:0.7,b:0.3`, a mix file), each tokenized or raw, as train.py loads them.
    dataset = load_data(config.data_path, lambda source: load_tokenized_dataset(str(tokenized_path(config, source))))
    lengths, loss_tokens = dataset.lengths, dataset.num_loss_counted_tokens
    num_tokens, num_loss = int(lengths.sum()), int(loss_tokens.sum())
    over = lengths > config.max_tokens_per_gpu
    histogram = length_histogram(lengths)
    steps = plan_steps(lengths, config, dataset.stream(config.seed) if hasattr(dataset, "stream") else None)

    print(f"data {dataset.path}: {len(dataset)} samples, {num_tokens} tokens")
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    print(f"tokens per sample: min {int(lengths.min())}, p50 {p50:.0f}, p90 {p90:.0f}, p99 {p99:.0f}, "
          f"max {int(lengths.max())}, mean {lengths.mean():.1f}")
    print(f"loss-counted tokens: {num_loss} = {100 * num_loss / max(num_tokens, 1):.1f}% of all tokens "
          f"(the rest are prompts, system text and template tokens); "
          f"{int(np.count_nonzero(loss_tokens == 0))} samples have none")
    print("\nlength histogram (tokens per sample):")
    peak = max(count for _, _, count in histogram)
    for low, high, count in histogram:
        bar = "#" * max(int(round(HISTOGRAM_WIDTH * count / peak)), 1 if count else 0)
        marker = "  <- over budget" if low > config.max_tokens_per_gpu else \
            "  <- partly over budget" if high > config.max_tokens_per_gpu >= low else ""
        print(f"  {low:>7}-{high:<7} {bar:<{HISTOGRAM_WIDTH}} {count:>7} ({100 * count / len(dataset):5.1f}%){marker}")
    print(f"\n--max-tokens-per-gpu {config.max_tokens_per_gpu}: {int(over.sum())} samples "
          f"({100 * over.mean():.2f}%) are longer; the trainer drops them whenever they are drawn"
          + (f" (they hold {int(lengths[over].sum())} tokens)" if over.any() else ""))

    steps_per_epoch = math.ceil(len(dataset) / config.batch_size)
    print(f"\npacking plan: --batch-size {config.batch_size}, world size {config.world_size}, "
          f"--seed {config.seed}, balance {config.balance}; one epoch = {steps_per_epoch} steps")
    print(f"  {'step':>4} {'samples':>7} {'dropped':>7} {'minibatches':>11} {'tokens':>9} "
          f"{'max/rank':>9} {'utilization':>11} {'balance':>7}")
    for s in steps:
        print(f"  {s.step:>4} {s.num_samples:>7} {s.num_dropped:>7} {s.num_minibatches:>11} {s.num_tokens:>9} "
              f"{s.max_rank_tokens:>9} {100 * s.utilization:>10.1f}% {s.balance:>7.3f}")
    mean_minibatches = float(np.mean([s.num_minibatches for s in steps]))
    mean_utilization = float(np.mean([s.utilization for s in steps]))
    print(f"  mean: {mean_minibatches:.1f} minibatches (gradient-accumulation steps) per rank per step, "
          f"{100 * mean_utilization:.1f}% of the token budget used")
    if mean_minibatches <= 1 and mean_utilization < 0.5:
        print("  hint: one half-empty minibatch per step; --batch-size can grow at no extra memory, "
              "or --max-tokens-per-gpu can shrink")
    return {"num_samples": len(dataset), "num_tokens": num_tokens, "num_loss_counted_tokens": num_loss,
            "loss_token_share": num_loss / max(num_tokens, 1), "num_over_budget": int(over.sum()),
            "histogram": histogram, "steps": steps}


def main(argv: list[str] | None = None, *, prog: str = "inspect_data.py") -> dict:
    config = parse_config(InspectDataConfig, argv, description=__doc__.split("\n\n")[0])
    setup_logging()  # raw data: the tokenizing run's lines, as train.py shows them
    try:
        return inspect_data(config)
    except ValueError as err:
        raise SystemExit(f"{prog}: error: {err}") from None


def cli() -> None:
    """The command line (``python -m minitrainer.tools.inspect_data``, ``minitrainer-inspect-data``): ``main``,
    its report printed rather than returned."""
    main(prog=Path(sys.argv[0]).name)


if __name__ == "__main__":
    cli()
