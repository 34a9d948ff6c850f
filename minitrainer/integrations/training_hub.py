"""Backend ``minitrainer`` for training_hub's ``sft``, ``osft`` and ``lora_sft``: importing this module registers it.

    import minitrainer.integrations.training_hub  # noqa: F401
    from training_hub import osft
    osft(model_path=..., data_path="chat.parquet", ckpt_output_dir="out", unfreeze_rank_ratio=0.25,
         effective_batch_size=16, max_tokens_per_gpu=4096, max_seq_len=2048, learning_rate=1e-5,
         backend="minitrainer")

Every parameter the hub passes is honoured or refused before anything starts (``hub_parameters``); the data
is read as the user has it, by our own door inside the run; callbacks fire here, in the launching process,
from the run's metrics and exports (``report/watch.py``), so no code is shipped to the workers. training_hub is an
optional extra (``pip install '.[training-hub]'`` with the installed torch pinned, docs/install.md): nothing else of
ours imports it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

try:
    from training_hub import AlgorithmRegistry, Backend, TrainingHubCallback, TrainingHubContext
    from training_hub.utils import get_torchrun_params
except ImportError as err:
    raise ImportError(f"minitrainer.integrations.training_hub needs training_hub ({err}): pip install "
                      "'training-hub>=0.11.2' \"torch==$(python -c 'import torch; print(torch.__version__)')\" "
                      "(docs/install.md)") from err

from minitrainer.api import RunResult, TorchrunArgs, run_training
from minitrainer.common.refusals import problems_of
from minitrainer.common.translations import IN_STEP
from minitrainer.data.cache import is_tokenized
from minitrainer.integrations.hub_parameters import TORCHRUN_KEYS, translate
from minitrainer.report.watch import Lifecycle, ListenerFailures, RunEvent
from minitrainer.train_config import TrainConfig

BACKEND_NAME = "minitrainer"
IN_STEP_HOOKS = ("on_step_begin",)
"""Hooks that would have to run inside the step, on the workers: refused."""
HUB_OWN_CALLBACKS = ("JITCheckpointCallback", "RemoteCheckpointSyncCallback")
"""What training_hub adds to lora_sft's callbacks for its own backends: the preemption save is ours already,
and remote storage is refused."""


class ParameterRefused(ValueError):
    """A hub parameter we cannot honour; the message names each, one line apiece."""


class _MinitrainerBackend(Backend):
    algorithm: str

    def execute_training(self, algorithm_params: dict[str, Any]) -> RunResult:
        config, torchrun_args, env, listener = prepare(self.algorithm, algorithm_params)
        try:
            result = run_training(torchrun_args, config, on_event=listener, env=env)
        except BaseException:
            listener.close(finished=False)
            raise
        listener.close(finished=True)
        return result


class SFTBackend(_MinitrainerBackend):
    algorithm = "sft"


class OSFTBackend(_MinitrainerBackend):
    algorithm = "osft"


class LoRASFTBackend(_MinitrainerBackend):
    algorithm = "lora_sft"


def prepare(algorithm: str, params: dict[str, Any]) -> tuple[TrainConfig, TorchrunArgs, dict[str, str],
                                                              HubCallbacks]:
    """The run ``params`` ask for, or ``ParameterRefused`` naming every parameter we cannot honour."""
    translation = translate(algorithm, params, environ=dict(os.environ))
    refusals = list(translation.refusals)
    callbacks = [callback for callback in translation.launcher.get("callbacks") or []
                 if type(callback).__name__ not in HUB_OWN_CALLBACKS]
    for callback in callbacks:
        if reason := _callback_refusal(callback):
            refusals.append(f"{algorithm}(..., callbacks=[{type(callback).__name__}()]) with backend='minitrainer': "
                            f"{reason}")
    use_processed = translation.launcher.get("use_processed_dataset")
    data_path = translation.train.get("data_path")
    if use_processed and data_path is not None and not is_tokenized(data_path):
        refusals.append(f"{algorithm}(..., use_processed_dataset=True) with backend='minitrainer': {data_path} holds "
                        "no input_ids; drop the flag and the data is tokenized by the run")
    torchrun_given = {name: value for name, value in translation.torchrun.items() if name in TORCHRUN_KEYS}
    try:
        resolved = get_torchrun_params(torchrun_given)  # the hub's own: arguments, then PET_* variables, defaults
        torchrun_args = TorchrunArgs(**_our_torchrun(resolved))
        config = TrainConfig(**translation.train)
    except (ValueError, TypeError) as err:
        refusals += [f"{algorithm}(...) with backend='minitrainer': {problem}" for problem in problems_of(err)]
    if refusals:
        raise ParameterRefused("\n".join(refusals))
    # The node of global rank 0 writes the metrics the hooks read; on a shared filesystem the other nodes'
    # launchers would read them too, and fire every hook once per node.
    listener = HubCallbacks(callbacks if resolved.get("node_rank", 0) == 0 else [], output_dir=config.output_dir,
                            logging_steps=translation.launcher.get("logging_steps") or 1)
    return config, torchrun_args, translation.env, listener


def _our_torchrun(resolved: dict) -> dict:
    """training_hub's resolved torchrun values as our ``TorchrunArgs``: a single node runs standalone."""
    out = {"nproc_per_node": resolved["nproc_per_node"], "nnodes": resolved.get("nnodes", 1),
           "rdzv_id": str(resolved.get("rdzv_id", "mini-trainer"))}
    if resolved.get("rdzv_endpoint"):
        out["rdzv_endpoint"] = resolved["rdzv_endpoint"]
    elif resolved.get("master_addr"):
        out.update(master_addr=resolved["master_addr"], node_rank=resolved.get("node_rank", 0))
        if resolved.get("master_port"):
            out["master_port"] = int(resolved["master_port"])
    if out["nnodes"] > 1 and "master_addr" not in out:
        out["node_rank"] = resolved.get("node_rank", 0)
    return out


