"""The package as a user installs it: a wheel built from the checkout, installed into an empty folder and
used from another working directory that holds the user's own ``utils.py``, ``schedule.py`` and
``sampler.py``; and the checkout's root scripts, as the original mini_trainer's users import them.

    .venv/bin/python -m pytest -q tests/test_packaging.py

The wheel is built offline from a copy of the package's files (``--no-build-isolation``: this venv's
setuptools) and installed with ``--target`` and no dependencies: the dependencies are this venv's, the
package is only the wheel's (``PYTHONPATH`` names the target folder, never the checkout).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from fixtures.e2e import ROOT, read_metrics
from fixtures.hub_venv import HUB_VERSION

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
OPTIONAL_EXTRA_MODULES = {"minitrainer.integrations.training_hub": "pip install 'training-hub>=0.11.2' \"torch=="}
"""Modules that import an optional extra at the top (they exist only for it): without it, the ImportError
names the install command."""
USER_MODULES = ("utils", "schedule", "sampler", "train", "process_data")
"""Modules a user's folder may hold under names the package's modules have, or had at the root."""


def _requirement(text: str) -> tuple[str, SpecifierSet]:
    name, specifier = re.fullmatch(r"([A-Za-z0-9_.-]+)(.*)", text.strip()).groups()
    return name.lower(), SpecifierSet(specifier)


def _requirements(path: Path) -> dict[str, SpecifierSet]:
    """``{name: specifier}`` of a requirements file, following ``-r``."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r"):
            found |= _requirements(path.parent / line[2:].strip())
        elif line:
            found.update([_requirement(line)])
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of the checkout, built from a copy of what pyproject.toml packages."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "requirements.txt"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "minitrainer", source / "minitrainer", ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                             "--wheel-dir", str(work / "dist"), str(source)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [built] = (work / "dist").glob("minitrainer-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel installed into an empty folder (its console scripts in ``bin/``)."""
    target = tmp_path_factory.mktemp("site")
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                             str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return target


@pytest.fixture
def user_folder(tmp_path) -> Path:
    """A user's working folder whose own modules fail loudly if anything of ours imports them."""
    folder = tmp_path / "user"
    folder.mkdir()
    for name in USER_MODULES:
        (folder / f"{name}.py").write_text(f'raise ImportError("the user\'s own {name}.py was imported")\n')
    return folder


def _env(installed: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(installed), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "CUDA_VISIBLE_DEVICES": "", "PATH": f"{installed / 'bin'}{os.pathsep}{os.environ['PATH']}"}


