"""Fine-tune a Hugging Face causal LM with FSDP2 on padding-free packed minibatches.

Single node (8 GPUs):

    torchrun --nnodes=1 --nproc-per-node=8 train.py \\
        --output-dir ./output --data-path ./data/chat_tkns \\
        --model-name-or-path Qwen/Qwen2.5-1.5B-Instruct \\
        --min-samples-per-checkpoint 2000 --num-warmup-steps 20 \\
        --max-tokens-per-gpu 128000 --batch-size 128 --use-liger-kernels \\
        --seed 8888 --learning-rate 6e-6

CPU (two gloo processes, the tiny model ``python tiny_model.py`` builds):

    torchrun --nproc-per-node=2 train.py --output-dir /tmp/out --data-path /tmp/data \\
        --model-name-or-path /tmp/tiny --min-samples-per-checkpoint 64 \\
        --batch-size 16 --max-tokens-per-gpu 512 --max-steps 4

Each optimizer step takes ``--batch-size`` samples from an infinite seeded
stream, packs them into minibatches of at most ``--max-tokens-per-gpu`` tokens
per rank (gradient accumulation follows), and optimises the exact per-token
mean cross-entropy over the whole batch. Python API: ``train(TrainConfig(...))``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from tqdm import tqdm

import checkpoint_policy
import data_mix
import flops
import resume_policy
import sampler
import validation
from attention import attention_inputs
from autotune import probe_token_budget
from batch_metrics import MetricsWriter, StepCounts, step_record
from checkpoint import save_hf_checkpoint
from full_state import PreemptionFlag, TrainState, remove_leftover_tmp, resume_train_state, save_full_state
from lora import ALL_LINEAR, LoraSettings, lora_preflight
from objective import router_aux_weight
from selfcheck import check_data_fits_model, check_objective
from setup_model_fsdp import attention_preflight, setup_model, shard_group_size, sync_gradients_on
from trackers import make_tracker

from utils import (
    DistInfo,
    cleanup,
    collect_errors,
    config_field,
    device_peak_tflops,
    init_distributed,
    log_rank_0,
    logger,
    parse_config,
    peak_memory_gb,
    reset_peak_memory,
    seed_everything,
    setup_logging,
    synchronize,
)

SCHEDULERS_WITHOUT_TOTAL = ("constant", "constant_with_warmup", "inverse_sqrt")
SCHEDULERS_WITH_MIN_LR = ("cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay")
SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _token_budget(text: str) -> int | str:
    """CLI parser of --max-tokens-per-gpu: a positive integer or 'auto'."""
    return "auto" if str(text).lower() == "auto" else int(text)


@dataclass
class TrainConfig:
    """Every parameter of a training run; the CLI is generated from these fields."""

    output_dir: str = config_field(help="folder for metrics, training_params.json and checkpoints")
    min_samples_per_checkpoint: int = config_field(
        help="samples between Hugging Face checkpoints (hf_format/samples_N); one is always written at the end")
    model_name_or_path: str = config_field("Qwen/Qwen2.5-1.5B-Instruct",
                                           help="Hugging Face model id or local folder")
    data_path: str = config_field("test.jsonl", help="tokenized jsonl file or process_data.py output folder; or a "
                                                     "weighted mix `a:0.7,b:0.3`, or a .yaml/.json mix file "
                                                     "(see \"Data mixing\")")
    batch_size: int = config_field(1024, help="samples per optimizer step, whole job")
    max_tokens_per_gpu: int | Literal["auto"] = config_field(
        10000, parse=_token_budget,
        help="token budget of one packed minibatch on one rank; 'auto' probes the largest that fits "
             "on this GPU (with a 10%% safety margin)")
    learning_rate: float = config_field(5e-6, help="peak learning rate")
    num_warmup_steps: int = config_field(10, help="linear warmup steps from 0")
    lr_scheduler: str = config_field("constant_with_warmup", choices=SCHEDULERS,
                                     help="transformers.get_scheduler name; decaying schedules need a stop condition")
    min_lr_ratio: float = config_field(
        0.1, help="LR floor as a fraction of --learning-rate for cosine_with_min_lr, cosine_warmup_with_min_lr "
                  "and warmup_stable_decay (ignored by the other schedulers)")
    decay_fraction: float = config_field(
        0.1, help="warmup_stable_decay: fraction of the run's steps spent decaying (after warmup and a "
                  "constant phase)")
    seed: int = config_field(42, help="seeds Python, NumPy, torch and the data order on every rank")
    use_liger_kernels: bool = config_field(
        False, help="Liger fused linear cross-entropy plus RMSNorm/RoPE/SwiGLU kernels (CUDA; ignored with a "
                    "warning on CPU)")
    head_learned_positions_only: bool = config_field(
        True, help="run the LM head and cross-entropy only on positions with a label (same loss and gradients, "
                   "less work on prompt-heavy data); --no-head-learned-positions-only runs them on every position, "
                   "for A/B timing (make gpu-check)")
    compile: bool = config_field(
        False, help="torch.compile each decoder block (inductor, dynamic sequence length; after activation "
                    "checkpointing, before FSDP); the first steps pay the compile time")
    logging_level: str = config_field("INFO", help="DEBUG, INFO, WARNING, ERROR or CRITICAL (any case)")
    max_steps: int | None = config_field(None, help="stop after this many optimizer steps")
    max_samples: int | None = config_field(None, help="stop once this many samples were consumed")
    num_epochs: float | None = config_field(None, help="stop after this many passes over the data")
    fsdp_sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"] = config_field(
        "FULL_SHARD", help="FULL_SHARD (ZeRO-3), SHARD_GRAD_OP (ZeRO-2), NO_SHARD (DDP-like), "
                           "HYBRID_SHARD (shard within a node, replicate across nodes)")
    cpu_offload: bool = config_field(False, help="keep sharded params, grads and optimizer state in host memory")
    attn_implementation: str = config_field(
        "auto", help="auto (the fastest backend the architecture accepts: flash_attention_2, torch_varlen, "
                     "sdpa, eager on CUDA; sdpa, eager on CPU), sdpa, eager, flash_attention_2, flash_attention_3, "
                     "torch_varlen, reference_varlen (CPU, slow)")
    trust_remote_code: bool = config_field(
        False, help="run the modelling and tokenizer code a checkpoint ships (only for sources you trust)")
    skip_objective_check: bool = config_field(
        False, help="skip the start-up check that the trainer's loss equals the model's own forward(labels=...)")
    weight_decay: float = config_field(0.0, help="AdamW weight decay")
    adam_betas: tuple[float, float] = config_field((0.9, 0.95), help="AdamW betas")
    max_grad_norm: float = config_field(1.0, help="gradient clipping norm (0 disables clipping)")
    activation_checkpointing: bool = config_field(True, help="recompute each decoder block in backward")
    balance: Literal["tokens", "attention"] = config_field(
        "tokens", help="packing balance cost: token counts, or tokens plus attention's quadratic term")
    num_data_workers: int = config_field(1, help="DataLoader worker processes per rank (0 = in-process)")
    resume: bool = config_field(True, help="continue from the newest complete full-state checkpoint in "
                                           "--output-dir (--no-resume starts fresh)")
    resume_from: str | None = config_field(None, help="resume from this full_state/samples_N folder")
    keep_last_n_checkpoints: int | None = config_field(
        None, help="keep only the newest N Hugging Face exports (default: keep all); also caps the full states "
                   "kept when --keep-last-n-full-states is not given")
    min_samples_per_full_state: int | None = config_field(
        None, help="samples between full training states (default: with every Hugging Face export); one is "
                   "always written at the end and on preemption")
    keep_last_n_full_states: int | None = config_field(
        None, help="keep only the newest N full training states (default 2, or --keep-last-n-checkpoints when "
                   "smaller)")
    full_state: bool = config_field(True, help="write full training states for exact resume (--no-full-state: "
                                               "Hugging Face exports only; the run cannot resume)")
    allow_config_change: bool = config_field(
        False, help="resume even though learning rate, schedule, batch size, seed, data or other training "
                    "parameters changed, applying the new values from the next step")
    validation_data_path: str | None = config_field(
        None, help="tokenized jsonl file or folder of held-out samples for the validation loss")
    validation_split: float | None = config_field(
        None, help="hold out this fraction of --data-path (seeded split, same on every rank and after resume) "
                   "for the validation loss; training never samples those rows")
    validation_every_n_steps: int | None = config_field(
        None, help="compute the validation loss every N optimizer steps (and always at the end)")
    validation_every_n_samples: int | None = config_field(
        None, help="compute the validation loss whenever the sample stream crosses a multiple of N")
    save_best_val_loss: bool = config_field(
        False, help="keep a Hugging Face export of the best validation loss so far in hf_format/best/")
    val_loss_improvement_threshold: float = config_field(
        0.0, help="a validation loss counts as better only when it is this much below the best so far")
    early_stopping_patience: int | None = config_field(
        None, help="stop after this many validations in a row without improvement")
    wandb_project: str | None = config_field(None, help="also log every metrics line to this Weights & Biases "
                                                         "project (pip install wandb)")
    tensorboard_dir: str | None = config_field(None, help="also log every metrics line to TensorBoard in this "
                                                          "folder (pip install tensorboard)")
    max_bad_steps: int = config_field(5, help="abort after this many consecutive steps with a non-finite "
                                              "loss or gradient norm (each one is skipped)")
    lora_rank: int = config_field(0, help="LoRA rank r: train low-rank adapters on a frozen base model "
                                          "(0 = full fine-tuning)")
    lora_alpha: float | None = config_field(None, help="LoRA alpha; adapters are scaled by alpha / r "
                                                        "(default: 2 x --lora-rank)")
    lora_dropout: float = config_field(0.0, help="dropout on the adapters' input")
    lora_target_modules: str = config_field(
        ALL_LINEAR, help="comma-separated module names to adapt (e.g. q_proj,v_proj), or all-linear: every "
                         "nn.Linear layer but the LM head (fused 3-D MoE experts stay frozen)")
    lora_use_rslora: bool = config_field(False, help="rank-stabilised LoRA: scale by alpha / sqrt(r)")
    lora_merge_on_export: bool = config_field(
        True, help="Hugging Face exports hold the merged model (loads with transformers and vLLM as is) plus "
                   "the adapter in adapter/; --no-lora-merge-on-export writes the adapter alone")
    lora_quantize_data_type: Literal["none", "nf4"] = config_field(
        "none", help="QLoRA: nf4 stores the frozen base weights of the adapted linear layers in 4-bit NormalFloat "
                     "(torchao, pip install torchao; docs/lora.md); none keeps them in full precision")

    def __post_init__(self) -> None:
        self.logging_level = self.logging_level.upper()
        errors = []
        if self.max_tokens_per_gpu != "auto" and not (isinstance(self.max_tokens_per_gpu, int)
                                                       and self.max_tokens_per_gpu > 0):
            errors.append(f"--max-tokens-per-gpu must be a positive integer or 'auto', got {self.max_tokens_per_gpu!r}")
        for name in ("min_samples_per_checkpoint", "batch_size"):
            if getattr(self, name) <= 0:
                errors.append(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for name in ("max_steps", "max_samples", "num_epochs"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                errors.append(f"--{name.replace('_', '-')} must be positive, got {value}")
        if self.learning_rate < 0 or self.num_warmup_steps < 0:
            errors.append("--learning-rate and --num-warmup-steps must be non-negative")
        if self.logging_level not in LOG_LEVELS:
            errors.append(f"--logging-level {self.logging_level!r} is not one of {', '.join(LOG_LEVELS)}")
        if self.lr_scheduler not in SCHEDULERS_WITHOUT_TOTAL and not self.has_stop_condition:
            errors.append(f"--lr-scheduler {self.lr_scheduler} decays over a known number of steps: give "
                          "--max-steps, --max-samples or --num-epochs (sampling is infinite otherwise)")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            errors.append(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 < self.decay_fraction <= 1.0:
            errors.append(f"--decay-fraction must be in (0, 1], got {self.decay_fraction}")
        if self.num_data_workers < 0:
            errors.append("--num-data-workers must be >= 0")
        if self.resume_from and not self.resume:
            errors.append("--resume-from and --no-resume contradict each other")
        if self.keep_last_n_checkpoints is not None and self.keep_last_n_checkpoints < 1:
            errors.append("--keep-last-n-checkpoints must be at least 1")
        if self.max_bad_steps < 1:
            errors.append("--max-bad-steps must be at least 1")
        errors += _policy_errors(self)
        if self.lora_rank < 0:
            errors.append(f"--lora-rank must be positive (or 0 for full fine-tuning), got {self.lora_rank}")
        if self.lora_alpha is not None and self.lora_alpha <= 0:
            errors.append(f"--lora-alpha must be positive, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            errors.append(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if self.lora_quantize_data_type != "none" and self.lora_rank == 0:
            errors.append(f"--lora-quantize-data-type {self.lora_quantize_data_type} quantizes the frozen base "
                          "under LoRA adapters: give --lora-rank too")
        if self.compile and self.lora_quantize_data_type != "none":
            # Never run together: NF4 weights are a tensor subclass that dynamo would have to trace.
            errors.append(f"--compile with --lora-quantize-data-type {self.lora_quantize_data_type} is not "
                          "supported yet: drop one of them")
        collect_errors(errors)

    @property
    def lora(self) -> LoraSettings | None:
        if self.lora_rank == 0:
            return None
        alpha = self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank
        return LoraSettings(rank=self.lora_rank, alpha=alpha, dropout=self.lora_dropout,
                            target_modules=self.lora_target_modules, use_rslora=self.lora_use_rslora,
                            merge_on_export=self.lora_merge_on_export,
                            quantize_data_type=self.lora_quantize_data_type)

    @property
    def has_stop_condition(self) -> bool:
        return any(v is not None for v in (self.max_steps, self.max_samples, self.num_epochs))

    @property
    def has_validation(self) -> bool:
        return self.validation_data_path is not None or self.validation_split is not None


def _policy_errors(config: TrainConfig) -> list[str]:
    """Validation, checkpoint-policy and resume flags (issue 14)."""
    errors = []
    for name in ("min_samples_per_full_state", "keep_last_n_full_states", "validation_every_n_steps",
                 "validation_every_n_samples", "early_stopping_patience"):
        value = getattr(config, name)
        if value is not None and value < 1:
            errors.append(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if config.validation_data_path is not None and config.validation_split is not None:
        errors.append("--validation-data-path and --validation-split are alternatives: give one")
    if config.validation_split is not None and not 0 < config.validation_split < 1:
        errors.append(f"--validation-split must be in (0, 1), got {config.validation_split}")
    needs_validation = [flag for flag, on in (("--validation-every-n-steps", config.validation_every_n_steps),
                                              ("--validation-every-n-samples", config.validation_every_n_samples),
                                              ("--save-best-val-loss", config.save_best_val_loss),
                                              ("--early-stopping-patience", config.early_stopping_patience))
                        if on]
    if needs_validation and not config.has_validation:
        errors.append(f"{', '.join(needs_validation)} need --validation-data-path or --validation-split")
    if config.val_loss_improvement_threshold < 0:
        errors.append("--val-loss-improvement-threshold must be >= 0")
    if not config.full_state and (config.min_samples_per_full_state or config.keep_last_n_full_states):
        errors.append("--no-full-state contradicts --min-samples-per-full-state/--keep-last-n-full-states")
    return errors


def train(config: TrainConfig) -> Path | None:
    """Run training as one rank of a torchrun job (or alone). Returns the last HF checkpoint."""
    dist_info = init_distributed(cpu_offload=config.cpu_offload)
    setup_logging(config.logging_level, rank=dist_info.rank)
    try:
        return _train(config, dist_info)
    finally:
        cleanup()


def _train(config: TrainConfig, dist_info: DistInfo) -> Path | None:
    from transformers import AutoTokenizer

    from full_state import fingerprint, truncate_metrics

    seed_everything(config.seed)
    _fail_together(dist_info, _preflight(config) if dist_info.is_main else None)
    if dist_info.is_main:
        for leftover in remove_leftover_tmp(config.output_dir):
            logger.warning("removed %s, left behind by a save that was interrupted", leftover)
    dataset = _load_dataset_rank0_first(config, dist_info)
    _fail_together(dist_info, _check_data_fits_model(config, dataset) if dist_info.is_main else None)
    dataset, val_dataset, val_source = _validation_set(config, dataset, dist_info)
    total_steps = _total_steps(config, len(dataset))
    _check_scheduler(config, total_steps, dist_info)
    run_params = resume_policy.run_params(config, total_steps,
                                          schedule_has_total=config.lr_scheduler not in SCHEDULERS_WITHOUT_TOTAL)
    _fail_together(dist_info, _resume_policy(config, run_params, dataset) if dist_info.is_main else None)
    tracker, tracker_error = _start_tracker(config, dist_info)
    _fail_together(dist_info, tracker_error)

    model, resolved = setup_model(
        model_name_or_path=config.model_name_or_path, dist_info=dist_info,
        attn_implementation=config.attn_implementation, sharding_strategy=config.fsdp_sharding_strategy,
        cpu_offload=config.cpu_offload, activation_checkpointing=config.activation_checkpointing,
        use_liger_kernels=config.use_liger_kernels, head_learned_positions_only=config.head_learned_positions_only,
        compile=config.compile,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", dist_info.world_size)),
        trust_remote_code=config.trust_remote_code, lora=config.lora,
    )
    model_shape, flops_reason = flops.checked_model_flops(model.model)
    log_rank_0(flops_reason)
    peak_tflops, peak_reason = device_peak_tflops(dist_info.device)
    log_rank_0("MFU denominator: %s", peak_reason)
    if not config.skip_objective_check:
        check_objective(model, dataset, attn_implementation=resolved.attn_implementation,
                        compute_dtype=resolved.param_dtype, device=dist_info.device)
    max_tokens = config.max_tokens_per_gpu
    if max_tokens == "auto":
        max_tokens = probe_token_budget(
            model, dataset, dist_info=dist_info,
            model_inputs=lambda mb: _model_inputs(mb, resolved.attn_implementation, dist_info.device))
    val_plan = None
    if val_dataset is not None:
        val_plan = validation.plan_validation(val_dataset.lengths, val_dataset.num_loss_counted_tokens,
                                              max_tokens_per_rank=max_tokens, num_ranks=dist_info.world_size,
                                              group_size=config.batch_size, balance=config.balance)
        validation.announce(val_plan, val_source)
    tokenizer = (AutoTokenizer.from_pretrained(config.model_name_or_path, trust_remote_code=config.trust_remote_code)
                 if dist_info.is_main else None)
    generation_config = _original_generation_config(config.model_name_or_path) if dist_info.is_main else None
    # Only trainable parameters get optimizer state (with LoRA: the adapters alone).
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.learning_rate,
                                  betas=config.adam_betas, weight_decay=config.weight_decay)
    scheduler = _build_scheduler(config, optimizer, total_steps)
    model_fingerprint = fingerprint(model.model.config, dataset, config.lora)
    began = time.perf_counter()
    state = resume_train_state(model, optimizer, scheduler, output_dir=config.output_dir, resume=config.resume,
                               resume_from=config.resume_from, model_fingerprint=model_fingerprint,
                               dist_info=dist_info)
    if state.step:
        log_rank_0("resume took %.2fs", time.perf_counter() - began)
        if config.allow_config_change:
            resume_policy.apply_new_hyperparameters(optimizer, scheduler, config)
    _announce(config, dist_info, resolved, len(dataset), total_steps, max_tokens)
    if isinstance(dataset, data_mix.MixedDataset):
        log_rank_0(dataset.describe())
    if dist_info.is_main:
        _announce_disk_plan(config, model, total_steps)
    metrics_path = Path(config.output_dir) / f"training_metrics_{dist_info.rank}.jsonl"
    if dist_info.is_main:
        _write_training_params(config, dist_info, resolved, max_tokens)
        truncate_metrics(metrics_path, state.step)
    metrics = MetricsWriter(metrics_path) if dist_info.is_main else None
    state.wandb_run_id = tracker.wandb_run_id or state.wandb_run_id

    def save(*, hf_export: bool, full_state: bool = True) -> Path | None:
        """The Hugging Face export and/or the full state (resume needs it), each on its own cadence."""
        exported = None
        if hf_export:
            # Recorded before the full state is written, so a resume keeps the same cadence.
            state.last_checkpoint_samples = state.samples_seen
            began = time.perf_counter()
            exported = save_hf_checkpoint(
                model, output_dir=config.output_dir, num_samples=state.samples_seen, tokenizer=tokenizer,
                generation_config=generation_config, rank=dist_info.rank,
                keep_last_n=config.keep_last_n_checkpoints)
            log_rank_0("saved Hugging Face checkpoint %s in %.2fs (%.1f MB)", exported,
                       time.perf_counter() - began, _folder_mb(exported))
        if full_state and config.full_state:
            began = time.perf_counter()
            saved = save_full_state(
                model, optimizer, scheduler, output_dir=config.output_dir, num_samples=state.samples_seen,
                trainer_state={**dataclasses.asdict(state), "run_params": run_params},
                model_fingerprint=model_fingerprint, dist_info=dist_info,
                keep_last_n=checkpoint_policy.full_states_kept(config.keep_last_n_full_states,
                                                               config.keep_last_n_checkpoints))
            log_rank_0("saved full training state %s in %.2fs (%.1f MB)", saved, time.perf_counter() - began,
                       _folder_mb(saved))
        return exported

    def validate() -> str | None:
        """One validation pass, its metrics line, the best export; returns an early-stopping reason."""
        began = time.perf_counter()
        val_loss, val_tokens = validation.run_validation(
            model, val_dataset, val_plan, rank=dist_info.rank, device=dist_info.device,
            model_inputs=lambda mb: _model_inputs(mb, resolved.attn_implementation, dist_info.device))
        record = validation.validation_record(step=state.step, samples_seen=state.samples_seen, val_loss=val_loss,
                                              num_loss_counted_tokens=val_tokens, num_samples=val_plan.num_samples,
                                              elapsed=time.perf_counter() - began)
        if metrics is not None:
            metrics.write(record)
        tracker.log(record)
        log_rank_0("step %d: validation loss %.4f over %d tokens (%.2fs)", state.step, val_loss, val_tokens,
                   record["val_time_s"])
        return validation.update_best(state, val_loss, config=config, save_best=lambda: validation.save_best_export(
            model, output_dir=config.output_dir, step=state.step, samples_seen=state.samples_seen,
            val_loss=val_loss, tokenizer=tokenizer, generation_config=generation_config, rank=dist_info.rank))

    done = _stop_reason(config, state, len(dataset))
    if done:
        log_rank_0(resume_policy.finished_message(
            done, lr_scheduler_decays=config.lr_scheduler not in SCHEDULERS_WITHOUT_TOTAL))
        tracker.close()
        return None
    loader = sampler.make_batch_loader(
        dataset, batch_size=config.batch_size, max_tokens_per_rank=max_tokens,
        rank=dist_info.rank, world_size=dist_info.world_size, seed=config.seed,
        start_position=state.samples_seen, num_workers=config.num_data_workers, balance=config.balance,
        pin_memory=dist_info.device.type == "cuda",  # lets the non_blocking host-to-GPU copies overlap
    )
    preemption = PreemptionFlag()
    progress = tqdm(total=total_steps, initial=state.step, desc="train", disable=not dist_info.is_main,
                    dynamic_ncols=True)
    last_checkpoint: Path | None = None
    model.train()
    for batch in loader:
        reset_peak_memory()
        start = time.perf_counter()
        # --- one optimizer step -------------------------------------------------
        # Sum-reduced CE over this rank's minibatches, divided by the whole batch's
        # loss-token count (known before any forward). FSDP averages gradients over
        # ranks, so multiplying by world_size turns that average back into the sum
        # the exact per-token mean needs.
        scale = dist_info.world_size / max(batch.batch_num_loss_counted_tokens, 1)
        loss_sum = torch.zeros((), device=dist_info.device)
        backward_sum = torch.zeros((), device=dist_info.device)
        router_aux_sum = torch.zeros((), device=dist_info.device)
        local_loss_tokens = 0
        for index, minibatch in enumerate(batch.minibatches):
            sync_gradients_on(model, sharding_strategy=config.fsdp_sharding_strategy,
                              final_minibatch=index == len(batch.minibatches) - 1)
            # MoE router loss (objective.py): per-sample, averaged over the batch's samples.
            aux_weight = router_aux_weight(
                model.router_loss, batch_num_loss_counted_tokens=batch.batch_num_loss_counted_tokens,
                batch_num_samples=batch.num_samples, minibatch_num_samples=minibatch.num_samples)
            mb_loss = model(**_model_inputs(minibatch, resolved.attn_implementation, dist_info.device),
                            router_aux_weight=aux_weight)
            mb_loss = _test_inject_nan(mb_loss, model, state.step + 1, dist_info.rank)
            scaled = mb_loss * scale
            scaled.backward()
            loss_sum += model.last_ce_sum
            router_aux_sum += model.last_router_aux_sum
            backward_sum += scaled.detach()
            local_loss_tokens += minibatch.num_loss_counted_tokens
        synchronize()  # so the forward/backward time below is the device's, not the launch queue's
        forward_backward_time = time.perf_counter() - start
        # The norm is reduced over every shard, so all ranks see the same value and
        # take the same skip decision without another collective.
        grad_norm = _clip_grad_norm(model, config.max_grad_norm)
        finite = bool(torch.isfinite(grad_norm))  # CPU-GPU sync point, once per step
        # A batch without loss tokens has zero gradients: AdamW would still move the
        # weights (momentum, weight decay), so it is skipped like a non-finite step.
        empty = batch.batch_num_loss_counted_tokens == 0
        if finite and not empty:
            optimizer.step()
            scheduler.step()  # the schedule counts updates: skipped steps do not advance it
        optimizer.zero_grad(set_to_none=True)
        # -------------------------------------------------------------------------
        state.step += 1
        state.samples_seen = batch.end_position
        state.samples_trained += batch.num_samples if finite and not empty else 0
        state.num_bad_steps = 0 if finite else state.num_bad_steps + 1
        _test_after_step_hooks(state.step, dist_info.rank)
        counts, preempted = _reduce_step_counts(loss_sum, backward_sum, local_loss_tokens, forward_backward_time,
                                                batch, dist_info, preemption.requested,
                                                router_aux_sum if model.router_loss is not None else None)
        synchronize()
        record = _step_metrics(dist_info, state, batch, counts, grad_norm, scheduler,
                               time.perf_counter() - start, skipped=not finite or empty)
        record.update(flops.speed_metrics(
            model_shape, batch.sample_lengths, num_loss_counted_tokens=counts.num_loss_counted_tokens,
            seconds=record["time_per_batch"], world_size=dist_info.world_size, peak_tflops=peak_tflops,
            frozen_base=config.lora is not None))
        if isinstance(dataset, data_mix.MixedDataset):
            record.update(dataset.source_metrics(config.seed, state.samples_seen))
        if metrics is not None:
            metrics.write(record)
        tracker.log(record)
        progress.update(1)
        progress.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_second']:.0f}",
                             samples=state.samples_seen)
        logger.debug("step %d: %s", state.step, record)

        if not finite:
            logger.warning("step %d: non-finite loss or gradient norm (%s); update skipped (%d in a row)",
                           state.step, float(grad_norm), state.num_bad_steps)
            if state.num_bad_steps >= config.max_bad_steps:
                logger.error("aborting: %d consecutive steps with non-finite loss or gradients "
                             "(--max-bad-steps %d); lower the learning rate or inspect the data around "
                             "samples %d..%d", state.num_bad_steps, config.max_bad_steps,
                             batch.start_position, batch.end_position)
                raise SystemExit(1)
        if empty and finite:
            log_rank_0("step %d: no loss-counted tokens in the batch (samples %d..%d); update skipped",
                       state.step, batch.start_position, batch.end_position, level=logging.WARNING)
        done = _stop_reason(config, state, len(dataset))
        if val_plan is not None and not preempted and (done or validation.should_validate(
                step=state.step, every_n_steps=config.validation_every_n_steps, samples_seen=state.samples_seen,
                previous_samples=batch.start_position, every_n_samples=config.validation_every_n_samples)):
            done = validate() or done
        # A preemption on the last step (or on a cadence step) still writes the export that step owes:
        # the rerun finds nothing left to train and would never write it.
        export_due = bool(done) or (state.samples_seen - state.last_checkpoint_samples
                                    >= config.min_samples_per_checkpoint)
        full_due = bool(done) or (checkpoint_policy.crossed(batch.start_position, state.samples_seen,
                                                            config.min_samples_per_full_state)
                                  if config.min_samples_per_full_state else export_due)
        if preempted:
            log_rank_0("preemption signal received: saving full state at step %d and exiting", state.step)
            full_due = True
            export_due = export_due or not config.full_state  # with --no-full-state an export is all there is
        if export_due or full_due:
            last_checkpoint = save(hf_export=export_due, full_state=full_due) or last_checkpoint
        if done:
            log_rank_0("stopping: %s", done)
        if done or preempted:
            break
    progress.close()
    preemption.restore()
    if metrics is not None:
        metrics.close()
    tracker.close()
    return last_checkpoint


# ----------------------------------------------------------------------------
# Helpers of the loop, in the order the loop uses them.


def _preflight(config: TrainConfig) -> str | None:
    """Cheap checks on rank 0 before any heavy work; returns one error line or None."""
    from transformers import AutoConfig

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
    try:
        model_config = AutoConfig.from_pretrained(config.model_name_or_path, trust_remote_code=config.trust_remote_code)
    except (OSError, ValueError) as err:
        return f"--model-name-or-path {config.model_name_or_path}: cannot load a model config ({err})"
    attention_error = attention_preflight(config.model_name_or_path, config.attn_implementation,
                                          trust_remote_code=config.trust_remote_code)
    if attention_error is not None:
        return attention_error
    if config.lora is not None:
        error = lora_preflight(model_config, config.lora, shard_size=shard_group_size(
            config.fsdp_sharding_strategy, dist.get_world_size(),
            int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))))
        if error:
            return error
    for flag, value, package in (("--wandb-project", config.wandb_project, "wandb"),
                                 ("--tensorboard-dir", config.tensorboard_dir, "tensorboard")):
        if value is not None and importlib.util.find_spec(package) is None:
            return f"{flag} needs the {package} package: pip install {package}"
    output = Path(config.output_dir)
    try:
        output.mkdir(parents=True, exist_ok=True)
        probe = output / ".write_probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        return f"--output-dir {config.output_dir}: not writable ({err.strerror or err})"
    return None


def _fail_together(dist_info: DistInfo, error: str | None) -> None:
    """Broadcast rank 0's verdict so every rank exits non-zero instead of hanging."""
    payload = [error]
    dist.broadcast_object_list(payload, src=0)
    if payload[0] is not None:
        if dist_info.is_main:
            logger.error(payload[0])
        raise SystemExit(1)


