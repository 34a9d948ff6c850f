"""Helpers shared by the end-to-end tests: tokenized data on disk and real torchrun launches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
IGNORE_INDEX = -100


def write_tokenized_jsonl(path: Path, *, num_samples: int, vocab_size: int, seed: int = 0,
                          min_len: int = 4, max_len: int = 48) -> Path:
    """Rows shaped like process_data.py output: a masked prompt, then an unmasked reply."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for _ in range(num_samples):
            length = int(rng.integers(min_len, max_len + 1))
            input_ids = rng.integers(0, vocab_size, size=length).tolist()
            prompt = int(rng.integers(1, length))
            labels = [IGNORE_INDEX] * prompt + input_ids[prompt:]
            row = {"input_ids": input_ids, "labels": labels, "len": length,
                   "num_loss_counted_tokens": length - prompt}
            f.write(json.dumps(row) + "\n")
    return path


def torchrun(args: list[str], *, nproc: int = 2, timeout: float = 300, script: str = "train.py",
             env: dict | None = None) -> subprocess.CompletedProcess:
    """Launch ``script`` under torchrun on CPU with ``nproc`` gloo processes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--master-port", str(_free_port()), str(ROOT / script), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def torchrun_two_nodes(args: list[str], *, timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """Two single-process torchrun "nodes" on this host (static rendezvous), as a 2-node job runs."""
    port = str(_free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={rank}",
                               "--nproc-per-node=1", "--master-addr=127.0.0.1", "--master-port", port,
                               str(ROOT / "train.py"), *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    results = []
    for node in nodes:
        stdout, stderr = node.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(node.args, node.returncode, stdout, stderr))
    return results


def read_metrics(output_dir: Path) -> list[dict]:
    path = Path(output_dir) / "training_metrics_0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
