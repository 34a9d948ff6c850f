"""Faults on demand, for the tests that prove a run survives them; inert unless a variable below is set.

Clusters kill, signal and fill disks at awkward moments; the resume, preemption,
skip and auto-budget tests make those moments happen in a real ``torchrun``
through these environment variables (values are matched exactly):

| variable                               | value         | effect                                                   |
|----------------------------------------|---------------|----------------------------------------------------------|
| ``MINI_TRAINER_TEST_KILL_DURING_SAVE`` | ``SAMPLES``   | rank 0 SIGKILLs itself after every rank wrote the full    |
|                                        |               | state ``.samples_SAMPLES.tmp``, before it is renamed     |
| ``MINI_TRAINER_TEST_KILL_DURING_EXPORT``| ``SAMPLES``  | rank 0 SIGKILLs itself after writing the Hugging Face    |
|                                        |               | export ``.samples_SAMPLES.tmp``, before it is renamed    |
| ``MINI_TRAINER_TEST_KILL_AFTER_SAVE``  | ``SAMPLES``   | every rank SIGKILLs itself right after that full state   |
| ``MINI_TRAINER_TEST_FAIL_EXPORT``      | ``samples_N`` | rank 0's write of that Hugging Face export fails ENOSPC  |
| ``MINI_TRAINER_TEST_NAN``              | ``STEP:RANK`` | that rank's loss (and logged cross-entropy) is NaN       |
| ``MINI_TRAINER_TEST_SIGTERM``          | ``STEP:RANK`` | that rank SIGTERMs itself after the step's update        |
| ``MINI_TRAINER_TEST_STEP_SLEEP``       | ``SECONDS``   | every update is followed by a sleep (time to signal)     |
| ``MINI_TRAINER_TEST_PREPARE_SLEEP``    | ``SECONDS``   | the objective's preparation (DPO's reference pass) first |
|                                        |               | sleeps that long (time to signal a run before step 1)    |
| ``MINI_TRAINER_TEST_RAISE``            | ``STEP:RANK`` | that rank raises an unexpected error after the step's    |
|                                        |               | update (a bug: its traceback must stay visible)          |
| ``MINI_TRAINER_TEST_PROBE_FAIL``       | ``TOKENS:R``  | rank R (``*``: all) fails mid-backward in the auto-budget |
|                                        |               | trial of TOKENS tokens, as a GPU allocation failure does |
| ``MINI_TRAINER_TEST_DROP_LOGIT_SCALE`` | ``1``         | the trainer forgets the model's logit scale, so the      |
|                                        |               | start-up self-check must catch the mismatch              |

The training step itself carries no test code: ``install`` hooks the model's
forward and the optimizer's step once, at start-up.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

import torch

from minitrainer.common.log import logger

KILL_DURING_SAVE = "MINI_TRAINER_TEST_KILL_DURING_SAVE"
KILL_AFTER_SAVE = "MINI_TRAINER_TEST_KILL_AFTER_SAVE"
KILL_DURING_EXPORT = "MINI_TRAINER_TEST_KILL_DURING_EXPORT"
FAIL_EXPORT = "MINI_TRAINER_TEST_FAIL_EXPORT"
NAN = "MINI_TRAINER_TEST_NAN"
SIGTERM = "MINI_TRAINER_TEST_SIGTERM"
STEP_SLEEP = "MINI_TRAINER_TEST_STEP_SLEEP"
PREPARE_SLEEP = "MINI_TRAINER_TEST_PREPARE_SLEEP"
RAISE = "MINI_TRAINER_TEST_RAISE"
PROBE_FAIL = "MINI_TRAINER_TEST_PROBE_FAIL"
DROP_LOGIT_SCALE = "MINI_TRAINER_TEST_DROP_LOGIT_SCALE"


def kill_at(variable: str, num_samples: int) -> None:
    """SIGKILL this process when ``variable`` names this save (``KILL_DURING_SAVE``, ``KILL_AFTER_SAVE``,
    ``KILL_DURING_EXPORT``)."""
    if os.environ.get(variable) == str(int(num_samples)):
        logger.warning("%s: killing this process now", variable)
        os.kill(os.getpid(), signal.SIGKILL)


def fail_export(folder: Path) -> None:
    """Raise the disk-full error a real export would, for the export ``FAIL_EXPORT`` names."""
    if os.environ.get(FAIL_EXPORT) == folder.name:
        raise OSError(errno.ENOSPC, f"No space left on device (fault injected by {FAIL_EXPORT})")


def sleep_before_preparing() -> None:
    """Sleep ``PREPARE_SLEEP`` seconds, when set, saying so first (the line a test waits for)."""
    if PREPARE_SLEEP in os.environ:
        logger.warning("%s: sleeping %s s before the objective's preparation", PREPARE_SLEEP,
                       os.environ[PREPARE_SLEEP])
        time.sleep(float(os.environ[PREPARE_SLEEP]))


def drops_logit_scale() -> bool:
    return os.environ.get(DROP_LOGIT_SCALE) == "1"


def install(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state, rank: int) -> None:
    """Hook the step faults (``NAN``, ``SIGTERM``, ``STEP_SLEEP``, ``RAISE``) into the model and optimizer, when asked.

    Args:
        model: the training module (``loss.CausalLMWithLoss``): its loss output and ``last_ce_sum``.
        state: the run's ``train_state.TrainState``; ``state.step + 1`` is the step in progress.
    """
    if NAN in os.environ:
        def poison(module, args, kwargs, loss):
            if os.environ[NAN] == f"{state.step + 1}:{rank}":
                module.last_ce_sum = module.last_ce_sum * float("nan")
                return loss * float("nan")
            return loss

        model.register_forward_hook(poison, with_kwargs=True)
    if SIGTERM in os.environ or STEP_SLEEP in os.environ or RAISE in os.environ:
        def after_update(optimizer, args, kwargs):
            if os.environ.get(SIGTERM) == f"{state.step + 1}:{rank}":
                os.kill(os.getpid(), signal.SIGTERM)
            if os.environ.get(RAISE) == f"{state.step + 1}:{rank}":
                raise AssertionError(f"internal invariant broken (fault injected by {RAISE})")
            if STEP_SLEEP in os.environ:
                time.sleep(float(os.environ[STEP_SLEEP]))

        optimizer.register_step_post_hook(after_update)


def probe_failure(model: torch.nn.Module, num_tokens: int, fsdp_blocks: list[torch.nn.Module]):
    """For ``PROBE_FAIL``: a hook raising an allocation failure half-way through the trial's backward
    (after the later blocks reduced their gradients); returns its handle, or None."""
    tokens, _, rank = os.environ.get(PROBE_FAIL, "").partition(":")
    if tokens != str(num_tokens) or rank not in ("*", os.environ.get("RANK", "0")):
        return None
    middle = fsdp_blocks[len(fsdp_blocks) // 2] if fsdp_blocks else model

    def fail(module, grad_output):
        raise RuntimeError(f"CUBLAS_STATUS_ALLOC_FAILED (fault injected by {PROBE_FAIL})")

    return middle.register_full_backward_pre_hook(fail)
