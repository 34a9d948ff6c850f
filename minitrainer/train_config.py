"""The training run's parameters: one dataclass shared by ``train.py``'s CLI and the Python API."""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from minitrainer.checkpoint.policy import FINAL_EXPORT_ONLY
from minitrainer.common.cli import comma_list, config_field, mapping_text
from minitrainer.common.refusals import collect_errors, problems_of
from minitrainer.common.log import PROGRESS_MODES
from minitrainer.data.tokenizing_flags import tokenizing_field
from minitrainer.data.mix import parse_data_spec
from minitrainer.data.process_data import ProcessDataConfig, tokenizing_config
from minitrainer.methods.base import FineTuningMethod
from minitrainer.methods.lora import ALL_LINEAR, LoRA, LoraSettings
from minitrainer.methods.osft import OSFT, UPCAST_DTYPES, OSFTSettings, num_frozen_directions
from minitrainer.methods.qlora import QLoRA
from minitrainer.model.recomputation import POLICIES, as_policy
from minitrainer.objectives.base import TrainingObjective
from minitrainer.objectives.cpo import CPOObjective, CPOSettings
from minitrainer.objectives.dpo import DPOObjective, DPOSettings
from minitrainer.objectives.kto import KTOObjective, KTOSettings
from minitrainer.objectives.orpo import ORPOObjective, ORPOSettings
from minitrainer.objectives.pairs import PAIR_OBJECTIVES
from minitrainer.objectives.reward import RewardObjective, RewardSettings
from minitrainer.optim.base import OptimizerChoice
from minitrainer.optim.registry import OPTIMIZERS, optimizer_choice

SCHEDULERS_WITHOUT_TOTAL = ("constant", "constant_with_warmup", "inverse_sqrt")
SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay")
OBJECTIVE_FIELDS = {
    "dpo": ("dpo_beta", "dpo_loss", "dpo_label_smoothing", "dpo_sft_weight", "reference_model"),
    "cpo": ("cpo_beta", "cpo_loss", "cpo_alpha"),
    "simpo": ("simpo_beta", "simpo_gamma", "simpo_sft_weight"),
    "orpo": ("orpo_beta",),
    "kto": ("kto_beta", "kto_desirable_weight", "kto_undesirable_weight", "kto_kl_chunk", "reference_model"),
    "reward": ("reward_center_coefficient",),
}
"""The fields that mean something only with their --objective (a field may serve several)."""
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
SAVE_DTYPES = ("bfloat16", "float16", "float32", "auto")
"""--save-dtype's values (its Literal's): torch's dtype names, and auto."""


def _token_budget(text: str) -> int | str:
    """CLI parser of --max-tokens-per-gpu: a positive integer or 'auto'."""
    return "auto" if str(text).lower() == "auto" else int(text)


def _recomputation_policy(text: str) -> str:
    """CLI parser of --activation-checkpointing's value: a policy of ``recomputation.POLICIES``."""
    if text not in POLICIES:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(POLICIES)})")
    return text


