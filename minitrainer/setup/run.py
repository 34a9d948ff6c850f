"""Everything a training run needs before its first step, checked cheaply first, gathered in one ``Run``.

Order matters and is kept: rank 0's cheap checks (paths, model config,
attention backend, LoRA, trackers, writable output) come before any heavy
work; data is loaded and checked against the model's vocabulary before the
model loads; the schedule is built on a stand-in optimizer so a bad
combination fails in seconds; the resume policy compares the checkpoint with
this run's parameters before the model is sharded. Every refusal exits all
ranks together with one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import importlib.util
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LRScheduler

from minitrainer.data import held_out
from minitrainer.setup import schedule
from minitrainer.setup import flops
from minitrainer.setup.autotune import probe_recomputation, probe_token_budget
from minitrainer.report.metrics import MetricsWriter, truncate_metrics
from minitrainer.checkpoint import output_lock, resume_policy
from minitrainer.checkpoint import policy as checkpoint_policy
from minitrainer.checkpoint.full_state import remove_leftover_tmp, resume_candidates, resume_train_state
from minitrainer.checkpoint.train_state import TrainState
from minitrainer.common import fault_injection
from minitrainer.common.device import device_type
from minitrainer.common.distributed import DistInfo, fail_together
from minitrainer.common.exits import stopping_phase, write_run_status
from minitrainer.common.log import log_rank_0, logger
from minitrainer.common.rng import seed_everything
from minitrainer.data import sampler
from minitrainer.data import cache as data_cache
from minitrainer.data import mix as data_mix
from minitrainer.data.rows import is_pairs
from minitrainer.data.sampler import StepBatch
from minitrainer.methods.base import FineTuningMethod
from minitrainer.model import context_parallel
from minitrainer.model.attention import attention_needs, explicit_attention_refusal, model_inputs
from minitrainer.model.heads import sequence_classification_class
from minitrainer.model.loss import CausalLMWithLoss, find_decoder_blocks
from minitrainer.model.multimodal import multimodal_preflight
from minitrainer.model.paths import model_path_error
from minitrainer.model.recurrent import recurrent_mixers
from minitrainer.model.score_head import SequenceScorer
from minitrainer.objectives.base import RunContext, TrainingObjective
from minitrainer.optim.base import OptimizerSetting
from minitrainer.optim.diagnostics import Diagnostics, build_diagnostics
from minitrainer.setup.selfcheck import audit_refusal, check_data_fits_model, check_loss_terms, check_scores
from minitrainer.setup.model import ModelSetup, meta_model, setup_model, shard_group_size
from minitrainer.report.trackers import NullTracker, Tracker, make_tracker
from minitrainer.train_config import SCHEDULERS_WITHOUT_TOTAL, TrainConfig

if TYPE_CHECKING:
    from transformers import GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

PATIENT_WAIT_DAYS = 7
"""How long the other ranks wait for rank 0 to tokenize raw data (a 100M-row dataset on one node: hours)."""

TrainingRows = sampler.TokenizedDataset | data_mix.MixedDataset | held_out.RowSubset
"""What the sampler draws from: a tokenized file, a data mix, or the rows a validation split left."""


@dataclass
class Run:
    """The parts of one training run that the loop, the step, saving and validation share."""

    config: TrainConfig
    dist_info: DistInfo
    dataset: TrainingRows
    total_steps: int | None        # None: infinite sampling
    max_tokens_per_gpu: int        # resolved --max-tokens-per-gpu (auto: measured)
    model: CausalLMWithLoss        # FSDP-sharded
    method: FineTuningMethod       # full fine-tuning, LoRA, QLoRA or OSFT (TrainConfig.fine_tuning_method)
    objective: TrainingObjective   # SFT or DPO (TrainConfig.training_objective)
    resolved: ModelSetup           # what setup_model decided: attention backend, dtype, mesh, ...
    model_shape: flops.ModelFlops | None  # None where the config does not describe it
    peak_tflops: float | None      # the MFU denominator
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    state: TrainState              # counters, restored on resume
    run_params: dict               # what a resume compares (resume_policy.py)
    model_fingerprint: dict
    tokenizer: PreTrainedTokenizerBase | None   # rank 0 only: saved with every export
    generation_config: GenerationConfig | None  # rank 0 only
    metrics: MetricsWriter | None  # rank 0 only
    tracker: Tracker
    context: context_parallel.ContextGroup  # this rank's context-parallel group (size 1 without it)
    val_dataset: TrainingRows | None = None
    val_plan: held_out.ValidationPlan | None = None
    diagnostics: Diagnostics | None = None  # --optimizer-diagnostics (None: off)

    @property
    def max_tokens_per_rank(self) -> int:
        """The packer's budget of one of its ranks: a data-parallel rank, which under context parallelism
        is a group of GPUs (``ContextGroup.tokens_per_data_rank``). The one place the budget's name changes."""
        return self.context.tokens_per_data_rank(self.max_tokens_per_gpu)


