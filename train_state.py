"""The loop's state: counters that advance every step (saved with each full state) and the
preemption flag that SIGTERM/SIGUSR1 raise."""

from __future__ import annotations

import signal
from dataclasses import dataclass

from utils import logger


@dataclass
class TrainState:
    """Counters that advance every step."""

    step: int = 0
    samples_seen: int = 0          # stream position: samples consumed, dropped ones included
    samples_trained: int = 0       # real samples that contributed to an update
    last_checkpoint_samples: int = 0
    num_bad_steps: int = 0         # consecutive skipped (non-finite) steps
    best_val_loss: float | None = None          # best validation loss so far (--save-best-val-loss)
    num_validations_without_improvement: int = 0  # for --early-stopping-patience
    wandb_run_id: str | None = None               # a resumed run continues this wandb run


class PreemptionFlag:
    """SIGTERM/SIGUSR1 (SLURM's warning before a kill) ask for a checkpoint at the end of the step."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.requested = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def _handle(self, signum, frame) -> None:
        self.requested = True
        logger.warning("received %s: will checkpoint and exit after this step", signal.Signals(signum).name)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
