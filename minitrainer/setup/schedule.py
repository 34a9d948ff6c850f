"""How long a run lasts and its learning-rate schedule: stop conditions and transformers' schedules."""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR

from minitrainer.checkpoint.train_state import TrainState
from minitrainer.common.log import logger
from minitrainer.train_config import SCHEDULERS_WITHOUT_TOTAL, TrainConfig


def stop_steps(config: TrainConfig, num_dataset_samples: int) -> dict[str, int]:
    """Each stop condition given (as its flag and value) -> the step it ends the run at."""
    steps = {}
    if config.max_steps is not None:
        steps[f"--max-steps {config.max_steps}"] = config.max_steps
    if config.max_samples is not None:
        steps[f"--max-samples {config.max_samples}"] = math.ceil(config.max_samples / config.batch_size)
    if config.num_epochs is not None:
        steps[f"--num-epochs {config.num_epochs:g}"] = math.ceil(config.num_epochs * num_dataset_samples
                                                                  / config.batch_size)
    return steps


def total_steps(config: TrainConfig, num_dataset_samples: int) -> int | None:
    """Optimizer steps until the first stop condition, or None for infinite sampling."""
    return min(stop_steps(config, num_dataset_samples).values(), default=None)


def stop_plan(config: TrainConfig, num_dataset_samples: int) -> str:
    """How long the run lasts and which condition ends it. With several, the first reached wins; TRL and
    transformers' Trainer let --max-steps override epochs instead, so a config brought from them stops earlier
    here: said at start-up, not only when it happens."""
    steps = stop_steps(config, num_dataset_samples)
    if not steps:
        return "infinite sampling (no stop condition)"
    end = min(steps.values())
    ending = [flag for flag, step in steps.items() if step == end]
    later = [f"{flag} (step {step})" for flag, step in steps.items() if step != end]
    text = f"{end} steps, ended by {' and '.join(ending)}"
    if later:
        text += f"; the first stop reached ends the run, so {', '.join(later)} is not reached"
    return text


def stop_reason(config: TrainConfig, state: TrainState, num_dataset_samples: int) -> str | None:
    if config.max_steps is not None and state.step >= config.max_steps:
        return f"reached --max-steps {config.max_steps}"
    if config.max_samples is not None and state.samples_seen >= config.max_samples:
        return f"reached --max-samples {config.max_samples}"
    if config.num_epochs is not None and state.samples_seen >= config.num_epochs * num_dataset_samples:
        return f"reached --num-epochs {config.num_epochs}"
    return None


def build_scheduler(config: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int | None) -> LambdaLR:
    """``--lr-scheduler``'s schedule, as ``transformers.get_scheduler`` builds it (the same factors to the last bit,
    the same ``LambdaLR`` state in a full state) without importing transformers' trainer stack, which start-up does
    not otherwise need (peft and torchao come with it: about a second in every process)."""
    kwargs = scheduler_kwargs(config, total_steps)
    warmup = config.num_warmup_steps
    if config.lr_scheduler == "constant":
        return LambdaLR(optimizer, _constant)
    if config.lr_scheduler not in SCHEDULERS_WITHOUT_TOTAL and total_steps is None:
        raise ValueError(f"{config.lr_scheduler} requires `num_training_steps`, please provide that argument.")
    if config.lr_scheduler == "polynomial":
        kwargs = {"lr_end": 1e-7, "power": 1.0, "lr_init": optimizer.defaults["lr"]}
        if not kwargs["lr_init"] > kwargs["lr_end"]:
            raise ValueError(f"lr_end ({kwargs['lr_end']}) must be smaller than initial lr ({kwargs['lr_init']})")
    if config.lr_scheduler == "inverse_sqrt":
        kwargs = {"timescale": warmup or 10_000}
    if config.lr_scheduler == "warmup_stable_decay":
        kwargs["num_stable_steps"] = total_steps - warmup - kwargs["num_decay_steps"]
    total = {} if config.lr_scheduler in SCHEDULERS_WITHOUT_TOTAL + ("warmup_stable_decay",) else \
        {"num_training_steps": total_steps}
    return LambdaLR(optimizer, functools.partial(_FACTORS[config.lr_scheduler], num_warmup_steps=warmup, **total,
                                                 **kwargs))


def _constant(_=None):
    return 1


def _warming_up(step: int, num_warmup_steps: int) -> float:
    return float(step) / float(max(1, num_warmup_steps))


