"""DPO on packed, padding-free batches (``--objective dpo``).

A pair is one unit of the sampler and the packer, so both its sides are in the same packed row on the same
rank; one forward gives every packed sequence's summed cross-entropy (``loss.CausalLMWithLoss`` with
``sequence_ids``), minus which is the sequence's log-probability. The pair loss is not linear in those, but it
is local to the minibatch: its sum over the minibatch's pairs, divided by the batch's pair count (known
before any forward, as the SFT token count is), makes the step optimise the exact mean over the batch's pairs,
across ranks and minibatches::

    pair 0 (c0: 4 tokens, r0: 3), pair 1 (c1: 3, r1: 2)      one rank's minibatch, one row
    input_ids      c c c c r r r c c c r r
    position_ids   0 1 2 3 0 1 2 0 1 2 0 1
    sequence_ids   0 0 0 0 1 1 1 2 2 2 3 3      even: the chosen side of pair s // 2, odd: its rejected side

The reference log-probabilities come from ``reference.py``: the same packer, kernels and dtype, before step 1,
so the log-ratio of step 1 is exactly 0. Losses follow TRL 1.16's ``DPOTrainer`` (``loss_type``):

    sigmoid  -(1 - e) log s(b D) - e log s(-b D)     D = chosen log-ratio - rejected log-ratio; e: label smoothing
    ipo      (Dc / nc - Dr / nr - 1 / (2 b))^2        n: a side's learned tokens
    hinge    relu(1 - b D)

plus ``--dpo-sft-weight`` times the chosen sides' per-token mean cross-entropy over the whole batch (TRL's
``loss_type=["sigmoid", "sft"]``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minitrainer.common.log import log_rank_0
from minitrainer.data.rows import is_pairs
from minitrainer.data.sampler import Minibatch, StepBatch, collate_units
from minitrainer.model.attention import model_inputs
from minitrainer.model.paths import model_path_error
from minitrainer.objectives import reference
from minitrainer.objectives.base import RunContext, TrainingObjective

DPO_LOSSES = ("sigmoid", "ipo", "hinge")
REFERENCE_FLAG = "--reference-model"


@dataclass(frozen=True)
class DPOSettings:
    beta: float = 0.1
    loss: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    label_smoothing: float = 0.0
    sft_weight: float = 0.0
    reference_model: str | None = None


def pair_losses(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, side_loss_tokens: torch.Tensor,
                settings: DPOSettings) -> torch.Tensor:
    """Each pair's loss, ``[P]``, from its sides' log-ratios (policy minus reference log-probabilities) and
    learned-token counts ``[P, 2]``. Pure."""
    beta = settings.beta
    if settings.loss == "ipo":
        tokens = side_loss_tokens.clamp(min=1).to(chosen_logratios.dtype)
        return (chosen_logratios / tokens[:, 0] - rejected_logratios / tokens[:, 1] - 1 / (2 * beta)) ** 2
    margin = beta * (chosen_logratios - rejected_logratios)
    if settings.loss == "hinge":
        return torch.relu(1 - margin)
    smoothing = settings.label_smoothing
    return -(1 - smoothing) * F.logsigmoid(margin) - smoothing * F.logsigmoid(-margin)


def sequence_inputs(minibatch: Minibatch, device: torch.device) -> dict:
    """The forward's per-sequence arguments: which packed sequence each position is in, and how many."""
    lengths = (minibatch.cu_seqlens[1:] - minibatch.cu_seqlens[:-1]).long()
    sequence_ids = torch.repeat_interleave(torch.arange(lengths.numel()), lengths).unsqueeze(0)
    return {"sequence_ids": sequence_ids.to(device, non_blocking=True), "num_sequences": int(lengths.numel())}


