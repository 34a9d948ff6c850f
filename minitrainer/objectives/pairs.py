"""What every objective on preference pairs shares: one packed forward per minibatch, per-side sums, and a loss
that is the exact mean over the optimizer batch's pairs (``dpo.py``, ``cpo.py``, ``orpo.py``).

A pair is one unit of the sampler and the packer, so both its sides are in the same packed row on the same
rank; one forward gives every packed sequence's summed cross-entropy (``loss.CausalLMWithLoss`` with
``sequence_ids``), minus which is the sequence's log-probability::

    pair 0 (c0: 4 tokens, r0: 3), pair 1 (c1: 3, r1: 2)      one rank's minibatch, one row
    input_ids      c c c c r r r c c c r r
    position_ids   0 1 2 3 0 1 2 0 1 2 0 1
    sequence_ids   0 0 0 0 1 1 1 2 2 2 3 3      even: the chosen side of pair s // 2, odd: its rejected side

A pair's loss is not linear in those sums, but it is local to the minibatch: the sum of the minibatch's pair
losses, divided by the batch's pair count (known before any forward, as the SFT token count is), makes the step
optimise the exact mean over the batch's pairs, across ranks and minibatches. An NLL term on the chosen sides
(DPO's ``--dpo-sft-weight``, CPO's alpha, ORPO's own) is their summed cross-entropy over the batch's chosen
tokens, also known before the forward (``chosen_nll_tokens``).

A subclass gives ``pair_terms`` (the losses and the metric sums of a minibatch's pairs), the loss and metrics
read from the summed terms, and the per-row tables ``prepare`` builds (reference log-probabilities for DPO;
the sides' token counts for the reference-free objectives).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from minitrainer.common.log import log_rank_0
from minitrainer.data.rows import is_pairs
from minitrainer.data.sampler import Minibatch, StepBatch, collate_units
from minitrainer.data.unpaired import is_unpaired
from minitrainer.model.attention import model_inputs
from minitrainer.objectives.base import RunContext, TrainingObjective

PAIR_OBJECTIVES = ("dpo", "cpo", "simpo", "orpo")
"""The ``--objective`` values that train on preference pairs (each a ``PairObjective``)."""


@dataclass(frozen=True)
class SideCounts:
    """A dataset's per-row numbers the reference-free objectives read, indexed by its rows: the sides'
    learned-token counts and lengths, ``[N, 2]`` each (chosen, rejected); ``ReferenceTable`` has the counts too."""

    side_loss_tokens: np.ndarray
    side_lengths: np.ndarray

    @staticmethod
    def of(dataset) -> SideCounts:
        if dataset is None:
            return SideCounts(np.zeros((0, 2), np.int64), np.zeros((0, 2), np.int64))
        return SideCounts(dataset.side_loss_tokens, dataset.side_lengths)


def sequence_inputs(minibatch: Minibatch, device: torch.device) -> dict:
    """The forward's per-sequence arguments: which packed sequence each position is in, and how many."""
    lengths = (minibatch.cu_seqlens[1:] - minibatch.cu_seqlens[:-1]).long()
    sequence_ids = torch.repeat_interleave(torch.arange(lengths.numel()), lengths).unsqueeze(0)
    return {"sequence_ids": sequence_ids.to(device, non_blocking=True), "num_sequences": int(lengths.numel())}


PAIR_SUMS = ("pairs", "pair_loss", "chosen_ce", "chosen_tokens", "chosen_rewards", "rejected_rewards", "accurate",
             "chosen_logps", "rejected_logps")
"""What every pair objective sums (``pair_sums``); a subclass's ``sum_names`` starts with these."""


def pair_sums(losses: torch.Tensor, *, chosen_ce: torch.Tensor, chosen_tokens: float, rewarded: torch.Tensor,
              logps: torch.Tensor, beta: float) -> list[torch.Tensor]:
    """``PAIR_SUMS`` of one minibatch's pairs, float64: their losses ``[P]``, the chosen sides' summed NLL and its
    token count, the ``[P, 2]`` terms rewards are beta times (accuracy counts chosen > rejected) and the ``[P, 2]``
    log-probabilities the metrics report. Pure."""
    rewarded, logps = rewarded.double(), logps.double()
    return [losses.new_tensor(float(len(losses)), dtype=torch.float64), losses.double().sum(), chosen_ce.double(),
            losses.new_tensor(float(chosen_tokens), dtype=torch.float64), beta * rewarded[:, 0].sum(),
            beta * rewarded[:, 1].sum(), (rewarded[:, 0] > rewarded[:, 1]).sum().double(), logps[:, 0].sum(),
            logps[:, 1].sum()]


def disable_dropout(model: nn.Module) -> None:
    """TRL's ``disable_dropout``: a sampled mask would make the sides' log-probabilities noise."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


class PairObjective(TrainingObjective):
    """The shared loop of a preference objective; ``name`` is its ``--objective`` value."""

    name = "pairs"
    unit = "pairs"
    console_metrics = ("rewards/accuracies", "rewards/margins")

    nll_weight = 0.0
    """The weight of the chosen sides' per-token NLL over the batch (0: no such term)."""

    def __init__(self) -> None:
        self.train = SideCounts.of(None)
        self.held_out = SideCounts.of(None)

    def data_error(self, dataset, path: str) -> str | None:
        if is_unpaired(dataset):
            return (f"--objective {self.name} needs preference pairs (prompt/chosen/rejected rows), but {path} "
                    "holds unpaired feedback (one completion per row, labelled): train it with --objective kto")
        if not is_pairs(dataset):
            return (f"--objective {self.name} needs preference pairs (prompt/chosen/rejected rows, tokenized by "
                    f"process_data.py), but {path} holds SFT rows")
        return None

    def model_error(self, model: nn.Module) -> str | None:
        if model.router_loss is not None:
            return (f"--objective {self.name} does not add a MoE router loss (its per-pair weighting is not "
                    "defined yet): set output_router_logits=false in the model's config.json")
        return None

    def prepare(self, model: nn.Module, context: RunContext) -> None:
        """Dropout off, then the per-row tables (``tables``)."""
        disable_dropout(model)
        if model.liger_loss is not None:
            log_rank_0(f"--objective {self.name}: per-sequence log-probabilities use the chunked head, not "
                       "Liger's fused loss (which sums over the whole row)", level=logging.WARNING)
        self.train, self.held_out = self.tables(model, context)

    def tables(self, model: nn.Module, context: RunContext):
        """The training and held-out per-row tables (collective where computed by a forward pass)."""
        return SideCounts.of(context.dataset), SideCounts.of(context.val_dataset)

    def forward_pairs(self, model: nn.Module, minibatch: Minibatch, attn: str,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log-probabilities [P, 2] (chosen, rejected), every sequence's summed cross-entropy)``. A dummy
        minibatch gives ``[0, 2]``; its forward still runs, for FSDP's collectives need every rank's."""
        sums = model(**model_inputs(minibatch, attn, device), **sequence_inputs(minibatch, device))
        pairs = len(minibatch.rows)
        return (-sums.view(pairs, 2) if pairs else sums.new_zeros(0, 2)), sums

    def pair_terms(self, logps: torch.Tensor, rows: tuple[int, ...], table) -> tuple[torch.Tensor, torch.Tensor]:
        """``(per-pair losses [P], sums [len(sum_names)])`` of one minibatch's pairs, in float64; the sums'
        ``chosen_ce`` is the chosen sides' summed NLL the ``nll_weight`` term reads."""
        raise NotImplementedError

    def chosen_nll_tokens(self, table, rows) -> int:
        """The chosen sides' NLL tokens of ``rows``: their learned tokens."""
        return int(table.side_loss_tokens[rows, 0].sum())

    def minibatch_loss(self, model: nn.Module, minibatch: Minibatch, batch: StepBatch, *, attn: str,
                       device: torch.device, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pairs' loss sum over the batch's pair count (the exact mean over its pairs) plus the NLL term
        over the batch's chosen tokens, times world_size: FSDP averages gradients over ranks, as for SFT."""
        logps, sequence_sums = self.forward_pairs(model, minibatch, attn, device)
        losses, sums = self.pair_terms(logps, minibatch.rows, self.train)
        objective = losses.sum() / max(batch.num_samples, 1)
        if self.nll_weight:
            chosen_ce = sums[self.sum_names.index("chosen_ce")]
            tokens = self.chosen_nll_tokens(self.train, batch.kept_indices)
            objective = objective + self.nll_weight * chosen_ce / max(tokens, 1)
        # + 0 x the sums: a dummy's backward still reaches every block, so every rank joins FSDP's reductions.
        return objective.float() * world_size + 0 * sequence_sums.sum(), sums.detach()

    def record(self, counts) -> dict:
        sums = dict(zip(self.sum_names, counts.objective_sums))
        assert int(sums["pairs"]) == counts.num_samples, (sums["pairs"], counts.num_samples)
        return {"loss": self.summed_loss(sums), **self.pair_metrics(sums, prefix=""), "num_pairs": counts.num_samples}

    def step_loss(self, counts) -> float:
        return self.summed_loss(dict(zip(self.sum_names, counts.objective_sums)))

    def validation_loss(self, model: nn.Module, dataset, plan, *, rank: int, device: torch.device, attn: str,
                        shard=None) -> tuple[float, int, dict]:
        """The held-out pairs' loss (the training loss's definition) and metrics (collective)."""
        totals = torch.zeros(len(self.sum_names), device=device, dtype=torch.float64)
        for logps, rows in self.held_out_logps(model, dataset, plan, rank=rank, attn=attn, device=device):
            totals += self.pair_terms(logps, rows, self.held_out)[1]
        dist.all_reduce(totals)
        sums = dict(zip(self.sum_names, totals.tolist()))  # CPU-GPU sync point
        assert int(sums["pairs"]) == plan.num_samples, (sums["pairs"], plan.num_samples)
        if not sums["pairs"]:
            return float("nan"), plan.num_loss_counted_tokens, {}
        return self.summed_loss(sums), plan.num_loss_counted_tokens, self.pair_metrics(sums, prefix="val_")

    def held_out_logps(self, model: nn.Module, dataset, plan, *, rank: int, attn: str,
                       device: torch.device) -> Iterator[tuple[torch.Tensor, tuple[int, ...]]]:
        """``(log-probabilities, rows)`` of this rank's minibatches of the validation plan, forward only in
        eval mode: the one pass of held-out pairs, for a stored reference (``reference.py``) and validation
        alike."""
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for minibatch in plan.minibatches:
                    packed = collate_units(dataset, minibatch[rank])
                    yield self.forward_pairs(model, packed, attn, device)[0], packed.rows
        finally:
            model.train(was_training)

    def summed_loss(self, sums: dict) -> float:
        """The loss of the pairs whose terms ``sums`` adds up (a step's, all ranks; a validation pass's)."""
        loss = sums["pair_loss"] / max(sums["pairs"], 1)
        if self.nll_weight:
            loss += self.nll_weight * sums["chosen_ce"] / max(sums["chosen_tokens"], 1)
        return loss

    def pair_metrics(self, sums: dict, *, prefix: str) -> dict:
        """TRL's names and meanings: rewards are beta times the sides' (log-ratio or log-probability) terms;
        accuracies count chosen > rejected."""
        pairs = max(sums["pairs"], 1)
        return {f"{prefix}rewards/chosen": sums["chosen_rewards"] / pairs,
                f"{prefix}rewards/rejected": sums["rejected_rewards"] / pairs,
                f"{prefix}rewards/accuracies": sums["accurate"] / pairs,
                f"{prefix}rewards/margins": (sums["chosen_rewards"] - sums["rejected_rewards"]) / pairs,
                f"{prefix}logps/chosen": sums["chosen_logps"] / pairs,
                f"{prefix}logps/rejected": sums["rejected_logps"] / pairs}