def _validation_set(config: TrainConfig, dataset, dist_info: DistInfo):
    """``(training dataset, validation dataset, where it came from)``; the first is unchanged without validation."""
    if not config.has_validation:
        return dataset, None, None
    if config.validation_split is not None:
        train_rows, val_rows = validation.split_rows(len(dataset), config.validation_split, config.seed)
        dataset, val_dataset = validation.RowSubset(dataset, train_rows), validation.RowSubset(dataset, val_rows)
        source = f"{config.validation_split:g} of {config.data_path} (seed {config.seed})"
    else:
        val_dataset = _load_dataset_rank0_first(config, dist_info, path=config.validation_data_path)
        source = config.validation_data_path
    return dataset, val_dataset, source


def _resume_policy(config: TrainConfig, run_params: dict, dataset) -> str | None:
    """Rank 0, before the model loads: move an old run aside (--no-resume) or compare model, data and
    run parameters with the checkpoint a resume would load."""
    from transformers import AutoConfig

    from full_state import complete_checkpoints, fingerprint, full_state_root

    if not config.resume:
        moved = resume_policy.move_aside(config.output_dir)
        if moved is not None:
            logger.warning("--no-resume: moved the earlier run's checkpoints and metrics in %s to %s",
                           config.output_dir, moved)
        return None
    candidates = ([Path(config.resume_from)] if config.resume_from
                  else complete_checkpoints(full_state_root(config.output_dir)))
    expected = (fingerprint(AutoConfig.from_pretrained(config.model_name_or_path), dataset, config.lora)
                if candidates else None)
    error, notice = resume_policy.check_resume(candidates, run_params, allow_change=config.allow_config_change,
                                               fingerprint=expected)
    if notice:
        logger.warning(notice)
    return error