def test_the_wheel_holds_the_package_its_data_and_a_console_script_per_entry_point(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = archive.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    outside = sorted({name.split("/")[0] for name in names} - {"minitrainer"} - {n.split("/")[0] for n in names
                                                                                if ".dist-info/" in n})
    assert outside == [], f"the wheel holds more than the package: {outside}"
    assert "minitrainer/tools/demo_chat.jsonl" in names
    assert "minitrainer/tools/demo_preferences.jsonl" in names
    packaged = {name for name in names if name.endswith(".py")}
    checkout = {str(path.relative_to(ROOT)) for path in (ROOT / "minitrainer").rglob("*.py")}
    assert packaged == checkout
    for script, target in PYPROJECT["scripts"].items():
        assert f"{script} = {target}" in entry_points
    # One list of dependencies: requirements.txt's, as the wheel's metadata states them.
    required = dict(_requirement(line) for line in re.findall(r"^Requires-Dist: ([^;\n]*)$", metadata, re.M))
    assert required == _requirements(ROOT / "requirements.txt")


def test_the_extras_pin_what_the_tests_run_on():
    """Each optional part's floor is the one requirements-dev.txt (or requirements-cuda.txt) installs for the
    tests; a package the tests do not install (wandb, tensorboard) has none."""
    tested = _requirements(ROOT / "requirements-dev.txt") | _requirements(ROOT / "requirements-cuda.txt")
    # Tested in a venv of its own (fixtures/hub_venv.py): the version installed there is the floor.
    tested["training-hub"] = SpecifierSet(f">={HUB_VERSION}")
    for extra, requirements in PYPROJECT["optional-dependencies"].items():
        for requirement in requirements:
            name, specifier = _requirement(requirement)
            assert tested.get(name, SpecifierSet()) == specifier, (extra, requirement, tested.get(name))


def test_every_module_imports_from_the_installed_wheel_in_a_users_folder(installed, user_folder):
    """From another working directory holding the user's own ``utils.py``, ``schedule.py``, ``sampler.py``:
    every module of the package imports from the wheel's folder, and none of the user's is touched; hints name
    the console scripts (a checkout's ``python -m`` paths do not run there)."""
    code = ("import importlib, pkgutil, sys, minitrainer\n"
            f"OPTIONAL = {OPTIONAL_EXTRA_MODULES!r}\n"
            "names = [m.name for m in pkgutil.walk_packages(minitrainer.__path__, 'minitrainer.')]\n"
            "for name in names:\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "    except ImportError as err:\n"
            "        assert name in OPTIONAL and OPTIONAL[name] in str(err), (name, err)\n"
            "from minitrainer import (ProcessDataConfig, TorchrunArgs, TrainConfig, config_from_file, process_data,\n"
            "                         run_training)\n"
            "from minitrainer.common.commands import command\n"
            "from minitrainer.run import _help\n"
            "assert command('minitrainer.tools.inspect_data') == 'minitrainer-inspect-data'\n"
            "assert _help().endswith('train.py flags: minitrainer-train --help'), _help()[-200:]\n"
            "print(minitrainer.__file__, len(names))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=user_folder, env=_env(installed), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    where, count = result.stdout.split()
    modules = [path for path in (ROOT / "minitrainer").rglob("*.py") if path.parent != ROOT / "minitrainer"
               or path.name != "__init__.py"]
    assert Path(where).is_relative_to(installed) and int(count) == len(modules)


def test_the_console_scripts_and_the_api_train_from_a_users_folder(installed, user_folder):
    """``pip install``'s commands, end to end from the user's folder: the tiny model, tokenizing, two steps
    under ``torchrun --no-python minitrainer-train``, ``minitrainer-run``'s refusal of a typo, then
    ``run_training`` (which launches ``-m minitrainer.run``, whose ranks run ``-m minitrainer.train``, the
    working directory first on the workers' ``sys.path``) resumes the same run."""
    env = _env(installed)

    def run(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
        result = subprocess.run(list(argv), cwd=user_folder, env=env, capture_output=True, text=True,
                                timeout=timeout)
        assert result.returncode == 0, f"{argv[:4]}:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
        return result

    run(str(installed / "bin" / "minitrainer-tiny-model"), "--output-dir", "tiny", "--hidden-size", "32",
        "--num-layers", "1")
    refused = subprocess.run([str(installed / "bin" / "minitrainer-process-data"), "--input-file", "missing.jsonl",
                              "--output-dir", "data", "--model-name-or-path", "tiny"], cwd=user_folder, env=env,
                             capture_output=True, text=True, timeout=300)
    assert (refused.returncode, refused.stderr.strip().splitlines()[-1]) == (
        1, "minitrainer-process-data: error: input file missing.jsonl does not exist")  # the name the user typed
    demo_data = installed / "minitrainer" / "tools" / "demo_chat.jsonl"
    run(str(installed / "bin" / "minitrainer-process-data"), "--input-file", str(demo_data), "--output-dir", "data",
        "--model-name-or-path", "tiny", "--num-proc", "1", "--max-sample-num-tokens", "256")
    flags = ["--model-name-or-path", "tiny", "--data-path", "data", "--output-dir", "out", "--batch-size", "8",
             "--max-tokens-per-gpu", "256", "--min-samples-per-checkpoint", "16", "--num-data-workers", "0"]
    run(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone", "--no-python",
        str(installed / "bin" / "minitrainer-train"), *flags, "--max-steps", "2")
    typo = subprocess.run([str(installed / "bin" / "minitrainer-run"), "--nproc-per-node=2", *flags, "--max-stepz",
                           "3"], cwd=user_folder, env=env, capture_output=True, text=True, timeout=300)
    # The launcher's refusal as a user sees it, its whole output (tests/test_run_launcher.py checks it in-process).
    assert (typo.returncode, typo.stderr, typo.stdout) == (
        2, "minitrainer-run: error: unknown flag --max-stepz; did you mean --max-steps?\n", "")
    api = ("from minitrainer import TorchrunArgs, TrainConfig, run_training\n"
           f"config = TrainConfig(model_name_or_path='tiny', data_path='data', output_dir='out', batch_size=8,\n"
           f"                     max_tokens_per_gpu=256, min_samples_per_checkpoint=16, num_data_workers=0,\n"
           f"                     max_steps=3)\n"
           "run_training(TorchrunArgs(nproc_per_node=2), config)\n")
    resumed = run(sys.executable, "-c", api)
    assert "resumed from" in resumed.stderr
    out = user_folder / "out"
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    params = json.loads((out / "training_params.json").read_text())
    assert params["max_steps"] == 3 and params["world_size"] == 2
    assert (out / "hf_format" / "samples_24" / "config.json").is_file()


def test_hints_in_a_checkout_name_the_module_with_this_interpreter(monkeypatch):
    from minitrainer.common.commands import command

    monkeypatch.chdir(ROOT)
    expected = Path(sys.executable).relative_to(ROOT) if Path(sys.executable).is_relative_to(ROOT) else sys.executable
    assert command("minitrainer.tools.inspect_data") == f"{expected} -m minitrainer.tools.inspect_data"


def test_the_root_scripts_keep_the_original_imports():
    """The original mini_trainer's imports, from the checkout's root (this import path regressed once)."""
    code = ("from sampler import batch_lengths_to_minibatches\n"
            "from train import TrainConfig, train\n"
            "from process_data import ProcessDataConfig, process_data\n"
            "from utils import IGNORE_INDEX, init_distributed, parse_config, setup_logging\n"
            "from batch_metrics import MetricsWriter, step_record\n"
            "from setup_model_fsdp import setup_model\n"
            "print(batch_lengths_to_minibatches([5, 3, 9, 2], 10, 2, 1))\n")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[[2]]"


def _documented_extra_lines() -> list[list[str]]:
    """The extras' install lines of docs/install.md as words, the ``keep_torch`` pin each carries."""
    lines = [line.split("#", 1)[0] for line in (ROOT / "docs" / "install.md").read_text().splitlines()
             if line.startswith(".venv/bin/pip install") and '"$keep_torch"' in line]
    return [shlex.split(line) for line in lines]


def _resolve(words: list[str], keep_torch: str, report: Path) -> list[str]:
    """What pip would install for one documented line (``--dry-run`` in this venv, whose torch is the user's)."""
    args = [word for word in words[1:] if word != "-e"]
    args = [keep_torch if word == "$keep_torch" else word for word in args]
    result = subprocess.run([sys.executable, "-m", "pip", *args, "--dry-run", "--quiet", "--no-build-isolation",
                             "--report", str(report)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{shlex.join(words)}:\n{result.stderr[-3000:]}"
    return [item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]]


def test_every_extra_installs_beside_the_torch_a_user_installed(wheel, tmp_path):
    """The documented extras lines, from the checkout and from a wheel: pip resolves each without replacing the
    installed torch (unpinned, training-hub's torchvision pulled torch 2.15 and its CUDA libraries over a CPU
    2.13); every extra has a line, and ``keep_torch`` is the torch this venv runs."""
    import torch

    keep = subprocess.run(["bash", "-c", 'eval "$1"; printf %s "$keep_torch"', "-",
                           next(line for line in (ROOT / "docs" / "install.md").read_text().splitlines()
                                if line.startswith("keep_torch="))], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert keep.stdout == f"torch=={torch.__version__}", keep.stderr
    lines = _documented_extra_lines()
    extras = {extra for words in lines for word in words if (m := re.fullmatch(r"\.\[([\w,-]+)\]", word))
              for extra in m.group(1).split(",")}
    assert extras == set(PYPROJECT["optional-dependencies"]), "an extra without its documented line"
    for i, words in enumerate(lines):
        installs = _resolve(words, keep.stdout, tmp_path / f"checkout{i}.json")
        assert "torch" not in installs, f"{shlex.join(words)} would replace torch {torch.__version__}"
    from_wheel = ["pip", "install", f"{wheel}[{','.join(sorted(extras))}]", "$keep_torch"]
    assert "torch" not in _resolve(from_wheel, keep.stdout, tmp_path / "wheel.json")
