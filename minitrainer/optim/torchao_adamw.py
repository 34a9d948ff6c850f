"""``--optimizer adamw_8bit`` and ``adamw_4bit``: torchao's block-wise quantized AdamW moments, as TRL and axolotl
users pick ``adamw_8bit`` (and ``adamw_torch_4bit``).

| name         | moments                                           | state bytes per parameter |
|--------------|---------------------------------------------------|---------------------------|
| `adamw_8bit` | 8-bit codes, an fp32 scale per 256 (dynamic tree)  | 2 + 8/256 = ~2.03         |
| `adamw_4bit` | 4-bit codes, an fp32 scale per 128                 | 1 + 8/128 = ~1.06         |

Tensors under 4096 elements keep fp32 moments. The quantized states are DTensor subclasses sharded like their
parameters, saved and restored by the full state like AdamW's.
"""

from __future__ import annotations

import logging

import torch
import torch._functorch.config

from minitrainer.common.log import log_rank_0
from minitrainer.optim.base import OptimizerChoice, OptimizerSetting


class _TorchaoAdamW(OptimizerChoice):
    class_name: str

    def build(self, param_groups: list[dict], setting: OptimizerSetting) -> torch.optim.Optimizer:
        try:
            import torchao.optim
        except ImportError as err:
            raise ImportError(f"--optimizer {self.name} needs torchao: pip install torchao") from err
        # torch 2.13's AOT autograd cache keys torchao's state subclasses without telling 8-bit from 4-bit
        # (they lack ``_stable_hash_for_caching``), so a machine that once compiled one update ran the other's
        # kernel on these states and failed ("wrong number of dimensions"), even in a fresh process.
        torch._functorch.config.enable_autograd_cache = False
        if setting.device.type == "cpu":
            log_rank_0(f"--optimizer {self.name} on CPU: each parameter shape compiles its update once (inductor); "
                       "the first step is slow", level=logging.INFO)
        return getattr(torchao.optim, self.class_name)(param_groups, lr=setting.lr, betas=setting.betas,
                                                       eps=setting.eps)


class AdamW8bit(_TorchaoAdamW):
    name = "adamw_8bit"
    class_name = "AdamW8bit"
    state_bytes_per_param = 2.0 + 2 * 4 / 256


class AdamW4bit(_TorchaoAdamW):
    name = "adamw_4bit"
    class_name = "AdamW4bit"
    state_bytes_per_param = 1.0 + 2 * 4 / 128
