"""The objective's pieces and the start-up checks, in one process (no torchrun).

    .venv/bin/python -m pytest -q tests/test_loss_terms.py

Liger's fused linear cross-entropy runs on CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1``, set in a subprocess before triton is
imported); with the logit scale folded into the hidden states it must equal
the chunked PyTorch loss, loss and gradients (Liger's softcap branch does not
run under the interpreter: its argument is checked). The per-sample router loss must equal
transformers' ``load_balancing_loss_func`` on each sample alone, whatever the
packing. Attention selection follows what the architecture accepts.

The head on learned positions only (``loss.learned_positions``) must give the
loss, router loss and every gradient of the head on all positions, for
several architectures, logit scaling, softcapping, LoRA and Liger; equal up
to fp32 summation order (the terms are the same, their grouping into sums is
not), and the prompt positions' hidden-state gradient exactly 0 in both.

The start-up self-check on the sweep's tiny configs (``fixtures/tiny_configs.py``: every
dropout off, large initial weights, so a leak shows): BERT-style encoders,
whose forward runs a prediction transform between the encoder and the LM head,
are refused with that reason (Electra's and RoFormer's head is wider than the
encoder: the trainer's head matmul used to crash); MiniCPM3, whose scaling
before the head the trainer reproduces on the logits, passes; OPT, whose
forward builds its mask without ``position_ids``, is refused under sdpa;
RWKV, whose forward takes no ``position_ids`` at all, is refused saying so.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from fixtures.architectures import ARCH_BY_NAME, COMMON
from fixtures.e2e import ROOT, write_tokenized_jsonl
from minitrainer.common.log import logger
from minitrainer.data.sampler import load_tokenized_dataset
from minitrainer.model.attention import (attention_needs, backend_refusal, explicit_attention_refusal,
                                         reference_varlen_attention_forward, resolve_attn_implementation)
from minitrainer.model.loss_terms import LogitTransform, router_aux_sum
from minitrainer.setup.selfcheck import MAX_ROW_TOKENS, check_data_fits_model, pick_rows

LIGER_SCRIPT = r"""
import json, torch
from minitrainer.model.loss import chunked_cross_entropy_sum, learned_positions, make_liger_fused_loss
from minitrainer.model.loss_terms import LogitTransform
torch.manual_seed(0)
T, H, V = 24, 16, 64
results = {}
for n_masked in (14, T):
    hidden = torch.randn(T, H, requires_grad=True)
    weight = (torch.randn(V, H) * 0.5).requires_grad_()
    labels = torch.randint(0, V, (T,)); labels[torch.randperm(T)[:n_masked]] = -100
    liger = make_liger_fused_loss(LogitTransform())
    full = liger(weight, hidden, labels, None)
    g_full = torch.autograd.grad(full, (hidden, weight))
    positions = learned_positions(labels)
    only = liger(weight, hidden.index_select(0, positions), labels.index_select(0, positions), None)
    g_only = torch.autograd.grad(only, (hidden, weight))
    results[f"learned_only/{n_masked}"] = {
        "loss": [full.item(), only.item()], "grad_hidden": (g_full[0] - g_only[0]).abs().max().item(),
        "grad_weight": (g_full[1] - g_only[1]).abs().max().item(), "accum_dtype": "torch.float32"}
for scale, softcap in ((1.0, None), (0.0625, None), (3.0, None)):
    transform = LogitTransform(scale=scale, softcap=softcap)
    hidden = torch.randn(T, H, requires_grad=True)
    weight = (torch.randn(V, H) * 0.5).requires_grad_()
    labels = torch.randint(0, V, (T,)); labels[:5] = -100
    plain = chunked_cross_entropy_sum(hidden, weight, None, labels, transform=transform, chunk_tokens=7)
    g_plain = torch.autograd.grad(plain, (hidden, weight))
    h2 = hidden.detach().clone().requires_grad_(); w2 = weight.detach().clone().requires_grad_()
    fused = make_liger_fused_loss(transform)(w2, h2 * scale if scale != 1.0 else h2, labels, None)
    fused.backward()
    results[f"{scale}/{softcap}"] = {
        "loss": [plain.item(), fused.item()],
        "grad_hidden": (g_plain[0] - h2.grad).abs().max().item(),
        "grad_weight": (g_plain[1] - w2.grad).abs().max().item(),
        "accum_dtype": str(make_liger_fused_loss(transform).accum_dtype)}
