"""How a run ends under torchrun: one line per handled failure (and that line as the root cause of torchrun's
report), a bug's traceback kept, Ctrl-C as a preemption, a launcher killed with SIGKILL, and the exit statuses
and ``run_status.json`` a script reads (issue 40 items 3-5, issue 41).

    .venv/bin/python -m pytest -q tests/test_exit_status.py

Every signal is delivered as it is on a cluster or a terminal: to torchrun's process group (``os.killpg``,
what Ctrl-C does), or SIGKILL to torchrun alone. Each run whose process's life or torchrun's report is the subject
is a real fresh ``torchrun`` of train.py with 2 gloo CPU processes; the refusals whose text alone is the subject,
and the rerun after a Ctrl-C, are warm 2-rank runs (``fixtures/warm_jobs.py``): the report's root cause is one
mechanism for every refusal of ``fail_together`` (the missing model folder's fresh run shows it) and one for a bad
flag (its own fresh run).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures.e2e import ROOT, _free_port, model_vocab_size, torchrun, write_tokenized_jsonl
from tests.test_faults import _Launch, _args, _children

SECONDS_TO_EXIT = 30


@pytest.fixture(scope="module")
def data_path(tmp_path_factory, chatml_model) -> Path:
    return write_tokenized_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", num_samples=60,
                                 vocab_size=model_vocab_size(chatml_model), seed=3)


def _frames_of_ours(output: str) -> list[str]:
    """Traceback frames in this repository's files. torchrun's own frames are in site-packages, which may lie
    inside the repository too (``make`` builds ``.venv`` there): those are not ours."""
    return [line for line in output.splitlines()
            if re.match(rf'\s*File "{re.escape(str(ROOT))}/', line) and "site-packages" not in line]


def _root_cause(output: str) -> str:
    """The ``traceback :`` line of torchrun's "Root Cause (first observed failure)" section."""
    section = output.split("Root Cause (first observed failure):", 1)[1]
    return next(line for line in section.splitlines() if line.strip().startswith("traceback :"))


def _stepped(out: Path) -> bool:
    """Step 1's metrics line is written: the loop runs (the file itself is opened during set-up)."""
    metrics = out / "training_metrics_0.jsonl"
    return metrics.is_file() and metrics.read_text().count("\n") >= 1


def _status(out: Path) -> dict:
    return json.loads((out / "run_status.json").read_text())


