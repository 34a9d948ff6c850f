"""Launch a training job through torchrun's own API, and end it with the run's status and one line.

torchrun's flags first, then ``train.py``'s (one node, 8 GPUs; then two CPU processes):

    minitrainer-run --nnodes=1 --nproc-per-node=8 \\
        --output-dir ./output --data-path ./data/chat_tkns \\
        --model-name-or-path Qwen/Qwen2.5-1.5B-Instruct --min-samples-per-checkpoint 2000

    python -m minitrainer.run --nproc-per-node=2 --output-dir /tmp/out --data-path /tmp/data \\
        --model-name-or-path /tmp/tiny --min-samples-per-checkpoint 64 --batch-size 16 --max-steps 4

Every rank runs ``python -m minitrainer.train`` with the training flags, exactly as
``torchrun --nproc-per-node=8 -m minitrainer.train ...`` would start it: the flags, their parsing,
the exit paths and the files a run writes are the same. What differs is the end. torchrun exits 1
after any failure or signal, with its ``ChildFailedError`` report (~40 lines) under the run's line;
this command prints at most one line of its own, the run's (from ``<output-dir>/run_status.json``,
else the first failed rank's error file), and exits with the run's status (docs/training.md, "Exit
statuses"): 0 finished, 1 failed, 2 bad flags, 75 preempted and saved, 130 interrupted before a save.

The training flags are checked here before any worker starts (``train.py``'s own parser): a typo
costs no process start and is refused once, not once per rank. ``-- `` may separate the two sets of
flags; without it the training flags begin at the first word that is not one of torchrun's flags.
``--help`` lists torchrun's flags; ``python -m minitrainer.train --help`` explains the training ones.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from minitrainer.common.cli import parse_config
from minitrainer.common.commands import command
from minitrainer.common.exits import EXIT_FAILED, EXIT_FINISHED, EXIT_INTERRUPTED, EXIT_USAGE, RUN_STATUS_FILE
from minitrainer.train_config import TrainConfig

__all__ = ["PROG", "TRAIN_MODULE", "cli", "launch", "main", "pythonpath_with_package", "read_run_status", "split_argv"]

PROG = "minitrainer-run"
TRAIN_MODULE = "minitrainer.train"
PACKAGE_PARENT = Path(__file__).resolve().parent.parent
"""Where ``minitrainer`` is imported from: site-packages once installed, else the checkout."""
NOT_OURS = ("module", "no_python", "run_path")
"""torchrun flags that choose the program to run: this command always runs ``-m minitrainer.train``."""



def pythonpath_with_package(pythonpath: str | None) -> str:
    """``pythonpath`` with ``PACKAGE_PARENT`` last (once): a child ``python -m minitrainer...`` finds the package
    where this process found it, after whatever the caller's path puts first."""
    entries = [entry for entry in (pythonpath or "").split(os.pathsep) if entry]
    return os.pathsep.join(entries if str(PACKAGE_PARENT) in entries else [*entries, str(PACKAGE_PARENT)])

REPLACED_REPORTS = {
    "torch.distributed.elastic.agent.server.api": ("Received %s death signal",),
    "torch.distributed.elastic.multiprocessing.api": ("failed (exitcode", "Sending process %s closing signal"),
}
"""torchrun's log lines that the run's own line replaces (a rank's end, a signal passed on); its others stay."""