def setup_run(config: TrainConfig, dist_info: DistInfo) -> Run:
    """Checks, data, model, optimizer, schedule, resume and trackers, in the order that fails fastest."""
    from transformers import AutoTokenizer

    seed_everything(config.seed)
    method = config.fine_tuning_method()
    objective = config.training_objective()
    fail_together((_preflight(config) or objective.preflight()) if dist_info.is_main else None)
    if dist_info.is_main:  # the folder is this run's now: the status of the run before it is gone
        write_run_status(config.output_dir, None)
    model_config = _load_model_config(config)
    fail_together(objective.head_error(model_config, config.model_name_or_path) if dist_info.is_main else None)
    model_config = objective.head_config(model_config)
    fail_together(_model_preflight(config, model_config, method) if dist_info.is_main else None)
    if dist_info.is_main:
        for leftover in remove_leftover_tmp(config.output_dir):
            logger.warning("removed %s, left behind by a save that was interrupted", leftover)
    dataset = objective.training_rows(_load_dataset_rank0_first(config, dist_info))
    fail_together(objective.data_error(dataset, config.data_path) if dist_info.is_main else None)
    fail_together(_check_data_fits_model(config, model_config, dataset) if dist_info.is_main else None)
    dataset, val_dataset, val_source = _validation_set(config, dataset, dist_info, objective)
    if val_dataset is not None:
        fail_together(objective.data_error(val_dataset, val_source) if dist_info.is_main else None)
    total_steps = schedule.total_steps(config, len(dataset))
    schedule.check_scheduler(config, total_steps, is_main=dist_info.is_main)
    run_params = resume_policy.run_params(config, total_steps, objective=objective,
                                          schedule_has_total=config.lr_scheduler not in SCHEDULERS_WITHOUT_TOTAL)
    weights_digest = _weights_digest(config, model_config, dist_info)
    model_fingerprint = resume_policy.fingerprint(
        model_config, dataset, method, data_digest=_data_digest(dataset, dist_info),
        model_source=str(config.model_name_or_path), weights_digest=weights_digest)
    fail_together(_resume_policy(config, run_params, model_fingerprint) if dist_info.is_main else None)
    candidates = resume_candidates(config.output_dir, resume=config.resume, resume_from=config.resume_from)
    tracker, tracker_error = _start_tracker(config, dist_info, candidates)
    fail_together(tracker_error)

    model, resolved = _setup_model(config, model_config, dist_info, method, config.model_name_or_path)
    fail_together(objective.model_error(model))
    # Collective: every rank makes every group. The sampler then sees each group as one data rank.
    context = context_parallel.new_context_group(config.context_parallel_size, dist_info)
    if context.size > 1 and _local_world_size() % context.size:
        log_rank_0(f"--context-parallel-size {context.size} does not divide the {_local_world_size()} processes per "
                   "node: some groups span nodes, and their K/V all-gather of every layer crosses the network",
                   level=logging.WARNING)
    model_shape, flops_reason = flops.checked_model_flops(model.model, method=method)
    log_rank_0(flops_reason, level=logging.INFO if model_shape else logging.WARNING)
    peak_tflops, peak_reason = flops.device_peak_tflops(dist_info.device)
    log_rank_0("MFU denominator: %s", peak_reason)
    if not config.skip_objective_check:
        check = check_scores if isinstance(model, SequenceScorer) else check_loss_terms
        check(model, _sequences(dataset), attn_implementation=resolved.attn_implementation,
              compute_dtype=resolved.param_dtype, device=dist_info.device)
    max_tokens_per_gpu = config.max_tokens_per_gpu
    if max_tokens_per_gpu == "auto":
        max_tokens_per_gpu = probe_token_budget(
            model, _sequences(dataset), dist_info=dist_info,
            state_bytes_per_param=config.optimizer_choice().planned_state_bytes(model.model),
            model_inputs=lambda mb: model_inputs(mb, resolved.attn_implementation, dist_info.device))
    elif config.activation_checkpointing == "auto" and resolved.recomputation != "none":
        resolved = dataclasses.replace(resolved, recomputation=probe_recomputation(
            model, _sequences(dataset), dist_info=dist_info, num_tokens=max_tokens_per_gpu,
            state_bytes_per_param=config.optimizer_choice().planned_state_bytes(model.model),
            model_inputs=lambda mb: model_inputs(mb, resolved.attn_implementation, dist_info.device)))
    val_plan = None
    if val_dataset is not None:
        val_plan = held_out.plan_validation(val_dataset.lengths, val_dataset.num_loss_counted_tokens,
                                              max_tokens_per_rank=context.tokens_per_data_rank(max_tokens_per_gpu),
                                              num_ranks=context.num_data_ranks,
                                              group_size=config.batch_size, balance=config.balance)
        held_out.announce(val_plan, val_source, objective.unit)
    # Before the resume loads a checkpoint: the model is still the one the run started from (the reference).
    max_tokens_per_rank = context.tokens_per_data_rank(max_tokens_per_gpu)
    with stopping_phase(objective.preparing):
        fault_injection.sleep_before_preparing()
        objective.prepare(model, RunContext(
            dist_info=dist_info, dataset=dataset, val_dataset=val_dataset, val_plan=val_plan,
            batches=functools.partial(batch_stream, config, dist_info, context, dataset,
                                      max_tokens_per_rank=max_tokens_per_rank, num_workers=0),
            batch_size=config.batch_size,
            packing={"batch_size": config.batch_size, "max_tokens_per_rank": max_tokens_per_rank,
                     "ranks": context.num_data_ranks, "balance": config.balance, "seed": config.seed},
            attn=resolved.attn_implementation, param_dtype=resolved.param_dtype, weights_digest=weights_digest,
            method_fingerprint=method.fingerprint(), output_dir=config.output_dir,
            models=_OtherModels(config, dist_info)))
    tokenizer = (AutoTokenizer.from_pretrained(config.model_name_or_path, trust_remote_code=config.trust_remote_code)
                 if dist_info.is_main else None)
    generation_config = _original_generation_config(config.model_name_or_path) if dist_info.is_main else None
    optimizer = _build_optimizer(config, method, model)
    diagnostics = build_diagnostics(model.model, enabled=config.optimizer_diagnostics, device=dist_info.device)
    scheduler = schedule.build_scheduler(config, optimizer, total_steps)
    began = time.perf_counter()
    state = resume_train_state(model, optimizer, scheduler, candidates=candidates, resume=config.resume,
                               model_fingerprint=model_fingerprint, dist_info=dist_info)
    fault_injection.install(model, optimizer, state, dist_info.rank)
    if state.step:
        log_rank_0("resume took %.2fs", time.perf_counter() - began)
        if config.allow_config_change:
            resume_policy.apply_new_hyperparameters(optimizer, scheduler, config)
    _announce(config, dist_info, resolved, method, len(dataset), max_tokens_per_gpu, objective.unit)
    if isinstance(dataset, data_mix.MixedDataset):
        log_rank_0(dataset.describe())
    if dist_info.is_main:
        _announce_disk_plan(config, model, total_steps, export_dtype=resolved.export_dtype)
    metrics_path = Path(config.output_dir) / f"training_metrics_{dist_info.rank}.jsonl"
    if dist_info.is_main:
        _write_training_params(config, dist_info, resolved, max_tokens_per_gpu)
        truncate_metrics(metrics_path, state.step)
    metrics = MetricsWriter(metrics_path) if dist_info.is_main else None
    state.wandb_run_id = tracker.wandb_run_id or state.wandb_run_id
    state.mlflow_run_id = tracker.mlflow_run_id or state.mlflow_run_id
    return Run(config=config, dist_info=dist_info, dataset=dataset, total_steps=total_steps,
               max_tokens_per_gpu=max_tokens_per_gpu, model=model, method=method, objective=objective,
               resolved=resolved, model_shape=model_shape, peak_tflops=peak_tflops,
               optimizer=optimizer, scheduler=scheduler, state=state, run_params=run_params,
               model_fingerprint=model_fingerprint, tokenizer=tokenizer, generation_config=generation_config,
               metrics=metrics, tracker=tracker, context=context, val_dataset=val_dataset, val_plan=val_plan,
               diagnostics=diagnostics)