results["softcap_argument"] = make_liger_fused_loss(LogitTransform(softcap=2.0)).softcap
print("RESULTS" + json.dumps(results))
"""


def test_liger_fused_loss_equals_plain_path_under_triton_interpreter():
    pytest.importorskip("liger_kernel")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    # `python -c` imports from its working directory: the repository root, as every launch here.
    result = subprocess.run([sys.executable, "-c", LIGER_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    [line] = [ln for ln in result.stdout.splitlines() if ln.startswith("RESULTS")]
    results = json.loads(line.removeprefix("RESULTS"))
    # Liger 0.8.5's softcap branch casts a scalar argument, which Triton's interpreter cannot: the cap
    # is checked to reach Liger's own argument; its kernel math runs on GPUs only.
    assert results.pop("softcap_argument") == 2.0
    for case, r in results.items():
        plain, fused = r["loss"]
        assert fused == pytest.approx(plain, rel=1e-5), case
        assert r["grad_hidden"] < 1e-5 and r["grad_weight"] < 1e-5, case
        assert r["accum_dtype"] == "torch.float32"


LEARNED_ONLY_ARCHS = ("llama", "granite", "cohere", "gemma2", "qwen3_moe_aux", "granitemoe_aux")


def _loss_and_grads(wrapper, batch: dict, *, learned_only: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    wrapper.head_learned_positions_only = learned_only
    wrapper.zero_grad(set_to_none=True)
    loss = wrapper(**batch, router_aux_weight=0.7)
    loss.backward()
    return loss.detach(), wrapper.last_router_aux_sum, {n: p.grad.clone() for n, p in wrapper.named_parameters()
                                                        if p.grad is not None}


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("name", LEARNED_ONLY_ARCHS)
def test_head_on_learned_positions_equals_head_on_every_position(name, lora):
    from transformers import AutoConfig, AutoModelForCausalLM

    from minitrainer.model.loss import CausalLMWithLoss
    from minitrainer.methods.lora import LoraSettings, apply_lora

    arch = ARCH_BY_NAME[name]
    vocab = 96
    config = AutoConfig.for_model(arch.model_type, vocab_size=vocab, **{**COMMON, **arch.overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    if lora:
        apply_lora(model, LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules="all-linear", use_rslora=False))
        for module_name, param in model.named_parameters():  # B = 0 at start would hide the adapters' A gradient
            if "lora_B" in module_name:
                torch.nn.init.normal_(param, std=0.1)
    wrapper = CausalLMWithLoss(model)
    lengths = [9, 14, 5, 12]  # one packed row; 60-70% of it prompt, as in chat SFT
    total = sum(lengths)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab, (1, total), generator=generator)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = torch.randint(0, vocab, (1, total), generator=generator)
    labels[torch.rand(1, total, generator=generator) < 0.65] = -100
    ends = torch.tensor(lengths).cumsum(0) - 1
    labels[0, ends] = -100  # a sample's last token has no target
    batch = {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}

    old_loss, old_router, old_grads = _loss_and_grads(wrapper, batch, learned_only=False)
    new_loss, new_router, new_grads = _loss_and_grads(wrapper, batch, learned_only=True)
    assert wrapper.logit_transform.is_identity == (name in ("llama", "qwen3_moe_aux"))
    assert (wrapper.router_loss is not None) == arch.overrides.get("output_router_logits", False)
    torch.testing.assert_close(new_router, old_router, rtol=0, atol=0)  # router logits are untouched
    # Same terms, summed in other groupings (chunks of learned positions, a shorter GEMM): fp32 rounding only.
    torch.testing.assert_close(new_loss, old_loss, rtol=1e-6, atol=0)
    assert new_grads.keys() == old_grads.keys() and new_grads
    for key, old in old_grads.items():
        torch.testing.assert_close(new_grads[key], old, rtol=1e-5, atol=1e-6 * old.abs().max().item(), msg=key)


def test_a_row_without_learned_positions_still_reaches_every_parameter():
    from transformers import AutoConfig, AutoModelForCausalLM

    from minitrainer.model.loss import CausalLMWithLoss, learned_positions

    assert learned_positions(torch.full((5,), -100)).tolist() == [0]
    assert learned_positions(torch.tensor([-100, 3, -100, 4])).tolist() == [1, 3]
    config = AutoConfig.for_model("llama", vocab_size=64, **COMMON)
    wrapper = CausalLMWithLoss(AutoModelForCausalLM.from_config(config, attn_implementation="eager"))
    loss = wrapper(torch.randint(0, 64, (1, 6)), torch.arange(6)[None], torch.full((1, 6), -100))
    loss.backward()
    assert loss.item() == 0.0
    # Every parameter gets a (zero) gradient, so FSDP's reductions see the same graph on every rank.
    assert all(p.grad is not None and not p.grad.any() for p in wrapper.parameters())


def test_logit_transform_matches_the_forward_order():
    logits = torch.randn(5, 7) * 4
    t = LogitTransform(scale=0.5, softcap=3.0)
    torch.testing.assert_close(t.apply(logits), 3.0 * torch.tanh(logits * 0.5 / 3.0))
    assert LogitTransform().is_identity and LogitTransform().apply(logits) is logits


@pytest.mark.parametrize("lengths", [[7], [3, 9, 1, 5], [1, 1, 1]])
def test_router_aux_sum_is_each_samples_own_load_balancing_loss(lengths):
    torch.manual_seed(len(lengths))
    num_experts, top_k, layers = 6, 2, 3
    total = sum(lengths)
    logits = tuple(torch.randn(total, num_experts) for _ in range(layers))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    packed = router_aux_sum(logits, cu, num_experts=num_experts, top_k=top_k)
    expected = sum(load_balancing_loss_func(tuple(layer[s:e] for layer in logits), num_experts, top_k)
                   for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()))
    torch.testing.assert_close(packed, torch.as_tensor(expected, dtype=torch.float32))


def _meta(name: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = ARCH_BY_NAME[name]
    config = AutoConfig.for_model(arch.model_type, vocab_size=64, **{**COMMON, **arch.overrides})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


@pytest.mark.parametrize("name,cpu,cuda", [("llama", "sdpa", "torch_varlen"), ("gemma2", "eager", "eager"),
                                           ("gpt_oss", "eager", "eager"), ("mistral_swa", "sdpa", "torch_varlen")])
def test_auto_picks_what_the_architecture_accepts(name, cpu, cuda):
    from minitrainer.model.attention import flash_attn_unavailable_reason, torch_varlen_unavailable_reason

    needs = attention_needs(_meta(name))
    assert resolve_attn_implementation("auto", "cpu", needs) == cpu
    if flash_attn_unavailable_reason("flash_attention_2") is None or torch_varlen_unavailable_reason():
        pytest.skip("the CUDA choice depends on flash_attn / torch varlen here")
    assert resolve_attn_implementation("auto", "cuda", needs) == cuda


def test_needs_are_read_from_the_model():
    gemma2, gpt_oss, llama = (attention_needs(_meta(n)) for n in ("gemma2", "gpt_oss", "llama"))
    assert gemma2.softcap == 5.0 and not gemma2.supports_sdpa and not gemma2.sinks
    assert gpt_oss.sinks and not gpt_oss.supports_sdpa
    assert llama.supports_sdpa and llama.softcap is None and not llama.sinks
    assert backend_refusal("reference_varlen", gemma2) and backend_refusal("flash_attention_2", gpt_oss)
    assert backend_refusal("flash_attention_2", gemma2) is None  # flash-attn implements softcapping


def test_explicit_refused_choice_is_one_line_naming_the_accepted():
    needs = attention_needs(_meta("gemma2"))
    error = explicit_attention_refusal("sdpa", needs)
    assert error == ("--attn-implementation sdpa: Gemma2ForCausalLM does not support sdpa; this model accepts "
                     "auto, eager, flash_attention_2, flash_attention_3")
    with pytest.raises(ValueError, match="Gemma2ForCausalLM does not support sdpa"):
        resolve_attn_implementation("sdpa", "cpu", needs)
    with pytest.raises(ValueError, match="attention sinks"):
        resolve_attn_implementation("reference_varlen", "cpu", attention_needs(_meta("gpt_oss")))


def test_varlen_backend_refuses_sinks_instead_of_dropping_them():
    q = k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="sinks"):
        reference_varlen_attention_forward(torch.nn.Module(), q, k, v, None, s_aux=torch.zeros(2),
                                           position_ids=torch.arange(4)[None])


def test_out_of_vocabulary_data_and_another_tokenizer_are_refused(tmp_path, chatml_model, llama3_model, caplog):
    from transformers import AutoConfig, AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(chatml_model))
    too_big = write_tokenized_jsonl(tmp_path / "big" / "data.jsonl", num_samples=4, vocab_size=vocab + 50, seed=0)
    error = check_data_fits_model(load_tokenized_dataset(str(too_big)), str(too_big), str(chatml_model),
                                  AutoConfig.from_pretrained(chatml_model))
    assert error is not None and "vocabulary of" in error and str(chatml_model) in error

    ok = write_tokenized_jsonl(tmp_path / "ok" / "data.jsonl", num_samples=4, vocab_size=vocab, seed=0)
    other = AutoTokenizer.from_pretrained(llama3_model)
    (tmp_path / "ok" / "summary.json").write_text(json.dumps({"tokenizer": {
        "name_or_path": str(llama3_model), "num_tokens": len(other), "eos_token": other.eos_token,
        "bos_token": other.bos_token}}))
    check = functools.partial(check_data_fits_model, load_tokenized_dataset(str(ok)), str(ok), str(chatml_model),
                              AutoConfig.from_pretrained(chatml_model))
    error = check()
    assert error is not None and "\n" not in error and str(llama3_model) in error and str(chatml_model) in error
    assert "--allow-tokenizer-mismatch" in error
    logger.addHandler(caplog.handler)  # the toolkit's logger does not propagate once setup_logging ran
    try:
        with caplog.at_level(logging.WARNING, logger=logger.name):
            assert check(allow_tokenizer_mismatch=True) is None
    finally:
        logger.removeHandler(caplog.handler)
    warned = [r.getMessage() for r in caplog.records if "tokenized with" in r.getMessage()]
    assert warned and str(llama3_model) in warned[0] and str(chatml_model) in warned[0]


def _self_check(model_type: str, tmp_path, caplog, *, attn_implementation: str = "sdpa",
                min_len: int = 4, max_len: int = 48) -> list[str]:
    """``check_loss_terms`` on the sweep's tiny ``model_type`` (``fixtures/tiny_configs.py``), one process, no FSDP;
    its ERROR lines (empty when it passes)."""
    from transformers import AutoModelForCausalLM

    from fixtures.tiny_configs import tiny_config
    from minitrainer.model.loss import CausalLMWithLoss
    from minitrainer.setup.selfcheck import check_loss_terms

    vocab = 96
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, vocab), dtype=torch.float32,
                                             attn_implementation=attn_implementation)
    data = write_tokenized_jsonl(tmp_path / "data.jsonl", num_samples=12, vocab_size=vocab, seed=3,
                                 min_len=min_len, max_len=max_len)
    logger.addHandler(caplog.handler)  # the toolkit's logger does not propagate once setup_logging ran
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            try:
                check_loss_terms(CausalLMWithLoss(model), load_tokenized_dataset(str(data)),
                                attn_implementation=attn_implementation, compute_dtype=torch.float32,
                                device=torch.device("cpu"))
            except SystemExit as stop:
                assert stop.code == 1
    finally:
        logger.removeHandler(caplog.handler)
    # Each record once: caplog sees it through the added handler and, where the logger propagates, its own.
    return list(dict.fromkeys(r.getMessage() for r in caplog.records if r.levelno == logging.ERROR))


@pytest.mark.parametrize("model_type, between, attn", [
    ("bert", "cls.predictions.transform", "sdpa"),          # same width: the loss alone would differ, unexplained
    ("electra", "generator_predictions", "sdpa"),           # 32 -> 128 features: the trainer's head matmul crashed
    ("roformer", "cls.predictions.transform", "eager"),     # 32 -> 768 features
])
def test_a_head_fed_something_else_than_the_decoder_output_is_refused_with_that_reason(
        model_type, between, attn, tmp_path, caplog):
    """BERT-style encoders registered as causal LMs run a masked-LM prediction transform between the encoder and the
    output embedding; the trainer's loss is the head on the decoder's output. One line says so, no traceback."""
    [line] = _self_check(model_type, tmp_path, caplog, attn_implementation=attn)
    assert f"(model_type '{model_type}')" in line and f"through {between} before the LM head" in line
    assert f"attention {attn}" in line and "fine-tune a decoder-only model" in line


@pytest.mark.parametrize("model_type", ["llama", "minicpm3"])
def test_a_head_the_trainer_reproduces_passes(model_type, tmp_path, caplog):
    """MiniCPM3 divides the decoder's output by logits_scaling before its head: not the same tensor, but the
    trainer applies that scale to the logits, so the loss agrees and nothing is refused."""
    assert _self_check(model_type, tmp_path, caplog) == []
    assert any("objective self-check: the trainer's loss equals" in r.getMessage() for r in caplog.records)


def test_opt_lets_packed_samples_see_each_other_under_sdpa_and_is_refused(tmp_path, caplog):
    """OPT's forward builds its causal mask without position_ids: packed samples attend to each other under sdpa.
    At its default init_std (0.02, nearly uniform attention) the leak cost 1.3e-5 of the step-1 loss and passed the
    self-check; the sweep's tiny configs now set init_std like initializer_range, and the leak is refused."""
    [line] = _self_check("opt", tmp_path, caplog)
    assert "OPTForCausalLM" in line and "rows packed into one" in line and "attention sdpa lets packed" in line


