"""Packed rows through recurrent token mixers: linear attention, state-space and short-convolution layers.

Attention keeps packed samples apart through its mask or ``cu_seqlens``
(``attention.py``). Hybrid models (Qwen3.5 / Qwen3-Next and OLMo-hybrid
gated delta nets, Kimi-Linear's delta attention, Mamba-style mixers) also
have layers that carry a state along the row: a causal depthwise convolution
and a recurrence. Their fused kernels (flash-linear-attention,
causal-conv1d) accept ``cu_seqlens``, but the PyTorch fallbacks transformers
uses without them (CPU, or a GPU without those packages) ignore it, and one
sample's state then flows into the next::

    packed row        [ a0 a1 a2 | b0 b1 | c0 c1 c2 c3 ]
    recurrent state    s(a0..a2) -> b0 starts from it      (wrong)
    per sample         a: s0 -> ..., b: s0 -> ..., c: s0 -> ...  (what each sample alone computes)

``run_mixers_per_sample`` makes each such layer run once per packed sample,
with the model's own code, and concatenates the outputs: exactly each
sample's forward alone. The cost is one call per sample per recurrent layer
(the work stays linear in tokens). Attention layers are untouched.

The layers are found from the model's structure, not from its name: a direct
child of a decoder block that holds a depthwise ``nn.Conv1d`` (the causal
token convolution every such mixer opens with). The sample boundaries come
from the ``position_ids`` (or ``cu_seq_lens_q``) the decoder is called with.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
from torch import nn

from minitrainer.model.attention import cu_seqlens_from_position_ids

BOUNDARY_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""Row-level boundary kwargs: they describe the whole packed row, not one sample, so a sample's call drops them."""


def recurrent_mixers(blocks: list[nn.Module]) -> list[nn.Module]:
    """The token mixers of ``blocks`` that carry a state along the row (see the module docstring)."""
    mixers = []
    for block in blocks:
        for child in block.children():
            if isinstance(child, nn.Conv1d):
                continue  # a bare convolution takes [B, C, T], not hidden states; none seen in a decoder block
            if any(isinstance(m, nn.Conv1d) and m.groups == m.in_channels > 1 for m in child.modules()):
                mixers.append(child)
    return mixers


@dataclass
class RowBoundaries:
    """``cu_seqlens`` of the packed row the decoder is running on (None: one sample, nothing to split)."""

    cu_seqlens: torch.Tensor | None = None
    num_tokens: int = 0


def run_mixers_per_sample(decoder: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """Make every recurrent mixer of ``blocks`` run once per packed sample; returns those mixers.

    The decoder's forward pre-hook records the row's boundaries from the
    ``position_ids`` (or ``cu_seq_lens_q``) it is called with; each mixer's
    forward (an instance attribute, the class is untouched) reads them. An
    activation-checkpointing recompute happens in the same minibatch's
    backward, before the next forward records new boundaries; the token
    count is checked on every call.
    """
    mixers = recurrent_mixers(blocks)
    if not mixers:
        return []
    row = RowBoundaries()

    def record(_module, args, kwargs):
        cu_seqlens = kwargs.get("cu_seq_lens_q")
        position_ids = kwargs.get("position_ids")
        if position_ids is not None and position_ids.ndim == 3:
            position_ids = position_ids[0]  # [1 + axes, 1, T] multimodal rotary: text positions first (loss.py)
        if cu_seqlens is None and position_ids is not None:
            cu_seqlens, _ = cu_seqlens_from_position_ids(position_ids)  # CPU-GPU sync point: once per forward
        if cu_seqlens is None or cu_seqlens.numel() <= 2 or (position_ids is not None and position_ids.shape[0] != 1):
            row.cu_seqlens, row.num_tokens = None, 0
        else:
            row.cu_seqlens, row.num_tokens = cu_seqlens.tolist(), int(cu_seqlens[-1])

    decoder.register_forward_pre_hook(record, with_kwargs=True)
    for mixer in mixers:
        mixer.forward = types.MethodType(_per_sample(type(mixer).forward, row), mixer)
    return mixers


def _per_sample(forward, row: RowBoundaries):
    def per_sample_forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        # Each call below is one sample: the row's boundaries would only mislead the kernel (transformers'
        # PyTorch fallbacks refuse them outright).
        kwargs = {key: value for key, value in kwargs.items() if key not in BOUNDARY_KWARGS}
        bounds = row.cu_seqlens
        if bounds is None or kwargs.get("attention_mask") is not None:
            # A row-wide mask (an attention layer that also holds a convolution) cannot be cut per sample:
            # the layer runs as the model wrote it, and the self-check's packed-vs-alone test judges it.
            return forward(self, hidden_states, *args, **kwargs)
        assert hidden_states.shape[:2] == (1, row.num_tokens), (
            f"{type(self).__name__}: hidden states {tuple(hidden_states.shape)} are not the recorded packed row "
            f"of {row.num_tokens} tokens")
        outputs = [forward(self, hidden_states[:, start:end], *args, **kwargs)
                   for start, end in zip(bounds[:-1], bounds[1:])]
        if isinstance(outputs[0], torch.Tensor):
            return torch.cat(outputs, dim=1)  # [1, T, H]
        # (hidden_states, None, ...) tuples: only the first element is per token
        if not (isinstance(outputs[0], tuple) and all(part is None for out in outputs for part in out[1:])):
            raise TypeError(f"{type(self).__name__} returns {type(outputs[0]).__name__}: cannot join per-sample "
                            "outputs; train it unpacked or report it")
        return (torch.cat([out[0] for out in outputs], dim=1), *outputs[0][1:])

    return per_sample_forward