def _start_tracker(config: TrainConfig, dist_info: DistInfo):
    """Rank 0 starts the trackers before the model loads (continuing a resumed run's wandb run);
    returns ``(tracker, error line or None)``."""
    from full_state import complete_checkpoints, full_state_root
    from trackers import NullTracker, TrackerInitError

    if not dist_info.is_main or (config.wandb_project is None and config.tensorboard_dir is None):
        return NullTracker(), None
    run_id = None
    if config.resume:
        candidates = ([Path(config.resume_from)] if config.resume_from
                      else complete_checkpoints(full_state_root(config.output_dir)))
        found = resume_policy.newest_trainer_state(candidates)
        run_id = found[1].get("wandb_run_id") if found else None
    try:
        return make_tracker(wandb_project=config.wandb_project, tensorboard_dir=config.tensorboard_dir,
                            run_config=dataclasses.asdict(config), rank=dist_info.rank, wandb_run_id=run_id), None
    except (ImportError, TrackerInitError) as err:
        return NullTracker(), str(err)


def _announce_disk_plan(config: TrainConfig, model: torch.nn.Module, total_steps: int | None) -> None:
    import shutil

    params = list(model.parameters())
    plan = checkpoint_policy.plan_disk(
        num_params=sum(p.numel() for p in params), param_bytes=params[0].element_size(),
        total_samples=total_steps * config.batch_size if total_steps else None,
        export_every=config.min_samples_per_checkpoint, keep_exports=config.keep_last_n_checkpoints,
        full_state_every=config.min_samples_per_full_state or config.min_samples_per_checkpoint,
        keep_full_states=checkpoint_policy.full_states_kept(config.keep_last_n_full_states,
                                                            config.keep_last_n_checkpoints),
        full_state=config.full_state)
    info, warning = checkpoint_policy.disk_report(plan, shutil.disk_usage(config.output_dir).free, config.output_dir)
    log_rank_0(info)
    if warning:
        logger.warning(warning)


