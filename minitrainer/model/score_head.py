"""A reward model's forward: one scalar score per packed sequence, read at its last learned token.

The model is a Hugging Face ``*ForSequenceClassification`` with one label (``heads.scoring_config``), whose own
forward pools its score head's output at each row's last non-pad token: one padded sequence per row. Packed, a
row holds many sequences, so the decoder runs once over the packed row and the head runs only on the hidden
state of each sequence's last learned token (its reply's final token, where the whole reply has been read)::

    pair 0 (c0, r0), pair 1 (c1, r1)        one rank's minibatch, one row, labels shifted per sequence
    input_ids      p p c c E t | p r r E t | p p c E t | p r E t        E: end of turn, t: template tail
    hidden         [T, H] ---index_select(last learned positions: the four E)---> [4, H]
    score head     [4, H] @ [H, 1] -> scores [4]: c0, r0, c1, r1

Causal attention makes the hidden state at a sequence's last learned token independent of every later token,
so the score is the one the exported model computes on the sequence cut right after that token
(``tools/score_pairs.py``), with no padding and no forward per side. A template's tail after the end of turn
(ChatML's newline) carries no target and is never read.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from minitrainer.common.labels import IGNORE_INDEX
from minitrainer.model.attention import cu_seqlens_from_position_ids
from minitrainer.model.heads import score_head_name
from minitrainer.model.loss import CausalLMWithLoss


def last_learned_index(labels: np.ndarray) -> int | None:
    """The index of one sequence's last learned token, from its UNshifted labels (past position 0, as the shifted
    targets count them: a first token is no target), or None when it learns none: where ``last_learned_positions``
    reads its score, and where a sequence is cut to be scored alone. Pure."""
    learned = np.flatnonzero(np.asarray(labels)[1:] != IGNORE_INDEX)
    return int(learned[-1]) + 1 if learned.size else None


def last_learned_positions(labels: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per packed sequence, the position of its last learned token: ``[S]`` int64, from the row's labels (``[T]``,
    shifted per sequence: the target of position ``t`` is token ``t + 1``) and its boundaries
    (``[S + 1]``). Pure.

    Raises:
        ValueError: a sequence learns nothing (it has no token to score), naming which.
    """
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    sequence = torch.repeat_interleave(torch.arange(lengths.numel(), device=labels.device), lengths.to(labels.device))
    positions = torch.arange(labels.numel(), device=labels.device)
    marked = torch.where(labels != IGNORE_INDEX, positions, -1)
    last = torch.full((lengths.numel(),), -1, dtype=torch.long, device=labels.device)
    last = last.scatter_reduce(0, sequence, marked, reduce="amax")
    empty = torch.nonzero(last < 0).flatten().tolist()
    if empty:
        raise ValueError(f"packed sequences {empty} learn no token: a reward model has nothing of theirs to score")
    return last + 1  # the target of the last learned position is the last learned token


class SequenceScorer(CausalLMWithLoss):
    """Root FSDP unit of a reward model: ``model`` is the untouched ``*ForSequenceClassification``, whose decoder
    this runs on the packed row before its score head reads the scored positions (module docstring).

    The loss bookkeeping of the causal-LM wrapper (``last_ce_sum``, ``last_router_aux_sum``) is zero here: the
    objective (``objectives/reward.py``) holds what a step reports.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model, use_liger_kernels=False, head_learned_positions_only=True)
        self.head_name = score_head_name(model)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor, *,
                score_positions: torch.Tensor | None = None, own_forward: bool = False,
                learned_positions: torch.Tensor | None = None, router_aux_weight: float = 0.0,
                **attention_kwargs: torch.Tensor | int) -> torch.Tensor:
        """The scores ``[S]`` (fp32) of one packed row's sequences at ``score_positions``.

        Args:
            input_ids, position_ids, labels: ``[1, T]`` as ``CausalLMWithLoss`` takes them (labels shifted).
            score_positions: ``[S]`` positions in the row to score (``last_learned_positions``, as the objective
                passes them); None: every sequence's last token, from ``position_ids`` (the memory probes' rows,
                whose cut samples may learn nothing).
            own_forward: the Hugging Face model's own forward instead, on one unpacked sequence: its pooled
                score ``[1]`` at its last token (the start-up self-check's reference).
            learned_positions, router_aux_weight: the causal-LM forward's; unused by a score head.
        """
        if own_forward:
            return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                              **attention_kwargs).logits[:, 0].float()
        if score_positions is None:
            cu_seqlens, _ = cu_seqlens_from_position_ids(position_ids)
            score_positions = (cu_seqlens[1:] - 1).long()
        outputs = self._run_decoder(input_ids, position_ids, attention_kwargs)
        hidden = outputs.last_hidden_state.flatten(0, 1).index_select(0, score_positions)  # [S, H]
        scores = getattr(self.model, self.head_name)(hidden)[:, 0].float()
        self.last_ce_sum = scores.new_zeros(())
        self.last_router_aux_sum = scores.new_zeros(())
        return scores
