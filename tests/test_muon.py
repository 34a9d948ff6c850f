"""``--optimizer muon`` (optim/muon.py): torch's Muon and AdamW bit for bit, in one process and on FSDP2 shards.

    .venv/bin/python -m pytest -q tests/test_muon.py

The reference is torch itself: ``torch.optim.Muon`` over the hidden matrices and ``torch.optim.AdamW`` over the rest,
stepped side by side. The two-rank checks run gloo on CPU through one ``torch.multiprocessing.spawn``: FULL_SHARD
(uneven shards), HYBRID-like 2-D meshes and a DCP save and resume, each against one process.
"""

from __future__ import annotations

import copy
import datetime
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from minitrainer.methods.base import FineTuningMethod, param_groups
from minitrainer.methods.osft import OSFT, OSFTSettings
from minitrainer.optim.base import OptimizerSetting
from minitrainer.optim.muon import NOTHING_TO_ORTHOGONALIZE, Muon, MuonWithAdamW

LR = 0.02
BETAS = (0.9, 0.95)
EPS = 1e-8
MATRICES = {"up.weight", "down.weight", "gate.weight", "experts"}


class Toy(nn.Module):
    """A decoder in miniature: embeddings, a wide and a tall hidden matrix (7 rows: uneven on 2 ranks), a one-row
    gate (no rows at all on the second rank), a stack of tall experts, biases, a norm and an untied head."""

    def __init__(self, *, experts: int = 0, vocab: int = 16, width: int = 8, hidden: int = 7):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width, bias=False)
        self.gate = nn.Linear(width, 1, bias=False)
        self.experts = nn.Parameter(torch.randn(experts, width, hidden) * 0.3) if experts else None
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        inner = self.up(h)
        if self.experts is not None:
            inner = inner + torch.einsum("btw,ewh->bth", h, self.experts)
        h = h + self.down(torch.tanh(inner)) * torch.sigmoid(self.gate(h))
        return self.head(self.norm(h))

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def get_output_embeddings(self) -> nn.Module:
        return self.head


def _toy(seed: int = 0, **kwargs) -> Toy:
    torch.manual_seed(seed)
    return Toy(**kwargs)


def _batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 16, (2, 5), generator=gen), torch.randint(0, 16, (2, 5), generator=gen))
            for _ in range(steps)]


def _loss(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())


def _setting(model: nn.Module) -> OptimizerSetting:
    return OptimizerSetting(lr=LR, betas=BETAS, eps=EPS, device=torch.device("cpu"), model=model)


def _muon(model: nn.Module, weight_decay: float = 0.1, **args) -> MuonWithAdamW:
    return Muon(args).build(param_groups(model, weight_decay=weight_decay), _setting(model))


def _train(model: nn.Module, optimizers: list, batches, schedulers: tuple = ()) -> None:
    for ids, targets in batches:
        _loss(model, ids, targets).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        for scheduler in schedulers:
            scheduler.step()


