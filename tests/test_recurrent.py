"""Recurrent token mixers (linear attention, SSM) keep packed samples apart.

    .venv/bin/python -m pytest -q tests/test_recurrent.py

A tiny random hybrid model (gated delta net linear attention + full attention)
is run on one packed row and on each sample alone: without
``recurrent.run_mixers_per_sample`` the linear-attention state flows from one
sample into the next (transformers' PyTorch fallback ignores ``cu_seqlens``),
with it the packed row is exactly the samples alone.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from fixtures.tiny_configs import tiny_config
from minitrainer.model.loss import decoder_of, find_decoder_blocks
from minitrainer.model.recurrent import recurrent_mixers, run_mixers_per_sample

LENGTHS = [5, 11, 7]


def _hybrid(model_type: str):
    torch.manual_seed(0)
    config = tiny_config(model_type, 64)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()


def _packed_and_alone(model) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    samples = [torch.randint(0, 64, (1, n), generator=gen) for n in LENGTHS]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    with torch.no_grad():
        packed = model(input_ids=torch.cat(samples, dim=1), position_ids=positions, use_cache=False).logits
        alone = torch.cat([model(input_ids=s, position_ids=torch.arange(s.shape[1])[None], use_cache=False).logits
                           for s in samples], dim=1)
    return packed, alone


@pytest.mark.parametrize("model_type", ["olmo_hybrid", "qwen3_5_text"])
def test_packed_row_equals_samples_alone_with_per_sample_mixers(model_type):
    model = _hybrid(model_type)
    blocks = find_decoder_blocks(model)
    assert len(recurrent_mixers(blocks)) == 1, "one linear-attention layer, one full-attention layer"
    packed, alone = _packed_and_alone(model)
    assert (packed - alone).abs().max() > 1e-3, "the fallback kernel lets the state leak: the test must see it"
    run_mixers_per_sample(decoder_of(model), blocks)
    packed, alone = _packed_and_alone(model)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def test_attention_only_models_have_no_recurrent_mixers():
    model = _hybrid("llama")
    assert recurrent_mixers(find_decoder_blocks(model)) == []
