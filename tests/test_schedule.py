"""Schedule sanity: a warmup at least the run's length, or a decay the run is too short for, is one warning at start-up.

    .venv/bin/python -m pytest -q tests/test_schedule.py

The schedules are transformers' own, built without its trainer stack: every factor of every schedule equals
``transformers.get_scheduler``'s to the last bit (built on a stand-in optimizer, as ``check_scheduler`` does at
start-up).
"""

from __future__ import annotations

import logging
import re
import shlex

import pytest
import torch

from fixtures.e2e import ROOT
from minitrainer.common.cli import parse_config
from minitrainer.run import split_argv
from minitrainer.setup.schedule import build_scheduler, check_scheduler, schedule_warnings, stop_plan, total_steps
from minitrainer.train_config import SCHEDULERS, TrainConfig


def _warnings(config: TrainConfig, steps: int | None) -> list[str]:
    stand_in = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=config.learning_rate)
    return schedule_warnings(config, steps, build_scheduler(config, stand_in, steps).lr_lambdas[0])


def _config(**settings) -> TrainConfig:
    return TrainConfig(model_name_or_path="m", data_path="d", output_dir="o", min_samples_per_checkpoint=1, **settings)


@pytest.mark.parametrize(("scheduler", "warmup", "steps"), [
    ("constant_with_warmup", 10, 4), ("constant_with_warmup", 4, 4), ("cosine", 12, 12), ("linear", 5, 3),
    ("inverse_sqrt", 8, 8)])
def test_a_warmup_at_least_the_run_never_reaches_the_peak(scheduler, warmup, steps):
    [warning] = _warnings(_config(lr_scheduler=scheduler, num_warmup_steps=warmup, max_steps=steps), steps)
    last = (steps - 1) / warmup  # every warmup is linear from 0: step k uses (k - 1) / warmup
    assert warning == (f"--num-warmup-steps {warmup} is at least the run's {steps} steps: the learning rate never "
                       f"reaches --learning-rate 5e-06 (the last step uses {last:.0%} of it); lower "
                       "--num-warmup-steps or train longer")


@pytest.mark.parametrize(("scheduler", "warmup", "steps", "last", "end"), [
    ("cosine", 10, 12, "50%", "0%"), ("linear", 0, 2, "50%", "0%"), ("cosine_with_min_lr", 5, 7, "55%", "10%"),
    ("polynomial", 0, 2, "51%", "2%")])
def test_a_decay_too_short_to_reach_its_end_is_one_warning(scheduler, warmup, steps, last, end):
    [warning] = _warnings(_config(lr_scheduler=scheduler, num_warmup_steps=warmup, max_steps=steps), steps)
    assert warning.startswith(f"--lr-scheduler {scheduler} will not reach its end: the last of the run's {steps} "
                              f"steps uses {last} of --learning-rate where the schedule ends at {end}")


@pytest.mark.parametrize(("scheduler", "warmup", "steps"), [
    ("constant_with_warmup", 3, 4), ("constant", 0, 1), ("cosine", 10, 13), ("linear", 0, 3), ("linear", 100, 1000),
    ("warmup_stable_decay", 2, 100), ("cosine_with_min_lr", 20, 500)])
def test_a_schedule_that_runs_its_course_is_silent(scheduler, warmup, steps):
    assert _warnings(_config(lr_scheduler=scheduler, num_warmup_steps=warmup, max_steps=steps), steps) == []


def test_infinite_sampling_has_nothing_to_check():
    assert _warnings(_config(num_warmup_steps=10_000), None) == []


def test_check_scheduler_logs_the_warning_on_rank_0_only(caplog):
    config = _config(num_warmup_steps=10, max_steps=4)
    with caplog.at_level(logging.WARNING):
        check_scheduler(config, 4, is_main=False)
        assert caplog.records == []
        check_scheduler(config, 4, is_main=True)
    [record] = caplog.records
    assert "--num-warmup-steps 10 is at least the run's 4 steps" in record.getMessage()


def test_the_readme_quick_start_trains_past_its_warmup():
    """It once ran 4 steps under the default 10-step warmup: the learning rate never reached its peak."""
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"^\.venv/bin/python -m minitrainer\.run .*?[^\\]$", readme, re.M | re.S)[0]
    _, train_argv = split_argv(shlex.split(command.replace("\\\n", " "))[3:])
    config = parse_config(TrainConfig, train_argv)
    assert config.max_steps == 4 and _warnings(config, total_steps(config, num_dataset_samples=412)) == []


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize(("warmup", "steps"), [(0, 1), (0, 7), (3, 10), (10, 4), (4, 4), (20, 500)])
def test_every_schedule_is_transformers_own_to_the_last_bit(scheduler, warmup, steps):
    from transformers import get_scheduler

    from minitrainer.setup.schedule import scheduler_kwargs

    config = _config(lr_scheduler=scheduler, num_warmup_steps=warmup, max_steps=steps, min_lr_ratio=0.1,
                     learning_rate=3e-4)

    def built(make):
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=config.learning_rate)
        try:
            return make(optimizer)
        except (TypeError, ValueError, ZeroDivisionError) as err:
            return f"{type(err).__name__}: {err}"

    ours = built(lambda optimizer: build_scheduler(config, optimizer, steps))
    theirs = built(lambda optimizer: get_scheduler(scheduler, optimizer, num_warmup_steps=warmup,
                                                   num_training_steps=steps,
                                                   scheduler_specific_kwargs=scheduler_kwargs(config, steps)))
    if isinstance(theirs, str):
        assert ours == theirs
        return

    def factors(built_scheduler):
        try:
            return [built_scheduler.lr_lambdas[0](step) for step in range(steps + 3)]
        except ZeroDivisionError as err:
            return str(err)

    assert factors(ours) == factors(theirs)
    if isinstance(factors(ours), str):  # polynomial with as many warmup steps as steps: both divide by zero
        return
    for _ in range(min(steps, 5)):  # the state a full state records, after a few steps
        for one in (ours, theirs):
            one.optimizer.step()
            one.step()
    assert ours.state_dict() == theirs.state_dict()


def test_the_start_up_line_names_the_stop_that_ends_the_run():
    """TRL lets max_steps win over epochs; here the first stop reached does, so the line says which one that is
    and why the other is not reached (the issue's ``max_steps: 6`` with one epoch of 4 steps)."""
    both = _config(max_steps=6, num_epochs=1, batch_size=16)
    assert total_steps(both, 60) == 4
    assert stop_plan(both, 60) == ("4 steps, ended by --num-epochs 1; the first stop reached ends the run, so "
                                   "--max-steps 6 (step 6) is not reached")
    assert stop_plan(_config(max_steps=3, max_samples=48, batch_size=16), 60) == \
        "3 steps, ended by --max-steps 3 and --max-samples 48"
    assert stop_plan(_config(max_samples=40, batch_size=16), 60) == "3 steps, ended by --max-samples 40"
    assert stop_plan(_config(), 60) == "infinite sampling (no stop condition)"
