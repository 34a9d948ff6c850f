"""Other tools' settings as ours: the rules a translation table is written in, and the reasons said to more
than one tool's users, written once.

A table maps each foreign setting to a ``Rule``: ``(value, all settings, translation) -> None`` having written
the value where it goes, or the one-line reason it is refused. ``compat/mini_trainer.py`` (mini_trainer 0.9's
``TrainingArgs``) and ``integrations/hub_parameters.py`` (training_hub's parameters) are such tables;
``common/foreign_names.py`` (the CLI's and config files' names) says the same reasons.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

BF16 = "GPU runs compute in bfloat16 over float32 weights (CPU runs in float32)"
FLOAT32_STATE = "weights and optimizer stay float32; " + BF16
NO_FP16 = "float16 is not offered; " + BF16
NO_TF32 = "GPU runs compute in bfloat16, where TF32 does not apply"
FINAL_EXPORT = "the final export is always written"
NO_TOKEN_STOP = "a run stops after steps, samples or epochs, not tokens"
PACKED = "every batch is packed, padding-free, with the exact per-token loss"
MIN_LR_ONLY = "only min_lr_rate (our min_lr_ratio) is taken; name the schedule's shape with lr_scheduler"
IN_STEP = "would have to run inside the step on the workers"
"""Of a callback's hooks that a launching process cannot run (after the hooks' names)."""


@dataclass
class Translation:
    """Where translated settings go: our ``TrainConfig`` fields, ``TorchrunArgs`` fields, the workers'
    environment, the launcher's own settings; and one line per setting refused."""

    train: dict[str, Any] = field(default_factory=dict)
    torchrun: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    launcher: dict[str, Any] = field(default_factory=dict)
    refusals: list[str] = field(default_factory=list)


Rule = Callable[[Any, dict, Translation], "str | None"]


def to(name: str, convert: Callable[[Any], Any] = lambda value: value) -> Rule:
    """Our ``TrainConfig`` field ``name``, the value converted."""
    def rule(value, params, out):
        out.train[name] = convert(value)
    rule.target = name
    return rule


def accepted_when(ok: Callable[[Any], bool], reason: str, then: Rule | None = None) -> Rule:
    """Refused with ``reason`` unless ``ok(value)``; then ``then``'s, or nothing to set."""
    def rule(value, params, out):
        if not ok(value):
            return reason
        return then(value, params, out) if then is not None else None
    rule.target = getattr(then, "target", None)
    return rule


def refused(reason: str) -> Rule:
    return accepted_when(lambda value: False, reason)


def read_by_another(value, params, out) -> None:
    """A setting another rule of the table reads (a stop's count, read by its mode)."""
