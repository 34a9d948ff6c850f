"""Python API beside the CLI: launch ``python -m minitrainer.run`` (torchrun's API) from a config object.

    from minitrainer import TorchrunArgs, TrainConfig, run_training, ProcessDataConfig, process_data

    process_data(ProcessDataConfig(input_file="minitrainer/tools/demo_chat.jsonl", output_dir="/tmp/demo_tkns",
                                   model_name_or_path="Qwen/Qwen2.5-1.5B-Instruct"))
    run_training(TorchrunArgs(nproc_per_node=2),
                 TrainConfig(output_dir="/tmp/out", data_path="/tmp/demo_tkns",
                             model_name_or_path="Qwen/Qwen2.5-1.5B-Instruct",
                             min_samples_per_checkpoint=1000, max_steps=10))

A config file (YAML or JSON, what ``--config`` reads: ``examples/``, a run's ``training_params.json``)
gives the same object: ``config_from_file(TrainConfig, "examples/lora.yaml")``, and
``dataclasses.replace(config, output_dir=...)`` changes a field of it.

``run_training`` turns the ``TrainConfig`` (the same dataclass the CLI is
generated from) back into ``train.py`` flags, so the Python API and the CLI
cannot drift apart, and runs the launcher ``python -m minitrainer.run`` (torchrun's own
API, the run's exit status) in a child process with this Python.
Inside an already-running torchrun job, call ``minitrainer.train.train(config)`` instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from minitrainer.checkpoint.full_state import complete_checkpoints
from minitrainer.common.cli import config_field
from minitrainer.common.refusals import collect_errors
from minitrainer.common.config_files import config_from_file
from minitrainer.common.exits import EXIT_INTERRUPTED, EXIT_PREEMPTED
from minitrainer.common.log import logger
from minitrainer.data.process_data import ProcessDataConfig, process_data
from minitrainer.run import pythonpath_with_package, read_run_status
from minitrainer.report.watch import ListenerFailures, RunEvent, RunWatcher
from minitrainer.train_config import TrainConfig

__all__ = ["ProcessDataConfig", "RunEvent", "RunFailed", "RunResult", "TorchrunArgs", "TrainConfig", "config_from_file",
           "config_to_argv", "process_data", "run_training", "torchrun_command"]

NPROC_WORDS = ("gpu", "cpu", "auto")


@dataclass
class TorchrunArgs:
    """How torchrun starts the job: ``torchrun --nnodes ... --nproc-per-node ... train.py``.

    One node: leave everything but ``nproc_per_node`` at its default (torchrun
    ``--standalone`` picks a free local port). Several nodes: run the same call
    on every node with its own ``node_rank`` and either a c10d rendezvous
    (``rdzv_endpoint``, preferred) or a static ``master_addr``/``master_port``.
    """

    nproc_per_node: int | Literal["gpu", "cpu", "auto"] = config_field(
        1, help="processes per node, or torchrun's own words for it: gpu (one per visible GPU), cpu (one per core), "
                "auto (gpu where there is one, else cpu)")
    nnodes: int = config_field(1, help="number of nodes")
    node_rank: int | None = config_field(None, help="this node's rank (static rendezvous only; c10d assigns it)")
    rdzv_id: str = config_field("mini-trainer", help="job id shared by all nodes of one c10d rendezvous")
    rdzv_endpoint: str | None = config_field(None, help="host:port of the c10d rendezvous (e.g. the first node)")
    rdzv_backend: str = config_field("c10d", help="torchrun rendezvous backend")
    master_addr: str | None = config_field(None, help="static rendezvous: address of the rank-0 node")
    master_port: int = config_field(29500, help="static rendezvous: port on master_addr")

    def __post_init__(self) -> None:
        errors = []
        if isinstance(self.nproc_per_node, str):
            if self.nproc_per_node not in NPROC_WORDS:
                errors.append(f"nproc_per_node {self.nproc_per_node!r} is neither a number nor one of "
                              f"{', '.join(NPROC_WORDS)}")
        elif self.nproc_per_node < 1:
            errors.append(f"nproc_per_node must be >= 1, got {self.nproc_per_node}")
        if self.nnodes < 1:
            errors.append(f"nnodes must be >= 1, got {self.nnodes}")
        if self.rdzv_endpoint is not None and self.master_addr is not None:
            errors.append("give rdzv_endpoint (c10d rendezvous) or master_addr (static), not both")
        if self.nnodes > 1 and self.rdzv_endpoint is None and self.master_addr is None:
            errors.append(f"nnodes={self.nnodes} needs rdzv_endpoint or master_addr so the nodes can find each other")
        if self.master_addr is not None and self.node_rank is None:
            errors.append("a static rendezvous (master_addr) needs this node's node_rank")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            errors.append(f"node_rank {self.node_rank} outside 0..{self.nnodes - 1}")
        collect_errors(errors)

    def to_argv(self) -> list[str]:
        """torchrun's own flags (everything before the script path)."""
        argv = [f"--nnodes={self.nnodes}", f"--nproc-per-node={self.nproc_per_node}"]
        if self.rdzv_endpoint is not None:
            argv += [f"--rdzv-backend={self.rdzv_backend}", f"--rdzv-endpoint={self.rdzv_endpoint}",
                     f"--rdzv-id={self.rdzv_id}"]
        elif self.master_addr is not None:
            argv += [f"--master-addr={self.master_addr}", f"--master-port={self.master_port}"]
        else:
            argv += ["--standalone"]
        if self.node_rank is not None:
            argv += [f"--node-rank={self.node_rank}"]
        return argv


