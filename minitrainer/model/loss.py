"""The loss: a Hugging Face causal LM wrapped with its own objective as a sum-reduced token loss.

The loss never materialises fp32 logits for the whole packed row:

* plain path: the row is cut into chunks of ``CHUNK_TOKENS`` tokens and each
  chunk's ``hidden @ W_vocab.T`` + cross-entropy is checkpointed, so backward
  recomputes one chunk's logits at a time;
* Liger path (``--use-liger-kernels``, CUDA): Liger's fused linear
  cross-entropy, which never builds logits at all and accumulates the LM-head
  gradient in fp32 (``accum_dtype``), so bf16 chunks do not round it away.

Both apply the model's own logit processing (``loss_terms.LogitTransform``:
Granite's ``logits_scaling``, Cohere's ``logit_scale``, Gemma's final
softcapping) and, for MoE models whose config asks for it, add the router
load-balancing loss (``loss_terms.RouterLoss``) as documented in ``loss_terms.py``.

Both return the SUM of token losses; the trainer divides by the optimizer
batch's loss-token count, known before the forward pass.

By default both run only on learned positions (``learned_positions``; the
old all-positions head stays behind ``--no-head-learned-positions-only`` for
A/B timing): in chat SFT most positions are prompt (label ``IGNORE_INDEX``),
and their logits, head matmul and cross-entropy add exactly 0 to the loss and
its gradients. Their hidden states are dropped before the head, so the head
costs scale with the loss tokens, not the row length. The values are the same
sums over the same terms; only float summation order can differ
(docs/speed-head-compile.md)::

    row        [p p p p a a a p p a a]   p: prompt (label -100), a: learned
    hidden     [T, H] ---index_select(positions)---> [N, H], N = 5 here
    head + CE  [N, V] logits instead of [T, V]

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

from minitrainer.common.device import device_type
from minitrainer.common.labels import IGNORE_INDEX
from minitrainer.common.log import log_rank_0
from minitrainer.model.attention import cu_seqlens_from_position_ids, learned_positions
from minitrainer.model.loss_terms import LogitTransform, logit_transform, router_aux_sum, router_loss

CHUNK_TOKENS = 4096
"""Tokens per checkpointed cross-entropy chunk: bounds live logits to CHUNK_TOKENS x vocab."""


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    labels: torch.Tensor, transform: LogitTransform) -> torch.Tensor:
    logits = transform.apply(F.linear(hidden, weight, bias).float())  # [chunk, vocab]
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              labels: torch.Tensor, *, chunk_tokens: int = CHUNK_TOKENS,
                              transform: LogitTransform = LogitTransform()) -> torch.Tensor:
    """Sum of token cross-entropies of ``transform(hidden @ weight.T + bias)`` against ``labels``.

    Args:
        hidden: [T, H] final hidden states.
        weight: [V, H] output embedding.
        bias: [V] or None.
        labels: [T] targets, ``IGNORE_INDEX`` where no loss is counted.
        transform: the model's logit processing, applied in fp32.
    """
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_tokens):
        end = start + chunk_tokens
        chunk = (hidden[start:end], weight, bias, labels[start:end], transform)
        if torch.is_grad_enabled() and hidden.requires_grad:
            total = total + checkpoint(_chunk_loss_sum, *chunk, use_reentrant=False)
        else:
            total = total + _chunk_loss_sum(*chunk)
    return total


def _chunk_sequence_sums(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         labels: torch.Tensor, sequence_ids: torch.Tensor, num_sequences: int,
                         transform: LogitTransform) -> torch.Tensor:
    logits = transform.apply(F.linear(hidden, weight, bias).float())
    losses = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")  # 0 where ignored
    return losses.new_zeros(num_sequences).index_add(0, sequence_ids, losses)


def chunked_cross_entropy_per_sequence(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                       labels: torch.Tensor, sequence_ids: torch.Tensor, *, num_sequences: int,
                                       chunk_tokens: int = CHUNK_TOKENS,
                                       transform: LogitTransform = LogitTransform()) -> torch.Tensor:
    """Like ``chunked_cross_entropy_sum``, but one sum per packed sequence: ``[num_sequences]`` fp32.

    ``sequence_ids`` ([T]) says which sequence each position belongs to. A preference objective needs
    each side's log-probability (minus this sum), and the pair loss is not linear in it.
    """
    total = hidden.new_zeros(num_sequences, dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_tokens):
        end = start + chunk_tokens
        chunk = (hidden[start:end], weight, bias, labels[start:end], sequence_ids[start:end], num_sequences,
                 transform)
        if torch.is_grad_enabled() and hidden.requires_grad:
            total = total + checkpoint(_chunk_sequence_sums, *chunk, use_reentrant=False)
        else:
            total = total + _chunk_sequence_sums(*chunk)
    return total


def sequence_token_stats(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         labels: torch.Tensor, sequence_ids: torch.Tensor, *, num_sequences: int,
                         chunk_tokens: int = CHUNK_TOKENS,
                         transform: LogitTransform = LogitTransform()) -> torch.Tensor:
    """Per packed sequence, over its learned positions, the sums of the next-token distribution's entropy and of
    the vocabulary-mean logit: ``[num_sequences, 2]`` fp32, no gradient (what TRL logs as ``entropy`` and
    ``logits/*``). A second head pass over those positions, chunked as the loss's."""
    stats = hidden.new_zeros((num_sequences, 2), dtype=torch.float32)
    with torch.no_grad():
        for start in range(0, hidden.shape[0], chunk_tokens):
            end = start + chunk_tokens
            logits = transform.apply(F.linear(hidden[start:end], weight, bias).float())
            log_probs = torch.log_softmax(logits, dim=-1)
            entropy = -(log_probs.exp() * log_probs).sum(-1)
            learned = labels[start:end] != IGNORE_INDEX
            values = torch.stack([entropy, logits.mean(-1)], dim=1)[learned]
            stats.index_add_(0, sequence_ids[start:end][learned], values)
    return stats


_positions_of = learned_positions  # the forward's argument of that name shadows it


class CausalLMWithLoss(nn.Module):
    """Root FSDP unit: ``model`` is the untouched Hugging Face causal LM.

    Being the root lets FSDP2 gather embeddings, final norm and LM head around
    our own forward, which runs the decoder and then the loss on hidden states.
    After each call, ``last_ce_sum`` and ``last_router_aux_sum`` hold the
    detached parts of the returned objective, for logging.
    """

    def __init__(self, model: nn.Module, *, use_liger_kernels: bool = False,
                 head_learned_positions_only: bool = True) -> None:
        super().__init__()
        self.model = model
        self.head_learned_positions_only = head_learned_positions_only
        self.logit_transform = logit_transform(model)
        self.router_loss = router_loss(model)
        self.liger_loss = None
        if use_liger_kernels:
            self.liger_loss = _make_liger_loss(self.logit_transform)
        self.position_rows = multimodal_position_rows(decoder_of(model))
        self.last_ce_sum: torch.Tensor | None = None
        self.last_router_aux_sum: torch.Tensor | None = None
        self.last_sequence_stats: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor, *,
                router_aux_weight: float = 0.0, own_forward: bool = False,
                learned_positions: torch.Tensor | None = None, sequence_ids: torch.Tensor | None = None,
                num_sequences: int = 0, sequence_stats: bool = False,
                **attention_kwargs: torch.Tensor | int) -> torch.Tensor:
        """Summed token loss of one packed row, plus the weighted router loss of MoE models.

        Args:
            input_ids: [1, T] packed samples.
            position_ids: [1, T] restarting at 0 for each sample.
            labels: [1, T] per-sample shifted targets (unshifted with ``own_forward``).
            router_aux_weight: weight of the row's summed per-sample router loss
                (``loss_terms.router_aux_weight``); 0 leaves it out.
            learned_positions: ``learned_positions(labels)``, found on the host before the copy
                (``attention.model_inputs``); None: found here, on the device (a synchronisation).
            sequence_ids: [1, T] the packed sequence of each position, 0 to ``num_sequences - 1``: the
                forward then returns one summed loss per sequence, ``[num_sequences]``, with the chunked
                head (Liger's fused loss sums over the whole row).
            sequence_stats: with ``sequence_ids``, also leave ``sequence_token_stats`` of each sequence in
                ``last_sequence_stats``.
            own_forward: return the Hugging Face model's own ``forward(labels=...).loss``
                instead (the start-up self-check's reference; one unpacked sample,
                unshifted labels). Runs here so FSDP gathers the root's parameters.
            attention_kwargs: backend-specific boundary hints, e.g. flash-attn's
                ``cu_seq_lens_q/k`` and ``max_length_q/k``.
        """
        if own_forward:
            return own_text_model(self.model)(input_ids=input_ids, position_ids=position_ids, labels=labels,
                                              use_cache=False, **attention_kwargs).loss
        with_router = self.router_loss is not None and router_aux_weight != 0.0
        extra = {"output_router_logits": with_router} if self.router_loss is not None else {}
        flat_labels = labels.flatten()
        positions = None
        if self.head_learned_positions_only:
            # Found on the device, before the decoder: the sync then waits only for the input copies.
            positions = learned_positions if learned_positions is not None else _positions_of(flat_labels)
        outputs = self._run_decoder(input_ids, position_ids, {**extra, **attention_kwargs})
        hidden = outputs.last_hidden_state.flatten(0, 1)  # [T, H]
        flat_sequences = sequence_ids.flatten() if sequence_ids is not None else None
        if positions is not None:
            # Backward scatters the gradient into zeros: the dropped rows' gradient was exactly 0 anyway.
            hidden, flat_labels = hidden.index_select(0, positions), flat_labels.index_select(0, positions)  # [N, H]
            if flat_sequences is not None:
                flat_sequences = flat_sequences.index_select(0, positions)
        head = self.model.get_output_embeddings()
        if flat_sequences is not None:
            sums = chunked_cross_entropy_per_sequence(
                hidden, head.weight, head.bias, flat_labels, flat_sequences,
                num_sequences=num_sequences,
                transform=self.logit_transform)
            self.last_ce_sum = sums.detach().sum()
            self.last_router_aux_sum = torch.zeros((), device=sums.device)
            self.last_sequence_stats = sequence_token_stats(
                hidden.detach(), head.weight, head.bias, flat_labels, flat_sequences, num_sequences=num_sequences,
                transform=self.logit_transform) if sequence_stats else None
            return sums
        if self.liger_loss is not None:
            scale = self.logit_transform.scale
            # The scale is folded into the hidden states (and bias): (s*h) W + s*b = s * (h W + b).
            bias = head.bias if head.bias is None or scale == 1.0 else head.bias * scale
            ce_sum = self.liger_loss(head.weight, hidden * scale if scale != 1.0 else hidden, flat_labels, bias)
        else:
            ce_sum = chunked_cross_entropy_sum(hidden, head.weight, head.bias, flat_labels,
                                               transform=self.logit_transform)
        self.last_ce_sum = ce_sum.detach()
        if not with_router:
            self.last_router_aux_sum = torch.zeros((), device=ce_sum.device)
            return ce_sum
        cu_seqlens = attention_kwargs.get("cu_seq_lens_q")
        if cu_seqlens is None:
            cu_seqlens, _ = cu_seqlens_from_position_ids(position_ids)
        aux_sum = router_aux_sum(outputs.router_logits, cu_seqlens, num_experts=self.router_loss.num_experts,
                                 top_k=self.router_loss.top_k)
        self.last_router_aux_sum = aux_sum.detach()
        return ce_sum + router_aux_weight * aux_sum

    def _run_decoder(self, input_ids: torch.Tensor, position_ids: torch.Tensor, kwargs: dict):
        """The decoder's outputs on one packed row; multimodal rotary positions get their rows (``position_rows``)."""
        decoder = decoder_of(self.model)
        if self.position_rows:
            try:
                # [1 + axes, 1, T]: text positions (where the mask finds packed samples), then one row per rotary
                # axis (Qwen-VL: temporal, height, width), the same positions for text (get_rope_index on text).
                return decoder(input_ids=input_ids, position_ids=position_ids.expand(self.position_rows,
                                                                                     *position_ids.shape),
                               use_cache=False, **kwargs)
            except ValueError as err:
                # HunYuan-VL counts the text row, then refuses it before any layer runs (no collective was
                # started): plain positions from now on, and the self-check judges whether packing leaks.
                log_rank_0(f"{type(decoder).__name__} refuses a text-position row before its rotary axes ({err}): "
                           "passing plain position_ids", level=logging.WARNING)
                self.position_rows = 0
        return decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs)


def own_text_model(model: nn.Module) -> nn.Module:
    """The module whose ``forward(labels=...)`` is ``model``'s own text objective: the model itself, or a
    multimodal model's language model where that is a whole causal LM of its own (Llama-4's
    ``language_model``, whose wrapper's forward adds only the image path)."""
    from transformers import PreTrainedModel

    language_model = model.get_decoder()
    if language_model is not model and isinstance(language_model, PreTrainedModel) \
            and language_model.get_output_embeddings() is model.get_output_embeddings():
        return language_model
    return model


def multimodal_position_rows(decoder: nn.Module) -> int:
    """Rows of ``position_ids`` for a decoder with multimodal rotary positions (``mrope_section``: one section
    per axis, e.g. Qwen-VL's time, height and width), else 0. Such a decoder finds packed samples only in
    positions of one row per axis plus a first row of text positions; from 2-D positions it builds a plain
    causal mask, and packed samples see each other."""
    for module in decoder.modules():
        sections = getattr(module, "mrope_section", None)
        if isinstance(sections, (list, tuple)) and sections:
            return len(sections) + 1
    return 0


def decoder_of(model: nn.Module) -> nn.Module:
    """The module that returns the causal LM's final hidden states (``last_hidden_state``).

    ``get_decoder()`` looks for the attribute named by ``base_model_prefix`` and
    returns the model itself when there is none (Llama-4 text: prefix
    ``language_model``, decoder at ``.model``); the decoder is then the one
    pretrained-model child of the causal LM. A multimodal model's
    ``get_decoder()`` returns its language model, itself a causal LM in some
    families (Llama-4), whose decoder is then taken.
    """
    from transformers import PreTrainedModel

    decoder = model.get_decoder()
    if decoder is model:
        children = [child for child in model.children() if isinstance(child, PreTrainedModel)]
        if len(children) != 1:
            raise ValueError(f"cannot find the decoder of {type(model).__name__}: get_decoder() returns the model "
                             f"itself and it has {len(children)} pretrained-model children")
        decoder = children[0]
    if decoder is not model and isinstance(decoder, PreTrainedModel) and decoder.get_output_embeddings() is not None:
        # A multimodal model whose language model is a whole causal LM (Llama-4: language_model is
        # Llama4ForCausalLM): its decoder is one level further down.
        return decoder_of(decoder)
    return decoder


def find_decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks, found generically.

    Uses the model's own ``_no_split_modules`` (the classes Hugging Face never
    splits across devices: its decoder layers); falls back to the longest
    ``nn.ModuleList`` of same-class modules.
    """
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    # Outermost only: some families list a block and a module inside it (Mamba: MambaBlock and MambaMixer),
    # and sharding both would shard the inner parameters twice.
    inner = {id(sub) for block in blocks for sub in block.modules() if sub is not block}
    # The embeddings stay with the root, beside the LM head they may be tied to (BERT-style models list
    # their embeddings module among _no_split_modules; a separate FSDP unit would split the tied weight).
    embeddings = [m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None]
    blocks = [block for block in blocks if id(block) not in inner
              and not any(e is sub for e in embeddings for sub in block.modules())]
    if blocks:
        return blocks
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best):
            if len({type(child) for child in module}) == 1:
                best = list(module)
    if not best:
        raise ValueError(f"cannot find the decoder blocks of {type(model).__name__}: it declares no "
                         "_no_split_modules and has no nn.ModuleList of identical blocks")
    return best


def _make_liger_loss(transform: LogitTransform) -> nn.Module | None:
    if device_type() != "cuda":
        log_rank_0("--use-liger-kernels needs a GPU (Triton kernels): using the chunked PyTorch "
                   "cross-entropy instead", level=logging.WARNING)
        return None
    return make_liger_fused_loss(transform)


def make_liger_fused_loss(transform: LogitTransform) -> nn.Module:
    """Liger's fused linear cross-entropy with the model's softcap, summed, fp32 gradient accumulation.

    The scale of ``transform`` is not inside: the caller folds it into the
    hidden states. Runs on CPU tensors under ``TRITON_INTERPRET=1`` (tests).
    """
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError as err:
        raise ImportError("--use-liger-kernels needs liger-kernel: pip install -r requirements-cuda.txt") from err
    # Sum reduction: Liger's reduction='none' path has had wrong gradients, and the trainer owns the
    # normalisation anyway. accum_dtype fp32: the LM-head gradient is summed over chunks of tokens, and a
    # bf16 accumulator loses the small per-chunk contributions of a long packed row.
    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum",
                                            softcap=transform.softcap, accum_dtype=torch.float32)