def batch_loader(run: Run) -> contextlib.AbstractContextManager[Iterator[StepBatch]]:
    """The infinite, seeded stream of packed batches, from where the run stands; its workers are shut
    down when the ``with`` block ends, however it ends (``sampler.BatchLoader``)."""
    return batch_stream(run.config, run.dist_info, run.context, run.dataset, max_tokens_per_rank=run.max_tokens_per_rank,
                        start_position=run.state.samples_seen)


@contextlib.contextmanager
def batch_stream(config: TrainConfig, dist_info: DistInfo, context: context_parallel.ContextGroup, dataset,
                 *, max_tokens_per_rank: int, start_position: int = 0,
                 num_workers: int | None = None) -> Iterator[Iterator[StepBatch]]:
    """The run's batch stream from ``start_position``: what the steps train on, and what an objective's pass
    before step 1 walks (``RunContext.batches``), so both see the same packed rows on the same ranks.

    With context parallelism the sampler plans for the groups (one data rank
    each, N x the per-GPU budget), every rank of a group collates the same
    rows, and each keeps its own shard of every row.
    """
    with sampler.make_batch_loader(
        dataset, batch_size=config.batch_size, max_tokens_per_rank=max_tokens_per_rank,
        rank=context.data_rank, world_size=context.num_data_ranks, seed=config.seed,
        start_position=start_position, balance=config.balance,
        num_workers=config.num_data_workers if num_workers is None else num_workers,
        pin_memory=dist_info.device.type == "cuda",  # lets the non_blocking host-to-GPU copies overlap
    ) as loader:
        yield (context_parallel.shard_step_batch(batch, context, device=dist_info.device) for batch in loader)