class _FlagOrPolicy(argparse.Action):
    """``--activation-checkpointing [POLICY]`` and ``--no-activation-checkpointing``: the flag's boolean forms
    (``full``, ``none``), which scripts written before the policies use, beside the named policies."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        negated = ["--no-" + flag[2:] for flag in option_strings]
        super().__init__(option_strings + negated, dest, nargs="?", metavar="{" + ",".join(POLICIES) + "}",
                         **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, "none" if option_string.startswith("--no-") else values or "full")


@dataclass(kw_only=True)
class TrainConfig:
    """Every parameter of a training run; the CLI is generated from these fields."""

    recorded_keys: ClassVar[tuple[str, ...]] = (
        "world_size", "device", "attn_implementation_resolved", "context_parallel_inner",
        "max_tokens_per_gpu_resolved", "activation_checkpointing_resolved", "torch_version",
        "transformers_version")
    """What ``training_params.json`` records beside the fields: what the run resolved, not settings. A
    config file may hold them (a run's record replays it, on any machine) and they are skipped."""

    data_path: str = config_field(section="Data", help="tokenized jsonl or process_data.py folder, raw data "
                                                     "(tokenized once), or a mix: `a:0.7,b:0.3` or a .yaml/.json "
                                                     "mix file")
    seed: int = config_field(42, help="seeds Python, NumPy, torch and the data order on every rank")
    num_data_workers: int = config_field(1, help="DataLoader worker processes per rank (0 = in-process)")
    chat_template: str | None = tokenizing_field("chat_template", run=True)
    end_of_turn_token: str | None = tokenizing_field("end_of_turn_token", run=True)
    mask_reasoning: bool = tokenizing_field("mask_reasoning", run=True)
    max_sample_num_tokens: int = tokenizing_field("max_sample_num_tokens", run=True)
    split_long_text: bool = tokenizing_field("split_long_text", run=True)
    input_format: str = tokenizing_field("input_format", run=True)
    columns: str | None = tokenizing_field("columns", run=True)
    sharegpt_roles: str | None = tokenizing_field("sharegpt_roles", run=True)
    data_split: str = tokenizing_field("data_split", run=True)
    data_subset: str | None = tokenizing_field("data_subset", run=True)
    text_sample_by: str = tokenizing_field("text_sample_by", run=True)
    allow_audit_failures: bool = config_field(
        False, help="raw data: train even when the label audit fails (process_data.py output: its own flag, "
                    "recorded in summary.json, decides)")
    tokenized_data_dir: str | None = config_field(
        None, help="raw data: the folder its tokenized copy is cached in (default: <--output-dir>/tokenized_data; "
                   "a fast local disk or /dev/shm speeds up loading)")
    allow_tokenizer_mismatch: bool = config_field(
        False, help="train on data tokenized with a tokenizer that differs from the model's (refused otherwise)")

    model_name_or_path: str = config_field(section="Model", help="Hugging Face model id or local folder")
    trust_remote_code: bool = config_field(
        False, help="run the modelling and tokenizer code a checkpoint ships (only for sources you trust)")
    attn_implementation: str = config_field(
        "auto", help="auto (the fastest the model accepts), sdpa, eager, flash_attention_2, flash_attention_3, "
                     "torch_varlen, reference_varlen (CPU)")

    batch_size: int = config_field(1024, section="Batching", help="samples per optimizer step, whole job")
    max_tokens_per_gpu: int | Literal["auto"] = config_field(
        10000, parse=_token_budget,
        help="token budget of one packed minibatch on one rank; 'auto' probes the largest that fits "
             "on this GPU (with a 10%% safety margin)")
    balance: Literal["tokens", "attention"] = config_field(
        "tokens", help="packing balance cost: token counts, or tokens plus attention's quadratic term")
    context_parallel_size: int = config_field(
        1, help="N ranks share each packed row (context parallelism): samples up to N x --max-tokens-per-gpu "
                "(docs/long-context.md)")

    learning_rate: float = config_field(5e-6, section="Optimizer, schedule and stop", help="peak learning rate")
    weight_decay: float = config_field(0.0, help="weight decay (decoupled in AdamW and Muon); biases and norm "
                                                 "weights are exempt, as in transformers' Trainer, TRL and axolotl")
    adam_betas: tuple[float, float] = config_field((0.9, 0.95), help="AdamW betas (also Muon's AdamW part)")
    adam_eps: float = config_field(1e-8, help="AdamW epsilon (added to the root of the second moment)")
    optimizer: str = config_field(
        "adamw", help=f"{', '.join(OPTIMIZERS)}, or your own as package.module:Class (docs/optimizers.md)")
    optimizer_args: dict[str, Any] = config_field(
        default_factory=dict, parse=mapping_text,
        help="the optimizer's own settings as a JSON or YAML mapping, e.g. '{\"momentum\": 0.9}'; "
             "default: none (docs/optimizers.md)")
    optimizer_diagnostics: bool = config_field(
        False, help="log each step's update/weight norm ratio and gradient norm per parameter kind")
    max_grad_norm: float = config_field(1.0, help="gradient clipping norm (0 disables clipping)")
    lr_scheduler: str = config_field("constant_with_warmup", choices=SCHEDULERS,
                                     help="transformers.get_scheduler name; decaying schedules need a stop condition")
    num_warmup_steps: int = config_field(10, help="linear warmup steps from 0")
    min_lr_ratio: float = config_field(
        0.1, help="LR floor as a fraction of --learning-rate (cosine_with_min_lr, cosine_warmup_with_min_lr, "
                  "warmup_stable_decay)")
    decay_fraction: float = config_field(
        0.1, help="warmup_stable_decay: fraction of the run's steps spent decaying (after warmup and a "
                  "constant phase)")
    max_steps: int | None = config_field(None, help="stop after this many optimizer steps")
    max_samples: int | None = config_field(None, help="stop once this many samples were consumed")
    num_epochs: float | None = config_field(None, help="stop after this many passes over the data")

    objective: Literal["sft", "dpo", "cpo", "simpo", "orpo", "kto", "reward"] = config_field(
        "sft", section="Objective", help="sft (the assistant replies); on preference pairs dpo, cpo, simpo, "
                                         "orpo, or reward (a reward model); on labelled replies kto")
    dpo_beta: float = config_field(0.1, help="DPO: beta, how far the policy may move from the reference "
                                             "(larger: closer)")
    dpo_loss: Literal["sigmoid", "ipo", "hinge"] = config_field(
        "sigmoid", help="DPO loss: sigmoid (DPO), ipo (IPO, length-normalised), hinge (SLiC)")
    dpo_label_smoothing: float = config_field(
        0.0, help="DPO sigmoid loss: the share of pairs assumed mislabelled, in [0, 0.5) (conservative DPO)")
    dpo_sft_weight: float = config_field(
        0.0, help="DPO: add this weight times the chosen replies' per-token cross-entropy (RPO; TRL's "
                  "loss_type [sigmoid, sft])")
    reference_model: str | None = config_field(
        None, help="DPO, KTO: the reference model's folder or id (default: the model being trained, before its "
                   "first update; with LoRA its base)")
    cpo_beta: float = config_field(0.1, help="CPO: beta, the scale of the log-probability difference")
    cpo_loss: Literal["sigmoid", "hinge", "ipo"] = config_field(
        "sigmoid", help="CPO loss: sigmoid (CPO), hinge, ipo (on length-normalised log-probabilities)")
    cpo_alpha: float = config_field(
        1.0, help="CPO: the weight of the chosen replies' per-token cross-entropy (TRL's cpo_alpha)")
    simpo_beta: float = config_field(
        2.0, help="SimPO: beta, the scale of the length-normalised log-probability difference")
    simpo_gamma: float = config_field(0.5, help="SimPO: the target reward margin gamma")
    simpo_sft_weight: float = config_field(
        0.0, help="SimPO: add this weight times the chosen replies' per-token cross-entropy (CPO-SimPO; TRL's "
                  "cpo_alpha with loss_type simpo)")
    orpo_beta: float = config_field(
        0.1, help="ORPO: the weight of the odds-ratio term beside the chosen sequences' cross-entropy (lambda)")
    kto_beta: float = config_field(0.1, help="KTO: beta, the scale of the log-ratio against the KL baseline")
    kto_desirable_weight: float = config_field(1.0, help="KTO: the weight of the desirable examples' losses")
    kto_undesirable_weight: float = config_field(1.0, help="KTO: the weight of the undesirable examples' losses")
    kto_kl_chunk: int = config_field(
        8, help="KTO: rows per chunk of the file whose prompts take the previous row's completion for the KL "
                "baseline (TRL: per-device batch)")
    reward_center_coefficient: float = config_field(
        0.0, help="reward: add this weight times the squared sum of a pair's scores, centring them on 0 (TRL's "
                  "center_rewards_coefficient)")

    output_dir: str = config_field(section="Output, checkpoints and resume", help="folder for metrics, training_params.json and checkpoints")
    min_samples_per_checkpoint: int = config_field(
        0, help="samples between Hugging Face checkpoints (hf_format/samples_N; 0: none on the way); one is always "
                "written at the end")
    checkpoint_at_epoch: bool = config_field(
        False, help="also write a Hugging Face export (and full state) after the step that completes each epoch")
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
    export_text_only: bool = config_field(
        False, help="image-text-to-text checkpoints: export the language model alone, as a causal LM "
                    "(default: the whole checkpoint in its own class)")
    save_dtype: Literal["bfloat16", "float16", "float32", "auto"] = config_field(
        "bfloat16", help="Hugging Face exports' weight dtype (--no-lora-merge-on-export: the adapter's); auto: "
                         "the checkpoint's own, as stored")
    resume: bool = config_field(True, help="continue from the newest complete full-state checkpoint in "
                                           "--output-dir (--no-resume starts fresh)")
    resume_from: str | None = config_field(None, help="resume from this full_state/samples_N folder")
    allow_config_change: bool = config_field(
        False, help="resume even if training parameters changed (learning rate, schedule, batch, seed, data); "
                    "new values apply from the next step")

    validation_data_path: str | None = config_field(
        None, section="Validation", help="tokenized or raw data file or folder of held-out samples for the validation loss")
    validation_data_split: str | None = config_field(
        None, help="raw data: the split of a dataset folder --validation-data-path reads (default: its validation "
                   "split, else its test split)")
    validation_split: float | None = config_field(
        None, help="hold out this seeded fraction of --data-path for the validation loss (same rows on every "
                   "rank and after resume)")
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

    logging_level: str = config_field("INFO", section="Logging and tracking", help="DEBUG, INFO, WARNING, ERROR or CRITICAL (any case)")
    progress: str = config_field(
        "auto", choices=list(PROGRESS_MODES),
        help="bar (tqdm), lines (a log line every 30 s and each tenth of the run: for files, SLURM) or none; "
             "auto: bar on a terminal, else lines")
    wandb_project: str | None = config_field(None, help="also log every metrics line to this Weights & Biases "
                                                         "project (pip install wandb)")
    tensorboard_dir: str | None = config_field(None, help="also log every metrics line to TensorBoard in this "
                                                          "folder (pip install tensorboard)")
    mlflow_tracking_uri: str | None = config_field(
        None, help="also log every metrics line to MLflow at this URI: http://host:5000, sqlite:///mlflow.db, ... "
                   "(pip install mlflow-skinny)")
    mlflow_experiment: str | None = config_field(
        None, help="MLflow experiment name (turns MLflow on too, at MLFLOW_TRACKING_URI or MLflow's default store)")
    mlflow_run_name: str | None = config_field(None, help="MLflow run name (default: one MLflow makes up)")

    lora_rank: int = config_field(0, section="LoRA and QLoRA", help="LoRA rank r: train low-rank adapters on a frozen base model "
                                          "(0 = full fine-tuning)")
    lora_alpha: float | None = config_field(None, help="LoRA alpha; adapters are scaled by alpha / r "
                                                        "(default: 2 x --lora-rank)")
    lora_dropout: float = config_field(0.0, help="dropout on the adapters' input")
    lora_target_modules: str = config_field(
        ALL_LINEAR, help="comma-separated module names (e.g. q_proj,v_proj), or all-linear: every nn.Linear but "
                         "the LM head")
    lora_use_rslora: bool = config_field(False, help="rank-stabilised LoRA: scale by alpha / sqrt(r)")
    lora_merge_on_export: bool = config_field(
        True, help="exports hold the merged model plus adapter/ (--no-lora-merge-on-export: the adapter alone)")
    lora_quantize_data_type: Literal["none", "nf4"] = config_field(
        "none", help="QLoRA: nf4 stores the adapted layers' frozen base weights in 4-bit NormalFloat (torchao)")

    osft: bool = config_field(
        False, section="OSFT (Orthogonal Subspace Fine-Tuning)",
        help="freeze each targeted weight's top singular directions and train the rest, so the model "
             "forgets less (docs/osft.md)")
    osft_unfreeze_rank_ratio: float | None = config_field(
        None, help="fraction of each weight's singular directions that train, in [0, 1], e.g. 0.25 (required "
                   "with --osft; 1.0: full fine-tuning)")
    osft_target_patterns: str | None = config_field(
        None, help="comma-separated module names or globs to decompose (e.g. q_proj,*.mlp.down_proj; default: "
                   "every linear layer of the decoder blocks)")
    osft_upcast_dtype: Literal["float32", "float64"] = config_field(
        "float32", help="dtype of the start-up SVDs and of the export's W = U S V^T")

    fsdp_sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"] = config_field(
        "FULL_SHARD", section="Speed and memory", help="FULL_SHARD (ZeRO-3), SHARD_GRAD_OP (ZeRO-2), NO_SHARD (DDP-like), HYBRID_SHARD "
                           "(shard in a node, replicate across)")
    cpu_offload: bool = config_field(False, help="keep sharded params, grads and optimizer state in host memory")
    activation_checkpointing: Literal["full", "selective", "none", "auto"] | bool = config_field(
        "full", parse=_recomputation_policy, action=_FlagOrPolicy,
        help="recomputation in backward: full, selective (keeps matmuls, attention), none, auto (least that fits)")
    use_liger_kernels: bool = config_field(
        False, help="Liger fused linear cross-entropy plus RMSNorm/RoPE/SwiGLU kernels (CUDA; ignored on CPU; "
                    "with --compile only the loss)")
    head_learned_positions_only: bool = config_field(
        True, help="LM head and cross-entropy only on positions with a label: same loss and gradients, less work")
    compile: bool = config_field(
        False, help="torch.compile each decoder block (dynamic shapes); the first steps pay the compile time")

    skip_objective_check: bool = config_field(
        False, section="Debugging and safety nets", help="skip the start-up check that the trainer's loss equals the model's own forward(labels=...)")
    max_bad_steps: int = config_field(5, help="abort after this many consecutive steps with a non-finite "
                                              "loss or gradient norm (each one is skipped)")
    on_divergence: Literal["warn", "stop", "rewind"] = config_field(
        "stop", help="on a divergence: warn and go on, stop before exporting the diverged model, or "
                     "rewind to the last full state, skipping the batch")
    divergence_loss_factor: float = config_field(
        5.0, help="a loss above this many times the median of the last 20 steps (at least 1) diverged; 0: off")

    def __post_init__(self) -> None:
        self.logging_level = self.logging_level.upper()
        self.activation_checkpointing = as_policy(self.activation_checkpointing)
        errors = []
        if self.activation_checkpointing not in POLICIES:
            errors.append(f"--activation-checkpointing {self.activation_checkpointing!r} is not one of "
                          f"{', '.join(POLICIES)}")
        if self.max_tokens_per_gpu != "auto" and not (isinstance(self.max_tokens_per_gpu, int)
                                                       and self.max_tokens_per_gpu > 0):
            errors.append(f"--max-tokens-per-gpu must be a positive integer or 'auto', got {self.max_tokens_per_gpu!r}")
        if self.batch_size <= 0:
            errors.append(f"--batch-size must be positive, got {self.batch_size}")
        if self.min_samples_per_checkpoint < 0:
            errors.append("--min-samples-per-checkpoint must be positive (or 0: only the final export), got "
                          f"{self.min_samples_per_checkpoint}")
        for name in ("max_steps", "max_samples", "num_epochs"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                errors.append(f"--{name.replace('_', '-')} must be positive, got {value}")
        if not self.adam_eps > 0:
            errors.append(f"--adam-eps must be positive, got {self.adam_eps}")
        if self.num_warmup_steps < 0:
            errors.append(f"--num-warmup-steps must be non-negative, got {self.num_warmup_steps}")
        errors += _optimizer_errors(self)
        try:
            errors += [error for error in [self.optimizer_choice().method_error(self.fine_tuning_method())] if error]
        except ValueError as err:
            errors.append(str(err))
        if self.logging_level not in LOG_LEVELS:
            errors.append(f"--logging-level {self.logging_level!r} is not one of {', '.join(LOG_LEVELS)}")
        if self.lr_scheduler not in SCHEDULERS:
            errors.append(f"--lr-scheduler {self.lr_scheduler!r} is not one of {', '.join(SCHEDULERS)}")
        elif self.lr_scheduler not in SCHEDULERS_WITHOUT_TOTAL and not self.has_stop_condition:
            errors.append(f"--lr-scheduler {self.lr_scheduler} decays over a known number of steps: give "
                          "--max-steps, --max-samples or --num-epochs (sampling is infinite otherwise)")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            errors.append(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 < self.decay_fraction <= 1.0:
            errors.append(f"--decay-fraction must be in (0, 1], got {self.decay_fraction}")
        if self.num_data_workers < 0:
            errors.append("--num-data-workers must be >= 0")
        errors += _tokenizing_errors(self)
        if self.resume_from and not self.resume:
            errors.append("--resume-from and --no-resume contradict each other")
        if self.keep_last_n_checkpoints is not None and self.keep_last_n_checkpoints < 1:
            errors.append("--keep-last-n-checkpoints must be at least 1")
        if self.save_dtype not in SAVE_DTYPES:
            errors.append(f"--save-dtype {self.save_dtype!r} is not one of {', '.join(SAVE_DTYPES)}")
        if self.max_bad_steps < 1:
            errors.append("--max-bad-steps must be at least 1")
        if self.divergence_loss_factor != 0 and not self.divergence_loss_factor > 1:
            errors.append(f"--divergence-loss-factor must be above 1 (or 0: off), got {self.divergence_loss_factor}")
        errors += _policy_errors(self)
        if self.mlflow_run_name is not None and self.mlflow_tracking_uri is None and self.mlflow_experiment is None:
            errors.append("--mlflow-run-name needs --mlflow-tracking-uri or --mlflow-experiment (MLflow is off)")
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
        errors += _osft_errors(self)
        errors += _context_parallel_errors(self)
        errors += _objective_errors(self)
        collect_errors(errors)

    @property
    def osft_settings(self) -> OSFTSettings | None:
        if not self.osft:
            return None
        patterns = comma_list(self.osft_target_patterns) if self.osft_target_patterns else None
        return OSFTSettings(unfreeze_rank_ratio=self.osft_unfreeze_rank_ratio, target_patterns=patterns,
                            upcast_dtype=UPCAST_DTYPES[self.osft_upcast_dtype])

    @property
    def lora(self) -> LoraSettings | None:
        if self.lora_rank == 0:
            return None
        alpha = self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank
        return LoraSettings(rank=self.lora_rank, alpha=alpha, dropout=self.lora_dropout,
                            target_modules=self.lora_target_modules, use_rslora=self.lora_use_rslora,
                            merge_on_export=self.lora_merge_on_export,
                            quantize_data_type=self.lora_quantize_data_type)

    def fine_tuning_method(self) -> FineTuningMethod:
        """A new instance of the method the flags choose: the one place that picks it (``methods/base.py``)."""
        if self.osft_settings is not None:
            return OSFT(self.osft_settings)
        if self.lora is not None:
            return QLoRA(self.lora) if self.lora.quantize_data_type != "none" else LoRA(self.lora)
        return FineTuningMethod()

    def optimizer_choice(self) -> OptimizerChoice:
        """The optimizer the flags choose, with its ``--optimizer-args`` (``optim/registry.py``)."""
        return optimizer_choice(self.optimizer, self.optimizer_args)

    def training_objective(self) -> TrainingObjective:
        """A new instance of the objective the flags choose: the one place that picks it (``objectives/base.py``)."""
        if self.objective == "dpo":
            return DPOObjective(DPOSettings(beta=self.dpo_beta, loss=self.dpo_loss,
                                            label_smoothing=self.dpo_label_smoothing,
                                            sft_weight=self.dpo_sft_weight, reference_model=self.reference_model))
        if self.objective == "cpo":
            return CPOObjective(CPOSettings(loss=self.cpo_loss, beta=self.cpo_beta, alpha=self.cpo_alpha))
        if self.objective == "simpo":
            return CPOObjective(CPOSettings(loss="simpo", beta=self.simpo_beta, alpha=self.simpo_sft_weight,
                                            gamma=self.simpo_gamma))
        if self.objective == "orpo":
            return ORPOObjective(ORPOSettings(beta=self.orpo_beta))
        if self.objective == "reward":
            return RewardObjective(RewardSettings(center_coefficient=self.reward_center_coefficient))
        if self.objective == "kto":
            return KTOObjective(KTOSettings(beta=self.kto_beta, desirable_weight=self.kto_desirable_weight,
                                            undesirable_weight=self.kto_undesirable_weight,
                                            kl_chunk=self.kto_kl_chunk, reference_model=self.reference_model))
        return TrainingObjective()

    def tokenizing_config(self, input_file: str, *, output_dir: str, split: str | None = None) -> ProcessDataConfig:
        """process_data.py's settings for raw ``input_file``: this run's tokenizer and raw-data flags, the
        rest process_data.py's defaults (``data/cache.py`` writes under ``output_dir``); ``split``
        replaces ``--data-split`` (a validation source's)."""
        return tokenizing_config(self, input_file, output_dir=output_dir, split=split,
                                 allow_audit_failures=self.allow_audit_failures, logging_level=self.logging_level)

    @property
    def export_every(self) -> int:
        """Samples between Hugging Face exports on the way (0 asks for none: a cadence never reached)."""
        return self.min_samples_per_checkpoint or FINAL_EXPORT_ONLY

    @property
    def has_stop_condition(self) -> bool:
        return any(v is not None for v in (self.max_steps, self.max_samples, self.num_epochs))

    @property
    def has_validation(self) -> bool:
        return self.validation_data_path is not None or self.validation_split is not None


def _tokenizing_errors(config: TrainConfig) -> list[str]:
    """The raw-data flags, checked by process_data.py's own config."""
    try:
        config.tokenizing_config(config.data_path, output_dir=config.output_dir)
    except ValueError as err:
        return problems_of(err)
    return []


def _context_parallel_errors(config: TrainConfig) -> list[str]:
    """What --context-parallel-size cannot combine with yet (the model-dependent refusals come at start-up)."""
    size = config.context_parallel_size
    if size < 1:
        return [f"--context-parallel-size must be at least 1, got {size}"]
    if size == 1:
        return []
    refused = [(config.compile, "--compile (dynamo would trace the K/V all-gather of every attention call)"),
               (config.lora_quantize_data_type != "none",
                f"--lora-quantize-data-type {config.lora_quantize_data_type} (QLoRA: untested with sharded rows)"),
               (config.max_tokens_per_gpu == "auto",
                "--max-tokens-per-gpu auto (the probe measures unsharded rows): give the per-GPU budget")]
    return [f"--context-parallel-size {size} does not combine with {what} yet" for bad, what in refused if bad]


def _objective_errors(config: TrainConfig) -> list[str]:
    """The preference flags: each objective's own only with it, and in range."""
    errors = []
    for field in dataclasses.fields(config):
        owners = [owner for owner, names in OBJECTIVE_FIELDS.items() if field.name in names]
        if owners and config.objective not in owners and getattr(config, field.name) != field.default:
            errors.append(f"--{field.name.replace('_', '-')} needs --objective {' or '.join(owners)}")
    if config.objective == "kto":
        errors += _kto_errors(config)
    elif config.objective == "reward":
        coefficient = config.reward_center_coefficient
        if not (math.isfinite(coefficient) and coefficient >= 0):
            errors.append(f"--reward-center-coefficient must be non-negative, got {coefficient}")
    elif config.objective not in PAIR_OBJECTIVES:
        return errors
    beta = getattr(config, f"{config.objective}_beta", None)
    if beta is not None and not (math.isfinite(beta) and beta > 0):
        errors.append(f"--{config.objective}-beta must be positive, got {beta}")
    weight = {"dpo": "dpo_sft_weight", "cpo": "cpo_alpha", "simpo": "simpo_sft_weight"}.get(config.objective)
    if weight is not None and not (math.isfinite(getattr(config, weight)) and getattr(config, weight) >= 0):
        errors.append(f"--{weight.replace('_', '-')} must be non-negative, got {getattr(config, weight)}")
    if config.objective == "simpo" and not math.isfinite(config.simpo_gamma):
        errors.append(f"--simpo-gamma must be finite, got {config.simpo_gamma}")
    if config.objective == "dpo":
        if not 0.0 <= config.dpo_label_smoothing < 0.5:
            errors.append(f"--dpo-label-smoothing must be in [0, 0.5), got {config.dpo_label_smoothing}")
        elif config.dpo_label_smoothing and config.dpo_loss != "sigmoid":
            errors.append(f"--dpo-label-smoothing applies to --dpo-loss sigmoid, not {config.dpo_loss}")
    refused = [(config.context_parallel_size > 1, f"--context-parallel-size {config.context_parallel_size} (a "
                                                  "pair's sums would span ranks)"),
               (_is_mix(config.data_path), "a data mix (one preference file per run)")]
    errors += [f"--objective {config.objective} does not combine with {what} yet" for bad, what in refused if bad]
    return errors


def _kto_errors(config: TrainConfig) -> list[str]:
    errors = [f"--{name.replace('_', '-')} must be positive, got {getattr(config, name)}"
              for name in ("kto_desirable_weight", "kto_undesirable_weight")
              if not (math.isfinite(getattr(config, name)) and getattr(config, name) > 0)]
    if config.kto_kl_chunk < 2:
        errors.append(f"--kto-kl-chunk must be at least 2, got {config.kto_kl_chunk}: a chunk of one row pairs its "
                      "prompt with its own completion, and the KL baseline becomes its reward")
    return errors


def _is_mix(data_path: str) -> bool:
    try:
        return parse_data_spec(data_path) is not None
    except ValueError:  # a malformed mix: start-up names its problem
        return True


def _optimizer_errors(config: TrainConfig) -> list[str]:
    """Optimizer numbers must be finite and non-negative: ``nan`` passes every ``< 0`` check, and a
    NaN or infinite learning rate would otherwise fail inside torch (or train to NaN) after the model loads."""
    errors = []
    for name in ("learning_rate", "weight_decay", "max_grad_norm"):
        value = getattr(config, name)
        if not (math.isfinite(value) and value >= 0):
            errors.append(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
    if not all(math.isfinite(beta) and 0 <= beta < 1 for beta in config.adam_betas):
        errors.append(f"--adam-betas must be two numbers in [0, 1), got {config.adam_betas}")
    return errors


def _policy_errors(config: TrainConfig) -> list[str]:
    """Validation, checkpoint-policy and resume flags."""
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


def _osft_errors(config: TrainConfig) -> list[str]:
    """--osft flags: the ratio is required and in [0, 1]; what OSFT does not combine with, one line each."""
    if not config.osft:
        given = [flag for flag, value in (("--osft-unfreeze-rank-ratio", config.osft_unfreeze_rank_ratio),
                                          ("--osft-target-patterns", config.osft_target_patterns)) if value is not None]
        return [f"{', '.join(given)} only apply with --osft"] if given else []
    errors = []
    if config.osft_unfreeze_rank_ratio is None:
        errors.append("--osft needs --osft-unfreeze-rank-ratio (the fraction of directions that train, e.g. 0.25)")
    else:
        try:
            num_frozen_directions(2, 2, config.osft_unfreeze_rank_ratio)
        except ValueError as err:
            errors.append(str(err))
    if config.lora_rank:
        errors.append("--osft with --lora-rank: OSFT trains the weights' own low singular directions, LoRA adds "
                      "adapters to frozen weights; choose one")
    if config.compile:
        # Not yet proven: the factor layer's token-count branch and the post-step projections are untested
        # under dynamo.
        errors.append("--osft with --compile is not supported yet: drop --compile")
    return errors
