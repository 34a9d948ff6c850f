"""``--optimizer adamw`` (the default): ``torch.optim.AdamW``, two fp32 moments (8 bytes per parameter).

On a GPU the fused kernel: one launch for every parameter, and the skip of a non-finite step decided on the device
(``device_skip.py``). CPU keeps torch's default (foreach): its fused kernel rounds differently in the last bit
(seen: 3e-8 after 20 steps).
"""

from __future__ import annotations

import torch

from minitrainer.optim.base import OptimizerChoice, OptimizerSetting


class AdamW(OptimizerChoice):
    name = "adamw"
    state_bytes_per_param = 8.0

    def build(self, param_groups: list[dict], setting: OptimizerSetting) -> torch.optim.Optimizer:
        return torch.optim.AdamW(param_groups, lr=setting.lr, betas=setting.betas, eps=setting.eps,
                                 fused=True if setting.device.type == "cuda" else None)
