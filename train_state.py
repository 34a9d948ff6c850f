"""The loop's state: counters that advance every step (saved with each full state) and the
preemption flag that SIGTERM/SIGUSR1 raise."""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass, field

from utils import exit_process, logger


@dataclass
class TrainState:
    """Counters that advance every step."""

    step: int = 0
    samples_seen: int = 0          # stream position: samples consumed, dropped ones included
    samples_trained: int = 0       # real samples that contributed to an update
    last_checkpoint_samples: int = 0
    num_bad_steps: int = 0         # consecutive skipped (non-finite) steps
    bad_step_samples: list = field(default_factory=list)  # [start, end) of each of those steps, for the abort
    recent_losses: list = field(default_factory=list)     # the divergence guard's history (divergence.py)
    diverged_at_step: int | None = None                   # a divergence was detected (--on-divergence warn)
    skipped_batches: list = field(default_factory=list)   # [start, end) of batches --on-divergence rewind skips
    best_val_loss: float | None = None          # best validation loss so far (--save-best-val-loss)
    num_validations_without_improvement: int = 0  # for --early-stopping-patience
    wandb_run_id: str | None = None               # a resumed run continues this wandb run


class PreemptionFlag:
    """SIGTERM/SIGUSR1 (SLURM's warning before a kill) ask for a checkpoint at the end of the step.

    Unless a peer rank is already dead: then no checkpoint can be written (it is a collective),
    and the signal is torchrun ending the job after that rank died. This rank then exits at once,
    naming the lost rank, rather than waiting in a collective until torchrun kills it 30 s later
    (with NCCL, a collective whose peer died waits for the collective timeout).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, lost_ranks: Callable[[], list[str]] = list) -> None:
        self.requested = False
        self._lost_ranks = lost_ranks
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def __enter__(self) -> PreemptionFlag:
        return self

    def __exit__(self, *exc_info) -> None:
        self.restore()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        lost = self._lost_ranks()
        if lost:
            logger.error("received %s after %s is gone (it stopped on its own error, or was killed, e.g. by the "
                         "out-of-memory killer): exiting; rerun the same command to resume from the newest full "
                         "state", name, ", ".join(lost))
            exit_process(1)
        self.requested = True
        logger.warning("received %s: will checkpoint and exit after this step", name)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
