"""The loop's counters: what advances every step, saved with each full state and restored on resume."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    mlflow_run_id: str | None = None              # and this MLflow run