def _wait_gone(pids: list[int], seconds: float) -> None:
    from minitrainer.common.distributed import pid_alive

    deadline = time.monotonic() + seconds
    while any(pid_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"still running after {seconds} s: {[p for p in pids if pid_alive(p)]}"
        time.sleep(0.2)


def test_a_missing_local_model_path_is_one_line_and_torchruns_root_cause(tmp_path, chatml_model, data_path):
    out = tmp_path / "out"
    result = torchrun(_args(tmp_path / "modles" / "qwen", data_path, out), timeout=240)
    output = result.stdout + result.stderr
    line = f"--model-name-or-path {tmp_path / 'modles' / 'qwen'}: no such folder"
    assert result.returncode == 1, output[-4000:]
    assert f"[rank0] ERROR {line}" in output, output[-4000:]
    assert "Repo id must be" not in output
    assert _frames_of_ours(output) == [], output[-6000:]
    assert _root_cause(output) == f"  traceback : {line}", output[-3000:]
    assert _status(out)["status"] == "failed" and _status(out)["message"] == line


def test_a_refusal_is_one_line_and_torchruns_root_cause(tmp_path, chatml_model, data_path):
    """A bad flag: argparse's line, the exit line of its own path (``cli.py``), is the report's root cause."""
    line = "train.py: error: unknown flag --lr; did you mean --learning-rate?"
    result = torchrun(_args(chatml_model, data_path, tmp_path / "out", "--lr", "1e-4"), timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 1 and line in output, output[-4000:]
    assert _frames_of_ours(output) == [], output[-6000:]
    assert _root_cause(output) == f"  traceback : {line}", output[-3000:]


@pytest.mark.parametrize("refusal", ["missing_data", "budget_too_small"])
def test_a_refusal_before_training_is_one_line_on_every_rank(tmp_path, chatml_model, data_path, refusal):
    """Refused through ``fail_together``, as the missing model folder is (whose fresh run shows the line as
    torchrun's root cause): the line, status 1 on both ranks, no traceback."""
    out = tmp_path / "out"
    args, line = {
        "missing_data": (_args(chatml_model, tmp_path / "nothing.jsonl", out),
                         f"--data-path {tmp_path / 'nothing.jsonl'}: no such file or folder"),
        "budget_too_small": (_args(chatml_model, data_path, out, "--max-tokens-per-gpu", "3"),
                             f"--max-tokens-per-gpu 3 is below every sample of {data_path} (shortest: 4 tokens)"),
    }[refusal]
    result = torchrun(args, timeout=240, warm=True)
    output = result.stdout + result.stderr
    assert result.returncode == 1 and result.rank_codes == [1, 1] and f"[rank0] ERROR {line}" in output, \
        output[-4000:]
    assert _frames_of_ours(output) == [] and "Traceback" not in output, output[-6000:]


def test_an_internal_error_keeps_its_traceback(tmp_path, chatml_model, data_path):
    result = torchrun(_args(chatml_model, data_path, tmp_path / "out"), timeout=240,
                      env={"MINI_TRAINER_TEST_RAISE": "2:0"})
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-4000:]
    assert any("fault_injection.py" in frame for frame in _frames_of_ours(output)), output[-6000:]
    assert "AssertionError: internal invariant broken" in output
    # The report's root cause is rank 0's traceback (torch's record() wrote it), not "<N/A>".
    assert "fault_injection.py" in output.split("Root Cause (first observed failure):", 1)[1], output[-3000:]
    assert _status(tmp_path / "out") == {**_status(tmp_path / "out"), "status": "failed", "exit_code": 1}


def test_ctrl_c_saves_and_stops_in_one_line_then_the_rerun_finishes(tmp_path, chatml_model, data_path):
    out = tmp_path / "out"
    run = _Launch(_args(chatml_model, data_path, out), env={"MINI_TRAINER_TEST_STEP_SLEEP": "1"})
    run.wait_for(lambda: _stepped(out), "step 1")
    os.killpg(run.proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C: torchrun passes it to every rank
    code = run.exit_within(SECONDS_TO_EXIT)
    output = run.output
    status = _status(out)
    assert status["status"] == "preempted" and status["exit_code"] == 75, (status, output[-4000:])
    match = re.search(r"\[rank0\] WARNING preempted at step (\d+), state saved in (\S+); run the same command "
                      r"to resume", output)
    assert match, output[-4000:]
    assert status["message"] == match.group(0).split("WARNING ", 1)[1]
    assert Path(match.group(2)).is_dir() and Path(match.group(2)).parent == out / "full_state"
    assert code == 1, "torchrun ends with 1 after a signal of its own, whatever its ranks return"
    assert "KeyboardInterrupt" not in output and _frames_of_ours(output) == [], output[-6000:]
    # torchao, imported by transformers whenever installed, warns of nothing a user can act on (log.setup_logging).
    assert "Failed to load" not in output and "_pytree" not in output, output[-6000:]

    resumed = torchrun(_args(chatml_model, data_path, out), timeout=240, warm=True)  # the rerun's state, not its life
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resumed from {match.group(2)}" in resumed.stderr
    assert _status(out)["status"] == "finished" and _status(out)["exit_code"] == 0


@pytest.mark.timing
def test_a_second_ctrl_c_stops_at_once_unsaved(tmp_path, chatml_model, data_path):
    out = tmp_path / "out"
    run = _Launch(_args(chatml_model, data_path, out), env={"MINI_TRAINER_TEST_STEP_SLEEP": "5"})
    run.wait_for(lambda: _stepped(out), "step 1")
    os.killpg(run.proc.pid, signal.SIGINT)
    run.wait_for(lambda: "Ctrl-C again to stop at once" in run.output, "the first Ctrl-C's warning")
    ranks = _children(run.proc.pid)
    os.killpg(run.proc.pid, signal.SIGINT)
    # Not the end of the output: a rank's data worker notices its parent is gone within torch's 5 s poll.
    _wait_gone(ranks, 3)  # shorter than the step's 5 s sleep, let alone the save
    run.exit_within(SECONDS_TO_EXIT)
    output = run.output
    assert "preempted at step" not in output and "saved full training state" not in output, output[-4000:]
    assert "forcefully exiting" not in output, "torchrun had to SIGKILL a rank"


def test_ranks_whose_launcher_was_killed_save_and_stop_freeing_the_lock(tmp_path, chatml_model, data_path):
    out = tmp_path / "out"
    run = _Launch(_args(chatml_model, data_path, out, "--max-steps", "200"), env={"MINI_TRAINER_TEST_STEP_SLEEP": "1"})
    ranks: list[int] = []
    try:
        run.wait_for(lambda: _stepped(out), "step 1")
        ranks = _children(run.proc.pid)
        assert len(ranks) == 2
        os.kill(run.proc.pid, signal.SIGKILL)  # torchrun alone: it cannot pass anything on
        run.proc.wait()
        _wait_gone(ranks, SECONDS_TO_EXIT)
    finally:
        for pid in ranks:  # each rank leads a session of its own, with its data worker
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    time.sleep(1)  # the reader thread drains the ranks' last lines
    output = run.output
    assert "the launcher (torchrun, pid" in output, output[-4000:]
    assert not (out / ".lock").exists(), "the lock is free for the rerun"
    status = _status(out)
    assert status["status"] == "preempted", (status, output[-4000:])
    assert Path(status["message"].split("state saved in ", 1)[1].split(";")[0]).is_dir()


@pytest.mark.parametrize("kind", ["missing_relative", "missing_absolute", "missing_deep", "file", "no_config",
                                  "model_folder", "hub_id"])
def test_model_path_refusals_are_one_line(tmp_path, chatml_model, kind, monkeypatch):
    from minitrainer.model.paths import model_path_error

    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"")
    value, expected = {
        "missing_relative": ("./modles/qwen", "--model-name-or-path ./modles/qwen: no such folder"),
        "missing_absolute": (str(tmp_path / "qwen"), f"--model-name-or-path {tmp_path / 'qwen'}: no such folder"),
        "missing_deep": ("models/qwen/7b", "--model-name-or-path models/qwen/7b: no such folder"),
        "file": ("weights.bin", "--model-name-or-path weights.bin: a file, not a model folder"),
        "no_config": ("empty", "--model-name-or-path empty: cannot load a model from this folder: it has no "
                               "config.json (not a Hugging Face model folder)"),
        "model_folder": (str(chatml_model), None),
        "hub_id": ("Qwen/Qwen2.5-1.5B-Instruct", None),  # only loading can tell
    }[kind]
    assert model_path_error(value) == expected


@pytest.mark.parametrize("hub", ["refused", "offline"])
def test_a_hub_id_that_cannot_be_reached_is_one_line(tmp_path, data_path, hub):
    """``python train.py`` with the hub's address refusing connections (retried for ~25 s, silently), or
    offline (``HF_HUB_OFFLINE=1``) with an empty cache, as on a node without internet."""
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{_free_port()}"} if hub == "refused" else {"HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--model-name-or-path", "nobody/no-such-model", "--data-path",
         str(data_path), "--output-dir", str(tmp_path / "out"), "--min-samples-per-checkpoint", "8"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
        env={**os.environ, **env, "HF_HOME": str(tmp_path / "hf"), "CUDA_VISIBLE_DEVICES": ""})
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    [line] = [line for line in output.splitlines() if "ERROR" in line]
    assert "ERROR --model-name-or-path nobody/no-such-model: cannot load a model config (" in line, output[-3000:]
    assert "Traceback" not in output and "Retrying" not in output, output[-3000:]


