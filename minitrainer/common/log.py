"""The toolkit's logger: one format, rank 0 at the chosen level and the other ranks at warnings, and the
one line a failure ends with (the first ERROR a process logs)."""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger("mini_trainer")
PROGRESS_MODES = ("auto", "bar", "lines", "none")
"""``--progress``: how the loop shows its progress on stderr (``minitrainer/report/progress.py``)."""


def setup_logging(level: str = "INFO", *, rank: int = 0) -> None:
    """Configure the toolkit's logger; ranks other than 0 only show warnings and above.

    The first ERROR line is also kept (``_ExitLine``): it is the line torchrun's failure report shows.
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown logging level {level!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank{rank}] %(levelname)s %(message)s", "%H:%M:%S"))
    logger.handlers[:] = [handler, _exit_line]
    # torchao, imported by transformers (its quantizers) and peft whenever it is installed, QLoRA or not,
    # warns on every rank: it cannot load its CUDA-only kernels into a CPU build of torch, and torch 2.13
    # deprecates the pytree registration torchao 0.18 (the newest release) does at import. The NF4 type
    # QLoRA uses is plain PyTorch and needs neither. Nothing a user can act on; errors still show.
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logger.setLevel(numeric if rank == 0 else max(numeric, logging.WARNING))
    logger.propagate = False


class _ExitLine(logging.Handler):
    """Keeps the first ERROR line this process logs: the one line a failure ends with."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.line: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.line is None:
            self.line = record.getMessage()


_exit_line = _ExitLine()


def note_exit_line(line: str, *, override: bool = False) -> None:
    """Make ``line`` what this process's exit reports, unless an earlier error line already is
    (a rank that did not log the line itself: ``fail_together`` logs on rank 0 only); ``override``:
    in any case (a preemption whose save is done ends the run, whatever was logged before)."""
    if _exit_line.line is None or override:
        _exit_line.line = line


def log_rank_0(msg: str, *args: Any, level: int = logging.INFO) -> None:
    """Log on rank 0 only (other ranks' logger level already filters INFO)."""
    if int(os.environ.get("RANK", "0")) == 0:
        logger.log(level, msg, *args)


def exit_line() -> str | None:
    """The line this process's failure ends with (the first ERROR it logged), if any."""
    return _exit_line.line
