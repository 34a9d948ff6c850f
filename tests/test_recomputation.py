"""``--activation-checkpointing`` policies: the same loss and gradients as no recomputation, and each policy
recomputes what it says (``recomputation.py``).

    .venv/bin/python -m pytest -q tests/test_recomputation.py      # ~1 min on a loaded CPU

The model goes through ``setup_model`` (FSDP2, one gloo process) as in training; what backward recomputes is
counted by op under a ``TorchDispatchMode`` around ``backward()``.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from fixtures.e2e import model_vocab_size
from minitrainer.setup.autotune import probe_recomputation
from minitrainer.common.cli import parse_config
from minitrainer.common.distributed import init_distributed
from minitrainer.common.labels import IGNORE_INDEX
from minitrainer.data.sampler import collate_minibatch
from minitrainer.model.attention import model_inputs
from minitrainer.setup.model import setup_model
from minitrainer.train_config import TrainConfig

LENGTHS = [7, 3, 12, 5]


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def dist_info():
    """One gloo process (conftest destroys its group after the test)."""
    return init_distributed()


def _minibatch(vocab_size: int):
    gen = torch.Generator().manual_seed(5)
    samples = []
    for n in LENGTHS:
        ids = torch.randint(0, vocab_size, (n,), generator=gen)
        labels = ids.clone()
        labels[:2] = IGNORE_INDEX  # a masked prompt
        samples.append((ids.numpy(), labels.numpy()))
    return collate_minibatch(samples)


def _train_pass(model_dir, dist_info, *, policy: str, attn: str) -> tuple[torch.Tensor, dict, Counter]:
    model, resolved = setup_model(model_name_or_path=str(model_dir), dist_info=dist_info, attn_implementation=attn,
                                  sharding_strategy="FULL_SHARD", cpu_offload=False, activation_checkpointing=policy,
                                  use_liger_kernels=False, local_world_size=1)
    assert resolved.recomputation == policy
    loss = model(**model_inputs(_minibatch(model_vocab_size(model_dir)), resolved.attn_implementation,
                                dist_info.device))
    with _OpCounter() as counter:
        loss.backward()
    grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
             for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, counter.counts


@pytest.mark.parametrize("attn", ["sdpa", "reference_varlen"])
def test_every_policy_gives_the_loss_and_gradients_of_no_recomputation(chatml_model, dist_info, attn):
    runs = {policy: _train_pass(chatml_model, dist_info, policy=policy, attn=attn)
            for policy in ("none", "selective", "full")}
    loss, grads, _ = runs["none"]
    for policy in ("selective", "full"):
        other_loss, other_grads, _ = runs[policy]
        # Recomputation replays the same ops on the same inputs on one thread: bit for bit.
        torch.testing.assert_close(other_loss, loss, rtol=0, atol=0)
        assert other_grads.keys() == grads.keys()
        for name in grads:
            torch.testing.assert_close(other_grads[name], grads[name], rtol=0, atol=0, msg=f"{policy} {name}")
    # Each policy recomputes what it says, counted in backward: full reruns the blocks' matmuls, selective
    # keeps them (as many as without recomputation) but reruns the element-wise ops.
    mm = {policy: counts["mm"] + counts["addmm"] + counts["bmm"] for policy, (_, _, counts) in runs.items()}
    assert mm["selective"] == mm["none"] < mm["full"], mm
    total = {policy: sum(counts.values()) for policy, (_, _, counts) in runs.items()}
    assert total["none"] < total["selective"] < total["full"], total


def test_auto_without_a_gpu_is_full(chatml_model, dist_info, caplog):
    model, resolved = setup_model(model_name_or_path=str(chatml_model), dist_info=dist_info, attn_implementation="sdpa",
                                  sharding_strategy="FULL_SHARD", cpu_offload=False, activation_checkpointing="auto",
                                  use_liger_kernels=False, local_world_size=1)
    assert resolved.recomputation == "full"
    lengths = SimpleNamespace(lengths=np.array([5, 9]))  # what the trial step reads of a dataset before a trial
    chosen = probe_recomputation(model, lengths, model_inputs=None, dist_info=dist_info, num_tokens=64)
    assert chosen == "full"
    assert "--activation-checkpointing auto needs a GPU" in caplog.text


@pytest.mark.parametrize(("argv", "policy"), [
    ([], "full"), (["--activation-checkpointing"], "full"), (["--no-activation-checkpointing"], "none"),
    (["--activation-checkpointing", "selective"], "selective"), (["--activation-checkpointing=auto"], "auto"),
    (["--activation-checkpointing", "none", "--seed", "3"], "none")])
def test_the_flag_keeps_its_boolean_forms(argv, policy):
    config = parse_config(TrainConfig, ["--output-dir", "out", "--model-name-or-path", "m", "--data-path", "d", *argv])
    assert config.activation_checkpointing == policy


def test_config_files_and_the_api_keep_their_booleans(tmp_path):
    path = tmp_path / "training_params.json"
    path.write_text('{"activation_checkpointing": true, "output_dir": "out", "model_name_or_path": "m", "data_path": "d"}')
    assert parse_config(TrainConfig, ["--config", str(path)]).activation_checkpointing == "full"
    path.write_text('{"activation_checkpointing": false, "output_dir": "out", "model_name_or_path": "m", "data_path": "d"}')
    assert parse_config(TrainConfig, ["--config", str(path)]).activation_checkpointing == "none"
    assert TrainConfig(model_name_or_path="m", data_path="d", output_dir="out", min_samples_per_checkpoint=4,
                       activation_checkpointing=False).activation_checkpointing == "none"
    with pytest.raises(ValueError, match="--activation-checkpointing 'half' is not one of"):
        TrainConfig(model_name_or_path="m", data_path="d", output_dir="out", min_samples_per_checkpoint=4, activation_checkpointing="half")