class _DropReplaced(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def _torchrun_parser():
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog, parser.usage = PROG, f"{PROG} [torchrun flags] [--] [train.py flags]"
    return parser


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` cut where torchrun's flags end: at ``--``, or at the first word that is none of them.

    Returns:
        torchrun's words (each flag with its value) and the training flags.
    """
    parser = _torchrun_parser()
    # argparse's table of option strings: the only way to know which of torchrun's flags take a value.
    takes_value = {option: action.nargs != 0 for action in parser._actions for option in action.option_strings}
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return argv[:i], argv[i + 1:]
        name = word.split("=", 1)[0]
        if name not in takes_value:
            break
        i += 2 if takes_value[name] and "=" not in word else 1
    return argv[:i], argv[i:]


def read_run_status(output_dir: str | os.PathLike, *, since: float = 0.0) -> dict:
    """``run_status.json`` of ``output_dir`` if this launch wrote it (its ``time`` is after ``since``), else
    ``{}``: a run stopped before it held the folder leaves the previous run's file."""
    try:
        status = json.loads((Path(output_dir) / RUN_STATUS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return status if isinstance(status, dict) and status.get("time", 0.0) >= since else {}


def _failure_line(error) -> tuple[int, str]:
    """The status and line of torchrun's ``ChildFailedError``: the rank that failed first, its own line (the
    error file ``exit_process`` or ``record`` wrote: a traceback's last line), or how it died."""
    rank, failure = error.get_first_failure()
    message = failure.message
    if isinstance(message, dict):  # torch's ErrorHandler layout: {"message": ..., "extraInfo": ...}
        message = message.get("message", "")
    lines = str(message).strip().splitlines()
    if failure.exitcode < 0:
        return EXIT_FAILED, f"rank {rank} (pid {failure.pid}) was killed by {failure.signal_name()}"
    if not failure.error_file_data or not lines:
        return EXIT_FAILED, f"rank {rank} (pid {failure.pid}) exited with status {failure.exitcode}"
    code = failure.exitcode if failure.exitcode in (EXIT_USAGE, EXIT_INTERRUPTED) else EXIT_FAILED
    return code, lines[-1]


def launch(torchrun_argv: list[str], train_argv: list[str], *, output_dir: str | os.PathLike) -> tuple[int, str | None]:
    """Run ``python -m minitrainer.train *train_argv`` on every rank torchrun's flags describe; wait for the job.

    SIGINT and SIGTERM to this process reach every rank (torchrun's agent passes them on): the loop saves
    its state and stops, and the status is the run's 75.

    Returns:
        the run's exit status and its one line (None when it finished).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    args = _torchrun_parser().parse_args([*torchrun_argv, TRAIN_MODULE])
    if chosen := [name for name in NOT_OURS if getattr(args, name)]:
        return EXIT_USAGE, (f"--{chosen[0].replace('_', '-')} is torchrun's choice of program; {PROG} always "
                            f"runs -m {TRAIN_MODULE}")
    args.module, args.training_script_args = True, list(train_argv)
    # By module, never by a file's path: the ranks find the package where this process found it (a checkout
    # that is not installed included), after whatever the caller's PYTHONPATH puts first.
    os.environ["PYTHONPATH"] = pythonpath_with_package(os.environ.get("PYTHONPATH"))
    for name, prefixes in REPLACED_REPORTS.items():
        logging.getLogger(name).addFilter(_DropReplaced(prefixes))
    started = time.time()
    try:
        run(args)
        return EXIT_FINISHED, None
    except ChildFailedError as error:
        code, line = _failure_line(error)
    except SignalException as error:  # the agent has passed the signal on and waited for the ranks
        code, line = EXIT_INTERRUPTED, f"interrupted ({signal.Signals(error.sigval).name})"
    except KeyboardInterrupt:  # before the agent's own handlers were up: no rank was started
        code, line = EXIT_INTERRUPTED, "interrupted (SIGINT)"
    except (ValueError, RuntimeError, AssertionError) as error:  # torchrun refused its flags or the rendezvous
        return EXIT_FAILED, f"torchrun: {error}"
    status = read_run_status(output_dir, since=started)
    if status.get("exit_code") is not None:  # rank 0's own line, where it stopped (a stop before step 1 included)
        code, line = status["exit_code"], status.get("message") or line
    elif status.get("status") == "running":  # rank 0 held the folder and was ended before it could say how
        line = f"{line}; the run recorded no end: the same command resumes from its newest full state, or " \
               "starts again where it has none"
    elif code == EXIT_INTERRUPTED:  # before rank 0 held the folder
        line = f"{line} before training began; nothing to save"
    return code, line


def _help() -> str:
    """This docstring, then torchrun's flags by name (``python -m torch.distributed.run --help`` explains them)."""
    import textwrap

    names = [action.option_strings[0] for action in _torchrun_parser()._actions
             if action.option_strings and action.dest not in (*NOT_OURS, "help")]
    return (f"usage: {PROG} [torchrun flags] [--] [train.py flags]\n\n{__doc__.strip()}\n\n"
            f"torchrun flags (python -m torch.distributed.run --help):\n"
            + textwrap.fill(", ".join(names), width=100, initial_indent="  ", subsequent_indent="  ")
            + f"\ntrain.py flags: {command(TRAIN_MODULE)} --help")


def main(argv: list[str] | None = None) -> int:
    """Check the training flags, launch, and return the run's exit status (its line printed)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    torchrun_argv, train_argv = split_argv(argv)
    if "-h" in torchrun_argv or "--help" in torchrun_argv:
        print(_help())
        return EXIT_FINISHED
    # Checked once, here: a refusal is train.py's own one line (status 2), before a rank starts.
    config = parse_config(TrainConfig, train_argv, description=__doc__.split("\n\n")[0])
    code, line = launch(torchrun_argv, train_argv, output_dir=config.output_dir)
    if line is not None:
        print(f"{PROG}: exit status {code}: {line}", file=sys.stderr, flush=True)
    return code


def cli() -> None:
    """``python -m minitrainer.run`` and the ``minitrainer-run`` console script."""
    sys.argv[0] = PROG  # the name a refusal of the training flags starts with (argparse's prog), not "run.py"
    sys.exit(main())


if __name__ == "__main__":
    cli()