class _OtherModels:
    """``RunContext.models``: another model than the run's, read and set up with the run's settings."""

    def __init__(self, config: TrainConfig, dist_info: DistInfo) -> None:
        self.config, self.dist_info = config, dist_info

    def weights_digest(self, path: str, *, flag: str) -> str:
        return _weights_digest(self.config, _load_model_config(self.config, path, flag=flag), self.dist_info, path)

    def load(self, path: str, *, flag: str) -> torch.nn.Module:
        model_config = _load_model_config(self.config, path, flag=flag)
        found = sequence_classification_class(model_config)
        fail_together(f"{flag} {path} is a sequence-classification checkpoint ({found}): it has no LM head to give "
                      "log-probabilities; name the causal LM" if found and self.dist_info.is_main else None)
        return _setup_model(self.config, model_config, self.dist_info, FineTuningMethod(), path)[0]


def close_run(run: Run) -> None:
    if run.metrics is not None:
        run.metrics.close()
    run.tracker.close()


# ----------------------------------------------------------------------------
# Helpers of setup_run, in the order it uses them.


def _preflight(config: TrainConfig) -> str | None:
    """Cheap checks of paths, packages and the output folder on rank 0; returns one error line or None."""
    try:
        paths = data_mix.data_paths(config.data_path)
    except ValueError as err:
        return str(err)
    for path in paths:
        if not Path(path).exists():
            return f"--data-path {path}: no such file or folder"
    if len(paths) > 1 and config.validation_split is not None:
        return "--validation-split takes rows of one dataset: with a data mix, give --validation-data-path"
    if config.validation_data_path and not Path(config.validation_data_path).exists():
        return f"--validation-data-path {config.validation_data_path}: no such file or folder"
    # Only a GPU runs Liger (elsewhere the flag warns and changes nothing); missing there, every rank would
    # stop in a traceback while building the model.
    if config.use_liger_kernels and device_type() == "cuda" and importlib.util.find_spec("liger_kernel") is None:
        return "--use-liger-kernels needs liger-kernel, which is not installed here: pip install -r requirements-cuda.txt"
    output = Path(config.output_dir)
    try:
        output.mkdir(parents=True, exist_ok=True)
        probe = output / ".write_probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        return f"--output-dir {config.output_dir}: not writable ({err.strerror or err})"
    return output_lock.acquire(output)  # last: a refusal above leaves no lock behind


