"""What clusters do to a week-long job, done for real: a full disk, flipped bytes, re-tokenized data, a second
run on the folder, broken data files, a rank taken by the out-of-memory killer (issue 30).

    .venv/bin/python -m pytest -q tests/test_faults.py

A fault the processes live through (a full disk, corrupt bytes read on resume, a second live run, a killed rank,
a broken data line) is a real fresh ``torchrun`` of train.py with 2 gloo CPU processes and the DEFAULT data
workers (one per rank: the tests of tests/test_resume.py use none, which is how a worker that held every rank's
exit went unseen). The reference run, the resume after the disk is freed and the refusals whose line is the
subject (re-tokenized data, an empty data file) are ``train.main`` calls in a warm 2-rank torchrun job
(``fixtures/warm_jobs.py``): the same ranks, workers and files. A full disk is a small tmpfs mounted for the
test: where mounting is refused (not root, a container without CAP_SYS_ADMIN) those tests skip and say so. Each
test fails on the code before issue 30: a hang (the tests bound every wait), a silent resume, tracebacks instead
of one line. The modules issue 30 added are imported inside the tests that use them, after the part that runs
the job, so that this file runs against that older code too and each test fails there on its own assertion.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fixtures.e2e import ROOT, _free_port, assert_ok, model_vocab_size, read_metrics, torchrun, write_tokenized_jsonl
from minitrainer.checkpoint.full_state import complete_checkpoints

BATCH = 12
STEPS = 8
EVERY = 2 * BATCH  # a full state (and an export) after steps 2, 4, 6, 8
SECONDS_TO_EXIT = 30  # torchrun itself gives a worker 30 s after SIGTERM: a clean exit must beat that


@pytest.fixture(scope="module")
def data_path(tmp_path_factory, chatml_model) -> Path:
    return write_tokenized_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", num_samples=60,
                                 vocab_size=model_vocab_size(chatml_model), seed=3)


def _args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    """No --num-data-workers: the default, one worker process per rank."""
    return ["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out),
            "--batch-size", str(BATCH), "--max-tokens-per-gpu", "96", "--seed", "11", "--learning-rate", "1e-3",
            "--num-warmup-steps", "2", "--lr-scheduler", "cosine", "--max-steps", str(STEPS),
            "--min-samples-per-checkpoint", str(EVERY), "--keep-last-n-full-states", "3", *extra]


def _no_worker_traceback(output: str, *, killed_rank: int | None = None) -> None:
    """The trainer's processes print no traceback (torchrun's own summary of a failed job is one).

    A rank killed from outside is not judged: its DataLoader worker may report the broken pipe to its
    dead parent (multiprocessing's resource sharer) before it exits, which says nothing of the survivors.
    """
    lines = [line for line in output.splitlines()
             if killed_rank is None or f"[rank{killed_rank}]:" not in line]
    shown = "\n".join(lines)
    assert shown.count("Traceback (most recent call last)") == shown.count("ChildFailedError:"), output[-6000:]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, chatml_model, data_path) -> Path:
    out = tmp_path_factory.mktemp("reference")
    assert_ok(torchrun(_args(chatml_model, data_path, out), warm=True))
    return out


def _same_run(out: Path, reference: Path) -> None:
    """Same steps, losses and final weights, bit for bit."""
    got, want = read_metrics(out), read_metrics(reference)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    a = load_file(complete_checkpoints(reference / "hf_format")[-1] / "model.safetensors")
    b = load_file(complete_checkpoints(out / "hf_format")[-1] / "model.safetensors")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)


class _Launch:
    """A torchrun in its own process group whose output is read as it comes, so a test can act mid-run and
    bound how long the job takes to exit after the moment that matters."""

    def __init__(self, args: list[str], env: dict | None = None) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port",
               str(_free_port()), str(ROOT / "train.py"), *args]
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                    "CUDA_VISIBLE_DEVICES": "", **(env or {})}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, start_new_session=True, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, ready, what: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None:
                self._reader.join(timeout=10)
                assert ready(), f"the run ended before {what}:\n{self.output[-4000:]}"
                return
            assert time.monotonic() < deadline, f"no {what} within {timeout} s"
            time.sleep(0.05)

    def exit_within(self, seconds: float) -> int:
        """The job's exit code; it must come within ``seconds`` (else the job is killed and the test fails)."""
        try:
            code = self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            self.kill()  # ranks included: left running, they would load the tests after this one
            pytest.fail(f"the job did not exit within {seconds} s:\n{self.output[-4000:]}")
        self._reader.join(timeout=10)
        return code

    def kill(self) -> None:
        """``kill -9`` of the whole job, nothing runs its cleanup: torchrun starts each rank in a session
        of its own (with its data worker), so each of those process groups is killed, then torchrun's."""
        for rank_pid in _children(self.proc.pid):
            os.killpg(rank_pid, signal.SIGKILL)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._reader.join(timeout=10)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rpartition(")")[2].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return found


@pytest.fixture
def small_disk(tmp_path):
    """``mount(size_mb)``: a fresh tmpfs of that size (the disk that fills), unmounted after the test."""
    mounted = []

    def mount(size_mb: int) -> Path:
        point = tmp_path / f"disk{len(mounted)}"
        point.mkdir()
        if os.geteuid() != 0:
            pytest.skip("filling a disk needs a small tmpfs, and mounting one needs root (CAP_SYS_ADMIN)")
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(point)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here to fill (a container without CAP_SYS_ADMIN?): "
                        f"{result.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


def _fill(folder: Path) -> None:
    """Another writer takes every free byte of the file system."""
    try:
        with (folder / "filler").open("wb") as f:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
    except OSError:
        pass  # full


def _next_line_needs_a_page(metrics: Path) -> bool:
    """Whether the next metrics line may need a new 4 KiB page, after a step that saves nothing (every 5th does)."""
    lines = metrics.read_text().splitlines(keepends=True)
    return len(lines) % 5 != 0 and metrics.stat().st_size % 4096 + max(len(line) for line in lines) + 64 > 4096


def _complete_and_verified(out: Path) -> list[str]:
    from minitrainer.checkpoint.full_state import verify

    found = []
    for path in complete_checkpoints(out / "full_state"):
        state = json.loads((path / "trainer_state.json").read_text())
        assert state["checksums"] and verify(path, state, rank=0, world_size=1) is None, path
        found.append(path.name)
    return found


# ----------------------------------------------------------------------------
# The disk fills


@pytest.mark.timing
def test_disk_full_during_a_full_state_save_stops_every_rank_then_resumes_exactly(
        small_disk, chatml_model, data_path, uninterrupted):
    """A full state is ~1.9 MB and an export ~0.3 MB: 3 MB holds the first of each, not the second full state."""
    disk = small_disk(3)
    out = disk / "out"
    run = _Launch(_args(chatml_model, data_path, out))
    run.wait_for(lambda: "could not be saved" in run.output, "the failed save")
    assert run.exit_within(SECONDS_TO_EXIT) != 0
    output = run.output
    for rank in (0, 1):
        assert (f"[rank{rank}] ERROR full-state checkpoint {out / 'full_state' / 'samples_48'} could not be saved"
                in output), output[-4000:]
    assert "No space left on device" in output, [line for line in output.splitlines() if "ERROR" in line]
    _no_worker_traceback(output)
    assert _complete_and_verified(out) == ["samples_24"], "the failed save must never look like a checkpoint"
    assert not list((out / "full_state").glob("*.tmp")), "the half-written save is removed, freeing its space"

    subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)  # the user frees space
    resumed = torchrun(_args(chatml_model, data_path, out), warm=True)
    assert_ok(resumed)
    assert f"resumed from {out / 'full_state' / 'samples_24'}" in resumed.stderr
    _same_run(out, uninterrupted)


