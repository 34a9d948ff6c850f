"""Shared plumbing: the label sentinel, config-to-CLI generation, logging,
seeding, and the device/distributed edge of the toolkit.

Everything that touches ``torch.cuda`` or ``torch.distributed`` setup lives
here so the rest of the code stays device-agnostic: ``init_distributed()``
picks cuda+nccl when a GPU is present and cpu+gloo otherwise, and also works
as a plain single process without torchrun.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import random
import socket
import sys
import typing
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np

from minitrainer.common.config_files import nearest_name, read_config_file, unwrap_optional

IGNORE_INDEX = -100
"""Label value that contributes no loss (the Hugging Face / PyTorch convention)."""

logger = logging.getLogger("mini_trainer")

ConfigT = TypeVar("ConfigT")


# ----------------------------------------------------------------------------
# Config dataclass -> argparse


def config_field(default: Any = dataclasses.MISSING, *, help: str, **kwargs: Any) -> Any:
    """A dataclass field whose help text becomes the CLI flag's help.

    ``choices=`` restricts the CLI values; ``parse=`` is the CLI's string -> value
    function for fields whose type argparse cannot infer (e.g. ``int | Literal["auto"]``);
    ``action=`` is the flag's argparse action, for a flag that also stands alone (``--x``, ``--x V``, ``--no-x``);
    ``section=`` on a field opens a headed group of ``--help`` that holds it and the
    fields after it, up to the next section.
    """
    metadata = {"help": help}
    for key in ("choices", "parse", "section", "action"):
        if key in kwargs:
            metadata[key] = kwargs.pop(key)
    if "default_factory" in kwargs:
        return dataclasses.field(default_factory=kwargs.pop("default_factory"), metadata=metadata, **kwargs)
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


class _Parser(argparse.ArgumentParser):
    """argparse, with its output on rank 0 only and a refusal in one line.

    Under torchrun every rank parses the same argv: without this, ``--help`` or a typo printed the
    53-line usage once per rank. ``RANK`` is set by torchrun before any process group exists.
    A refusal is ``prog: error: ...`` alone: the usage block would bury that line.
    """

    def _print_message(self, message: str, file: Any = None) -> None:
        if int(os.environ.get("RANK", "0")) == 0:
            super()._print_message(message, file)

    def error(self, message: str) -> typing.NoReturn:
        note_exit_line(f"{self.prog}: error: {message}")
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_arg_parser(config_cls: type, *, description: str | None = None) -> argparse.ArgumentParser:
    """Generate an argparse parser from a config dataclass.

    Field ``foo_bar`` becomes ``--foo-bar``; booleans get ``--foo``/``--no-foo``;
    ``Literal`` types become choices; tuples become ``nargs``. Fields without a
    default are required. Sections (``config_field(section=...)``) become
    argparse groups, printed in field order. ``--config FILE`` comes first
    (``config_files.py``). Flags are never abbreviated: ``--lr`` must not
    silently mean ``--lr-scheduler``.
    """
    parser = _Parser(description=description, allow_abbrev=False)
    parser.add_argument("--config", metavar="FILE",
                        help="YAML or JSON file of these flags' values (names with dashes or underscores); "
                             "flags given here override it")
    group: argparse.ArgumentParser | argparse._ArgumentGroup = parser
    hints = typing.get_type_hints(config_cls)
    for field in dataclasses.fields(config_cls):
        if not field.init:
            continue
        if "section" in field.metadata:
            group = parser.add_argument_group(field.metadata["section"])
        flag = "--" + field.name.replace("_", "-")
        tp, _ = unwrap_optional(hints[field.name])
        kwargs: dict[str, Any] = {"help": field.metadata.get("help", ""), "dest": field.name}
        if field.default is not dataclasses.MISSING:
            kwargs["default"] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            kwargs["default"] = field.default_factory()
        else:
            kwargs["required"] = True
        if "parse" in field.metadata:
            kwargs["type"] = field.metadata["parse"]
        elif tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(tp) is Literal:
            kwargs["choices"] = list(typing.get_args(tp))
            kwargs["type"] = type(kwargs["choices"][0])
        elif typing.get_origin(tp) is tuple:
            args = typing.get_args(tp)
            kwargs["nargs"] = len(args)
            kwargs["type"] = args[0]
        else:
            kwargs["type"] = tp
            if "choices" in field.metadata:
                kwargs["choices"] = field.metadata["choices"]
        if "action" in field.metadata:
            kwargs["action"] = field.metadata["action"]
        action = group.add_argument(flag, **kwargs)
        # Set after add_argument: Python 3.11's BooleanOptionalAction appends its own default to the help.
        action.help = flag_help(field.metadata.get("help", ""), kwargs.get("default", dataclasses.MISSING))
    return parser


def flag_help(text: str, default: Any) -> str:
    """A flag's help with its default said once: not where the text already states it, nor when it is None."""
    if default is dataclasses.MISSING:
        return f"{text} (required)"
    if default is None or "default" in text:
        return text
    shown = " ".join(map(str, default)) if isinstance(default, tuple) else str(default)
    return f"{text} (default: {shown.replace('%', '%%')})"


def parse_config(config_cls: type[ConfigT], argv: list[str] | None = None, *, description: str | None = None) -> ConfigT:
    """Parse ``argv`` into ``config_cls``: its flags, over a ``--config`` file's values, over the defaults.

    An unknown flag (with the nearest known one), a bad config file or a ``ValueError`` from
    validation exits with code 2 and one ``prog: error: ...`` line, printed by rank 0.
    """
    parser = build_arg_parser(config_cls, description=description)
    argv = sys.argv[1:] if argv is None else list(argv)
    # Checked before argparse, whose "required" error would come first and whose message has no suggestion.
    known = [flag[2:] for flag in parser._option_string_actions if flag.startswith("--")]
    unknown = [word.split("=", 1)[0] for word in argv
               if word.startswith("--") and word != "--" and word.split("=", 1)[0] not in parser._option_string_actions]
    if unknown:
        parser.error(" ".join(f"unknown flag {flag}" + (f"; did you mean --{name}?" if name else "")
                              for flag in unknown for name in [nearest_name(flag[2:], known)]))
    try:
        file_values = read_config_file(config_cls, path) if (path := _config_path(argv)) else {}
    except ValueError as err:
        parser.error(str(err))
    for action in parser._actions:
        if action.dest in file_values:  # a flag given in argv still overrides this default
            action.default, action.required = file_values[action.dest], False
    values = vars(parser.parse_args(argv))
    del values["config"]
    hints = typing.get_type_hints(config_cls)
    for name, value in values.items():
        if isinstance(value, list) and typing.get_origin(unwrap_optional(hints[name])[0]) is tuple:
            values[name] = tuple(value)
    try:
        return config_cls(**values)
    except ValueError as err:
        parser.error(str(err))


def _config_path(argv: list[str]) -> str | None:
    """The value of ``--config`` in ``argv``, the last one given as argparse takes it (read before the
    other flags, which override the file)."""
    path = None
    for i, word in enumerate(argv):
        if word == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif word.startswith("--config="):
            path = word.split("=", 1)[1]
    return path


def comma_list(text: str) -> list[str]:
    """The names of a comma-separated flag value (``"a, b,"`` -> ``["a", "b"]``)."""
    return [name.strip() for name in text.split(",") if name.strip()]


def collect_errors(errors: list[str]) -> None:
    """Raise one ValueError listing every validation problem, if any."""
    if errors:
        raise ValueError("invalid configuration:\n  - " + "\n  - ".join(errors))


# ----------------------------------------------------------------------------
# Logging


