"""Attention backends for packed rows: selection, boundaries, and equal losses on every backend.

    .venv/bin/python -m pytest -q tests/test_attention.py

The torch_varlen tests at the end need a CUDA GPU and are skipped without one.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from fixtures.e2e import model_vocab_size, torchrun, write_tokenized_jsonl
from minitrainer.setup.autotune import (DEFAULT_MAX_TOKENS_PER_GPU, longest_first_plan, probe_max_tokens_per_gpu,
                                  search_largest_fitting)
from minitrainer.common.labels import IGNORE_INDEX
from minitrainer.common.log import logger
from minitrainer.model import attention
from minitrainer.model.attention import (REFERENCE_VARLEN, TORCH_VARLEN, attention_inputs, cu_seqlens_from_position_ids,
                                         register_attention_backends, resolve_attn_implementation, varlen_reference)
from minitrainer.model.loss import CausalLMWithLoss
from minitrainer.setup.model import apply_liger_kernels

gpu_test = pytest.mark.gpu  # conftest.py skips it without a GPU; make gpu-check runs `pytest -m gpu`


@dataclass
class Row:
    """The Minibatch fields attention_inputs reads."""

    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor | None
    max_seqlen: int


def packed_positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)


@pytest.fixture
def warnings_seen(caplog):
    """Warnings from the toolkit's logger (which does not propagate once setup_logging ran)."""
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING, logger=logger.name)
    yield caplog
    logger.removeHandler(caplog.handler)


# ----------------------------------------------------------------------------
# Backend selection


def test_auto_on_cpu_is_sdpa():
    assert resolve_attn_implementation("auto", "cpu") == "sdpa"


@pytest.mark.parametrize("name", ["sdpa", "eager", REFERENCE_VARLEN])
def test_cpu_backends_are_kept(name):
    assert resolve_attn_implementation(name, "cpu") == name


@pytest.mark.parametrize("name", ["flex_attention", "paged|eager", "sdpa_paged", "nonsense"])
def test_backend_without_packed_boundaries_is_refused(name):
    with pytest.raises(ValueError, match="cannot honour packed sequence boundaries"):
        resolve_attn_implementation(name, "cpu")


@pytest.mark.parametrize("name", ["flash_attention_2", "flash_attention_3", TORCH_VARLEN])
def test_gpu_only_backend_on_cpu_falls_back_with_warning(name, warnings_seen):
    assert resolve_attn_implementation(name, "cpu") == "sdpa"
    assert any(name in r.getMessage() and "sdpa" in r.getMessage() for r in warnings_seen.records)


def test_missing_flash_attn_on_cuda_is_a_clear_error():
    if attention.flash_attn_unavailable_reason("flash_attention_2") is None:
        pytest.skip("flash_attn is installed here")
    with pytest.raises(ValueError, match="flash_attn does not import"):
        resolve_attn_implementation("flash_attention_2", "cuda")


def test_liger_on_cpu_warns_and_changes_nothing(chatml_model, warnings_seen):
    model = AutoModelForCausalLM.from_pretrained(chatml_model)
    forwards = [m.forward for m in model.modules()]
    assert apply_liger_kernels(model, device_type="cpu") is False
    assert [m.forward for m in model.modules()] == forwards
    assert any("Liger" in r.getMessage() or "liger" in r.getMessage() for r in warnings_seen.records)


@gpu_test
def test_liger_missing_on_a_gpu_is_a_one_line_refusal(tmp_path, chatml_model):
    """On a GPU, where Liger would run, a missing liger-kernel (a ``sitecustomize`` puts ``None`` in
    ``sys.modules`` for these processes) stops the run in one line before the model is built."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['liger_kernel'] = None\n")
    data = write_tokenized_jsonl(tmp_path / "data.jsonl", num_samples=8, vocab_size=model_vocab_size(chatml_model))
    result = torchrun(["--model-name-or-path", str(chatml_model), "--data-path", str(data), "--output-dir",
                       str(tmp_path / "out"), "--max-steps", "1", "--min-samples-per-checkpoint", "100",
                       "--use-liger-kernels"], nproc=1, env={"PYTHONPATH": str(hide), "CUDA_VISIBLE_DEVICES": "0"})
    assert result.returncode == 1
    assert "ERROR --use-liger-kernels needs liger-kernel, which is not installed here" in result.stderr
    assert "[rank0]: Traceback" not in result.stderr


def test_liger_under_compile_leaves_the_blocks_to_inductor(chatml_model, warnings_seen):
    """Dynamo failed on Liger's RMSNorm autograd.Function at step 1 on an H100 (torch 2.11, liger 0.8.5)."""
    model = AutoModelForCausalLM.from_pretrained(chatml_model)
    forwards = [m.forward for m in model.modules()]
    assert apply_liger_kernels(model, device_type="cuda", compile=True) is False
    assert [m.forward for m in model.modules()] == forwards
    assert any("left to inductor" in r.getMessage() for r in warnings_seen.records)


