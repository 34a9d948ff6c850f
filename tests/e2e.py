"""Helpers shared by the end-to-end tests: tokenized data on disk and real torchrun launches."""

from __future__ import annotations

import enum
import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

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


def model_vocab_size(model_dir: Path) -> int:
    """The vocabulary of the model saved in ``model_dir``, from its config (no weights loaded)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir).vocab_size


def unpacked_loss_sum(model, samples, *, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, int]:
    """The tests' reference: each ``(input_ids, labels)`` alone through ``model`` (no packing, no
    sharding, one process); the summed next-token cross-entropy (logits cast to ``dtype`` if given)
    and the number of loss-counted tokens."""
    sums, num_tokens = [], 0
    for input_ids, labels in samples:
        logits = model(input_ids=torch.tensor([input_ids])).logits[0, :-1]
        targets = torch.tensor(labels[1:])
        sums.append(F.cross_entropy(logits if dtype is None else logits.to(dtype), targets,
                                    ignore_index=IGNORE_INDEX, reduction="sum"))
        num_tokens += int((targets != IGNORE_INDEX).sum())
    return torch.stack(sums).sum(), num_tokens


def reference_adamw_losses(model, data_path: Path, *, num_steps: int, batch_size: int, seed: int,
                           lr: float) -> list[float]:
    """The losses of ``num_steps`` plain single-process AdamW steps on the sampler's batches, each the
    model's own unpacked per-token mean: what the packed, sharded trainer must reproduce."""
    from sampler import InfiniteSampler, load_tokenized_dataset

    dataset = load_tokenized_dataset(str(data_path))
    sampler = InfiniteSampler(len(dataset), seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95),
                                  weight_decay=0.0)
    losses = []
    for _ in range(num_steps):
        loss_sum, num_tokens = unpacked_loss_sum(model, [dataset.sample(int(i)) for i in sampler.take(batch_size)])
        loss = loss_sum / num_tokens
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


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


class _EnumForm(pickle.Pickler):
    """Writes enum members in one chosen form, whatever this interpreter's default: Python 3.11.2
    writes ``getattr(EnumClass, 'NAME')``, 3.10/3.11.7/3.12+ write the member by value."""

    def __init__(self, file, *, by_name: bool, protocol: int):
        super().__init__(file, protocol=protocol)
        self.by_name = by_name

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return (getattr, (type(obj), obj.name)) if self.by_name else (type(obj), (obj.value,))
        return NotImplemented


def pickle_enums(obj, *, by_name: bool, protocol: int = pickle.DEFAULT_PROTOCOL) -> bytes:
    buf = io.BytesIO()
    _EnumForm(buf, by_name=by_name, protocol=protocol).dump(obj)
    return buf.getvalue()
