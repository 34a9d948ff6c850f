"""Optional experiment tracking that mirrors the metrics JSONL line for line.

``train.py`` writes one JSON object per optimizer step to
``training_metrics_0.jsonl``; a tracker receives exactly that object and logs
every numeric field under the same name, at ``step``:

    torchrun --nproc-per-node=2 train.py ... --wandb-project my-sft
    torchrun --nproc-per-node=2 train.py ... --tensorboard-dir ./output/tb
    tensorboard --logdir ./output/tb

Both packages are optional (``pip install wandb`` / ``pip install tensorboard``)
and imported only when asked for; a missing one raises an ``ImportError`` that
names the package (``setup_run`` turns it into one warning: a tracker never stops
a run). A tracker that fails while logging (network, full disk) warns once and is
turned off (``FailSoftTracker``). Only rank 0 logs: every other rank gets the null tracker.
"""

from __future__ import annotations

import json
import numbers

from utils import logger


class TrackerInitError(RuntimeError):
    """A tracker could not start (credentials, network, bad project): raised before the model loads."""


class NullTracker:
    """Does nothing: what ranks other than 0 and runs without tracking get (nanochat's DummyWandb)."""

    wandb_run_id = None

    def log(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


def _numeric_fields(record: dict) -> dict[str, float]:
    """The record's numbers (bools as 0/1), under their JSONL names; ``step`` is the x-axis, not a series."""
    return {key: float(value) for key, value in record.items()
            if key != "step" and isinstance(value, numbers.Real)}


class WandbTracker:
    """Weights & Biases run; ``wandb.log`` gets the JSONL record itself, at its ``step``."""

    def __init__(self, *, project: str, run_config: dict, run_id: str | None = None) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ImportError("--wandb-project needs the optional package wandb: pip install wandb "
                              "(then `wandb login`, or set WANDB_MODE=offline)") from err
        self._wandb = wandb
        try:
            # A resumed training run continues its wandb run (the id is kept in the full state).
            self._run = wandb.init(project=project, config=run_config, id=run_id,
                                   resume="allow" if run_id else None)
        except wandb.errors.Error as err:
            raise TrackerInitError(f"--wandb-project {project}: wandb.init failed ({err}); run `wandb login` or "
                                   "set WANDB_API_KEY, or WANDB_MODE=offline to log locally") from err
        self.wandb_run_id = self._run.id
        self.errors = (wandb.errors.Error,)  # what wandb raises when it loses its service or network

    def log(self, record: dict) -> None:
        self._run.log(_numeric_fields(record), step=int(record["step"]))

    def close(self) -> None:
        self._run.finish()


class TensorBoardTracker:
    """TensorBoard event files: one scalar series per JSONL field, plus the run config as text."""

    wandb_run_id = None

    def __init__(self, *, log_dir: str, run_config: dict) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError("--tensorboard-dir needs the optional package tensorboard: "
                              "pip install tensorboard") from err
        self._writer = SummaryWriter(log_dir=log_dir)
        # Markdown code block so TensorBoard's text tab keeps the indentation.
        self._writer.add_text("run_config", "```\n" + json.dumps(run_config, indent=2, default=str) + "\n```")

    def log(self, record: dict) -> None:
        step = int(record["step"])
        for key, value in _numeric_fields(record).items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class FailSoftTracker:
    """A tracker whose failure while logging or closing warns once and turns it off: the run goes on, as
    the metrics JSONL holds every value anyway. Catches ``OSError`` (TensorBoard's event files on a
    full disk) and the tracker's own ``errors`` (wandb's)."""

    def __init__(self, tracker) -> None:
        self._tracker = tracker
        self._errors = (OSError, *getattr(tracker, "errors", ()))
        self.wandb_run_id = tracker.wandb_run_id

    def _call(self, what: str, *args) -> None:
        if self._tracker is None:
            return
        try:
            getattr(self._tracker, what)(*args)
        except self._errors as err:
            logger.warning("tracker %s failed in %s (%s: %s): tracking is off for the rest of the run; the "
                           "metrics are in training_metrics_0.jsonl", type(self._tracker).__name__, what,
                           type(err).__name__, err)
            self._tracker = None

    def log(self, record: dict) -> None:
        self._call("log", record)

    def close(self) -> None:
        self._call("close")


class TrackerGroup:
    """Several trackers behind one ``log``/``close``."""

    def __init__(self, trackers: list) -> None:
        self.trackers = trackers
        self.errors = tuple(error for tracker in trackers for error in getattr(tracker, "errors", ()))
        self.wandb_run_id = next((t.wandb_run_id for t in trackers if getattr(t, "wandb_run_id", None)), None)

    def log(self, record: dict) -> None:
        for tracker in self.trackers:
            tracker.log(record)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


Tracker = NullTracker | WandbTracker | TensorBoardTracker | TrackerGroup
"""Anything with ``log(record)``, ``close()`` and ``wandb_run_id``."""


def make_tracker(*, wandb_project: str | None, tensorboard_dir: str | None, run_config: dict, rank: int,
                 wandb_run_id: str | None = None) -> Tracker:
    """The tracker(s) a run asked for, or the null tracker.

    Args:
        wandb_project: Weights & Biases project name, or None for no wandb run.
        tensorboard_dir: folder for TensorBoard event files, or None.
        run_config: the run's parameters (``training_params.json``), stored with the run.
        rank: global rank; only rank 0 tracks.
        wandb_run_id: continue this wandb run (a resumed training run's), or None for a new one.

    Returns:
        An object with ``log(record)`` and ``close()`` (``FailSoftTracker``: a failure while logging warns once).

    Raises:
        ImportError: a requested tracker's package is not installed (the message names it).
        TrackerInitError: wandb could not start a run (credentials, network).
    """
    if rank != 0 or (wandb_project is None and tensorboard_dir is None):
        return NullTracker()
    trackers = []
    if wandb_project is not None:
        trackers.append(WandbTracker(project=wandb_project, run_config=run_config, run_id=wandb_run_id))
    if tensorboard_dir is not None:
        try:
            trackers.append(TensorBoardTracker(log_dir=tensorboard_dir, run_config=run_config))
        except ImportError:
            TrackerGroup(trackers).close()  # don't leave a wandb run open behind the error
            raise
    return FailSoftTracker(trackers[0] if len(trackers) == 1 else TrackerGroup(trackers))
