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

import sampler
from attention import attention_inputs
from autotune import probe_token_budget
from batch_metrics import MetricsWriter, StepCounts, step_record
from checkpoint import save_hf_checkpoint
from full_state import PreemptionFlag, TrainState, resume_train_state, save_full_state
from lora import ALL_LINEAR, LoraSettings, lora_preflight
from setup_model_fsdp import setup_model
from trackers import make_tracker

from utils import (
    DistInfo,
    cleanup,
    collect_errors,
    config_field,
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
    data_path: str = config_field("test.jsonl", help="tokenized jsonl file or process_data.py output folder")
    batch_size: int = config_field(1024, help="samples per optimizer step, whole job")
    max_tokens_per_gpu: int | Literal["auto"] = config_field(
        10000, parse=_token_budget,
        help="token budget of one packed minibatch on one rank; 'auto' probes the largest that fits "
             "on this GPU (with a 10%% safety margin)")
    learning_rate: float = config_field(5e-6, help="peak learning rate")
    num_warmup_steps: int = config_field(10, help="linear warmup steps from 0")
    lr_scheduler: str = config_field("constant_with_warmup", choices=SCHEDULERS,
                                     help="transformers.get_scheduler name; decaying schedules need a stop condition")
    seed: int = config_field(42, help="seeds Python, NumPy, torch and the data order on every rank")
    use_liger_kernels: bool = config_field(
        False, help="Liger fused linear cross-entropy plus RMSNorm/RoPE/SwiGLU kernels (CUDA; ignored with a "
                    "warning on CPU)")
    logging_level: str = config_field("INFO", help="DEBUG, INFO, WARNING, ERROR or CRITICAL (any case)")
    max_steps: int | None = config_field(None, help="stop after this many optimizer steps")
    max_samples: int | None = config_field(None, help="stop once this many samples were consumed")
    num_epochs: float | None = config_field(None, help="stop after this many passes over the data")
    fsdp_sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"] = config_field(
        "FULL_SHARD", help="FULL_SHARD (ZeRO-3), SHARD_GRAD_OP (ZeRO-2), NO_SHARD (DDP-like), "
                           "HYBRID_SHARD (shard within a node, replicate across nodes)")
    cpu_offload: bool = config_field(False, help="keep sharded params, grads and optimizer state in host memory")
    attn_implementation: str = config_field(
        "auto", help="auto (flash_attention_2 if flash_attn imports on CUDA, else torch_varlen on CUDA with "
                     "torch>=2.10, else sdpa), sdpa, eager, flash_attention_2, flash_attention_3, torch_varlen, "
                     "reference_varlen (CPU, slow)")
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
        None, help="keep only the newest N full-state and Hugging Face checkpoints (default: keep all)")
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
                         "linear layer of the decoder blocks (the LM head excluded)")
    lora_use_rslora: bool = config_field(False, help="rank-stabilised LoRA: scale by alpha / sqrt(r)")
    lora_merge_on_export: bool = config_field(
        True, help="Hugging Face exports hold the merged model (loads with transformers and vLLM as is) plus "
                   "the adapter in adapter/; --no-lora-merge-on-export writes the adapter alone")
    lora_quantize_data_type: Literal["none", "nf4"] = config_field(
        "none", help="QLoRA base-weight quantization: only none is supported (nf4 is refused, see README)")

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
        if self.num_data_workers < 0:
            errors.append("--num-data-workers must be >= 0")
        if self.resume_from and not self.resume:
            errors.append("--resume-from and --no-resume contradict each other")
        if self.keep_last_n_checkpoints is not None and self.keep_last_n_checkpoints < 1:
            errors.append("--keep-last-n-checkpoints must be at least 1")
        if self.max_bad_steps < 1:
            errors.append("--max-bad-steps must be at least 1")
        if self.lora_rank < 0:
            errors.append(f"--lora-rank must be positive (or 0 for full fine-tuning), got {self.lora_rank}")
        if self.lora_alpha is not None and self.lora_alpha <= 0:
            errors.append(f"--lora-alpha must be positive, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            errors.append(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if self.lora_quantize_data_type != "none":
            errors.append("--lora-quantize-data-type nf4 (QLoRA) is not supported: 4-bit base weights need "
                          "bitsandbytes' CUDA kernels under FSDP2, which this trainer has not been validated with; "
                          "use plain LoRA (bf16 base weights)")
        collect_errors(errors)

    @property
    def lora(self) -> LoraSettings | None:
        if self.lora_rank == 0:
            return None
        alpha = self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank
        return LoraSettings(rank=self.lora_rank, alpha=alpha, dropout=self.lora_dropout,
                            target_modules=self.lora_target_modules, use_rslora=self.lora_use_rslora)

    @property
    def has_stop_condition(self) -> bool:
        return any(v is not None for v in (self.max_steps, self.max_samples, self.num_epochs))


def train(config: TrainConfig) -> Path | None:
    """Run training as one rank of a torchrun job (or alone). Returns the last HF checkpoint."""
    dist_info = init_distributed()
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
    dataset = _load_dataset_rank0_first(config, dist_info)
    total_steps = _total_steps(config, len(dataset))

    model, resolved = setup_model(
        model_name_or_path=config.model_name_or_path, dist_info=dist_info,
        attn_implementation=config.attn_implementation, sharding_strategy=config.fsdp_sharding_strategy,
        cpu_offload=config.cpu_offload, activation_checkpointing=config.activation_checkpointing,
        use_liger_kernels=config.use_liger_kernels,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", dist_info.world_size)), lora=config.lora,
    )
    max_tokens = config.max_tokens_per_gpu
    if max_tokens == "auto":
        max_tokens = probe_token_budget(
            model, dataset, dist_info=dist_info,
            model_inputs=lambda mb: _model_inputs(mb, resolved.attn_implementation, dist_info.device))
    tokenizer = AutoTokenizer.from_pretrained(config.model_name_or_path) if dist_info.is_main else None
    generation_config = _original_generation_config(config.model_name_or_path) if dist_info.is_main else None
    # Only trainable parameters get optimizer state (with LoRA: the adapters alone).
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.learning_rate,
                                  betas=config.adam_betas, weight_decay=config.weight_decay)
    scheduler = _build_scheduler(config, optimizer, total_steps)
    model_fingerprint = fingerprint(model.model.config, dataset)
    began = time.perf_counter()
    state = resume_train_state(model, optimizer, scheduler, output_dir=config.output_dir, resume=config.resume,
                               resume_from=config.resume_from, model_fingerprint=model_fingerprint,
                               dist_info=dist_info)
    if state.step:
        log_rank_0("resume took %.2fs", time.perf_counter() - began)
    _announce(config, dist_info, resolved, len(dataset), total_steps, max_tokens)
    metrics_path = Path(config.output_dir) / f"training_metrics_{dist_info.rank}.jsonl"
    if dist_info.is_main:
        _write_training_params(config, dist_info, resolved, max_tokens)
        truncate_metrics(metrics_path, state.step)
    metrics = MetricsWriter(metrics_path) if dist_info.is_main else None
    tracker = make_tracker(wandb_project=config.wandb_project, tensorboard_dir=config.tensorboard_dir,
                           run_config=dataclasses.asdict(config), rank=dist_info.rank)

    def save(*, hf_export: bool) -> Path | None:
        """Full state always (resume needs it); the Hugging Face export on the regular cadence."""
        exported = None
        if hf_export:
            began = time.perf_counter()
            exported = save_hf_checkpoint(
                model, output_dir=config.output_dir, num_samples=state.samples_seen, tokenizer=tokenizer,
                generation_config=generation_config, rank=dist_info.rank,
                keep_last_n=config.keep_last_n_checkpoints, lora_merge=config.lora_merge_on_export,
                base_model_name_or_path=config.model_name_or_path)
            log_rank_0("saved Hugging Face checkpoint %s in %.2fs (%.1f MB)", exported,
                       time.perf_counter() - began, _folder_mb(exported))
        began = time.perf_counter()
        saved = save_full_state(
            model, optimizer, scheduler, output_dir=config.output_dir, num_samples=state.samples_seen,
            trainer_state=dataclasses.asdict(state), model_fingerprint=model_fingerprint,
            dist_info=dist_info, keep_last_n=config.keep_last_n_checkpoints)
        log_rank_0("saved full training state %s in %.2fs (%.1f MB)", saved, time.perf_counter() - began,
                   _folder_mb(saved))
        state.last_checkpoint_samples = state.samples_seen
        return exported

    done = _stop_reason(config, state, len(dataset))
    if done:
        log_rank_0("nothing to do: %s already", done)
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
        local_loss_tokens = 0
        for minibatch in batch.minibatches:
            mb_loss = model(**_model_inputs(minibatch, resolved.attn_implementation, dist_info.device))
            mb_loss = _test_inject_nan(mb_loss, state.step + 1, dist_info.rank)
            scaled = mb_loss * scale
            scaled.backward()
            loss_sum += mb_loss.detach()
            backward_sum += scaled.detach()
            local_loss_tokens += minibatch.num_loss_counted_tokens
        # The norm is reduced over every shard, so all ranks see the same value and
        # take the same skip decision without another collective.
        grad_norm = _clip_grad_norm(model, config.max_grad_norm)
        finite = bool(torch.isfinite(grad_norm))  # CPU-GPU sync point, once per step
        if finite:
            optimizer.step()
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        # -------------------------------------------------------------------------
        state.step += 1
        state.samples_seen = batch.end_position
        state.samples_trained += batch.num_samples if finite else 0
        state.num_bad_steps = 0 if finite else state.num_bad_steps + 1
        _test_send_signal(state.step, dist_info.rank)
        counts, preempted = _reduce_step_counts(loss_sum, backward_sum, local_loss_tokens, batch, dist_info,
                                                preemption.requested)
        synchronize()
        record = _step_metrics(dist_info, state, batch, counts, grad_norm, scheduler,
                               time.perf_counter() - start, skipped=not finite)
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
        if preempted:
            log_rank_0("preemption signal received: saving full state at step %d and exiting", state.step)
            save(hf_export=False)
            break
        done = _stop_reason(config, state, len(dataset))
        if done or state.samples_seen - state.last_checkpoint_samples >= config.min_samples_per_checkpoint:
            last_checkpoint = save(hf_export=True) or last_checkpoint
        if done:
            log_rank_0("stopping: %s", done)
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

    if not Path(config.data_path).exists():
        return f"--data-path {config.data_path}: no such file or folder"
    try:
        model_config = AutoConfig.from_pretrained(config.model_name_or_path)
    except (OSError, ValueError) as err:
        return f"--model-name-or-path {config.model_name_or_path}: cannot load a model config ({err})"
    if config.lora is not None:
        error = lora_preflight(model_config, config.lora)
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


