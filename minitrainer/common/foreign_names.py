"""Other tools' setting names and ours: a TRL, axolotl or mini_trainer 0.9 config brought here is answered key by key.

    train.py --num_train_epochs 2
    train.py: error: --num_train_epochs is TRL's and Hugging Face's name; ours is --num-epochs

An unknown flag or config-file key found in ``FOREIGN_NAMES`` is refused with our equivalent, or with why we have
none, before any did-you-mean guess (which offered ``data_subset`` for ``dataset_name``). A name that is one of our
own fields is ours and is not listed. Pure data: ``tests/test_foreign_names.py`` checks every name against the
peers' real config classes, every target against our config classes, and renders docs/coming-from.md from it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from minitrainer.common.translations import BF16, FINAL_EXPORT, FLOAT32_STATE, NO_FP16, NO_TF32, NO_TOKEN_STOP, PACKED

TRL = "TRL"
"""SFTConfig, DPOConfig, RewardConfig and a ``trl sft --config`` file's ScriptArguments and ModelConfig keys."""
OLD_TRL = "older TRL"
"""TRL before 0.20 on transformers 4 (``max_seq_length``, ``warmup_ratio``): the configs written then."""
HF = "Hugging Face"
"""transformers' TrainingArguments, which TRL's configs extend."""
AXOLOTL = "axolotl"
"""axolotl's config file (``AxolotlInputConfig``)."""
MINI_TRAINER = "mini_trainer 0.9"
"""mini_trainer 0.9's ``TrainingArgs`` (our ``minitrainer.compat.mini_trainer`` takes it as it is)."""
PEERS = (TRL, OLD_TRL, HF, AXOLOTL, MINI_TRAINER)


@dataclass(frozen=True)
class Foreign:
    """Whose name it is, the field(s) of ours that do its job (empty: none), and how they differ or why we have none."""

    whose: tuple[str, ...]
    ours: tuple[str, ...] = ()
    note: str = ""


def _f(whose: str | tuple[str, ...], ours: str | tuple[str, ...] = (), note: str = "") -> Foreign:
    return Foreign((whose,) if isinstance(whose, str) else whose, (ours,) if isinstance(ours, str) else ours, note)


TRAINING_ARGUMENTS = (TRL, HF)
_BATCH = ("samples per optimizer step, whole job: per-device batch x accumulation x GPUs; minibatches are packed "
          "under --max-tokens-per-gpu")
_LOGGED = "every step is logged to training_metrics_<rank>.jsonl"
_PAIR_LENGTH = "one limit on a whole pair (prompt and both replies); longer pairs are counted and dropped, not truncated"
_ASSISTANT_ONLY = "always: chat rows learn the assistant turns only, text rows every token"
_CHECKPOINT_STEPS = "in samples, not steps: steps x --batch-size"
_TRACKERS = "a tracker is on when its setting is given"
_HUB_UPLOAD = "exports are written to <output-dir>/hf_format; upload them yourself"