def _load_model_config(config: TrainConfig, path: str | None = None, *,
                       flag: str = "--model-name-or-path") -> PretrainedConfig:
    """The config of the model at ``path`` (default: the run's; ``flag``: what a refusal names), read once per
    rank at start-up (honouring --trust-remote-code) and handed to everything that needs it; a config that does
    not load stops every rank with one line."""
    from transformers import AutoConfig

    path = path or config.model_name_or_path
    model_config, error = None, model_path_error(path, flag=flag)
    # An unreachable hub is retried 5 times with a warning each, on every rank: they would bury the one line
    # below. Only for this small first file; the weights' downloads keep their retry warnings.
    hub_http = logging.getLogger("huggingface_hub.utils._http")
    hub_http_level = hub_http.level
    hub_http.setLevel(logging.ERROR)
    try:
        if error is None:
            model_config = AutoConfig.from_pretrained(path, trust_remote_code=config.trust_remote_code)
    except (OSError, ValueError) as err:  # a hub id not reachable, not found or not a model; a broken config
        reason = " ".join(str(err).split())  # transformers' messages span lines: one line here
        error = f"{flag} {path}: cannot load a model config ({reason})"
    finally:
        hub_http.setLevel(hub_http_level)
    fail_together(error)
    return model_config


def _model_preflight(config: TrainConfig, model_config: PretrainedConfig, method: FineTuningMethod) -> str | None:
    """Rank 0, before heavy work: a multimodal checkpoint whose language model cannot be trained alone (or
    exported alone, with --export-text-only), an explicit attention backend, context parallelism or a
    fine-tuning method this model refuses."""
    error = multimodal_preflight(
        model_config, trust_remote_code=config.trust_remote_code, export_text_only=config.export_text_only)
    if error is not None:
        return error
    # One meta model (no memory) for every check that reads the architecture, built only if one does.
    meta = functools.cache(lambda: meta_model(model_config, config.trust_remote_code))
    needs = (attention_needs(meta()) if config.context_parallel_size > 1 or config.attn_implementation != "auto"
             else None)
    if config.context_parallel_size > 1:
        error = context_parallel.refusal(
            config.context_parallel_size, world_size=dist.get_world_size(), needs=needs,
            num_recurrent_mixers=len(recurrent_mixers(find_decoder_blocks(meta()))),
            router_loss=bool(getattr(model_config, "output_router_logits", False)))
        if error is not None:
            return error
    if config.attn_implementation != "auto":
        error = explicit_attention_refusal(config.attn_implementation, needs)
        if error is not None:
            return error
    shard_size = shard_group_size(config.fsdp_sharding_strategy, dist.get_world_size(), _local_world_size())
    return method.preflight(model_config, meta_model=meta, shard_size=shard_size)


