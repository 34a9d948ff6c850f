"""Data preparation and loading meet what clusters do, for real (issue 41): a full disk under
``process_data.py``, a ``process_data.py`` killed mid-write and run again, and a training run whose
home directory is read-only.

    .venv/bin/python -m pytest -q tests/test_data_faults.py

A full disk is a small tmpfs and a read-only home a read-only bind mount, both mounted for the
test: where mounting is refused (not root, a container without CAP_SYS_ADMIN) those tests skip and
say so. A kill is SIGKILL; a live second run is a real ``process_data.py`` stopped with SIGSTOP.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures.e2e import ROOT, assert_ok, model_vocab_size, read_metrics, torchrun, write_tokenized_jsonl
from minitrainer.common.leftovers import process_start, remove_dead_leftovers
from tests.test_faults import _no_worker_traceback, small_disk  # noqa: F401  (small_disk: the tmpfs fixture)

CONVERSATION = [{"role": "system", "content": "Answer in full sentences. " * 4},
                {"role": "user", "content": "Describe the weather in a long paragraph, please."},
                {"role": "assistant", "content": "The weather is mild and the sky is clear today. " * 6}]


def _input(path: Path, num_rows: int) -> Path:
    line = json.dumps({"messages": CONVERSATION}) + "\n"
    path.write_text(line * num_rows)
    return path


def _cli_args(input_file: Path, out: Path, model: Path, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "process_data.py"), "--input-file", str(input_file), "--output-dir", str(out),
            "--model-name-or-path", str(model), "--num-printed-samples", "0", *extra]


def _error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-4000:]
    return stderr.strip().splitlines()[-1]


# ----------------------------------------------------------------------------
# process_data.py on a full disk


def test_process_data_on_a_full_disk_says_so_in_one_line_and_leaves_nothing(small_disk, chatml_model, tmp_path):
    """About 1.5 KB of output a row: 3000 rows need ~4.5 MB, the disk holds 1 MB."""
    disk = small_disk(1)
    out = disk / "out"
    input_file = _input(tmp_path / "in.jsonl", 3000)
    result = subprocess.run(_cli_args(input_file, out, chatml_model, "--num-proc", "2"), cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    line = _error_line(result.stderr)
    assert line.startswith(f"process_data.py: error: no space left on device for the output in {out}: "), line
    assert " MB written from the first " in line and " of 3000 input rows" in line and "nothing was kept" in line
    assert sorted(out.iterdir()) == [], "no partial output and no temporary file is left"


# ----------------------------------------------------------------------------
# A run killed mid-write, then run again


def _temporary_files(out: Path) -> set[str]:
    return {path.name for path in out.iterdir() if ".tmp-" in path.name}


def _start_and_catch_writing(args: list[str], out: Path, timeout: float = 240) -> tuple[subprocess.Popen, set[str]]:
    """Start a run and wait until it has written data to its temporary file; returns it and its files."""
    before = _temporary_files(out) if out.exists() else set()
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        mine = _temporary_files(out) - before if out.exists() else set()
        if any(name.startswith(".data.jsonl") and (out / name).stat().st_size > 0 for name in mine):
            return proc, mine
        assert proc.poll() is None, f"the run ended before it was caught writing: {proc.communicate()[1][-3000:]}"
        time.sleep(0.05)
    proc.kill()
    pytest.fail("the run never started writing its data")


def test_rerun_removes_a_killed_runs_leftovers_and_never_a_live_runs(chatml_model, tmp_path):
    input_file = _input(tmp_path / "in.jsonl", 8000)
    out = tmp_path / "out"
    args = _cli_args(input_file, out, chatml_model, "--num-proc", "1", "--chunk-size", "32")

    live, live_files = _start_and_catch_writing(args, out)
    live.send_signal(signal.SIGSTOP)  # alive, mid-write: a second run writing to the folder right now
    killed, killed_files = _start_and_catch_writing(args, out)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    try:
        assert {name.split(".tmp-")[0] for name in killed_files} == {".data.jsonl", ".rejected.jsonl"}
        rerun = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert rerun.returncode == 0, rerun.stderr[-4000:]
        assert "removed 2 leftover file(s) of dead runs" in rerun.stderr, rerun.stderr[-4000:]
        assert _temporary_files(out) == live_files, "the dead run's files are gone, the live run's kept"
        assert len(live_files) == 2
        assert len((out / "data.jsonl").read_text().splitlines()) == 8000
    finally:
        live.send_signal(signal.SIGKILL)
        live.wait()


def test_a_reused_pid_or_another_host_is_no_proof_of_a_dead_or_live_writer(tmp_path, caplog):
    """Unit test of the liveness rule: the pid's start time tells a reused pid, another host's file is kept."""
    final = tmp_path / "data.jsonl"
    me, start, host = os.getpid(), process_start(os.getpid()), socket.gethostname()
    ended = subprocess.Popen(["true"])
    ended.wait()
    names = {
        "mine": f".data.jsonl.tmp-{host}-{me}-{start}",  # this process: alive
        "reused": f".data.jsonl.tmp-{host}-{me}-{start + 1}",  # this pid, started at another time: dead
        "ended": f".data.jsonl.tmp-{host}-{ended.pid}-{start}",
        "older_form": f".data.jsonl.tmp-{ended.pid}",
        "other_host": f".data.jsonl.tmp-other-host-{me}-{start}",
        "unrelated": ".data.jsonl.tmp-notes",
    }
    for name in names.values():
        (tmp_path / name).write_text("x")
    removed = remove_dead_leftovers((final,))
    assert sorted(p.name for p in removed) == sorted(names[key] for key in ("reused", "ended", "older_form"))
    assert {p.name for p in tmp_path.iterdir()} == {names[key] for key in ("mine", "other_host", "unrelated")}
    assert f"pid {me} on other-host" in caplog.text


# ----------------------------------------------------------------------------
# Training with a read-only home directory


@pytest.fixture
def read_only_dir(tmp_path):
    """``make(name)``: an empty folder, bind-mounted read-only over itself (root cannot write it either)."""
    mounted = []

    def make(name: str) -> Path:
        point = tmp_path / name
        point.mkdir()
        if os.geteuid() != 0:
            pytest.skip("a read-only folder that root cannot write is a read-only mount, and mounting needs root")
        for cmd in (["mount", "--bind", str(point), str(point)], ["mount", "-o", "remount,bind,ro", str(point)]):
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                if mounted or cmd[1] != "--bind":
                    subprocess.run(["umount", str(point)], check=False)
                pytest.skip(f"cannot bind-mount a read-only folder here (no CAP_SYS_ADMIN?): {result.stderr.strip()}")
        mounted.append(point)
        return point

    yield make
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


def _train_args(model: Path, data: Path, out: Path) -> list[str]:
    return ["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out),
            "--batch-size", "8", "--max-tokens-per-gpu", "96", "--max-steps", "2", "--num-data-workers", "0",
            "--min-samples-per-checkpoint", "1000"]


def test_training_with_a_read_only_home_caches_the_data_under_the_output(read_only_dir, chatml_model, tmp_path,
                                                                         monkeypatch):
    """No HF_DATASETS_CACHE and a home nobody can write: the converted data goes under the output folder."""
    home = read_only_dir("home")
    for name in ("HF_DATASETS_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    data = write_tokenized_jsonl(tmp_path / "data" / "train.jsonl", num_samples=24,
                                 vocab_size=model_vocab_size(chatml_model), seed=3)
    out = tmp_path / "out"
    result = torchrun(_train_args(chatml_model, data, out), env={"HOME": str(home)})
    assert_ok(result)
    assert f"is not writable" in result.stderr and str(out / ".cache" / "datasets") in result.stderr, \
        result.stderr[-4000:]
    assert len(read_metrics(out)) == 2
    assert not list(home.iterdir())


def test_training_with_a_read_only_datasets_cache_stops_every_rank_in_one_line(read_only_dir, chatml_model,
                                                                                tmp_path):
    """A HF_DATASETS_CACHE the user set is never overridden: a read-only one is named, on every rank, no traceback."""
    cache = read_only_dir("cache")
    data = write_tokenized_jsonl(tmp_path / "data" / "train.jsonl", num_samples=24,
                                 vocab_size=model_vocab_size(chatml_model), seed=3)
    result = torchrun(_train_args(chatml_model, data, tmp_path / "out"), env={"HF_DATASETS_CACHE": str(cache)})
    assert result.returncode != 0
    _no_worker_traceback(result.stderr)
    assert (f"[rank0] ERROR HF_DATASETS_CACHE={cache} cannot be written (Read-only file system): point it at a "
            "writable folder") in result.stderr, result.stderr[-4000:]
    assert "Connection closed by peer" not in result.stderr
