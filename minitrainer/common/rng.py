"""Seeds and random states: every RNG seeded from the one config seed, and saved and restored with a
full state so a resumed run draws what the uninterrupted one would."""

from __future__ import annotations

import random

import numpy as np


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) from the one config seed."""
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def rng_state() -> dict:
    """Every RNG this process draws from (Python, NumPy, torch CPU and, on GPU, CUDA), as tensors
    and plain numbers only, so ``torch.load(weights_only=True)`` reads it back without pickle."""
    import torch

    version, mt_words, gauss = random.getstate()
    kind, np_words, np_pos, has_gauss, cached = np.random.get_state()
    state = {
        "python_version": version, "python_words": torch.tensor(mt_words, dtype=torch.int64),
        "python_gauss": gauss,
        "numpy_kind": kind, "numpy_words": torch.from_numpy(np_words.astype(np.int64)),
        "numpy_pos": int(np_pos), "numpy_has_gauss": int(has_gauss), "numpy_cached_gaussian": float(cached),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import torch

    random.setstate((state["python_version"], tuple(state["python_words"].tolist()), state["python_gauss"]))
    np.random.set_state((state["numpy_kind"], state["numpy_words"].numpy().astype(np.uint32), state["numpy_pos"],
                         state["numpy_has_gauss"], state["numpy_cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
