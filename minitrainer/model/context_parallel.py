"""Context parallelism: one packed row shared by a group of N ranks, attention by all-gathered K and V.

A row longer than one rank's token budget is split token-wise over the N
ranks of a context-parallel (CP) group. Every layer except attention is
per-token, so each rank runs the model on its own tokens only; attention
all-gathers K and V inside the group and each rank's queries attend the
keys of their own document up to their own position.

1. Split (``split_row``, pure numpy). Long documents are cut head-tail into
   2N chunks, rank i taking chunk i and chunk 2N-1-i, so each rank gets the
   same tokens and (to rounding) the same attention cost, because a query's
   cost is its position in its document. Documents that fit are kept whole.
   Each rank keeps its tokens in row order, with their ORIGINAL position_ids
   and the labels the collator ALREADY SHIFTED on the whole row, so no label
   crosses a shard boundary and the per-rank loss sums add up to the row's.
   N = 2, a row of a long document ``a`` (16 tokens) and two short ones
   (``split_row([16, 4, 4], 2)``; each rank 12 tokens and 78 attended keys)::

       row       a a a a a a a a a a a a a a a a | b b b b | c c c c
       chunk     |- 0 -| |- 1 -| |- 2 -| |- 3 -|   whole     whole
       rank      0 0 0 0 1 1 1 1 1 1 1 1 0 0 0 0 | 0 0 0 0 | 1 1 1 1
       rank 0:   a0..a3  a12..a15  b0..b3     position_ids 0-3, 12-15, 0-3
       rank 1:   a4..a11  c0..c3              position_ids 4-11, 0-3

2. Plan (``context_parallel_plan``): from the split, each rank's local tokens
   are cut into query segments, maximal runs of consecutive row tokens of one
   document. A segment ``[s, e)`` of a document starting at ``d`` attends the
   keys ``[d, e)``: causal with the diagonal at the bottom right, which is
   exactly what flash-attn's varlen kernel computes for ``seqlen_q <= seqlen_k``::

       rank 0, document a:   queries a0..a3    keys a0..a3     (4 x 4,  causal)
                             queries a12..a15  keys a0..a15    (4 x 16, bottom-right causal)

   The segments' keys are gathered (duplicated where two segments share a
   prefix) into one key row with its own ``cu_seqlens_k``.

3. Attention (``context_parallel_attention``): local K and V are concatenated,
   padded to the longest shard and all-gathered in ONE differentiable
   collective (``all_gather_into_tensor`` forward, ``reduce_scatter_tensor``
   backward); one ``index_select`` takes every segment's keys from the gathered
   buffer; an inner varlen kernel with separate ``cu_seqlens_q``/``cu_seqlens_k``
   (the ``InnerKernel`` contract: ``reference_kernel`` on CPU,
   ``flash_attn_kernel`` on GPU) does the rest.
   Backward sends each key's gradient back to the rank that owns it.

Memory per rank: local activations for T/N tokens, plus K and V of the whole
row during each attention call (``2 * T * kv_heads * head_dim`` values, and
the same again for the per-segment key row).

4. Training (``--context-parallel-size N``): ``new_context_group`` makes groups
   of N consecutive ranks, each one data rank to the sampler with N x the
   per-GPU budget; ``shard_step_batch`` / ``shard_minibatch`` cut every
   collated row of the group to this rank's shard (a ``Minibatch`` carrying its
   plan, with its own loss-token count); ``refusal`` says in one line what a
   job or model cannot combine with yet. The backend wraps the varlen backend
   the run would use without it (``inner_backend``) and runs that backend
   itself for a forward without a plan (the start-up self-check).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minitrainer.common.distributed import DistInfo
from minitrainer.common.labels import IGNORE_INDEX
from minitrainer.data.sampler import DUMMY_TOKEN_ID, Minibatch, StepBatch
from minitrainer.model.attention import (CONTEXT_PARALLEL, REFERENCE_VARLEN, TORCH_VARLEN, AttentionNeeds,
                                         call_varlen_attn, register_attention_backends)

__all__ = ["CONTEXT_PARALLEL", "ContextGroup", "shard_minibatch", "shard_row", "split_row"]

BALANCES = ("attention", "tokens")


# ----------------------------------------------------------------------------
# The split (pure: numpy, no torch.distributed)


def document_lengths(position_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Lengths of the documents of a packed row: a document starts wherever the position is 0."""
    positions = np.asarray(position_ids, dtype=np.int64).reshape(-1)
    if positions.size == 0 or positions[0] != 0:
        raise ValueError("a packed row must start a document: its first position_id must be 0")
    starts = np.flatnonzero(positions == 0)
    return np.diff(np.append(starts, positions.size))