def _load_dataset_rank0_first(config: TrainConfig, dist_info: DistInfo, *, path: str | None = None):
    """Rank 0 loads (and caches) first; the others then reuse its cache. Errors exit every rank."""
    path = path or config.data_path
    dataset, error = None, None
    if dist_info.is_main:
        try:
            dataset = data_mix.load_data(path, sampler.load_tokenized_dataset)
            budget = config.max_tokens_per_gpu
            if budget != "auto" and int(dataset.lengths.min(initial=budget + 1)) > budget:
                error = (f"--max-tokens-per-gpu {config.max_tokens_per_gpu} is below every sample of "
                         f"{path} (shortest: {int(dataset.lengths.min())} tokens)")
        except ValueError as err:
            error = str(err)
    _fail_together(dist_info, error)
    if not dist_info.is_main:
        dataset = data_mix.load_data(path, sampler.load_tokenized_dataset)
    return dataset


def _check_data_fits_model(config: TrainConfig, dataset) -> str | None:
    """Every source of the data against the model's vocabulary and tokenizer (selfcheck.py)."""
    parts = ([(source.path, part) for source, part in zip(dataset.sources, dataset.datasets)]
             if isinstance(dataset, data_mix.MixedDataset) else [(config.data_path, dataset)])
    for path, part in parts:
        error = check_data_fits_model(part, path, config.model_name_or_path,
                                      trust_remote_code=config.trust_remote_code)
        if error:
            return error
    return None


