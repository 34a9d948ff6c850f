"""mini_trainer 0.9's Python API, field for field, run by our trainer: moving a script over is one import line.

    # from mini_trainer import run_training, TrainingArgs, TorchrunArgs, TrainingMode, PretrainingConfig
    from minitrainer.compat.mini_trainer import run_training, TrainingArgs, TorchrunArgs, TrainingMode

The dataclasses keep 0.9.0's field names, types and defaults, the API's (not its CLI's): ``cosine`` schedule,
no warmup, seed 42, a final checkpoint. Where 0.9 silently ignored a field (``beta1``, ``beta2``, ``eps``,
``weight_decay`` never reached its workers), it is honoured; a field we cannot honour is refused before
anything starts, one line each (``Refused``). Callbacks (``TrainerCallback``) run in this process from the
run's metrics and exports, not in the workers. docs/python-api.md has the table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

from minitrainer import api
from minitrainer.checkpoint.policy import FINAL_EXPORT_ONLY
from minitrainer.common.cli import errors_in_one_line
from minitrainer.common.log import logger
from minitrainer.report.watch import Lifecycle, RunEvent
from minitrainer.train_config import TrainConfig

__all__ = ["PretrainingConfig", "Refused", "TorchrunArgs", "TrainerCallback", "TrainingArgs", "TrainingContext",
           "TrainingFailed", "TrainingMode", "run_training", "to_our_config"]


class TrainingMode(str, Enum):
    EPOCH = "epoch"
    STEP = "step"
    TOKEN = "token"
    INFINITE = "infinite"


@dataclass
class PretrainingConfig:
    block_size: int


@dataclass
class TorchrunArgs:
    nnodes: int = 1
    nproc_per_node: Literal["gpu"] | int = 1
    node_rank: int = 0
    rdzv_id: str | int = 123
    rdzv_endpoint: str | None = None
    master_addr: str | None = None
    master_port: int | None = None

    def __post_init__(self):
        if self.rdzv_endpoint and self.master_addr:
            raise ValueError("Provide either `rdzv_endpoint` OR both `master_addr` and `master_port`, not both.")


@dataclass
class TrainingArgs:
    model_name_or_path: str
    data_path: str
    batch_size: int
    max_tokens_per_gpu: int
    learning_rate: float
    output_dir: str
    num_warmup_steps: int = 0
    lr_scheduler: str = "cosine"
    lr_scheduler_kwargs: dict[str, Any] | None = field(default_factory=dict)
    seed: int = 42
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    use_liger_kernels: bool = False
    osft: bool = False
    osft_unfreeze_rank_ratio: float | None = None
    osft_target_patterns: list[str] | None = None
    osft_upcast_dtype: str | None = "float32"
    min_samples_per_checkpoint: int | None = None
    training_mode: TrainingMode = TrainingMode.EPOCH
    max_epochs: int = 1
    max_steps: int = 0
    max_tokens: int = 0
    checkpoint_at_epoch: bool = False
    save_final_checkpoint: bool = True
    save_dtype: str | None = None
    train_dtype: str = "float32"
    wandb_project: str | None = None
    wandb_run_name: str | None = None
    wandb_entity: str | None = None
    mlflow_tracking_uri: str | None = None
    mlflow_experiment_name: str | None = None
    mlflow_run_name: str | None = None
    validation_split: float = 0.0
    validation_data_path: str | None = None
    validation_frequency: int | None = None
    validate_at_epoch: bool = False
    min_samples_per_validation: int | None = None
    validate_at_final: bool = False
    pretraining_config: PretrainingConfig | None = None
    trust_remote_code: bool = False
    save_best_val_loss: bool = False
    val_loss_improvement_threshold: float = 0.0
    on_demand_checkpointing: bool = False
    resume_from_full_state_checkpoint: str | None = None
    callbacks: list | None = None


@dataclass
class TrainingContext:
    """What 0.9's hooks read; here filled from the run's metrics line (``batch_metrics`` is the whole line)."""

    hook_name: str = ""
    step: int = 0
    epoch: int = 0
    total_samples: int = 0
    total_tokens: int = 0
    loss: float | None = None
    learning_rate: float | None = None
    grad_norm: float | None = None
    batch_metrics: dict[str, Any] = field(default_factory=dict)
    val_metrics: dict[str, Any] = field(default_factory=dict)
    checkpoint_path: str | None = None
    output_dir: str = ""
    model_name_or_path: str = ""
    training_mode: str = ""
    max_epochs: int = 0
    max_steps: int = 0
    max_tokens: int = 0
    world_size: int = 1
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True


class TrainerCallback:
    """0.9's hooks. Those of the launching process fire; those inside the step are refused when overridden."""

    def on_train_begin(self, context: TrainingContext) -> None: ...
    def on_epoch_begin(self, context: TrainingContext) -> None: ...
    def on_step_begin(self, context: TrainingContext) -> None: ...
    def on_before_forward(self, context: TrainingContext) -> None: ...
    def on_after_backward(self, context: TrainingContext) -> None: ...
    def on_pre_optimizer_step(self, context: TrainingContext) -> None: ...
    def on_optimizer_step(self, context: TrainingContext) -> None: ...
    def on_log(self, context: TrainingContext) -> None: ...
    def on_evaluate(self, context: TrainingContext) -> None: ...
    def on_save(self, context: TrainingContext) -> None: ...
    def on_step_end(self, context: TrainingContext) -> None: ...
    def on_epoch_end(self, context: TrainingContext) -> None: ...
    def on_train_end(self, context: TrainingContext) -> None: ...


