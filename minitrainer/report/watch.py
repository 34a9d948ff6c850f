"""A launched run's progress, read by the launching process from the files the run writes anyway.

``api.run_training`` polls a ``RunWatcher`` while torchrun runs and hands each ``RunEvent`` to the caller:
rank 0's metrics lines (``training_metrics_0.jsonl``: one per step, one per validation) and each Hugging Face
export as its folder appears (``hf_format/samples_N`` is renamed into place whole). Nothing crosses into the
workers, so a listener that is slow or fails cannot touch training, and the events of a run are those its
metrics file records, whatever launched it. A listener that raises is said once and then counted
(``ListenerFailures``): one that fails on every step must not bury the run's own lines.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from minitrainer.checkpoint.full_state import complete_checkpoints
from minitrainer.common.log import logger


@dataclass(frozen=True)
class RunEvent:
    """``step``: a step's metrics line; ``validation``: a validation's line; ``export``: a new Hugging Face
    export (``path``), with the line of the step that wrote it as ``record``."""

    kind: Literal["step", "validation", "export"]
    record: dict
    path: Path | None = None


class RunWatcher:
    """New events of the run writing into ``output_dir`` since ``started`` (a ``time.time()``).

    Lines of an earlier attempt are not events: a resumed run cuts its metrics file back to the resumed step
    and appends, and every line carries the time it was written. Exports already there are not either.
    """

    def __init__(self, output_dir: str | Path, *, started: float):
        self.output_dir = Path(output_dir)
        self.metrics_path = self.output_dir / "training_metrics_0.jsonl"
        self._started = started
        self._offset = 0
        self._tail = b""
        self._seen: set[tuple[str, int]] = set()
        self._exports = set(complete_checkpoints(self.output_dir / "hf_format"))
        self._last_step: dict = {}
        self._step_at_samples: dict[int, dict] = {}

    def poll(self) -> list[RunEvent]:
        events = [self._event(record) for record in self._new_records()]
        for folder in complete_checkpoints(self.output_dir / "hf_format"):  # oldest first
            if folder not in self._exports:
                self._exports.add(folder)
                samples = int(folder.name.removeprefix("samples_"))
                events.append(RunEvent("export", self._step_at_samples.get(samples, self._last_step), folder))
        return [event for event in events if event is not None]

    def _event(self, record: dict) -> RunEvent | None:
        kind = "validation" if "val_loss" in record else "step"
        key = (kind, int(record.get("step", 0)))
        if key in self._seen or record.get("timestamp", 0.0) < self._started:
            return None
        self._seen.add(key)
        if kind == "step":
            self._last_step = self._step_at_samples[int(record.get("samples_seen", -1))] = record
        return RunEvent(kind, record)

    def _new_records(self) -> list[dict]:
        try:
            with self.metrics_path.open("rb") as f:
                # Cut back by a resume (and perhaps grown past where this read up to since): the last line
                # read is no longer where it was. Read it all again; the times and steps tell what is new.
                f.seek(max(self._offset - len(self._tail), 0))
                if f.read(len(self._tail)) != self._tail:
                    self._offset = 0
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        whole = chunk[:chunk.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        self._offset += len(whole)
        if whole:
            self._tail = whole[whole.rfind(b"\n", 0, len(whole) - 1) + 1:]
        records = []
        for line in whole.splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
        return records



class Lifecycle:
    """A run's events as the lifecycle hooks trainers' callbacks know (transformers', training_hub's, mini_trainer
    0.9's), in order: ``on_train_begin`` at the first event; per step ``on_epoch_begin`` when its epoch is new
    (after ``on_epoch_end`` of the one before), ``on_step_end`` and ``on_log`` (every ``logging_steps``);
    ``on_evaluate`` per validation, ``on_save`` per export; ``finish()``: ``on_epoch_end``, ``on_train_end``.

    ``fire(hook, event, last_step)`` is called for each, ``last_step`` being the newest step event (None
    before the first): the caller turns them into its own context objects.
    """

    def __init__(self, fire: Callable[[str, RunEvent, RunEvent | None], None], *, logging_steps: int = 1):
        self._fire, self.logging_steps = fire, logging_steps
        self._began = False
        self._epoch: int | None = None
        self._last: RunEvent | None = None

    def __call__(self, event: RunEvent) -> None:
        if not self._began:
            self._began = True
            self._fire("on_train_begin", event, self._last)
        if event.kind == "step":
            epoch = int(event.record.get("epoch", 0))
            if epoch != self._epoch:
                if self._last is not None:
                    self._fire("on_epoch_end", self._last, self._last)
                self._epoch = epoch
                self._fire("on_epoch_begin", event, self._last)
            self._last = event
            self._fire("on_step_end", event, event)
            if int(event.record.get("step", 0)) % self.logging_steps == 0:
                self._fire("on_log", event, event)
        else:
            self._fire("on_evaluate" if event.kind == "validation" else "on_save", event, self._last)

    def finish(self) -> None:
        """The run finished: its last epoch and the training end."""
        if self._last is not None:
            self._fire("on_epoch_end", self._last, self._last)
            self._fire("on_train_end", self._last, self._last)


class ListenerFailures:
    """Runs the caller's listeners (``on_event``, trainers' callback hooks) so that one failing never stops the
    run and is said once: its first failure logs one warning with its error, later ones are only counted, and
    ``report()`` (once, however the run ended) logs one line per listener that failed, with its count.

    ``per`` names what a call is in those lines (``event``, ``call``).
    """

    def __init__(self, *, per: str = "call"):
        self.per = per
        self._calls: dict[str, int] = {}
        self._failures: dict[str, int] = {}
        self._first: dict[str, str] = {}
        self._reported = False

    def call(self, name: str, fn: Callable[..., object], *args: object, at: str | None = None) -> None:
        """``fn(*args)``; a failure is logged (the first, naming ``name`` and where, ``at``) or counted.

        Args:
            name: the listener as the user knows it (``training_hub callback Broken.on_step_end``).
            fn: the listener.
            args: what it is called with.
            at: where the run was (``step 3``), said with its first failure.
        """
        self._calls[name] = self._calls.get(name, 0) + 1
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001 - a listener's failure is its own, never the run's
            self._failures[name] = self._failures.get(name, 0) + 1
            if name in self._first:
                return
            where = f" at {at}" if at else ""
            self._first[name] = f"first{where}: {type(err).__name__}: {err}"
            logger.warning("%s failed%s (%s: %s); training goes on (its further failures are counted, said at "
                           "the end)", name, where, type(err).__name__, err)

    def report(self) -> None:
        """One line per listener that failed: how often, of how many calls, and its first error. Once."""
        if self._reported:
            return
        self._reported = True
        for name, num_failed in self._failures.items():
            logger.warning("%s failed on %d of %d %ss (%s)", name, num_failed, self._calls[name], self.per,
                           self._first[name])