# ----------------------------------------------------------------------------
# Boundaries


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=12))
def test_cu_seqlens_equal_the_packed_boundaries(lengths):
    cu_seqlens, max_seqlen = cu_seqlens_from_position_ids(packed_positions(lengths))
    assert cu_seqlens.dtype == torch.int32
    assert cu_seqlens.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert max_seqlen == max(lengths)


def test_attention_inputs_per_backend():
    lengths = [3, 2, 4]
    row = Row(packed_positions(lengths), torch.tensor([0, 3, 5, 9], dtype=torch.int32), 4)
    for name in ("sdpa", "eager"):
        assert attention_inputs(row, name, torch.device("cpu")) == {}
    for name in ("flash_attention_2", "flash_attention_3", TORCH_VARLEN, REFERENCE_VARLEN):
        inputs = attention_inputs(row, name, torch.device("cpu"))
        assert inputs["cu_seq_lens_q"].tolist() == inputs["cu_seq_lens_k"].tolist() == [0, 3, 5, 9]
        assert inputs["max_length_q"] == inputs["max_length_k"] == 4
    derived = attention_inputs(Row(row.position_ids, None, 0), TORCH_VARLEN, torch.device("cpu"))
    assert derived["cu_seq_lens_q"].tolist() == [0, 3, 5, 9] and derived["max_length_q"] == 4
    with pytest.raises(ValueError, match="covers 8 tokens"):
        attention_inputs(Row(row.position_ids, torch.tensor([0, 3, 8], dtype=torch.int32), 5), TORCH_VARLEN,
                         torch.device("cpu"))


def test_no_mask_is_built_for_varlen_backends(chatml_model):
    """transformers must hand these backends attention_mask=None, never an O(T^2) tensor."""
    from transformers.masking_utils import create_causal_mask

    register_attention_backends()
    model = AutoModelForCausalLM.from_pretrained(chatml_model, attn_implementation=REFERENCE_VARLEN)
    embeds = torch.zeros(1, 9, model.config.hidden_size)
    mask = create_causal_mask(config=model.config, inputs_embeds=embeds, attention_mask=None,
                              past_key_values=None, position_ids=packed_positions([3, 2, 4]))
    assert mask is None


def test_missing_boundaries_fail_loudly():
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="needs the packed sample boundaries"):
        attention.reference_varlen_attention_forward(torch.nn.Module(), q, q, q, None)
    with pytest.raises(ValueError, match="padding-free"):
        attention.reference_varlen_attention_forward(torch.nn.Module(), q, q, q, torch.ones(1, 5))


# ----------------------------------------------------------------------------
# Reference attention against the textbook formula


def textbook_attention(q, k, v, lengths, *, scale, sliding_window=None):
    """softmax(q k^T * scale + mask) v per sample, GQA by repeating kv heads."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        scores = q[:, :, sl] @ k[:, :, sl].transpose(-1, -2) * scale
        i = torch.arange(n)
        allowed = i[:, None] >= i[None, :]
        if sliding_window is not None:
            allowed &= (i[:, None] - i[None, :]) < sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(scores.softmax(-1) @ v[:, :, sl])
        start += n
    return torch.cat(outs, dim=2)


def test_sdpa_reference_sanity():
    """The textbook helper itself agrees with torch's SDPA on one causal sample."""
    q, k, v = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)
    torch.testing.assert_close(textbook_attention(q, k, v, [6], scale=0.5),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5))


