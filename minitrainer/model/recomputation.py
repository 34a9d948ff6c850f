"""``--activation-checkpointing``: how much of each decoder block backward recomputes.

Four policies, from most recomputation to least:

| policy      | kept from forward                                 | recomputed in backward          |
|-------------|---------------------------------------------------|---------------------------------|
| `full`      | each block's input                                | the whole block                 |
| `selective` | the block's input, matmul and attention outputs   | element-wise ops (norms, RoPE, activations, residual adds) |
| `none`      | everything autograd saves                         | nothing                         |
| `auto`      | the least recomputation whose peak fits the GPU, probed at start-up (`resolve_auto`) | |

Every policy computes the same ops in forward; recomputation replays them with
the saved RNG state, so losses and gradients equal those of ``none``
(``tests/test_recomputation.py``). The model applies the policy itself
(transformers' ``activation_checkpointing_enable``, non-reentrant
``torch.utils.checkpoint`` around each decoder block's ``forward``, FSDP's hooks
outside); ``selective`` hands it a ``context_fn`` built by
``torch.utils.checkpoint.create_selective_checkpoint_contexts``, as torchtitan's
op-level selective checkpointing does.

``auto`` on a GPU builds the model with ``full``, then runs one trial step
(forward and backward on a row of the longest samples at the run's token
budget) per policy, least recomputation first, and keeps the first that fits;
the ranks agree on every verdict. Without a GPU there is no peak to measure:
``auto`` is ``full``, the policy of least memory, with a warning. With
``--max-tokens-per-gpu auto`` too, the budget is what is being maximised:
``auto`` is ``full`` there as well, so the probe finds the largest budget.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from minitrainer.common.log import log_rank_0

POLICIES = ("full", "selective", "none", "auto")
LEAST_RECOMPUTATION_FIRST = ("none", "selective", "full")
"""The order ``auto`` tries them in: fastest first."""
AUTO_WITHOUT_A_PROBE = "full"


def as_policy(value: str | bool) -> str:
    """A policy from a value of ``activation_checkpointing``: its name, or the boolean of the flag's first form
    (``true``: ``full``, ``false``: ``none``), which configs and scripts written before the policies hold."""
    if isinstance(value, bool):
        return "full" if value else "none"
    return value


def _saved_ops() -> frozenset:
    """The ops whose outputs ``selective`` keeps: matmuls and attention kernels, the work that scales with
    hidden size (and, for attention, with sequence length squared). Element-wise ops are cheap to redo and
    their outputs are as large as a matmul's, so they are recomputed."""
    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
           aten._scaled_dot_product_efficient_attention.default,
           aten._scaled_dot_product_flash_attention.default,
           aten._scaled_dot_product_cudnn_attention.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default,
           aten._flash_attention_forward.default, aten._efficient_attention_forward.default}
    # Varlen kernels registered by optional packages: kept where they are loaded.
    for namespace, name in (("flash_attn", "_flash_attn_varlen_forward"), ("flash_attn_3", "fwd")):
        try:
            ops.add(getattr(getattr(torch.ops, namespace), name).default)
        except (AttributeError, RuntimeError):
            pass
    return frozenset(ops)


def _keep_matmuls_and_attention(saved: frozenset) -> Callable:
    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_context_fn() -> Callable:
    """``torch.utils.checkpoint``'s ``context_fn`` for ``selective``: a fresh pair of contexts per call."""
    return functools.partial(create_selective_checkpoint_contexts, _keep_matmuls_and_attention(_saved_ops()))


def supports_recomputation(model: nn.Module) -> bool:
    """Whether the model can checkpoint its blocks (a few architectures cannot: docs/architectures.md)."""
    return bool(getattr(model, "supports_gradient_checkpointing", True))


def set_policy(model: nn.Module, policy: str) -> None:
    """Make every decoder block of the Hugging Face ``model`` recompute per ``policy`` (full, selective or
    none) from its next forward on; callable again on the sharded (or compiled) model, which ``auto`` does."""
    assert policy in LEAST_RECOMPUTATION_FIRST, policy
    # transformers 5 renamed the public switches; 4.x only has the old names.
    renamed = hasattr(model, "activation_checkpointing_enable")
    if policy == "none":
        if any(getattr(module, "gradient_checkpointing", False) for module in model.modules()):
            (model.activation_checkpointing_disable if renamed else model.gradient_checkpointing_disable)()
        return
    kwargs = {"use_reentrant": False}
    if policy == "selective":
        kwargs["context_fn"] = selective_context_fn()
    if renamed:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def initial_policy(policy: str, model: nn.Module) -> str:
    """The policy the model is built with: ``auto`` starts as ``full`` (the probe lowers it); a model that
    cannot checkpoint trains with ``none``, with a warning."""
    if policy != "none" and not supports_recomputation(model):
        log_rank_0(f"{type(model).__name__} does not support activation checkpointing: training without it "
                   "(more activation memory)", level=logging.WARNING)
        return "none"
    return AUTO_WITHOUT_A_PROBE if policy == "auto" else policy


def resolve_auto(model: nn.Module, try_step: Callable[[int], None], *, num_tokens: int, device_type: str,
                 fits: Callable[[Callable[[int], None], int], bool]) -> str:
    """``auto``: the least recomputation whose trial step of ``num_tokens`` tokens fits on this device.

    Args:
        model: the Hugging Face model inside the training wrapper, built with ``full``.
        try_step: one forward and backward on a row of ``num_tokens`` tokens, undone afterwards
            (``autotune.make_trial_step``).
        num_tokens: the run's token budget per minibatch.
        device_type: only 'cuda' has a peak to probe; elsewhere ``full`` is kept.
        fits: runs a trial and combines every rank's verdict (``autotune.trial_fits`` with ``agree``).

    Returns:
        The chosen policy, already set on the model.
    """
    if device_type != "cuda":
        log_rank_0(f"--activation-checkpointing auto needs a GPU to measure a peak: using "
                   f"{AUTO_WITHOUT_A_PROBE} on {device_type}", level=logging.WARNING)
        return AUTO_WITHOUT_A_PROBE
    for policy in LEAST_RECOMPUTATION_FIRST:
        set_policy(model, policy)
        ok = fits(try_step, num_tokens)
        torch.accelerator.empty_cache()
        log_rank_0("recomputation probe: %s at %d tokens %s", policy, num_tokens, "fits" if ok else "does not fit")
        if ok:
            return policy
    raise ValueError(f"--activation-checkpointing auto: even full recomputation does not fit {num_tokens} tokens "
                     "per GPU; lower --max-tokens-per-gpu (or give auto), add --use-liger-kernels or --cpu-offload")
