"""A training objective: the loss of one packed minibatch, scaled so that a step optimises the exact mean over
its whole batch, and the metrics a step and a validation pass report. ``TrainingObjective`` is the interface
and, as it stands, SFT: the exact per-token mean cross-entropy (the model's own objective, ``model/loss.py``).

The other objectives are one module each, a subclass overriding the hooks it needs:

    pairs.py  PairObjective  what the objectives on preference pairs share: one packed forward, per-side sums
    dpo.py    DPOObjective   pairs: sigmoid, IPO or hinge loss against reference log-probabilities
    cpo.py    CPOObjective   pairs, reference-free: CPO (sigmoid, hinge, IPO) and SimPO
    orpo.py   ORPOObjective  pairs, reference-free: the chosen sequences' NLL plus an odds-ratio term
    kto.py    KTOObjective   unpaired feedback: each row's log-ratio against a KL baseline from mismatched rows
    reward.py RewardObjective pairs, on a score head: a Bradley-Terry reward model

``TrainConfig.training_objective`` is the one place that picks an objective from the flags. Where each hook
runs::

    setup/run.py         preflight (rank 0, before anything loads), head_error and head_config (the model's
                         head, from its config), run_params (what a resume compares),
                         training_rows (the units trained, from the rows a file holds), data_error,
                         model_error, prepare (before the resume, with the run's ``RunContext``)
    loop/step.py         begin_step (before a step's minibatches), minibatch_loss (every minibatch), record
                         and step_loss (the metrics line, the guard)
    loop/actions.py      validation_loss

How to add one: docs/code-layout.md, "How to add a training objective".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

import torch.distributed as dist

from minitrainer.common.distributed import DistInfo
from minitrainer.data.held_out import ValidationPlan
from minitrainer.data.rows import Rows, is_pairs
from minitrainer.data.sampler import Minibatch, StepBatch, collate_minibatch
from minitrainer.data.unpaired import is_unpaired
from minitrainer.model.attention import model_inputs
from minitrainer.model.heads import head_refusal
from minitrainer.model.loss_terms import router_aux_weight


class ModelSource(Protocol):
    """Other models than the run's, set up as the run's is (dtype, attention, sharding; no fine-tuning method):
    a reference model, a teacher. Both calls are collective."""

    def weights_digest(self, path: str, *, flag: str) -> str:
        """The digest of the weights at ``path`` (the one a resume compares); ``flag`` names it in a refusal."""
        ...

    def load(self, path: str, *, flag: str) -> nn.Module:
        """The model at ``path`` as a sharded ``CausalLMWithLoss``, freed when the caller drops it."""
        ...


@dataclass(frozen=True)
class RunContext:
    """What ``prepare`` may read of the run being set up (``setup/run.py`` fills it), after the model is sharded
    and before a resume loads a checkpoint: the model is still the one the run starts from."""

    dist_info: DistInfo
    dataset: Rows
    val_dataset: Rows | None
    val_plan: ValidationPlan | None
    batches: Callable[[], contextlib.AbstractContextManager[Iterator[StepBatch]]]
    """The run's own batch stream from its start, packed and placed on ranks as the steps will see it."""
    batch_size: int
    """Units per optimizer step (``--batch-size``)."""
    packing: dict
    """What the stream's packing depends on (batch size, token budget, ranks, balance, seed): the key of
    anything stored per packing."""
    attn: str
    """The attention backend: the model inputs' kind (``model_inputs``)."""
    param_dtype: torch.dtype
    weights_digest: str
    """The run's starting weights (``resume_policy``'s digest)."""
    method_fingerprint: dict
    """The fine-tuning method's settings (``FineTuningMethod.fingerprint``)."""
    output_dir: str
    models: ModelSource


