"""The launch budget: every fresh process the tests start is counted from their source (``fixtures/launch_census.py``)
and must be listed in ``tests/launch_budget.toml`` with its reason, so a new one is a decision made in the change that
adds it, not minutes that creep into CI. A run whose numbers are the subject goes into a warm job
(``torchrun(..., warm=True)``) and costs nothing here.

    .venv/bin/python -m pytest -q tests/test_launch_budget.py
"""

from __future__ import annotations

import textwrap
import tomllib

from fixtures.launch_census import census, file_census
from fixtures.launching import ROOT

BUDGET = ROOT / "tests" / "launch_budget.toml"


def _budget() -> dict[str, list]:
    return {f"{file}::{owner}": entry for file, entries in tomllib.loads(BUDGET.read_text()).items()
            for owner, entry in entries.items()}


def _fresh() -> dict[str, int]:
    return {f"{file}::{owner}": kinds["fresh"] for file, owners in census().items()
            for owner, kinds in owners.items() if kinds["fresh"]}


def test_every_fresh_launch_is_in_the_budget_with_its_reason():
    budget, fresh = _budget(), _fresh()
    over = [f"{key} starts {count} fresh, the budget allows {budget.get(key, [0])[0]}"
            for key, count in sorted(fresh.items()) if count > budget.get(key, [0])[0]]
    assert not over, ("fresh launches beyond tests/launch_budget.toml: " + "; ".join(over) + ". Run it warm "
                      "(torchrun(..., warm=True)) where the run's numbers are the subject; where the process's life "
                      "is, raise its entry in tests/launch_budget.toml, with the reason, in the same change")
    under = [f"{key}: {entry[0]} budgeted, {fresh.get(key, 0)} found" for key, entry in sorted(budget.items())
             if fresh.get(key, 0) < entry[0]]
    assert not under, "lower these entries of tests/launch_budget.toml to what the tests start: " + "; ".join(under)
    unexplained = [key for key, entry in budget.items() if len(entry) != 2 or not str(entry[1]).strip()]
    assert not unexplained, f"entries without a reason: {unexplained}"


def test_the_census_counts_what_a_test_starts_and_where(tmp_path):
    """Fresh and warm launches are told apart, a helper's launches count where a test calls it, and a function that
    starts nothing is not listed."""
    path = tmp_path / "test_example.py"
    path.write_text(textwrap.dedent("""
        import subprocess, pytest

        def _twice(args):
            torchrun(args)
            return subprocess.run(["python", "-c", "pass"])

        @pytest.fixture(scope="module")
        def run():
            return torchrun([], warm=True)

        def test_a(run):
            _twice([])
            torchrun([], warm=False, nproc=4)

        def test_b():
            subprocess.list2cmdline(["x"])
    """))
    found = file_census(path)
    assert {name: dict(kinds) for name, kinds in found.items()} == {"run": {"warm": 1}, "test_a": {"fresh": 3}}
