"""How long a run lasts and its learning-rate schedule: stop conditions and transformers' schedulers."""

from __future__ import annotations

import math
from typing import Callable

import torch

from minitrainer.checkpoint.train_state import TrainState
from minitrainer.common.log import logger
from minitrainer.train_config import SCHEDULERS_WITHOUT_TOTAL, TrainConfig


def total_steps(config: TrainConfig, num_dataset_samples: int) -> int | None:
    """Optimizer steps until the first stop condition, or None for infinite sampling."""
    candidates = []
    if config.max_steps is not None:
        candidates.append(config.max_steps)
    if config.max_samples is not None:
        candidates.append(math.ceil(config.max_samples / config.batch_size))
    if config.num_epochs is not None:
        candidates.append(math.ceil(config.num_epochs * num_dataset_samples / config.batch_size))
    return min(candidates) if candidates else None


def stop_reason(config: TrainConfig, state: TrainState, num_dataset_samples: int) -> str | None:
    if config.max_steps is not None and state.step >= config.max_steps:
        return f"reached --max-steps {config.max_steps}"
    if config.max_samples is not None and state.samples_seen >= config.max_samples:
        return f"reached --max-samples {config.max_samples}"
    if config.num_epochs is not None and state.samples_seen >= config.num_epochs * num_dataset_samples:
        return f"reached --num-epochs {config.num_epochs}"
    return None


def build_scheduler(config: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int | None):
    from transformers import get_scheduler

    return get_scheduler(config.lr_scheduler, optimizer, num_warmup_steps=config.num_warmup_steps,
                         num_training_steps=total_steps, scheduler_specific_kwargs=scheduler_kwargs(config, total_steps))


def scheduler_kwargs(config: TrainConfig, total_steps: int | None) -> dict:
    """The extra arguments of the schedulers that need more than warmup and total steps."""
    if config.lr_scheduler in ("cosine_with_min_lr", "cosine_warmup_with_min_lr"):
        return {"min_lr_rate": config.min_lr_ratio}
    if config.lr_scheduler == "warmup_stable_decay":
        return {"num_decay_steps": max(1, math.ceil(config.decay_fraction * (total_steps or 0))),
                "min_lr_ratio": config.min_lr_ratio}
    return {}


def check_scheduler(config: TrainConfig, total_steps: int | None, *, is_main: bool) -> None:
    """Build the schedule on a stand-in optimizer before the model loads: a bad combination fails in
    seconds, not after minutes of loading. Every rank computes the same verdict (same config and data)."""
    error = None
    kwargs = scheduler_kwargs(config, total_steps)
    if total_steps is not None and config.lr_scheduler == "warmup_stable_decay" \
            and config.num_warmup_steps + kwargs["num_decay_steps"] > total_steps:
        error = (f"--lr-scheduler warmup_stable_decay: {config.num_warmup_steps} warmup + "
                 f"{kwargs['num_decay_steps']} decay steps exceed the run's {total_steps} steps; lower "
                 "--num-warmup-steps or --decay-fraction")
    else:
        stand_in = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=config.learning_rate)
        try:
            scheduler = build_scheduler(config, stand_in, total_steps)
        except (TypeError, ValueError) as err:
            error = f"--lr-scheduler {config.lr_scheduler}: {err}"
        else:
            for warning in schedule_warnings(config, total_steps, scheduler.lr_lambdas[0]) if is_main else ():
                logger.warning(warning)
    if error is not None:
        if is_main:
            logger.error(error)
        raise SystemExit(1)


def schedule_warnings(config: TrainConfig, total_steps: int | None, multiplier: Callable[[int], float]) -> list[str]:
    """What the schedule will not do over this run, known before its first step: a warmup at least the run's
    length never reaches ``--learning-rate``, and a decaying schedule whose last step still uses half its
    range or more never gets near its end (too few steps after the warmup). At most one line.

    Args:
        config: the run's parameters.
        total_steps: the run's optimizer steps, or None for infinite sampling (then nothing is known).
        multiplier: the schedule's factor on ``--learning-rate`` at each scheduler step (``LambdaLR``'s
            ``lr_lambdas[0]``); optimizer step k uses the factor at k - 1.
    """
    if total_steps is None:
        return []
    last, end = multiplier(total_steps - 1), multiplier(total_steps)
    if config.num_warmup_steps >= total_steps:
        return [f"--num-warmup-steps {config.num_warmup_steps} is at least the run's {total_steps} steps: the "
                f"learning rate never reaches --learning-rate {config.learning_rate} (the last step uses "
                f"{last:.0%} of it); lower --num-warmup-steps or train longer"]
    if config.lr_scheduler not in SCHEDULERS_WITHOUT_TOTAL and last - end >= 0.5 * (1 - end):
        return [f"--lr-scheduler {config.lr_scheduler} will not reach its end: the last of the run's {total_steps} "
                f"steps uses {last:.0%} of --learning-rate where the schedule ends at {end:.0%}, too few steps "
                "decay; lower --num-warmup-steps or train longer"]
    return []