def _constant_with_warmup(step: int, *, num_warmup_steps: int) -> float:
    if step < num_warmup_steps:
        return float(step) / float(max(1.0, num_warmup_steps))
    return 1.0


def _linear(step: int, *, num_warmup_steps: int, num_training_steps: int) -> float:
    if step < num_warmup_steps:
        return _warming_up(step, num_warmup_steps)
    return max(0.0, float(num_training_steps - step) / float(max(1, num_training_steps - num_warmup_steps)))


def _decay_progress(step: int, num_warmup_steps: int, num_training_steps: int) -> float:
    return float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))


def _half_cosine(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * float(0.5) * 2.0 * progress))


def _cosine(step: int, *, num_warmup_steps: int, num_training_steps: int) -> float:
    if step < num_warmup_steps:
        return _warming_up(step, num_warmup_steps)
    return max(0.0, _half_cosine(_decay_progress(step, num_warmup_steps, num_training_steps)))


def _cosine_with_restarts(step: int, *, num_warmup_steps: int, num_training_steps: int) -> float:
    if step < num_warmup_steps:
        return _warming_up(step, num_warmup_steps)
    progress = _decay_progress(step, num_warmup_steps, num_training_steps)
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((float(1) * progress) % 1.0))))


def _polynomial(step: int, *, num_warmup_steps: int, num_training_steps: int, lr_end: float, power: float,
                lr_init: float) -> float:
    """A factor on ``lr_init``, which ``LambdaLR`` multiplies back."""
    if step < num_warmup_steps:
        return _warming_up(step, num_warmup_steps)
    if step > num_training_steps:
        return lr_end / lr_init
    remaining = 1 - (step - num_warmup_steps) / (num_training_steps - num_warmup_steps)
    return ((lr_init - lr_end) * remaining**power + lr_end) / lr_init


def _inverse_sqrt(step: int, *, num_warmup_steps: int, timescale: int) -> float:
    if step < num_warmup_steps:
        return _warming_up(step, num_warmup_steps)
    return 1.0 / math.sqrt((step + timescale - num_warmup_steps) / timescale)


def _cosine_with_min_lr(step: int, *, num_warmup_steps: int, num_training_steps: int, min_lr_rate: float) -> float:
    if step < num_warmup_steps:
        return _warming_up(step, num_warmup_steps)
    factor = _half_cosine(_decay_progress(step, num_warmup_steps, num_training_steps))
    return max(0, factor * (1 - min_lr_rate) + min_lr_rate)


def _cosine_warmup_with_min_lr(step: int, *, num_warmup_steps: int, num_training_steps: int,
                               min_lr_rate: float) -> float:
    """Its warmup starts one step in, and its decay one step earlier, than the others'."""
    step, num_warmup_steps, num_training_steps = float(step), float(num_warmup_steps), float(num_training_steps)
    if step < num_warmup_steps:
        return (step + 1.0) / max(1.0, num_warmup_steps)
    progress = (step - num_warmup_steps + 1.0) / (max(1.0, num_training_steps - num_warmup_steps))
    factor = 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress))
    return max(0, factor * (1 - min_lr_rate) + min_lr_rate)


def _warmup_stable_decay(step: int, *, num_warmup_steps: int, num_stable_steps: int, num_decay_steps: int,
                         min_lr_ratio: float) -> float:
    """A linear warmup, a plateau, then a cosine decay to ``min_lr_ratio``."""
    if step < num_warmup_steps:
        factor = float(step) / float(max(1, num_warmup_steps))
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    if step < num_warmup_steps + num_stable_steps:
        return 1.0
    if step < num_warmup_steps + num_stable_steps + num_decay_steps:
        factor = _half_cosine(float(step - num_warmup_steps - num_stable_steps) / float(max(1, num_decay_steps)))
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    return min_lr_ratio


_FACTORS = {"linear": _linear, "cosine": _cosine, "cosine_with_restarts": _cosine_with_restarts,
            "polynomial": _polynomial, "constant_with_warmup": _constant_with_warmup, "inverse_sqrt": _inverse_sqrt,
            "cosine_with_min_lr": _cosine_with_min_lr, "cosine_warmup_with_min_lr": _cosine_warmup_with_min_lr,
            "warmup_stable_decay": _warmup_stable_decay}
"""Each schedule's factor on ``--learning-rate`` at a scheduler step, written as transformers 5 computes it."""


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