class DPOObjective(TrainingObjective):
    """Direct preference optimisation of chosen over rejected replies."""

    unit = "pairs"
    sum_names = ("pairs", "pair_loss", "chosen_ce", "chosen_tokens", "chosen_rewards", "rejected_rewards",
                 "accurate", "chosen_logps", "rejected_logps")

    def __init__(self, settings: DPOSettings) -> None:
        self.settings = settings
        self.train = reference.ReferenceTable.empty()
        self.held_out = reference.ReferenceTable.empty()

    def preflight(self) -> str | None:
        source = self.settings.reference_model
        return model_path_error(source, flag=REFERENCE_FLAG) if source else None

    def run_params(self) -> dict:
        # A changed beta or loss is another function to optimise: a resume refuses it unless allowed.
        return {"objective": "dpo", **{f"dpo_{name}": value for name, value in asdict(self.settings).items()}}

    def data_error(self, dataset, path: str) -> str | None:
        if not is_pairs(dataset):
            return (f"--objective dpo needs preference pairs (prompt/chosen/rejected rows, tokenized by "
                    f"process_data.py), but {path} holds SFT rows")
        return None

    def model_error(self, model: nn.Module) -> str | None:
        if model.router_loss is not None:
            return ("--objective dpo does not add a MoE router loss (its per-pair weighting is not defined "
                    "yet): set output_router_logits=false in the model's config.json")
        return None

    def prepare(self, model: nn.Module, context: RunContext) -> None:
        """Dropout off (TRL's ``disable_dropout``: a sampled mask would make the log-ratio noise), then the
        reference log-probabilities of every training and held-out pair (``reference.py``)."""
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
            if isinstance(getattr(module, "attention_dropout", None), float):
                module.attention_dropout = 0.0
        if model.liger_loss is not None:
            log_rank_0("--objective dpo: per-sequence log-probabilities use the chunked head, not Liger's fused "
                       "loss (which sums over the whole row)", level=logging.WARNING)
        self.train, self.held_out = reference.reference_tables(model, self, context, flag=REFERENCE_FLAG)

    def forward_pairs(self, model: nn.Module, minibatch: Minibatch, attn: str,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log-probabilities [P, 2] (chosen, rejected), every sequence's summed cross-entropy)``. A dummy
        minibatch gives ``[0, 2]``; its forward still runs, for FSDP's collectives need every rank's."""
        sums = model(**model_inputs(minibatch, attn, device), **sequence_inputs(minibatch, device))
        pairs = len(minibatch.rows)
        return (-sums.view(pairs, 2) if pairs else sums.new_zeros(0, 2)), sums

    def pair_terms(self, logps: torch.Tensor, rows: tuple[int, ...], table: reference.ReferenceTable,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(per-pair losses [P], sums [K])`` of one minibatch's pairs, in float64."""
        device = logps.device
        reference_logps = table.logps(rows, device)
        side_loss_tokens = torch.as_tensor(table.side_loss_tokens[list(rows)], device=device)
        ratios = logps.double() - reference_logps.double()
        losses = pair_losses(ratios[:, 0], ratios[:, 1], side_loss_tokens, self.settings)
        beta = self.settings.beta
        sums = torch.stack([
            logps.new_tensor(float(len(rows)), dtype=torch.float64), losses.sum(),
            -logps[:, 0].double().sum(), side_loss_tokens[:, 0].sum().double(), beta * ratios[:, 0].sum(),
            beta * ratios[:, 1].sum(), (ratios[:, 0] > ratios[:, 1]).sum().double(),
            logps[:, 0].double().sum(), logps[:, 1].double().sum()])
        return losses, sums

    def minibatch_loss(self, model: nn.Module, minibatch: Minibatch, batch: StepBatch, *, attn: str,
                       device: torch.device, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pairs' loss sum over the batch's pair count (the exact mean over its pairs) plus the SFT term,
        times world_size: FSDP averages gradients over ranks, as for SFT."""
        logps, sequence_sums = self.forward_pairs(model, minibatch, attn, device)
        losses, sums = self.pair_terms(logps, minibatch.rows, self.train)
        objective = losses.sum() / max(batch.num_samples, 1)
        if self.settings.sft_weight:
            chosen_tokens = int(self.train.side_loss_tokens[batch.kept_indices, 0].sum())
            objective = objective + self.settings.sft_weight * -logps[:, 0].sum() / max(chosen_tokens, 1)
        # + 0 x the sums: a dummy's backward still reaches every block, so every rank joins FSDP's reductions.
        return objective.float() * world_size + 0 * sequence_sums.sum(), sums.detach()

    def record(self, counts) -> dict:
        sums = dict(zip(self.sum_names, counts.objective_sums))
        assert int(sums["pairs"]) == counts.num_samples, (sums["pairs"], counts.num_samples)
        return {"loss": self._loss(sums), **self._pair_metrics(sums, prefix=""),
                "num_pairs": counts.num_samples}

    def step_loss(self, counts) -> float:
        return self._loss(dict(zip(self.sum_names, counts.objective_sums)))

    def validation_loss(self, model: nn.Module, dataset, plan, *, rank: int, device: torch.device, attn: str,
                        shard=None) -> tuple[float, int, dict]:
        """The held-out pairs' loss (the training loss's definition) and reward metrics (collective)."""
        totals = torch.zeros(len(self.sum_names), device=device, dtype=torch.float64)
        for logps, rows in self.held_out_logps(model, dataset, plan, rank=rank, attn=attn, device=device):
            totals += self.pair_terms(logps, rows, self.held_out)[1]
        dist.all_reduce(totals)
        sums = dict(zip(self.sum_names, totals.tolist()))  # CPU-GPU sync point
        assert int(sums["pairs"]) == plan.num_samples, (sums["pairs"], plan.num_samples)
        if not sums["pairs"]:
            return float("nan"), plan.num_loss_counted_tokens, {}
        return self._loss(sums), plan.num_loss_counted_tokens, self._pair_metrics(sums, prefix="val_")

    def held_out_logps(self, model: nn.Module, dataset, plan, *, rank: int, attn: str,
                       device: torch.device) -> Iterator[tuple[torch.Tensor, tuple[int, ...]]]:
        """``(log-probabilities [P, 2], rows)`` of this rank's minibatches of the validation plan, forward only
        in eval mode: the one pass of held-out pairs, for their reference (``reference.py``) and validation
        alike, so a validation at the starting weights sees log-ratios of exactly 0."""
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for minibatch in plan.minibatches:
                    packed = collate_units(dataset, minibatch[rank])
                    yield self.forward_pairs(model, packed, attn, device)[0], packed.rows
        finally:
            model.train(was_training)

    def _loss(self, sums: dict) -> float:
        loss = sums["pair_loss"] / max(sums["pairs"], 1)
        if self.settings.sft_weight:
            loss += self.settings.sft_weight * sums["chosen_ce"] / max(sums["chosen_tokens"], 1)
        return loss

    @staticmethod
    def _pair_metrics(sums: dict, *, prefix: str) -> dict:
        """TRL's names and meanings: rewards are beta times the log-ratios; accuracies count chosen > rejected."""
        pairs = max(sums["pairs"], 1)
        return {f"{prefix}dpo_loss": sums["pair_loss"] / pairs,
                f"{prefix}sft_loss": sums["chosen_ce"] / max(sums["chosen_tokens"], 1),
                f"{prefix}rewards/chosen": sums["chosen_rewards"] / pairs,
                f"{prefix}rewards/rejected": sums["rejected_rewards"] / pairs,
                f"{prefix}rewards/accuracies": sums["accurate"] / pairs,
                f"{prefix}rewards/margins": (sums["chosen_rewards"] - sums["rejected_rewards"]) / pairs,
                f"{prefix}logps/chosen": sums["chosen_logps"] / pairs,
                f"{prefix}logps/rejected": sums["rejected_logps"] / pairs}
