"""The interface of an optimizer choice (``--optimizer``): one module per optimizer under ``optim/``, registered by
name in ``registry.py``, so the loop and the checkpoint code name none.

    hook                      called by                 answers
    Args                      --optimizer-args          the optimizer's own settings, with their defaults
    build(groups, setting)    setup_run                 a torch.optim.Optimizer over the method's groups
    state_bytes_per_param     the memory plan           bytes of state per trainable parameter
    planned_state_bytes       the memory plan           the same for this model, where parts keep different states
    method_error(method)      start-up                  a refusal where the method and optimizer cannot combine
    describe(optimizer)       start-up                  one line on how it split the parameters, or None

Every optimizer built here steps the FSDP2 shards (``Shard(0)`` DTensors) in place and keeps its states in
``optimizer.state`` sharded like their parameters (or, where a state is whole, the same on every rank), so the full
state (``checkpoint/full_state.py``: DCP's ``get_state_dict``/``set_state_dict``) saves and restores it and a resume
is exact. A group keeps the ``weight_decay`` the method gave it; the learning-rate schedule scales every group's
``lr``.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from minitrainer.common.config_files import WRONG, check_value, describe_type


@dataclass(frozen=True)
class OptimizerSetting:
    """What every optimizer is built from besides its own ``Args``: the run's flags and where the model lives."""

    lr: float
    betas: tuple[float, float]
    eps: float
    device: torch.device
    model: nn.Module | None = None
    """The Hugging Face model (``get_input_embeddings``/``get_output_embeddings``), for optimizers that split
    parameters by their role."""


@dataclass(frozen=True)
class NoArgs:
    """An optimizer with no settings of its own beyond the AdamW flags."""


class OptimizerChoice:
    """One ``--optimizer``: its settings (``Args``, from ``--optimizer-args``) and how it builds."""

    name: ClassVar[str]
    Args: ClassVar[type] = NoArgs
    state_bytes_per_param: ClassVar[float] = 8.0
    uses_adam_flags: ClassVar[bool] = True
    """Whether ``--adam-betas``/``--adam-eps`` reach it (start-up warns when they are set and would not)."""

    def __init__(self, args: dict[str, Any] | None = None):
        self.args = parse_args(self.Args, args or {}, f"--optimizer {self.name}")

    def build(self, param_groups: list[dict], setting: OptimizerSetting) -> torch.optim.Optimizer:
        raise NotImplementedError

    def planned_state_bytes(self, model: nn.Module) -> float:
        """Bytes of state per trainable parameter of ``model`` that the memory plan holds aside: the one
        number, unless an optimizer keeps different states for different parameters."""
        return self.state_bytes_per_param

    def method_error(self, method) -> str | None:
        """A one-line refusal when this optimizer cannot train with ``method`` (a ``FineTuningMethod``)."""
        return None

    def describe(self, optimizer: torch.optim.Optimizer) -> str | None:
        """A start-up line about what the built optimizer does with which parameters."""
        return None


def parse_args(args_cls: type, values: dict[str, Any], label: str) -> Any:
    """``args_cls(**values)`` with each key and value checked: ``ValueError`` in one line naming every problem."""
    fields = {field.name: field for field in dataclasses.fields(args_cls)}
    hints = typing.get_type_hints(args_cls)
    problems = []
    for key in values:
        if key not in fields:
            known = ", ".join(fields) or "none"
            problems.append(f"{key!r} is not one of its settings ({known})")
    if not problems:
        for key, value in values.items():
            checked = check_value(value, hints[key])
            if checked is WRONG:
                problems.append(f"{key} must be {describe_type(hints[key])}, got {value!r}")
            else:
                values = {**values, key: checked}
    if problems:
        raise ValueError(f"--optimizer-args for {label}: " + "; ".join(problems))
    try:
        return args_cls(**values)
    except ValueError as err:
        raise ValueError(f"--optimizer-args for {label}: {err}") from None
