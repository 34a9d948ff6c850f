"""The step's host-device synchronisations, counted by ``bench/bench_step_cost.py`` (structurally, on CPU).

    .venv/bin/python -m pytest -q tests/test_step_cost.py      # ~1 min

A GPU run's optimizer (fused AdamW) skips a non-finite step on the device, so the step reads the device
once: the metrics, after the update. An optimizer that cannot (CPU's foreach AdamW) adds the read of the
gradient norm's finiteness before its update. The counter itself is checked on reads it must and must
not count.
"""

from __future__ import annotations

import torch

from bench.bench_step_cost import StepCostConfig, measure
from fixtures.sync_count import SyncCounter


def _trainer_reads(budget: dict) -> list[str]:
    """The trainer's own reads; sdpa's mask code in transformers reads packed position ids once per minibatch
    (the varlen backends a GPU run uses get sample boundaries instead and read nothing)."""
    return [site for site in budget["sync_sites"] if " via " not in site]


def test_a_gpu_step_reads_the_device_once_after_the_update():
    results = measure(StepCostConfig(optimizer_path="gpu", token_budgets="128", num_steps=1))
    [budget] = results["budgets"]
    [site] = _trainer_reads(budget)
    assert site.startswith("step.py:") and site.endswith("tolist"), budget["sync_sites"]
    assert all("masking_utils" in site for site in budget["sync_sites"] if " via " in site), budget["sync_sites"]


def test_an_optimizer_that_cannot_skip_on_the_device_reads_the_norm_first():
    results = measure(StepCostConfig(optimizer_path="as-built", token_budgets="128", num_steps=1))
    [budget] = results["budgets"]
    assert [site.split()[-1] for site in _trainer_reads(budget)] == ["__bool__", "tolist"], budget["sync_sites"]


def test_the_counter_counts_device_reads_and_data_dependent_shapes_only():
    model = torch.nn.Linear(4, 3)
    host = torch.tensor([0, 2, -100, 1])
    with SyncCounter(model) as counter:
        out = model(torch.randn(2, 4)).sum()
        host.ne(-100).nonzero()  # host data: no device involved in a GPU run
        int(host[1])
        labels_on_device = host + model.bias.sum().long() * 0  # a value the device computed
        labels_on_device.ne(-100).nonzero()
        float(out)
    assert [site.split()[-1] for site in counter.sites] == ["nonzero", "__float__"], counter.sites
