"""Token-budgeted packing of one optimizer batch into per-rank minibatches.

Pure planning on lengths: numpy and the standard library only, no torch and no
``torch.distributed``. Every rank calls the same function on the same lengths
and gets the same global plan, then keeps its own column.

A plan is indexed ``plan[minibatch][rank]`` and holds indices into the batch;
a slot with nothing to do holds ``[-1]`` (the caller feeds a dummy sample that
counts zero loss tokens). Example, 7 samples, 2 ranks, budget 10 tokens::

    lengths = [9, 6, 5, 4, 3, 2, 1]     total 30 -> lower bound ceil(30 / (2 * 10)) = 2
    plan    = [[[0],    [1, 4]],        minibatch 0: rank 0 = 9,     rank 1 = 6+3 = 9
               [[2, 6], [3, 5]]]        minibatch 1: rank 0 = 5+1 = 6, rank 1 = 4+2 = 6

    rank 0:  |9 9 9 9 9 9 9 9 9|        then  |5 5 5 5 5|1|
    rank 1:  |6 6 6 6 6 6|3 3 3|        then  |4 4 4 4|2 2|

How (``plan_minibatches``): ``k`` minibatches are ``k * num_ranks`` bins of
capacity ``max_tokens_per_rank``, so planning is bin packing plus balancing.

1. ``k`` starts at the Martello-Toth L2 bin-packing lower bound (divided by
   the world size), which is at least ``ceil(total / (num_ranks * budget))``.
2. Balanced packing at ``k``: LPT over all bins (the next longest sample goes
   to the neediest bin), vectorized in rounds, with the small tail
   water-filled in one step. Samples costlier than the level the bins would
   reach ("outliers") get a minibatch of their own kind, whose other ranks
   are filled up towards the outlier, so no rank idles next to it.
3. If that overflows: best-fit for samples over a quarter budget (they need
   careful pairing), worst-fit for the rest.
4. If that overflows too: best-fit decreasing with as many bins as it needs
   sets ``k``; with several ranks steps 2-3 are retried there (for
   balance), else (and with one rank) its own packing is used.
   If LPT would need fewer minibatches (never seen), its plan is returned,
   so "never more than LPT" holds by construction.

Free bins are finally sorted by cost and dealt out ``num_ranks`` at a time,
so each minibatch gets bins of similar load, heaviest minibatch first.

The balance objective is pluggable (``cost``): ``"tokens"`` balances token
counts; ``"attention"`` balances ``len + alpha * len**2`` because attention
time grows with the square of each sample's length; any callable mapping a
lengths array to a float cost array works too. The token budget is always the
hard constraint. Memory is linear in the batch size; the old planner's
batch x batch matrix is gone.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Callable, Sequence

import numpy as np

ATTENTION_ALPHA = 1.0 / 32768
"""Weight of ``len**2`` in the "attention" cost. Per sample, attention FLOPs are
about ``num_layers * hidden * len**2`` against ``num_params * len`` for the
linear layers, so alpha ~ num_layers * hidden / num_params: 28 * 1536 / 1.5e9
~ 1/35000 for Qwen2.5-1.5B."""

Cost = str | Callable[[np.ndarray], np.ndarray]
Plan = list[list[list[int]]]


def sample_costs(lengths: np.ndarray, cost: Cost = "tokens") -> np.ndarray:
    """Per-sample cost that the balancer equalizes across ranks.

    Args:
        lengths: int array of sample lengths.
        cost: "tokens", "attention" (``len + ATTENTION_ALPHA * len**2``), or a
            callable from the lengths array to a float array of the same shape.

    Returns:
        float64 array of costs.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if callable(cost):
        costs = np.asarray(cost(lengths), dtype=np.float64)
        if costs.shape != lengths.shape:
            raise ValueError(f"cost callable returned shape {costs.shape}, expected {lengths.shape}")
        return costs
    if cost == "tokens":
        return lengths.astype(np.float64)
    if cost == "attention":
        as_float = lengths.astype(np.float64)
        return as_float + ATTENTION_ALPHA * as_float * as_float
    raise ValueError(f"unknown cost {cost!r}: expected 'tokens', 'attention' or a callable")


