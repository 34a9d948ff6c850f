"""``--optimizer``: which optimizer updates the trainable parameters, apart from the fine-tuning method.

| name         | states per trainable parameter                | implementation |
|--------------|-----------------------------------------------|----------------|
| `adamw`      | two fp32 moments: 8 bytes                     | `torch.optim.AdamW`, fused kernels on a GPU (one launch for every parameter, and the skip of a non-finite step decided on the device); `foreach` on CPU, numerically as before |
| `adamw_8bit` | two 8-bit moments with an fp32 scale per 256: ~2.03 bytes | `torchao.optim.AdamW8bit` (block-wise quantized moments; tensors under 4096 elements keep fp32 moments), as TRL/axolotl users pick `adamw_8bit` |

Both update the FSDP2 shards in place: the states are DTensors sharded like their parameters
(torchao's subclass states included), saved and restored by the full state
(``full_state.py``, DCP ``get_state_dict``/``set_state_dict``), so a resume is exact.
"""

from __future__ import annotations

import logging

import torch

from minitrainer.common.log import log_rank_0

OPTIMIZERS = ("adamw", "adamw_8bit")
STATE_BYTES_PER_PARAM = {"adamw": 8.0, "adamw_8bit": 2.0 + 2 * 4 / 256}
"""Optimizer-state bytes per trainable parameter (what a memory probe holds aside before the first step)."""


def build_optimizer(name: str, param_groups: list[dict], *, lr: float, betas: tuple[float, float],
                    device: torch.device, eps: float = 1e-8) -> torch.optim.Optimizer:
    """The optimizer ``name`` over the method's ``param_groups`` (each carries its weight decay).

    Args:
        name: one of ``OPTIMIZERS``.
        param_groups: ``FineTuningMethod.param_groups``.
        lr, betas, eps: AdamW's.
        device: where the parameters' shards live (with ``--cpu-offload``: the host).
    """
    if name == "adamw":
        # Fused on a GPU: one kernel for every parameter and an on-device skip (``skips_on_device``). CPU keeps
        # torch's default (foreach): its fused kernel rounds differently in the last bit (seen: 3e-8 after 20 steps).
        return torch.optim.AdamW(param_groups, lr=lr, betas=betas, eps=eps,
                                 fused=True if device.type == "cuda" else None)
    assert name == "adamw_8bit", name
    try:
        from torchao.optim import AdamW8bit
    except ImportError as err:
        raise ImportError("--optimizer adamw_8bit needs torchao: pip install torchao") from err
    if device.type == "cpu":
        log_rank_0("--optimizer adamw_8bit on CPU: each parameter shape compiles its update once (inductor); "
                   "the first step is slow", level=logging.INFO)
    return AdamW8bit(param_groups, lr=lr, betas=betas, eps=eps)


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` can skip a non-finite step by itself, without the host reading the norm
    first: torch's fused Adam kernels take ``found_inf`` (as ``GradScaler`` uses them) and leave parameters,
    moments and step counts untouched where it is set."""
    return isinstance(optimizer, torch.optim.AdamW) and bool(optimizer.defaults.get("fused"))


def step_unless(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """``optimizer.step()`` that changes nothing where ``found_inf`` (a float scalar on the device) is 1;
    queued, no host-device synchronisation. Only for ``skips_on_device`` optimizers."""
    optimizer.found_inf = found_inf
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf
