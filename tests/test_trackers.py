"""Trackers mirror the metrics JSONL; each one asked for starts on its own, and one that cannot start is one warning.

    .venv/bin/python -m pytest -q tests/test_trackers.py

wandb is a network service: a stand-in module records what the tracker sends. MLflow logs to a
local file store (``mlflow-skinny``, in requirements-dev.txt) and is read back with its own client.
A missing package is simulated by ``sys.modules[name] = None`` (the import then fails). The runs
that go on through such failures end to end are in tests/test_tracker_resume.py.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
import types

import pytest

from minitrainer.report.trackers import NullTracker, make_tracker
from minitrainer.train_config import TrainConfig


def _config(**trackers) -> TrainConfig:
    return TrainConfig(model_name_or_path="m", data_path="d", output_dir="o", min_samples_per_checkpoint=1, **trackers)


def _record(step: int = 3) -> dict:
    from minitrainer.report.metrics import StepCounts, step_record

    counts = StepCounts(loss_sum=30.0, backward_loss_sum=20.0, batch_num_loss_counted_tokens=10,
                        num_loss_counted_tokens=10, num_samples=4, num_total_tokens=40, num_dropped_samples=0,
                        num_minibatches=2)
    return step_record(step=step, lr=1e-4, grad_norm=0.5, counts=counts, world_size=2, time_per_batch=0.1,
                       total_samples_accumulated=12, samples_seen=12, epoch=0, peak_memory_usage_gb=1.5)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def _missing(monkeypatch, *packages: str) -> None:
    for package in packages:
        monkeypatch.setitem(sys.modules, package, None)
    if "tensorboard" in packages:
        monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)


def test_tracker_is_null_unless_requested_on_rank_0(monkeypatch):
    _missing(monkeypatch, "wandb")  # rank 1 must not even import it
    assert isinstance(make_tracker(_config(), rank=0), NullTracker)
    tracker = make_tracker(_config(wandb_project="p", tensorboard_dir="/tmp/tb"), rank=1)
    assert isinstance(tracker, NullTracker)
    tracker.log(_record())
    tracker.close()


def test_trackers_that_cannot_start_are_one_warning_each(monkeypatch, tmp_path, caplog):
    """wandb and TensorBoard both missing: each names its package (before, TensorBoard was silently off)."""
    _missing(monkeypatch, "wandb", "tensorboard", "mlflow")
    with caplog.at_level(logging.WARNING):
        tracker = make_tracker(_config(wandb_project="p", tensorboard_dir=str(tmp_path), mlflow_experiment="e"),
                               rank=0)
    assert isinstance(tracker, NullTracker)
    warnings = _warnings(caplog)
    assert [re.search(r"needs? the optional package (\w+): pip install", w)[1] for w in warnings] == [
        "wandb", "tensorboard", "mlflow"]
    assert all("the run goes on without this tracker" in w and "\n" not in w for w in warnings)


def _fake_wandb(monkeypatch, calls: list) -> None:
    run = types.SimpleNamespace(id="run1", log=lambda data, step: calls.append(("log", data, step)),
                                finish=lambda: calls.append(("finish",)))
    fake = types.ModuleType("wandb")
    fake.init = lambda project, config, id, resume: calls.append(("init", project, config, id, resume)) or run
    fake.errors = types.SimpleNamespace(Error=type("Error", (Exception,), {}))  # as wandb.errors.Error
    monkeypatch.setitem(sys.modules, "wandb", fake)


def test_wandb_tracker_mirrors_the_jsonl_record(monkeypatch):
    calls = []
    _fake_wandb(monkeypatch, calls)
    config = _config(wandb_project="demo")
    record = _record()
    tracker = make_tracker(config, rank=0)
    tracker.log(record)
    tracker.close()
    assert calls[0] == ("init", "demo", dataclasses.asdict(config), None, None)
    assert tracker.wandb_run_id == "run1"
    _, logged, step = calls[1]
    assert step == record["step"]
    assert logged == {k: float(v) for k, v in record.items() if k != "step"}
    assert calls[2] == ("finish",)


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """A local file store: MLflow 3 refuses one unless told (it wants a database), as a user's opt-out does."""
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")  # hermetic: no usage report over the network
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return (tmp_path / "mlruns").as_uri()