@pytest.mark.parametrize("lengths", [[7], [1, 5, 3], [4, 4, 1, 9, 2]])
@pytest.mark.parametrize("sliding_window", [None, 3])
def test_reference_varlen_equals_per_sample_attention(lengths, sliding_window):
    torch.manual_seed(0)
    total = sum(lengths)
    q, k, v = torch.randn(1, 4, total, 8), torch.randn(1, 2, total, 8), torch.randn(1, 2, total, 8)
    cu_seqlens, _ = cu_seqlens_from_position_ids(packed_positions(lengths))
    out = varlen_reference(q, k, v, cu_seqlens, scale=0.3, sliding_window=sliding_window)
    expected = textbook_attention(q, k, v, lengths, scale=0.3, sliding_window=sliding_window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", [REFERENCE_VARLEN, TORCH_VARLEN])
def test_varlen_backends_take_values_narrower_than_queries(backend, monkeypatch):
    """Multi-head latent attention (DeepSeek-V3, Kimi): value heads of 4 under query/key heads of 8."""
    torch.manual_seed(0)
    lengths = [3, 6, 2]
    total = sum(lengths)
    q, k, v = torch.randn(1, 4, total, 8), torch.randn(1, 2, total, 8), torch.randn(1, 2, total, 4)
    cu_seqlens, max_seqlen = cu_seqlens_from_position_ids(packed_positions(lengths))
    if backend == TORCH_VARLEN:  # the CUDA kernel, stood in for by the reference with its signature (CPU)
        import torch.nn.attention.varlen as varlen

        monkeypatch.setattr(varlen, "varlen_attn", _fake_varlen_new)
        forward = attention.torch_varlen_attention_forward
    else:
        forward = attention.reference_varlen_attention_forward
    out, _ = forward(torch.nn.Module(), q, k, v, None, scaling=0.3, cu_seq_lens_q=cu_seqlens,
                     max_length_q=max_seqlen)
    expected = textbook_attention(q, k, v, lengths, scale=0.3).transpose(1, 2)
    assert out.shape == (1, total, 4, 4)
    torch.testing.assert_close(out.float(), expected, atol=2e-2 if backend == TORCH_VARLEN else 1e-5,
                               rtol=2e-2 if backend == TORCH_VARLEN else 1e-5)


def _fake_varlen_new(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                     window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """The newer varlen_attn signature (torch 2.13 here), computed by the reference (CPU)."""
    assert enable_gqa or q.shape[1] == k.shape[1]
    left, right = window_size
    assert right == 0, "the trainer only asks for causal attention"
    out = varlen_reference(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], cu_seq_q,
                           scale=scale, sliding_window=None if left < 0 else left + 1)
    return out[0].transpose(0, 1)


def _fake_varlen_2_10(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10's varlen_attn signature: no scale, no GQA, no window."""
    assert q.shape[1] == k.shape[1], "2.10 needs equal head counts"
    assert is_causal
    out = varlen_reference(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], cu_seq_q)
    return out[0].transpose(0, 1)


def test_varlen_attn_fakes_cover_the_installed_signature():
    """The keywords the adapter switches on, as this torch spells them, are mirrored by one of the fakes."""
    from torch.nn.attention.varlen import varlen_attn

    used = {"scale", "window_size", "enable_gqa", "is_causal"} & attention._varlen_params(varlen_attn)
    assert used and any(used <= attention._varlen_params(fake) for fake in (_fake_varlen_new, _fake_varlen_2_10))


@pytest.mark.parametrize("fake", [_fake_varlen_new, _fake_varlen_2_10])
@pytest.mark.parametrize("scale", [None, 0.2])
def test_varlen_attn_adapter_across_torch_signatures(fake, scale):
    """The torch_varlen adapter (scale folding, GQA repeat, causal flag) on both API generations."""
    torch.manual_seed(0)
    lengths = [3, 6, 2]
    total = sum(lengths)
    q, k, v = torch.randn(total, 4, 8), torch.randn(total, 2, 8), torch.randn(total, 2, 8)
    cu_seqlens, max_seqlen = cu_seqlens_from_position_ids(packed_positions(lengths))
    out = attention.call_varlen_attn(fake, q, k, v, cu_seqlens, max_seqlen, causal=True, scale=scale,
                                      sliding_window=None)
    expected = textbook_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                  lengths, scale=scale if scale is not None else 8**-0.5)
    torch.testing.assert_close(out, expected[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------
# Whole model: the same loss through every backend, packed or not


def packed_sample_batch(vocab_size: int, lengths: list[int], seed: int = 0):
    """One packed row plus its samples; labels shifted per sample with a masked prompt token."""
    gen = torch.Generator().manual_seed(seed)
    samples = [torch.randint(0, vocab_size, (n,), generator=gen) for n in lengths]
    labels = []
    for ids in samples:
        shifted = torch.cat([ids[1:], torch.tensor([IGNORE_INDEX])])
        shifted[0] = IGNORE_INDEX  # a masked prompt token
        labels.append(shifted)
    row = {"input_ids": torch.cat(samples)[None], "labels": torch.cat(labels)[None],
           "position_ids": packed_positions(lengths)}
    return row, list(zip(samples, labels))


def model_loss(path, attn: str, inputs: dict, **attention_kwargs):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=torch.float32)
    wrapper = CausalLMWithLoss(model)
    loss = wrapper(**inputs, **attention_kwargs)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in wrapper.parameters() if p.grad is not None])
    return loss.detach(), grads