@pytest.mark.timing
def test_disk_filled_by_another_writer_between_saves_stops_every_rank_in_one_line(small_disk, chatml_model,
                                                                                  data_path):
    disk = small_disk(16)  # room for every checkpoint the run plans: only the other writer fills it
    out = disk / "out"
    metrics = out / "training_metrics_0.jsonl"
    run = _Launch(_args(chatml_model, data_path, out, "--min-samples-per-checkpoint", str(5 * BATCH),
                        "--max-steps", "12"), env={"MINI_TRAINER_TEST_STEP_SLEEP": "1"})
    # The write that meets the full disk first must be rank 0's alone: the metrics line (the row of issue 30;
    # a failed export already stopped every rank). tmpfs allocates 4 KiB pages, so after the save of step 5
    # the disk is filled once the next line may no longer fit in the metrics file's last page, on a step
    # that saves nothing (saves come after the step's line; lines are ~900 bytes: line 10 needs page 3).
    run.wait_for(lambda: (out / "full_state" / f"samples_{5 * BATCH}").is_dir() and _next_line_needs_a_page(metrics),
                 "a metrics line that needs a new page")
    _fill(disk)
    assert run.exit_within(SECONDS_TO_EXIT) != 0
    output = run.output
    assert f"[rank0] ERROR stopping: [Errno 28] No space left on device: '{metrics}'" in output, output[-4000:]
    assert "[rank1] ERROR" in output, "the other rank says why it stops"
    _no_worker_traceback(output)
    assert _complete_and_verified(out)[0] == f"samples_{5 * BATCH}", "what was saved stays loadable"