def test_mlflow_logs_every_metrics_line_to_a_file_store(mlflow_store):
    from mlflow import MlflowClient

    config = _config(mlflow_tracking_uri=mlflow_store, mlflow_experiment="sft", mlflow_run_name="first")
    tracker = make_tracker(config, rank=0)
    records = [_record(step) for step in (1, 2)]
    for record in records:
        tracker.log(record)
    tracker.close()

    client = MlflowClient(mlflow_store)
    [run] = client.search_runs([client.get_experiment_by_name("sft").experiment_id])
    assert run.info.run_name == "first" and run.info.status == "FINISHED"
    assert run.data.params["learning_rate"] == str(config.learning_rate)
    assert set(run.data.params) == {f.name for f in dataclasses.fields(TrainConfig)}
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["loss"]) for r in records]
    assert set(run.data.metrics) == {k for k, v in records[0].items() if k != "step" and isinstance(v, (int, float))}


def test_a_resumed_run_whose_mlflow_run_is_not_in_the_store_starts_a_new_one(mlflow_store, caplog):
    """Resumed against another tracking store (or a deleted run): one warning, a new run, the metrics logged."""
    from mlflow import MlflowClient

    config = _config(mlflow_tracking_uri=mlflow_store, mlflow_experiment="sft")
    with caplog.at_level(logging.WARNING):
        tracker = make_tracker(config, rank=0, mlflow_run_id="0" * 32)
    tracker.log(_record(3))
    tracker.close()
    [warning] = _warnings(caplog)
    assert f"could not continue run {'0' * 32} of the resumed training run" in warning and "starting a new one" in warning
    client = MlflowClient(mlflow_store)
    [run] = client.search_runs([client.get_experiment_by_name("sft").experiment_id])
    assert tracker.mlflow_run_id == run.info.run_id != "0" * 32
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [3]


def test_mlflow_that_cannot_start_is_one_warning_beside_a_tracker_that_can(mlflow_store, monkeypatch, caplog):
    """The store refuses (MLflow 3's file store without its opt-out): one line; wandb still logs."""
    calls = []
    _fake_wandb(monkeypatch, calls)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    with caplog.at_level(logging.WARNING):
        tracker = make_tracker(_config(wandb_project="p", mlflow_tracking_uri=mlflow_store), rank=0)
    [warning] = _warnings(caplog)
    assert warning.startswith(f"MLflow at {mlflow_store} could not start a run (")
    assert "MLFLOW_ALLOW_FILE_STORE" in warning and "\n" not in warning
    tracker.log(_record())
    assert [call[0] for call in calls] == ["init", "log"]


def test_a_tracker_failing_while_logging_leaves_the_others_on(mlflow_store, monkeypatch, caplog):
    import mlflow

    calls = []
    _fake_wandb(monkeypatch, calls)
    tracker = make_tracker(_config(wandb_project="p", mlflow_experiment="e", mlflow_tracking_uri=mlflow_store),
                           rank=0)

    def refuse(*args, **kwargs):
        raise mlflow.exceptions.MlflowException("RESOURCE_DOES_NOT_EXIST: server went away")

    monkeypatch.setattr(mlflow, "log_metrics", refuse)
    with caplog.at_level(logging.WARNING):
        for step in (1, 2):
            tracker.log(_record(step))
    [warning] = _warnings(caplog)
    assert "tracker MLflowTracker failed in log (MlflowException" in warning
    assert [call[2] for call in calls if call[0] == "log"] == [1, 2]
    tracker.close()


def test_mlflow_run_name_alone_is_refused():
    with pytest.raises(ValueError, match="--mlflow-run-name needs --mlflow-tracking-uri or --mlflow-experiment"):
        _config(mlflow_run_name="x")
