"""The device edge: which device this process computes on, and its synchronisation and peak memory, as
no-ops or host figures on CPU. The rest of the toolkit asks here rather than ``torch.cuda``."""

from __future__ import annotations


def device_type() -> str:
    """'cuda' when a GPU is visible, else 'cpu'."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def synchronize() -> None:
    """Wait for queued device work (a no-op on CPU)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_peak_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_memory_gb() -> float:
    """Peak GPU memory allocated since the last reset, in GB (10**9 bytes, as the original
    mini_trainer logged it); on CPU, this process's peak RSS."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 1e9
    import resource

    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
