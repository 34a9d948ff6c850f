"""``--max-tokens-per-gpu auto``: find the largest packed row that fits on this GPU.

A short trial: run real training steps (forward, backward) on rows of the
longest samples at growing token budgets, catch ``torch.OutOfMemoryError``,
and bisect between the last budget that fitted and the first that did not.
The answer is scaled by a safety margin (fragmentation, longer runs) and
rounded down to ``resolution`` tokens.

Distributed: every rank must run the same trial sizes (rows built from the
same samples), so their FSDP collectives and allocations match and an OOM
hits every rank at the same allocation; ``probe_agreement`` then all-reduces
each verdict so the ranks never diverge. A failure on one rank only leaves the
others inside a collective of the trial that it will never join: the failed
rank waits for their verdicts on a side group with a short timeout, then stops
the job with an error instead of letting it hang. On CPU there is no device
memory to probe: the documented default is returned with a warning.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterator
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from minitrainer.common import fault_injection
from minitrainer.common.distributed import DistInfo, positive_env_number
from minitrainer.common.log import log_rank_0
from minitrainer.model import recomputation

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


ALLOCATION_FAILURES = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED",
                       "cudaErrorMemoryAllocation", "HIP out of memory")
"""Messages of allocation failures that libraries raise as plain ``RuntimeError``s, not ``OutOfMemoryError``."""


def is_allocation_failure(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and any(text in str(err) for text in ALLOCATION_FAILURES))


def trial_fits(try_step: Callable[[int], None], num_tokens: int, *,
               agree: Callable[[bool], bool] | None = None) -> bool:
    """Run one trial; an allocation failure means "does not fit" (other errors propagate).

    ``agree`` combines the verdicts of all ranks, so one rank's failure fails the
    trial on every rank and they search on together.
    """
    ok = True
    try:
        try_step(num_tokens)
    except (torch.OutOfMemoryError, RuntimeError) as err:
        if not is_allocation_failure(err):
            raise
        ok = False
    return agree(ok) if agree is not None else ok


PROBE_TIMEOUT_ENV = "MINI_TRAINER_PROBE_TIMEOUT_SECONDS"
DEFAULT_PROBE_TIMEOUT_SECONDS = 120.0


def probe_agreement(dist_info: DistInfo) -> Callable[[bool], bool]:
    """``agree`` for the probe: every rank's verdict of a trial, combined (MIN) on a gloo side group.

    Call on every rank at once (it creates a process group). The side group's timeout
    (``MINI_TRAINER_PROBE_TIMEOUT_SECONDS``, default 120) bounds how long a rank waits for
    the others' verdicts: ranks that ran the same trial arrive within moments of each other,
    while ranks blocked in a collective of the trial that a failed rank left never arrive.
    That failed rank then raises, its process exits, and torchrun stops the rest.
    """
    seconds = positive_env_number(PROBE_TIMEOUT_ENV, DEFAULT_PROBE_TIMEOUT_SECONDS)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=seconds))

    def agree(ok: bool) -> bool:
        flag = torch.tensor([int(ok)], dtype=torch.int32)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        except RuntimeError as err:
            verdict = "failed (allocation failure)" if not ok else "fitted"
            raise RuntimeError(
                f"--max-tokens-per-gpu auto: a trial step {verdict} on rank {dist_info.rank}, but the other ranks "
                f"did not report within {seconds:g} s ({PROBE_TIMEOUT_ENV}): the ranks went out of step (an "
                "allocation failure on some ranks only) and cannot continue together. Set --max-tokens-per-gpu to "
                "a number instead (below the size of the last trial logged)") from err
        return bool(flag.item())

    return agree


def reset_fsdp_after_trial(model: torch.nn.Module) -> None:
    """Leave no trace of a trial step, finished or not: reset FSDP's per-iteration state, which an
    exception mid-backward leaves undefined (parameters kept unsharded, gradients never reduced:
    ranks would silently train apart), reshard every FSDP module and free the gradients."""
    # First while the failed step's unsharded parameters are still the registered ones: gradients
    # accumulated there (modules whose backward ran but whose reduction did not) would leak into
    # the next step.
    model.zero_grad(set_to_none=True)
    fsdp_modules = [module for module in model.modules() if isinstance(module, FSDPModule)]
    if fsdp_modules:
        fsdp_modules[0].reset_iter_state()  # on the root (the outermost one); it resets every group
    for module in fsdp_modules:
        module.reshard()
    model.zero_grad(set_to_none=True)


def make_trial_step(model: torch.nn.Module, dataset, *, model_inputs: Callable) -> Callable[[int], None]:
    """The probe's trial: forward and backward on a row of ``num_tokens`` tokens of the longest samples."""
    from minitrainer.data import sampler

    longest_first = np.argsort(dataset.lengths, kind="stable")[::-1]

    def try_step(num_tokens: int) -> None:
        samples, remaining = [], num_tokens
        for index in itertools.cycle(longest_first):
            input_ids, labels = dataset.sample(int(index))
            samples.append((input_ids[:remaining], labels[:remaining]))
            remaining -= len(samples[-1][0])
            if remaining <= 0:
                break
        minibatch = sampler.collate_minibatch(samples)
        injected = fault_injection.probe_failure(
            model, num_tokens, [m for m in model.modules() if isinstance(m, FSDPModule)][1:])
        try:
            model(**model_inputs(minibatch)).sum().backward()  # a reward model returns a score per sequence
        finally:
            if injected is not None:
                injected.remove()
            reset_fsdp_after_trial(model)

    return try_step


