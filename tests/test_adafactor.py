"""``--optimizer adafactor`` (optim/adafactor.py): torch's Adafactor update on FSDP2 row shards.

    .venv/bin/python -m pytest -q tests/test_adafactor.py

One process: bit for bit ``torch.optim.Adafactor``. Two gloo ranks (one spawn): FULL_SHARD with uneven shards (an
odd row count, a matrix of one row, a 3-D tensor of three slices) equals one process of torch's to float32
rounding; HYBRID_SHARD (2 x 1) bit for bit; a DCP save and load into a fresh sharded model continues exactly,
and the same checkpoint loaded into one process continues like the two ranks.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from minitrainer.optim.adafactor import Adafactor, ShardedAdafactor
from minitrainer.optim.base import OptimizerSetting

LR = 1e-2
STEPS = 5


class _Toy(nn.Module):
    """A matrix of 5 rows (3 + 2 on two ranks), one of 1 row (none on the second rank), a 3-D tensor (its
    last two dims factored, sharded over the leading one), 1-D biases and a norm weight."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.up = nn.Linear(8, 5)
        self.norm = nn.Parameter(1 + 0.1 * torch.randn(5))
        self.experts = nn.Parameter(torch.randn(3, 5, 4) / 3)
        self.down = nn.Linear(4, 6)
        self.gate = nn.Linear(5, 1, bias=False)

    def forward(self, x):
        h = torch.tanh(self.up(x)) * self.norm
        mixed = torch.tanh(torch.einsum("bi,eij->bej", h, self.experts)).sum(dim=1)
        return self.down(mixed).square().mean() + self.gate(h).square().mean()


