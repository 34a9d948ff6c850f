"""The reference log-probabilities of preference pairs: computed once, by the training code path, and kept.

One forward-only pass before step 1 walks **the training loader itself** over epoch 0 (the same packer, rows
per rank, kernels, dtype and chunking as the steps) and the validation plan, so every pair's reference sums are
computed in exactly the packed row its first step computes the policy's in: the log-ratio of step 1 is then
exactly 0 (on deterministic kernels), and the sigmoid loss exactly ln 2.

The values are stored as ``reference_logps/<key>.npz`` beside the tokenized data (the run's output folder when
that one is read-only), by ``common/stores.py``. What they depend on: the reference model's weights digest (the
one resume compares), the fine-tuning method (QLoRA's NF4 base is another reference), dtype, attention backend,
the data's content digests and the packing. The key hashes it, and the file holds it (``computed_from``); a
rerun or resume reuses a file only when what it holds equals this run's, so another model never does, even
under the same name. A file computed from something else or unreadable is one line and computed again; a
store that cannot be written (a full disk) is one warning and the run goes on, with the values in memory.

Which model is the reference: ``--reference-model PATH`` when given, loaded for the pass and freed; else the
run's own model before its first update (this pass runs before a resume loads a checkpoint), which with LoRA or
QLoRA is the base with adapters adding exactly 0, and with OSFT the base rebuilt from its factors.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from minitrainer.common.distributed import reshard
from minitrainer.common.log import log_rank_0
from minitrainer.common.stores import read_store, write_store
from minitrainer.data.sampler import cannot_write
from minitrainer.objectives.base import RunContext

STORE_DIR = "reference_logps"
WHAT = "reference log-probabilities"


@dataclass(frozen=True)
class ReferenceTable:
    """Reference log-probabilities ``[N, 2]`` (chosen, rejected) of a dataset's pairs, and their sides'
    learned-token counts ``[N, 2]``, indexed by the dataset's rows."""

    values: np.ndarray
    side_loss_tokens: np.ndarray

    @staticmethod
    def empty() -> ReferenceTable:
        return ReferenceTable(np.zeros((0, 2), np.float32), np.zeros((0, 2), np.int64))

    def logps(self, rows, device: torch.device) -> torch.Tensor:
        return torch.as_tensor(self.values[list(rows)], device=device)


def reference_tables(model: nn.Module, objective, context: RunContext, *, flag: str) -> tuple[ReferenceTable,
                                                                                          ReferenceTable]:
    """The training and held-out tables: read from the store when it was computed from what this run's would
    be, else computed and stored.
    ``objective``: the pairs' forward (``forward_pairs``, ``held_out_logps``) and its ``reference_model``
    (``flag`` names it in a refusal)."""
    source = objective.settings.reference_model
    dist_info, dataset, val_dataset = context.dist_info, context.dataset, context.val_dataset
    reference_weights = context.models.weights_digest(source, flag=flag) if source else context.weights_digest
    parts = path = None
    # Rank 0 alone keys, reads and writes the store (it hashed the data already, for the resume fingerprint).
    if dist_info.is_main:
        parts = {
            "reference_weights": reference_weights, "method": {} if source else context.method_fingerprint,
            "dtype": str(context.param_dtype), "attn_implementation": context.attn,
            "data": dataset.content_digest(), "held_out": val_dataset.content_digest() if val_dataset else None,
            "packing": context.packing,
        }
        path = _store_folder(Path(dataset.path).parent, Path(context.output_dir)) / f"{_key(parts)}.npz"
    num_held_out = len(val_dataset) if val_dataset is not None else 0
    found = [_read(path, parts, num_train=len(dataset), num_held_out=num_held_out) if dist_info.is_main else None]
    dist.broadcast_object_list(found, src=0)
    if found[0] is not None:
        train, held_out = found[0]
        log_rank_0("reference log-probabilities: %s (computed before, for this model, data and packing)", path)
    else:
        log_rank_0("reference log-probabilities of %d %s: computing them with %s (a forward pass over epoch 0)",
                   len(dataset), objective.unit, source or "the starting model")
        began = time.perf_counter()
        reference = context.models.load(source, flag=flag) if source else model
        train = epoch_pass(reference, context, objective=objective)
        held_out = (held_out_pass(reference, val_dataset, context.val_plan, dist_info=dist_info, attn=context.attn,
                                  objective=objective) if val_dataset is not None else np.zeros((0, 2), np.float32))
        del reference  # a --reference-model is freed here; the run's model stays referenced
        # Rank 0 alone writes, and alone logs: it knows whether the write went through.
        stored = dist_info.is_main and write_store(path, {"train": train, "held_out": held_out}, computed_from=parts,
                                                   what=WHAT)
        log_rank_0("reference log-probabilities of %d %s%s by %s in %.1fs, %s", len(train), objective.unit,
                   f" (+{len(held_out)} held out)" if len(held_out) else "", source or "the starting model",
                   time.perf_counter() - began, f"stored in {path}" if stored else "kept in memory only")
    return (ReferenceTable(train, dataset.side_loss_tokens),
            ReferenceTable(held_out, val_dataset.side_loss_tokens if val_dataset is not None
                           else np.zeros((0, 2), np.int64)))