def _token_costs(lengths: np.ndarray, balance: str) -> np.ndarray:
    """Per-document cost: the keys its queries attend (``L (L + 1) / 2``), or its tokens."""
    if balance == "attention":
        return lengths * (lengths + 1) // 2
    return lengths.copy()


def _water_fill(length: int, rooms: np.ndarray, loads: np.ndarray, token_cost: float) -> np.ndarray:
    """Shares of ``length`` tokens that level the ranks' loads, each share within its rank's room.

    A share ``s`` adds about ``s * token_cost`` to its rank's load (a head-tail
    piece of a document of length L costs ``(L + 1) / 2`` per token on
    average). The level is found by bisection, shares are floored, and the
    few leftover tokens go one by one to the least loaded ranks with room.
    """
    rooms = np.maximum(rooms, 0)
    assert rooms.sum() >= length, "the ranks' rooms are smaller than the row"
    fill = (lambda level: np.clip((level - loads) / token_cost, 0, rooms))
    low, high = float(loads.min()), float(loads.max() + length * token_cost)
    for _ in range(64):
        middle = (low + high) / 2
        low, high = (middle, high) if fill(middle).sum() < length else (low, middle)
    shares = np.minimum(np.floor(fill(high)).astype(np.int64), rooms)
    while shares.sum() > length:  # bisection overshoot: take back from the most loaded
        open_ranks = np.flatnonzero(shares > 0)
        shares[open_ranks[np.argmax(loads[open_ranks] + shares[open_ranks] * token_cost)]] -= 1
    while shares.sum() < length:
        open_ranks = np.flatnonzero(shares < rooms)
        shares[open_ranks[np.argmin(loads[open_ranks] + shares[open_ranks] * token_cost)]] += 1
    return shares


def _head_tail_pieces(start: int, shares: np.ndarray) -> list[tuple[int, int, int]]:
    """``(rank, begin, end)`` pieces of a document at ``start``: rank i's head then, mirrored, its tail.

    Rank i takes ``ceil(share_i / 2)`` tokens from the front region and
    ``floor(share_i / 2)`` from the back one::

        heads 0 1 2 ... N-1 | tails N-1 ... 2 1 0
    """
    heads = (shares + 1) // 2
    tails = shares // 2
    pieces, cursor = [], start
    for rank in range(shares.size):
        pieces.append((rank, cursor, cursor + int(heads[rank])))
        cursor += int(heads[rank])
    for rank in reversed(range(shares.size)):
        pieces.append((rank, cursor, cursor + int(tails[rank])))
        cursor += int(tails[rank])
    return [piece for piece in pieces if piece[2] > piece[1]]