# Every row longer than the self-check's window (agent data behind a long tool prompt): it checks windows.
LONG = {"min_len": MAX_ROW_TOKENS + 40, "max_len": 2 * MAX_ROW_TOKENS}


def test_long_rows_are_checked_on_windows_around_their_first_learned_tokens(tmp_path):
    data = tmp_path / "long.jsonl"
    with data.open("w") as f:
        for length, learned in ((700, 40), (300, 5), (600, 600 - 1), (900, 0)):
            labels = [-100] * (length - learned) + list(range(learned))
            f.write(json.dumps({"input_ids": list(range(length)), "labels": labels, "len": length,
                                "num_loss_counted_tokens": learned}) + "\n")
    dataset = load_tokenized_dataset(str(data))
    windows = pick_rows(dataset, num_rows=4)
    assert sorted(w.index for w in windows) == [0, 1, 2]  # no learned token in row 3: nothing to compare
    for window in windows:
        _, labels = dataset.sample_arrays(window.index)
        assert window.stop - window.start == MAX_ROW_TOKENS and 0 <= window.start < window.stop <= len(labels)
        assert (labels[window.start + 1:window.stop] != -100).sum() >= 4
        assert labels[window.start] == -100 or window.start == 0  # its first token predicts nothing
    assert [w.describe() for w in windows if w.index == 1] == ["tokens 44 to 300 of its 300"]


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_data_of_long_rows_only_is_checked_and_passes(model_type, tmp_path, caplog):
    assert _self_check(model_type, tmp_path, caplog, **LONG) == []
    [line] = {r.getMessage() for r in caplog.records if "objective self-check: " in r.getMessage()}
    assert "on 3 rows (3 long ones on a window of 256 tokens)" in line