@pytest.mark.timing
def test_an_orphan_stuck_where_no_python_runs_exits_after_its_grace():
    """A rank whose launcher died while it waits in a collective for a peer that died too: the main thread runs
    no Python there (here: a blocking read), so only the watching thread can end it, unsaved, after its grace."""
    rank = ("import os; os.environ['TORCHELASTIC_RUN_ID'] = 'x'\n"
            "from minitrainer.loop.preemption import PreemptionFlag\n"
            "flag = PreemptionFlag(poll_s=0.1, orphan_grace_s=1.0)\n"
            "r, w = os.pipe(); print('ready', flush=True); os.read(r, 1)\n")
    launcher = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time; "
                                 f"p = subprocess.Popen([sys.executable, '-c', {rank!r}]); print(p.pid, flush=True); "
                                 f"time.sleep(600)"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    rank_pid = int(launcher.stdout.readline())
    try:
        assert launcher.stdout.readline().strip() == "ready"  # the rank's own line: its flag is up
        launcher.kill()  # SIGKILL of the launcher alone
        launcher.wait()
        _wait_gone([rank_pid], 15)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank_pid, signal.SIGKILL)


_GLOO_RANK = """
import datetime, os, socket, sys, time
import torch, torch.distributed as dist
from minitrainer.common.distributed import DistInfo, lost_ranks
from minitrainer.loop.preemption import PreemptionFlag
rank = int(sys.argv[1])
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[2], 2), rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=120))
processes = [None, None]
dist.all_gather_object(processes, (socket.gethostname(), os.getpid()))
info = DistInfo(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"), processes=tuple(processes))
if rank == 1:
    child = os.fork()
    if child == 0:  # as a forked worker does, holds this rank's connections open after it is killed
        time.sleep(600)
        os._exit(0)
    print(child, flush=True)
    time.sleep(600)
with PreemptionFlag(lambda: lost_ranks(info)):
    print("ready", flush=True)
    dist.all_reduce(torch.ones(1))
"""