def split_row(lengths: Sequence[int] | np.ndarray, num_ranks: int, *, balance: str = "attention",
              max_tokens_per_rank: int | None = None) -> list[np.ndarray]:
    """Assign every token of a packed row to one of ``num_ranks`` ranks.

    Documents are visited longest first. One goes whole to the least loaded
    rank that has room for it (and, with ``balance="attention"``, stays within
    the per-rank share of the row's attention cost); otherwise it is cut
    head-tail (module docstring), with shares that level the ranks' loads
    within their remaining token room (equal shares on an even start). The row's total attention cost does not depend on
    the split, so the per-rank target ``sum(L (L + 1) / 2) / N`` is known up front.

    Args:
        lengths: document lengths of the row, in row order (``document_lengths``).
        num_ranks: the context-parallel group size N.
        balance: "attention" (cost of a query = its position in its document + 1)
            or "tokens" (split only what does not fit).
        max_tokens_per_rank: hard cap on a rank's tokens; default and minimum
            ``ceil(T / N)``.

    Returns:
        ``num_ranks`` int64 arrays of token indices into the row, each ascending;
        together they hold every token exactly once.
    """
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be at least 1, got {num_ranks}")
    if balance not in BALANCES:
        raise ValueError(f"unknown balance {balance!r}: expected one of {BALANCES}")
    if (lengths < 1).any():
        raise ValueError(f"document lengths must be positive, got {lengths.tolist()}")
    total = int(lengths.sum())
    cap = -(-total // num_ranks)
    if max_tokens_per_rank is not None:
        cap = max(cap, max_tokens_per_rank)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    costs = _token_costs(lengths, balance)
    cost_target = costs.sum() / num_ranks
    tokens = np.zeros(num_ranks, dtype=np.int64)
    loads = np.zeros(num_ranks, dtype=np.float64)
    pieces: list[tuple[int, int, int]] = []
    for doc in np.argsort(-lengths, kind="stable"):
        length, start = int(lengths[doc]), int(starts[doc])
        fits = (tokens + length <= cap) & (loads + costs[doc] <= cost_target)
        if fits.any():
            rank = int(np.flatnonzero(fits)[np.argmin(loads[fits])])
            pieces.append((rank, start, start + length))
            tokens[rank] += length
            loads[rank] += costs[doc]
            continue
        token_cost = (length + 1) / 2 if balance == "attention" else 1.0
        shares = _water_fill(length, cap - tokens, loads, token_cost)
        for rank, begin, end in _head_tail_pieces(start, shares):
            pieces.append((rank, begin, end))
            positions = np.arange(begin - start, end - start)
            loads[rank] += (positions + 1).sum() if balance == "attention" else end - begin
        tokens += shares
    per_rank: list[list[np.ndarray]] = [[] for _ in range(num_ranks)]
    for rank, begin, end in sorted(pieces, key=lambda piece: piece[1]):
        per_rank[rank].append(np.arange(begin, end, dtype=np.int64))
    return [np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64) for parts in per_rank]


def rank_attention_costs(lengths: Sequence[int] | np.ndarray, splits: Sequence[np.ndarray]) -> np.ndarray:
    """Per rank, the keys its queries attend: ``sum(position + 1)`` over its tokens."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    positions = np.arange(int(lengths.sum())) - np.repeat(starts, lengths)
    return np.array([int((positions[index] + 1).sum()) for index in splits], dtype=np.int64)


def loss_counted_tokens_per_rank(labels: Sequence[int] | np.ndarray, splits: Sequence[np.ndarray]) -> list[int]:
    """Learned tokens (shifted label != IGNORE_INDEX) each rank holds; they sum to the row's count."""
    learned = np.asarray(labels).reshape(-1) != IGNORE_INDEX
    return [int(learned[index].sum()) for index in splits]


@dataclass(frozen=True)
class Segments:
    """One rank's queries as varlen segments (numpy, host side).

    Segment ``s`` holds local queries ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``
    and attends the row tokens ``key_index[cu_seqlens_k[s]:cu_seqlens_k[s+1]]``,
    bottom-right causal. ``key_slot`` is the same keys' places in the
    gathered buffer, rank r's j-th token sitting at ``r * max_local + j``.
    """

    cu_seqlens_q: np.ndarray  # int32 [S + 1]
    cu_seqlens_k: np.ndarray  # int32 [S + 1]
    key_index: np.ndarray  # int64 [Tk] row indices of the keys
    key_slot: np.ndarray  # int64 [Tk] their slots in the gathered buffer
    local_lengths: tuple[int, ...]  # tokens per rank of the group
    max_local: int


