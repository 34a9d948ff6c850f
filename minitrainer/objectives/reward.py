"""Bradley-Terry reward models on packed, padding-free pairs (``--objective reward``).

The model is the one-label sequence classifier of the checkpoint's family (``model/heads.py``): a
``*ForSequenceClassification`` checkpoint as it is, or a causal LM given a fresh score head. Each side's score
``r`` is read at its last learned token inside the packed row (``model/score_head.py``): one forward per
minibatch, no padding, no forward per side. As TRL 1.16's ``RewardTrainer`` computes it, a pair's loss is::

    -log s(r_chosen - r_rejected - m)  +  c (r_chosen + r_rejected)^2

with ``m`` the pair's ``margin`` column where the file has one (0 otherwise) and ``c`` the
``--reward-center-coefficient`` (TRL's ``center_rewards_coefficient``, which pulls the scores towards 0). The
step optimises the exact mean over the batch's pairs, whatever the packing (``pairs.py``).

What a step logs, under TRL's names: ``accuracy`` (pairs with ``r_chosen > r_rejected``), ``margin`` (the mean
of ``r_chosen - r_rejected``), ``mean_reward``, ``min_reward`` and ``max_reward`` over every side of the batch,
plus ``rewards/chosen`` and ``rewards/rejected`` (the sides' mean scores). They are the whole batch's, over all
ranks and minibatches; TRL logs the mean of its micro-batches' values, the same numbers when a step is one
micro-batch. The batch's minimum and maximum ride on the step's one all-reduce of sums: each rank owns three
slots (its pair count and its running maximum and negated minimum, sent as increments over the step's
minibatches), and the sum over ranks lays every rank's extremes side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from minitrainer.data.sampler import Minibatch
from minitrainer.model.attention import model_inputs
from minitrainer.model.heads import scoring_config, scoring_refusal
from minitrainer.model.multimodal import is_multimodal
from minitrainer.model.score_head import SequenceScorer, last_learned_positions
from minitrainer.objectives.base import RunContext
from minitrainer.objectives.pairs import PairObjective, disable_dropout

REWARD_SUMS = ("pairs", "pair_loss", "accurate", "chosen_rewards", "rejected_rewards")
RANK_SLOTS = ("pairs", "max", "negated_min")
"""Per rank, after ``REWARD_SUMS``: what the batch's extremes are read from (module docstring)."""


@dataclass(frozen=True)
class RewardSettings:
    center_coefficient: float = 0.0
    """TRL's ``center_rewards_coefficient``: the weight of the squared sum of a pair's scores."""


def bradley_terry_losses(chosen: torch.Tensor, rejected: torch.Tensor, margins: torch.Tensor, *,
                         center_coefficient: float) -> torch.Tensor:
    """Each pair's loss ``[P]`` from its sides' scores and its margin (module docstring). Pure."""
    losses = -F.logsigmoid(chosen - rejected - margins)
    if center_coefficient:
        losses = losses + center_coefficient * (chosen + rejected) ** 2
    return losses


def margins_of(dataset) -> np.ndarray:
    """The pairs' ``margin`` column (float64 ``[N]``), zeros where the file has none."""
    margins = getattr(dataset, "margins", None) if dataset is not None else None
    if margins is None:
        return np.zeros(0 if dataset is None else len(dataset), np.float64)
    return np.asarray(margins, np.float64)


class RunningExtremes:
    """One rank's maximum and negated minimum score so far, as the increments a sum over minibatches (and
    then over ranks) turns back into them."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None

    def reset(self) -> None:
        self.value = None

    def increment(self, scores: torch.Tensor) -> torch.Tensor:
        """``[pairs, max, negated min]`` to add to this rank's slots for ``scores`` (``[P, 2]``)."""
        count = scores.new_tensor([float(len(scores))], dtype=torch.float64)
        if not len(scores):
            return torch.cat([count, count.new_zeros(2)])
        now = torch.stack([scores.max(), -scores.min()]).double()
        if self.value is None:
            added, self.value = now, now
        else:
            highest = torch.maximum(self.value, now)
            added, self.value = highest - self.value, highest
        return torch.cat([count, added])


