"""Optional experiment tracking that mirrors the metrics JSONL line for line.

``train.py`` writes one JSON object per optimizer step to
``training_metrics_0.jsonl``; a tracker receives exactly that object and logs
every numeric field under the same name, at ``step``:

    torchrun --nproc-per-node=2 train.py ... --wandb-project my-sft
    torchrun --nproc-per-node=2 train.py ... --tensorboard-dir ./output/tb
    tensorboard --logdir ./output/tb
    torchrun --nproc-per-node=2 train.py ... --mlflow-tracking-uri http://mlflow:5000 --mlflow-experiment sft

The packages are optional (``pip install wandb`` / ``tensorboard`` / ``mlflow-skinny``) and
imported only when asked for. Each tracker asked for is started on its own: one that cannot
start (its package missing or broken, no credentials, a store that refuses) is one warning line
and the run goes on with the others, as trackers only mirror the metrics JSONL. One that fails
later while logging (network, full disk) warns once and is turned off (``FailSoftTracker``), the
others going on. Only rank 0 logs: every other rank gets the null tracker.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from typing import Any, Callable

from minitrainer.common.log import logger
from minitrainer.train_config import TrainConfig


class TrackerInitError(RuntimeError):
    """A tracker could not start (credentials, network, bad project): raised before the model loads."""


class NullTracker:
    """Does nothing: what ranks other than 0 and runs without tracking get (nanochat's DummyWandb)."""

    wandb_run_id = mlflow_run_id = None

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

    mlflow_run_id = None

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

    wandb_run_id = mlflow_run_id = None

    def __init__(self, *, log_dir: str, run_config: dict) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError("--tensorboard-dir needs the optional package tensorboard: "
                              "pip install tensorboard") from err
        try:
            self._writer = SummaryWriter(log_dir=log_dir)
        except OSError as err:
            raise TrackerInitError(f"--tensorboard-dir {log_dir}: cannot write event files there ({err})") from err
        # Markdown code block so TensorBoard's text tab keeps the indentation.
        self._writer.add_text("run_config", "```\n" + json.dumps(run_config, indent=2, default=str) + "\n```")

    def log(self, record: dict) -> None:
        step = int(record["step"])
        for key, value in _numeric_fields(record).items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MLflowTracker:
    """An MLflow run: the run config as its parameters, each numeric JSONL field as a metric at ``step``.
    A resumed training run continues its MLflow run (the id is kept in the full state)."""

    wandb_run_id = None

    def __init__(self, *, tracking_uri: str | None, experiment: str | None, run_name: str | None,
                 run_config: dict, run_id: str | None = None) -> None:
        try:
            import mlflow
        except ImportError as err:
            raise ImportError("--mlflow-tracking-uri/--mlflow-experiment need the optional package mlflow: "
                              "pip install mlflow-skinny") from err
        self._mlflow = mlflow
        self.errors = (mlflow.exceptions.MlflowException,)  # what MLflow raises when its store or server fails
        try:
            if tracking_uri is not None:  # else MLFLOW_TRACKING_URI, or MLflow's default store
                mlflow.set_tracking_uri(tracking_uri)
            if experiment is not None:  # else MLFLOW_EXPERIMENT_NAME, or MLflow's default experiment
                mlflow.set_experiment(experiment)
            if not (run_id and self._continue(run_id)):
                mlflow.start_run(run_name=run_name)
                mlflow.log_params(run_config)  # MLflow stores every value as its text
        except (*self.errors, OSError) as err:  # OSError: a folder store that cannot be written
            if mlflow.active_run() is not None:
                mlflow.end_run(status="FAILED")
            raise TrackerInitError(f"MLflow at {mlflow.get_tracking_uri()} could not start a run ({err})") from err
        self.mlflow_run_id = mlflow.active_run().info.run_id

    def _continue(self, run_id: str) -> bool:
        """Reopen the resumed run's MLflow run; its parameters stay the first start's (MLflow refuses to
        change one, and --allow-config-change may have). False, with a warning, where this store lacks it."""
        try:
            self._mlflow.start_run(run_id=run_id)
        except self.errors as err:
            logger.warning("MLflow at %s: could not continue run %s of the resumed training run (%s); "
                           "starting a new one", self._mlflow.get_tracking_uri(), run_id, err)
            return False
        return True

    def log(self, record: dict) -> None:
        self._mlflow.log_metrics(_numeric_fields(record), step=int(record["step"]))

    def close(self) -> None:
        self._mlflow.end_run()


class FailSoftTracker:
    """A tracker whose failure while logging or closing warns once and turns it off: the run and the other
    trackers go on, as the metrics JSONL holds every value anyway. Catches ``OSError`` (TensorBoard's event
    files on a full disk) and the tracker's own ``errors`` (wandb's, MLflow's)."""

    def __init__(self, tracker) -> None:
        self._tracker = tracker
        self._errors = (OSError, *getattr(tracker, "errors", ()))
        self.wandb_run_id, self.mlflow_run_id = tracker.wandb_run_id, tracker.mlflow_run_id

    def _call(self, what: str, *args) -> None:
        if self._tracker is None:
            return
        try:
            getattr(self._tracker, what)(*args)
        except self._errors as err:
            logger.warning("tracker %s failed in %s (%s: %s): it is off for the rest of the run; the "
                           "metrics are in training_metrics_0.jsonl", type(self._tracker).__name__, what,
                           type(err).__name__, err)
            self._tracker = None

    def log(self, record: dict) -> None:
        self._call("log", record)

    def close(self) -> None:
        self._call("close")


class TrackerGroup:
    """Several trackers behind one ``log``/``close``; each fails on its own (``FailSoftTracker``)."""

    def __init__(self, trackers: list[FailSoftTracker]) -> None:
        self.trackers = trackers
        self.wandb_run_id = next((t.wandb_run_id for t in trackers if t.wandb_run_id), None)
        self.mlflow_run_id = next((t.mlflow_run_id for t in trackers if t.mlflow_run_id), None)

    def log(self, record: dict) -> None:
        for tracker in self.trackers:
            tracker.log(record)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


Tracker = NullTracker | TrackerGroup
"""Anything with ``log(record)``, ``close()``, ``wandb_run_id`` and ``mlflow_run_id``."""


def make_tracker(config: TrainConfig, *, rank: int, wandb_run_id: str | None = None,
                 mlflow_run_id: str | None = None) -> Tracker:
    """The trackers a run asked for that could start, or the null tracker.

    Each is started on its own; one that cannot start is one warning and the others go on.

    Args:
        config: the run's parameters: which trackers (``--wandb-project``, ``--tensorboard-dir``,
            ``--mlflow-*``), and what is stored with the run (``training_params.json``'s fields).
        rank: global rank; only rank 0 tracks.
        wandb_run_id: continue this wandb run (a resumed training run's), or None for a new one.
        mlflow_run_id: likewise for MLflow.

    Returns:
        An object with ``log(record)`` and ``close()``.
    """
    if rank != 0:
        return NullTracker()
    run_config = dataclasses.asdict(config)
    starters: list[Callable[[], Any]] = []
    if config.wandb_project is not None:
        starters.append(lambda: WandbTracker(project=config.wandb_project, run_config=run_config, run_id=wandb_run_id))
    if config.tensorboard_dir is not None:
        starters.append(lambda: TensorBoardTracker(log_dir=config.tensorboard_dir, run_config=run_config))
    if config.mlflow_tracking_uri is not None or config.mlflow_experiment is not None:
        starters.append(lambda: MLflowTracker(tracking_uri=config.mlflow_tracking_uri,
                                              experiment=config.mlflow_experiment,
                                              run_name=config.mlflow_run_name, run_config=run_config,
                                              run_id=mlflow_run_id))
    trackers = []
    for start in starters:
        try:
            trackers.append(FailSoftTracker(start()))
        except (ImportError, TrackerInitError) as err:
            logger.warning("%s; the run goes on without this tracker (the metrics are in training_metrics_0.jsonl)",
                           err)
    return TrackerGroup(trackers) if trackers else NullTracker()
