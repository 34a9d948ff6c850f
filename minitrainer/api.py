"""Python API beside the CLI: launch ``torchrun -m minitrainer.train`` from a config object.

    from minitrainer import TorchrunArgs, TrainConfig, run_training, ProcessDataConfig, process_data

    process_data(ProcessDataConfig(input_file="minitrainer/tools/demo_chat.jsonl", output_dir="/tmp/demo_tkns",
                                   model_name_or_path="Qwen/Qwen2.5-1.5B-Instruct"))
    run_training(TorchrunArgs(nproc_per_node=2),
                 TrainConfig(output_dir="/tmp/out", data_path="/tmp/demo_tkns",
                             model_name_or_path="Qwen/Qwen2.5-1.5B-Instruct",
                             min_samples_per_checkpoint=1000, max_steps=10))

A config file (YAML or JSON, what ``--config`` reads: ``examples/``, a run's ``training_params.json``)
gives the same object: ``config_from_file(TrainConfig, "examples/lora.yaml")``, and
``dataclasses.replace(config, output_dir=...)`` changes a field of it.

``run_training`` turns the ``TrainConfig`` (the same dataclass the CLI is
generated from) back into ``train.py`` flags, so the Python API and the CLI
cannot drift apart, and runs torchrun in a child process with this Python.
Inside an already-running torchrun job, call ``minitrainer.train.train(config)`` instead.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minitrainer.common.cli import collect_errors, config_field
from minitrainer.common.config_files import config_from_file
from minitrainer.common.log import logger
from minitrainer.data.process_data import ProcessDataConfig, process_data
from minitrainer.train_config import TrainConfig

__all__ = ["ProcessDataConfig", "TorchrunArgs", "TrainConfig", "config_from_file", "config_to_argv", "process_data",
           "run_training", "torchrun_command"]

PACKAGE_PARENT = Path(__file__).resolve().parent.parent
"""Where ``minitrainer`` is imported from: site-packages once installed, else the checkout."""


@dataclass
class TorchrunArgs:
    """How torchrun starts the job: ``torchrun --nnodes ... --nproc-per-node ... train.py``.

    One node: leave everything but ``nproc_per_node`` at its default (torchrun
    ``--standalone`` picks a free local port). Several nodes: run the same call
    on every node with its own ``node_rank`` and either a c10d rendezvous
    (``rdzv_endpoint``, preferred) or a static ``master_addr``/``master_port``.
    """

    nproc_per_node: int = config_field(1, help="processes (GPUs) per node")
    nnodes: int = config_field(1, help="number of nodes")
    node_rank: int | None = config_field(None, help="this node's rank (static rendezvous only; c10d assigns it)")
    rdzv_id: str = config_field("mini-trainer", help="job id shared by all nodes of one c10d rendezvous")
    rdzv_endpoint: str | None = config_field(None, help="host:port of the c10d rendezvous (e.g. the first node)")
    rdzv_backend: str = config_field("c10d", help="torchrun rendezvous backend")
    master_addr: str | None = config_field(None, help="static rendezvous: address of the rank-0 node")
    master_port: int = config_field(29500, help="static rendezvous: port on master_addr")

    def __post_init__(self) -> None:
        errors = []
        if self.nproc_per_node < 1 or self.nnodes < 1:
            errors.append(f"nproc_per_node and nnodes must be >= 1, got {self.nproc_per_node} and {self.nnodes}")
        if self.rdzv_endpoint is not None and self.master_addr is not None:
            errors.append("give rdzv_endpoint (c10d rendezvous) or master_addr (static), not both")
        if self.nnodes > 1 and self.rdzv_endpoint is None and self.master_addr is None:
            errors.append(f"nnodes={self.nnodes} needs rdzv_endpoint or master_addr so the nodes can find each other")
        if self.master_addr is not None and self.node_rank is None:
            errors.append("a static rendezvous (master_addr) needs this node's node_rank")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            errors.append(f"node_rank {self.node_rank} outside 0..{self.nnodes - 1}")
        collect_errors(errors)

    def to_argv(self) -> list[str]:
        """torchrun's own flags (everything before the script path)."""
        argv = [f"--nnodes={self.nnodes}", f"--nproc-per-node={self.nproc_per_node}"]
        if self.rdzv_endpoint is not None:
            argv += [f"--rdzv-backend={self.rdzv_backend}", f"--rdzv-endpoint={self.rdzv_endpoint}",
                     f"--rdzv-id={self.rdzv_id}"]
        elif self.master_addr is not None:
            argv += [f"--master-addr={self.master_addr}", f"--master-port={self.master_port}"]
        else:
            argv += ["--standalone"]
        if self.node_rank is not None:
            argv += [f"--node-rank={self.node_rank}"]
        return argv


def config_to_argv(config: Any) -> list[str]:
    """The CLI flags that ``cli.parse_config`` turns back into an equal ``config``.

    ``foo_bar=x`` becomes ``--foo-bar x``; booleans ``--foo``/``--no-foo``;
    tuples several values; ``None`` is omitted (every optional field defaults
    to None). Floats use ``repr`` so they round-trip exactly.
    """
    argv: list[str] = []
    for field in dataclasses.fields(config):
        if not field.init:
            continue
        value = getattr(config, field.name)
        flag = "--" + field.name.replace("_", "-")
        if value is None:
            assert field.default is None, f"{field.name} is None but defaults to {field.default!r}"
            continue
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + field.name.replace("_", "-"))
        elif isinstance(value, (tuple, list)):
            argv += [flag, *(repr(v) if isinstance(v, float) else str(v) for v in value)]
        else:
            argv += [flag, repr(value) if isinstance(value, float) else str(value)]
    return argv


def torchrun_command(torchrun_args: TorchrunArgs, train_args: TrainConfig) -> list[str]:
    """The full command ``run_training`` executes."""
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args.to_argv(), "-m", "minitrainer.train",
            *config_to_argv(train_args)]


def run_training(torchrun_args: TorchrunArgs, train_args: TrainConfig) -> None:
    """Launch ``torchrun -m minitrainer.train`` with ``train_args`` and wait for it.

    The child inherits this process's environment and terminal (set
    ``CUDA_VISIBLE_DEVICES``, ``NCCL_*`` or ``OMP_NUM_THREADS`` in
    ``os.environ`` before calling).

    Args:
        torchrun_args: node and process layout.
        train_args: the run's parameters, as the CLI would parse them.

    Raises:
        subprocess.CalledProcessError: torchrun exited non-zero (a rank failed).
    """
    command = torchrun_command(torchrun_args, train_args)
    logger.info("launching: %s", " ".join(command))
    # By module, never by the file's path: a script's folder goes first on sys.path, and the package's
    # modules would shadow the caller's own. The child finds the package where this process found it
    # (a checkout that is not installed included), after whatever the caller's PYTHONPATH puts first.
    path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(PACKAGE_PARENT)]))
    subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": path})