def setup_logging(level: str = "INFO", *, rank: int = 0) -> None:
    """Configure the toolkit's logger; ranks other than 0 only show warnings and above.

    The first ERROR line is also kept (``_ExitLine``): it is the line torchrun's failure report shows.
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown logging level {level!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank{rank}] %(levelname)s %(message)s", "%H:%M:%S"))
    logger.handlers[:] = [handler, _exit_line]
    # torchao, imported by transformers (its quantizers) and peft whenever it is installed, QLoRA or not,
    # warns on every rank: it cannot load its CUDA-only kernels into a CPU build of torch, and torch 2.13
    # deprecates the pytree registration torchao 0.18 (the newest release) does at import. The NF4 type
    # QLoRA uses is plain PyTorch and needs neither. Nothing a user can act on; errors still show.
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logger.setLevel(numeric if rank == 0 else max(numeric, logging.WARNING))
    logger.propagate = False


class _ExitLine(logging.Handler):
    """Keeps the first ERROR line this process logs: the one line a failure ends with."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.line: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.line is None:
            self.line = record.getMessage()


_exit_line = _ExitLine()


def note_exit_line(line: str, *, override: bool = False) -> None:
    """Make ``line`` what this process's exit reports, unless an earlier error line already is
    (a rank that did not log the line itself: ``fail_together`` logs on rank 0 only); ``override``:
    in any case (a preemption whose save is done ends the run, whatever was logged before)."""
    if _exit_line.line is None or override:
        _exit_line.line = line


def log_rank_0(msg: str, *args: Any, level: int = logging.INFO) -> None:
    """Log on rank 0 only (other ranks' logger level already filters INFO)."""
    if int(os.environ.get("RANK", "0")) == 0:
        logger.log(level, msg, *args)


# ----------------------------------------------------------------------------
# Seeding


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) from the one config seed."""
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def rng_state() -> dict:
    """Every RNG this process draws from (Python, NumPy, torch CPU and, on GPU, CUDA), as tensors
    and plain numbers only, so ``torch.load(weights_only=True)`` reads it back without pickle."""
    import torch

    version, mt_words, gauss = random.getstate()
    kind, np_words, np_pos, has_gauss, cached = np.random.get_state()
    state = {
        "python_version": version, "python_words": torch.tensor(mt_words, dtype=torch.int64),
        "python_gauss": gauss,
        "numpy_kind": kind, "numpy_words": torch.from_numpy(np_words.astype(np.int64)),
        "numpy_pos": int(np_pos), "numpy_has_gauss": int(has_gauss), "numpy_cached_gaussian": float(cached),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import torch

    random.setstate((state["python_version"], tuple(state["python_words"].tolist()), state["python_gauss"]))
    np.random.set_state((state["numpy_kind"], state["numpy_words"].numpy().astype(np.uint32), state["numpy_pos"],
                         state["numpy_has_gauss"], state["numpy_cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ----------------------------------------------------------------------------
# Devices and distributed


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    local_rank: int
    world_size: int
    device: Any  # torch.device; typed loosely so this module imports without torch
    processes: tuple[tuple[str, int], ...] = ()  # (host, pid) of every rank, by rank; () when unknown

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def device_type() -> str:
    """'cuda' when a GPU is visible, else 'cpu'."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def process_group_backend(device: str, *, cpu_offload: bool = False) -> str:
    """nccl for cuda, gloo for cpu; with CPU offload on a GPU both, since gradient
    clipping then reduces norms of CPU-resident shards (a CPU collective)."""
    import torch.distributed as dist

    if device == "cuda" and cpu_offload:
        return "cuda:nccl,cpu:gloo"
    return dist.Backend.default_device_backend_map[device]