def _total_steps(config: TrainConfig, num_dataset_samples: int) -> int | None:
    """Optimizer steps until the first stop condition, or None for infinite sampling."""
    candidates = []
    if config.max_steps is not None:
        candidates.append(config.max_steps)
    if config.max_samples is not None:
        candidates.append(math.ceil(config.max_samples / config.batch_size))
    if config.num_epochs is not None:
        candidates.append(math.ceil(config.num_epochs * num_dataset_samples / config.batch_size))
    return min(candidates) if candidates else None


def _build_scheduler(config: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int | None):
    from transformers import get_scheduler

    return get_scheduler(config.lr_scheduler, optimizer, num_warmup_steps=config.num_warmup_steps,
                         num_training_steps=total_steps, scheduler_specific_kwargs=_scheduler_kwargs(config, total_steps))


def _scheduler_kwargs(config: TrainConfig, total_steps: int | None) -> dict:
    """The extra arguments of the schedulers that need more than warmup and total steps."""
    if config.lr_scheduler in ("cosine_with_min_lr", "cosine_warmup_with_min_lr"):
        return {"min_lr_rate": config.min_lr_ratio}
    if config.lr_scheduler == "warmup_stable_decay":
        return {"num_decay_steps": max(1, math.ceil(config.decay_fraction * (total_steps or 0))),
                "min_lr_ratio": config.min_lr_ratio}
    return {}


