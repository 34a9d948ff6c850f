"""``--progress``: a bar for a terminal, plain lines for a file or SLURM, or nothing (issue 54).

    .venv/bin/python -m pytest -q tests/test_progress.py

Under SLURM or ``> log`` a tqdm bar's carriage returns glued the whole run into one line of thousands of
characters; the end-to-end test runs the real trainer with stderr in a file, as SLURM does: ``auto`` in a fresh
process (its whole output, import-time lines included, is the subject), ``none`` as a warm 1-rank run (what the
run itself prints).
"""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.e2e import ROOT, model_vocab_size, torchrun, write_tokenized_jsonl
from minitrainer.common.cli import parse_config
from minitrainer.report.progress import Progress, format_duration, resolve_progress
from minitrainer.train_config import TrainConfig

STEP_LINE = "INFO step "


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_is_a_bar_on_a_terminal_and_lines_elsewhere():
    assert resolve_progress("auto", _Terminal()) == "bar"
    assert resolve_progress("auto", io.StringIO()) == "lines"
    assert [resolve_progress(mode, io.StringIO()) for mode in ("bar", "lines", "none")] == ["bar", "lines", "none"]


def test_every_mode_is_a_flag_and_others_are_refused(capsys):
    base = ["--output-dir", "o", "--model-name-or-path", "m", "--data-path", "d"]
    assert parse_config(TrainConfig, base).progress == "auto"
    assert [parse_config(TrainConfig, [*base, "--progress", m]).progress for m in ("bar", "lines", "none")] \
        == ["bar", "lines", "none"]
    with pytest.raises(SystemExit):
        parse_config(TrainConfig, [*base, "--progress", "dots"])


def _steps(progress: Progress, clock: _Clock, steps: range, seconds_per_step: float) -> None:
    for step in steps:
        clock.now += seconds_per_step
        progress.update(step=step, loss=2.5, tokens_per_second=1000.0, samples=8 * step)


@pytest.mark.parametrize("total", [7, 10, 100, 1000])
def test_lines_come_at_the_first_step_each_tenth_and_the_last(caplog, total):
    clock = _Clock()
    progress = Progress("lines", total=total, clock=clock)
    with caplog.at_level(logging.INFO, logger="mini_trainer"):
        _steps(progress, clock, range(1, total + 1), seconds_per_step=0.01)  # never 30 s between lines
    steps = [int(r.getMessage().split()[1].split("/")[0]) for r in caplog.records]
    tenths = sorted({1, total, *(next(s for s in range(1, total + 1) if s * 10 >= k * total) for k in range(1, 11))})
    assert steps == tenths
    assert all(len(r.getMessage()) < 200 and "\r" not in r.getMessage() for r in caplog.records)


def test_lines_also_come_every_30_seconds_with_an_eta(caplog):
    clock = _Clock()
    progress = Progress("lines", total=None, initial=40, clock=clock)
    with caplog.at_level(logging.INFO, logger="mini_trainer"):
        _steps(progress, clock, range(41, 51), seconds_per_step=10.0)
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["step 41", "step 44", "step 47", "step 50"]
    caplog.clear()
    clock = _Clock()
    progress = Progress("lines", total=100, initial=50, clock=clock)
    with caplog.at_level(logging.INFO, logger="mini_trainer"):
        _steps(progress, clock, range(51, 52), seconds_per_step=6.0)
    assert caplog.records[0].getMessage() == ("step 51/100 (51%): loss 2.5000, 1000 tokens/s, samples 408, "
                                              "elapsed 6s, eta 4m54s")
    assert format_duration(3725) == "1h02m"


PAIR_METRICS = {"rewards/accuracies": 0.625, "rewards/margins": 0.03125}


