"""Torchrun helper of tests/test_autotune.py (not a test itself): a ``--max-tokens-per-gpu auto``
trial step that fails mid-backward (``MINI_TRAINER_TEST_PROBE_FAIL``), then one real training step.

    torchrun --nproc-per-node=2 -m tests.probe_recovery_run MODEL_DIR DATA_FILE RESULT_JSON   # from the repository root

Writes the trial's verdict and a checksum of the updated full weights (rank 0).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from minitrainer.setup.autotune import make_trial_step, probe_agreement, trial_fits
from minitrainer.checkpoint.hf_export import gather_full_state_dict
from minitrainer.common.distributed import cleanup, init_distributed
from minitrainer.data import sampler
from minitrainer.model.attention import model_inputs
from minitrainer.setup.model import setup_model


def main(model_dir: str, data_file: str, result: str) -> None:
    info = init_distributed()
    torch.manual_seed(0)
    model, resolved = setup_model(model_name_or_path=model_dir, dist_info=info, attn_implementation="auto",
                                  sharding_strategy="FULL_SHARD", cpu_offload=False, activation_checkpointing=False,
                                  use_liger_kernels=False, local_world_size=info.world_size)
    dataset = sampler.load_tokenized_dataset(data_file)

    def inputs(minibatch):
        return model_inputs(minibatch, resolved.attn_implementation, info.device)

    fitted = trial_fits(make_trial_step(model, dataset, model_inputs=inputs), 64, agree=probe_agreement(info))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    rows = range(info.rank * 3, info.rank * 3 + 3)  # different data per rank: only a reduction makes them agree
    model(**inputs(sampler.collate_minibatch([dataset.sample(i) for i in rows]))).backward()
    optimizer.step()
    state = gather_full_state_dict(model)
    if info.rank == 0:
        checksum = {name: float(t.double().sum()) for name, t in state.items()}
        Path(result).write_text(json.dumps({"fitted": fitted, "weights": checksum}))
    cleanup()


if __name__ == "__main__":
    main(*sys.argv[1:])