def probe_max_tokens_per_gpu(try_step: Callable[[int], None], *, device_type: str, lower: int = 4096,
                             upper: int = 262144, safety: float = 0.9, resolution: int = 1024,
                             reserve_bytes: int = 0, agree: Callable[[bool], bool] | None = None) -> int:
    """The largest ``--max-tokens-per-gpu`` that trains on this GPU, with a safety margin.

    Args:
        try_step: runs one forward + backward on a packed row of that many
            tokens (``longest_first_plan``) and, in a ``finally``, undoes it
            (``reset_fsdp_after_trial``) so a step that died half-way leaves
            FSDP as if it never ran; it may raise ``torch.OutOfMemoryError`` or
            another allocation failure (``is_allocation_failure``).
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
        ok = trial_fits(try_step, num_tokens, agree=agree)
        # The failed step's graph died with the exception; hand its blocks back before the next trial.
        torch.accelerator.empty_cache()
        log_rank_0("max-tokens probe: %d tokens %s", num_tokens, "fit" if ok else "do not fit")
        return ok

    with _held_aside(reserve_bytes, device_type):
        best = search_largest_fitting(fits, lower=lower, upper=upper, resolution=resolution)
    if best is None:
        raise ValueError(f"--max-tokens-per-gpu auto: even {lower} tokens do not fit on this GPU; "
                         "enable --activation-checkpointing, --use-liger-kernels or --cpu-offload, or use more GPUs")
    chosen = max(resolution, int(best * safety) // resolution * resolution)
    log_rank_0(f"--max-tokens-per-gpu auto: {best} tokens fit, using {chosen} ({safety:.0%} safety margin)")
    return chosen


@contextlib.contextmanager
def _held_aside(num_bytes: int, device_type: str) -> Iterator[None]:
    """Device memory held during the trials for what a real step adds later (the optimizer's states)."""
    reserve = torch.empty(num_bytes, dtype=torch.uint8, device=device_type) if num_bytes else None
    try:
        yield
    finally:
        del reserve
        if device_type != "cpu":  # no accelerator to hand blocks back to
            torch.accelerator.empty_cache()


def _optimizer_state_bytes(model: torch.nn.Module, state_bytes_per_param: float) -> int:
    """The optimizer states' bytes on this rank, which do not exist yet during a probe."""
    local_params = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    return int(state_bytes_per_param * local_params)


def probe_recomputation(model: torch.nn.Module, dataset, *, model_inputs: Callable, dist_info: DistInfo,
                        num_tokens: int, state_bytes_per_param: float = 8.0) -> str:
    """``--activation-checkpointing auto`` for the trainer (``recomputation.resolve_auto``): one trial step at
    ``num_tokens`` per policy, least recomputation first, the optimizer's states held aside, the ranks agreeing
    on every verdict. ``model`` is the training wrapper; its Hugging Face model (``.model``) is switched."""
    device_type = dist_info.device.type
    try_step = make_trial_step(model, dataset, model_inputs=model_inputs)
    agree = probe_agreement(dist_info) if device_type == "cuda" else None  # CPU does not probe
    reserve = _optimizer_state_bytes(model, state_bytes_per_param) if device_type == "cuda" else 0
    with _held_aside(reserve, device_type):
        return recomputation.resolve_auto(model.model, try_step, num_tokens=num_tokens, device_type=device_type,
                                          fits=lambda step, tokens: trial_fits(step, tokens, agree=agree))


def probe_token_budget(model: torch.nn.Module, dataset, *, model_inputs: Callable, dist_info: DistInfo,
                       state_bytes_per_param: float = 8.0) -> int:
    """``--max-tokens-per-gpu auto`` for the trainer: trial steps on packed rows of the longest samples.

    Every rank builds the same trial rows, so collectives and allocations match
    and the ranks agree on each verdict. ``model_inputs(minibatch)`` turns a
    collated minibatch into the model's forward kwargs.
    """
    # The optimizer's states (AdamW's two fp32 moments: 8 bytes) do not exist yet during the probe: held aside.
    try_step = make_trial_step(model, dataset, model_inputs=model_inputs)
    agree = probe_agreement(dist_info) if dist_info.device.type == "cuda" else None  # CPU does not probe
    return probe_max_tokens_per_gpu(try_step, device_type=dist_info.device.type,
                                    reserve_bytes=_optimizer_state_bytes(model, state_bytes_per_param), agree=agree)
