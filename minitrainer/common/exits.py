"""How a process of ours ends: the exit statuses, the one line left in torchrun's error file, and
``<output-dir>/run_status.json``."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from minitrainer.common.log import exit_line, logger

EXIT_FINISHED = 0
EXIT_FAILED = 1
EXIT_USAGE = 2       # argparse's status for bad flags
EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: stopped by a signal with the state saved; rerunning resumes
EXIT_INTERRUPTED = 130  # the shell's status for SIGINT: a signal before the loop, where there is nothing to save
"""The exit statuses of ``train.py`` (docs/training.md, "Exit statuses")."""

STARTUP_PHASE = "during start-up"
_phase = [STARTUP_PHASE]


@contextmanager
def stopping_phase(label: str | None) -> Iterator[None]:
    """What a stop before the first step says it interrupted while inside (``"during the reference pass"``);
    None: the phase around it."""
    if label is None:
        yield
        return
    _phase.append(label)
    try:
        yield
    finally:
        _phase.pop()


def stopped_line(signal_name: str) -> str:
    """The line of a run stopped by a signal before its first step: where, and that nothing is lost."""
    return (f"stopped by {signal_name} {_phase[-1]}, before the first step: nothing to save; the same command "
            "starts again")


def exit_process(code: int = 0) -> None:
    """End this process now with ``code``, streams flushed, skipping the interpreter's teardown.

    A non-zero ``code`` leaves this process's one line (the first ERROR it logged, or what
    ``note_exit_line`` set) in torchrun's error file, so torchrun's failure report names that
    line as the root cause rather than "<N/A>".

    Both ways out of a command-line run take it: a run that finished, and a job already broken (a rank
    died). After ``destroy_process_group`` the gloo/NCCL groups stay referenced from torch's native DTensor
    dispatch caches (through the device mesh), so they are destroyed only during interpreter teardown,
    with their worker threads still running; a 2-rank CPU run was seen to lose a rank there to SIGABRT
    ("terminate called without an active exception") after it had saved and logged everything.
    Every file is closed by then; the streams are flushed here.
    """
    if code and (line := exit_line()) is not None:
        write_error_file(line)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


RUN_STATUS_FILE = "run_status.json"
_STATUS_NAMES = {EXIT_FINISHED: "finished", EXIT_PREEMPTED: "preempted", EXIT_INTERRUPTED: "interrupted"}


def write_run_status(output_dir: str | os.PathLike, code: int | None, line: str | None = None) -> None:
    """``<output-dir>/run_status.json``: how the run that holds the folder ended (``code`` None: it is running),
    for scripts that launch it through torchrun, whose own status is 0 or 1 only. Rank 0 writes it;
    a report, so a failed write is one warning."""
    import json
    import time

    status = "running" if code is None else _STATUS_NAMES.get(code, "failed")
    record = {"status": status, "exit_code": code, "message": line, "time": time.time()}
    path = os.path.join(output_dir, RUN_STATUS_FILE)
    try:
        with open(path + ".tmp", "w") as f:
            f.write(json.dumps(record) + "\n")
        os.replace(path + ".tmp", path)
    except OSError as err:
        logger.warning("%s not written (%s)", path, err.strerror or err)


def write_error_file(line: str) -> None:
    """Write ``line`` where torchrun reads a rank's failure (``TORCHELASTIC_ERROR_FILE``, set for each rank),
    in the layout of torch's own ``ErrorHandler`` without its ``py_callstack``: the report then shows the
    line itself. Nothing without torchrun."""
    import json
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    # Whole or absent, never empty: torchrun reads the file of every rank that ended, one it is still killing
    # included, and an empty one ends torchrun itself in a JSONDecodeError traceback (seen under load).
    try:
        with open(path + ".tmp", "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}, f)
        os.replace(path + ".tmp", path)
    except OSError as err:  # the report falls back to "<N/A>"; the line is in the log already
        logger.warning("could not write torchrun's error file %s (%s)", path, err.strerror or err)
