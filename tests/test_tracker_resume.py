"""A resumed run continues its Weights & Biases and MLflow runs; a tracker that cannot start or log never stops a run.

    .venv/bin/python -m pytest -q tests/test_tracker_resume.py

wandb is a network service and an optional package (not installed here), so
these runs put a stand-in ``wandb`` package on PYTHONPATH: the boundary, not
the trainer, is replaced. It records every ``wandb.init`` call to a file and
can refuse to start as wandb does without credentials, or fail on ``log`` as it does
when its service goes away. A tracker package whose import fails is a ``wandb`` /
``tensorboard`` / ``mlflow`` package on PYTHONPATH that raises ``ImportError`` (a broken install).
Those runs are fresh ``torchrun`` launches (a warm job cannot change its import path); the MLflow
resume, a real mlflow-skinny on a local file store whose logged steps are the subject, is two
``train.main`` calls in a warm 2-rank torchrun job (``fixtures/warm_jobs.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fixtures.e2e import model_vocab_size, torchrun, write_tokenized_jsonl

FAKE_WANDB = '''
import json, os, uuid

from . import errors


class _Run:
    def __init__(self, run_id):
        self.id = run_id

    def log(self, data, step):
        if os.environ.get("FAKE_WANDB_LOG_FAIL"):
            raise errors.CommError("Network error (ConnectionError), entering retry loop")
        with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
            f.write(json.dumps({"log_step": step}) + "\\n")

    def finish(self):
        pass


def init(project, config, id=None, resume=None):
    if os.environ.get("FAKE_WANDB_FAIL"):
        raise errors.UsageError("api_key not configured (no-tty)")
    with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
        f.write(json.dumps({"init_id": id, "resume": resume}) + "\\n")
    return _Run(id or uuid.uuid4().hex[:8])
'''
FAKE_ERRORS = '''
class Error(Exception):
    pass


class UsageError(Error):
    pass


class CommError(Error):
    pass
'''
BROKEN = 'raise ImportError("libfoo.so: cannot open shared object file")\n'



@pytest.fixture(scope="module")
def fake_wandb(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fake_site")
    (root / "wandb").mkdir()
    (root / "wandb" / "__init__.py").write_text(FAKE_WANDB)
    (root / "wandb" / "errors.py").write_text(FAKE_ERRORS)
    return root


def _args(model: Path, data: Path, out: Path, steps: int) -> list[str]:
    return ["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out),
            "--batch-size", "8", "--max-tokens-per-gpu", "64", "--num-warmup-steps", "0", "--lr-scheduler",
            "constant", "--min-samples-per-checkpoint", "1000", "--num-data-workers", "0", "--max-steps", str(steps),
            "--wandb-project", "p"]


def test_resumed_run_continues_the_same_wandb_run(tmp_path, chatml_model, fake_wandb):
    import os

    vocab = model_vocab_size(chatml_model)
    data = write_tokenized_jsonl(tmp_path / "d.jsonl", num_samples=20, vocab_size=vocab, seed=2)
    log = tmp_path / "wandb_calls.jsonl"
    env = {"PYTHONPATH": f"{fake_wandb}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "FAKE_WANDB_LOG": str(log)}
    out = tmp_path / "out"
    for steps in (1, 2):
        result = torchrun(_args(chatml_model, data, out, steps), env=env)
        assert result.returncode == 0, result.stderr[-4000:]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    inits = [c for c in calls if "init_id" in c]
    assert inits[0] == {"init_id": None, "resume": None}
    saved = json.loads((out / "full_state" / "samples_16" / "trainer_state.json").read_text())["wandb_run_id"]
    first = json.loads((out / "full_state" / "samples_8" / "trainer_state.json").read_text())["wandb_run_id"]
    assert inits[1] == {"init_id": first, "resume": "allow"} and saved == first
    assert [c["log_step"] for c in calls if "log_step" in c] == [1, 2]



def test_resumed_run_continues_the_same_mlflow_run(tmp_path, chatml_model, monkeypatch):
    """MLflow (mlflow-skinny, a local file store): the resumed run logs into the run the first one started."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    vocab = model_vocab_size(chatml_model)
    data = write_tokenized_jsonl(tmp_path / "d.jsonl", num_samples=20, vocab_size=vocab, seed=2)
    store = (tmp_path / "mlruns").as_uri()
    env = {"MLFLOW_ALLOW_FILE_STORE": "true", "MLFLOW_DISABLE_TELEMETRY": "true"}
    for name, value in env.items():  # this process reads the store too
        monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    for steps in (1, 2):
        args = _args(chatml_model, data, out, steps)[:-2] + ["--mlflow-tracking-uri", store, "--mlflow-experiment", "e"]
        result = torchrun(args, env=env, warm=True)
        assert result.returncode == 0, result.stderr[-4000:]
    client = MlflowClient(store)
    [run] = client.search_runs([client.get_experiment_by_name("e").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2]
    assert run.info.status == "FINISHED"
    for samples in (8, 16):
        state = json.loads((out / "full_state" / f"samples_{samples}" / "trainer_state.json").read_text())
        assert state["mlflow_run_id"] == run.info.run_id


def _warnings(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if "WARNING" in line and needle in line]


def test_a_tracker_that_cannot_start_is_one_warning_and_the_run_goes_on(tmp_path, chatml_model, fake_wandb):
    """wandb.init refused (no credentials): the run trains on with one warning instead of exiting."""
    import os

    vocab = model_vocab_size(chatml_model)
    data = write_tokenized_jsonl(tmp_path / "d.jsonl", num_samples=20, vocab_size=vocab, seed=2)
    env = {"PYTHONPATH": f"{fake_wandb}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "FAKE_WANDB_LOG": str(tmp_path / "calls.jsonl"), "FAKE_WANDB_FAIL": "1"}
    result = torchrun(_args(chatml_model, data, tmp_path / "out", 1), env=env)
    text = result.stdout + result.stderr
    assert result.returncode == 0, text[-4000:]
    [warning] = _warnings(text, "wandb.init failed (api_key not configured")
    assert "the run goes on without this tracker" in warning
    assert len((tmp_path / "out" / "training_metrics_0.jsonl").read_text().splitlines()) == 1


def test_each_tracker_package_that_fails_to_import_is_one_warning(tmp_path, chatml_model):
    """Three trackers asked for, their packages broken: one warning each (each is tried on its own); training goes on."""
    import os

    site = tmp_path / "site"
    for package in ("wandb", "tensorboard", "mlflow"):
        (site / package).mkdir(parents=True)
        (site / package / "__init__.py").write_text(BROKEN)
    vocab = model_vocab_size(chatml_model)
    data = write_tokenized_jsonl(tmp_path / "d.jsonl", num_samples=20, vocab_size=vocab, seed=2)
    env = {"PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = tmp_path / "out"
    result = torchrun(_args(chatml_model, data, out, 1) + ["--tensorboard-dir", str(tmp_path / "tb"),
                                                           "--mlflow-experiment", "e"], env=env)
    text = result.stdout + result.stderr
    assert result.returncode == 0, text[-4000:]
    for package in ("wandb", "tensorboard", "mlflow"):
        [warning] = _warnings(text, f"the optional package {package}")
        assert "the run goes on without this tracker" in warning
    assert len((out / "training_metrics_0.jsonl").read_text().splitlines()) == 1


def test_a_tracker_that_fails_while_logging_warns_once_and_is_turned_off(tmp_path, chatml_model, fake_wandb):
    import os

    vocab = model_vocab_size(chatml_model)
    data = write_tokenized_jsonl(tmp_path / "d.jsonl", num_samples=20, vocab_size=vocab, seed=2)
    env = {"PYTHONPATH": f"{fake_wandb}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "FAKE_WANDB_LOG": str(tmp_path / "calls.jsonl"), "FAKE_WANDB_LOG_FAIL": "1"}
    out = tmp_path / "out"
    result = torchrun(_args(chatml_model, data, out, 2), env=env)
    text = result.stdout + result.stderr
    assert result.returncode == 0, text[-4000:]
    [warning] = _warnings(text, "tracker WandbTracker failed in log (CommError: Network error")
    assert "it is off for the rest of the run" in warning
    assert len((out / "training_metrics_0.jsonl").read_text().splitlines()) == 2
