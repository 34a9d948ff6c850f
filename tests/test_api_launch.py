"""``run_training`` as a launcher: the run's events reach the caller in order and once (``report/watch.py``), a
signal to the launching process becomes the run's preemption save, a rerun resumes, a failing listener
costs two lines however often it fails (``ListenerFailures``); and the settings other trainers' APIs need
(``--adam-eps``, ``--checkpoint-at-epoch``, ``--tokenized-data-dir``).

    .venv/bin/python -m pytest -q tests/test_api_launch.py

The launches are real: ``run_training`` in a child Python (the launching process a notebook or a pod
would be) starting torchrun with 2 gloo CPU ranks on the tiny chatml model and the demo's raw chat data (every
4th row of it for the two epochs).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fixtures.e2e import ROOT
from minitrainer.api import _deliver
from minitrainer.common.log import logger
from minitrainer.optim.base import OptimizerSetting
from minitrainer.optim.registry import optimizer_choice
from minitrainer.report.watch import Lifecycle, ListenerFailures, RunEvent, RunWatcher

DEMO_DATA = ROOT / "minitrainer" / "tools" / "demo_chat.jsonl"
EVERY_NTH_ROW = 4
"""Two epochs of the whole demo are ~50 steps; every 4th row keeps its mix of chat and text rows in ~12."""

LAUNCHER = """
import json, sys
from minitrainer.api import RunFailed, TorchrunArgs, TrainConfig, run_training

out, model, data, extra = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
events = open(out + ".events.jsonl", "a")

raises = extra.pop("listener_raises", False)

def listen(event):
    events.write(json.dumps({"kind": event.kind, "step": event.record.get("step"),
                             "path": None if event.path is None else str(event.path)}) + "\\n")
    events.flush()
    if raises:  # after recording: the test sees every event it was handed
        raise RuntimeError("a listener's own bug")

config = TrainConfig(output_dir=out, data_path=data, model_name_or_path=model, batch_size=16,
                     max_tokens_per_gpu=2048, min_samples_per_checkpoint=10**9, **extra.pop("config", {}))
try:
    result = run_training(TorchrunArgs(nproc_per_node=2), config, on_event=listen)
except RunFailed as err:
    print("RUNFAILED", json.dumps({"status": err.status, "line": err.line, "message": str(err)}), flush=True)
    sys.exit(3)
