"""Rules 1-6 of the minibatch planner, checked as properties and against references.

    .venv/bin/python -m pytest -q tests/test_packing.py
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minitrainer.data.packing import (_BestFit, batch_lengths_to_minibatches_lpt, bins_lower_bound, lpt_minibatches,
                                      minibatches_lower_bound, plan_minibatches, rank_loads, sample_costs)
from minitrainer.data.sampler import batch_lengths_to_minibatches

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def batches(draw, max_world: int = 64):
    """(lengths, budget, world): lengths in 1..budget, skewed towards short samples."""
    budget = draw(st.integers(min_value=1, max_value=4096))
    world = draw(st.integers(min_value=1, max_value=max_world))
    kind = draw(st.sampled_from(["uniform", "short", "long", "equal"]))
    n = draw(st.integers(min_value=0, max_value=300))
    if kind == "uniform":
        elements = st.integers(min_value=1, max_value=budget)
    elif kind == "short":
        elements = st.integers(min_value=1, max_value=max(1, budget // 16))
    elif kind == "long":
        elements = st.integers(min_value=max(1, budget // 3), max_value=budget)
    else:
        elements = st.just(draw(st.integers(min_value=1, max_value=budget)))
    lengths = draw(st.lists(elements, min_size=n, max_size=n))
    return lengths, budget, world


def best_fit_bins(lengths, budget) -> int:
    """Naive best-fit decreasing, an independent reference for the bin count."""
    residuals: list[int] = []
    for size in sorted(lengths, reverse=True):
        fitting = [i for i, r in enumerate(residuals) if r >= size]
        if fitting:
            best = min(fitting, key=lambda i: residuals[i])
            residuals[best] -= size
        else:
            residuals.append(budget - size)
    return len(residuals)


def best_fit_assignment(sorted_lengths, budget) -> list[int]:
    """Naive best-fit over samples in the given order: each sample's bin,
    the fullest bin it fits in, ties to the lower bin id."""
    residuals: list[int] = []
    bins = []
    for size in sorted_lengths:
        fitting = [i for i, r in enumerate(residuals) if r >= size]
        if fitting:
            best = min(fitting, key=lambda i: (residuals[i], i))
        else:
            best = len(residuals)
            residuals.append(budget)
        residuals[best] -= size
        bins.append(best)
    return bins


def check_rules_1_to_3(plan, lengths, budget, world):
    lengths = np.asarray(lengths, dtype=np.int64)
    # Rule 3: one slot per rank in every minibatch; empty slots are exactly [-1].
    assert all(len(minibatch) == world for minibatch in plan)
    for minibatch in plan:
        for slot in minibatch:
            assert slot == [-1] or (slot and -1 not in slot)
    # Rule 2: every sample exactly once.
    used = sorted(i for minibatch in plan for slot in minibatch for i in slot if i != -1)
    assert used == list(range(lengths.size))
    # Rule 1: budget never exceeded.
    loads = rank_loads(plan, lengths)
    assert loads.size == 0 or loads.max() <= budget
    return loads


@PROPERTY
@given(batches())
def test_plan_rules(batch):
    lengths, budget, world = batch
    plan = plan_minibatches(lengths, max_tokens_per_rank=budget, num_ranks=world)
    check_rules_1_to_3(plan, lengths, budget, world)
    if not lengths:
        assert plan == []
        return
    # Rule 4: between the lower bound and both LPT and best-fit decreasing.
    num_minibatches = len(plan)
    lpt = lpt_minibatches(lengths, max_tokens_per_rank=budget, num_ranks=world)
    assert minibatches_lower_bound(lengths, max_tokens_per_rank=budget, num_ranks=world) <= num_minibatches
    assert -(-bins_lower_bound(np.array(lengths), budget) // world) <= num_minibatches
    assert num_minibatches <= len(lpt)
    assert num_minibatches <= -(-best_fit_bins(lengths, budget) // world)
    # Rule 6: deterministic, and the same from a list or an array.
    again = plan_minibatches(np.array(lengths), max_tokens_per_rank=budget, num_ranks=world)
    assert again == plan


@PROPERTY
@given(batches(max_world=16), st.data())
def test_per_rank_view_is_a_column_of_the_global_plan(batch, data):
    lengths, budget, world = batch
    plan = plan_minibatches(lengths, max_tokens_per_rank=budget, num_ranks=world)
    columns = [batch_lengths_to_minibatches(lengths, budget, world, rank) for rank in range(world)]
    # Rule 3: the same number of minibatches on every rank.
    assert {len(column) for column in columns} == {len(plan)}
    rank = data.draw(st.integers(min_value=0, max_value=world - 1))
    assert columns[rank] == [minibatch[rank] for minibatch in plan]


@PROPERTY
@given(
    budget=st.integers(min_value=1, max_value=4096),
    fractions=st.lists(st.floats(min_value=0, max_value=1), max_size=700),
    split=st.floats(min_value=0, max_value=1),
)
def test_shared_best_fit_matches_naive_best_fit(budget, fractions, split):
    """The planner's best-fit (placed once, in blocks, resumable) gives every
    sample the bin naive best-fit gives it, whether asked in one go or in two."""
    lengths = sorted((int(f * budget) for f in fractions), reverse=True)
    sizes = np.array(lengths, dtype=np.int64)
    expected = best_fit_assignment(lengths, budget)
    assert _BestFit(sizes, budget).first(sizes.size).tolist() == expected
    resumed = _BestFit(sizes, budget)
    head = int(split * sizes.size)
    assert resumed.first(head).tolist() == expected[:head]
    assert resumed.first(sizes.size).tolist() == expected


@pytest.mark.parametrize("budget", [1024, 8192])
def test_shared_best_fit_matches_naive_best_fit_across_blocks(budget):
    lengths = sorted((int(x) for x in realistic_lengths(1500, seed=budget) if x <= budget), reverse=True)
    sizes = np.array(lengths, dtype=np.int64)
    resumed = _BestFit(sizes, budget)
    assert resumed.first(sizes.size // 3).tolist() + resumed.first(sizes.size).tolist()[sizes.size // 3 :] == (
        best_fit_assignment(lengths, budget)
    )


@PROPERTY
@given(batches(max_world=16))
def test_single_minibatch_is_balanced(batch):
    """Rule 5 where it can be stated exactly: with one minibatch, no rank carries
    more than the mean plus one sample (the LPT guarantee)."""
    lengths, budget, world = batch
    plan = plan_minibatches(lengths, max_tokens_per_rank=budget, num_ranks=world)
    if len(plan) == 1:
        loads = rank_loads(plan, lengths)[0]
        assert loads.max() <= max(lengths) + sum(lengths) / world


@PROPERTY
@given(batches(max_world=16), st.sampled_from(["attention", "custom"]))
def test_other_costs_keep_the_rules(batch, cost):
    lengths, budget, world = batch
    objective = (lambda x: np.sqrt(x.astype(np.float64))) if cost == "custom" else cost
    plan = plan_minibatches(lengths, max_tokens_per_rank=budget, num_ranks=world, cost=objective)
    check_rules_1_to_3(plan, lengths, budget, world)
    if lengths:
        lpt = lpt_minibatches(lengths, max_tokens_per_rank=budget, num_ranks=world)
        assert len(plan) <= len(lpt)


@PROPERTY
@given(batches())
def test_lpt_reference_keeps_rules_1_to_3(batch):
    lengths, budget, world = batch
    plan = lpt_minibatches(lengths, max_tokens_per_rank=budget, num_ranks=world)
    check_rules_1_to_3(plan, lengths, budget, world)
    rank = world - 1
    assert batch_lengths_to_minibatches_lpt(lengths, budget, world, rank) == [m[rank] for m in plan]


def realistic_lengths(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(640), 1.12, size=n)), 16, 131072).astype(np.int64)


@pytest.mark.parametrize("batch_size", [1024, 4096])
@pytest.mark.parametrize("world", [8, 64])
@pytest.mark.parametrize("budget", [8192, 32768])
def test_realistic_batches_are_tight_and_balanced(batch_size, world, budget):
    lengths = realistic_lengths(batch_size, seed=batch_size + world + budget)
    lengths = lengths[lengths <= budget]
    plan = plan_minibatches(lengths, max_tokens_per_rank=budget, num_ranks=world)
    loads = check_rules_1_to_3(plan, lengths, budget, world)
    lower = minibatches_lower_bound(lengths, max_tokens_per_rank=budget, num_ranks=world)
    assert len(plan) <= lower + 1
    assert len(plan) <= len(lpt_minibatches(lengths, max_tokens_per_rank=budget, num_ranks=world))
    # Rule 5, relative to what is attainable: a minibatch can be no faster than
    # its longest sample, so perfect balance is mean / max(mean, longest).
    mean = loads.mean(axis=1)
    longest = np.array([max(lengths[i] for slot in mb for i in slot if i != -1) for mb in plan])
    balance = mean / loads.max(axis=1)
    attainable = mean / np.maximum(mean, longest)
    assert (balance / attainable).mean() >= 0.95


def test_attention_cost_balances_squared_lengths():
    # Two ranks, one minibatch: 4 short samples against 1 long one of equal tokens.
    lengths = [4096, 1024, 1024, 1024, 1024]
    tokens = plan_minibatches(lengths, max_tokens_per_rank=8192, num_ranks=2, cost="tokens")
    attention = plan_minibatches(lengths, max_tokens_per_rank=8192, num_ranks=2, cost="attention")
    assert len(tokens) == len(attention) == 1
    costs = sample_costs(np.array(lengths), "attention")
    per_rank = [costs[slot].sum() for slot in attention[0]]
    assert min(per_rank) / max(per_rank) > 0.6
    assert sorted(map(sorted, tokens[0])) == [[0], [1, 2, 3, 4]]


def test_docstring_example():
    plan = plan_minibatches([9, 6, 5, 4, 3, 2, 1], max_tokens_per_rank=10, num_ranks=2)
    assert plan == [[[0], [1, 4]], [[2, 6], [3, 5]]]
    assert batch_lengths_to_minibatches([9, 6, 5, 4, 3, 2, 1], 10, 2, 1) == [[1, 4], [3, 5]]


def test_empty_slots_and_empty_batch():
    assert plan_minibatches([], max_tokens_per_rank=10, num_ranks=4) == []
    assert batch_lengths_to_minibatches([], 10, 4, 0) == []
    plan = plan_minibatches([3], max_tokens_per_rank=10, num_ranks=3)
    assert plan == [[[0], [-1], [-1]]]


def test_original_signature_leaves_over_budget_samples_out_with_a_warning():
    """The original's ``batch_lengths_to_minibatches`` contract: its collator dropped long samples."""
    from_sampler = batch_lengths_to_minibatches
    lengths = [9, 30, 6, 5, 4, 11, 3, 2, 1]
    kept = [0, 2, 3, 4, 6, 7, 8]
    plan = plan_minibatches([lengths[i] for i in kept], max_tokens_per_rank=10, num_ranks=2)
    for rank in range(2):
        warning = r"left out 2 sample\(s\) .*max_tokens_per_rank=10: batch indices \[1, 5\]"
        with pytest.warns(UserWarning, match=warning):
            column = from_sampler(lengths, 10, 2, rank)
        assert column == [[kept[i] if i >= 0 else -1 for i in minibatch[rank]] for minibatch in plan]
    with pytest.warns(UserWarning):
        assert from_sampler([11, 12], 10, 2, 0) == []


def test_invalid_inputs_are_rejected():
    with pytest.raises(ValueError, match="sample 1 has 11 tokens"):
        plan_minibatches([3, 11], max_tokens_per_rank=10, num_ranks=2)
    with pytest.raises(ValueError, match="num_ranks"):
        plan_minibatches([3], max_tokens_per_rank=10, num_ranks=0)
    with pytest.raises(ValueError, match="rank 2 outside"):
        batch_lengths_to_minibatches([3], 10, 2, 2)
    with pytest.raises(ValueError, match="unknown cost"):
        plan_minibatches([3], max_tokens_per_rank=10, num_ranks=1, cost="flops")


def test_large_batch_is_fast_and_linear_in_memory():
    """16k samples: the old planner's batch x batch matrix would be 2 GiB."""
    import time
    import tracemalloc

    lengths = realistic_lengths(16384, seed=0)
    lengths = lengths[lengths <= 32768]
    tracemalloc.start()
    start = time.perf_counter()
    plan = plan_minibatches(lengths, max_tokens_per_rank=32768, num_ranks=64)
    elapsed = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    check_rules_1_to_3(plan, lengths, 32768, 64)
    assert peak < 64 * 2**20
    assert elapsed < 5.0
