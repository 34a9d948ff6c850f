"""Fine-tune a Hugging Face causal LM with FSDP2 on padding-free packed minibatches.

Single node (8 GPUs):

    torchrun --nnodes=1 --nproc-per-node=8 train.py \\
        --output-dir ./output --data-path ./data/chat_tkns \\
        --model-name-or-path Qwen/Qwen2.5-1.5B-Instruct \\
        --min-samples-per-checkpoint 2000 --num-warmup-steps 20 \\
        --max-tokens-per-gpu 128000 --batch-size 128 --use-liger-kernels \\
        --seed 8888 --learning-rate 6e-6

The same settings from a config file (YAML or JSON; ``examples/`` holds ready ones, and a
run's own ``training_params.json`` replays it), flags after it overriding it:

    torchrun --nnodes=1 --nproc-per-node=8 train.py --config examples/full_8gpu.yaml --seed 8888

CPU (two gloo processes, the tiny model ``python -m minitrainer.tools.tiny_model`` builds):

    torchrun --nproc-per-node=2 train.py --output-dir /tmp/out --data-path /tmp/data \\
        --model-name-or-path /tmp/tiny --min-samples-per-checkpoint 64 \\
        --batch-size 16 --max-tokens-per-gpu 512 --max-steps 4

``--data-path`` may also be raw data in any format ``process_data.py`` reads (``data/chat.parquet``):
rank 0 tokenizes it once into ``--output-dir/tokenized_data/`` (``data/cache.py``), reused by a rerun.

Each optimizer step takes ``--batch-size`` samples from an infinite seeded
stream, packs them into minibatches of at most ``--max-tokens-per-gpu`` tokens
per rank (gradient accumulation follows), and optimises the exact per-token
mean cross-entropy over the whole batch. Python API: ``train(TrainConfig(...))``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from minitrainer.checkpoint import output_lock, resume_policy
from minitrainer.common.cli import parse_config
from minitrainer.common.distributed import DistInfo, cleanup, init_distributed, lost_ranks, stop_in_one_line
from minitrainer.common.exits import (EXIT_FAILED, EXIT_FINISHED, EXIT_INTERRUPTED, exit_process, stopped_line,
                                      write_run_status)
from minitrainer.common.log import exit_line, log_rank_0, logger, note_exit_line, setup_logging
from minitrainer.loop.preemption import PreemptionFlag, StopBeforeTraining, Stopped
from minitrainer.report.progress import Progress, announce_progress, resolve_progress
from minitrainer.loop.actions import batches, checkpoints_due, rewind, save, stop_preempted, validate, validation_due
from minitrainer.setup.schedule import stop_reason
from minitrainer.setup.run import close_run, setup_run
from minitrainer.train_config import SCHEDULERS_WITHOUT_TOTAL, TrainConfig
from minitrainer.loop.step import log_step, reduce_step, report_divergence, report_skipped_step, train_step

__all__ = ["TrainConfig", "cli", "main", "train"]


def train(config: TrainConfig) -> Path | None:
    """Run training as one rank of a torchrun job (or alone). Returns the last HF checkpoint."""
    dist_info = init_distributed(cpu_offload=config.cpu_offload)
    setup_logging(config.logging_level, rank=dist_info.rank)
    announce_progress(config.progress, resolve_progress(config.progress))
    code = EXIT_FAILED  # unless it returns or exits with a status of its own
    try:
        last_checkpoint = _train(config, dist_info)
        code = EXIT_FINISHED
        return last_checkpoint
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else EXIT_FAILED
        raise
    except Stopped as stop:  # a signal before the first step: nothing to save
        code = EXIT_INTERRUPTED
        log_rank_0(stop.line, level=logging.WARNING)
        note_exit_line(stop.line, override=True)
        raise SystemExit(code) from None
    finally:
        # A run refused for the lock another run holds leaves that run's status alone.
        if dist_info.is_main and output_lock.release(config.output_dir):
            write_run_status(config.output_dir, code, exit_line())
        cleanup()


def _train(config: TrainConfig, dist_info: DistInfo) -> Path | None:
    """Set up; then for each batch: one optimizer step, its metrics line, maybe validate, save or stop."""
    with StopBeforeTraining():
        run = setup_run(config, dist_info)
    done = stop_reason(config, run.state, len(run.dataset))
    if done:  # a resumed run that has nothing left to train
        log_rank_0(resume_policy.finished_message(
            done, lr_scheduler_decays=config.lr_scheduler not in SCHEDULERS_WITHOUT_TOTAL))
        close_run(run)
        return None
    progress = Progress(resolve_progress(config.progress), total=run.total_steps, initial=run.state.step,
                        enabled=dist_info.is_main)
    last_checkpoint: Path | None = None
    run.model.train()
    # Undone however the loop ends: the loader's workers ignore SIGTERM and would hold the exit of a
    # rank that leaves by an exception (sampler.BatchLoader). A full disk or a lost peer: one line each.
    with (batches(run) as loader, PreemptionFlag(lambda: lost_ranks(dist_info)) as preemption,
          stop_in_one_line(dist_info)):
        for batch in loader:
            result = train_step(run, batch)
            counts, preempted = reduce_step(run, batch, result, preemption_requested=preemption.requested)
            log_step(run, batch, result, counts, progress=progress)
            report_skipped_step(run, batch, result)
            if report_divergence(run, batch, result, counts):
                rewind(run, batch)
                continue
            done = stop_reason(config, run.state, len(run.dataset))
            if validation_due(run, batch, done=done, preempted=preempted):
                done = validate(run) or done
            export_due, full_due = checkpoints_due(run, batch, done=done, preempted=preempted)
            if export_due or full_due:
                last_checkpoint = save(run, hf_export=export_due, full_state=full_due) or last_checkpoint
            if done:
                log_rank_0("stopping: %s", done)
            if done or preempted:
                break
    progress.close()
    close_run(run)
    if preempted:
        stop_preempted(run)
    return last_checkpoint


def main(argv: list[str] | None = None) -> None:
    config = parse_config(TrainConfig, argv, description=__doc__.split("\n\n")[0])
    train(config)


def cli() -> None:
    """The command line (``torchrun train.py``, ``torchrun -m minitrainer.train``, ``minitrainer-train``): runs
    ``main`` and ends the process with its exit status.

    Exit statuses: ``EXIT_*``, documented in docs/training.md. A handled refusal or failure has logged its
    one line and leaves it in torchrun's error file (exit_process); ``record`` writes an unexpected
    exception's traceback there, and Python still prints it.
    """
    try:
        record(main)()
    except SystemExit as stop:  # a refusal, failure or preemption, already logged in one line; --help; usage
        exit_process(0 if stop.code is None else stop.code if isinstance(stop.code, int) else EXIT_FAILED)
    except KeyboardInterrupt:  # Ctrl-C before start-up handles it (StopBeforeTraining): nothing is trained yet
        note_exit_line(stopped_line("SIGINT"))
        logger.warning(exit_line())
        exit_process(EXIT_INTERRUPTED)
    exit_process()


if __name__ == "__main__":
    cli()