def minibatches_lower_bound(lengths: Sequence[int] | np.ndarray, *, max_tokens_per_rank: int, num_ranks: int) -> int:
    """``ceil(total_tokens / (num_ranks * max_tokens_per_rank))``: the issue's lower bound."""
    total = int(np.sum(np.asarray(lengths, dtype=np.int64)))
    capacity = num_ranks * max_tokens_per_rank
    return -(-total // capacity)


def bins_lower_bound(lengths: np.ndarray, capacity: int) -> int:
    """Martello-Toth L2 lower bound on the number of bins of ``capacity``.

    For every threshold ``a <= capacity / 2``: samples longer than
    ``capacity - a`` each need their own bin; samples in
    ``(capacity / 2, capacity - a]`` each need a bin too (no two share one), and
    samples in ``[a, capacity / 2]`` must fit in those bins' leftover room or in
    new bins. ``a = 0`` gives ``ceil(total / capacity)``.
    """
    return _bins_lower_bound_sorted(np.sort(np.asarray(lengths, dtype=np.int64)), capacity)


def _bins_lower_bound_sorted(sizes: np.ndarray, capacity: int) -> int:
    """``bins_lower_bound`` of sizes already sorted shortest first."""
    if sizes.size == 0:
        return 0
    prefix = np.concatenate(([0], np.cumsum(sizes)))
    half = capacity // 2
    # Thresholds: 0 plus sizes up to capacity / 2. Any threshold gives a valid
    # bound, so at most _MAX_THRESHOLDS evenly spaced ones are tried (speed).
    small = sizes[: np.searchsorted(sizes, half, side="right")]
    step = max(1, small.size // _MAX_THRESHOLDS)
    alphas = np.concatenate(([0], small[::step]))
    n = sizes.size
    # Index boundaries in the ascending array.
    lo3 = np.searchsorted(sizes, alphas, side="left")  # first size >= a
    hi3 = np.searchsorted(sizes, half, side="right")  # first size > capacity/2
    hi2 = np.searchsorted(sizes, capacity - alphas, side="right")  # first size > capacity - a
    count1 = n - hi2
    count2 = hi2 - hi3
    sum2 = prefix[hi2] - prefix[hi3]
    sum3 = prefix[hi3] - prefix[lo3]
    spill = sum3 - (count2 * capacity - sum2)
    extra = np.where(spill > 0, -(-spill // capacity), 0)
    return int(np.max(count1 + count2 + extra))


_MAX_THRESHOLDS = 256


# ----------------------------------------------------------------------------
# Bin packers on samples sorted longest first. Each returns the bin of every
# sample, or None when the samples do not fit in ``num_bins`` bins.


def _worst_fit(
    sizes: np.ndarray,
    costs: np.ndarray,
    loads: np.ndarray,
    cost_loads: np.ndarray,
    targets: np.ndarray,
    capacity: int,
) -> np.ndarray | None:
    """LPT towards per-bin targets: the next longest sample goes to the bin
    furthest below its target cost (with equal targets: the least loaded bin).
    Updates ``loads``/``cost_loads`` in place.

    Vectorized in rounds: the j-th longest of the next samples goes to the
    j-th neediest bin for as long as one-by-one LPT would do the same (bin j's
    need must be at least every earlier bin's need after its new sample). A
    sample that does not fit there goes to the neediest bin that fits. Once the
    samples left are small against the final level, they are water-filled in
    one vectorized step (``_water_fill``).
    """
    bins = np.empty(sizes.size, dtype=np.int64)
    remaining = np.cumsum(costs[::-1])[::-1]
    start = 0
    while start < sizes.size:
        level = (cost_loads.sum() + remaining[start]) / loads.size
        if costs[start] * _WATER_FILL_RATIO <= level:
            filled = _water_fill(sizes[start:], costs[start:], loads, cost_loads, targets, capacity)
            if filled is not None:
                bins[start:] = filled
                return bins
        priority = cost_loads - targets
        target = np.argsort(priority, kind="stable")[: sizes.size - start]
        cost = costs[start : start + target.size]
        after = priority[target] + cost
        ok = priority[target[1:]] <= np.minimum.accumulate(after[:-1])
        count = 1 + (target.size - 1 if ok.all() else int(np.argmin(ok)))
        target = target[:count]
        cost = cost[:count]
        size = sizes[start : start + count]
        fits = loads[target] + size <= capacity
        bins[start : start + count] = target
        # Targets are distinct bins, so the fitting samples are placed at once.
        if fits.all():
            loads[target] += size
            cost_loads[target] += cost
            start += count
            continue
        placed = target[fits]
        loads[placed] += size[fits]
        cost_loads[placed] += cost[fits]
        for j in np.flatnonzero(~fits):
            room = np.flatnonzero(loads + size[j] <= capacity)
            if room.size == 0:
                return None
            chosen = room[np.argmin(cost_loads[room] - targets[room])]
            loads[chosen] += size[j]
            cost_loads[chosen] += cost[j]
            bins[start + j] = chosen
        start += count
    return bins


_WATER_FILL_RATIO = 64
"""Water-fill once the next sample costs at most 1/64 of the mean bin level:
each bin then lands within one (small) sample of its share."""


def _water_fill(
    sizes: np.ndarray,
    costs: np.ndarray,
    loads: np.ndarray,
    cost_loads: np.ndarray,
    targets: np.ndarray,
    capacity: int,
) -> np.ndarray | None:
    """Raise the neediest bins to a common level with the remaining (small) samples.

    The level ``lam`` solves ``sum(max(0, lam - need_b)) = remaining cost``;
    the bins' shortfalls are laid end to end and each sample goes to the bin
    under its midpoint::

        shortfall  |--- bin 4 ---|-- bin 1 --|- bin 7 -|
        samples    |aaa|bbb|cc|cc|dd|d|d|d|d|e|e|e|e|e|

    Returns None (and changes nothing) if that would overflow a bin.
    """
    priority = cost_loads - targets
    ascending = np.sort(priority)
    total = float(costs.sum())
    filled = np.arange(1, ascending.size + 1)
    levels = (total + np.cumsum(ascending)) / filled
    upper = np.append(ascending[1:], np.inf)
    lam = levels[int(np.argmax(levels <= upper))]
    shortfall = np.maximum(lam - priority, 0.0)
    by_need = np.argsort(-shortfall, kind="stable")
    edges = np.cumsum(shortfall[by_need])
    middles = np.cumsum(costs) - costs / 2
    slot = np.minimum(np.searchsorted(edges, middles, side="right"), by_need.size - 1)
    bins = by_need[slot]
    new_loads = loads + np.bincount(bins, weights=sizes, minlength=loads.size).astype(np.int64)
    if new_loads.max() > capacity:
        return None
    loads[:] = new_loads
    cost_loads += np.bincount(bins, weights=costs, minlength=loads.size)
    return bins


_BEST_FIT_BLOCK = 256
"""Samples best-fit places between two merges of its set-aside bins."""


class _BestFit:
    """Unbounded best-fit over samples sorted longest first: each sample goes
    to the fullest bin it fits in, ties to the lower bin id, and a new bin
    opens when nothing fits. Bins open in id order, so the first ``count``
    samples' bins are exactly what best-fit into ``num_bins`` bins gives when
    they use at most ``num_bins`` of them (else that fails). The placement is
    computed once, as far as asked: the tight packing's head and the best-fit
    fallback share one pass.
    """

    def __init__(self, sizes: np.ndarray, capacity: int):
        self.sizes = sizes
        self.capacity = capacity
        self.stride = sizes.size + 1
        # Sorted keys residual * stride + bin of the open bins: bisect finds
        # the tightest bin with room.
        self.keys: list[int] = []
        self.num_bins = 0
        self.bins = np.zeros(0, dtype=np.int64)

    def first(self, count: int) -> np.ndarray:
        """Bins of the first ``count`` samples."""
        if count > self.bins.size:
            self.bins = np.concatenate([self.bins, self._place(self.sizes[self.bins.size : count])])
        return self.bins[:count]

    def _place(self, sizes: np.ndarray) -> np.ndarray:
        capacity, stride, keys = self.capacity, self.stride, self.keys
        num_big = 0
        if not keys:
            # Samples over half the budget never share a bin, so the i-th of
            # the leading ones goes alone into a new bin: placed at once.
            over_half = 2 * sizes > capacity
            num_big = sizes.size if over_half.all() else int(np.argmin(over_half))
        big = np.arange(num_big)
        keys.extend(np.sort((capacity - sizes[:num_big]) * stride + big).tolist())
        fresh = capacity * stride + num_big + self.num_bins  # key of the next bin to open
        chosen = []
        append = chosen.append
        scaled_sizes = sizes[num_big:] * stride
        for begin in range(0, scaled_sizes.size, _BEST_FIT_BLOCK):
            block = scaled_sizes[begin : begin + _BEST_FIT_BLOCK]
            # Bins with less room than the block's smallest sample are out of
            # its reach: they wait in ``spent`` (with the bins that drop below
            # it) and are merged back after the block, so the list that is
            # bisected and edited per sample stays short.
            floor = int(block.min())
            cut = bisect_left(keys, floor)
            spent, live = keys[:cut], keys[cut:]
            pop = live.pop
            for scaled in block.tolist():
                at = bisect_left(live, scaled)
                try:
                    key = pop(at)
                except IndexError:
                    key = fresh
                    fresh += 1
                left = key - scaled
                if left < floor:
                    spent.append(left)
                else:
                    # The bin's key only shrinks, so it goes back at or before ``at``.
                    insort(live, left, 0, at)
                append(key)
            spent.extend(live)
            spent.sort()
            keys = spent
        self.keys = keys
        self.num_bins = fresh - capacity * stride
        rest = np.array(chosen, dtype=np.int64) % stride
        return np.concatenate([big, rest]) if num_big else rest


def _balanced_targets(sorted_costs: np.ndarray, num_minibatches: int, num_ranks: int) -> tuple[int, np.ndarray]:
    """Outliers and per-slot target costs for a balanced plan.

    With every bin at the mean cost, a sample costlier than the mean would
    leave its minibatch's other ranks idle. So the costliest samples (those
    above the level the other bins reach) get a slot each, ``num_ranks`` per
    minibatch, and every rank of such a minibatch is filled towards that
    minibatch's largest sample; the other bins share the rest evenly.

    Returns:
        ``(num_outliers, targets)``: sample ``i < num_outliers`` is pre-placed
        in slot ``i``; ``targets`` has one cost per slot.
    """
    num_bins = num_minibatches * num_ranks
    total = float(sorted_costs.sum())
    num_outliers = 0
    while True:
        num_heavy = -(-num_outliers // num_ranks)
        heads = sorted_costs[0 : num_heavy * num_ranks : num_ranks]
        if num_heavy >= num_minibatches:
            # Everything is an outlier: plain LPT over all bins.
            return 0, np.full(num_bins, total / num_bins)
        level = (total - num_ranks * float(heads.sum())) / (num_bins - num_heavy * num_ranks)
        count = int(np.searchsorted(-sorted_costs, -level, side="left"))
        if count <= num_outliers:
            break
        num_outliers = count
    targets = np.full(num_bins, level)
    targets[: num_heavy * num_ranks] = np.repeat(heads, num_ranks)
    return num_outliers, targets


def _pack_balanced(
    sizes: np.ndarray, costs: np.ndarray, num_minibatches: int, num_ranks: int, capacity: int
) -> tuple[np.ndarray, int] | None:
    """Balanced packing into ``num_minibatches * num_ranks`` bins, or None.

    Returns:
        ``(bins, num_fixed)``: bin ``b`` is slot (b // num_ranks, b % num_ranks)
        for ``b < num_fixed``; the other bins are dealt out by load later.
    """
    num_bins = num_minibatches * num_ranks
    num_outliers, targets = _balanced_targets(costs, num_minibatches, num_ranks)
    loads = np.zeros(num_bins, dtype=np.int64)
    cost_loads = np.zeros(num_bins, dtype=np.float64)
    loads[:num_outliers] = sizes[:num_outliers]
    cost_loads[:num_outliers] = costs[:num_outliers]
    rest = _worst_fit(sizes[num_outliers:], costs[num_outliers:], loads, cost_loads, targets, capacity)
    if rest is None:
        return None
    num_fixed = -(-num_outliers // num_ranks) * num_ranks
    return np.concatenate([np.arange(num_outliers), rest]), num_fixed


def _pack_tight(
    sizes: np.ndarray, costs: np.ndarray, num_bins: int, capacity: int, best_fit: _BestFit
) -> np.ndarray | None:
    """Best-fit the samples longer than a quarter budget (they need careful
    pairing), worst-fit the rest for balance; None if that does not fit."""
    split = int(np.searchsorted(-sizes, -(capacity // 4), side="right"))
    head_bins = best_fit.first(split)
    if split and head_bins.max() >= num_bins:
        return None
    loads = np.bincount(head_bins, weights=sizes[:split], minlength=num_bins).astype(np.int64)
    cost_loads = np.bincount(head_bins, weights=costs[:split], minlength=num_bins).astype(np.float64)
    flat = np.zeros(num_bins, dtype=np.float64)
    tail_bins = _worst_fit(sizes[split:], costs[split:], loads, cost_loads, flat, capacity)
    if tail_bins is None:
        return None
    return np.concatenate([head_bins, tail_bins])


def _pack_at(
    sizes: np.ndarray, costs: np.ndarray, num_minibatches: int, num_ranks: int, capacity: int, best_fit: _BestFit
) -> tuple[np.ndarray, int] | None:
    """Balanced packing if it fits, else the tight one, else None."""
    if num_ranks > 1:
        # With one rank a minibatch is one bin: nothing to balance, only to pack.
        packed = _pack_balanced(sizes, costs, num_minibatches, num_ranks, capacity)
        if packed is not None:
            return packed
    tight = _pack_tight(sizes, costs, num_minibatches * num_ranks, capacity, best_fit)
    return None if tight is None else (tight, 0)


# ----------------------------------------------------------------------------
# Public planners


def _check_inputs(sizes: np.ndarray, max_tokens_per_rank: int, num_ranks: int) -> None:
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if max_tokens_per_rank < 1:
        raise ValueError(f"max_tokens_per_rank must be >= 1, got {max_tokens_per_rank}")
    if sizes.ndim != 1:
        raise ValueError(f"lengths must be one-dimensional, got shape {sizes.shape}")
    if sizes.size and (sizes.min() < 0 or sizes.max() > max_tokens_per_rank):
        bad = int(np.flatnonzero((sizes < 0) | (sizes > max_tokens_per_rank))[0])
        raise ValueError(
            f"sample {bad} has {int(sizes[bad])} tokens, outside 0..max_tokens_per_rank={max_tokens_per_rank}; "
            "drop over-long samples before planning"
        )


def plan_minibatches(
    lengths: Sequence[int] | np.ndarray, *, max_tokens_per_rank: int, num_ranks: int, cost: Cost = "tokens"
) -> Plan:
    """Global plan for one optimizer batch: ``plan[minibatch][rank]`` -> batch indices.

    Guarantees: no slot holds more than ``max_tokens_per_rank`` tokens; every
    sample appears exactly once; every rank has the same number of minibatches
    (an empty slot is ``[-1]``); that number is the smallest this search finds,
    starting at the L2 lower bound, and never more than ``lpt_minibatches``;
    within a minibatch the ranks' costs are balanced; the result depends only on
    the arguments. An empty batch gives ``[]``.

    Args:
        lengths: tokens per sample of the batch, each in ``0..max_tokens_per_rank``.
        max_tokens_per_rank: token budget of one rank's packed minibatch.
        num_ranks: world size.
        cost: balance objective, see ``sample_costs``.

    Returns:
        The plan; minibatches ordered heaviest first.
    """
    sizes = np.asarray(lengths, dtype=np.int64).reshape(-1) if len(lengths) else np.zeros(0, dtype=np.int64)
    _check_inputs(sizes, max_tokens_per_rank, num_ranks)
    n = sizes.size
    if n == 0:
        return []
    costs = sample_costs(sizes, cost)
    order_is_by_length = isinstance(cost, str) and cost in ("tokens", "attention")
    if order_is_by_length:
        # Both costs grow with length, so longest first is also costliest first.
        order = np.argsort(-sizes, kind="stable")
    else:
        order = np.lexsort((np.arange(n), -sizes, -costs))
    sorted_sizes = sizes[order]
    sorted_costs = costs[order]

    if order_is_by_length:
        ascending = sorted_sizes[::-1]
    else:
        ascending = np.sort(sizes)
    lower = max(1, -(-_bins_lower_bound_sorted(ascending, max_tokens_per_rank) // num_ranks))
    num_minibatches = lower
    best_fit = _BestFit(sorted_sizes, max_tokens_per_rank)
    packed = _pack_at(sorted_sizes, sorted_costs, lower, num_ranks, max_tokens_per_rank, best_fit)
    if packed is None:
        # Best-fit decreasing with as many bins as it needs sets the count.
        fallback = best_fit.first(n)
        num_minibatches = max(lower, -(-(int(fallback.max()) + 1) // num_ranks))
        if num_minibatches > lower and num_ranks > 1:
            # With one rank a minibatch is one bin, so best-fit's own packing
            # is as good at this count: the retry is for balance across ranks.
            packed = _pack_at(sorted_sizes, sorted_costs, num_minibatches, num_ranks, max_tokens_per_rank, best_fit)
        if packed is None:
            packed = fallback, 0
        if num_minibatches > lower and _lpt_count(sorted_sizes, max_tokens_per_rank, num_ranks) < num_minibatches:
            # Never seen in practice; keeps "never more than LPT" true by construction.
            return lpt_minibatches(sizes, max_tokens_per_rank=max_tokens_per_rank, num_ranks=num_ranks)
    bins, num_fixed = packed
    return _deal_bins(order, bins, num_fixed, sorted_sizes, sorted_costs, num_minibatches, num_ranks)


def _deal_bins(
    order: np.ndarray,
    bins: np.ndarray,
    num_fixed: int,
    sorted_sizes: np.ndarray,
    sorted_costs: np.ndarray,
    num_minibatches: int,
    num_ranks: int,
) -> Plan:
    """Turn bins into the plan. Bins below ``num_fixed`` keep their slot; the
    others are sorted heaviest first and dealt ``num_ranks`` at a time, so the
    bins of one minibatch have neighbouring loads. Slot ``s`` is (s // W, s % W);
    minibatches are then ordered by their heaviest bin."""
    num_bins = num_minibatches * num_ranks
    bin_cost = np.bincount(bins, weights=sorted_costs, minlength=num_bins)
    bin_load = np.bincount(bins, weights=sorted_sizes, minlength=num_bins)
    free = np.arange(num_fixed, num_bins)
    by_weight = free[np.lexsort((free, -bin_load[free], -bin_cost[free]))]
    slot_of_bin = np.arange(num_bins)
    slot_of_bin[by_weight] = free
    slot_cost = np.empty(num_bins)
    slot_cost[slot_of_bin] = bin_cost
    minibatch_order = np.argsort(-slot_cost.reshape(num_minibatches, num_ranks).max(axis=1), kind="stable")
    slots = slot_of_bin[bins]
    # uint16 keys get numpy's (much faster) stable radix sort.
    sort_keys = slots.astype(np.uint16) if num_bins <= 1 << 16 else slots
    indices = order[np.argsort(sort_keys, kind="stable")].tolist()
    counts = np.bincount(slots, minlength=num_bins)
    ends = np.cumsum(counts)
    # Slots in plan order: minibatch by minibatch, rank by rank.
    slot_order = (minibatch_order[:, None] * num_ranks + np.arange(num_ranks)).reshape(-1)
    flat = [
        indices[start:end] or [-1]
        for start, end in zip((ends - counts)[slot_order].tolist(), ends[slot_order].tolist())
    ]
    if num_ranks == 1:
        return [[slot] for slot in flat]
    return [flat[at : at + num_ranks] for at in range(0, num_bins, num_ranks)]


def lpt_minibatches(lengths: Sequence[int] | np.ndarray, *, max_tokens_per_rank: int, num_ranks: int) -> Plan:
    """The original mini_trainer's LPT planner, reimplemented as the baseline.

    Samples are sorted longest first. Each minibatch takes the longest prefix of
    the remaining samples that LPT (longest first onto the least loaded rank)
    fits into ``num_ranks`` budgets, found by binary search, and distributes it
    with LPT. Same output format as ``plan_minibatches``.
    """
    sizes = np.asarray(lengths, dtype=np.int64).reshape(-1) if len(lengths) else np.zeros(0, dtype=np.int64)
    _check_inputs(sizes, max_tokens_per_rank, num_ranks)
    order = np.argsort(-sizes, kind="stable")
    sorted_sizes = sizes[order]
    plan: Plan = []
    for start, end in _lpt_prefixes(sorted_sizes, max_tokens_per_rank, num_ranks):
        ranks: list[list[int]] = [[] for _ in range(num_ranks)]
        heap = [(0, r) for r in range(num_ranks)]
        for i in range(start, end):
            load, r = heap[0]
            ranks[r].append(int(order[i]))
            heapq.heapreplace(heap, (load + int(sorted_sizes[i]), r))
        plan.append([row if row else [-1] for row in ranks])
    return plan


def _lpt_prefixes(sorted_sizes: np.ndarray, max_tokens_per_rank: int, num_ranks: int) -> list[tuple[int, int]]:
    """LPT's minibatches as ``(start, end)`` ranges of the longest-first samples."""
    prefix = np.cumsum(sorted_sizes)
    n = sorted_sizes.size
    ranges = []
    start = 0
    while start < n:
        before = int(prefix[start - 1]) if start else 0
        # No prefix can hold more than num_ranks budgets of tokens.
        limit = int(np.searchsorted(prefix[start:], before + num_ranks * max_tokens_per_rank, side="right"))
        left, right = 1, min(n - start + 1, limit + 1)
        if num_ranks == 1:
            # One rank: fitting is the (monotone) sum check, so the limit is exact.
            left = right - 1
        while right - left > 1:
            mid = (left + right) // 2
            if _lpt_fits(sorted_sizes[start : start + mid].tolist(), max_tokens_per_rank, num_ranks):
                left = mid
            else:
                right = mid
        ranges.append((start, start + left))
        start += left
    return ranges


def _lpt_count(sorted_sizes: np.ndarray, max_tokens_per_rank: int, num_ranks: int) -> int:
    """Number of LPT minibatches; with one rank (next-fit decreasing) in O(n log n) numpy."""
    if num_ranks > 1:
        return len(_lpt_prefixes(sorted_sizes, max_tokens_per_rank, num_ranks))
    prefix = np.concatenate(([0], np.cumsum(sorted_sizes)))
    # jump[i]: where a minibatch starting at sample i ends.
    jump = np.searchsorted(prefix, prefix[:-1] + max_tokens_per_rank, side="right") - 1
    jump = jump.tolist()
    count, at = 0, 0
    while at < sorted_sizes.size:
        at = jump[at]
        count += 1
    return count


def _lpt_fits(sizes: list[int], max_tokens_per_rank: int, num_ranks: int) -> bool:
    heap = [0] * num_ranks
    for size in sizes:
        load = heap[0] + size
        if load > max_tokens_per_rank:
            return False
        heapq.heapreplace(heap, load)
    return True


def batch_lengths_to_minibatches_lpt(
    batch_lengths: Sequence[int], max_tokens_per_rank: int, num_ranks: int, rank: int
) -> list[list[int]]:
    """The LPT reference with the original signature."""
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank {rank} outside 0..{num_ranks - 1}")
    plan = lpt_minibatches(batch_lengths, max_tokens_per_rank=max_tokens_per_rank, num_ranks=num_ranks)
    return [minibatch[rank] for minibatch in plan]


def rank_loads(plan: Plan, lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """Tokens per (minibatch, rank) slot, dummies counting 0: int64 ``[k, num_ranks]``."""
    sizes = np.asarray(lengths, dtype=np.int64)
    if not plan:
        return np.zeros((0, 0), dtype=np.int64)
    loads = np.zeros((len(plan), len(plan[0])), dtype=np.int64)
    for m, minibatch in enumerate(plan):
        for r, slot in enumerate(minibatch):
            if slot != [-1]:
                loads[m, r] = int(sizes[slot].sum())
    return loads