# ----------------------------------------------------------------------------
# What a resume must not trust


def test_corrupt_full_states_are_skipped_with_one_warning_each(tmp_path, chatml_model, data_path, uninterrupted):
    """Bytes flipped inside a shard of the newest full state, and an empty .metadata in the one before: the
    resume skips both, each with one warning naming it, and continues exactly from the third. A fresh run: the
    whole output a user sees holds the warnings and no reader traceback."""
    out = tmp_path / "out"
    shutil.copytree(uninterrupted, out)
    newest, previous, third = complete_checkpoints(out / "full_state")[::-1]
    shard = newest / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    shard.write_bytes(bytes(data))
    (previous / ".metadata").write_bytes(b"")
    resumed = torchrun(_args(chatml_model, data_path, out))
    assert_ok(resumed)
    output = resumed.stdout + resumed.stderr
    assert f"skipping corrupt checkpoint {newest}: __1_0.distcp does not match the checksum" in output, output[-4000:]
    assert f"skipping unreadable checkpoint {previous}: .metadata" in output
    assert f"resumed from {third}" in output
    assert "Traceback" not in output, "the warning alone, no reader tracebacks"
    _same_run(out, uninterrupted)


def test_data_retokenized_with_the_same_lengths_is_refused(tmp_path, chatml_model, data_path, uninterrupted):
    """Same rows, same lengths, other labels (a new template's masks): the content fingerprint tells. The run
    crashed after its second full state (the later ones are gone), then the data was re-tokenized."""
    out = tmp_path / "out"
    shutil.copytree(uninterrupted, out)
    for later in complete_checkpoints(out / "full_state")[1:]:
        shutil.rmtree(later)
    changed = tmp_path / "retokenized.jsonl"
    with data_path.open() as src, changed.open("w") as dst:
        for line in src:
            row = json.loads(line)
            row["labels"] = list(row["input_ids"])  # every token now learned
            dst.write(json.dumps(row) + "\n")
    result = torchrun(_args(chatml_model, changed, out), warm=True)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "written for another model or dataset (data_content_xxh3: checkpoint" in output, output[-4000:]
    _no_worker_traceback(output)


def test_a_checkpoint_older_than_the_content_fingerprint_resumes_with_a_warning(tmp_path, uninterrupted):
    """Decided: accept it (its sample count and lengths still must match), and say what was not compared."""
    from minitrainer.checkpoint.resume_policy import check_resume

    newest = complete_checkpoints(uninterrupted / "full_state")[-1]
    state = json.loads((newest / "trainer_state.json").read_text())
    current = dict(state["fingerprint"])
    old = tmp_path / "samples_96"
    old.mkdir()
    del state["fingerprint"]["data_content_xxh3"]
    (old / "trainer_state.json").write_text(json.dumps(state))
    error, notice = check_resume([old], state["run_params"], allow_change=False, fingerprint=current)
    assert error is None and "predates data_content_xxh3" in notice
    error, _ = check_resume([old], state["run_params"], allow_change=False,
                            fingerprint={**current, "data_lengths_sha1": "other"})
    assert "another model or dataset" in error, "the fields it has are still compared"


# ----------------------------------------------------------------------------
# One writer per folder


def test_a_second_run_on_the_same_output_dir_is_refused_and_a_dead_runs_lock_taken_over(tmp_path, chatml_model,
                                                                                        data_path, caplog):
    out = tmp_path / "out"
    command = _args(chatml_model, data_path, out, "--max-steps", "200")  # the same command, launched twice
    first = _Launch(command, env={"MINI_TRAINER_TEST_STEP_SLEEP": "1"})
    try:
        first.wait_for(lambda: (out / "training_metrics_0.jsonl").is_file(), "the first run's first step")
        second = torchrun(command, timeout=240)
        assert first.proc.poll() is None, "the first run trains on"
    finally:
        first.kill()  # kill -9 of the job: its lock stays behind, stale
    output = second.stdout + second.stderr
    assert second.returncode != 0, "the second run trained beside the first"
    holder = json.loads((out / ".lock").read_text())
    assert (f"--output-dir {out} is in use by another run (pid {holder['pid']} on {socket.gethostname()}"
            in output), output[-4000:]
    _no_worker_traceback(output)
    assert holder["host"] == socket.gethostname() and (out / ".lock").is_file()

    from minitrainer.checkpoint import output_lock
    from minitrainer.common.distributed import pid_alive
    from minitrainer.common.log import logger

    deadline = time.monotonic() + 30
    while pid_alive(holder["pid"]):  # SIGKILL of the group is delivered, not awaited, by killpg
        assert time.monotonic() < deadline, f"rank 0 (pid {holder['pid']}) survived SIGKILL"
        time.sleep(0.1)

    logger.addHandler(caplog.handler)  # the toolkit's logger does not propagate to pytest's
    try:
        assert output_lock.acquire(out) is None, "the dead run's lock is taken over"
    finally:
        logger.removeHandler(caplog.handler)
    assert f"took over the lock {out / '.lock'}" in caplog.text and f"pid {holder['pid']} is not running" in caplog.text
    assert json.loads((out / ".lock").read_text())["pid"] == os.getpid()
    output_lock.release(out)
    assert not (out / ".lock").exists()


