"""training_hub's parameters of ``sft``, ``osft`` and ``lora_sft``, each honoured as our setting or refused.

Pure: the parameters an algorithm hands its backend go in, a ``Translation`` comes out (``TrainConfig`` fields,
``TorchrunArgs`` fields, the workers' environment, the launcher's own settings) with one line per parameter
we cannot honour. Nothing is dropped: a name this table does not know is refused too, unless it is one of
``TrainConfig``'s own fields, which passes as itself (``osft(..., max_steps=100, backend="minitrainer")``).

A parameter left out takes the default the algorithm's own backend would have used (``ALGORITHM_DEFAULTS``:
mini_trainer 0.9's API for ``osft``, instructlab-training's for ``sft``, the Unsloth backend's for ``lora_sft``),
so switching ``backend=`` changes the engine, not the recipe. docs/training-hub.md lists the table.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any

from minitrainer.common.translations import (BF16, FINAL_EXPORT, MIN_LR_ONLY, NO_FP16, NO_TF32, PACKED, Rule,
                                            Translation, accepted_when, refused, to)
from minitrainer.train_config import TrainConfig

ALGORITHMS = ("sft", "osft", "lora_sft")
TORCHRUN_KEYS = ("nproc_per_node", "nnodes", "node_rank", "rdzv_id", "rdzv_endpoint", "master_addr", "master_port")
LAUNCHER_KEYS = ("callbacks", "logging_steps")

ALGORITHM_DEFAULTS: dict[str, dict[str, Any]] = {
    # mini_trainer 0.9's TrainingArgs, which the hub's own osft backend fills.
    "osft": {"lr_scheduler": "cosine", "warmup_steps": 0, "num_epochs": 1, "seed": 42},
    # instructlab-training 0.16's TrainingArgs and its launcher's --lr_scheduler.
    "sft": {"lr_scheduler": "cosine", "warmup_steps": 0, "num_epochs": 1, "seed": 42, "checkpoint_at_epoch": True,
            "accelerate_full_state_at_epoch": True},
    # The hub's Unsloth backend (its TRL SFTConfig), AdamW's betas being transformers' defaults.
    "lora_sft": {"num_epochs": 3, "max_seq_len": 2048, "learning_rate": 2e-4, "weight_decay": 0.01,
                 "max_grad_norm": 0.3, "warmup_steps": 10, "lr_scheduler": "linear", "save_steps": 500,
                 "save_total_limit": 3, "seed": 3407, "micro_batch_size": 2, "gradient_accumulation_steps": 1},
}
OUR_DEFAULTS: dict[str, dict[str, Any]] = {"lora_sft": {"adam_betas": (0.9, 0.999)}}
TRACKER_VARIABLES = {"mlflow_tracking_uri": "MLFLOW_TRACKING_URI", "mlflow_experiment_name": "MLFLOW_EXPERIMENT_NAME",
                     "mlflow_run_name": "MLFLOW_RUN_NAME", "wandb_project": "WANDB_PROJECT",
                     "wandb_entity": "WANDB_ENTITY", "wandb_run_name": "WANDB_RUN_NAME"}
"""The tracker parameters the hub's own backends take from these variables when a call leaves them out (how
a platform turns tracking on for every job)."""


def _torchrun(name: str) -> Rule:
    def rule(value, params, out):
        out.torchrun[name] = str(value) if name == "rdzv_id" else value
    return rule


def _launcher(name: str) -> Rule:
    def rule(value, params, out):
        out.launcher[name] = value
    return rule


def _env(name: str) -> Rule:
    def rule(value, params, out):
        out.env[name] = str(value)
    return rule


def _betas(value, params, out):
    out.train["adam_betas"] = (params.get("beta1", 0.9), params.get("beta2", 0.95))


def _osft_ratio(value, params, out):
    out.train.update(osft=True, osft_unfreeze_rank_ratio=float(value))


def _every_n_steps_in_samples(name: str) -> Rule:
    """A step count as samples: each optimizer step takes exactly ``effective_batch_size`` samples."""
    def rule(value, params, out):
        if value <= 0:
            return f"must be positive ({FINAL_EXPORT}), got {value}"
        out.train[name] = value * _batch_size(params)
    return rule


def _batch_size(params: dict) -> int:
    """``effective_batch_size``, or what the Unsloth backend makes of its per-device parameters."""
    if params.get("effective_batch_size") is not None:
        return params["effective_batch_size"]
    world = params.get("nnodes") or 1
    nproc = params.get("nproc_per_node") or 1
    if isinstance(nproc, str):
        import torch

        nproc = torch.cuda.device_count() or os.cpu_count() or 1
    return (params.get("micro_batch_size") or 1) * (params.get("gradient_accumulation_steps") or 1) * nproc * world


def _per_device_batch(value, params, out):
    if params.get("effective_batch_size") is not None:
        return ("effective_batch_size decides the samples per step; each step's minibatches are packed under "
                "max_tokens_per_gpu, so drop it")
    out.train["batch_size"] = _batch_size(params)


def _pretraining(value, params, out):
    if not value:
        return None
    if params.get("unmask_messages"):
        return "is_pretraining=True learns whole documents: drop unmask_messages"
    if params.get("block_size") is None:
        return "is_pretraining=True needs block_size (the tokens of each training row)"
    out.train.update(input_format="text", columns=f"text={params.get('document_column_name') or 'document'}",
                     max_sample_num_tokens=params["block_size"], split_long_text=True)


def _used_by_pretraining(value, params, out):
    if not params.get("is_pretraining"):
        return "only with is_pretraining=True"


def _dataset_type(value, params, out):
    formats = {"chat_template": "messages", "alpaca": "alpaca", "passthrough": "auto"}
    if value not in formats:
        return f"one of {', '.join(formats)}"
    out.train["input_format"] = formats[value]


def _column(name: str) -> Rule:
    def rule(value, params, out):
        if value != name:
            out.launcher.setdefault("columns", []).append(f"{name}={value}")
    return rule


def _target_modules(value, params, out):
    if value:
        out.train["lora_target_modules"] = ",".join(value)


def _flash_attention(value, params, out):
    # auto picks flash attention where the package and a GPU are there, and the fastest other kernel elsewhere.
    out.train["attn_implementation"] = "auto" if value else "sdpa"


RULES: dict[str, Rule] = {
    # where the data, model and results are
    "model_path": to("model_name_or_path"),
    "data_path": to("data_path"),
    "ckpt_output_dir": to("output_dir"),
    "data_output_dir": to("tokenized_data_dir"),
    "use_processed_dataset": _launcher("use_processed_dataset"),
    "unmask_messages": accepted_when(lambda v: not v, "we learn assistant turns only (and whole text rows); "
                                                      "write the rows to learn in full as text rows"),
    "max_seq_len": to("max_sample_num_tokens"),
    "is_pretraining": _pretraining,
    "block_size": _used_by_pretraining,
    "document_column_name": _used_by_pretraining,
    "dataset_type": _dataset_type,
    "field_messages": _column("messages"),
    "field_instruction": _column("instruction"),
    "field_input": _column("input"),
    "field_output": _column("output"),
    "eval_data_path": to("validation_data_path"),
    "per_device_eval_batch_size": refused("validation is packed under max_tokens_per_gpu like training; drop it"),
    # batch, schedule, optimizer, stop
    "effective_batch_size": to("batch_size"),
    "micro_batch_size": _per_device_batch,
    "gradient_accumulation_steps": _per_device_batch,
    "max_tokens_per_gpu": to("max_tokens_per_gpu"),
    "max_batch_len": to("max_tokens_per_gpu"),
    "learning_rate": to("learning_rate"),
    "lr_scheduler": to("lr_scheduler"),
    "lr_scheduler_kwargs": accepted_when(
        lambda v: not v or set(v) <= {"min_lr_rate"},
        MIN_LR_ONLY,
        lambda v, p, out: out.train.update({"min_lr_ratio": float(v["min_lr_rate"])} if v else {})),
    "warmup_steps": to("num_warmup_steps"),
    "num_epochs": to("num_epochs", float),
    "seed": to("seed"),
    "beta1": _betas,
    "beta2": _betas,
    "eps": to("adam_eps"),
    "weight_decay": to("weight_decay"),
    "max_grad_norm": to("max_grad_norm"),
    # how the model is trained
    "unfreeze_rank_ratio": _osft_ratio,
    "target_patterns": to("osft_target_patterns", ",".join),
    "use_liger": to("use_liger_kernels"),
    "trust_remote_code": to("trust_remote_code"),
    "flash_attention": _flash_attention,
    "sample_packing": accepted_when(bool, PACKED),
    "bf16": accepted_when(bool, BF16),
    "fp16": accepted_when(lambda v: not v, NO_FP16),
    "tf32": refused(NO_TF32),
    "enable_model_splitting": accepted_when(lambda v: not v, "FSDP2 already shards the model over every rank"),
    "finetune_vision_layers": accepted_when(lambda v: not v, "the language model is trained, the vision tower "
                                                             "kept as it is"),
    "finetune_language_layers": accepted_when(bool, "the language model is what is trained"),
    # LoRA and QLoRA
    "lora_r": to("lora_rank"),
    "lora_alpha": to("lora_alpha", float),
    "lora_dropout": to("lora_dropout"),
    "target_modules": _target_modules,
    "use_rslora": to("lora_use_rslora"),
    "load_in_4bit": lambda v, p, out: out.train.update({"lora_quantize_data_type": "nf4"} if v else {}),
    "load_in_8bit": accepted_when(lambda v: not v, "the frozen base is quantized to NF4 only: load_in_4bit=True"),
    "bnb_4bit_quant_type": accepted_when(lambda v: v == "nf4", "NF4 is the only 4-bit type (torchao)"),
    "bnb_4bit_compute_dtype": refused("the adapters compute in the training dtype (bfloat16 on GPUs)"),
    "bnb_4bit_use_double_quant": accepted_when(lambda v: not v, "NF4 scales are not quantized again"),
    "use_dora": accepted_when(lambda v: not v, "DoRA is not offered; plain LoRA or use_rslora"),
    "init_lora_weights": accepted_when(lambda v: v is True, "adapters start as peft's default (B = 0)"),
    "loftq_config": refused("LoftQ initialisation is not offered"),
    "rank_pattern": refused("one rank for every target module: lora_r"),
    "alpha_pattern": refused("one alpha for every target module: lora_alpha"),
    "peft_enabled": accepted_when(bool, "lora_sft trains LoRA adapters"),
    "peft_type": accepted_when(lambda v: v == "lora", "LoRA is the adapter type offered"),
    # checkpoints and resume
    "save_samples": lambda v, p, out: out.train.update(min_samples_per_checkpoint=max(v, 0)),
    "save_steps": _every_n_steps_in_samples("min_samples_per_checkpoint"),
    "checkpoint_at_epoch": to("checkpoint_at_epoch"),
    "save_total_limit": to("keep_last_n_checkpoints"),
    "accelerate_full_state_at_epoch": to("full_state"),
    "save_final_checkpoint": accepted_when(bool, FINAL_EXPORT),
    "save_model": accepted_when(bool, FINAL_EXPORT),
    "enable_jit_checkpoint": lambda v, p, out: None,  # a SIGTERM or SIGINT always saves the full state and stops
    "on_demand_checkpointing": lambda v, p, out: None,
    "checkpoint_storage": accepted_when(lambda v: v in ("", "pvc"), "checkpoints are written to ckpt_output_dir "
                                                                     "only; copy it to remote storage yourself"),
    "eval_steps": lambda v, p, out: out.train.update(validation_every_n_steps=v),
    # tracking
    "wandb_project": to("wandb_project"),
    "wandb_entity": _env("WANDB_ENTITY"),
    "wandb_run_name": _env("WANDB_NAME"),
    "tensorboard_log_dir": to("tensorboard_dir"),
    "mlflow_tracking_uri": to("mlflow_tracking_uri"),
    "mlflow_experiment_name": to("mlflow_experiment"),
    "mlflow_run_name": to("mlflow_run_name"),
    # the launcher's
    **{name: _torchrun(name) for name in TORCHRUN_KEYS},
    "callbacks": _launcher("callbacks"),
    "logging_steps": _launcher("logging_steps"),
}

ONLY_FOR = {
    **dict.fromkeys(("unfreeze_rank_ratio", "target_patterns"), "osft"),
    **dict.fromkeys(("lora_r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "load_in_4bit",
                     "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_compute_dtype", "bnb_4bit_use_double_quant",
                     "use_dora", "init_lora_weights", "loftq_config", "rank_pattern", "alpha_pattern", "peft_enabled",
                     "peft_type"), "lora_sft"),
}
"""Parameters of one algorithm: another's backend refuses them, naming it."""