def _local_world_size() -> int:
    """Processes per node (HYBRID_SHARD's shard group), as torchrun says."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))


def _validation_set(config: TrainConfig, dataset, dist_info: DistInfo, objective: TrainingObjective):
    """``(training dataset, validation dataset, where it came from)``; the first is unchanged without validation.
    A split of the training units keeps the pairing the objective made of their rows; a held-out file has its own."""
    if not config.has_validation:
        return dataset, None, None
    if config.validation_split is not None:
        train_rows, val_rows = held_out.split_rows(len(dataset), config.validation_split, config.seed)
        dataset, val_dataset = held_out.RowSubset(dataset, train_rows), held_out.RowSubset(dataset, val_rows)
        source = f"{config.validation_split:g} of {config.data_path} (seed {config.seed})"
    else:
        val_dataset = objective.training_rows(_load_dataset_rank0_first(
            config, dist_info, path=config.validation_data_path, held_out=True))
        source = config.validation_data_path
    return dataset, val_dataset, source


def _resume_policy(config: TrainConfig, run_params: dict, model_fingerprint: dict) -> str | None:
    """Rank 0, before the model loads: move an old run aside (--no-resume) or compare model, data and
    run parameters with the checkpoint a resume would load."""
    if not config.resume:
        moved = resume_policy.move_aside(config.output_dir)
        if moved is not None:
            logger.warning("--no-resume: moved the earlier run's checkpoints and metrics in %s to %s",
                           config.output_dir, moved)
        return None
    candidates = resume_candidates(config.output_dir, resume=True, resume_from=config.resume_from)
    error, notice = resume_policy.check_resume(candidates, run_params, allow_change=config.allow_config_change,
                                               fingerprint=model_fingerprint if candidates else None)
    if notice:
        logger.warning(notice)
    return error


def _start_tracker(config: TrainConfig, dist_info: DistInfo, candidates: list[Path]) -> tuple[Tracker, str | None]:
    """Rank 0 starts the trackers before the model loads (continuing a resumed run's wandb and MLflow runs);
    returns ``(tracker, None)``: each tracker that cannot start (its package missing, no credentials)
    is one warning (``make_tracker``) and the run goes on without it."""
    if not dist_info.is_main:
        return NullTracker(), None
    found = resume_policy.newest_trainer_state(candidates)  # one small JSON, read only where a run resumes
    state = found[1] if found else {}
    return make_tracker(config, rank=dist_info.rank, wandb_run_id=state.get("wandb_run_id"),
                        mlflow_run_id=state.get("mlflow_run_id")), None


def _announce_disk_plan(config: TrainConfig, model: torch.nn.Module, total_steps: int | None, *,
                        export_dtype: torch.dtype) -> None:
    params = list(model.parameters())
    plan = checkpoint_policy.plan_disk(
        num_params=sum(p.numel() for p in params), param_bytes=params[0].element_size(),
        export_bytes_per_param=export_dtype.itemsize,
        total_samples=total_steps * config.batch_size if total_steps else None,
        export_every=config.export_every, keep_exports=config.keep_last_n_checkpoints,
        full_state_every=config.min_samples_per_full_state or config.export_every,
        keep_full_states=checkpoint_policy.full_states_kept(config.keep_last_n_full_states,
                                                            config.keep_last_n_checkpoints),
        full_state=config.full_state)
    info, warning = checkpoint_policy.disk_report(plan, shutil.disk_usage(config.output_dir).free, config.output_dir)
    log_rank_0(info)
    if warning:
        logger.warning(warning)


def _load_dataset_rank0_first(config: TrainConfig, dist_info: DistInfo, *, path: str | None = None,
                              held_out: bool = False):
    """Rank 0 loads first: it tokenizes raw sources once (``data/cache.py``), gates every source (a
    failed label audit) and converts each to arrow; the others then open what it made. Errors exit every rank.

    Tokenizing takes as long as the data needs, hours for a large one, so the other ranks learn rank 0's
    verdict through ``_patient_broadcast``, not a collective under the process group's timeout.
    """
    path = path or config.data_path
    dataset, error, tokenized = None, None, {}
    if dist_info.is_main:
        def load(source: str):
            tokenized[source] = str(_tokenized_source(config, source, held_out=held_out))
            loaded = load_arrow(tokenized[source])
            refusal = audit_refusal(loaded, source, allowed_now=config.allow_audit_failures
                                    and tokenized[source] != source)
            if refusal:
                raise ValueError(refusal)
            return loaded

        try:
            load_arrow, note = _tokenized_loader(config)
            if note:
                logger.warning(note)
            dataset = data_mix.load_data(path, load)
            error = _budget_error(config, dataset, path)
        # ImportError: a library tokenizing needs, missing or below its floor (jinja2 < 3.1.6 renders no template).
        except (ValueError, ImportError) as err:
            error = str(err)
        except OSError as err:  # a full or failing disk under the cache: one line on every rank, not gloo's
            error = f"loading {path} failed: {err}"
    error, tokenized = _patient_broadcast((error, tokenized))
    fail_together(error if dist_info.is_main else None)
    if not dist_info.is_main:
        load_arrow = _tokenized_loader(config)[0]
        dataset = data_mix.load_data(path, lambda source: load_arrow(tokenized[source]))
    return dataset


def _tokenized_loader(config: TrainConfig):
    """``load_tokenized_dataset`` with its arrow cache where this rank can write, and the note saying so."""
    cache_dir, note = sampler.datasets_cache_dir(Path(config.output_dir) / ".cache" / "datasets")
    return functools.partial(sampler.load_tokenized_dataset, cache_dir=cache_dir), note


def _tokenized_source(config: TrainConfig, source: str, *, held_out: bool) -> Path | str:
    """``source`` itself when it is tokenized, else its cache folder, tokenized now if new (rank 0); a
    ``held_out`` (validation) source is read as its held-out split (``data.cache.validation_split``)."""
    if data_cache.is_tokenized(source):
        return source
    cache_root = (Path(config.tokenized_data_dir) if config.tokenized_data_dir is not None
                  else Path(config.output_dir) / data_cache.CACHE_FOLDER)
    split = data_cache.validation_split(config, source) if held_out else config.data_split
    with stopping_phase(f"while tokenizing {source}"):
        return data_cache.tokenize_once(config.tokenizing_config(source, output_dir=str(cache_root), split=split))


def _patient_broadcast(value):
    """Rank 0's ``value`` on every rank, however long rank 0 took to get there.

    A gloo group of its own with a timeout of days: the default group's timeout (30 minutes, the
    longest a rank waits for a dead peer) would end a long tokenization. A rank 0 that dies meanwhile
    does not leave the others waiting: torchrun stops the job when one of its processes exits.
    """
    if dist.get_world_size() == 1:
        return value
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=PATIENT_WAIT_DAYS))
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    dist.destroy_process_group(group)
    return box[0]


def _budget_error(config: TrainConfig, dataset, path: str) -> str | None:
    """A budget below every sample; with context parallelism, any sample longer than a group's budget."""
    budget, size = config.max_tokens_per_gpu, config.context_parallel_size
    if budget == "auto" or not len(dataset):
        return None
    if int(dataset.lengths.min()) > budget * size:
        return (f"--max-tokens-per-gpu {budget} is below every sample of {path} "
                f"(shortest: {int(dataset.lengths.min())} tokens)")
    longest = int(np.argmax(dataset.lengths))
    length = int(dataset.lengths[longest])
    if size > 1 and length > budget * size:
        # Without context parallelism such samples are dropped and counted; a user who asked for long
        # context wants every sample trained, so the run refuses rather than drop the longest ones.
        return (f"--context-parallel-size {size} x --max-tokens-per-gpu {budget} holds {budget * size} tokens "
                f"per sample, but row {longest} of {path} has {length}: it needs --context-parallel-size "
                f"{-(-length // budget)} or --max-tokens-per-gpu {-(-length // size)}")
    return None


def _data_digest(dataset, dist_info: DistInfo) -> str:
    """Rank 0 hashes the data's content (every token id and label) and tells the others: one pass, not one per rank."""
    began = time.perf_counter()
    digest = [dataset.content_digest() if dist_info.is_main else None]
    dist.broadcast_object_list(digest, src=0)
    log_rank_0("data content hash %s (%.2fs)", digest[0], time.perf_counter() - began)
    return digest[0]


def _weights_digest(config: TrainConfig, model_config: PretrainedConfig, dist_info: DistInfo,
                    path: str | None = None) -> str:
    """Rank 0 reads the identity of the model at ``path`` (default: the run's; ``resume_policy.weights_digest``)
    and tells the others."""
    began = time.perf_counter()
    digest = [resume_policy.weights_digest(path or config.model_name_or_path,
                                           commit_hash=getattr(model_config, "_commit_hash", None))
              if dist_info.is_main else None]
    dist.broadcast_object_list(digest, src=0)
    log_rank_0("model weights digest %s (%.2fs)", digest[0], time.perf_counter() - began)
    return digest[0]


def _check_data_fits_model(config: TrainConfig, model_config: PretrainedConfig, dataset) -> str | None:
    """Every source of the data against the model's vocabulary and tokenizer (selfcheck.py)."""
    parts = ([(source.path, part) for source, part in zip(dataset.sources, dataset.datasets)]
             if isinstance(dataset, data_mix.MixedDataset) else [(config.data_path, _sequences(dataset))])
    for path, part in parts:
        error = check_data_fits_model(part, path, config.model_name_or_path, model_config,
                                      trust_remote_code=config.trust_remote_code,
                                      allow_tokenizer_mismatch=config.allow_tokenizer_mismatch)
        if error:
            return error
    return None


def _sequences(dataset):
    """The dataset as single sequences, for the checks and probes made for SFT rows: a preference pair's
    two sides are two sequences (``PreferenceDataset.sides``)."""
    return dataset.sides() if is_pairs(dataset) else dataset


def _build_optimizer(config: TrainConfig, method: FineTuningMethod, model) -> torch.optim.Optimizer:
    """The chosen optimizer over the method's parameter groups; its one-line account of the split, if any."""
    choice = config.optimizer_choice()
    setting = OptimizerSetting(lr=config.learning_rate, betas=config.adam_betas, eps=config.adam_eps,
                               device=next(model.parameters()).device,  # the host with --cpu-offload
                               model=model.model)
    optimizer = choice.build(method.param_groups(model, weight_decay=config.weight_decay), setting)
    if not choice.uses_adam_flags and (tuple(config.adam_betas) != (0.9, 0.95) or config.adam_eps != 1e-8):
        log_rank_0(f"--adam-betas/--adam-eps do not reach --optimizer {choice.name}: its own settings are "
                   "--optimizer-args", level=logging.WARNING)
    line = choice.describe(optimizer)
    if line:
        log_rank_0(line)
    return optimizer


