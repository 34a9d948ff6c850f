"""``--optimizer``: the optimizers by name (one module each), or the user's own class as ``module:Class``.

    adamw        optim/adamw.py           torch.optim.AdamW (fused on a GPU)
    adamw_8bit   optim/torchao_adamw.py   torchao's 8-bit AdamW
    adamw_4bit   optim/torchao_adamw.py   torchao's 4-bit AdamW
    sgd          optim/sgd.py             torch.optim.SGD with momentum
    adafactor    optim/adafactor.py       torch.optim.Adafactor's update, on FSDP2 shards
    muon         optim/muon.py            Muon for the hidden matrices (each whole on an owner rank), AdamW the rest

docs/optimizers.md says what each keeps and when to pick it.
"""

from __future__ import annotations

from typing import Any

from minitrainer.optim.adafactor import Adafactor
from minitrainer.optim.adamw import AdamW
from minitrainer.optim.base import OptimizerChoice
from minitrainer.optim.muon import Muon
from minitrainer.optim.sgd import SGD
from minitrainer.optim.torchao_adamw import AdamW4bit, AdamW8bit
from minitrainer.optim.user_class import UserOptimizer, is_class_path

OPTIMIZERS: dict[str, type[OptimizerChoice]] = {
    choice.name: choice for choice in (AdamW, AdamW8bit, AdamW4bit, SGD, Adafactor, Muon)}


def optimizer_choice(name: str, args: dict[str, Any] | None = None) -> OptimizerChoice:
    """The optimizer ``name`` with its ``--optimizer-args``; ``ValueError`` in one line for an unknown name, a
    class that cannot be imported, or a setting it does not have."""
    if name in OPTIMIZERS:
        return OPTIMIZERS[name](args)
    if is_class_path(name):
        return UserOptimizer(name, args)
    raise ValueError(f"--optimizer {name!r} is not one of {', '.join(OPTIMIZERS)}, nor a class as "
                     "package.module:Class")
