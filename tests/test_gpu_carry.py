"""``make gpu-carry``: the wheels the GPU image lacks resolve and install offline on Python 3.12.

    .venv/bin/python -m pytest -q tests/test_gpu_carry.py

Downloads the carry (a few MB from PyPI) into a temporary folder once; skips with the reason where
PyPI cannot be reached. The install check itself is offline (``pip install --dry-run --no-index``).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench import gpu_carry


@pytest.fixture(scope="module")
def carry(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpu_carry")
    try:
        gpu_carry.download(out)
    except subprocess.CalledProcessError as err:
        pytest.skip(f"cannot download from the package index ({err.cmd[3]} exited {err.returncode}): "
                    "no network to PyPI here")
    return out


def test_the_carry_installs_offline_on_the_gpu_images_python(carry):
    pins = (carry / "requirements.txt").read_text().split()
    names = {gpu_carry.canonical(pin.split("==")[0]) for pin in pins}
    assert {"transformers", "datasets", "dill", "multiprocess", "liger-kernel", "torchao"} <= names
    assert not names & gpu_carry.IMAGE_PACKAGES, "nothing the image already holds is carried"
    assert not {"torch", "triton", "huggingface-hub", "tokenizers"} & names
    transformers = next(pin.split("==")[1] for pin in pins if pin.startswith("transformers=="))
    assert (5, 23) <= tuple(int(part) for part in transformers.split(".")[:2]) < (5, 25), \
        "the carried transformers is inside requirements.txt's range"
    assert gpu_carry.check(carry) == []
    assert sum(f.stat().st_size for f in carry.glob("*.whl")) < 32 * 2**20


def test_a_carry_missing_a_needed_wheel_is_reported(carry, tmp_path):
    for wheel in carry.glob("*.whl"):
        if not wheel.name.startswith("dill-"):
            (tmp_path / wheel.name).write_bytes(wheel.read_bytes())
    (tmp_path / "requirements.txt").write_text((carry / "requirements.txt").read_text())
    problems = gpu_carry.check(tmp_path)
    assert any(p.startswith("offline install:") for p in problems)
    assert any("requires dill" in p and "neither carried nor on the image" in p for p in problems)
