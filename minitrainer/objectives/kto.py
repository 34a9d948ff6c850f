"""KTO on packed, padding-free batches (``--objective kto``): unpaired feedback, one completion per row, desirable
or not (``data/unpaired.py``), against reference log-probabilities (``reference.py``, as DPO's).

As TRL 1.16's ``KTOTrainer`` (``loss_type="kto"``), with ``r`` a row's log-ratio (its completion's policy minus
reference log-probability, summed over the learned tokens) and ``z`` the KL baseline::

    desirable     w_d (1 - s(b (r - z)))
    undesirable   w_u (1 - s(b (z - r)))
    z             max(0, mean over the batch's KL sequences of their log-ratio), detached

The KL sequences are mismatched prompt/completion pairs fixed by the file (``unpaired.KLUnits``). A unit packs a
row's own sequence and its KL sequence side by side, as a pair's sides are; a step first runs every KL sequence
of its whole batch forward only (``begin_step``, one all-reduce) and then the own sequences with gradients, so the
baseline is the whole optimizer batch's, on any number of ranks and minibatches. TRL estimates it per micro-batch
(gathered over ranks): the same number when it takes one micro-batch per step. Both passes pack a unit's sequence
alone into the row it shares with the other units' same sequences, and the reference pass packs them the same
way, so step 1 with the policy as its own reference has log-ratios, rewards and baseline exactly 0.

The loss is the exact mean over the batch's rows of their weighted losses; rewards are ``b r``; the metrics are
TRL's names (``kl``, ``rewards/chosen`` and ``logps/chosen`` over the desirable rows, ``.../rejected`` over the
undesirable ones, ``rewards/margins``; ``logits/chosen``, ``logits/rejected`` and ``entropy`` over their learned
tokens, ``loss.sequence_token_stats``), a side's omitted in a step without such rows, as TRL omits them.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from minitrainer.common.labels import IGNORE_INDEX
from minitrainer.common.log import log_rank_0
from minitrainer.data.rows import is_pairs
from minitrainer.data.sampler import Minibatch, StepBatch
from minitrainer.data.unpaired import KLUnits, is_unpaired, unpair
from minitrainer.model.attention import model_inputs
from minitrainer.model.paths import model_path_error
from minitrainer.objectives import reference
from minitrainer.objectives.base import RunContext
from minitrainer.objectives.pairs import PairObjective, sequence_inputs

REFERENCE_FLAG = "--reference-model"
OWN, KL = 0, 1
"""A unit's sequences: its row's own, then its KL sequence (``unpaired.KLUnits``)."""

KTO_SUMS = ("examples", "loss", "desirable", "undesirable", "chosen_rewards", "rejected_rewards", "chosen_logps",
            "rejected_logps", "chosen_logits", "chosen_tokens", "rejected_logits", "rejected_tokens", "entropy")


@dataclass(frozen=True)
class KTOSettings:
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    kl_chunk: int = 8
    reference_model: str | None = None


def kto_losses(logratios: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor,
               settings: KTOSettings) -> torch.Tensor:
    """Each row's weighted loss ``[P]`` from its log-ratio, its label and the batch's KL baseline. Pure."""
    beta = settings.beta
    chosen = settings.desirable_weight * (1 - torch.sigmoid(beta * (logratios - kl)))
    rejected = settings.undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratios)))
    return torch.where(desirable, chosen, rejected)


def kl_baseline(kl_logratio_sum: torch.Tensor, num_rows: torch.Tensor) -> torch.Tensor:
    """The KL baseline from the summed log-ratios of a batch's KL sequences (all ranks): their mean, at least 0."""
    return (kl_logratio_sum / num_rows.clamp(min=1)).clamp(min=0)