def config_to_argv(config: Any) -> list[str]:
    """The CLI flags that ``cli.parse_config`` turns back into an equal ``config``.

    ``foo_bar=x`` becomes ``--foo-bar x``; booleans ``--foo``/``--no-foo``;
    tuples several values; ``None`` is omitted (every optional field defaults
    to None). Floats use ``repr`` so they round-trip exactly.
    """
    argv: list[str] = []
    for field in dataclasses.fields(config):
        if not field.init:
            continue
        value = getattr(config, field.name)
        flag = "--" + field.name.replace("_", "-")
        if value is None:
            assert field.default is None, f"{field.name} is None but defaults to {field.default!r}"
            continue
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + field.name.replace("_", "-"))
        elif isinstance(value, (tuple, list)):
            argv += [flag, *(repr(v) if isinstance(v, float) else str(v) for v in value)]
        else:
            argv += [flag, repr(value) if isinstance(value, float) else str(value)]
    return argv


def torchrun_command(torchrun_args: TorchrunArgs, train_args: TrainConfig, *, log_dir: str | None = None) -> list[str]:
    """The full command ``run_training`` executes: ``python -m minitrainer.run`` with torchrun's flags, ``--``, the
    training flags (``log_dir``: where torchrun keeps each rank's error file)."""
    log = [f"--log-dir={log_dir}"] if log_dir is not None else []
    return [sys.executable, "-m", "minitrainer.run", *torchrun_args.to_argv(), *log, "--", *config_to_argv(train_args)]


@dataclass(frozen=True)
class RunResult:
    """Where a finished run left its results."""

    output_dir: Path
    last_checkpoint: Path | None
    """The newest Hugging Face export (``hf_format/samples_N``): the final model of a finished run."""
    metrics_path: Path
    """Rank 0's ``training_metrics_0.jsonl``: a JSON line per step and per validation."""


class RunFailed(subprocess.CalledProcessError):
    """The run did not finish: ``status`` (``run_status.json``'s: failed, preempted, interrupted) and the run's
    own one line as the message; ``returncode`` is the run's exit status (1, 2, 75 or 130: docs/training.md)."""

    def __init__(self, returncode: int, command: list[str], *, status: str, line: str | None):
        super().__init__(returncode, command)
        self.status, self.line = status, line

    def __str__(self) -> str:
        return f"training {self.status}: {self.line}" if self.line else f"training {self.status} (exit status " \
                                                                        f"{self.returncode})"