def epoch_pass(model: nn.Module, context: RunContext, *, objective) -> np.ndarray:
    """Every pair's log-probabilities in epoch 0's packing, forward only (collective), walking the run's own
    batch stream (``RunContext.batches``). The last batch may reach into epoch 1; a pair seen twice gets the mean
    of its two (equal up to summation order) values."""
    device = context.dist_info.device
    num_rows = len(context.dataset)
    totals = torch.zeros((num_rows, 2), dtype=torch.float64, device=device)
    counts = torch.zeros(num_rows, dtype=torch.float64, device=device)
    was_training = model.training
    model.train()  # as the steps run (dropout is off)
    with context.batches() as loader, torch.no_grad():
        for _, batch in zip(range(math.ceil(num_rows / context.batch_size)), loader):
            for minibatch in batch.minibatches:
                _add(totals, counts, objective.forward_pairs(model, minibatch, context.attn, device)[0],
                     minibatch.rows)
    model.train(was_training)
    reshard(model)
    return _gathered(totals, counts, what="training")


def held_out_pass(model: nn.Module, dataset, plan, *, dist_info, attn: str, objective) -> np.ndarray:
    """The held-out pairs' log-probabilities in the validation plan's packing and mode (collective)."""
    device = dist_info.device
    totals = torch.zeros((len(dataset), 2), dtype=torch.float64, device=device)
    counts = torch.zeros(len(dataset), dtype=torch.float64, device=device)
    for logps, rows in objective.held_out_logps(model, dataset, plan, rank=dist_info.rank, attn=attn, device=device):
        _add(totals, counts, logps, rows)
    reshard(model)
    return _gathered(totals, counts, what="held-out", allow_unseen=True)


def _add(totals: torch.Tensor, counts: torch.Tensor, logps: torch.Tensor, rows: tuple[int, ...]) -> None:
    if rows:
        index = torch.tensor(rows, device=totals.device)
        totals.index_add_(0, index, logps.double())
        counts.index_add_(0, index, torch.ones(len(rows), dtype=torch.float64, device=totals.device))


def _gathered(totals: torch.Tensor, counts: torch.Tensor, *, what: str, allow_unseen: bool = False) -> np.ndarray:
    packed = torch.cat([totals, counts.unsqueeze(1)], dim=1)
    dist.all_reduce(packed)
    packed = packed.cpu().numpy()
    seen = packed[:, 2] > 0
    # Pairs over the token budget are never trained (nor evaluated): they keep no reference.
    assert allow_unseen or seen.any() or not len(packed), f"no {what} pair was seen by the reference pass"
    values = np.zeros((len(packed), 2), np.float32)
    values[seen] = (packed[seen, :2] / packed[seen, 2:]).astype(np.float32)
    return values


def _key(parts: dict) -> str:
    import xxhash

    return xxhash.xxh3_64(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _store_folder(data_folder: Path, output_dir: Path) -> Path:
    """Beside the data, unless that folder cannot be written (a shared read-only dataset)."""
    if cannot_write(data_folder) is None:
        return data_folder / STORE_DIR
    log_rank_0("reference log-probabilities: %s cannot be written, storing them in %s", data_folder, output_dir)
    return output_dir / STORE_DIR


def _read(path: Path, parts: dict, *, num_train: int, num_held_out: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The stored tables when ``path`` was computed from ``parts`` and fits the data; else None (one line said
    why, ``common/stores.py``)."""
    arrays = read_store(path, computed_from=parts, shapes={"train": (num_train, 2), "held_out": (num_held_out, 2)},
                        what=WHAT)
    return None if arrays is None else (arrays["train"], arrays["held_out"])
