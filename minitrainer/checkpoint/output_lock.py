"""One writer per output folder: ``<output-dir>/.lock`` names the run that trains into it.

Rank 0 takes the lock at start-up, before anything is written, and removes it
when the run ends (however it ends, short of a kill). The file holds the
holder's host, pid, start time and SLURM job id. A second run on the same
folder (a manual rerun beside a requeued job) refuses in one line naming the
holder, instead of interleaving steps in one metrics file and racing on
checkpoints.

A lock left by a run that is gone is taken over, with a warning:

* same host, and its pid is no longer running (a kill, a crash, the node's
  out-of-memory killer; torchrun's ``--max-restarts`` restart);
* another host, and the lock carries this job's own ``SLURM_JOB_ID``: a
  requeued job keeps its id, and SLURM never runs one job twice at a time, so
  the holder is this job's previous, dead, incarnation (this is what lets a
  requeue land on another node).

Anything else on another host is refused: the pid of another machine cannot be
checked from here. If that run is really gone, delete the ``.lock`` the message
names. There is no heartbeat: the rule is the same after a minute or a week.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from minitrainer.common.distributed import pid_alive
from minitrainer.common.log import logger

LOCK_NAME = ".lock"


def acquire(output_dir: str | Path) -> str | None:
    """Take the folder's lock for this process; returns an error line when another run holds it."""
    path = Path(output_dir) / LOCK_NAME
    for _ in range(3):  # each pass either creates the lock, refuses, or saw it change under it
        if _create(path):
            return None
        try:
            text = path.read_text()
        except FileNotFoundError:
            continue  # released between the two calls: try again
        holder = _parse(text)
        stale = _stale_reason(holder, path)
        if stale is None:
            return (f"--output-dir {output_dir} is in use by another run ({_describe(holder)}; lock {path}): "
                    "wait for it to finish or use another --output-dir; if that run is gone, delete the lock")
        if _take_over(path, text):
            logger.warning("took over the lock %s of a run that is gone (%s): %s", path, _describe(holder), stale)
            return None
    return f"--output-dir {output_dir}: its lock {path} keeps changing (another run is starting there)"


def release(output_dir: str | Path) -> bool:
    """Remove the lock if this process holds it (a refused run leaves the holder's lock alone);
    returns whether it did."""
    path = Path(output_dir) / LOCK_NAME
    try:
        holder = _parse(path.read_text())
    except OSError:
        return False
    if holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid():
        path.unlink(missing_ok=True)
        return True
    return False


def _create(path: Path) -> bool:
    record = {"host": socket.gethostname(), "pid": os.getpid(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "slurm_job_id": os.environ.get("SLURM_JOB_ID")}
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)  # atomic: one creator wins
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(record) + "\n")
    return True


def _parse(text: str) -> dict:
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return holder if isinstance(holder, dict) else {}


def _stale_reason(holder: dict, path: Path) -> str | None:
    """Why the holder is known to be gone, or None when it may still run."""
    host, pid = holder.get("host"), holder.get("pid")
    if not isinstance(pid, int) or host is None:
        # Half-written by a starter killed between create and write, or not ours: only an old one is stale.
        age = time.time() - path.stat().st_mtime
        return f"unreadable lock, {age:.0f} s old" if age > 60 else None
    if host == socket.gethostname():
        if pid == os.getpid():
            return "held by this process"
        return None if pid_alive(pid) else f"pid {pid} is not running on {host}"
    job = os.environ.get("SLURM_JOB_ID")
    if job is not None and holder.get("slurm_job_id") == job:
        return f"held by SLURM job {job} on {host}, which is this job requeued"
    return None


def _take_over(path: Path, stale_text: str) -> bool:
    """Replace the stale lock whose content is ``stale_text``; False when another starter got there first."""
    aside = path.with_name(f"{LOCK_NAME}.stale.{socket.gethostname()}.{os.getpid()}")
    try:
        os.rename(path, aside)  # atomic: of two starters taking over, one moves the stale lock
    except FileNotFoundError:
        return False
    if aside.read_text() != stale_text:  # what was moved is a fresh lock another starter just made: put it back
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
        aside.unlink()
        return False
    aside.unlink()
    return _create(path)


def _describe(holder: dict) -> str:
    if not holder:
        return "holder unreadable"
    job = f", SLURM job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('started')}{job}"