def query_segments(lengths: Sequence[int] | np.ndarray, splits: Sequence[np.ndarray], rank: int) -> Segments:
    """Cut rank ``rank``'s tokens into runs of consecutive row tokens of one document (pure)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    bounds = np.concatenate(([0], np.cumsum(lengths)))
    total = int(bounds[-1])
    local_lengths = tuple(int(index.size) for index in splits)
    max_local = max(local_lengths)
    slot = np.full(total, -1, dtype=np.int64)
    for owner, index in enumerate(splits):
        slot[index] = owner * max_local + np.arange(index.size)
    assert (slot >= 0).all(), "the split leaves a token without a rank"
    index = np.asarray(splits[rank], dtype=np.int64)
    doc = np.searchsorted(bounds, index, side="right") - 1  # document of each local token
    new = np.ones(index.size, dtype=bool)
    new[1:] = (np.diff(index) != 1) | (np.diff(doc) != 0)
    first = np.flatnonzero(new)
    ends = np.append(first[1:], index.size)
    cu_q = np.append(first, index.size).astype(np.int32)
    key_ranges = [(int(bounds[doc[a]]), int(index[b - 1]) + 1) for a, b in zip(first, ends)]
    key_index = (np.concatenate([np.arange(lo, hi) for lo, hi in key_ranges]) if key_ranges
                 else np.zeros(0, dtype=np.int64))
    cu_k = np.concatenate(([0], np.cumsum([hi - lo for lo, hi in key_ranges]))).astype(np.int32)
    return Segments(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, key_index=key_index.astype(np.int64),
                    key_slot=slot[key_index], local_lengths=local_lengths, max_local=max_local)


# ----------------------------------------------------------------------------
# A rank's shard of a packed row, and the per-minibatch attention plan


@dataclass(frozen=True)
class ContextParallelPlan:
    """What every attention layer needs for one minibatch on one rank; built once, shared by layers."""

    group: dist.ProcessGroup | None  # the CP group (None: the default group)
    rank: int  # this rank's place in the group
    local_lengths: tuple[int, ...]  # tokens per rank of the group
    max_local: int  # the gather pads every shard to this
    key_slot: torch.Tensor  # int64 [Tk] each segment's keys in the gathered buffer
    cu_seqlens_q: torch.Tensor  # int32 [S + 1] over local queries
    cu_seqlens_k: torch.Tensor  # int32 [S + 1] over key_slot
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def num_ranks(self) -> int:
        return len(self.local_lengths)


@dataclass(frozen=True)
class ContextShard:
    """One rank's tokens of a packed row (shapes ``[1, t]``), in row order."""

    input_ids: torch.Tensor  # [1, t] int64
    labels: torch.Tensor  # [1, t] int64, shifted on the whole row before the split
    position_ids: torch.Tensor  # [1, t] int64, the tokens' original positions
    document_ids: torch.Tensor  # [t] int64, index of each token's document in the row
    token_index: torch.Tensor  # [t] int64, each token's index in the row
    num_loss_counted_tokens: int  # this rank's learned tokens
    group_loss_counted_tokens: tuple[int, ...]  # every group rank's, summing to the row's
    plan: ContextParallelPlan


def context_parallel_plan(lengths: Sequence[int] | np.ndarray, splits: Sequence[np.ndarray], *, rank: int,
                          group: dist.ProcessGroup | None = None,
                          device: torch.device | str = "cpu") -> ContextParallelPlan:
    """Rank ``rank``'s attention plan for a row of document ``lengths`` split as ``splits``."""
    segments = query_segments(lengths, splits, rank)
    as_int32 = (lambda a: torch.from_numpy(a).to(device=device, dtype=torch.int32))
    return ContextParallelPlan(
        group=group, rank=rank, local_lengths=segments.local_lengths, max_local=segments.max_local,
        key_slot=torch.from_numpy(segments.key_slot).to(device),
        cu_seqlens_q=as_int32(segments.cu_seqlens_q), cu_seqlens_k=as_int32(segments.cu_seqlens_k),
        max_seqlen_q=int(np.diff(segments.cu_seqlens_q).max(initial=0)),
        max_seqlen_k=int(np.diff(segments.cu_seqlens_k).max(initial=0)))


