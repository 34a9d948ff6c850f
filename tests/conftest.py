"""Session fixtures: tiny real tokenizers and random models built on disk once.

Every test loads them through ``from_pretrained``, as users load Qwen or Llama.
Run the suite with ``make test`` (or ``.venv/bin/python -m pytest -q tests``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from minitrainer.tools.tiny_model import TEMPLATES, build_tiny_model

TEMPLATE_NAMES = sorted(TEMPLATES)
# `make test-matrix` runs the data and packing tests under interpreters that have no CPU build of
# torch to install (PyPI's Linux wheels need the CUDA libraries): there only tokenizers are built.
HAS_TORCH = importlib.util.find_spec("torch") is not None


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one; `make gpu-check` runs them)")


def pytest_collection_modifyitems(config, items):
    from minitrainer.common.device import device_type

    if HAS_TORCH and device_type() == "cuda":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


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