IN_STEP_HOOKS = ("on_step_begin", "on_before_forward", "on_after_backward", "on_pre_optimizer_step",
                 "on_optimizer_step")


class Refused(ValueError):
    """Fields of 0.9's dataclasses we cannot honour, one line each."""


class TrainingFailed(RuntimeError):
    """What 0.9 raised when training failed (a ``RuntimeError``), carrying the run's own line; the
    ``api.RunFailed`` with its status is the cause."""


def run_training(torch_args: TorchrunArgs, train_args: TrainingArgs) -> api.RunResult:
    """0.9's ``run_training``: launch the job and wait for it; returns where the results are (0.9: None)."""
    config, torchrun, listener = to_our_config(torch_args, train_args)
    env = {name: value for name, value in (("WANDB_NAME", train_args.wandb_run_name),
                                           ("WANDB_ENTITY", train_args.wandb_entity)) if value}
    try:
        result = api.run_training(torchrun, config, on_event=listener, env=env)
    except api.RunFailed as err:
        raise TrainingFailed(str(err)) from err
    listener.finish()
    return result


def to_our_config(torch_args: TorchrunArgs, train_args: TrainingArgs) -> tuple[TrainConfig, api.TorchrunArgs,
                                                                                 _Callbacks]:
    """Our ``TrainConfig`` and ``TorchrunArgs`` for 0.9's, or ``Refused`` listing what cannot be honoured."""
    a, refusals = train_args, []

    def refuse(name: str, reason: str) -> None:
        refusals.append(f"TrainingArgs({name}={getattr(a, name)!r}): {reason}")

    ours: dict[str, Any] = dict(
        model_name_or_path=a.model_name_or_path, data_path=a.data_path, batch_size=a.batch_size,
        max_tokens_per_gpu=a.max_tokens_per_gpu, learning_rate=a.learning_rate, output_dir=a.output_dir,
        num_warmup_steps=a.num_warmup_steps, lr_scheduler=a.lr_scheduler, seed=a.seed, adam_betas=(a.beta1, a.beta2),
        adam_eps=a.eps, weight_decay=a.weight_decay, use_liger_kernels=a.use_liger_kernels,
        min_samples_per_checkpoint=a.min_samples_per_checkpoint or FINAL_EXPORT_ONLY,
        checkpoint_at_epoch=a.checkpoint_at_epoch, trust_remote_code=a.trust_remote_code,
        wandb_project=a.wandb_project, mlflow_tracking_uri=a.mlflow_tracking_uri,
        mlflow_experiment=a.mlflow_experiment_name, mlflow_run_name=a.mlflow_run_name,
        validation_data_path=a.validation_data_path, validation_split=a.validation_split or None,
        validation_every_n_steps=a.validation_frequency, validation_every_n_samples=a.min_samples_per_validation,
        save_best_val_loss=a.save_best_val_loss, val_loss_improvement_threshold=a.val_loss_improvement_threshold,
        resume_from=a.resume_from_full_state_checkpoint)
    kwargs = dict(a.lr_scheduler_kwargs or {})
    if "min_lr_rate" in kwargs:
        ours["min_lr_ratio"] = float(kwargs.pop("min_lr_rate"))
    if kwargs:
        refuse("lr_scheduler_kwargs", "only min_lr_rate (our min_lr_ratio) is taken; the schedule's other shapes "
                                      "are named by lr_scheduler")
    if a.osft:
        ours.update(osft=True, osft_unfreeze_rank_ratio=a.osft_unfreeze_rank_ratio,
                    osft_target_patterns=",".join(a.osft_target_patterns) if a.osft_target_patterns else None)
        if a.osft_upcast_dtype in ("float32", "float64"):
            ours["osft_upcast_dtype"] = a.osft_upcast_dtype
        elif a.osft_upcast_dtype is not None:
            refuse("osft_upcast_dtype", "float32 or float64: the decomposition is not computed in lower precision")
    mode = TrainingMode(a.training_mode)
    if mode is TrainingMode.EPOCH:
        ours["num_epochs"] = float(a.max_epochs)
    elif mode is TrainingMode.STEP:
        ours["max_steps"] = a.max_steps
    elif mode is TrainingMode.TOKEN:
        refuse("training_mode", "a run stops after steps, samples or epochs, not tokens: TrainingMode.STEP or EPOCH")
    if not a.save_final_checkpoint:
        refuse("save_final_checkpoint", "the final export is always written")
    if a.save_dtype is not None:
        refuse("save_dtype", "exports keep the checkpoint's own dtype")
    if a.train_dtype != "float32":
        refuse("train_dtype", "weights and optimizer stay float32; a GPU computes in bfloat16 over them")
    if a.validate_at_epoch:
        refuse("validate_at_epoch", "validation runs every N steps or samples: validation_frequency or "
                                    "min_samples_per_validation (and always at the end)")
    if a.pretraining_config is not None:
        refuse("pretraining_config", "blocks are cut when tokenizing: process_data.py --split-long-text "
                                     "--max-sample-num-tokens BLOCK on the documents as text rows")
    callbacks = list(a.callbacks or [])
    for callback in callbacks:
        overridden = [hook for hook in IN_STEP_HOOKS if _overrides(callback, hook)]
        if overridden:
            refusals.append(f"TrainingArgs(callbacks=[{type(callback).__name__}()]): {', '.join(overridden)} would "
                            "have to run inside the step on the workers; on_step_end gets the step's metrics")
    if refusals:  # the fields first: a refused one may leave the rest inconsistent (TOKEN mode: no stop)
        raise Refused("\n".join(refusals))
    try:
        config = TrainConfig(**ours)
        torchrun = _our_torchrun(torch_args)
    except ValueError as err:
        raise Refused(errors_in_one_line(err)) from None
    # The node of global rank 0 writes the metrics the hooks read (on a shared filesystem, every node could).
    return config, torchrun, _Callbacks(callbacks if torch_args.node_rank == 0 else [], config=config, train_args=a)


