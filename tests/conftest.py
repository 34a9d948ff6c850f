"""Session fixtures: tiny real tokenizers and random models built on disk once.

Every test loads them through ``from_pretrained``, as users load Qwen or Llama.
Run the suite with ``make test`` (or ``.venv/bin/python -m pytest -q tests``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import time
from pathlib import Path

import pytest

from fixtures.launch_census import file_census, launching_names
from minitrainer.tools.tiny_model import TEMPLATES, build_tiny_model

TEMPLATE_NAMES = sorted(TEMPLATES)
# `make test-matrix` runs the data and packing tests under interpreters that have no CPU build of
# torch to install (PyPI's Linux wheels need the CUDA libraries): there only tokenizers are built.
HAS_TORCH = importlib.util.find_spec("torch") is not None


REPORT = os.environ.get("MINITRAINER_TEST_REPORT")
"""A folder: each test's wall and CPU seconds and launches go to ``<worker>.jsonl`` there (``.ci/report.py``)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one; `make gpu-check` runs them)")
    config.addinivalue_line("markers", "launches: starts a process or calls into a warm job (fixtures/launch_census.py;"
                                       " `make test-quick` leaves them out)")
    config.addinivalue_line("markers", "timing: bounds wall-clock time, so it runs apart from the parallel lanes")


def pytest_collection_modifyitems(config, items):
    from minitrainer.common.device import device_type

    launching: dict[Path, set[str]] = {}
    for item in items:
        path = Path(str(item.fspath))
        if path not in launching:
            launching[path] = launching_names(file_census(path)) if path.suffix == ".py" else set()
        names = launching[path]
        if getattr(item, "originalname", item.name) in names or names & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.launches)
    if HAS_TORCH and device_type() == "cuda":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


def _cpu_seconds() -> float:
    """This process's CPU time, its reaped children's and the warm jobs' ranks' (fixtures/warm_jobs.py)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    warm = _warm_jobs()
    return total if warm is None else total + warm.CPU_SECONDS["calls"] - warm.CPU_SECONDS["reaped"]


def _warm_jobs():
    import sys

    return sys.modules.get("fixtures.warm_jobs")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test's wall and CPU seconds (its children's included, which a loaded machine barely moves) and its
    launches, for the CI report."""
    if not REPORT:
        yield
        return
    from fixtures.launching import LAUNCHES

    launches, cpu, began = dict(LAUNCHES), _cpu_seconds(), time.monotonic()
    yield
    record = {"test": item.nodeid, "wall": round(time.monotonic() - began, 3), "cpu": round(_cpu_seconds() - cpu, 3),
              **{kind: LAUNCHES[kind] - launches[kind] for kind in LAUNCHES}}
    folder = Path(REPORT)
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl").open("a") as file:
        file.write(json.dumps(record) + "\n")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """One folder per chat template: tokenizer plus a matching random causal LM (where torch is)."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {name: build_tiny_model(name, root / name, with_model=HAS_TORCH) for name in TEMPLATE_NAMES}


@pytest.fixture(scope="session")
def chatml_model(tiny_models) -> Path:
    return tiny_models["chatml"]


@pytest.fixture(scope="session")
def llama3_model(tiny_models) -> Path:
    return tiny_models["llama3"]


@pytest.fixture(autouse=True)
def _restore_torch_state():
    """Leave no process group or changed default dtype behind a test."""
    if not HAS_TORCH:
        yield
        return
    import torch

    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
