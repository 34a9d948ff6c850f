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
from minitrainer.common.refusals import problems_of
from minitrainer.common.translations import (FINAL_EXPORT, FLOAT32_STATE, IN_STEP, MIN_LR_ONLY, NO_TOKEN_STOP, Rule,
                                            Translation, accepted_when, read_by_another, to)
from minitrainer.report.watch import Lifecycle, ListenerFailures, RunEvent
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
        listener.finish()
    except api.RunFailed as err:
        raise TrainingFailed(str(err)) from err
    finally:  # finished or not: how often each failing hook failed, once
        listener.report()
    return result


def _betas(value, params, out):
    out.train["adam_betas"] = (params["beta1"], params["beta2"])


def _osft(value, params, out):
    if not value:
        return None
    patterns = params["osft_target_patterns"]
    out.train.update(osft=True, osft_unfreeze_rank_ratio=params["osft_unfreeze_rank_ratio"],
                     osft_target_patterns=",".join(patterns) if patterns else None)
    return None


def _osft_upcast(value, params, out):
    if not params["osft"] or value is None:
        return None
    if value not in ("float32", "float64"):
        return "float32 or float64: the decomposition is not computed in lower precision"
    out.train["osft_upcast_dtype"] = value
    return None


SAVE_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32",
               "float": "float32", None: "auto"}
"""0.9's ``save_dtype`` names (those of its ``get_model_save_dtype`` we write) as our ``--save-dtype``; 0.9's None
is the checkpoint's own dtype, our auto. A torch.dtype is refused, as in 0.9: its launcher passed it to the workers
as text (``torch.float32``) that they refused."""


def _training_mode(value, params, out):
    mode = TrainingMode(value)
    if mode is TrainingMode.EPOCH:
        out.train["num_epochs"] = float(params["max_epochs"])
    elif mode is TrainingMode.STEP:
        out.train["max_steps"] = params["max_steps"]
    elif mode is TrainingMode.TOKEN:
        return f"{NO_TOKEN_STOP}: TrainingMode.STEP or EPOCH"
    return None


def _min_lr_rate(value, params, out):
    if value and "min_lr_rate" in value:
        out.train["min_lr_ratio"] = float(value["min_lr_rate"])


RULES: dict[str, Rule] = {
    "model_name_or_path": to("model_name_or_path"),
    "data_path": to("data_path"),
    "batch_size": to("batch_size"),
    "max_tokens_per_gpu": to("max_tokens_per_gpu"),
    "learning_rate": to("learning_rate"),
    "output_dir": to("output_dir"),
    "num_warmup_steps": to("num_warmup_steps"),
    "lr_scheduler": to("lr_scheduler"),
    "lr_scheduler_kwargs": accepted_when(lambda v: not v or set(v) <= {"min_lr_rate"}, MIN_LR_ONLY, _min_lr_rate),
    "seed": to("seed"),
    "beta1": _betas,  # never forwarded to 0.9's workers: honoured here
    "beta2": _betas,
    "eps": to("adam_eps"),
    "weight_decay": to("weight_decay"),
    "use_liger_kernels": to("use_liger_kernels"),
    "osft": _osft,
    "osft_unfreeze_rank_ratio": read_by_another,
    "osft_target_patterns": read_by_another,
    "osft_upcast_dtype": _osft_upcast,
    "min_samples_per_checkpoint": to("min_samples_per_checkpoint", lambda v: v or 0),
    "training_mode": _training_mode,
    "max_epochs": read_by_another,
    "max_steps": read_by_another,
    "max_tokens": read_by_another,  # read by TrainingMode.TOKEN alone, which is refused
    "checkpoint_at_epoch": to("checkpoint_at_epoch"),
    "save_final_checkpoint": accepted_when(bool, FINAL_EXPORT),
    "save_dtype": accepted_when(lambda v: v in SAVE_DTYPES, "bfloat16, float16 or float32 (or None: the checkpoint's "
                                                            "own dtype); exports are not written in float64",
                                to("save_dtype", SAVE_DTYPES.get)),
    "train_dtype": accepted_when(lambda v: v == "float32", FLOAT32_STATE),
    "wandb_project": to("wandb_project"),
    "wandb_run_name": read_by_another,  # as in 0.9, the run's name and team come from WANDB_NAME, WANDB_ENTITY
    "wandb_entity": read_by_another,
    "mlflow_tracking_uri": to("mlflow_tracking_uri"),
    "mlflow_experiment_name": to("mlflow_experiment"),
    "mlflow_run_name": to("mlflow_run_name"),
    "validation_split": to("validation_split", lambda v: v or None),
    "validation_data_path": to("validation_data_path"),
    "validation_frequency": to("validation_every_n_steps"),
    "validate_at_epoch": accepted_when(lambda v: not v, "validation runs every N steps or samples: "
                                                        "validation_frequency or min_samples_per_validation "
                                                        "(and always at the end)"),
    "min_samples_per_validation": to("validation_every_n_samples"),
    "validate_at_final": read_by_another,  # a run with validation always validates at its end
    "pretraining_config": accepted_when(lambda v: v is None, "blocks are cut when tokenizing: process_data.py "
                                                             "--split-long-text --max-sample-num-tokens BLOCK on "
                                                             "the documents as text rows"),
    "trust_remote_code": to("trust_remote_code"),
    "save_best_val_loss": to("save_best_val_loss"),
    "val_loss_improvement_threshold": to("val_loss_improvement_threshold"),
    "on_demand_checkpointing": read_by_another,  # a SIGTERM or SIGUSR1 always saves the full state and stops
    "resume_from_full_state_checkpoint": to("resume_from"),
    "callbacks": read_by_another,  # to_our_config: the launching process's hooks
}
"""Each of 0.9's ``TrainingArgs`` fields, honoured as our setting or refused (``common/translations.py``); a field
no rule names is a test failure (``tests/test_mini_trainer_compat.py``)."""