@pytest.mark.parametrize("template", ["chatml", "llama3"])
def test_packed_loss_is_the_same_on_every_backend(tiny_models, template):
    path = tiny_models[template]
    register_attention_backends()
    lengths = [5, 11, 1, 8]
    row, samples = packed_sample_batch(model_vocab_size(path), lengths)

    unpacked = torch.zeros(())
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)
    wrapper = CausalLMWithLoss(model)
    with torch.no_grad():
        for ids, labels in samples:
            unpacked += wrapper(ids[None], torch.arange(len(ids))[None], labels[None])

    boundaries = attention_inputs(Row(row["position_ids"], None, 0), REFERENCE_VARLEN, torch.device("cpu"))
    results = {
        "sdpa": model_loss(path, "sdpa", row),
        "eager": model_loss(path, "eager", row),
        "reference_varlen": model_loss(path, REFERENCE_VARLEN, row, **boundaries),
        "reference_varlen from position_ids": model_loss(path, REFERENCE_VARLEN, row),
    }
    for name, (loss, grads) in results.items():
        torch.testing.assert_close(loss, unpacked, atol=1e-4, rtol=1e-5, msg=f"{name} loss")
        torch.testing.assert_close(grads, results["sdpa"][1], atol=1e-5, rtol=1e-4, msg=f"{name} grads")
    assert math.isfinite(unpacked.item()) and unpacked.item() > 0

    # The registered backend really reads the kwargs: one-sample boundaries let samples see each other.
    total = sum(lengths)
    one_sample = {"cu_seq_lens_q": torch.tensor([0, total], dtype=torch.int32),
                  "cu_seq_lens_k": torch.tensor([0, total], dtype=torch.int32),
                  "max_length_q": total, "max_length_k": total}
    leaked, _ = model_loss(path, REFERENCE_VARLEN, row, **one_sample)
    assert not torch.allclose(leaked, unpacked, atol=1e-3)


# ----------------------------------------------------------------------------
# --max-tokens-per-gpu auto


@pytest.mark.parametrize("capacity", [4096, 5000, 40000, 131072, 262144, 10**7])
def test_search_finds_the_largest_fitting_budget(capacity):
    tried = []

    def fits(n):
        tried.append(n)
        return n <= capacity

    best = search_largest_fitting(fits, lower=4096, upper=262144, resolution=1024)
    assert best <= capacity and best <= 262144
    assert best + 1024 > min(capacity, 262144)
    assert len(tried) <= 16


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=500), min_size=1, max_size=20),
       st.integers(min_value=1, max_value=5000))
def test_probe_row_takes_the_longest_samples_first(lengths, num_tokens):
    plan = longest_first_plan(np.array(lengths), num_tokens)
    assert sum(take for _, take in plan) == num_tokens
    assert all(0 < take <= lengths[i] for i, take in plan)
    full = [lengths[i] for i, take in plan[:len(lengths)][:-1]]
    assert full == sorted(lengths, reverse=True)[:len(full)]