def _check_scheduler(config: TrainConfig, total_steps: int | None, dist_info: DistInfo) -> None:
    """Build the schedule on a stand-in optimizer before the model loads: a bad combination fails in
    seconds, not after minutes of loading. Every rank computes the same verdict (same config and data)."""
    error = None
    kwargs = _scheduler_kwargs(config, total_steps)
    if total_steps is not None and config.lr_scheduler == "warmup_stable_decay" \
            and config.num_warmup_steps + kwargs["num_decay_steps"] > total_steps:
        error = (f"--lr-scheduler warmup_stable_decay: {config.num_warmup_steps} warmup + "
                 f"{kwargs['num_decay_steps']} decay steps exceed the run's {total_steps} steps; lower "
                 "--num-warmup-steps or --decay-fraction")
    else:
        stand_in = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=config.learning_rate)
        try:
            _build_scheduler(config, stand_in, total_steps)
        except (TypeError, ValueError) as err:
            error = f"--lr-scheduler {config.lr_scheduler}: {err}"
    if error is not None:
        if dist_info.is_main:
            logger.error(error)
        raise SystemExit(1)


def _original_generation_config(model_name_or_path: str):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_name_or_path)
    except OSError:
        return None


def _announce(config: TrainConfig, dist_info: DistInfo, resolved, num_dataset_samples: int,
              total_steps: int | None, max_tokens: int) -> None:
    """Print each resolved decision once, with its reason."""
    log_rank_0("world size %d on %s (%s backend)", dist_info.world_size, dist_info.device.type,
               dist.get_backend())
    log_rank_0("model %s: %d x %s sharded with %s, mesh %s, compute dtype %s, attention %s, "
               "activation checkpointing %s", config.model_name_or_path, resolved.num_blocks,
               resolved.block_class, config.fsdp_sharding_strategy, resolved.mesh_shape,
               str(resolved.param_dtype).removeprefix("torch."), resolved.attn_implementation,
               "on" if config.activation_checkpointing else "off")
    log_rank_0("trainable parameters: %s of %s (%.2f%%)%s", f"{resolved.num_trainable_params:,}",
               f"{resolved.num_params:,}", 100.0 * resolved.num_trainable_params / max(resolved.num_params, 1),
               f", LoRA rank {config.lora.rank}, alpha {config.lora.alpha:g} on {config.lora_target_modules}"
               if config.lora else "")
    log_rank_0("data %s: %d samples; %d samples per step; at most %d tokens per rank per minibatch "
               "(gradient accumulation follows from packing)", config.data_path, num_dataset_samples,
               config.batch_size, max_tokens)
    log_rank_0("schedule %s, warmup %d, %s", config.lr_scheduler, config.num_warmup_steps,
               f"{total_steps} steps" if total_steps else "infinite sampling (no stop condition)")