def _setup_model(config: TrainConfig, model_config: PretrainedConfig, dist_info: DistInfo,
                 method: FineTuningMethod, path: str):
    """``setup_model`` of the model at ``path`` with the run's settings: the trained model, or a reference."""
    return setup_model(
        model_name_or_path=path, model_config=model_config, dist_info=dist_info,
        attn_implementation=config.attn_implementation, sharding_strategy=config.fsdp_sharding_strategy,
        cpu_offload=config.cpu_offload, activation_checkpointing=config.activation_checkpointing,
        use_liger_kernels=config.use_liger_kernels, head_learned_positions_only=config.head_learned_positions_only,
        compile=config.compile, local_world_size=_local_world_size(),
        trust_remote_code=config.trust_remote_code, method=method,
        context_parallel_size=config.context_parallel_size,
        export_text_only=config.export_text_only, save_dtype=config.save_dtype,
    )


def _original_generation_config(model_name_or_path: str):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_name_or_path)
    except OSError:
        return None


def _announce(config: TrainConfig, dist_info: DistInfo, resolved, method: FineTuningMethod, num_dataset_samples: int,
              max_tokens_per_gpu: int, unit: str = "samples") -> None:
    """Print each resolved decision once, with its reason (``unit``: what the data holds, samples or pairs)."""
    log_rank_0("world size %d on %s (%s backend)", dist_info.world_size, dist_info.device.type,
               dist.get_backend())
    log_rank_0("model %s: %d x %s sharded with %s, mesh %s, compute dtype %s, attention %s, "
               "activation checkpointing %s; exports in %s%s", config.model_name_or_path, resolved.num_blocks,
               resolved.block_class, config.fsdp_sharding_strategy, resolved.mesh_shape,
               str(resolved.param_dtype).removeprefix("torch."), resolved.attn_implementation,
               resolved.recomputation + (" (auto)" if config.activation_checkpointing == "auto" else ""),
               str(resolved.export_dtype).removeprefix("torch."),
               " (--save-dtype auto: the checkpoint's own)" if config.save_dtype == "auto" else "")
    log_rank_0("trainable parameters: %s of %s (%.2f%%)%s", f"{resolved.num_trainable_params:,}",
               f"{resolved.num_params:,}", 100.0 * resolved.num_trainable_params / max(resolved.num_params, 1),
               method.describe())
    log_rank_0("data %s: %d %s; %d %s per step; at most %d tokens per rank per minibatch "
               "(gradient accumulation follows from packing)", config.data_path, num_dataset_samples, unit,
               config.batch_size, unit, max_tokens_per_gpu)
    if config.context_parallel_size > 1:
        size = config.context_parallel_size
        log_rank_0("context parallelism: %d groups of %d consecutive ranks, each one data rank packing rows of up "
                   "to %d tokens (%d x %d) and splitting each row over its ranks; FSDP still shards over all %d "
                   "ranks", dist_info.world_size // size, size, size * max_tokens_per_gpu, size, max_tokens_per_gpu,
                   dist_info.world_size)
    log_rank_0("schedule %s, warmup %d, %s", config.lr_scheduler, config.num_warmup_steps,
               schedule.stop_plan(config, num_dataset_samples))


def _write_training_params(config: TrainConfig, dist_info: DistInfo, resolved, max_tokens_per_gpu: int) -> None:
    import transformers

    params = dataclasses.asdict(config)
    params.update(world_size=dist_info.world_size, device=dist_info.device.type,
                  attn_implementation_resolved=resolved.attn_implementation,
                  context_parallel_inner=resolved.context_parallel_inner,
                  max_tokens_per_gpu_resolved=max_tokens_per_gpu, activation_checkpointing_resolved=resolved.recomputation,
                  torch_version=torch.__version__, transformers_version=transformers.__version__)
    path = Path(config.output_dir) / "training_params.json"
    try:  # default=str: a Path or other non-JSON value given through the Python API is written as its text
        path.write_text(json.dumps(params, indent=2, sort_keys=True, default=str))
    except OSError as err:  # a record for people; resume does not read it
        logger.warning("%s not written (%s); the run goes on", path, err.strerror or err)