def test_search_returns_none_when_nothing_fits():
    assert search_largest_fitting(lambda n: False, lower=4096, upper=65536, resolution=1024) is None


def test_probe_on_cpu_returns_the_default_with_a_warning(warnings_seen):
    def never_called(n):
        raise AssertionError("no trial steps on CPU")

    assert probe_max_tokens_per_gpu(never_called, device_type="cpu") == DEFAULT_MAX_TOKENS_PER_GPU
    assert any("needs a GPU" in r.getMessage() for r in warnings_seen.records)


# ----------------------------------------------------------------------------
# GPU only: PyTorch's varlen flash kernel


@gpu_test
@pytest.mark.parametrize("sliding_window", [None, 64])
def test_torch_varlen_matches_reference_on_gpu(sliding_window):
    if attention.torch_varlen_unavailable_reason() is not None:
        pytest.skip(attention.torch_varlen_unavailable_reason())
    torch.manual_seed(0)
    lengths = [17, 300, 1, 128, 555]
    total = sum(lengths)
    q = torch.randn(1, 8, total, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, total, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 2, total, 64, device="cuda", dtype=torch.bfloat16)
    module = torch.nn.Module()
    inputs = attention_inputs(Row(packed_positions(lengths), None, 0), TORCH_VARLEN, torch.device("cuda"))
    out, _ = attention.torch_varlen_attention_forward(module, q, k, v, None, scaling=64**-0.5,
                                                      sliding_window=sliding_window, **inputs)
    expected = varlen_reference(q.float(), k.float(), v.float(), inputs["cu_seq_lens_q"], scale=64**-0.5,
                                sliding_window=sliding_window).transpose(1, 2)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@gpu_test
def test_torch_varlen_model_loss_matches_reference_on_gpu(chatml_model):
    if attention.torch_varlen_unavailable_reason() is not None:
        pytest.skip(attention.torch_varlen_unavailable_reason())
    register_attention_backends()
    lengths = [5, 40, 1, 23]
    vocab = model_vocab_size(chatml_model)
    row, _ = packed_sample_batch(vocab, lengths)
    row = {name: t.cuda() for name, t in row.items()}
    losses = {}
    for name in (TORCH_VARLEN, REFERENCE_VARLEN):
        model = AutoModelForCausalLM.from_pretrained(chatml_model, attn_implementation=name,
                                                     dtype=torch.bfloat16).cuda()
        boundaries = attention_inputs(Row(row["position_ids"].cpu(), None, 0), name, torch.device("cuda"))
        with torch.no_grad():
            losses[name] = CausalLMWithLoss(model)(**row, **boundaries).float()
    torch.testing.assert_close(losses[TORCH_VARLEN], losses[REFERENCE_VARLEN], atol=0.05, rtol=1e-2)



def test_sharded_model_through_setup_model_gives_the_same_loss(chatml_model):
    """setup_model (FSDP2, one gloo process, activation checkpointing) with reference_varlen equals sdpa."""
    from minitrainer.setup.model import setup_model
    from minitrainer.common.distributed import init_distributed

    dist_info = init_distributed()
    lengths = [6, 2, 9]
    row, _ = packed_sample_batch(model_vocab_size(chatml_model), lengths)
    cu_seqlens, max_seqlen = cu_seqlens_from_position_ids(row["position_ids"])
    losses = {}
    for name in ("sdpa", REFERENCE_VARLEN):
        model, resolved = setup_model(model_name_or_path=str(chatml_model), dist_info=dist_info,
                                      attn_implementation=name, sharding_strategy="FULL_SHARD", cpu_offload=False,
                                      activation_checkpointing=True, use_liger_kernels=False, local_world_size=1)
        assert resolved.attn_implementation == name
        boundaries = attention_inputs(Row(row["position_ids"], cu_seqlens, max_seqlen), name, dist_info.device)
        losses[name] = model(**row, **boundaries).detach()
    torch.testing.assert_close(losses[REFERENCE_VARLEN], losses["sdpa"], atol=1e-4, rtol=1e-5)
