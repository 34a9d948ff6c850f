"""Skipping a non-finite step on the device: torch's fused Adam kernels take ``found_inf`` (as ``GradScaler`` uses
them) and leave parameters, moments and step counts untouched where it is set, so the host need not read the
gradient norm before the step."""

from __future__ import annotations

import torch


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` can skip a non-finite step by itself (fused ``torch.optim.AdamW``)."""
    return isinstance(optimizer, torch.optim.AdamW) and bool(optimizer.defaults.get("fused"))


def step_unless(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """``optimizer.step()`` that changes nothing where ``found_inf`` (a float scalar on the device) is 1;
    queued, no host-device synchronisation. Only for ``skips_on_device`` optimizers."""
    optimizer.found_inf = found_inf
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf
