"""``--optimizer sgd``: ``torch.optim.SGD`` with momentum (trainit's SGDM): one fp32 momentum buffer per parameter
(4 bytes; none at momentum 0), elementwise, so it steps the FSDP2 shards as they are.

Its momentum defaults to 0.9, not torch's 0: plain SGD is ``--optimizer-args '{"momentum": 0}'``. Weight decay is
torch's coupled L2 (added to the gradient), on the groups the method decays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minitrainer.optim.base import OptimizerChoice, OptimizerSetting


@dataclass(frozen=True)
class SGDArgs:
    momentum: float = 0.9
    dampening: float = 0.0
    nesterov: bool = False

    def __post_init__(self):
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if not 0 <= self.dampening <= 1:
            raise ValueError(f"dampening must be in [0, 1], got {self.dampening}")
        if self.nesterov and (self.momentum == 0 or self.dampening != 0):
            raise ValueError("nesterov needs momentum > 0 and dampening 0")


class SGD(OptimizerChoice):
    name = "sgd"
    Args = SGDArgs
    state_bytes_per_param = 4.0
    uses_adam_flags = False

    def build(self, param_groups: list[dict], setting: OptimizerSetting) -> torch.optim.Optimizer:
        args = self.args
        return torch.optim.SGD(param_groups, lr=setting.lr, momentum=args.momentum, dampening=args.dampening,
                               nesterov=args.nesterov)
