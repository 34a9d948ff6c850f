"""CPO and SimPO on packed, padding-free batches (``--objective cpo``, ``--objective simpo``): reference-free,
so no reference pass; the shared pair machinery is ``pairs.py``.

Both follow TRL 1.16's ``CPOTrainer``, where SimPO is its ``loss_type="simpo"``. With ``L`` a side's
log-probability (summed over its learned tokens; their mean for ``ipo`` and SimPO), ``D = Lc - Lr``::

    cpo sigmoid   -log s(b D)
    cpo hinge     relu(1 - b D)
    cpo ipo       (D - 1 / (2 b))^2
    simpo         -log s(b D - g)                       g: the target reward margin (--simpo-gamma)

plus alpha times the chosen sides' per-token mean cross-entropy over the whole batch (``--cpo-alpha``; SimPO's
``--simpo-sft-weight``, TRL's ``cpo_alpha`` with ``loss_type="simpo"``). Rewards are ``b L``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from minitrainer.objectives.pairs import PAIR_SUMS, PairObjective, pair_sums

@dataclass(frozen=True)
class CPOSettings:
    loss: Literal["sigmoid", "hinge", "ipo", "simpo"] = "sigmoid"
    beta: float = 0.1
    alpha: float = 1.0
    """The chosen sides' NLL weight."""
    gamma: float = 0.5
    """SimPO's target reward margin (``loss="simpo"`` only)."""

    @property
    def length_normalised(self) -> bool:
        """Whether a side's log-probability is the mean over its learned tokens (TRL: ipo and simpo)."""
        return self.loss in ("ipo", "simpo")


def cpo_pair_losses(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor,
                    settings: CPOSettings) -> torch.Tensor:
    """Each pair's loss, ``[P]``, from its sides' log-probabilities (means when ``length_normalised``). Pure."""
    beta = settings.beta
    difference = chosen_logps - rejected_logps
    if settings.loss == "ipo":
        return (difference - 1 / (2 * beta)) ** 2
    if settings.loss == "hinge":
        return torch.relu(1 - beta * difference)
    margin = settings.gamma if settings.loss == "simpo" else 0.0
    return -F.logsigmoid(beta * difference - margin)


class CPOObjective(PairObjective):
    """Contrastive preference optimisation (``name`` cpo) or SimPO (``name`` simpo): chosen over rejected,
    with no reference model."""

    sum_names = PAIR_SUMS

    def __init__(self, settings: CPOSettings) -> None:
        super().__init__()
        self.settings = settings
        self.name = "simpo" if settings.loss == "simpo" else "cpo"
        self.nll_weight = settings.alpha

    def run_params(self) -> dict:
        # A changed loss, beta, alpha or margin is another function to optimise: a resume refuses it unless allowed.
        return {"objective": self.name, **{f"cpo_{name}": value for name, value in asdict(self.settings).items()}}

    def pair_terms(self, logps: torch.Tensor, rows: tuple[int, ...], table) -> tuple[torch.Tensor, torch.Tensor]:
        side_loss_tokens = torch.as_tensor(table.side_loss_tokens[list(rows)], device=logps.device)
        sums_of_sides = logps.double()
        sides = sums_of_sides / side_loss_tokens.clamp(min=1) if self.settings.length_normalised else sums_of_sides
        losses = cpo_pair_losses(sides[:, 0], sides[:, 1], self.settings)
        sums = pair_sums(losses, chosen_ce=-sums_of_sides[:, 0].sum(), chosen_tokens=side_loss_tokens[:, 0].sum(),
                         rewarded=sides, logps=sides, beta=self.settings.beta)
        return losses, torch.stack(sums)

    def pair_metrics(self, sums: dict, *, prefix: str) -> dict:
        # TRL logs nll_loss as 0 when alpha is 0 (it skips computing it); the value is kept here, for it is free.
        return {**super().pair_metrics(sums, prefix=prefix),
                f"{prefix}nll_loss": sums["chosen_ce"] / max(sums["chosen_tokens"], 1)}