print("RESULT", json.dumps({"last_checkpoint": str(result.last_checkpoint)}), flush=True)
"""


def _demo_rows(tmp_path: Path) -> Path:
    """Every ``EVERY_NTH_ROW``-th row of the demo's raw chat data, under the demo file's name."""
    path = tmp_path / "demo" / DEMO_DATA.name
    path.parent.mkdir()
    path.write_text("".join(DEMO_DATA.read_text().splitlines(keepends=True)[::EVERY_NTH_ROW]))
    return path


def _launch(tmp_path: Path, model: Path, extra: dict, *, wait: bool = True, data: Path = DEMO_DATA):
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(script), str(tmp_path / "out"), str(model), str(data), json.dumps(extra)]
    if not wait:
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def _events(tmp_path: Path) -> list[dict]:
    path = tmp_path / "out.events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _metrics(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "out" / "training_metrics_0.jsonl").read_text().splitlines()]


def test_every_step_validation_and_export_reaches_the_launcher_once_in_order(tmp_path, chatml_model):
    """Two epochs with an export at each epoch's end, a validation every 4 steps, AdamW's epsilon and the
    tokenized cache where the caller put them; a listener that raises on every event is said once, then
    counted in one line at the end, and the run goes on."""
    config = {"num_epochs": 2.0, "checkpoint_at_epoch": True, "validation_split": 0.1,
              "validation_every_n_steps": 4, "adam_eps": 1e-6, "tokenized_data_dir": str(tmp_path / "tok")}
    data = _demo_rows(tmp_path)
    result = _launch(tmp_path, chatml_model, {"config": config, "listener_raises": True}, data=data)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = _metrics(tmp_path)
    steps = [m["step"] for m in metrics if "val_loss" not in m]
    events = _events(tmp_path)
    said = [line[line.index("the run's on_event listener"):] for line in (result.stdout + result.stderr).splitlines()
            if "the run's on_event listener" in line]
    assert said == [
        f"the run's on_event listener failed at step {steps[0]} (RuntimeError: a listener's own bug); training goes "
        "on (its further failures are counted, said at the end)",
        f"the run's on_event listener failed on {len(events)} of {len(events)} events (first at step {steps[0]}: "
        "RuntimeError: a listener's own bug)"]
    # Every line arrived, once, in order, the listener's failures notwithstanding.
    assert [e["step"] for e in events if e["kind"] == "step"] == steps
    assert [e["step"] for e in events if e["kind"] == "validation"] == [m["step"] for m in metrics if "val_loss" in m]
    num_rows = len(data.read_text().splitlines())
    train_rows = num_rows - round(num_rows * 0.1)
    samples = {m["step"]: m["samples_seen"] for m in metrics if "val_loss" not in m}
    epoch_end = min(step for step, seen in samples.items() if seen >= train_rows)
    exports = [(e["step"], Path(e["path"]).name) for e in events if e["kind"] == "export"]
    assert exports == [(epoch_end, f"samples_{samples[epoch_end]}"), (steps[-1], f"samples_{samples[steps[-1]]}")]
    assert json.loads(result.stdout.split("RESULT ", 1)[1])["last_checkpoint"].endswith(f"samples_{samples[steps[-1]]}")
    params = json.loads((tmp_path / "out" / "training_params.json").read_text())
    assert params["adam_eps"] == 1e-6
    assert list((tmp_path / "tok").glob("demo_chat-*/data.jsonl"))
    assert not (tmp_path / "out" / "tokenized_data").exists()


def test_sigterm_to_the_launching_process_saves_and_the_same_call_resumes(tmp_path, chatml_model):
    """A pod's preemption reaches the Python process that called ``run_training`` (torchrun runs in a session
    of its own): it is passed on, the ranks save, the call raises ``RunFailed`` with the run's own line; the
    same call again resumes, and its events are the new steps only."""
    extra = {"config": {"max_steps": 8}}
    launcher = _launch(tmp_path, chatml_model, extra, wait=False)
    deadline = time.monotonic() + 240
    while not any(e["kind"] == "step" and e["step"] >= 2 for e in _events(tmp_path)):
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.stdout.read()[-3000:]
        time.sleep(0.2)
    launcher.send_signal(signal.SIGTERM)
    output = launcher.communicate(timeout=120)[0]
    assert launcher.returncode == 3, output[-3000:]
    failed = json.loads(output.split("RUNFAILED ", 1)[1].splitlines()[0])
    assert failed["status"] == "preempted"
    assert failed["line"].startswith("preempted at step ") and "run the same command to resume" in failed["line"]
    assert failed["message"] == f"training preempted: {failed['line']}"
    saved_step = int(failed["line"].split()[3].rstrip(","))
    assert saved_step < 8
    first = _events(tmp_path)

    again = _launch(tmp_path, chatml_model, extra)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    resumed = _events(tmp_path)[len(first):]
    assert [e["step"] for e in resumed if e["kind"] == "step"] == list(range(saved_step + 1, 9))
    assert [m["step"] for m in _metrics(tmp_path)] == list(range(1, 9))


def test_a_resumed_metrics_file_cut_back_yields_only_lines_written_after_the_launch(tmp_path):
    metrics = tmp_path / "training_metrics_0.jsonl"
    old = [{"step": step, "samples_seen": 8 * step, "timestamp": 100.0 + step} for step in (1, 2, 3, 4)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in old))
    watcher = RunWatcher(tmp_path, started=200.0)
    assert watcher.poll() == []
    # The resumed run cuts the file back to its step 2 and appends; a line still being written waits.
    new = [{"step": 3, "samples_seen": 24, "timestamp": 201.0}, {"step": 3, "val_loss": 1.5, "timestamp": 202.0}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in old[:2] + new) + '{"step": 4, "sampl')
    assert [(e.kind, e.record["step"]) for e in watcher.poll()] == [("step", 3), ("validation", 3)]
    (tmp_path / "hf_format" / ".samples_24.tmp").mkdir(parents=True)
    assert watcher.poll() == []
    (tmp_path / "hf_format" / ".samples_24.tmp").rename(tmp_path / "hf_format" / "samples_24")
    with metrics.open("a") as f:
        f.write('s_seen": 32, "timestamp": 203.0}\n')
    events = watcher.poll()
    assert [(e.kind, e.record["step"]) for e in events] == [("step", 4), ("export", 3)]
    assert events[1].path == tmp_path / "hf_format" / "samples_24"


@pytest.mark.parametrize("name", ["adamw", "adamw_8bit"])
def test_adam_eps_reaches_the_optimizer(name):
    if name == "adamw_8bit":
        pytest.importorskip("torchao")
    params = [torch.nn.Parameter(torch.zeros(256, 256))]
    setting = OptimizerSetting(lr=1e-3, betas=(0.9, 0.95), eps=1e-5, device=torch.device("cpu"))
    optimizer = optimizer_choice(name).build([{"params": params, "weight_decay": 0.0}], setting)
    assert optimizer.defaults["eps"] == 1e-5


def test_lifecycle_hooks_come_in_the_order_trainers_callbacks_expect():
    fired = []
    lifecycle = Lifecycle(lambda hook, event, last: fired.append((hook, event.kind, event.record["step"],
                                                                  last and last.record["step"])), logging_steps=2)
    steps = [RunEvent("step", {"step": s, "epoch": 0 if s < 3 else 1}) for s in (1, 2, 3, 4)]
    for event in [steps[0], steps[1], RunEvent("validation", {"step": 2, "val_loss": 1.0}), steps[2],
                  RunEvent("export", {"step": 3}, Path("hf_format/samples_48")), steps[3]]:
        lifecycle(event)
    lifecycle.finish()
    assert fired == [
        ("on_train_begin", "step", 1, None), ("on_epoch_begin", "step", 1, None), ("on_step_end", "step", 1, 1),
        ("on_step_end", "step", 2, 2), ("on_log", "step", 2, 2), ("on_evaluate", "validation", 2, 2),
        ("on_epoch_end", "step", 2, 2), ("on_epoch_begin", "step", 3, 2), ("on_step_end", "step", 3, 3),
        ("on_save", "export", 3, 3), ("on_step_end", "step", 4, 4), ("on_log", "step", 4, 4),
        ("on_epoch_end", "step", 4, 4), ("on_train_end", "step", 4, 4)]


def _warnings(caplog, run) -> list[str]:
    """What ``run()`` logs at WARNING on the toolkit's logger (which stops propagating once set up)."""
    attach = not logger.propagate
    if attach:
        logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger=logger.name):
            run()
    finally:
        if attach:
            logger.removeHandler(caplog.handler)
    return [record.getMessage() for record in caplog.records if record.name == logger.name]