def _equal(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("nesterov", [True, False])
def test_one_process_equals_torch_muon_and_adamw(nesterov, weight_decay, adjust_lr_fn):
    ours_model, torch_model = _toy(), _toy()
    ours = _muon(ours_model, weight_decay, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    names = {id(p): name for name, p in torch_model.named_parameters()}
    muon_groups, adamw_groups = [], []
    for group in param_groups(torch_model, weight_decay=weight_decay):
        for part, wanted in ((muon_groups, True), (adamw_groups, False)):
            params = [p for p in group["params"] if (names[id(p)] in MATRICES) == wanted]
            if params:
                part.append({"params": params, "weight_decay": group["weight_decay"]})
    reference = [torch.optim.Muon(muon_groups, lr=LR, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn),
                 torch.optim.AdamW(adamw_groups, lr=LR, betas=BETAS, eps=EPS)]
    schedule = lambda step: 1 - 0.15 * step  # noqa: E731  (a changing lr reaches both parts)
    _train(ours_model, [ours], _batches(5), [torch.optim.lr_scheduler.LambdaLR(ours, schedule)])
    _train(torch_model, reference, _batches(5),
           [torch.optim.lr_scheduler.LambdaLR(optimizer, schedule) for optimizer in reference])
    for (name, p), q in zip(ours_model.named_parameters(), torch_model.parameters()):
        _equal(p, q)
        state, torch_state = ours.state[p], (reference[0] if name in MATRICES else reference[1]).state[q]
        assert state.keys() == torch_state.keys(), name
        for key in state:
            _equal(state[key], torch_state[key])


def test_the_split_follows_the_model():
    model = _toy()
    optimizer = _muon(model)
    names = {id(p): name for name, p in model.named_parameters()}
    muon = {names[id(p)] for group in optimizer.param_groups if group["muon"] for p in group["params"]}
    adamw = {names[id(p)] for group in optimizer.param_groups if not group["muon"] for p in group["params"]}
    assert muon == {"up.weight", "down.weight", "gate.weight"}
    assert adamw == {"embed.weight", "head.weight", "up.bias", "norm.weight", "norm.bias"}
    # Each of the method's groups split in two, keeping its weight decay: decayed matrices, embeddings and head.
    assert [(group["muon"], group["weight_decay"], len(group["params"])) for group in optimizer.param_groups] == [
        (True, 0.1, 3), (False, 0.1, 2), (False, 0.0, 3)]
    assert Muon().describe(optimizer) == (
        "muon: 3 matrices (120 parameters) orthogonalized, each whole on an owner rank; AdamW: 5 tensors "
        "(279 parameters): embeddings, output head, norms and biases")


def test_a_resumed_state_dict_steps_as_the_uninterrupted_run():
    model = _toy(experts=3)
    optimizer = _muon(model)
    _train(model, [optimizer], _batches(3))
    saved = copy.deepcopy(optimizer.state_dict())
    resumed_model = copy.deepcopy(model)
    resumed = _muon(resumed_model)
    resumed.load_state_dict(saved)  # new group dicts and state: the AdamW part must step these, not the old ones
    _train(model, [optimizer], _batches(2, seed=2))
    _train(resumed_model, [resumed], _batches(2, seed=2))
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        _equal(p, q)
        assert optimizer.state[p].keys() == resumed.state[q].keys()
        for key in optimizer.state[p]:
            _equal(optimizer.state[p][key], resumed.state[q][key])


def test_a_stack_of_experts_is_orthogonalized_per_expert():
    """A tall and a wide stack against torch's Muon on each expert alone: baddbmm over the stack gives addmm's
    bits on CPU (torch 2.13)."""
    gen = torch.Generator().manual_seed(3)
    stacks = [nn.Parameter(torch.randn(3, 8, 7, generator=gen)), nn.Parameter(torch.randn(2, 5, 9, generator=gen))]
    experts = [nn.Parameter(stack[e].detach().clone()) for stack in stacks for e in range(len(stack))]
    ours = MuonWithAdamW([{"params": stacks, "weight_decay": 0.1}], [None], lr=LR)
    reference = torch.optim.Muon(experts, lr=LR, weight_decay=0.1)
    for _ in range(3):
        grads = [torch.randn(stack.shape, generator=gen) for stack in stacks]
        for stack, grad in zip(stacks, grads):
            stack.grad = grad
        for expert, grad in zip(experts, (grad[e] for grad in grads for e in range(len(grad)))):
            expert.grad = grad.clone()
        ours.step()
        reference.step()
    for stack, alone in zip(stacks, (experts[:3], experts[3:])):
        torch.testing.assert_close(stack.detach(), torch.stack([e.detach() for e in alone]), rtol=0, atol=0)


def test_nothing_to_orthogonalize_is_refused_in_one_line():
    only_vectors = nn.LayerNorm(8)
    with pytest.raises(ValueError) as refusal:
        Muon().build(param_groups(only_vectors, weight_decay=0.0), _setting(_toy()))
    assert str(refusal.value) == NOTHING_TO_ORTHOGONALIZE and "\n" not in NOTHING_TO_ORTHOGONALIZE
    model = _toy()  # embeddings and head alone: matrices, yet none is Muon's
    groups = [{"params": [model.embed.weight, model.head.weight, model.norm.weight], "weight_decay": 0.0}]
    with pytest.raises(ValueError, match="no trainable parameter is a matrix"):
        Muon().build(groups, _setting(model))


def test_settings_and_methods_it_refuses():
    for args, problem in (({"momentum": 1.0}, "momentum must be in"), ({"ns_steps": 0}, "ns_steps must be in"),
                          ({"adjust_lr_fn": "none"}, "adjust_lr_fn must be one of"),
                          ({"weight_decay": 0.1}, "'weight_decay' is not one of its settings")):
        with pytest.raises(ValueError, match=problem) as refusal:
            Muon(args)
        assert "\n" not in str(refusal.value)
    assert Muon().method_error(FineTuningMethod()) is None
    error = Muon().method_error(OSFT(OSFTSettings(unfreeze_rank_ratio=0.5, target_patterns=None,
                                                  upcast_dtype=torch.float32)))
    assert error and "\n" not in error and "OSFT" in error and "--optimizer adamw" in error


def _check_sharded_equals_one_process(mesh) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    single = _toy(experts=3)
    sharded = copy.deepcopy(single)
    fully_shard(sharded, mesh=mesh)
    optimizers = [_muon(single), _muon(sharded)]
    _train(single, [optimizers[0]], _batches(3))
    _train(sharded, [optimizers[1]], _batches(3))  # the same data on every rank: averaged, the gradients are one's
    for (name, p), q in zip(single.named_parameters(), sharded.parameters()):
        _equal(q.full_tensor(), p)
        assert optimizers[1].state[q].keys() == optimizers[0].state[p].keys()
        for key, value in optimizers[1].state[q].items():
            if key != "step":  # AdamW's step count is one plain number
                assert isinstance(value, DTensor) and value.placements == q.placements, (name, key)
            _equal(_whole(value), optimizers[0].state[p][key])


def _check_resume(mesh, folder: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    from minitrainer.checkpoint.safe_metadata import MetadataSafeReader

    model = fully_shard(_toy(experts=3), mesh=mesh)
    optimizer = _muon(model)
    _train(model, [optimizer], _batches(2))
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    resumed_model = fully_shard(_toy(seed=5, experts=3), mesh=mesh)
    resumed = _muon(resumed_model)
    model_state, optim_state = get_state_dict(resumed_model, resumed)  # a fresh optimizer: DCP steps it at lr 0
    dcp.load({"model": model_state, "optim": optim_state}, storage_reader=MetadataSafeReader(folder))
    set_state_dict(resumed_model, resumed, model_state_dict=model_state, optim_state_dict=optim_state)
    _train(model, [optimizer], _batches(2, seed=2))
    _train(resumed_model, [resumed], _batches(2, seed=2))
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        _equal(p.full_tensor(), q.full_tensor())
        assert optimizer.state[p].keys() == resumed.state[q].keys()
        for key, value in optimizer.state[p].items():
            _equal(_whole(value), _whole(resumed.state[q][key]))


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _two_rank_worker(rank: int, port: int, folder: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))  # a failed rank ends the other in 2 min
    _check_sharded_equals_one_process(init_device_mesh("cpu", (2,), mesh_dim_names=("shard",)))
    _check_sharded_equals_one_process(init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard")))
    _check_sharded_equals_one_process(init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard")))
    _check_resume(init_device_mesh("cpu", (2,), mesh_dim_names=("shard",)), folder)
    dist.barrier()
    dist.destroy_process_group()
    # As tests/test_osft.py's workers: DTensor's caches still hold the gloo groups, whose teardown at the
    # interpreter's exit may abort; a passing worker leaves at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_two_ranks_equal_one_process_and_resume_exactly(tmp_path):
    """FULL_SHARD over 2 ranks (7-row matrices and a 3-expert stack split unevenly), replicate 2 x shard 1 and
    replicate 1 x shard 2 each equal one process bit for bit; a DCP save and load continues bit for bit."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_two_rank_worker, args=(port, str(tmp_path / "full_state")), nprocs=2, join=True)