class TrainingObjective:
    """SFT: every learned token's cross-entropy, summed, divided by the batch's learned-token count."""

    unit = "samples"
    """What the sampler draws and ``--batch-size`` counts, as the start-up lines name it."""
    preparing: str | None = None
    """Where ``prepare`` is, as a stop there names it (``"during the reference pass"``); None: start-up."""

    console_metrics: tuple[str, ...] = ()
    """Fields of ``record``'s metrics line that the console's progress line shows after the loss, in order."""

    sum_names: tuple[str, ...] = ()
    """What ``minibatch_loss`` sums besides the cross-entropy, in order: reduced over ranks with the step's
    other counts (``loop/step.reduce_step_counts``) and read by ``record``."""

    def preflight(self) -> str | None:
        """Rank 0, before anything loads: why this objective's own settings cannot run (one line), or None."""
        return None

    def head_error(self, model_config, path: str) -> str | None:
        """Rank 0, before the model is built: why the checkpoint at ``path`` has no head this objective can
        train (one line), or None. Every objective but ``reward`` trains the causal LM's own LM head, so a
        sequence-classification checkpoint is refused (``model/heads.py``)."""
        return head_refusal(model_config, path)

    def head_config(self, model_config):
        """The head seam: the config the run builds, loads and exports the model by (``model/heads.py``: its
        ``architectures`` pick the class). SFT and the preference objectives train the checkpoint as it is."""
        return model_config

    def run_params(self) -> dict:
        """Fields of the resume comparison (``resume_policy.run_params``): none for SFT, so every full state
        written before objectives existed still resumes."""
        return {}

    def training_rows(self, dataset: Rows) -> Rows:
        """The units this objective trains, from the rows a file holds (every rank, after loading; a data
        mix's sources are read as they are): the data-kind seam. SFT trains the rows themselves."""
        return dataset

    def data_error(self, dataset, path: str) -> str | None:
        """Why this objective cannot train on ``dataset`` (one line), or None."""
        if is_pairs(dataset):
            return (f"{path} holds preference pairs (chosen/rejected): train them with a preference objective "
                    "(--objective dpo, cpo, simpo, orpo or kto)")
        if is_unpaired(dataset):
            return (f"{path} holds unpaired feedback (rows with a desirable/undesirable label): train them with "
                    "--objective kto")
        return None

    def model_error(self, model: nn.Module) -> str | None:
        """Why this objective cannot train ``model`` (a ``CausalLMWithLoss``), or None."""
        return None

    def prepare(self, model: nn.Module, context: RunContext) -> None:
        """Once, after the model is set up and before a resume loads its weights (collective)."""

    def begin_step(self, model: nn.Module, batch: StepBatch, *, attn: str, device: torch.device) -> None:
        """Before the step's first minibatch, with the whole step's batch: what a loss needs of the batch as a
        whole before any backward (KTO's KL baseline). Collective where it runs a forward."""

    def minibatch_loss(self, model: nn.Module, minibatch: Minibatch, batch: StepBatch, *, attn: str,
                       device: torch.device, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What to backpropagate for one minibatch, and this minibatch's ``sum_names`` sums (detached).

        The summed cross-entropy is divided by the whole batch's learned-token count, known before any
        forward. FSDP averages gradients over ranks, so multiplying by world_size turns that average back
        into the sum the exact per-token mean needs. With context parallelism each rank's sum covers its own
        shard of the group's row, so the sum over all ranks is still the batch's: the same factor holds.
        """
        # MoE router loss (model/loss_terms.py): per-sample, averaged over the batch's samples.
        aux_weight = router_aux_weight(
            model.router_loss, batch_num_loss_counted_tokens=batch.batch_num_loss_counted_tokens,
            batch_num_samples=batch.num_samples, minibatch_num_samples=minibatch.num_samples)
        loss = model(**model_inputs(minibatch, attn, device), router_aux_weight=aux_weight)
        scale = world_size / max(batch.batch_num_loss_counted_tokens, 1)
        return loss * scale, torch.zeros(len(self.sum_names), device=device, dtype=torch.float64)

    def record(self, counts) -> dict:
        """Metrics-line fields that replace or join ``report/metrics.step_record``'s (``counts``: the step's
        ``report/metrics.StepCounts``)."""
        return {}

    def step_loss(self, counts) -> float:
        """The step's loss, as the metrics line reports it (the divergence guard watches it)."""
        return counts.loss_sum / max(counts.batch_num_loss_counted_tokens, 1)

    def validation_loss(self, model: nn.Module, dataset, plan, *, rank: int, device: torch.device, attn: str,
                        shard=None) -> tuple[float, int, dict]:
        """One pass over the validation set (collective: every rank calls it with the same plan).

        Args:
            model: the FSDP-wrapped ``CausalLMWithLoss``; returns the summed loss of a packed row.
            dataset: the validation samples (``sample_arrays(row)``).
            plan: from ``held_out.plan_validation``.
            rank: this rank (with context parallelism: its group's data rank).
            device: where the loss lives.
            attn: the attention backend (the training loop's model inputs).
            shard: minibatch -> this rank's shard of it (context parallelism; None: the whole row).

        Returns:
            ``(val_loss, num_loss_counted_tokens, extra fields of the validation line)`` over the whole set,
            all ranks; NaN loss for an empty set.
        """
        was_training = model.training
        model.eval()
        loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        tokens = 0
        with torch.no_grad():
            for minibatch in plan.minibatches:
                packed = collate_minibatch([dataset.sample_arrays(row) for row in minibatch[rank]])
                if shard is not None:
                    packed = shard(packed)  # its own loss tokens only: the group's shards sum to the row's
                loss_sum += model(**model_inputs(packed, attn, device)).double()
                tokens += packed.num_loss_counted_tokens
        model.train(was_training)
        totals = torch.stack([loss_sum, torch.tensor(float(tokens), device=device, dtype=torch.float64)])
        dist.all_reduce(totals)
        total_loss, total_tokens = totals.tolist()  # CPU-GPU sync point
        assert int(total_tokens) == plan.num_loss_counted_tokens, (total_tokens, plan.num_loss_counted_tokens)
        return (total_loss / total_tokens if total_tokens else float("nan")), int(total_tokens), {}