class RewardObjective(PairObjective):
    """A Bradley-Terry reward model on preference pairs (module docstring)."""

    name = "reward"
    console_metrics = ("accuracy", "margin")

    def __init__(self, settings: RewardSettings) -> None:
        super().__init__()
        self.settings = settings
        self.sum_names = REWARD_SUMS
        self.rank = 0
        self.extremes = RunningExtremes()
        self.train = self.held_out = margins_of(None)

    def run_params(self) -> dict:
        # Another coefficient is another function to optimise: a resume refuses it unless allowed.
        return {"objective": self.name, "reward_center_coefficient": self.settings.center_coefficient}

    def head_error(self, model_config, path: str) -> str | None:
        if is_multimodal(model_config):
            return (f"--objective reward: {path} is an image-text-to-text checkpoint ({model_config.model_type}); "
                    "its language model has no sequence-classification class of its own here: export it with "
                    "--export-text-only from an SFT run and train that")
        return scoring_refusal(model_config, path)

    def head_config(self, model_config):
        return scoring_config(model_config)

    def data_error(self, dataset, path: str) -> str | None:
        error = super().data_error(dataset, path)
        if error is not None:
            return error
        silent = np.flatnonzero((np.asarray(dataset.side_loss_tokens) == 0).any(axis=1))
        if silent.size:
            return (f"--objective reward: {silent.size} pairs of {path} have a side that learns no token (pair "
                    f"{int(silent[0])} first), so it has no reply to score; re-tokenize them with process_data.py")
        return None

    def model_error(self, model: nn.Module) -> str | None:
        if not isinstance(model, SequenceScorer):
            return f"--objective reward needs a score head, but {type(model.model).__name__} was built"
        return super().model_error(model)

    def prepare(self, model: nn.Module, context: RunContext) -> None:
        disable_dropout(model)
        self.rank = context.dist_info.rank
        self.sum_names = REWARD_SUMS + tuple(f"{slot}@{rank}" for rank in range(context.dist_info.world_size)
                                             for slot in RANK_SLOTS)
        self.train, self.held_out = margins_of(context.dataset), margins_of(context.val_dataset)

    def begin_step(self, model: nn.Module, batch, *, attn: str, device: torch.device) -> None:
        self.extremes.reset()

    def forward_pairs(self, model: nn.Module, minibatch: Minibatch, attn: str,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores [P, 2] (chosen, rejected), every scored sequence's score)``. A dummy minibatch scores
        nothing; its decoder still runs, for FSDP's collectives need every rank's."""
        pairs = len(minibatch.rows)
        positions = (last_learned_positions(minibatch.labels.flatten(), minibatch.cu_seqlens)[:2 * pairs] if pairs
                     else torch.zeros(0, dtype=torch.long))
        scores = model(**model_inputs(minibatch, attn, device), score_positions=positions.to(device))
        return scores.view(pairs, 2), scores

    def pair_terms(self, scores: torch.Tensor, rows: tuple[int, ...], table) -> tuple[torch.Tensor, torch.Tensor]:
        margins = torch.as_tensor(table[list(rows)], device=scores.device, dtype=torch.float64)
        scores64 = scores.double()
        losses = bradley_terry_losses(scores64[:, 0], scores64[:, 1], margins,
                                      center_coefficient=self.settings.center_coefficient)
        sums = torch.zeros(len(self.sum_names), device=scores.device, dtype=torch.float64)
        sums[:len(REWARD_SUMS)] = torch.stack([
            scores64.new_tensor(float(len(rows))), losses.sum(), (scores64[:, 0] > scores64[:, 1]).sum().double(),
            scores64[:, 0].sum(), scores64[:, 1].sum()])
        if len(self.sum_names) > len(REWARD_SUMS):
            start = len(REWARD_SUMS) + len(RANK_SLOTS) * self.rank
            sums[start:start + len(RANK_SLOTS)] = self.extremes.increment(scores64.detach())
        return losses, sums

    def validation_loss(self, model: nn.Module, dataset, plan, *, rank: int, device: torch.device, attn: str,
                        shard=None) -> tuple[float, int, dict]:
        self.extremes.reset()
        return super().validation_loss(model, dataset, plan, rank=rank, device=device, attn=attn, shard=shard)

    def pair_metrics(self, sums: dict, *, prefix: str) -> dict:
        pairs = max(sums["pairs"], 1)
        chosen, rejected = sums["chosen_rewards"], sums["rejected_rewards"]
        metrics = {f"{prefix}accuracy": sums["accurate"] / pairs, f"{prefix}margin": (chosen - rejected) / pairs,
                   f"{prefix}mean_reward": (chosen + rejected) / (2 * pairs),
                   f"{prefix}rewards/chosen": chosen / pairs, f"{prefix}rewards/rejected": rejected / pairs}
        ranks = [name.split("@")[1] for name in sums if name.startswith("pairs@")]
        present = [rank for rank in ranks if sums[f"pairs@{rank}"] > 0]
        if present:
            metrics[f"{prefix}min_reward"] = min(-sums[f"negated_min@{rank}"] for rank in present)
            metrics[f"{prefix}max_reward"] = max(sums[f"max@{rank}"] for rank in present)
        return metrics