def test_data_of_long_rows_only_still_refuses_what_short_rows_refuse(tmp_path, caplog):
    [line] = _self_check("opt", tmp_path, caplog, **LONG)
    assert "OPTForCausalLM" in line and "rows packed into one" in line
    caplog.clear()
    [line] = _self_check("electra", tmp_path / "e", caplog, **LONG)
    assert "through generator_predictions before the LM head" in line


def test_a_forward_without_position_ids_is_refused_saying_so(tmp_path, caplog):
    """RWKV's forward takes no position_ids (nor do BLOOM's and MPT's): its recurrent state flows from one packed
    sample into the next, and no attention backend can change that, so the reason must not blame an attention mask."""
    [line] = _self_check("rwkv", tmp_path, caplog, attn_implementation="eager")  # it refuses sdpa
    assert "RwkvForCausalLM" in line and "rows packed into one" in line
    assert "its forward takes no position_ids" in line and "no attention backend changes that" in line


@pytest.mark.parametrize("model_type", ["seed_oss", "opt", "electra", "llama"])
def test_tiny_configs_turn_every_dropout_off_and_use_large_weights(model_type):
    """The sweep compares a training-mode step with an eval-mode reference: any dropout left on (Seed-OSS's
    residual_dropout=0.1) makes them differ (1e-2), whatever the trainer does."""
    from fixtures.tiny_configs import tiny_config

    values = tiny_config(model_type, 96).to_dict()
    dropouts = {name: value for name, value in values.items()
                if isinstance(value, float) and ("dropout" in name or "pdrop" in name)}
    assert dropouts and not any(dropouts.values()), dropouts
    assert values.get("initializer_range", values.get("init_std")) == 0.3