def _groups(model: nn.Module) -> list[dict]:
    """Matrices decayed, 1-D tensors not, as the methods group them."""
    decay = [p for p in model.parameters() if p.dim() > 1]
    return [{"params": decay, "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0}]


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(100 + step))
        optimizer.zero_grad()
        model(x).backward()
        optimizer.step()


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _torch_reference(steps: int = STEPS, **kwargs) -> _Toy:
    model = _Toy()
    _train(model, torch.optim.Adafactor(_groups(model), lr=LR, **kwargs), range(steps))
    return model


def _assert_params(model: nn.Module, reference: nn.Module, *, rtol: float, atol: float) -> None:
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(_full(p.detach()), _full(q.detach()), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("args", [{}, {"maximize": True, "eps1": 1e-20, "beta2_decay": -0.5, "d": 2.0}])
def test_one_process_is_torchs_adafactor_bit_for_bit(args):
    model = _Toy()
    choice = Adafactor(args)
    optimizer = choice.build(_groups(model), OptimizerSetting(lr=LR, betas=(0.9, 0.999), eps=1e-8,
                                                              device=torch.device("cpu")))
    _train(model, optimizer, range(STEPS))
    torch_args = {key: value for key, value in args.items() if key != "eps1"}
    reference = _torch_reference(eps=(args.get("eps1"), 1e-3), **torch_args)
    _assert_params(model, reference, rtol=0, atol=0)
    assert any((p.detach() != q.detach()).any() for p, q in zip(model.parameters(), _Toy().parameters()))
    state = optimizer.state[model.experts]
    assert state["row_var"].shape == (3, 5, 1) and state["col_var"].shape == (3, 1, 4)
    assert state["step"].item() == STEPS
    assert choice.describe(optimizer).startswith("adafactor: 4 tensors with factored second moments")
    assert "3 elementwise" in choice.describe(optimizer) and "--learning-rate" not in choice.describe(optimizer)


def test_settings_are_checked_in_one_line():
    from minitrainer.optim.registry import optimizer_choice

    assert isinstance(optimizer_choice("adafactor", {"eps1": 0}), Adafactor)
    assert Adafactor().args.eps1 is None and Adafactor({"eps1": 0}).args.eps1 == 0.0
    for args, match in [({"beta2_decay": 0.5}, "beta2_decay must be <= 0"), ({"eps1": "tiny"}, "eps1 must be a"),
                        ({"eps1": -1.0}, "eps1 must be >= 0"), ({"eps2": -1}, "eps2 must be >= 0"),
                        ({"d": 0}, "must be > 0"), ({"betas": [0.9, 0.99]}, "not one of its settings")]:
        with pytest.raises(ValueError, match=match) as err:
            Adafactor(args)
        assert "\n" not in str(err.value)
    optimizer = Adafactor().build(_groups(_Toy()), OptimizerSetting(lr=5e-6, betas=(0.9, 0.999), eps=1e-8,
                                                                    device=torch.device("cpu")))
    assert "set --learning-rate" in Adafactor().describe(optimizer)


def _check_full_shard(mesh) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard

    model = _Toy()
    fully_shard(model, mesh=mesh)
    assert model.gate.weight.to_local().shape == ((1, 5) if dist.get_rank() == 0 else (0, 5))
    optimizer = ShardedAdafactor(_groups(model), lr=LR)
    _train(model, optimizer, range(STEPS))
    # Float32 rounding: the column sums and norms are added up in another order than one process's (seen: at
    # most 3e-8 apart, a last bit or two).
    _assert_params(model, _torch_reference(), rtol=1e-6, atol=1e-7)
    state = optimizer.state[model.up.weight]
    assert state["row_var"].placements == (Shard(0),) and state["row_var"].shape == (5, 1)
    assert state["col_var"].placements == (Replicate(),) and state["col_var"].to_local().shape == (1, 8)
    assert optimizer.state[model.experts]["col_var"].placements == (Shard(0),)


def _check_hybrid_shard(mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    model = _Toy()
    fully_shard(model, mesh=mesh)
    _train(model, ShardedAdafactor(_groups(model), lr=LR), range(STEPS))
    # One rank per shard group: nothing is summed, so each replica computes what one process does.
    _assert_params(model, _torch_reference(), rtol=0, atol=0)


def _sharded(seed: int, mesh) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    model = _Toy(seed)
    fully_shard(model, mesh=mesh)
    return model, ShardedAdafactor(_groups(model), lr=LR)


def _check_resume(mesh, folder: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer = _sharded(0, mesh)
    _train(model, optimizer, range(3))
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    # The trainer's load (checkpoint/full_state.py): a fresh model and optimizer, DCP filling their states.
    resumed, resumed_optimizer = _sharded(1, mesh)
    model_state, optim_state = get_state_dict(resumed, resumed_optimizer)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    set_state_dict(resumed, resumed_optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    _train(model, optimizer, range(3, STEPS))
    _train(resumed, resumed_optimizer, range(3, STEPS))
    _assert_params(resumed, model, rtol=0, atol=0)
    for p, q in zip(model.parameters(), resumed.parameters()):
        for key, value in optimizer.state[p].items():
            torch.testing.assert_close(_full(resumed_optimizer.state[q][key]), _full(value), rtol=0, atol=0)
    finals = {name: _full(p.detach()) for name, p in model.named_parameters()}
    if dist.get_rank() == 0:
        torch.save(finals, os.path.join(folder, "finals.pt"))


def _check_refusal(mesh) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    column_split = nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)]))
    with pytest.raises(ValueError, match=r"Shard\(0\).*--optimizer adamw") as err:
        ShardedAdafactor([column_split])
    assert "\n" not in str(err.value)


def _two_rank_worker(rank: int, port: int, folder: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    flat = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
    _check_full_shard(flat)
    _check_hybrid_shard(init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard")))
    _check_resume(flat, folder)
    _check_refusal(flat)
    dist.barrier()
    dist.destroy_process_group()
    # As tests/test_osft.py: DTensor's caches hold the gloo groups, whose teardown at exit may abort.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # the one-process load, meant
def test_two_ranks_equal_one_process_and_resume_exactly():
    """FULL_SHARD (2) equals one process of torch's Adafactor to float32 rounding, HYBRID_SHARD (2 x 1) bit for
    bit; a DCP round trip continues bit for bit, and the two ranks' checkpoint loaded into one process (DCP
    gathering the row shards) continues like them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_two_rank_worker, args=(port, folder), nprocs=2, join=True)
        model = _Toy(1)
        optimizer = ShardedAdafactor(_groups(model), lr=LR)
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
        assert optimizer.state[model.up.weight]["row_var"].shape == (5, 1)
        _train(model, optimizer, range(3, STEPS))
        finals = torch.load(os.path.join(folder, "finals.pt"), weights_only=True)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), finals[name], rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