POLL_SECONDS = 0.5
STATUS_NAMES = {EXIT_PREEMPTED: "preempted", EXIT_INTERRUPTED: "interrupted"}
"""``RunFailed.status`` by exit status, where the run wrote no ``run_status.json`` of its own."""
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def run_training(torchrun_args: TorchrunArgs, train_args: TrainConfig, *,
                 on_event: Callable[[RunEvent], None] | None = None, env: dict[str, str] | None = None) -> RunResult:
    """Launch ``python -m minitrainer.run`` with ``train_args`` and wait until it and its workers end.

    The child inherits this process's environment (set ``CUDA_VISIBLE_DEVICES``, ``NCCL_*`` or
    ``OMP_NUM_THREADS`` in ``os.environ`` before calling) and output. It runs in a session of its own, and
    SIGINT and SIGTERM that reach this process are passed on to it once each: Ctrl-C in a terminal or a
    notebook, or a pod's preemption, becomes the run's preemption save, not an orphaned job.

    Args:
        torchrun_args: node and process layout.
        train_args: the run's parameters, as the CLI would parse them.
        on_event: called in this process with each ``report.watch.RunEvent`` (steps, validations, exports) while
            the run goes on; what it raises is logged in one line the first time, counted after, the count said
            in one line when the run ends (finished or not), and the run goes on.
        env: variables added to the workers' environment (not this process's).

    Raises:
        RunFailed: the run failed, was preempted (saved: the same call resumes) or interrupted; its message is
            the run's own line (a ``subprocess.CalledProcessError``, as before).
    """
    with tempfile.TemporaryDirectory(prefix="minitrainer-torchrun-") as log_dir:
        return _launch(torchrun_command(torchrun_args, train_args, log_dir=log_dir), train_args, log_dir=Path(log_dir),
                       on_event=on_event, env=env)


def _launch(command: list[str], train_args: TrainConfig, *, log_dir: Path,
            on_event: Callable[[RunEvent], None] | None, env: dict[str, str] | None) -> RunResult:
    logger.info("launching: %s", " ".join(command))
    # By module, never by the file's path: a script's folder goes first on sys.path, and the package's
    # modules would shadow the caller's own. The child finds the package where this process found it
    # (a checkout that is not installed included), after whatever the caller's PYTHONPATH puts first.
    path = pythonpath_with_package(os.environ.get("PYTHONPATH"))
    started = time.time()
    watcher = RunWatcher(train_args.output_dir, started=started)
    process = subprocess.Popen(command, env={**os.environ, **(env or {}), "PYTHONPATH": path},
                               start_new_session=True)
    failures = ListenerFailures(per="event")
    try:
        with _signals_passed_to(process):
            while process.poll() is None:
                time.sleep(POLL_SECONDS)
                _deliver(watcher.poll(), on_event, failures)
            _deliver(watcher.poll(), on_event, failures)
    finally:  # finished, failed, preempted or interrupted here: the listener's count is said once
        failures.report()
    output_dir = Path(train_args.output_dir)
    if process.returncode != 0:
        status = read_run_status(output_dir, since=started)
        name = status.get("status") or STATUS_NAMES.get(process.returncode, "failed")
        raise RunFailed(process.returncode, command, status=name,
                        line=status.get("message") or _first_error_line(log_dir))
    exports = complete_checkpoints(output_dir / "hf_format")
    return RunResult(output_dir=output_dir, last_checkpoint=exports[-1] if exports else None,
                     metrics_path=watcher.metrics_path)


def _first_error_line(log_dir: Path) -> str | None:
    """The line of the rank that failed first, from torchrun's error files: where a run stopped before it
    held its output folder (a missing model, a refused flag), ``run_status.json`` has none."""
    reports = []
    for path in log_dir.rglob("error.json"):
        try:
            message = json.loads(path.read_text())["message"]
            text = message["message"] if isinstance(message, dict) else str(message)
            stamp = int(message.get("extraInfo", {}).get("timestamp", 0)) if isinstance(message, dict) else 0
        except (OSError, ValueError, KeyError, TypeError):
            continue
        reports.append((stamp, text.strip().splitlines()[-1] if text.strip() else text))
    return min(reports)[1] if reports else None


def _deliver(events: list[RunEvent], on_event: Callable[[RunEvent], None] | None,
             failures: ListenerFailures) -> None:
    for event in events if on_event is not None else ():
        where = f"step {event.record.get('step', 0)}" + ("" if event.kind == "step" else f" ({event.kind})")
        failures.call("the run's on_event listener", on_event, event, at=where)


@contextlib.contextmanager
def _signals_passed_to(process: subprocess.Popen):
    """While the run goes on, SIGINT and SIGTERM to this process go to the launcher, whose torchrun agent passes
    them to the ranks (the first saves and stops; a second SIGINT stops unsaved, as in a terminal)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum, _frame):
        if process.poll() is None:
            process.send_signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in FORWARDED_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
