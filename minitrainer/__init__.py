"""mini-trainer: fine-tuning and continued pretraining of Hugging Face causal LMs, FSDP2 on packed batches.

    from minitrainer import TrainConfig, TorchrunArgs, run_training, ProcessDataConfig, process_data

Inside a torchrun job, ``minitrainer.train.train(config)`` trains as one of its ranks. The package's folders
and their order: docs/code-layout.md. The names below are loaded on first use, so ``import
minitrainer.data.sampler`` does not import the trainer.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_API = {
    "TrainConfig": "minitrainer.train_config",
    "TorchrunArgs": "minitrainer.api",
    "run_training": "minitrainer.api",
    "ProcessDataConfig": "minitrainer.data.process_data",
    "process_data": "minitrainer.data.process_data",
    "config_from_file": "minitrainer.common.config_files",
}

__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'minitrainer' has no attribute {name!r}")
    return getattr(importlib.import_module(_API[name]), name)


def __dir__() -> list[str]:
    return sorted(__all__)