def test_a_preference_objectives_line_shows_its_metrics_and_counts_pairs(caplog):
    """The objective's ``console_metrics`` after the loss, in its unit; SFT's line is unchanged (above)."""
    from minitrainer.objectives.base import TrainingObjective
    from minitrainer.objectives.dpo import DPOObjective

    assert TrainingObjective.console_metrics == () and TrainingObjective.unit == "samples"
    assert DPOObjective.console_metrics == tuple(PAIR_METRICS) and DPOObjective.unit == "pairs"
    clock = _Clock()
    progress = Progress("lines", total=10, initial=2, clock=clock)
    clock.now += 10.0
    with caplog.at_level(logging.INFO, logger="mini_trainer"):
        progress.update(step=3, loss=0.68123, tokens_per_second=5120.0, samples=96, unit="pairs",
                        metrics=PAIR_METRICS)
    assert [r.getMessage() for r in caplog.records] == [
        "step 3/10 (30%): loss 0.6812, acc 0.62, margin 0.031, 5120 tokens/s, pairs 96, elapsed 10s, eta 1m10s"]
    # A field the record lacks (or null) is n/a, never a guess; an unnamed field shows as itself.
    assert progress.line(step=4, loss=0.5, tokens_per_second=1.0, samples=128, unit="pairs",
                         metrics={"rewards/accuracies": None, "odds_ratio": 1.234567}).startswith(
        "step 4/10 (40%): loss 0.5000, acc n/a, odds_ratio 1.235, 1 tokens/s, pairs 128, ")


def test_the_bar_of_a_preference_objective_shows_its_metrics_and_pairs(capsys):
    progress = Progress("bar", total=2)
    progress.update(step=1, loss=0.6931, tokens_per_second=100.0, samples=32, unit="pairs", metrics=PAIR_METRICS)
    postfix = progress.bar.postfix
    progress.close()
    assert postfix == "loss=0.6931, acc=0.62, margin=0.031, tok_s=100, pairs=32"
    assert "samples" not in capsys.readouterr().err


def test_none_and_other_ranks_report_nothing(caplog, capsys):
    for progress in (Progress("none", total=10), Progress("lines", total=10, enabled=False),
                     Progress("bar", total=10, enabled=False)):
        with caplog.at_level(logging.DEBUG, logger="mini_trainer"):
            _steps(progress, _Clock(), range(1, 11), seconds_per_step=60.0)
        progress.close()
    assert not caplog.records and capsys.readouterr().err == ""


def test_bar_is_tqdm_on_stderr(capsys):
    progress = Progress("bar", total=3)
    _steps(progress, _Clock(), range(1, 4), seconds_per_step=1.0)
    assert progress.bar.postfix == "loss=2.5000, tok_s=1000, samples=24"
    progress.close()
    err = capsys.readouterr().err
    assert "train" in err and "3/3" in err and "loss=2.5000" in err


def _args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out), "--batch-size",
            "4", "--max-tokens-per-gpu", "128", "--max-steps", "3", "--min-samples-per-checkpoint", "1000",
            "--num-data-workers", "0", "--num-warmup-steps", "0", *extra]


def _train(tmp_path: Path, model: Path, data: Path, name: str, *extra: str) -> str:
    """One single-process run (no torchrun), its stderr in a file as SLURM and ``2> log`` keep it."""
    log = tmp_path / f"{name}.log"
    with log.open("wb") as stderr:
        result = subprocess.run(
            [sys.executable, str(ROOT / "train.py"), *_args(model, data, tmp_path / name, *extra)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr, timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""})
    text = log.read_bytes().decode()  # bytes: text mode would turn each \r into a newline
    assert result.returncode == 0, text[-4000:]
    return text


def test_a_run_logged_to_a_file_has_plain_lines_and_none_has_no_progress(tmp_path, chatml_model):
    data = write_tokenized_jsonl(tmp_path / "train.jsonl", num_samples=16, vocab_size=model_vocab_size(chatml_model))
    text = _train(tmp_path, chatml_model, data, "auto")
    assert "\r" not in text and "progress: lines (stderr is not a terminal)" in text
    assert max(len(line) for line in text.splitlines()) <= 300
    assert [line.split(STEP_LINE)[1].split()[0] for line in text.splitlines() if STEP_LINE in line] \
        == ["1/3", "2/3", "3/3"]
    # A warm call's streams are files too, and hold all the run itself prints; the fresh run above held the rest.
    quiet = torchrun(_args(chatml_model, data, tmp_path / "none", "--progress", "none"), nproc=1, warm=True)
    assert quiet.returncode == 0, quiet.stderr[-4000:]
    assert STEP_LINE not in quiet.stderr and "\r" not in quiet.stderr
