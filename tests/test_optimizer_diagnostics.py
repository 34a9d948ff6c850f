"""``--optimizer-diagnostics``: every parameter's kind, and each kind's gradient norm and update ratio against the
same numbers computed directly from the gradients and weights of a real AdamW step on an FSDP2-sharded model.

    .venv/bin/python -m pytest -q tests/test_optimizer_diagnostics.py      # ~10 s, one process, gloo

The metrics line of a real run holding these keys is checked by hand (docs/training.md, Metrics).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from fixtures.e2e import _free_port
from minitrainer.loop.step import clip_grad_norm
from minitrainer.methods.lora import LoraSettings, apply_lora
from minitrainer.optim.diagnostics import KINDS, build_diagnostics, parameter_kinds

CPU = torch.device("cpu")
EXPECTED = {"q_proj": "attention", "k_proj": "attention", "v_proj": "attention", "o_proj": "attention",
            "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp", "embed_tokens": "embeddings",
            "lm_head": "head", "input_layernorm": "norms", "post_attention_layernorm": "norms", "norm": "norms"}
"""A Llama's parameters by the module that holds them."""


def _tiny_llama(*, tie_word_embeddings: bool = False, seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")


def _holder(name: str) -> str:
    """The module that holds parameter ``name`` (``model.layers.0.self_attn.q_proj.weight`` -> ``q_proj``)."""
    parts = name.split(".")
    return parts[-2] if parts[-1] in ("weight", "bias") else parts[-1]


def _init_one_rank() -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)


def _shard(model, mesh_shape: tuple[int, ...]) -> None:
    names = ("shard",) if len(mesh_shape) == 1 else ("replicate", "shard")
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


@pytest.mark.parametrize("tied", [False, True])
def test_every_parameter_gets_the_kind_of_the_module_that_holds_it(tied):
    model = _tiny_llama(tie_word_embeddings=tied)
    kinds = parameter_kinds(model)
    assert set(kinds) == {name for name, _ in model.named_parameters()}
    assert set(kinds.values()) <= set(KINDS)
    for name, kind in kinds.items():
        assert kind == EXPECTED[_holder(name)], name
    # A tied head is the embedding matrix: named once, as embeddings.
    assert ("lm_head.weight" in kinds) != tied


def test_the_kinds_are_the_same_once_sharded():
    _init_one_rank()
    model = _tiny_llama()
    unsharded = parameter_kinds(model)
    _shard(model, (1,))
    assert parameter_kinds(model) == unsharded


def test_lora_adapters_take_the_kind_of_the_layer_they_adapt():
    model = _tiny_llama()
    apply_lora(model, LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules="all-linear", use_rslora=False))
    kinds = parameter_kinds(model)
    adapters = {name: kinds[name] for name, param in model.named_parameters() if param.requires_grad}
    assert adapters and all(".lora_" in name for name in adapters)
    for name, kind in adapters.items():
        layer = name.split(".lora_")[0].rsplit(".", 1)[-1]  # ...self_attn.q_proj.lora_A.default.weight -> q_proj
        assert kind == EXPECTED[layer], name


def _reference(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], grads: dict[str, torch.Tensor],
               kinds: dict[str, str]) -> dict[str, float]:
    """The metrics computed directly: norms of the concatenation of each kind's full tensors, in float64."""
    record = {}
    for kind in sorted(set(kinds.values())):
        names = [name for name in grads if kinds[name] == kind]
        flat = {key: torch.cat([tensors[name].double().flatten() for name in names])
                for key, tensors in (("grad", grads), ("before", before), ("after", after))}
        record[f"grad_norm/{kind}"] = flat["grad"].norm().item()
        record[f"update_ratio/{kind}"] = (flat["after"] - flat["before"]).norm().item() / flat["before"].norm().item()
    return record


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


@pytest.mark.parametrize("mesh_shape", [(1,), (1, 1)], ids=["full-shard", "hybrid-2d"])
@pytest.mark.parametrize("applied", [True, False], ids=["applied", "skipped"])
def test_the_numbers_equal_the_norms_of_a_real_adamw_step(mesh_shape, applied):
    _init_one_rank()
    model = _tiny_llama()
    _shard(model, mesh_shape)
    kinds = parameter_kinds(model)
    diagnostics = build_diagnostics(model, enabled=True, device=CPU)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    input_ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    total = float(clip_grad_norm(model, 0.05))
    assert total > 0.05  # clipped: the gradient the optimizer sees is not the one backward left
    grads = {name: _full(param.grad) for name, param in model.named_parameters()}
    before = {name: _full(param) for name, param in model.named_parameters()}

    watched = diagnostics.before_update()
    if applied:
        optimizer.step()
    sums = diagnostics.after_update(watched)
    dist.all_reduce(sums)  # as reduce_step sums it with the step's other sums
    record = diagnostics.metrics(sums.tolist(), applied=applied)

    after = {name: _full(param) for name, param in model.named_parameters()}
    expected = _reference(before, after, grads, kinds)
    assert diagnostics.kinds == ["attention", "mlp", "embeddings", "head", "norms"]  # a Llama has no "other"
    assert set(record) == set(expected) == {f"{metric}/{kind}" for metric in ("grad_norm", "update_ratio")
                                            for kind in diagnostics.kinds}
    for key, value in expected.items():
        if key.startswith("update_ratio/") and not applied:
            assert value == 0.0 and record[key] == 0.0, key
        else:
            assert record[key] == pytest.approx(value, rel=1e-5), key
    # The kinds split the clipped gradient: their norms add up, in squares, to its total norm.
    assert math.sqrt(sum(record[f"grad_norm/{kind}"] ** 2 for kind in diagnostics.kinds)) == pytest.approx(0.05, rel=1e-4)
    if applied:
        assert all(record[f"update_ratio/{kind}"] > 0 for kind in diagnostics.kinds)


def test_a_kind_without_weight_has_no_ratio_and_a_skipped_step_moves_nothing():
    model = _tiny_llama()
    diagnostics = build_diagnostics(model, enabled=True, device=CPU)
    num = len(diagnostics.kinds)
    totals = [4.0] * num + [1.0] * num + [0.0] + [4.0] * (num - 1)
    record = diagnostics.metrics(totals, applied=True)
    assert record[f"update_ratio/{diagnostics.kinds[0]}"] is None
    assert record[f"update_ratio/{diagnostics.kinds[1]}"] == 0.5
    assert all(record[f"grad_norm/{kind}"] == 2.0 for kind in diagnostics.kinds)
    assert all(value == 0.0 for key, value in diagnostics.metrics(totals, applied=False).items()
               if key.startswith("update_ratio/"))


def test_off_builds_nothing_so_the_step_has_no_such_keys():
    # The step asks for diagnostics only when the run holds some (Run.diagnostics is None when off).
    assert build_diagnostics(_tiny_llama(), enabled=False, device=CPU) is None


def test_only_trainable_parameters_are_watched():
    model = _tiny_llama()
    for name, param in model.named_parameters():
        param.requires_grad_("self_attn" in name)
    diagnostics = build_diagnostics(model, enabled=True, device=CPU)
    assert diagnostics.kinds == ["attention"]
    for param in model.parameters():
        param.requires_grad_(False)
    assert build_diagnostics(model, enabled=True, device=CPU) is None