def shard_row(input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor, *, rank: int,
              num_ranks: int, balance: str = "attention", group: dist.ProcessGroup | None = None,
              device: torch.device | str = "cpu") -> ContextShard:
    """This rank's shard of a packed row, as the collator made it (``sampler.collate_minibatch``).

    Every rank of the group calls this on the same row and gets its own part
    (no communication: the split is a pure function of the document lengths).

    Args:
        input_ids: [1, T] packed tokens.
        labels: [1, T] labels shifted per document (``IGNORE_INDEX`` at document ends).
        position_ids: [1, T] restarting at 0 per document.
        rank: this rank's place in the CP group, ``0 <= rank < num_ranks``.
        num_ranks: the CP group size N.
        balance: ``split_row``'s balance.
        group: the CP process group, stored in the plan for the attention layers.
        device: where the plan's index tensors go (the model's device).

    Returns:
        The shard; its tensors other than the plan stay on the row's device.
    """
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank {rank} is outside a context-parallel group of {num_ranks}")
    if position_ids.numel() < num_ranks:
        # A rank with no token would run the model on an empty row; the caller pads dummy rows instead.
        raise ValueError(f"a packed row of {position_ids.numel()} tokens cannot be shared by {num_ranks} ranks: "
                         f"pad it to at least {num_ranks} tokens (a padding document with IGNORE_INDEX labels)")
    lengths = document_lengths(position_ids.cpu().numpy())
    splits = split_row(lengths, num_ranks, balance=balance)
    index = torch.from_numpy(splits[rank])
    document_ids = torch.from_numpy(np.repeat(np.arange(lengths.size), lengths)[splits[rank]])
    counts = loss_counted_tokens_per_rank(labels.cpu().numpy(), splits)
    take = (lambda row: row.reshape(-1)[index.to(row.device)].unsqueeze(0))
    return ContextShard(input_ids=take(input_ids), labels=take(labels), position_ids=take(position_ids),
                        document_ids=document_ids, token_index=index, num_loss_counted_tokens=counts[rank],
                        group_loss_counted_tokens=tuple(counts),
                        plan=context_parallel_plan(lengths, splits, rank=rank, group=group, device=device))


# ----------------------------------------------------------------------------
# Attention


InnerKernel = Callable[..., torch.Tensor]
"""``kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale) -> out``.

q: [Tq, Hq, D]; k: [Tk, Hkv, D]; v: [Tk, Hkv, Dv], Hq a multiple of Hkv;
cu_seqlens_q/k: int32 [S + 1]. Segment s's queries attend its keys causally
with the diagonal at the bottom right (query j of a segment with Lq queries
and Lk keys sees keys 0..j + Lk - Lq): flash-attn's
``flash_attn_varlen_func(..., causal=True)``. Returns [Tq, Hq, Dv].
"""


def reference_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                     scale: float | None = None) -> torch.Tensor:
    """``InnerKernel`` as one masked SDPA per segment, in the input dtype (fp64 works): slow, exact, CPU."""
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()  # CPU-GPU sync point (reference only)
    for q0, q1, k0, k1 in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:]):
        offset = (k1 - k0) - (q1 - q0)  # bottom-right alignment
        rows = torch.arange(q1 - q0, device=q.device)[:, None]
        mask = torch.arange(k1 - k0, device=q.device)[None, :] <= rows + offset
        # [T, H, D] -> [1, H, T, D] for SDPA
        segment = F.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1).unsqueeze(0), k[k0:k1].transpose(0, 1).unsqueeze(0),
            v[k0:k1].transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1])
        out[q0:q1] = segment.squeeze(0).transpose(0, 1)
    return out


