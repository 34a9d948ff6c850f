"""``--optimizer my_package.my_module:MyOptimizer`` (or ``path/to/my_optimizer.py:MyOptimizer``): a
``torch.optim.Optimizer`` subclass of the user's own, imported from the working directory or the environment, as
``python -m`` would find it, or from the file named.

It is built as ``MyOptimizer(param_groups, lr=--learning-rate, **--optimizer-args)``: the groups are the method's,
each with its ``weight_decay``; ``--adam-betas``/``--adam-eps`` are AdamW's and do not reach it. Its states live in
``optimizer.state`` like torch's, so the full state saves and restores them and a resume is exact as long as they
are tensors shaped like their parameters (or plain numbers). A class attribute ``state_bytes_per_param`` tells the
memory plan what it keeps; without one the plan assumes AdamW's 8 bytes.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from minitrainer.optim.base import OptimizerChoice, OptimizerSetting


def is_class_path(name: str) -> bool:
    """``package.module:Class`` or ``path/to/file.py:Class``."""
    module, _, attribute = name.rpartition(":")
    if not module or not all(part.isidentifier() for part in attribute.split(".")):
        return False
    return module.endswith(".py") or all(part.isidentifier() for part in module.split("."))


def import_class(path: str) -> type:
    """The class ``module:Class`` (or ``file.py:Class``) names; ``ValueError`` in one line when it cannot be had."""
    source, _, attribute = path.rpartition(":")
    found: Any = _import_file(path, source) if source.endswith(".py") else _import_module(path, source)
    try:
        for part in attribute.split("."):
            found = getattr(found, part)
    except AttributeError:
        raise ValueError(f"--optimizer {path}: {source} has no {attribute}") from None
    if not (isinstance(found, type) and issubclass(found, torch.optim.Optimizer)):
        raise ValueError(f"--optimizer {path}: {attribute} is not a torch.optim.Optimizer subclass")
    return found


def _import_module(path: str, module_name: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        top = module_name.split(".")[0]
        # As ``python -m`` finds a module: from the working directory too, which torchrun's script path hides.
        spec = importlib.machinery.PathFinder.find_spec(top, [os.getcwd()]) if err.name == top else None
        if spec is None:
            raise ValueError(f"--optimizer {path}: cannot import {module_name} ({err}); run from the folder that "
                             "holds it or install it in this environment") from None
    _load(spec, top)
    return importlib.import_module(module_name)


def _load(spec, name: str) -> ModuleType:
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise ValueError(f"--optimizer: {spec.origin} fails to import: {type(err).__name__}: {err}") from None
    return module


def _import_file(path: str, file_name: str) -> ModuleType:
    file = Path(file_name).resolve()
    if not file.is_file():
        raise ValueError(f"--optimizer {path}: no file {file}")
    name = f"_minitrainer_user_optimizer_{abs(hash(str(file)))}"
    if name in sys.modules:
        return sys.modules[name]
    return _load(importlib.util.spec_from_file_location(name, file), name)


class UserOptimizer(OptimizerChoice):
    uses_adam_flags = False

    def __init__(self, path: str, args: dict[str, Any] | None = None):
        self.name = path
        self.cls = import_class(path)
        self.args = dict(args or {})
        self.state_bytes_per_param = float(getattr(self.cls, "state_bytes_per_param", 8.0))

    def build(self, param_groups: list[dict], setting: OptimizerSetting) -> torch.optim.Optimizer:
        try:
            return self.cls(param_groups, lr=setting.lr, **self.args)
        except TypeError as err:
            raise ValueError(f"--optimizer {self.name} with --optimizer-args {self.args}: {err}") from None
