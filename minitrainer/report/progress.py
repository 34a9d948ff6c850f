"""The training loop's progress on rank 0, in the form that suits where stderr goes (``--progress``).

``bar``: a tqdm bar, redrawn in place with carriage returns: for a terminal. ``lines``: one plain log line
at the first step, every ``LINE_EVERY_SECONDS``, at each tenth of a known total and at the last step: for a
file, SLURM's output or a pipe, where redrawn bars glue into one line of thousands of characters.
``none``: nothing (the metrics jsonl still has every step). ``auto``: ``bar`` when stderr is a terminal,
else ``lines``.

Both show the objective's loss, the fields it names in ``console_metrics`` (``objectives/base.py``) and the
units seen, in the objective's unit::

    step 30/100 (30%): loss 2.1234, 5120 tokens/s, samples 3840, elapsed 1m05s, eta 2m31s
    step 2/20 (10%): loss 0.5197, acc 0.78, margin 0.473, 3975 tokens/s, pairs 64, elapsed 8s, eta 1m13s
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

from tqdm import tqdm

from minitrainer.common.log import PROGRESS_MODES, logger

LINE_EVERY_SECONDS = 30.0

CONSOLE_NAMES = {"rewards/accuracies": ("acc", ".2f"), "rewards/margins": ("margin", ".3f"), "kl": ("kl", ".4f"),
                 "rewards/chosen": ("chosen", ".3f"), "rewards/rejected": ("rejected", ".3f")}
"""A metrics field's short name and format on the console; any other field shows as itself, to 4 digits."""


def console_fields(metrics: dict[str, float | None]) -> list[tuple[str, str]]:
    """``(short name, formatted value)`` of each field, in order; a value that is missing or null is ``n/a``
    (a validation pass over no pairs)."""
    fields = []
    for name, value in metrics.items():
        short, spec = CONSOLE_NAMES.get(name, (name, ".4g"))
        fields.append((short, "n/a" if value is None else format(value, spec)))
    return fields


def resolve_progress(mode: str, stream: TextIO | None = None) -> str:
    """``auto`` becomes ``bar`` on a terminal and ``lines`` otherwise; the other modes stay."""
    if mode != "auto":
        return mode
    stream = sys.stderr if stream is None else stream
    return "bar" if stream.isatty() else "lines"


def announce_progress(mode: str, resolved: str) -> None:
    """Say the resolved mode once; unless it is ``bar``, turn off the libraries' own bars too (transformers'
    weight loading, datasets' jsonl conversion, hub downloads): each redraws itself with \r as tqdm does."""
    why = "" if mode != "auto" else " (stderr is a terminal)" if resolved == "bar" else " (stderr is not a terminal)"
    logger.info("progress: %s%s", resolved, why)
    if resolved == "bar":
        return
    import datasets
    import huggingface_hub.utils
    import transformers.utils.logging

    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    huggingface_hub.utils.disable_progress_bars()


def format_duration(seconds: float) -> str:
    """``1h02m``, ``3m05s``, ``42s``."""
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class Progress:
    """Reports each optimizer step in the resolved ``--progress`` mode; silent on other ranks.

    Args:
        mode: ``bar``, ``lines`` or ``none`` (``resolve_progress`` turns ``auto`` into one of them).
        total: the run's optimizer steps, or None for infinite sampling.
        initial: the step a resumed run starts from.
        enabled: False on every rank but 0.
        clock: seconds, ``time.monotonic`` unless a test passes its own.
    """

    def __init__(self, mode: str, *, total: int | None, initial: int = 0, enabled: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        assert mode in PROGRESS_MODES[1:], mode
        self.mode = mode if enabled else "none"
        self.total, self.initial, self.clock = total, initial, clock
        self.started = self.last_line = clock()
        self.bar = (tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True)
                    if self.mode == "bar" else None)

    def update(self, *, step: int, loss: float, tokens_per_second: float, samples: int, unit: str = "samples",
               metrics: dict[str, float | None] | None = None) -> None:
        """Step ``step`` (1-based, counted over the whole run) finished with this loss and speed.

        Args:
            samples: the units seen so far (the stream position), counted in ``unit``.
            unit: the objective's unit: ``samples``, or ``pairs`` for a preference objective.
            metrics: the objective's ``console_metrics`` fields of the step's metrics line, in order.
        """
        metrics = metrics or {}
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix({"loss": f"{loss:.4f}", **dict(console_fields(metrics)),
                                  "tok_s": f"{tokens_per_second:.0f}", unit: samples})
        elif self.mode == "lines" and self._line_due(step):
            self.last_line = self.clock()
            logger.info("%s", self.line(step=step, loss=loss, tokens_per_second=tokens_per_second, samples=samples,
                                        unit=unit, metrics=metrics))

    def line(self, *, step: int, loss: float, tokens_per_second: float, samples: int, unit: str = "samples",
             metrics: dict[str, float | None] | None = None) -> str:
        """``step 30/100 (30%): loss 2.1234, 5120 tokens/s, samples 3840, elapsed 1m05s, eta 2m31s``; a
        preference objective's: ``step 3/10 (30%): loss 0.6812, acc 0.62, margin 0.031, 5120 tokens/s, pairs 96,
        ...``."""
        elapsed = self.clock() - self.started
        where = f"step {step}" if self.total is None else f"step {step}/{self.total} ({step / self.total:.0%})"
        shown = "".join(f", {name} {value}" for name, value in console_fields(metrics or {}))
        text = f"{where}: loss {loss:.4f}{shown}, {tokens_per_second:.0f} tokens/s, {unit} {samples}, " \
               f"elapsed {format_duration(elapsed)}"
        done = step - self.initial
        if self.total is not None and done > 0:
            text += f", eta {format_duration(elapsed / done * (self.total - step))}"
        return text

    def _line_due(self, step: int) -> bool:
        if step == self.initial + 1 or self.clock() - self.last_line >= LINE_EVERY_SECONDS:
            return True
        if self.total is None:
            return False
        # Each tenth of the run (integer arithmetic: no float rounding at the boundaries), and the last step.
        return step >= self.total or step * 10 // self.total > (step - 1) * 10 // self.total

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