def one_sequence_each(minibatch: Minibatch, which: int) -> Minibatch:
    """The packed row of every unit's sequence ``which`` (``OWN`` or ``KL``) of ``minibatch``, in order: its
    tokens cut out of the row, labels already shifted per sequence. A dummy comes back as it is. Pure."""
    if not minibatch.rows:
        return minibatch
    bounds = minibatch.cu_seqlens.long()
    lengths = bounds[1:] - bounds[:-1]
    kept = torch.repeat_interleave(torch.arange(lengths.numel()) % 2 == which, lengths)
    kept_lengths = lengths[which::2]
    labels = minibatch.labels[:, kept]
    return dataclasses.replace(
        minibatch, input_ids=minibatch.input_ids[:, kept], labels=labels, position_ids=minibatch.position_ids[:, kept],
        cu_seqlens=torch.cat([kept_lengths.new_zeros(1), kept_lengths.cumsum(0)]).to(torch.int32),
        max_seqlen=int(kept_lengths.max()), num_loss_counted_tokens=int((labels != IGNORE_INDEX).sum()),
        num_tokens=int(kept_lengths.sum()))


@dataclass(frozen=True)
class Labels:
    """The desirable flags of a dataset's units, indexed by its rows."""

    desirable: np.ndarray

    def of(self, rows, device: torch.device) -> torch.Tensor:
        return torch.as_tensor(self.desirable[list(rows)], device=device)


