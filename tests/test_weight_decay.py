"""Weight decay follows transformers' Trainer (and TRL, axolotl): biases and norm weights are not decayed.

    .venv/bin/python -m pytest -q tests/test_weight_decay.py
"""

from __future__ import annotations

import json

import pytest
import torch

from fixtures.architectures import ARCH_BY_NAME, COMMON
from minitrainer.checkpoint.resume_policy import check_resume
from minitrainer.methods.base import param_groups

LR, WD = 0.1, 0.5


def _model(model_type: str, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=64, **{**COMMON, "pad_token_id": 0, **overrides})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@pytest.mark.parametrize("name", ["llama", "qwen3", "cohere", "olmo2", "gemma3", "seed_oss", "gpt2", "gpt_oss"])
def test_decayed_parameters_are_transformers_trainers(name):
    """The same set as ``Trainer.get_decay_parameter_names`` (biases, LayerNorm modules, *norm* names exempt)."""
    pytest.importorskip("accelerate")  # transformers' Trainer needs it
    from transformers import Trainer

    arch = ARCH_BY_NAME.get(name)
    if arch is None:
        pytest.skip(f"this transformers has no {name}")
    with torch.device("meta"):
        model = _model(arch.model_type, **arch.overrides)
    decay, no_decay = param_groups(model, weight_decay=WD)
    assert decay["weight_decay"] == WD and no_decay["weight_decay"] == 0.0
    # An instance method that reads nothing of the instance: the ecosystem's rule, called as Trainer calls it.
    # Compared as parameters, not names: a tied LM head is one parameter under two names.
    by_name = dict(model.named_parameters(remove_duplicate=False))
    expected = {id(by_name[name]) for name in Trainer.get_decay_parameter_names(None, model)}
    assert {id(p) for p in decay["params"]} == expected
    assert no_decay["params"]


def test_a_zero_gradient_step_decays_matrices_by_lr_times_wd_and_leaves_biases_and_norms():
    """AdamW with zero gradients moves a parameter only by its decoupled decay: p -> p * (1 - lr * wd)."""
    model = _model("qwen2")  # q/k/v biases, RMSNorm weights, matrices, embeddings
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(param_groups(model, weight_decay=WD), lr=LR)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    exempt = {name for name in before if name.endswith("bias") or "norm" in name}
    assert any(name.endswith("q_proj.bias") for name in exempt) and any("layernorm" in name for name in exempt)
    for name, p in model.named_parameters():
        expected = before[name] if name in exempt else before[name] * (1 - LR * WD)
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-7, msg=name)
    assert not torch.equal(model.model.embed_tokens.weight, before["model.embed_tokens.weight"]), \
        "embeddings decay, as in transformers' Trainer"


def test_zero_weight_decay_keeps_one_group_so_earlier_full_states_load():
    with torch.device("meta"):
        model = _model("llama")
    [group] = param_groups(model, weight_decay=0.0)
    assert len(group["params"]) == len(list(model.parameters())) and group["weight_decay"] == 0.0


@pytest.mark.parametrize("old,new,refused", [(0.0, 0.1, True), (0.1, 0.0, True), (0.1, 0.2, False)])
def test_turning_decay_on_or_off_at_a_resume_is_refused_in_one_line(tmp_path, old, new, refused):
    """The optimizer's groups change between 0 and > 0, so DCP could not restore the saved optimizer state."""
    (tmp_path / "trainer_state.json").write_text(json.dumps({"run_params": {"weight_decay": old}}))
    error, notice = check_resume([tmp_path], {"weight_decay": new}, allow_change=True)
    assert (error is not None) == refused
    if refused:
        assert "--weight-decay" in error and "\n" not in error
    else:
        assert "weight_decay 0.1 -> 0.2" in notice
