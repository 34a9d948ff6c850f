"""Temporary output files that name their writer, and the removal of a dead writer's leftovers.

A file is written as ``.NAME.tmp-HOST-PID-START`` beside its final ``NAME`` and renamed when
complete. A writer killed mid-write (SIGKILL, the out-of-memory killer, a node that lost power)
leaves that file behind; the next writer to the same folder removes it when its writer is
provably gone, and never a live writer's:

* same host, and no process ``PID`` runs, or the one that does started at another time than
  ``START`` (the pid was reused by an unrelated process): removed;
* same host, and ``PID`` runs with that start time: kept (a second run writing there now);
* another host (a shared file system): kept, with a warning, since a pid of another machine
  cannot be checked from here; the user deletes it once that run is over.

``START`` is the process's start time in clock ticks since boot (``/proc/PID/stat`` field 22),
exact and cheap; where there is no ``/proc`` it is 0 and only the pid is checked. The older
``.NAME.tmp-PID`` form (before the host was written) is taken as this host's.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from minitrainer.common.distributed import pid_alive
from minitrainer.common.log import logger


def process_start(pid: int) -> int:
    """Start time of process ``pid`` in clock ticks since boot; 0 when unknown (no ``/proc``, gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def temporary_name(path: Path) -> Path:
    """Where this process writes ``path`` before renaming it into place."""
    pid = os.getpid()
    return path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{pid}-{process_start(pid)}")


def _writer(path: Path, name: str) -> tuple[str, int, int] | None:
    """``(host, pid, start)`` of a temporary file of ``name``, or None when ``path`` is not one."""
    prefix = f".{name}.tmp-"
    if not path.name.startswith(prefix):
        return None
    writer = path.name[len(prefix):]
    if writer.isdigit():
        return socket.gethostname(), int(writer), 0
    host, _, rest = writer.rpartition("-")
    host, _, pid = host.rpartition("-")
    if not (host and pid.isdigit() and rest.isdigit()):
        return None
    return host, int(pid), int(rest)


def _alive(pid: int, start: int) -> bool:
    """Whether the writer runs: its pid, started at the same time where both times are known."""
    if not pid_alive(pid):
        return False
    now = process_start(pid)
    return not (start and now) or now == start


def remove_dead_leftovers(paths: tuple[Path, ...]) -> list[Path]:
    """Remove the temporary files of ``paths`` whose writer is gone (see the module docstring).

    Returns:
        The files removed; kept files of other hosts are named in a warning.
    """
    removed, foreign = [], []
    host = socket.gethostname()
    for final in paths:
        if not final.parent.is_dir():
            continue
        for path in final.parent.iterdir():
            writer = _writer(path, final.name)
            if writer is None:
                continue
            if writer[0] != host:
                foreign.append(f"{path} (pid {writer[1]} on {writer[0]})")
            elif not _alive(writer[1], writer[2]):
                path.unlink(missing_ok=True)
                removed.append(path)
    if removed:
        logger.info("removed %d leftover file(s) of dead runs: %s", len(removed), ", ".join(map(str, removed)))
    if foreign:
        logger.warning("kept %s: written by a run on another host, which cannot be checked from here; delete "
                       "them once that run is over", ", ".join(foreign))
    return removed