def positive_env_number(name: str, default: float) -> float:
    """``float(os.environ[name])`` or ``default``; a ValueError naming the variable unless positive."""
    value = float(os.environ.get(name, default))
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def init_distributed(timeout_minutes: float = 30.0, *, cpu_offload: bool = False) -> DistInfo:
    """Join the torchrun job (or become a one-process job without torchrun).

    The backend is ``process_group_backend``'s. ``MINI_TRAINER_DIST_TIMEOUT_MINUTES``
    overrides the collective timeout, the longest any rank waits in a collective
    for a peer that died (torch reads no variable for it; the SLURM script sets it).
    """
    import datetime

    import torch
    import torch.distributed as dist

    timeout_minutes = positive_env_number("MINI_TRAINER_DIST_TIMEOUT_MINUTES", timeout_minutes)
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    dtype = device_type()
    if dtype == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        # Plain `python train.py`: a one-process group keeps one code path. Its store lives in this process:
        # a TCP port picked free and bound a moment later can be taken meanwhile (EADDRINUSE on a busy host).
        alone = "MASTER_ADDR" not in os.environ and world_size == 1
        dist.init_process_group(
            backend=process_group_backend(dtype, cpu_offload=cpu_offload),
            store=dist.HashStore() if alone else None,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes),
            device_id=device if dtype == "cuda" else None,
        )
    processes: list[tuple[str, int] | None] = [None] * world_size
    dist.all_gather_object(processes, (socket.gethostname(), os.getpid()))  # lets a survivor name a lost rank
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=device,
                    processes=tuple(tuple(p) for p in processes))


def lost_ranks(dist_info: DistInfo) -> list[str]:
    """The ranks on this host whose process is gone (killed: the out-of-memory killer, ``kill -9``),
    as ``"rank R (pid P on HOST)"``; a rank on another host cannot be checked from here."""
    host = socket.gethostname()
    lost = []
    for rank, (peer_host, pid) in enumerate(dist_info.processes):
        if rank != dist_info.rank and peer_host == host and not pid_alive(pid):
            lost.append(f"rank {rank} (pid {pid} on {peer_host})")
    return lost


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process holds that pid
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True  # no /proc (macOS): the signal test above is all there is


def first_error(error: str | None) -> str | None:
    """The lowest rank's error line (each rank passes its own, or None), the same on every rank.

    The one way ranks agree in this toolkit: a refusal or failure seen on any rank
    (rank 0's checks, one rank's failed write) reaches every rank, so they stop
    together instead of waiting in their next collective for a rank that left.
    Collective: every rank calls it. Not for the hot path (it pickles).
    """
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return error
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((line for line in errors if line is not None), None)


def fail_together(error: str | None) -> None:
    """Exit every rank with code 1 when any rank has an error line; rank 0 logs it."""
    error = first_error(error)
    if error is not None:
        log_rank_0(error, level=logging.ERROR)
        note_exit_line(error)
        raise SystemExit(EXIT_FAILED)


@contextlib.contextmanager
def stop_in_one_line(dist_info: DistInfo):
    """Around the training loop: the failures a cluster causes end this rank with one line, exit code 1.

    * An ``OSError`` of this rank's own writes (the metrics file on a disk another writer filled):
      its message names the file and the cause.
    * A collective that failed because a peer rank is gone (it stopped on its own error, or the
      out-of-memory killer took it): the line names the lost rank, rather than gloo's traceback.

    Anything else propagates unchanged. Used inside the preemption flag's scope, so a SIGTERM
    from torchrun arriving meanwhile finds its handler (which also names the lost rank).
    """
    try:
        yield
    except OSError as err:
        logger.error("stopping: %s; the newest complete full state is intact: rerun the same command to resume "
                     "from it", err)
        raise SystemExit(1) from None
    except RuntimeError as err:  # gloo: "Connection closed by peer"; NCCL raises nothing, it waits
        lost = _wait_for_lost_ranks(dist_info, err)
        if not lost:
            raise
        logger.error("%s is gone (it stopped on its own error, logged there, or was killed, e.g. by the "
                     "out-of-memory killer): stopping this rank too; rerun the same command to resume from the "
                     "newest full state", ", ".join(lost))
        raise SystemExit(1) from None


