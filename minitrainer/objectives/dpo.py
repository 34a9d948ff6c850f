"""DPO on packed, padding-free batches (``--objective dpo``): the shared pair machinery is ``pairs.py``.

The reference log-probabilities come from ``reference.py``: the same packer, kernels and dtype, before step 1,
so the log-ratio of step 1 is exactly 0. Losses follow TRL 1.16's ``DPOTrainer`` (``loss_type``):

    sigmoid  -(1 - e) log s(b D) - e log s(-b D)     D = chosen log-ratio - rejected log-ratio; e: label smoothing
    ipo      (Dc / nc - Dr / nr - 1 / (2 b))^2        n: a side's learned tokens
    hinge    relu(1 - b D)

plus ``--dpo-sft-weight`` times the chosen sides' per-token mean cross-entropy over the whole batch (TRL's
``loss_type=["sigmoid", "sft"]``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from minitrainer.model.paths import model_path_error
from minitrainer.objectives import reference
from minitrainer.objectives.base import RunContext
from minitrainer.objectives.pairs import PAIR_SUMS, PairObjective, pair_sums

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


class DPOObjective(PairObjective):
    """Direct preference optimisation of chosen over rejected replies, against a reference model."""

    name = "dpo"
    preparing = "during the reference pass"
    sum_names = PAIR_SUMS

    def __init__(self, settings: DPOSettings) -> None:
        super().__init__()
        self.settings = settings
        self.nll_weight = settings.sft_weight
        self.train = reference.ReferenceTable.empty()
        self.held_out = reference.ReferenceTable.empty()

    def preflight(self) -> str | None:
        source = self.settings.reference_model
        return model_path_error(source, flag=REFERENCE_FLAG) if source else None

    def run_params(self) -> dict:
        # A changed beta or loss is another function to optimise: a resume refuses it unless allowed.
        return {"objective": "dpo", **{f"dpo_{name}": value for name, value in asdict(self.settings).items()}}

    def tables(self, model: nn.Module, context: RunContext):
        """The reference log-probabilities of every training and held-out pair (``reference.py``)."""
        return reference.reference_tables(model, self, context, flag=REFERENCE_FLAG)

    def pair_terms(self, logps: torch.Tensor, rows: tuple[int, ...], table: reference.ReferenceTable,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        device = logps.device
        reference_logps = table.logps(rows, device)
        side_loss_tokens = torch.as_tensor(table.side_loss_tokens[list(rows)], device=device)
        ratios = logps.double() - reference_logps.double()
        losses = pair_losses(ratios[:, 0], ratios[:, 1], side_loss_tokens, self.settings)
        sums = pair_sums(losses, chosen_ce=-logps[:, 0].double().sum(), chosen_tokens=side_loss_tokens[:, 0].sum(),
                         rewarded=ratios, logps=logps, beta=self.settings.beta)
        return losses, torch.stack(sums)

    def pair_metrics(self, sums: dict, *, prefix: str) -> dict:
        return {f"{prefix}dpo_loss": sums["pair_loss"] / max(sums["pairs"], 1),
                f"{prefix}sft_loss": sums["chosen_ce"] / max(sums["chosen_tokens"], 1),
                **super().pair_metrics(sums, prefix=prefix)}