def flash_attn_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                      scale: float | None = None) -> torch.Tensor:
    """``InnerKernel`` through flash-attn 2's varlen kernel (CUDA, fp16/bf16; bottom-right causal since 2.1)."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as err:
        raise ImportError(f"context parallelism with flash_attention_2 needs flash-attn ({err})") from err
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  softmax_scale=scale, causal=True)


def torch_varlen_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                        scale: float | None = None) -> torch.Tensor:
    """``InnerKernel`` through torch's ``varlen_attn`` (CUDA, torch >= 2.10; flash's bottom-right causal mask)."""
    from torch.nn.attention.varlen import varlen_attn

    # The flash kernel takes fp16/bf16 only; fp32 compute (unusual on GPU) runs it in bf16.
    dtype = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    out = call_varlen_attn(varlen_attn, q.to(dtype), k.to(dtype), v.to(dtype), cu_seqlens_q, max_seqlen_q,
                            causal=True, scale=scale, sliding_window=None, cu_seqlens_k=cu_seqlens_k,
                            max_seqlen_k=max_seqlen_k)
    return out.to(q.dtype)


INNER_KERNELS: dict[str, InnerKernel] = {REFERENCE_VARLEN: reference_kernel, "flash_attention_2": flash_attn_kernel,
                                         TORCH_VARLEN: torch_varlen_kernel}
"""The varlen backends context parallelism wraps, by name, and the kernel each lends it."""


def inner_backend(resolved: str, device_type: str) -> tuple[str | None, str]:
    """The varlen backend ``context_parallel`` wraps, given the one resolved without it, and why.

    Returns:
        ``(name, reason)``, or ``(None, refusal)`` when no wrapped kernel serves this device.
    """
    if resolved in INNER_KERNELS:
        return resolved, f"wrapping {resolved}"
    if device_type != "cuda":
        return REFERENCE_VARLEN, f"wrapping {REFERENCE_VARLEN} (the exact CPU kernel; {resolved} has no key boundaries)"
    return None, (f"--context-parallel-size needs flash_attention_2 or torch_varlen on GPU (keys with their own "
                  f"boundaries), got {resolved}: install flash-attn or torch >= 2.10, or pick one with "
                  "--attn-implementation")


# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (the old names warn); same semantics.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class _GatherKV(torch.autograd.Function):
    """All-gather along dim 0 forward, reduce-scatter (sum) backward: ONE collective each way.

    K and V travel concatenated through a single call, so backward has one
    reduce-scatter per layer and no order between two of them for the ranks
    to disagree on: gloo matches collectives by call order, and two separately
    differentiable gathers (same shapes under GQA) were reported to give the
    exact loss with wrong gradients on gloo (issue 33). With identical graphs
    on every rank the two-gather variant was not seen to fail here; one
    collective is kept because it cannot, and costs one launch instead of two.
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup | None, num_ranks: int) -> torch.Tensor:
        ctx.group = group
        gathered = local.new_empty(num_ranks * local.shape[0], *local.shape[1:])
        _all_gather_single(gathered, local.contiguous(), group=group)
        return gathered

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        local = grad.new_empty(grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:])
        _reduce_scatter_single(local, grad.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        return local, None, None


def gather_keys_values(key: torch.Tensor, value: torch.Tensor,
                       plan: ContextParallelPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Every segment's keys and values, from the whole group's shards.

    Args:
        key: [t, Hkv, D] this rank's keys; value: [t, Hkv, Dv].
        plan: this minibatch's plan (``t == plan.local_lengths[plan.rank]``).

    Returns:
        k [Tk, Hkv, D] and v [Tk, Hkv, Dv], in ``plan.cu_seqlens_k`` segment order.
    """
    num_local, kv_heads, key_dim = key.shape
    assert num_local == plan.local_lengths[plan.rank], "q/k/v are not this rank's shard of the plan"
    both = torch.cat([key.reshape(num_local, -1), value.reshape(num_local, -1)], dim=1)  # [t, Hkv * (D + Dv)]
    both = F.pad(both, (0, 0, 0, plan.max_local - num_local))  # [max_local, ...]: gather needs equal shards
    gathered = _GatherKV.apply(both, plan.group, plan.num_ranks)  # [N * max_local, ...]
    keys = gathered.index_select(0, plan.key_slot)  # [Tk, ...]; backward scatters into gathered's grad
    split = kv_heads * key_dim
    return (keys[:, :split].reshape(-1, kv_heads, key_dim),
            keys[:, split:].reshape(-1, kv_heads, value.shape[-1]))


def context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               plan: ContextParallelPlan, *, scale: float | None = None,
                               kernel: InnerKernel = reference_kernel) -> torch.Tensor:
    """Causal per-document attention of this rank's queries over the whole row's keys.

    Args:
        query: [t, Hq, D] this rank's queries, in its shard's order.
        key: [t, Hkv, D]; value: [t, Hkv, Dv], Hq a multiple of Hkv.
        plan: this minibatch's ``ContextParallelPlan`` (same on every layer).
        scale: softmax scale (None: 1/sqrt(D)).
        kernel: the inner varlen kernel (``InnerKernel``).

    Returns:
        [t, Hq, Dv]. Every rank of the group must call this together (collective).
    """
    keys, values = gather_keys_values(key, value, plan)
    return kernel(query, keys.contiguous(), values.contiguous(), plan.cu_seqlens_q, plan.cu_seqlens_k,
                  plan.max_seqlen_q, plan.max_seqlen_k, scale=scale)


def context_parallel_attention_forward(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
    sliding_window: int | None = None, softcap: float | None = None, is_causal: bool | None = None,
    context_parallel_plan: ContextParallelPlan | None = None,
    context_parallel_kernel: InnerKernel | None = None, context_parallel_inner: str | None = None, **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query/key/value [1, H, t, D] -> ([1, t, Hq, Dv], None).

    The plan (and optionally the inner kernel) arrive as keyword arguments of
    the model's forward, which transformers hands down to every attention call.
    ``context_parallel_inner`` (bound at registration) names the wrapped varlen
    backend: its kernel serves the plan, and a forward without a plan (the
    start-up self-check, one rank's own row) runs that backend itself.
    """
    if context_parallel_plan is None and context_parallel_inner is not None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS[context_parallel_inner](
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            sliding_window=sliding_window, softcap=softcap, is_causal=is_causal, **kwargs)
    if context_parallel_kernel is None:
        context_parallel_kernel = INNER_KERNELS[context_parallel_inner or REFERENCE_VARLEN]
    problems = [problem for bad, problem in (
        (context_parallel_plan is None, "no context_parallel_plan was passed to the model's forward"),
        (attention_mask is not None, "it takes packed rows, not an attention_mask"),
        (query.shape[0] != 1, f"it takes one packed row, got a batch of {query.shape[0]}"),
        (bool(dropout), f"it has no attention dropout (got {dropout})"),
        (softcap is not None, "it does not implement logit softcapping"),
        (sliding_window is not None, "it does not implement sliding windows"),
        (kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None, "it does not implement sinks"),
        ((is_causal if is_causal is not None else getattr(module, "is_causal", True)) is False,
         "it is causal only"),
    ) if bad]
    if problems:
        raise ValueError(f"{CONTEXT_PARALLEL} attention: " + "; ".join(problems))
    # [1, H, t, D] -> [t, H, D]: undoes the projection's transpose.
    q, k, v = (t.squeeze(0).transpose(0, 1) for t in (query, key, value))
    out = context_parallel_attention(q, k, v, context_parallel_plan, scale=scaling, kernel=context_parallel_kernel)
    return out.unsqueeze(0), None


def register_context_parallel_backend(inner: str | None = None) -> None:
    """Register ``context_parallel`` with transformers' ``AttentionInterface``, wrapping the varlen backend
    ``inner`` (None: only the CPU reference kernel, and a forward without a plan is an error)."""
    from transformers import AttentionInterface

    register_attention_backends()
    forward = (context_parallel_attention_forward if inner is None
               else functools.partial(context_parallel_attention_forward, context_parallel_inner=inner))
    AttentionInterface.register(CONTEXT_PARALLEL, forward)


# ----------------------------------------------------------------------------
# The training run's groups: N consecutive ranks share each packed row


@dataclass(frozen=True)
class ContextGroup:
    """This rank's context-parallel group: ``size`` consecutive ranks that are one data rank to the sampler.

    Ranks ``[g * size, (g + 1) * size)`` form group ``g``; FSDP still shards
    over every rank (the group folds into the shard dimension, as torchtitan's
    ``dp_shard * cp``), so gradients need no extra reduction.
    """

    size: int
    rank: int  # place in the group
    data_rank: int  # the group's index: its rank for the sampler
    num_data_ranks: int
    group: dist.ProcessGroup | None  # None with size 1

    def tokens_per_data_rank(self, max_tokens_per_gpu: int) -> int:
        """The packer's budget of this group, one data rank to it: its GPUs' budgets together (each packed
        row is then split among them); ``max_tokens_per_gpu`` itself without context parallelism."""
        return max_tokens_per_gpu * self.size


def new_context_group(size: int, dist_info: DistInfo) -> ContextGroup:
    """Split the job into groups of ``size`` consecutive ranks (collective: every rank calls it)."""
    assert dist_info.world_size % size == 0, "checked at start-up"
    group = None
    if size > 1:
        group, _ = dist.new_subgroups(group_size=size)
    return ContextGroup(size=size, rank=dist_info.rank % size, data_rank=dist_info.rank // size,
                        num_data_ranks=dist_info.world_size // size, group=group)


def refusal(size: int, *, world_size: int, needs: AttentionNeeds, num_recurrent_mixers: int,
            router_loss: bool) -> str | None:
    """The one line that refuses ``--context-parallel-size size`` for this job and model, or None."""
    flag = f"--context-parallel-size {size}"
    if world_size % size:
        return f"{flag} needs a world size divisible by {size}, got {world_size} ranks"
    problems = [problem for bad, problem in (
        (num_recurrent_mixers > 0, f"{needs.model_class}'s {num_recurrent_mixers} linear-attention/SSM layers "
                                   "carry a state along the row, which a split row would cut"),
        (needs.sliding_window is not None, f"{needs.model_class}'s sliding-window attention"),
        (needs.softcap is not None, f"{needs.model_class}'s attention logit softcapping"),
        (needs.sinks, f"{needs.model_class}'s attention sinks"),
        (needs.attention_chunk_size is not None, f"{needs.model_class}'s chunked attention"),
        (router_loss, "the MoE router loss (per sample, over tokens the group splits; "
                      "set output_router_logits=false to train without it)"),
    ) if bad]
    return f"{flag} does not support {'; '.join(problems)} yet" if problems else None


def shard_step_batch(batch: StepBatch, context: ContextGroup, *, device: torch.device | str) -> StepBatch:
    """The group's step batch (the same on each of its ranks) with each minibatch cut to this rank's shard."""
    if context.size == 1:
        return batch
    return dataclasses.replace(batch, minibatches=[shard_minibatch(minibatch, context, device=device)
                                                   for minibatch in batch.minibatches])


def shard_minibatch(minibatch: Minibatch, context: ContextGroup, *, device: torch.device | str) -> Minibatch:
    """This rank's part of the group's packed row, as a ``Minibatch`` carrying its attention plan.

    A row shorter than the group (the sampler's 1-token dummy) first gets a
    padding document with IGNORE_INDEX labels, so every rank holds a token.
    ``num_loss_counted_tokens`` becomes this rank's own count: summed over
    ranks, the step's counts then equal the unsharded run's.
    """
    if minibatch.num_tokens < context.size:
        minibatch = _pad_row(minibatch, context.size)
    shard = shard_row(minibatch.input_ids, minibatch.labels, minibatch.position_ids, rank=context.rank,
                      num_ranks=context.size, group=context.group, device=device)
    plan = shard.plan
    return dataclasses.replace(
        minibatch, input_ids=shard.input_ids, labels=shard.labels, position_ids=shard.position_ids,
        cu_seqlens=plan.cu_seqlens_q.cpu(), max_seqlen=plan.max_seqlen_q,
        num_loss_counted_tokens=shard.num_loss_counted_tokens, num_tokens=int(shard.token_index.numel()),
        context_parallel_plan=plan)


def _pad_row(minibatch: Minibatch, num_tokens: int) -> Minibatch:
    """The row followed by one padding document of ``DUMMY_TOKEN_ID`` tokens up to ``num_tokens`` tokens."""
    extra = num_tokens - minibatch.num_tokens
    pad = (lambda row, value: torch.cat([row, row.new_full((1, extra), value)], dim=1))
    cu_seqlens = torch.cat([minibatch.cu_seqlens, minibatch.cu_seqlens.new_tensor([num_tokens])])
    return dataclasses.replace(
        minibatch, input_ids=pad(minibatch.input_ids, DUMMY_TOKEN_ID), labels=pad(minibatch.labels, IGNORE_INDEX),
        position_ids=torch.cat([minibatch.position_ids, torch.arange(extra).unsqueeze(0)], dim=1),
        cu_seqlens=cu_seqlens, max_seqlen=max(minibatch.max_seqlen, extra), num_tokens=num_tokens)