def _load_dataset_rank0_first(config: TrainConfig, dist_info: DistInfo):
    """Rank 0 loads (and caches) first; the others then reuse its cache. Errors exit every rank."""
    dataset, error = None, None
    if dist_info.is_main:
        try:
            dataset = sampler.load_tokenized_dataset(config.data_path)
            budget = config.max_tokens_per_gpu
            if budget != "auto" and int(dataset.lengths.min(initial=budget + 1)) > budget:
                error = (f"--max-tokens-per-gpu {config.max_tokens_per_gpu} is below every sample of "
                         f"{config.data_path} (shortest: {int(dataset.lengths.min())} tokens)")
        except ValueError as err:
            error = str(err)
    _fail_together(dist_info, error)
    if not dist_info.is_main:
        dataset = sampler.load_tokenized_dataset(config.data_path)
    return dataset


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
                         num_training_steps=total_steps)


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


def _reduce_step_counts(loss_sum: torch.Tensor, backward_sum: torch.Tensor, local_loss_tokens: int, batch,
                        dist_info: DistInfo, preempt_requested: bool) -> tuple[StepCounts, bool]:
    """One all-reduce of this step's sums and of the preemption flags (any rank's signal stops all)."""
    extras = torch.tensor([float(local_loss_tokens), float(preempt_requested)], device=loss_sum.device)
    packed = torch.cat([loss_sum.float().reshape(1), backward_sum.float().reshape(1), extras])
    dist.all_reduce(packed)
    loss_total, backward_total, loss_tokens, preempts = packed.tolist()  # CPU-GPU sync point
    counts = StepCounts(loss_sum=loss_total, backward_loss_sum=backward_total,
                      batch_num_loss_counted_tokens=batch.batch_num_loss_counted_tokens,
                      num_loss_counted_tokens=int(round(loss_tokens)), num_samples=batch.num_samples,
                      num_total_tokens=batch.num_total_tokens, num_dropped_samples=batch.num_dropped_samples,
                      num_minibatches=len(batch.minibatches))
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


def _test_inject_nan(loss: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    """Test-only fault injection: MINI_TRAINER_TEST_NAN="STEP:RANK" poisons that rank's loss."""
    if os.environ.get("MINI_TRAINER_TEST_NAN") == f"{step}:{rank}":
        return loss * float("nan")
    return loss


def _test_send_signal(step: int, rank: int) -> None:
    """Test-only: MINI_TRAINER_TEST_SIGTERM="STEP:RANK" makes that rank SIGTERM itself after the step."""
    if os.environ.get("MINI_TRAINER_TEST_SIGTERM") == f"{step}:{rank}":
        os.kill(os.getpid(), signal.SIGTERM)


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