# Applied after the others: they read what the rest resolved.
_ORDER_LAST = ("micro_batch_size", "gradient_accumulation_steps", "save_steps", "is_pretraining", "field_messages",
               "field_instruction", "field_input", "field_output")


def translate(algorithm: str, params: dict[str, Any], environ: dict[str, str] | None = None) -> Translation:
    """What ``params`` (the dict training_hub's ``algorithm`` passes ``Backend.execute_training``) means for us.

    ``None`` is a parameter not given: the algorithm's default (``ALGORITHM_DEFAULTS``), else ours; a tracker
    parameter not given is read from ``environ`` (``TRACKER_VARIABLES``) as the hub's backends do.
    """
    assert algorithm in ALGORITHMS, algorithm
    from_environment = {name: environ[variable] for name, variable in TRACKER_VARIABLES.items()
                        if environ and environ.get(variable)}
    given = {**from_environment, **{name: value for name, value in params.items() if value is not None}}
    if algorithm == "lora_sft" and "effective_batch_size" in given:
        defaults = {k: v for k, v in ALGORITHM_DEFAULTS[algorithm].items()
                    if k not in ("micro_batch_size", "gradient_accumulation_steps")}
    else:
        defaults = ALGORITHM_DEFAULTS[algorithm]
    values = {**defaults, **given}
    out = Translation(train=dict(OUR_DEFAULTS.get(algorithm, {})))
    fields = {f.name for f in dataclasses.fields(TrainConfig) if f.init}
    for name in sorted(values, key=lambda n: n in _ORDER_LAST):
        value = values[name]
        if name in RULES:
            if ONLY_FOR.get(name, algorithm) != algorithm:
                reason = f"a parameter of {ONLY_FOR[name]}, not of {algorithm}"
            else:
                reason = RULES[name](value, values, out)
        elif name in fields:
            out.train[name] = value
            reason = None
        else:
            close = difflib.get_close_matches(name, [*RULES, *fields], n=1)
            reason = "not a parameter this backend knows" + (f" (did you mean {close[0]}?)" if close else "")
        if reason is not None:
            out.refusals.append(f"{algorithm}(..., {name}={value!r}) with backend='minitrainer': {reason}")
    if "columns" in out.launcher:
        out.train["columns"] = ",".join(out.launcher.pop("columns"))
    if not any(name in out.train for name in ("num_epochs", "max_steps", "max_samples")):
        out.train["num_epochs"] = 1.0
    return out