FOREIGN_NAMES: dict[str, Foreign] = {
    # ---- transformers' TrainingArguments (TRL's SFTConfig and DPOConfig extend it)
    "num_train_epochs": _f(TRAINING_ARGUMENTS, "num_epochs"),
    "per_device_train_batch_size": _f(TRAINING_ARGUMENTS, "batch_size", _BATCH),
    "gradient_accumulation_steps": _f((*TRAINING_ARGUMENTS, AXOLOTL), "batch_size", _BATCH),
    "per_device_eval_batch_size": _f(TRAINING_ARGUMENTS, note="validation is packed under --max-tokens-per-gpu "
                                                              "like training"),
    "warmup_steps": _f((*TRAINING_ARGUMENTS, AXOLOTL), "num_warmup_steps"),
    "warmup_ratio": _f((OLD_TRL, AXOLOTL), "num_warmup_steps", "in steps, not a fraction of the run"),
    "lr_scheduler_type": _f(TRAINING_ARGUMENTS, "lr_scheduler"),
    "lr_scheduler_kwargs": _f((*TRAINING_ARGUMENTS, AXOLOTL, MINI_TRAINER), "min_lr_ratio",
                              "only min_lr_rate is taken, as --min-lr-ratio; --lr-scheduler names the shape"),
    "logging_steps": _f((*TRAINING_ARGUMENTS, AXOLOTL), note=_LOGGED),
    "logging_strategy": _f(TRAINING_ARGUMENTS, note=_LOGGED),
    "logging_first_step": _f(TRAINING_ARGUMENTS, note=_LOGGED),
    "log_level": _f(TRAINING_ARGUMENTS, "logging_level"),
    "report_to": _f(TRAINING_ARGUMENTS, ("wandb_project", "tensorboard_dir", "mlflow_tracking_uri"), _TRACKERS),
    "run_name": _f(TRAINING_ARGUMENTS, "mlflow_run_name", "for Weights & Biases set WANDB_NAME"),
    "save_steps": _f((*TRAINING_ARGUMENTS, AXOLOTL), "min_samples_per_checkpoint", _CHECKPOINT_STEPS),
    "save_strategy": _f((*TRAINING_ARGUMENTS, AXOLOTL), ("min_samples_per_checkpoint", "checkpoint_at_epoch")),
    "save_total_limit": _f((*TRAINING_ARGUMENTS, AXOLOTL), "keep_last_n_checkpoints"),
    "save_only_model": _f((*TRAINING_ARGUMENTS, AXOLOTL), "full_state", "--no-full-state writes exports only"),
    "eval_steps": _f((*TRAINING_ARGUMENTS, AXOLOTL), "validation_every_n_steps"),
    "eval_strategy": _f((*TRAINING_ARGUMENTS, AXOLOTL), ("validation_every_n_steps", "validation_every_n_samples")),
    "load_best_model_at_end": _f((*TRAINING_ARGUMENTS, AXOLOTL), "save_best_val_loss", "the best export is kept in "
                                                                          "hf_format/best/"),
    "metric_for_best_model": _f((*TRAINING_ARGUMENTS, AXOLOTL), "save_best_val_loss", "the best is by validation loss"),
    "resume_from_checkpoint": _f((*TRAINING_ARGUMENTS, AXOLOTL), "resume_from",
                                 "by default --resume continues from the newest full state in --output-dir"),
    "data_seed": _f(TRAINING_ARGUMENTS, "seed", "one seed for everything"),
    "bf16": _f((*TRAINING_ARGUMENTS, AXOLOTL), note=BF16),
    "fp16": _f((*TRAINING_ARGUMENTS, AXOLOTL), note=NO_FP16),
    "tf32": _f((*TRAINING_ARGUMENTS, AXOLOTL), note=NO_TF32),
    "gradient_checkpointing": _f((*TRAINING_ARGUMENTS, AXOLOTL), "activation_checkpointing"),
    "gradient_checkpointing_kwargs": _f((*TRAINING_ARGUMENTS, AXOLOTL), "activation_checkpointing",
                                        "full, selective, none or auto"),
    "activation_checkpointing_kwargs": _f(TRAINING_ARGUMENTS, "activation_checkpointing",
                                          "full, selective, none or auto"),
    "adam_beta1": _f((*TRAINING_ARGUMENTS, AXOLOTL), "adam_betas", "the pair: --adam-betas B1 B2"),
    "adam_beta2": _f((*TRAINING_ARGUMENTS, AXOLOTL), "adam_betas", "the pair: --adam-betas B1 B2"),
    "adam_epsilon": _f((*TRAINING_ARGUMENTS, AXOLOTL), "adam_eps"),
    "optim": _f(TRAINING_ARGUMENTS, "optimizer", "adamw, adamw_8bit, adamw_4bit, sgd, adafactor or muon"),
    "use_liger_kernel": _f(TRAINING_ARGUMENTS, "use_liger_kernels"),
    "torch_compile": _f((*TRAINING_ARGUMENTS, AXOLOTL), "compile"),
    "dataloader_num_workers": _f((*TRAINING_ARGUMENTS, AXOLOTL), "num_data_workers"),
    "fsdp": _f((*TRAINING_ARGUMENTS, AXOLOTL), "fsdp_sharding_strategy", "FSDP2 always shards; this picks how"),
    "fsdp_config": _f((*TRAINING_ARGUMENTS, AXOLOTL), ("fsdp_sharding_strategy", "cpu_offload")),
    "deepspeed": _f((*TRAINING_ARGUMENTS, AXOLOTL), "fsdp_sharding_strategy", "FSDP2 shards the model, not "
                                                                             "DeepSpeed: FULL_SHARD is ZeRO-3"),
    "do_eval": _f(TRAINING_ARGUMENTS, ("validation_data_path", "validation_split"),
                  "validation runs when held-out data is given"),
    "push_to_hub": _f(TRAINING_ARGUMENTS, note=_HUB_UPLOAD),
    "hub_model_id": _f((*TRAINING_ARGUMENTS, AXOLOTL), note=_HUB_UPLOAD),
    "neftune_noise_alpha": _f((*TRAINING_ARGUMENTS, AXOLOTL), note="NEFTune is not offered"),
    # ---- TRL's SFTConfig (and, tagged OLD_TRL, the names of TRL 0.19 on transformers 4 since renamed or dropped)
    "max_length": _f(TRL, "max_sample_num_tokens",
                     "longer samples are dropped (and counted), not truncated; --split-long-text cuts long "
                     "text rows into pieces"),
    "packing": _f(TRL, note=PACKED),
    "packing_strategy": _f(TRL, note=PACKED),
    "truncation_mode": _f(TRL, "max_sample_num_tokens", "longer samples are dropped (and counted), not truncated"),
    "padding_free": _f(TRL, note=PACKED),
    "dataset_text_field": _f(TRL, "columns", "--columns text=FIELD"),
    "dataset_num_proc": _f((TRL, AXOLOTL), "num_proc"),
    "completion_only_loss": _f(TRL, note=_ASSISTANT_ONLY),
    "assistant_only_loss": _f(TRL, note=_ASSISTANT_ONLY),
    "chat_template_path": _f(TRL, "chat_template"),
    "model_init_kwargs": _f(TRL, ("attn_implementation", "trust_remote_code"),
                            "weights load in float32, the model's own settings kept"),
    "max_seq_length": _f(OLD_TRL, "max_sample_num_tokens",
                         "longer samples are dropped (and counted), not truncated; --split-long-text cuts long "
                         "text rows into pieces"),
    "logging_dir": _f(OLD_TRL, "tensorboard_dir"),
    "overwrite_output_dir": _f(OLD_TRL, "resume", "a run continues in its --output-dir; --no-resume starts over"),
    "torch_dtype": _f(OLD_TRL, note=FLOAT32_STATE),
    "max_prompt_length": _f(OLD_TRL, "max_sample_num_tokens", _PAIR_LENGTH),
    "max_completion_length": _f(OLD_TRL, "max_sample_num_tokens", _PAIR_LENGTH),
    # ---- TRL's DPOConfig
    "beta": _f(TRL, ("dpo_beta", "cpo_beta", "simpo_beta", "orpo_beta", "kto_beta"),
               "each preference objective's own: --dpo-beta with --objective dpo, and so on"),
    "loss_type": _f(TRL, ("dpo_loss", "dpo_sft_weight"),
                    "sigmoid, ipo or hinge; [sigmoid, sft] with weights [1, a] is --dpo-sft-weight a"),
    "precompute_ref_log_probs": _f(TRL, note="always: before step 1, stored beside the data and reused"),
    "label_smoothing": _f(TRL, "dpo_label_smoothing", "conservative DPO on the sigmoid loss"),
    "sync_ref_model": _f(TRL, note="the reference is fixed (TR-DPO's moving reference is not offered)"),
    # ---- TRL's RewardConfig
    "center_rewards_coefficient": _f(TRL, "reward_center_coefficient", "0 (not None) leaves the term out"),
    "rpo_alpha": _f((OLD_TRL, AXOLOTL), "dpo_sft_weight", "RPO's alpha; TRL 1.16 writes it as loss_type [sigmoid, sft]"),
    # ---- TRL's ScriptArguments (the dataset of a `trl sft --config` file)
    "dataset_name": _f(TRL, ("data_path", "input_file")),
    "dataset_config": _f(TRL, ("data_subset", "subset")),
    "dataset_train_split": _f(TRL, ("data_split", "split")),
    "dataset_test_split": _f(TRL, "validation_data_split"),
    "dataset_streaming": _f(TRL, note="raw data is always streamed and tokenized once"),
    # ---- TRL's ModelConfig
    "use_peft": _f(TRL, "lora_rank", "LoRA is on when --lora-rank is above 0"),
    "lora_r": _f((TRL, AXOLOTL), "lora_rank"),
    "use_rslora": _f(TRL, "lora_use_rslora"),
    "use_dora": _f(TRL, note="DoRA is not offered; plain LoRA or --lora-use-rslora"),
    "load_in_4bit": _f((TRL, AXOLOTL), "lora_quantize_data_type", "nf4"),
    "load_in_8bit": _f((TRL, AXOLOTL), "lora_quantize_data_type", "the frozen base is quantized to NF4 only"),
    "bnb_4bit_quant_type": _f(TRL, "lora_quantize_data_type", "nf4 only"),
    "dtype": _f(TRL, note=FLOAT32_STATE),
    # ---- axolotl
    "base_model": _f(AXOLOTL, "model_name_or_path"),
    "datasets": _f(AXOLOTL, ("data_path", "input_file"), "several sources mix as a:0.7,b:0.3 or a mix file"),
    "dataset_prepared_path": _f(AXOLOTL, "tokenized_data_dir"),
    "dataset_processes": _f(AXOLOTL, "num_proc"),
    "val_set_size": _f(AXOLOTL, "validation_split", "a fraction"),
    "test_datasets": _f(AXOLOTL, "validation_data_path"),
    "sequence_len": _f(AXOLOTL, "max_sample_num_tokens",
                       "longer samples are dropped (and counted), not truncated; --split-long-text cuts long "
                       "text rows into pieces"),
    "sample_packing": _f(AXOLOTL, note=PACKED),
    "pad_to_sequence_len": _f(AXOLOTL, note=PACKED),
    "micro_batch_size": _f(AXOLOTL, "batch_size", _BATCH),
    "train_on_inputs": _f(AXOLOTL, note="we learn assistant turns only (text rows: every token)"),
    "adapter": _f(AXOLOTL, ("lora_rank", "lora_quantize_data_type"), "lora: --lora-rank R; qlora: also nf4"),
    "lora_target_linear": _f(AXOLOTL, "lora_target_modules", "all-linear"),
    "flash_attention": _f(AXOLOTL, "attn_implementation", "flash_attention_2; auto picks it where it can"),
    "sdp_attention": _f(AXOLOTL, "attn_implementation", "sdpa"),
    "saves_per_epoch": _f(AXOLOTL, ("min_samples_per_checkpoint", "checkpoint_at_epoch"), "in samples"),
    "evals_per_epoch": _f(AXOLOTL, ("validation_every_n_samples", "validation_every_n_steps")),
    "auto_resume_from_checkpoints": _f(AXOLOTL, "resume", "on by default"),
    "wandb_name": _f(AXOLOTL, note="set WANDB_NAME"),
    "wandb_entity": _f((AXOLOTL, MINI_TRAINER), note="set WANDB_ENTITY"),
    "mlflow_experiment_name": _f((AXOLOTL, MINI_TRAINER), "mlflow_experiment"),
    "use_tensorboard": _f(AXOLOTL, "tensorboard_dir"),
    "use_wandb": _f(AXOLOTL, "wandb_project", _TRACKERS),
    "use_mlflow": _f(AXOLOTL, "mlflow_tracking_uri", _TRACKERS),
    "eval_batch_size": _f(AXOLOTL, note="validation is packed under --max-tokens-per-gpu like training"),
    "cosine_min_lr_ratio": _f(AXOLOTL, "min_lr_ratio"),
    "xformers_attention": _f(AXOLOTL, "attn_implementation"),
    "flex_attention": _f(AXOLOTL, "attn_implementation"),
    "chat_template_jinja": _f(AXOLOTL, "chat_template", "a jinja file"),
    "peft_use_rslora": _f(AXOLOTL, "lora_use_rslora"),
    "peft_use_dora": _f(AXOLOTL, note="DoRA is not offered; plain LoRA or --lora-use-rslora"),
    "tokenizer_config": _f(AXOLOTL, "model_name_or_path", "the tokenizer is read from the model's folder or id"),
    "streaming": _f(AXOLOTL, note="raw data is always streamed and tokenized once"),
    "group_by_length": _f((OLD_TRL, AXOLOTL), note=PACKED),
    "rl": _f(AXOLOTL, "objective", "rl: dpo, orpo, simpo and kto are --objective dpo, orpo, simpo and kto; ipo is "
                                   "--dpo-loss ipo"),
    "orpo_alpha": _f(AXOLOTL, "orpo_beta", "ORPO's lambda: the odds-ratio term's weight (TRL's beta)"),
    # ---- mini_trainer 0.9's TrainingArgs
    "beta1": _f(MINI_TRAINER, "adam_betas", "the pair: --adam-betas B1 B2"),
    "beta2": _f(MINI_TRAINER, "adam_betas", "the pair: --adam-betas B1 B2"),
    "eps": _f(MINI_TRAINER, "adam_eps"),
    "max_epochs": _f(MINI_TRAINER, "num_epochs"),
    "training_mode": _f(MINI_TRAINER, ("num_epochs", "max_steps", "max_samples"), "whichever stop is given"),
    "max_tokens": _f(MINI_TRAINER, note=NO_TOKEN_STOP),
    "save_final_checkpoint": _f(MINI_TRAINER, note=FINAL_EXPORT),
    "train_dtype": _f(MINI_TRAINER, note=FLOAT32_STATE),
    "wandb_run_name": _f(MINI_TRAINER, note="set WANDB_NAME"),
    "validation_frequency": _f(MINI_TRAINER, "validation_every_n_steps"),
    "min_samples_per_validation": _f(MINI_TRAINER, "validation_every_n_samples"),
    "validate_at_epoch": _f(MINI_TRAINER, ("validation_every_n_steps", "validation_every_n_samples"),
                            "validation runs every N steps or samples"),
    "validate_at_final": _f(MINI_TRAINER, note="validation always runs at the end"),
    "pretraining_config": _f(MINI_TRAINER, ("split_long_text", "max_sample_num_tokens"),
                             "blocks are cut when tokenizing text rows"),
    "on_demand_checkpointing": _f(MINI_TRAINER, note="a SIGTERM or SIGINT always saves a full state"),
    "resume_from_full_state_checkpoint": _f(MINI_TRAINER, "resume_from"),
    "callbacks": _f(MINI_TRAINER, note="Python API only: minitrainer.compat.mini_trainer runs them"),
}


