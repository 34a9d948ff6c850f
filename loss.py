"""The training module: a Hugging Face causal LM plus a sum-reduced token loss.

The loss never materialises fp32 logits for the whole packed row:

* plain path: the row is cut into chunks of ``CHUNK_TOKENS`` tokens and each
  chunk's ``hidden @ W_vocab.T`` + cross-entropy is checkpointed, so backward
  recomputes one chunk's logits at a time;
* Liger path (``--use-liger-kernels``, CUDA): Liger's fused linear
  cross-entropy, which never builds logits at all.

Both return the SUM of token losses; the trainer divides by the optimizer
batch's loss-token count, known before the forward pass.

Labels arrive already shifted per sample by the collator (``sampler.py``):
``labels[t]`` is the target of position ``t``, so nothing here shifts again
and no target crosses a packed sample boundary.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from utils import IGNORE_INDEX, device_type, log_rank_0

CHUNK_TOKENS = 4096
"""Tokens per checkpointed cross-entropy chunk: bounds live logits to CHUNK_TOKENS x vocab."""


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    labels: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()  # [chunk, vocab]
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              labels: torch.Tensor, *, chunk_tokens: int = CHUNK_TOKENS) -> torch.Tensor:
    """Sum of token cross-entropies of ``hidden @ weight.T`` against ``labels``.

    Args:
        hidden: [T, H] final hidden states.
        weight: [V, H] output embedding.
        bias: [V] or None.
        labels: [T] targets, ``IGNORE_INDEX`` where no loss is counted.
    """
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_tokens):
        end = start + chunk_tokens
        chunk = (hidden[start:end], weight, bias, labels[start:end])
        if torch.is_grad_enabled() and hidden.requires_grad:
            total = total + checkpoint(_chunk_loss_sum, *chunk, use_reentrant=False)
        else:
            total = total + _chunk_loss_sum(*chunk)
    return total


class CausalLMWithLoss(nn.Module):
    """Root FSDP unit: ``model`` is the untouched Hugging Face causal LM.

    Being the root lets FSDP2 gather embeddings, final norm and LM head around
    our own forward, which runs the decoder and then the loss on hidden states.
    """

    def __init__(self, model: nn.Module, *, use_liger_kernels: bool = False) -> None:
        super().__init__()
        self.model = model
        self.liger_loss = None
        if use_liger_kernels:
            self.liger_loss = _make_liger_loss()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor,
                **attention_kwargs: torch.Tensor | int) -> torch.Tensor:
        """Summed token loss of one packed row.

        Args:
            input_ids: [1, T] packed samples.
            position_ids: [1, T] restarting at 0 for each sample.
            labels: [1, T] per-sample shifted targets.
            attention_kwargs: backend-specific boundary hints, e.g. flash-attn's
                ``cu_seq_lens_q/k`` and ``max_length_q/k``.
        """
        hidden = self.model.get_decoder()(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, **attention_kwargs
        ).last_hidden_state
        hidden = hidden.flatten(0, 1)  # [T, H]
        head = self.model.get_output_embeddings()
        flat_labels = labels.flatten()
        if self.liger_loss is not None:
            return self.liger_loss(head.weight, hidden, flat_labels, head.bias)
        return chunked_cross_entropy_sum(hidden, head.weight, head.bias, flat_labels)


def _make_liger_loss() -> nn.Module | None:
    if device_type() != "cuda":
        log_rank_0("--use-liger-kernels needs a GPU (Triton kernels): using the chunked PyTorch "
                   "cross-entropy instead", level=logging.WARNING)
        return None
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError as err:
        raise ImportError("--use-liger-kernels needs liger-kernel: pip install -r requirements-cuda.txt") from err
    # Sum reduction: Liger's reduction='none' path has had wrong gradients, and the
    # trainer owns the normalisation anyway.
    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")
