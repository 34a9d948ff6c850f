"""Download every wheel the lent GPU machines lack into one ignored folder (``make gpu-carry``).

    python3 -m bench.gpu_carry --out .gpu-carry          # resolve and download (PyPI), a few MB
    python3 -m bench.gpu_carry --out .gpu-carry --check  # offline: the set installs on the image

The GPU machines run Python 3.12 with torch 2.11, transformers 5.17 and the packages in
``IMAGE_PACKAGES``, and reach no package index: ``datasets`` (with ``dill`` and ``multiprocess``),
``liger-kernel`` and ``torchao`` are missing, and transformers 5.17 is below requirements.txt's floor
(Gemma-2 is silently wrong under sdpa there), so transformers is carried too. This resolves what
``NEEDED`` pulls for Python 3.12 on x86-64 Linux against PyPI, with the image's torch, triton and the
libraries transformers needs standing in at the image's versions as metadata-only wheels (so the
multi-GB wheels are never fetched and nothing the image already satisfies is replaced), keeps what the
image does not hold, and downloads those wheels with ``requirements.txt`` naming them. ``make gpu-check`` installs them offline (``pip
install --no-index --no-deps --find-links .gpu-carry -r .gpu-carry/requirements.txt``) when the
folder is there. ``--check`` (``tests/test_gpu_carry.py``) proves, offline, that every carried wheel
installs on Python 3.12 x86-64 and that each of its requirements is carried or on the image.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

NEEDED = ("transformers>=5.23,<5.25", "datasets>=3.3", "liger-kernel>=0.6.2", "torchao>=0.18")
"""What requirements.txt, requirements-dev.txt and requirements-cuda.txt ask for that the image lacks
(or holds below the floor: transformers)."""
STAND_INS = {"torch": "2.11.0", "triton": "3.6.0", "huggingface-hub": "1.33.0", "tokenizers": "0.23.2",
             "safetensors": "0.8.0", "numpy": "2.5.2"}
"""Image packages at the versions its pip list showed: resolved against, never downloaded."""
IMAGE_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi
charset-normalizer click cloudpickle contourpy cuda-bindings cuda-core cuda-pathfinder cycler einops
filelock fonttools frozenlist fsspec h11 hf-xet httpcore httpx huggingface-hub hypothesis idna iniconfig
jinja2 joblib kiwisolver markdown-it-py markupsafe matplotlib mdurl ml-dtypes mpmath msgpack multidict
networkx numpy nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx packaging pandas peft pillow pip pluggy
propcache protobuf psutil pyarrow pygments pyparsing pytest python-dateutil pyyaml regex requests rich
safetensors scipy sentencepiece setuptools shellingham six sympy tokenizers torch tqdm triton
typer typing-extensions tzdata urllib3 wheel xxhash yarl zipp
""".split())
"""Packages the GPU image holds (its package list as read on 2026-11-17, the part that matters here)."""
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"] + [
    arg for tag in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                    "manylinux2014_x86_64", "manylinux1_x86_64") for arg in ("--platform", tag)]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _stand_in_wheels(folder: Path) -> None:
    """Metadata-only wheels of ``STAND_INS`` (local version ``+gpuimage``: it outranks PyPI's same version)."""
    for name, version in STAND_INS.items():
        dist = f"{name.replace('-', '_')}-{version}+gpuimage"
        with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as whl:
            whl.writestr(f"{dist}.dist-info/METADATA",
                         f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}+gpuimage\n")
            whl.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
            whl.writestr(f"{dist}.dist-info/RECORD", "")


def resolve() -> dict[str, str]:
    """``{name: version}`` of everything ``NEEDED`` pulls on the image's Python and packages."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        _stand_in_wheels(tmp)
        (tmp / "constraints.txt").write_text("".join(f"{n}=={v}+gpuimage\n" for n, v in STAND_INS.items()))
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
                        "--report", str(tmp / "report.json"), "--target", str(tmp / "site"), *PLATFORM,
                        "--find-links", str(tmp), "-c", str(tmp / "constraints.txt"), *NEEDED], check=True)
        report = json.loads((tmp / "report.json").read_text())
    return {canonical(item["metadata"]["name"]): item["metadata"]["version"] for item in report["install"]}


def download(out: Path) -> list[str]:
    """Resolve, keep what the image lacks, download those wheels into ``out``; returns the pins."""
    pins = sorted(f"{name}=={version}" for name, version in resolve().items() if name not in IMAGE_PACKAGES)
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM, "-d", str(out), *pins],
                   check=True)
    (out / "requirements.txt").write_text("".join(pin + "\n" for pin in pins))
    return pins


TARGET_ENVIRONMENT = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
                      "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
                      "platform_python_implementation": "CPython", "implementation_name": "cpython", "extra": ""}
"""The GPU image's interpreter, for evaluating requirement markers."""


def _requires(wheel: Path) -> list[str]:
    """Names the wheel requires on the image's interpreter (markers evaluated, extras left out)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # an interpreter without packaging: pip carries its own copy
        from pip._vendor.packaging.requirements import Requirement
    with zipfile.ZipFile(wheel) as whl:
        metadata = next(whl.read(n).decode() for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    names = []
    for line in metadata.splitlines():
        if line.startswith("Requires-Dist:"):
            requirement = Requirement(line.removeprefix("Requires-Dist:").strip())
            if requirement.marker is None or requirement.marker.evaluate(TARGET_ENVIRONMENT):
                names.append(canonical(requirement.name))
    return names


def check(out: Path) -> list[str]:
    """Offline: every pin of ``out/requirements.txt`` installs from ``out`` alone on Python 3.12 x86-64,
    and every requirement of a carried wheel is carried or on the image. Returns the problems."""
    requirements = out / "requirements.txt"
    if not requirements.is_file():
        return [f"{requirements}: missing (run make gpu-carry)"]
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--no-index", "--no-deps",
                                 "--find-links", str(out), "--target", tmp, *PLATFORM, "-r", str(requirements)],
                                capture_output=True, text=True)
    problems = [f"offline install: {result.stderr.strip()[-500:]}"] if result.returncode else []
    carried = {canonical(wheel.name.split("-")[0]) for wheel in out.glob("*.whl")}
    for wheel in sorted(out.glob("*.whl")):
        missing = [name for name in _requires(wheel) if name not in carried and name not in IMAGE_PACKAGES]
        if missing:
            problems.append(f"{wheel.name} requires {', '.join(missing)}: neither carried nor on the image")
    return problems


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".gpu-carry", help="the folder for the wheels (git-ignored)")
    parser.add_argument("--check", action="store_true", help="offline check of an existing folder, no download")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if not args.check:
        pins = download(out)
        size = sum(f.stat().st_size for f in out.glob("*.whl")) / 2**20
        print(f"{out}: {len(pins)} wheels, {size:.1f} MB: {' '.join(pins)}")
    problems = check(out)
    for problem in problems:
        print(f"gpu-carry: {problem}", file=sys.stderr)
    if problems:
        raise SystemExit(1)
    print(f"{out}: installs offline on Python 3.12 x86-64 beside the GPU image's packages")


if __name__ == "__main__":
    main()