def _owners(whose: tuple[str, ...]) -> str:
    names = [f"{name}'s" for name in whose]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def foreign_name_refusal(name: str, fields: Collection[str], *, as_flag: bool) -> str | None:
    """One line for a name that is another tool's, or None when the table does not hold it.

    Args:
        name: the unknown key or flag as given (``num_train_epochs``, ``--num-train-epochs``).
        fields: the config class's field names, so that our names shown are the ones this command takes.
        as_flag: name ours as flags (``--num-epochs``), else as keys (``num_epochs``).

    Returns:
        ``"--num_train_epochs is TRL's and Hugging Face's name; ours is --num-epochs"``, or ``"...; we have
        none: <why>"``; None for a name not in ``FOREIGN_NAMES``.
    """
    entry = FOREIGN_NAMES.get(name.lstrip("-").replace("-", "_"))
    if entry is None:
        return None

    def shown(field: str) -> str:
        return "--" + field.replace("_", "-") if as_flag else field

    head = f"{name} is {_owners(entry.whose)} name"
    if not entry.ours:
        return f"{head}; we have none: {entry.note}"
    here = [field for field in entry.ours if field in fields]
    note = f" ({entry.note})" if entry.note else ""
    if not here:
        return f"{head}; ours is {' or '.join(entry.ours)}{note}, which this command does not take"
    return f"{head}; ours is {' or '.join(shown(field) for field in here)}{note}"


# ----------------------------------------------------------------------------
# docs/coming-from.md

DOC_SECTIONS = (("TRL and Hugging Face TrainingArguments", (TRL, OLD_TRL, HF)), ("axolotl", (AXOLOTL,)),
                ("mini_trainer 0.9", (MINI_TRAINER,)))


def render_doc_tables() -> str:
    """docs/coming-from.md's tables, one per peer, from ``FOREIGN_NAMES`` (the test checks the doc holds them)."""
    out = []
    for title, peers in DOC_SECTIONS:
        out += [f"## {title}", "", "| theirs | ours | how it differs, or why we have none |", "|---|---|---|"]
        for name, entry in sorted(FOREIGN_NAMES.items()):
            if set(entry.whose) & set(peers):
                ours = " or ".join(f"`--{field.replace('_', '-')}`" for field in entry.ours) or "none"
                out.append(f"| `{name}` | {ours} | {entry.note.replace('|', '/')} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render_doc_tables(), end="")