def _wait_for_lost_ranks(dist_info: DistInfo, err: BaseException, timeout: float = 10.0) -> list[str]:
    """The peers that are gone after ``err``; a peer that closed its connection may still be exiting."""
    import time

    closed = any(text in str(err) for text in ("Connection closed by peer", "Connection reset by peer"))
    deadline = time.monotonic() + (timeout if closed else 0.0)
    while True:
        lost = lost_ranks(dist_info)
        if lost or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if not lost and closed:
        lost = ["a rank on another host"]
    return lost


def cleanup() -> None:
    """Leave the process group, pairing with ``init_distributed``."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


EXIT_FINISHED = 0
EXIT_FAILED = 1
EXIT_USAGE = 2       # argparse's status for bad flags
EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: stopped by a signal with the state saved; rerunning resumes
EXIT_INTERRUPTED = 130  # the shell's status for SIGINT: Ctrl-C before the loop, where there is nothing to save
"""The exit statuses of ``train.py`` (docs/training.md, "Exit statuses")."""


def exit_process(code: int = 0) -> None:
    """End this process now with ``code``, streams flushed, skipping the interpreter's teardown.

    A non-zero ``code`` leaves this process's one line (the first ERROR it logged, or what
    ``note_exit_line`` set) in torchrun's error file, so torchrun's failure report names that
    line as the root cause rather than "<N/A>".

    Both ways out of a command-line run take it: a run that finished, and a job already broken (a rank
    died). After ``destroy_process_group`` the gloo/NCCL groups stay referenced from torch's native DTensor
    dispatch caches (through the device mesh), so they are destroyed only during interpreter teardown,
    with their worker threads still running; a 2-rank CPU run was seen to lose a rank there to SIGABRT
    ("terminate called without an active exception") after it had saved and logged everything.
    Every file is closed by then; the streams are flushed here.
    """
    if code and _exit_line.line is not None:
        write_error_file(_exit_line.line)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


RUN_STATUS_FILE = "run_status.json"
_STATUS_NAMES = {EXIT_FINISHED: "finished", EXIT_PREEMPTED: "preempted", EXIT_INTERRUPTED: "interrupted"}


def write_run_status(output_dir: str | os.PathLike, code: int | None, line: str | None = None) -> None:
    """``<output-dir>/run_status.json``: how the run that holds the folder ended (``code`` None: it is running),
    for scripts that launch it through torchrun, whose own status is 0 or 1 only. Rank 0 writes it;
    a report, so a failed write is one warning."""
    import json
    import time

    status = "running" if code is None else _STATUS_NAMES.get(code, "failed")
    record = {"status": status, "exit_code": code, "message": line, "time": time.time()}
    path = os.path.join(output_dir, RUN_STATUS_FILE)
    try:
        with open(path + ".tmp", "w") as f:
            f.write(json.dumps(record) + "\n")
        os.replace(path + ".tmp", path)
    except OSError as err:
        logger.warning("%s not written (%s)", path, err.strerror or err)


def exit_line() -> str | None:
    """The line this process's failure ends with (the first ERROR it logged), if any."""
    return _exit_line.line


def write_error_file(line: str) -> None:
    """Write ``line`` where torchrun reads a rank's failure (``TORCHELASTIC_ERROR_FILE``, set for each rank),
    in the layout of torch's own ``ErrorHandler`` without its ``py_callstack``: the report then shows the
    line itself. Nothing without torchrun."""
    import json
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}, f)
    except OSError as err:  # the report falls back to "<N/A>"; the line is in the log already
        logger.warning("could not write torchrun's error file %s (%s)", path, err.strerror or err)


def synchronize() -> None:
    """Wait for queued device work (a no-op on CPU)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_peak_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_memory_gb() -> float:
    """Peak GPU memory allocated since the last reset, in GB (10**9 bytes, as the original
    mini_trainer logged it); on CPU, this process's peak RSS."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 1e9
    import resource

    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