def _callback_refusal(callback: Any) -> str | None:
    if not isinstance(callback, TrainingHubCallback):
        return f"not a TrainingHubCallback ({type(callback).__module__}.{type(callback).__name__})"
    if getattr(callback, "run_on_all_ranks", False):
        return ("run_on_all_ranks=True: hooks run once, in the launching process, from the run's metrics; "
                "per-rank figures are in each step's line (peak_memory_usage_GB is the largest rank's)")
    overridden = [hook for hook in IN_STEP_HOOKS
                  if getattr(type(callback), hook, None) is not getattr(TrainingHubCallback, hook)]
    if overridden:
        return (f"{', '.join(overridden)} {IN_STEP}; use on_step_end, "
                "which gets the step's metrics")
    return None


class HubCallbacks:
    """The hub's hooks, fired in the launching process from a run's events (``report.watch.Lifecycle`` gives their
    order); each gets a ``TrainingHubContext`` of the step's metrics line. A hook that raises is logged in one
    line the first time and counted after (``report.watch.ListenerFailures``); training goes on."""

    def __init__(self, callbacks: list[TrainingHubCallback], *, output_dir: str, logging_steps: int = 1):
        self.callbacks, self.output_dir = callbacks, str(output_dir)
        self._lifecycle = Lifecycle(self._fire, logging_steps=logging_steps)
        self._failures = ListenerFailures(per="call")

    def __call__(self, event: RunEvent) -> None:
        self._lifecycle(event)

    def close(self, *, finished: bool) -> None:
        """After the run: a finished one ends its epoch and the training; then how often each failing hook
        failed."""
        try:
            if finished:
                self._lifecycle.finish()
        finally:
            self._failures.report()

    def _fire(self, hook: str, event: RunEvent, last_step: RunEvent | None) -> None:
        if hook == "on_evaluate":  # the newest step's context, the validation's figures
            context = dataclasses.replace(self._context(last_step.record if last_step else {}),
                                          metrics=dict(event.record))
        else:
            context = self._context(event.record)
        if hook == "on_train_begin":
            context = dataclasses.replace(context, step=max(context.step - 1, 0))
        if hook == "on_save":
            context.metrics["checkpoint_path"] = str(event.path)
        for callback in self.callbacks:  # the hub's promise: a failing hook never stops training
            self._failures.call(f"training_hub callback {type(callback).__name__}.{hook}", getattr(callback, hook),
                                context, at=f"step {context.step}")

    def _context(self, record: dict) -> TrainingHubContext:
        return TrainingHubContext(step=int(record.get("step", 0)), epoch=int(record.get("epoch", 0)),
                                  loss=record.get("loss"), learning_rate=record.get("lr"), is_main_process=True,
                                  output_dir=self.output_dir, metrics=dict(record))


def register() -> None:
    for algorithm, backend in (("sft", SFTBackend), ("osft", OSFTBackend), ("lora_sft", LoRASFTBackend)):
        AlgorithmRegistry.register_backend(algorithm, BACKEND_NAME, backend)


register()

__all__ = ["BACKEND_NAME", "HubCallbacks", "LoRASFTBackend", "OSFTBackend", "ParameterRefused", "SFTBackend",
           "prepare", "register"]
