"""A rank's data-loader workers die with it, however it dies: a real SIGKILL, as the out-of-memory killer sends.

    .venv/bin/python -m pytest -q tests/test_worker_death.py

Orphaned workers (parent pid 1) lived on for over 10 minutes after their rank was killed, holding its
sockets open (issue 54). Each test starts a real process that builds a loader with two workers, from the
main thread or from a thread that has ended since (the kernel's parent-death signal follows the forking
thread, so that case takes the parent-watch fallback), kills it with SIGKILL and watches the workers go.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures.e2e import ROOT, write_tokenized_jsonl

CHILD = """
import sys, threading, time
from minitrainer.data.sampler import load_tokenized_dataset, make_batch_loader

dataset = load_tokenized_dataset(sys.argv[1], cache_dir=sys.argv[2])
loaders = []

def build():
    loaders.append(make_batch_loader(dataset, batch_size=4, max_tokens_per_rank=64, rank=0, world_size=1, seed=0,
                                     num_workers=2))
    next(loaders[0])

if sys.argv[3] == "thread":
    thread = threading.Thread(target=build)
    thread.start()
    thread.join()
else:
    build()
for _ in range(4):
    next(loaders[0])  # the workers still serve once the thread that forked them has ended
print("ready", flush=True)
time.sleep(600)
"""


def _children(pid: int) -> list[int]:
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()]


def _alive(pid: int) -> bool:
    """Running, not a zombie: an orphan's corpse waits for a reaper (pid 1 in a container may never reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.timing
@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
@pytest.mark.parametrize("built_on", ["main", "thread"])
def test_workers_die_within_seconds_of_their_rank(tmp_path, built_on):
    data = write_tokenized_jsonl(tmp_path / "train.jsonl", num_samples=32, vocab_size=100)
    rank = subprocess.Popen([sys.executable, "-c", CHILD, str(data), str(tmp_path / "cache"), built_on], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    workers: list[int] = []
    try:
        line = rank.stdout.readline()
        assert line == "ready\n", line + rank.stderr.read() if rank.poll() is not None else line
        workers = _children(rank.pid)
        assert len(workers) == 2 and all(_alive(pid) for pid in workers), workers
        rank.send_signal(signal.SIGKILL)
        rank.wait(timeout=30)
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = [pid for pid in workers if _alive(pid)]
        assert not survivors, f"workers {survivors} outlived their rank"
    finally:
        rank.kill()
        for pid in filter(_alive, workers):  # a failed test leaves no orphan behind
            os.kill(pid, signal.SIGKILL)