def test_a_failing_listener_is_said_once_then_counted_in_one_line_once(caplog):
    failures = ListenerFailures(per="call")
    seen = []

    def broken(value):
        seen.append(value)
        if value % 2:
            raise ValueError(f"boom {value}")

    def run():
        for value in range(1, 8):
            failures.call("callback Broken.on_step_end", broken, value, at=f"step {value}")
            failures.call("callback Fine.on_step_end", seen.append, -value)
        failures.report()
        failures.report()  # a second end (a failure path after a finish) says nothing more

    assert _warnings(caplog, run) == [
        "callback Broken.on_step_end failed at step 1 (ValueError: boom 1); training goes on (its further failures "
        "are counted, said at the end)",
        "callback Broken.on_step_end failed on 4 of 7 calls (first at step 1: ValueError: boom 1)"]
    assert seen == [v for value in range(1, 8) for v in (value, -value)]  # every call was made


def test_the_launchers_delivery_counts_a_failing_listener_over_a_real_metrics_file(tmp_path, caplog):
    """``_deliver`` as ``run_training`` drives it: the real watcher on a metrics file written here."""
    metrics = tmp_path / "training_metrics_0.jsonl"
    watcher = RunWatcher(tmp_path, started=100.0)
    failures = ListenerFailures(per="event")
    delivered = []

    def listener(event):
        delivered.append(event)
        raise KeyError("loss")

    def run():
        for step in range(1, 7):
            with metrics.open("a") as f:
                f.write(json.dumps({"step": step, "samples_seen": 8 * step, "timestamp": 100.0 + step}) + "\n")
                if step % 3 == 0:
                    f.write(json.dumps({"step": step, "val_loss": 1.0, "timestamp": 100.5 + step}) + "\n")
            _deliver(watcher.poll(), listener, failures)
        failures.report()

    said = _warnings(caplog, run)
    assert len(delivered) == 8
    assert said == ["the run's on_event listener failed at step 1 (KeyError: 'loss'); training goes on (its further "
                    "failures are counted, said at the end)",
                    "the run's on_event listener failed on 8 of 8 events (first at step 1: KeyError: 'loss')"]