@pytest.mark.timing
def test_a_signal_while_waiting_in_a_collective_for_a_dead_peer_ends_the_rank_at_once_naming_it(tmp_path):
    """torchrun's SIGTERM after a rank was killed reaches a survivor waiting in a gloo collective for it, whose
    connection a child of the dead rank still holds open. No Python handler runs inside the collective until it
    times out (here 120 s; torchrun's SIGKILL comes after 30 s): the flag's signal-watching thread ends it."""
    store = tmp_path / "store"
    ranks = [subprocess.Popen([sys.executable, "-c", _GLOO_RANK, str(rank), str(store)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    survivor, victim = ranks
    holder = None
    try:
        holder = int(victim.stdout.readline())
        assert survivor.stdout.readline().strip() == "ready"
        victim.kill()
        victim.wait()
        time.sleep(1)  # the survivor is inside the collective
        began = time.monotonic()
        survivor.send_signal(signal.SIGTERM)
        _, errors = survivor.communicate(timeout=60)
        took = time.monotonic() - began
    finally:
        for process in ranks:
            process.kill()
        if holder:
            with contextlib.suppress(ProcessLookupError):
                os.kill(holder, signal.SIGKILL)
    assert survivor.returncode == 1, errors[-3000:]
    assert f"received SIGTERM after rank 1 (pid {victim.pid} on " in errors, errors[-3000:]
    assert took < 10, f"the survivor took {took:.1f} s"


# ----------------------------------------------------------------------------
# A stop signal before the first step (loop/preemption.StopBeforeTraining), real signals to this process


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


@pytest.fixture
def own_handlers():
    """This process's handlers as they were, put back after the test (a stop leaves SIGTERM ignored)."""
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    yield previous
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def _signalled(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(10)  # the handler raises at the next instruction; never reached


def test_a_signal_before_the_first_step_stops_saying_where_and_its_repeat_ends_nothing(own_handlers):
    from minitrainer.common.exits import stopping_phase
    from minitrainer.loop.preemption import StopBeforeTraining, Stopped

    began = time.monotonic()
    with pytest.raises(Stopped) as stop, StopBeforeTraining(), stopping_phase("during the reference pass"):
        _signalled(signal.SIGTERM)
    assert time.monotonic() - began < 5
    assert stop.value.line == ("stopped by SIGTERM during the reference pass, before the first step: nothing to save; "
                               "the same command starts again")
    # SLURM signals the ranks and torchrun, which forwards: the second delivery must not end the rank on its way out.
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGUSR1)


def test_a_failure_after_the_signal_is_that_stop_and_no_signal_leaves_the_handlers_as_they_were(own_handlers):
    from minitrainer.loop.preemption import StopBeforeTraining, Stopped

    with StopBeforeTraining():
        pass
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == own_handlers
    with pytest.raises(Stopped) as stop, StopBeforeTraining():
        try:
            _signalled(signal.SIGUSR1)
        except Stopped:  # what a peer sees when this rank left the collective first
            raise RuntimeError("Connection closed by peer") from None
    assert stop.value.line.startswith("stopped by SIGUSR1 during start-up, before the first step")
    assert isinstance(stop.value.__cause__, RuntimeError)


def test_a_process_forked_before_the_first_step_still_dies_of_sigterm(own_handlers):
    """Tokenizing forks a Pool, whose terminate() SIGTERMs its workers: the handler they inherit must not turn that
    into an exception inside the child (an exit with a traceback, a worker that goes on)."""
    import multiprocessing

    from minitrainer.loop.preemption import StopBeforeTraining

    context = multiprocessing.get_context("fork")
    ready = context.Event()
    with StopBeforeTraining():
        child = context.Process(target=_ready_then_sleep, args=(ready,))
        child.start()
        assert ready.wait(timeout=60)  # signalled once it runs Python, as a Pool worker is when terminate() comes
        child.terminate()
        child.join(timeout=60)
    assert child.exitcode == -signal.SIGTERM


def _ready_then_sleep(ready) -> None:
    ready.set()
    time.sleep(120)