class KTOObjective(PairObjective):
    """Kahneman-Tversky optimisation of desirable and undesirable completions, against a reference model."""

    name = "kto"
    unit = "examples"
    preparing = "during the reference pass"
    console_metrics = ("kl", "rewards/chosen", "rewards/rejected")
    sum_names = KTO_SUMS

    def __init__(self, settings: KTOSettings) -> None:
        super().__init__()
        self.settings = settings
        self.train = reference.ReferenceTable.empty()
        self.held_out = reference.ReferenceTable.empty()
        self.labels = self.held_out_labels = Labels(np.zeros(0, bool))
        self.step_kl = torch.zeros((), dtype=torch.float64)
        self.last_own_stats = torch.zeros((0, 2))

    def preflight(self) -> str | None:
        source = self.settings.reference_model
        return model_path_error(source, flag=REFERENCE_FLAG) if source else None

    def run_params(self) -> dict:
        # Another beta, weight or KL chunk is another function to optimise: a resume refuses it unless allowed.
        return {"objective": "kto", **{f"kto_{name}": value for name, value in asdict(self.settings).items()}}

    def training_rows(self, dataset):
        """Unpaired rows as KTO's units (``KLUnits``); a preference file unpaired first, as TRL does."""
        if is_pairs(dataset) and not is_unpaired(dataset):
            rows = unpair(dataset)
            log_rank_0(f"--objective kto: {dataset.path}'s {len(dataset)} preference pairs unpaired into "
                       f"{len(rows)} examples (chosen: desirable, rejected: undesirable; TRL's "
                       "unpair_preference_dataset)")
        elif is_unpaired(dataset) and not is_pairs(dataset):
            rows = dataset
        else:
            return dataset
        return KLUnits(rows, self.settings.kl_chunk)

    def data_error(self, dataset, path: str) -> str | None:
        if is_unpaired(dataset) and is_pairs(dataset):
            return None
        return (f"--objective kto needs unpaired feedback (prompt/completion/label rows, tokenized by "
                f"process_data.py) or preference pairs, but {path} holds SFT rows")

    def tables(self, model: nn.Module, context: RunContext):
        """The rows' labels, the balance TRL warns about, then the reference log-probabilities of every own and
        KL sequence (``reference.py``)."""
        self.labels = Labels(context.dataset.desirable)
        self.held_out_labels = Labels(context.val_dataset.desirable if context.val_dataset is not None
                                      else np.zeros(0, bool))
        if context.dist_info.is_main:
            self._announce_balance()
        return reference.reference_tables(model, self, context, flag=REFERENCE_FLAG)

    def _announce_balance(self) -> None:
        """TRL's hint (the KTO paper's Eq. 8): with unequal counts, ``w_d n_d / (w_u n_u)`` in [1, 4/3]."""
        desirable = int(self.labels.desirable.sum())
        undesirable = int(self.labels.desirable.size) - desirable
        log_rank_0(f"kto: {desirable} desirable and {undesirable} undesirable examples, KL baseline from "
                   f"mismatched rows in chunks of {self.settings.kl_chunk} (--kto-kl-chunk)")
        if desirable == undesirable:
            return
        w_d, w_u = self.settings.desirable_weight, self.settings.undesirable_weight
        n_d, n_u = max(desirable, 1), max(undesirable, 1)
        d_range = (round(n_u * w_u / n_d, 2), round(n_u * w_u / n_d * 1.33, 2))
        u_range = (round(n_d * w_d / n_u / 1.33, 2), round(n_d * w_d / n_u, 2))
        if not (d_range[0] <= w_d <= d_range[1] or u_range[0] <= w_u <= u_range[1]):
            log_rank_0(f"kto: the weights do not balance {desirable} desirable against {undesirable} undesirable "
                       f"examples: set --kto-desirable-weight in [{d_range[0]}, {d_range[1]}] or "
                       f"--kto-undesirable-weight in [{u_range[0]}, {u_range[1]}] (not both)", level=logging.WARNING)

    def forward_sequences(self, model: nn.Module, minibatch: Minibatch, which: int, attn: str,
                          device: torch.device, *, stats: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log-probabilities [P] of every unit's sequence `which`, the row's per-sequence sums)``; a dummy's
        forward still runs, for FSDP's collectives need every rank's. ``stats``: the sequences' token statistics
        left in ``model.last_sequence_stats`` (``loss.sequence_token_stats``)."""
        part = one_sequence_each(minibatch, which)
        sums = model(**model_inputs(part, attn, device), **sequence_inputs(part, device), sequence_stats=stats)
        return (-sums if minibatch.rows else sums.new_zeros(0)), sums

    def forward_pairs(self, model: nn.Module, minibatch: Minibatch, attn: str,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log-probabilities [P, 2]: own, KL; the sums)``, each sequence in the row the steps pack it in: what
        the reference pass and validation read; the own sequences' token statistics in ``last_own_stats``."""
        own, own_sums = self.forward_sequences(model, minibatch, OWN, attn, device, stats=True)
        self.last_own_stats = model.last_sequence_stats
        kl, kl_sums = self.forward_sequences(model, minibatch, KL, attn, device)
        return torch.stack([own, kl], dim=1), torch.cat([own_sums, kl_sums])

    def begin_step(self, model: nn.Module, batch: StepBatch, *, attn: str, device: torch.device) -> None:
        """The batch's KL baseline: every KL sequence forward only, then one all-reduce (collective)."""
        totals = torch.zeros(2, dtype=torch.float64, device=device)
        with torch.no_grad():
            for minibatch in batch.minibatches:
                logps, _ = self.forward_sequences(model, minibatch, KL, attn, device)
                if minibatch.rows:
                    ratios = logps.double() - self.train.logps(minibatch.rows, device)[:, KL].double()
                    totals += torch.stack([ratios.sum(), totals.new_tensor(float(len(minibatch.rows)))])
        dist.all_reduce(totals)
        self.step_kl = kl_baseline(totals[0], totals[1])

    def example_terms(self, logps: torch.Tensor, rows: tuple[int, ...], table: reference.ReferenceTable,
                      labels: Labels, kl: torch.Tensor, stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weighted losses [P], KTO_SUMS)`` of one minibatch's rows from their own log-probabilities and token
        statistics ``[P, 2]`` (entropy and mean-logit sums over their learned tokens), float64."""
        device = logps.device
        logps = logps.double()
        ratios = logps - table.logps(rows, device)[:, OWN].double()
        desirable = labels.of(rows, device)
        losses = kto_losses(ratios, desirable, kl.to(device), self.settings)
        rewards = self.settings.beta * ratios.detach()
        chosen, rejected = desirable.double(), (~desirable).double()
        tokens = torch.as_tensor(table.side_loss_tokens[list(rows), OWN], device=device).double()
        stats = stats[:len(rows)].double()
        sums = torch.stack([logps.new_tensor(float(len(rows))), losses.double().sum(), chosen.sum(), rejected.sum(),
                            (rewards * chosen).sum(), (rewards * rejected).sum(), (logps.detach() * chosen).sum(),
                            (logps.detach() * rejected).sum(), (stats[:, 1] * chosen).sum(), (tokens * chosen).sum(),
                            (stats[:, 1] * rejected).sum(), (tokens * rejected).sum(), stats[:, 0].sum()])
        return losses, sums

    def minibatch_loss(self, model: nn.Module, minibatch: Minibatch, batch: StepBatch, *, attn: str,
                       device: torch.device, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' weighted losses over the batch's row count (the exact mean over its rows), times world_size:
        FSDP averages gradients over ranks, as for SFT."""
        logps, sequence_sums = self.forward_sequences(model, minibatch, OWN, attn, device, stats=True)
        losses, sums = self.example_terms(logps, minibatch.rows, self.train, self.labels, self.step_kl,
                                          model.last_sequence_stats)
        objective = losses.sum() / max(batch.num_samples, 1)
        # + 0 x the sums: a dummy's backward still reaches every block, so every rank joins FSDP's reductions.
        return objective.float() * world_size + 0 * sequence_sums.sum(), sums.detach()

    def record(self, counts) -> dict:
        sums = dict(zip(self.sum_names, counts.objective_sums))
        assert int(sums["examples"]) == counts.num_samples, (sums["examples"], counts.num_samples)
        return {"loss": self.summed_loss(sums), "kl": float(self.step_kl), **self.example_metrics(sums, prefix=""),
                "num_examples": counts.num_samples, "num_desirable": int(sums["desirable"])}

    def step_loss(self, counts) -> float:
        return self.summed_loss(dict(zip(self.sum_names, counts.objective_sums)))

    def summed_loss(self, sums: dict) -> float:
        return sums["loss"] / max(sums["examples"], 1)

    def example_metrics(self, sums: dict, *, prefix: str) -> dict:
        """TRL's names: each side's mean reward and log-probability over its rows and mean logit over their learned
        tokens, when it has rows; the entropy over every learned token."""
        tokens = sums["chosen_tokens"] + sums["rejected_tokens"]
        metrics = {f"{prefix}entropy": sums["entropy"] / tokens} if tokens else {}
        for side, count in (("chosen", sums["desirable"]), ("rejected", sums["undesirable"])):
            if count:
                metrics[f"{prefix}rewards/{side}"] = sums[f"{side}_rewards"] / count
                metrics[f"{prefix}logps/{side}"] = sums[f"{side}_logps"] / count
                metrics[f"{prefix}logits/{side}"] = sums[f"{side}_logits"] / max(sums[f"{side}_tokens"], 1)
        if sums["desirable"] and sums["undesirable"]:
            metrics[f"{prefix}rewards/margins"] = (metrics[f"{prefix}rewards/chosen"]
                                                   - metrics[f"{prefix}rewards/rejected"])
        return metrics

    def validation_loss(self, model: nn.Module, dataset, plan, *, rank: int, device: torch.device, attn: str,
                        shard=None) -> tuple[float, int, dict]:
        """The held-out rows' loss and metrics, the KL baseline the whole held-out set's (collective)."""
        kl_totals = torch.zeros(2, dtype=torch.float64, device=device)
        seen = []
        for logps, rows in self.held_out_logps(model, dataset, plan, rank=rank, attn=attn, device=device):
            if rows:
                ratios = logps[:, KL].double() - self.held_out.logps(rows, device)[:, KL].double()
                kl_totals += torch.stack([ratios.sum(), kl_totals.new_tensor(float(len(rows)))])
                seen.append((logps[:, OWN], rows, self.last_own_stats))
        dist.all_reduce(kl_totals)
        kl = kl_baseline(kl_totals[0], kl_totals[1])
        totals = torch.zeros(len(self.sum_names), device=device, dtype=torch.float64)
        for logps, rows, stats in seen:
            totals += self.example_terms(logps, rows, self.held_out, self.held_out_labels, kl, stats)[1]
        dist.all_reduce(totals)
        sums = dict(zip(self.sum_names, totals.tolist()))  # CPU-GPU sync point
        assert int(sums["examples"]) == plan.num_samples, (sums["examples"], plan.num_samples)
        if not sums["examples"]:
            return float("nan"), plan.num_loss_counted_tokens, {}
        return (self.summed_loss(sums), plan.num_loss_counted_tokens,
                {"val_kl": float(kl), **self.example_metrics(sums, prefix="val_")})
