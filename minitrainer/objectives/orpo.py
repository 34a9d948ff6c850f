"""ORPO on packed, padding-free batches (``--objective orpo``): reference-free, so no reference pass; the
shared pair machinery is ``pairs.py``.

As TRL 1.16's ``ORPOTrainer``: with ``p`` a side's mean log-probability over its learned tokens,

    log_odds = (pc - pr) - (log(1 - e^pc) - log(1 - e^pr))
    loss     = NLL(chosen) - b * mean(log s(log_odds))

where the NLL is the chosen sides' per-token mean cross-entropy over **every** target of the whole sequence,
prompt included (TRL's choice: its labels are the input ids wherever the attention mask is set), over the whole
batch. So one forward scores three sums per pair: a chosen side's learned targets, its other targets (the
prompt's), and the rejected side's learned targets::

    chosen (prompt p p, reply c c), rejected (prompt p p, reply r)     one pair, shifted targets
    input_ids      p p c c        p p r
    sequence_ids   2 2 0 0        1 1 1       3i: chosen reply, 3i + 1: rejected side, 3i + 2: chosen prompt
    labels         p c c -        - r -       the chosen prompt's targets filled in; a side's last has none

Rewards are ``b p``; ``log_odds_ratio`` is the mean of ``log s(log_odds)``, ``log_odds_chosen`` of ``log_odds``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minitrainer.common.labels import IGNORE_INDEX
from minitrainer.data.sampler import Minibatch
from minitrainer.model.attention import model_inputs
from minitrainer.objectives.pairs import PAIR_SUMS, PairObjective, pair_sums, sequence_inputs

SEQUENCES_PER_PAIR = 3


@dataclass(frozen=True)
class ORPOSettings:
    beta: float = 0.1


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - e^x)`` for ``x <= 0``, without cancellation on either side of ``-ln 2``."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def odds_ratio_terms(chosen_mean_logps: torch.Tensor, rejected_mean_logps: torch.Tensor,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log s(log_odds), log_odds)`` per pair, ``[P]`` each, from the sides' mean log-probabilities. Pure."""
    log_odds = (chosen_mean_logps - rejected_mean_logps) - (log1mexp(chosen_mean_logps) -
                                                            log1mexp(rejected_mean_logps))
    return F.logsigmoid(log_odds), log_odds


def whole_chosen_targets(minibatch: Minibatch) -> tuple[Minibatch, torch.Tensor]:
    """``minibatch`` with every chosen side's unlearned targets filled in (each position's next token, but at a
    side's last position), and the ``[1, T]`` sequence ids that sum them apart (``SEQUENCES_PER_PAIR``). Pure,
    on the host's tensors."""
    bounds = minibatch.cu_seqlens.long()
    lengths = bounds[1:] - bounds[:-1]
    sequence = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    pair, side = sequence // 2, sequence % 2
    offset = torch.arange(sequence.numel()) - bounds[sequence]
    input_ids, labels = minibatch.input_ids[0], minibatch.labels[0]
    fill = (side == 0) & (labels == IGNORE_INDEX) & (offset < lengths[sequence] - 1)
    next_ids = torch.cat([input_ids[1:], input_ids.new_zeros(1)])
    filled = torch.where(fill, next_ids, labels)
    sequence_ids = SEQUENCES_PER_PAIR * pair + side + 2 * fill.long()
    return dataclasses.replace(minibatch, labels=filled.unsqueeze(0)), sequence_ids.unsqueeze(0)


class ORPOObjective(PairObjective):
    """Odds-ratio preference optimisation: SFT on the chosen sides plus an odds-ratio term, no reference model."""

    name = "orpo"
    nll_weight = 1.0
    sum_names = (*PAIR_SUMS, "log_odds_ratio", "log_odds_chosen")

    def __init__(self, settings: ORPOSettings) -> None:
        super().__init__()
        self.settings = settings

    def run_params(self) -> dict:
        # A changed beta is another function to optimise: a resume refuses it unless allowed.
        return {"objective": "orpo", **{f"orpo_{name}": value for name, value in asdict(self.settings).items()}}

    def forward_pairs(self, model: nn.Module, minibatch: Minibatch, attn: str,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log-probabilities [P, 3]: chosen reply, rejected reply, chosen prompt targets; the sums)``."""
        pairs = len(minibatch.rows)
        if not pairs:  # a dummy: its forward still runs, for FSDP's collectives
            sums = model(**model_inputs(minibatch, attn, device), **sequence_inputs(minibatch, device))
            return sums.new_zeros(0, SEQUENCES_PER_PAIR), sums
        filled, sequence_ids = whole_chosen_targets(minibatch)
        sums = model(**model_inputs(filled, attn, device), sequence_ids=sequence_ids.to(device, non_blocking=True),
                     num_sequences=SEQUENCES_PER_PAIR * pairs)
        return -sums.view(pairs, SEQUENCES_PER_PAIR), sums

    def chosen_nll_tokens(self, table, rows) -> int:
        """Every target of the chosen sides: each side's tokens but its first."""
        return int((table.side_lengths[rows, 0] - 1).sum())

    def pair_terms(self, logps: torch.Tensor, rows: tuple[int, ...], table) -> tuple[torch.Tensor, torch.Tensor]:
        device = logps.device
        side_loss_tokens = torch.as_tensor(table.side_loss_tokens[list(rows)], device=device)
        logps = logps.double()
        means = logps[:, :2] / side_loss_tokens.clamp(min=1)
        ratio, log_odds = odds_ratio_terms(means[:, 0], means[:, 1])
        losses = -self.settings.beta * ratio
        sums = pair_sums(losses, chosen_ce=-(logps[:, 0] + logps[:, 2]).sum(),
                         chosen_tokens=self.chosen_nll_tokens(table, list(rows)), rewarded=means, logps=means,
                         beta=self.settings.beta)
        return losses, torch.stack([*sums, ratio.sum(), log_odds.sum()])

    def pair_metrics(self, sums: dict, *, prefix: str) -> dict:
        pairs = max(sums["pairs"], 1)
        return {**super().pair_metrics(sums, prefix=prefix),
                f"{prefix}nll_loss": sums["chosen_ce"] / max(sums["chosen_tokens"], 1),
                f"{prefix}log_odds_ratio": sums["log_odds_ratio"] / pairs,
                f"{prefix}log_odds_chosen": sums["log_odds_chosen"] / pairs}
