"""``--max-tokens-per-gpu auto``: find the largest packed row that fits on this GPU.

A short trial: run real training steps (forward, backward) on rows of the
longest samples at growing token budgets, catch ``torch.OutOfMemoryError``,
and bisect between the last budget that fitted and the first that did not.
The answer is scaled by a safety margin (fragmentation, longer runs) and
rounded down to ``resolution`` tokens.

Distributed: every rank must run the same trial sizes (rows built from the
same samples), so their FSDP collectives and allocations match and an OOM
hits every rank at the same allocation; ``agree`` then all-reduces each
verdict so the ranks never diverge. On CPU there is no device memory to probe:
the documented default is returned with a warning.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import numpy as np
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from utils import DistInfo, log_rank_0

DEFAULT_MAX_TOKENS_PER_GPU = 10000
"""What ``auto`` means without a GPU: the original mini_trainer default."""


def longest_first_plan(lengths: np.ndarray, num_tokens: int) -> list[tuple[int, int]]:
    """The trial row of ``num_tokens`` tokens: the longest samples first, the last one cut.

    Returns ``(sample index, tokens taken)`` pairs; samples repeat when the
    dataset holds fewer than ``num_tokens`` tokens::

        lengths [300, 900, 120, 700], num_tokens 2000
        -> [(1, 900), (3, 700), (0, 300), (2, 100)]
    """
    order = np.argsort(-np.asarray(lengths), kind="stable")
    plan, total = [], 0
    while total < num_tokens:
        for index in order:
            take = min(int(lengths[index]), num_tokens - total)
            plan.append((int(index), take))
            total += take
            if total >= num_tokens:
                break
    return plan


def search_largest_fitting(fits: Callable[[int], bool], *, lower: int, upper: int, resolution: int) -> int | None:
    """Largest multiple of ``resolution`` in [lower, upper] for which ``fits`` holds, assuming monotonicity.

    Doubles from ``lower`` until a budget fails (or ``upper``), then bisects.
    Returns None when even ``lower`` does not fit.
    """
    if not fits(lower):
        return None
    good, bad = lower, None
    while bad is None and good < upper:
        trial = min(good * 2, upper)
        if fits(trial):
            good = trial
        else:
            bad = trial
    if bad is None:
        return good
    while bad - good > resolution:
        mid = (good + bad) // 2 // resolution * resolution
        if mid <= good:
            break
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def probe_max_tokens_per_gpu(try_step: Callable[[int], None], *, device_type: str, lower: int = 4096,
                             upper: int = 262144, safety: float = 0.9, resolution: int = 1024,
                             reserve_bytes: int = 0, agree: Callable[[bool], bool] | None = None) -> int:
    """The largest ``--max-tokens-per-gpu`` that trains on this GPU, with a safety margin.

    Args:
        try_step: runs one forward + backward on a packed row of that many
            tokens (``longest_first_plan``) and, in a ``finally``, frees its
            gradients and reshards FSDP modules (``FSDPModule.reshard()``) so a
            step that died half-way leaves nothing gathered; it may raise
            ``torch.OutOfMemoryError``.
        device_type: 'cuda' probes; anything else returns ``DEFAULT_MAX_TOKENS_PER_GPU``.
        lower, upper: the search range in tokens.
        safety: fraction of the largest fitting budget that is returned.
        resolution: the answer is a multiple of this many tokens.
        reserve_bytes: device memory held during the trial for what a real step
            adds later (e.g. AdamW's two fp32 states per local parameter before
            the first optimizer step).
        agree: combines this rank's verdict with the other ranks' (all-reduce
            MIN); None in a single process.

    Returns:
        The budget in tokens.
    """
    if device_type != "cuda":
        log_rank_0(f"--max-tokens-per-gpu auto needs a GPU to probe: using {DEFAULT_MAX_TOKENS_PER_GPU} on "
                   f"{device_type}", level=logging.WARNING)
        return DEFAULT_MAX_TOKENS_PER_GPU

    def fits(num_tokens: int) -> bool:
        ok = True
        try:
            try_step(num_tokens)
        except torch.OutOfMemoryError:
            ok = False
        # The failed step's graph died with the exception; hand its blocks back before the next trial.
        torch.accelerator.empty_cache()
        if agree is not None:
            ok = agree(ok)
        log_rank_0("max-tokens probe: %d tokens %s", num_tokens, "fit" if ok else "do not fit")
        return ok

    reserve = torch.empty(reserve_bytes, dtype=torch.uint8, device=device_type) if reserve_bytes else None
    try:
        best = search_largest_fitting(fits, lower=lower, upper=upper, resolution=resolution)
    finally:
        del reserve
        torch.accelerator.empty_cache()
    if best is None:
        raise ValueError(f"--max-tokens-per-gpu auto: even {lower} tokens do not fit on this GPU; "
                         "enable --activation-checkpointing, --use-liger-kernels or --cpu-offload, or use more GPUs")
    chosen = max(resolution, int(best * safety) // resolution * resolution)
    log_rank_0(f"--max-tokens-per-gpu auto: {best} tokens fit, using {chosen} ({safety:.0%} safety margin)")
    return chosen


def probe_token_budget(model: torch.nn.Module, dataset, *, model_inputs: Callable, dist_info: DistInfo) -> int:
    """``--max-tokens-per-gpu auto`` for the trainer: trial steps on packed rows of the longest samples.

    Every rank builds the same trial rows, so collectives and allocations match
    and the ranks agree on each verdict. ``model_inputs(minibatch)`` turns a
    collated minibatch into the model's forward kwargs.
    """
    import sampler
    from full_state import agree

    longest_first = np.argsort(dataset.lengths, kind="stable")[::-1]
    # AdamW's two fp32 moments do not exist yet during the probe: hold their memory aside.
    local_params = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())

    def try_step(num_tokens: int) -> None:
        samples, remaining = [], num_tokens
        for index in itertools.cycle(longest_first):
            input_ids, labels = dataset.sample(int(index))
            samples.append((input_ids[:remaining], labels[:remaining]))
            remaining -= len(samples[-1][0])
            if remaining <= 0:
                break
        minibatch = sampler.collate_minibatch(samples)
        try:
            model(**model_inputs(minibatch)).backward()
        finally:
            model.zero_grad(set_to_none=True)
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()  # a step that died half-way may have left a block gathered

    return probe_max_tokens_per_gpu(try_step, device_type=dist_info.device.type, reserve_bytes=8 * local_params,
                                    agree=lambda ok: agree(ok, dist_info.device))