@pytest.mark.parametrize("same_job", [True, False], ids=["requeued_job", "other_job"])
def test_a_lock_from_another_host_is_taken_over_only_by_the_same_slurm_job(tmp_path, monkeypatch, same_job):
    """A requeued SLURM job keeps its id and may land on another node: its own dead lock must not block it.
    Another job's lock on another host cannot be checked from here, so it is refused."""
    from minitrainer.checkpoint import output_lock

    holder = {"host": "another-node", "pid": 12345, "started": "earlier", "slurm_job_id": "777"}
    (tmp_path / ".lock").write_text(json.dumps(holder))
    monkeypatch.setenv("SLURM_JOB_ID", "777" if same_job else "778")
    error = output_lock.acquire(tmp_path)
    if same_job:
        assert error is None and json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    else:
        assert "in use by another run (pid 12345 on another-node" in error and "SLURM job 777" in error


# ----------------------------------------------------------------------------
# Broken data files and a lost rank


@pytest.mark.parametrize("fault", ["truncated_line", "empty_file"])
def test_a_broken_data_file_is_one_line_naming_it(tmp_path, chatml_model, data_path, fault):
    """The truncated line in a fresh torchrun (the output a user sees); the empty file's line warm."""
    broken = tmp_path / "broken.jsonl"
    lines = data_path.read_text().splitlines()
    if fault == "truncated_line":
        lines[6] = lines[6][:40]  # a copy cut short mid-line
        broken.write_text("\n".join(lines) + "\n")
        expected = f"{broken}:7: not valid JSON"
    else:
        broken.write_text("")
        expected = f"{broken}: the file is empty"
    if fault == "truncated_line":
        result = torchrun(_args(chatml_model, broken, tmp_path / "out"), timeout=240)
    else:
        result = torchrun(_args(chatml_model, broken, tmp_path / "out"), timeout=240, warm=True)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert f"[rank0] ERROR {expected}" in output, output[-4000:]
    _no_worker_traceback(output)


@pytest.mark.timing
def test_a_rank_killed_by_the_oom_killer_makes_the_survivor_exit_at_once_naming_it(tmp_path, chatml_model,
                                                                                  data_path):
    """The kernel's out-of-memory killer sends SIGKILL to one process: here, rank 1, from outside."""
    out = tmp_path / "out"
    run = _Launch(_args(chatml_model, data_path, out), env={"MINI_TRAINER_TEST_STEP_SLEEP": "1"})
    run.wait_for(lambda: (out / "training_metrics_0.jsonl").is_file(), "step 1")
    [rank_1] = [pid for pid in _children(run.proc.pid) if "RANK=1" in _environ(pid)]
    os.kill(rank_1, signal.SIGKILL)
    began = time.monotonic()
    assert run.exit_within(SECONDS_TO_EXIT) != 0
    took = time.monotonic() - began
    output = run.output
    assert "[rank0] ERROR" in output and f"rank 1 (pid {rank_1} on {socket.gethostname()}) is gone" in output, \
        output[-4000:]
    assert "forcefully exiting" not in output, "torchrun had to SIGKILL the survivor"
    # Was 10 s while a forked loader worker held the killed rank's sockets open until torch's own check.
    assert took < 5, f"the survivor took {took:.1f} s"
    _no_worker_traceback(output, killed_rank=1)
    assert _complete_and_verified(out) in ([], ["samples_24"]), "nothing half-written is kept"


def _environ(pid: int) -> list[str]:
    return (Path("/proc") / str(pid) / "environ").read_bytes().decode(errors="replace").split("\0")