def to_our_config(torch_args: TorchrunArgs, train_args: TrainingArgs) -> tuple[TrainConfig, api.TorchrunArgs,
                                                                                 _Callbacks]:
    """Our ``TrainConfig`` and ``TorchrunArgs`` for 0.9's, or ``Refused`` listing what cannot be honoured."""
    params = {f.name: getattr(train_args, f.name) for f in dataclasses.fields(train_args)}
    out = Translation()
    for name, value in params.items():
        if (reason := RULES[name](value, params, out)) is not None:
            out.refusals.append(f"TrainingArgs({name}={value!r}): {reason}")
    callbacks = list(train_args.callbacks or [])
    for callback in callbacks:
        overridden = [hook for hook in IN_STEP_HOOKS if _overrides(callback, hook)]
        if overridden:
            out.refusals.append(f"TrainingArgs(callbacks=[{type(callback).__name__}()]): {', '.join(overridden)} "
                                f"{IN_STEP}; on_step_end gets the step's metrics")
    if out.refusals:  # the fields first: a refused one may leave the rest inconsistent (TOKEN mode: no stop)
        raise Refused("\n".join(out.refusals))
    try:
        config = TrainConfig(**out.train)
        torchrun = _our_torchrun(torch_args)
    except ValueError as err:
        raise Refused("\n".join(problems_of(err))) from None
    # The node of global rank 0 writes the metrics the hooks read (on a shared filesystem, every node could).
    return config, torchrun, _Callbacks(callbacks if torch_args.node_rank == 0 else [], config=config,
                                        train_args=train_args)


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
    """0.9's launching-process hooks from the run's events (``report.watch.Lifecycle`` gives their order), each with
    a ``TrainingContext`` of the step's metrics line. A hook that raises is logged once, then counted
    (``report.watch.ListenerFailures``): 0.9's callbacks are fire-and-forget."""

    def __init__(self, callbacks: list, *, config: TrainConfig, train_args: TrainingArgs):
        self.callbacks = callbacks
        self._base = TrainingContext(output_dir=config.output_dir, model_name_or_path=config.model_name_or_path,
                                     training_mode=TrainingMode(train_args.training_mode).value,
                                     max_epochs=train_args.max_epochs, max_steps=train_args.max_steps,
                                     max_tokens=train_args.max_tokens)
        self._lifecycle = Lifecycle(self._fire)
        self._failures = ListenerFailures(per="call")

    def __call__(self, event: RunEvent) -> None:
        self._lifecycle(event)

    def finish(self) -> None:
        self._lifecycle.finish()

    def report(self) -> None:
        self._failures.report()

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
            self._failures.call(f"callback {type(callback).__name__}.{hook}", getattr(callback, hook), context,
                                at=f"step {context.step}")