def _our_torchrun(t: TorchrunArgs) -> api.TorchrunArgs:
    if t.rdzv_endpoint:
        return api.TorchrunArgs(nnodes=t.nnodes, nproc_per_node=t.nproc_per_node, rdzv_id=str(t.rdzv_id),
                                rdzv_endpoint=t.rdzv_endpoint)
    if t.master_addr:
        return api.TorchrunArgs(nnodes=t.nnodes, nproc_per_node=t.nproc_per_node, node_rank=t.node_rank,
                                master_addr=t.master_addr, master_port=t.master_port or 29500)
    return api.TorchrunArgs(nnodes=t.nnodes, nproc_per_node=t.nproc_per_node)


def _overrides(callback: Any, hook: str) -> bool:
    for cls in type(callback).__mro__:
        if cls.__name__ == "TrainerCallback":  # ours, or 0.9's own base class
            return False
        if hook in vars(cls):
            return True
    return False


class _Callbacks:
    """0.9's launching-process hooks from the run's events (``run_watch.Lifecycle`` gives their order), each with
    a ``TrainingContext`` of the step's metrics line."""

    def __init__(self, callbacks: list, *, config: TrainConfig, train_args: TrainingArgs):
        self.callbacks = callbacks
        self._base = TrainingContext(output_dir=config.output_dir, model_name_or_path=config.model_name_or_path,
                                     training_mode=TrainingMode(train_args.training_mode).value,
                                     max_epochs=train_args.max_epochs, max_steps=train_args.max_steps,
                                     max_tokens=train_args.max_tokens)
        self._lifecycle = Lifecycle(self._fire)

    def __call__(self, event: RunEvent) -> None:
        self._lifecycle(event)

    def finish(self) -> None:
        self._lifecycle.finish()

    def _fire(self, hook: str, event: RunEvent, last_step: RunEvent | None) -> None:
        step = event if event.kind == "step" or last_step is None else last_step
        record = step.record if hook == "on_evaluate" else event.record
        context = dataclasses.replace(
            self._base, hook_name=hook, step=int(record.get("step", 0)), epoch=int(record.get("epoch", 0)),
            total_samples=int(record.get("samples_seen", 0)), loss=record.get("loss"),
            learning_rate=record.get("lr"), grad_norm=record.get("grad_norm"), batch_metrics=dict(record),
            val_metrics=dict(event.record) if hook == "on_evaluate" else {},
            checkpoint_path=str(event.path) if hook == "on_save" else None)
        if hook == "on_train_begin":  # before the run's first step
            context.step = max(context.step - 1, 0)
        for callback in self.callbacks:
            try:
                getattr(callback, hook)(context)
            except Exception as err:  # noqa: BLE001 - 0.9's promise: callbacks are fire-and-forget
                logger.warning("callback %s.%s failed at step %d (%s: %s); training goes on",
                               type(callback).__name__, hook, context.step, type(err).__name__, err)
