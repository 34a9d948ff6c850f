"""Benchmark the minibatch planner against the LPT reference, side by side.

    .venv/bin/python -m bench.bench_packer                       # table + bench/bench_packer.json
    .venv/bin/python -m bench.bench_packer --repeats 3 --output-json /dev/null

For batch sizes 128/1024/4096, world sizes 1/8/64 and budgets 8k/32k/128k
tokens (27 configurations) on two length distributions, it reports per
planner: minibatches against the lower bound ceil(tokens / (world * budget)),
utilization tokens / (minibatches * world * budget), mean per-minibatch
balance (mean rank tokens / max rank tokens, dummies counting 0), the same
relative to the attainable balance mean / max(mean, longest sample of the
minibatch), and the median time per call. Samples longer than the budget are dropped first, as the
loader does. Not part of the test suite.

Distributions (one seeded draw per configuration):
- realistic: lognormal, median 640 tokens, sigma 1.12 (p99 ~8.7k), clipped to 16..131072.
- long: lognormal, median 8192 tokens, sigma 1.0, clipped to 256..131072.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import numpy as np


from minitrainer.data.packing import lpt_minibatches, minibatches_lower_bound, plan_minibatches, rank_loads

BATCH_SIZES = (128, 1024, 4096)
WORLD_SIZES = (1, 8, 64)
BUDGETS = (8192, 32768, 131072)
DISTRIBUTIONS = {
    "realistic": dict(median=640, sigma=1.12, low=16, high=131072),
    "long": dict(median=8192, sigma=1.0, low=256, high=131072),
}
PLANNERS = {"plan": plan_minibatches, "lpt": lpt_minibatches}


def draw_lengths(distribution: str, batch_size: int, seed: int) -> np.ndarray:
    spec = DISTRIBUTIONS[distribution]
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(mean=np.log(spec["median"]), sigma=spec["sigma"], size=batch_size)
    return np.clip(np.round(raw), spec["low"], spec["high"]).astype(np.int64)


def check_plan(plan: list, lengths: np.ndarray, budget: int, world: int) -> np.ndarray:
    """Rules 1-3; returns the [minibatch, rank] token loads."""
    used = sorted(i for minibatch in plan for slot in minibatch for i in slot if i != -1)
    assert used == list(range(lengths.size)), "every sample exactly once"
    assert all(len(minibatch) == world for minibatch in plan), "one slot per rank"
    loads = rank_loads(plan, lengths)
    assert loads.size == 0 or loads.max() <= budget, "budget exceeded"
    return loads


def time_call(planner, lengths: np.ndarray, budget: int, world: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        planner(lengths, max_tokens_per_rank=budget, num_ranks=world)
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def run(repeats: int) -> list[dict]:
    rows = []
    for (d_index, distribution), batch_size, world, budget in itertools.product(
        enumerate(DISTRIBUTIONS), BATCH_SIZES, WORLD_SIZES, BUDGETS
    ):
        seed = 1000 * d_index + 7 * batch_size + world + budget
        drawn = draw_lengths(distribution, batch_size, seed)
        lengths = drawn[drawn <= budget]
        lower = minibatches_lower_bound(lengths, max_tokens_per_rank=budget, num_ranks=world)
        row = dict(
            distribution=distribution,
            batch_size=batch_size,
            world_size=world,
            budget=budget,
            num_samples=int(lengths.size),
            num_dropped=int(drawn.size - lengths.size),
            num_tokens=int(lengths.sum()),
            lower_bound=lower,
        )
        for name, planner in PLANNERS.items():
            plan = planner(lengths, max_tokens_per_rank=budget, num_ranks=world)
            loads = check_plan(plan, lengths, budget, world)
            mean = loads.mean(axis=1)
            balance = mean / np.maximum(loads.max(axis=1), 1)
            # A minibatch is never faster than its longest sample: the best
            # attainable balance is mean / max(mean, longest).
            longest = np.array([max(lengths[i] for slot in mb for i in slot if i != -1) for mb in plan])
            attainable = mean / np.maximum(mean, longest)
            row[f"{name}_minibatches"] = len(plan)
            row[f"{name}_utilization"] = float(lengths.sum() / max(1, len(plan) * world * budget))
            row[f"{name}_balance"] = float(balance.mean()) if len(plan) else 1.0
            row[f"{name}_balance_vs_attainable"] = float((balance / attainable).mean()) if len(plan) else 1.0
            row[f"{name}_ms"] = time_call(planner, lengths, budget, world, repeats)
        rows.append(row)
    return rows


def summarize(rows: list[dict]) -> dict:
    summary = {}
    for distribution in DISTRIBUTIONS:
        mine = [r for r in rows if r["distribution"] == distribution]
        multi = [r for r in mine if r["world_size"] > 1]
        at_4096 = [r for r in mine if r["batch_size"] == 4096]
        entry = {"lower_bound": sum(r["lower_bound"] for r in mine)}
        for name in PLANNERS:
            total = sum(r[f"{name}_minibatches"] for r in mine)
            entry[name] = dict(
                minibatches=total,
                over_lower_bound=total / entry["lower_bound"] - 1,
                mean_balance=float(np.mean([r[f"{name}_balance"] for r in mine])),
                mean_balance_world_gt_1=float(np.mean([r[f"{name}_balance"] for r in multi])),
                mean_balance_vs_attainable=float(np.mean([r[f"{name}_balance_vs_attainable"] for r in mine])),
                mean_utilization=float(np.mean([r[f"{name}_utilization"] for r in mine])),
                median_ms_at_4096=float(np.median([r[f"{name}_ms"] for r in at_4096])),
                max_ms_at_4096=float(np.max([r[f"{name}_ms"] for r in at_4096])),
            )
        entry["configs_plan_worse_than_lpt"] = sum(r["plan_minibatches"] > r["lpt_minibatches"] for r in mine)
        summary[distribution] = entry
    return summary


def print_table(rows: list[dict], summary: dict) -> None:
    header = (
        f"{'dist':<9} {'batch':>5} {'world':>5} {'budget':>6} {'drop':>4} {'LB':>4} | "
        f"{'plan':>4} {'util':>5} {'bal':>5} {'ms':>6} | {'lpt':>4} {'util':>5} {'bal':>5} {'ms':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['distribution']:<9} {r['batch_size']:>5} {r['world_size']:>5} {r['budget'] // 1024:>5}k "
            f"{r['num_dropped']:>4} {r['lower_bound']:>4} | "
            f"{r['plan_minibatches']:>4} {r['plan_utilization']:>5.3f} {r['plan_balance']:>5.3f} {r['plan_ms']:>6.2f} | "
            f"{r['lpt_minibatches']:>4} {r['lpt_utilization']:>5.3f} {r['lpt_balance']:>5.3f} {r['lpt_ms']:>7.2f}"
        )
    print()
    for distribution, entry in summary.items():
        print(f"{distribution}: lower bound {entry['lower_bound']} minibatches over 27 configurations")
        for name in PLANNERS:
            e = entry[name]
            print(
                f"  {name:<4} {e['minibatches']:>5} minibatches ({e['over_lower_bound']:+.1%} over the bound), "
                f"mean balance {e['mean_balance']:.3f} (world > 1: {e['mean_balance_world_gt_1']:.3f}; "
                f"vs attainable {e['mean_balance_vs_attainable']:.3f}), "
                f"mean utilization {e['mean_utilization']:.3f}, "
                f"batch 4096: median {e['median_ms_at_4096']:.2f} ms, max {e['max_ms_at_4096']:.2f} ms per call"
            )
        print(f"  configurations where plan uses more minibatches than lpt: {entry['configs_plan_worse_than_lpt']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per planner and configuration")
    parser.add_argument("--output-json", default="bench/bench_packer.json", help="where to write rows and summary")
    args = parser.parse_args()
    rows = run(args.repeats)
    summary = summarize(rows)
    print_table(rows, summary)
    Path(args.output_json).write_text(json.dumps({"rows": rows, "summary": summary}, indent=2) + "\n")
    print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