def _write_training_params(config: TrainConfig, dist_info: DistInfo, resolved, max_tokens: int) -> None:
    import transformers

    params = dataclasses.asdict(config)
    params.update(world_size=dist_info.world_size, device=dist_info.device.type,
                  attn_implementation_resolved=resolved.attn_implementation,
                  max_tokens_per_gpu_resolved=max_tokens,
                  torch_version=torch.__version__, transformers_version=transformers.__version__)
    path = Path(config.output_dir) / "training_params.json"
    path.write_text(json.dumps(params, indent=2, sort_keys=True))


def _model_inputs(minibatch, attn_implementation: str, device: torch.device) -> dict:
    return {
        "input_ids": minibatch.input_ids.to(device, non_blocking=True),
        "position_ids": minibatch.position_ids.to(device, non_blocking=True),
        "labels": minibatch.labels.to(device, non_blocking=True),
        # Explicit cu_seqlens for flash/varlen backends: computed once per minibatch, shared by every layer.
        **attention_inputs(minibatch, attn_implementation, device),
    }


def _clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Total gradient norm over all shards (clipped when ``max_norm`` > 0)."""
    parameters = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm if max_norm > 0 else float("inf"))
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return norm


def _reduce_step_counts(loss_sum: torch.Tensor, backward_sum: torch.Tensor, local_loss_tokens: int,
                        forward_backward_time: float, batch, dist_info: DistInfo, preempt_requested: bool,
                        router_aux_sum: torch.Tensor | None = None) -> tuple[StepCounts, bool]:
    """All-reduce this step's sums and the preemption flags (any rank's signal stops all).

    Counts travel as int64 so they stay exact past 2**24 tokens, where fp32 rounds.
    """
    aux = loss_sum.new_zeros(()) if router_aux_sum is None else router_aux_sum.float().reshape(())
    sums = torch.stack([loss_sum.float(), backward_sum.float(),
                        torch.tensor(forward_backward_time, device=loss_sum.device), aux.float()])
    integers = torch.tensor([local_loss_tokens, int(preempt_requested)], dtype=torch.int64, device=loss_sum.device)
    dist.all_reduce(sums)
    dist.all_reduce(integers)
    loss_total, backward_total, time_total, router_aux_total = sums.tolist()  # CPU-GPU sync point
    loss_tokens, preempts = integers.tolist()
    counts = StepCounts(loss_sum=loss_total, backward_loss_sum=backward_total,
                        batch_num_loss_counted_tokens=batch.batch_num_loss_counted_tokens,
                        num_loss_counted_tokens=loss_tokens, num_samples=batch.num_samples,
                        num_total_tokens=batch.num_total_tokens, num_dropped_samples=batch.num_dropped_samples,
                        num_minibatches=len(batch.minibatches), forward_backward_time_sum=time_total,
                        router_aux_loss_sum=None if router_aux_sum is None else router_aux_total)
    return counts, preempts > 0


def _step_metrics(dist_info: DistInfo, state: TrainState, batch, counts, grad_norm, scheduler, elapsed: float,
                  *, skipped: bool) -> dict:
    # Dropped (over-long) samples are warned about by the loader, with their rows; here they are counted.
    return step_record(step=state.step, lr=scheduler.get_last_lr()[0], grad_norm=float(grad_norm),
                       counts=counts, world_size=dist_info.world_size, time_per_batch=elapsed,
                       total_samples_accumulated=state.samples_trained, samples_seen=state.samples_seen,
                       epoch=batch.epoch, peak_memory_usage_gb=peak_memory_gb(), skipped=skipped)


def _folder_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / 2**20


def _test_inject_nan(loss: torch.Tensor, model, step: int, rank: int) -> torch.Tensor:
    """Test-only fault injection: MINI_TRAINER_TEST_NAN="STEP:RANK" poisons that rank's loss (and its
    logged cross-entropy, as a real non-finite forward would)."""
    if os.environ.get("MINI_TRAINER_TEST_NAN") == f"{step}:{rank}":
        model.last_ce_sum = model.last_ce_sum * float("nan")
        return loss * float("nan")
    return loss


def _test_after_step_hooks(step: int, rank: int) -> None:
    """Test-only: MINI_TRAINER_TEST_SIGTERM="STEP:RANK" makes that rank SIGTERM itself after the step;
    MINI_TRAINER_TEST_STEP_SLEEP=SECONDS slows every step so a test can signal a run mid-way."""
    if os.environ.get("MINI_TRAINER_TEST_SIGTERM") == f"{step}:{rank}":
        os.kill(os.getpid(), signal.SIGTERM)
    if "MINI_TRAINER_TEST_STEP_SLEEP" in os.environ:
        time.sleep(float(os.environ["MINI_TRAINER_TEST_STEP_SLEEP"]))


def _stop_reason(config: TrainConfig, state: TrainState, num_dataset_samples: int) -> str | None:
    if config.max_steps is not None and state.step >= config.max_steps:
        return f"reached --max-steps {config.max_steps}"
    if config.max_samples is not None and state.samples_seen >= config.max_samples:
        return f"reached --max-samples {config.max_samples}"
    if config.num_epochs is not None and state.samples_seen >= config.num_epochs * num_dataset_samples:
        return f"reached --num-epochs {config.num_epochs}"
    return None


def main(argv: list[str] | None = None) -> None:
    config = parse_config(TrainConfig, argv, description=__doc__.split("\n\n")[0])
    train(config)


if __name__ == "__main__":
    sys.exit(main())
