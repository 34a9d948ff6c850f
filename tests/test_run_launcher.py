"""``python -m minitrainer.run`` (torchrun's own API in our process): a job ends with the run's exit status and
one line of the launcher's own, never torchrun's ``ChildFailedError`` report (issue 54 item 1).

    .venv/bin/python -m pytest -q tests/test_run_launcher.py

Real fresh launches of 2 gloo CPU ranks, the launcher's process and its output being the subject: a failure
inside the ranks, a Ctrl-C to the launcher's process group (what a terminal sends) whose rerun finishes. A typo in
the training flags (refused before any rank starts) is refused by the launcher's ``cli`` in this process; the
installed ``minitrainer-run``'s real process shows the same refusal (tests/test_packaging.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures.e2e import ROOT, assert_ok, model_vocab_size, read_metrics, torchrun, write_tokenized_jsonl, \
    write_tokenized_pairs
from tests.test_exit_status import _stepped, _status
from tests.test_faults import _args

SECONDS_TO_EXIT = 60
PROG = "minitrainer-run"
TORCHRUN_REPORT = ("Traceback", "ChildFailedError", "failed (exitcode", "death signal", "closing signal")


@pytest.fixture(scope="module")
def data_path(tmp_path_factory, chatml_model) -> Path:
    return write_tokenized_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", num_samples=60,
                                 vocab_size=model_vocab_size(chatml_model), seed=3)


def _start(tmp_path: Path, args: list[str], env: dict | None = None) -> tuple[subprocess.Popen, Path, Path]:
    """The launcher in a process group of its own (a terminal's foreground job), its streams in files."""
    stdout, stderr = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    command = [sys.executable, "-m", "minitrainer.run", "--nproc-per-node=2", *args]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    with stdout.open("w") as out, stderr.open("w") as err:
        proc = subprocess.Popen(command, cwd=tmp_path, env=full_env, stdout=out, stderr=err, start_new_session=True)
    return proc, stdout, stderr


def _run(tmp_path: Path, args: list[str], env: dict | None = None) -> tuple[int, str]:
    proc, _, stderr = _start(tmp_path, args, env)
    return proc.wait(timeout=300), stderr.read_text()


def _own_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(f"{PROG}:")]


def test_a_failure_in_the_ranks_ends_in_the_runs_line_and_status_1(tmp_path, chatml_model, data_path):
    out = tmp_path / "out"
    code, stderr = _run(tmp_path, _args(tmp_path / "modles" / "qwen", data_path, out))
    line = f"--model-name-or-path {tmp_path / 'modles' / 'qwen'}: no such folder"
    assert code == 1, stderr[-4000:]
    assert _own_lines(stderr) == [f"{PROG}: exit status 1: {line}"], stderr[-4000:]
    assert stderr.splitlines()[-1] == f"{PROG}: exit status 1: {line}", stderr[-4000:]
    assert not [word for word in TORCHRUN_REPORT if word in stderr], stderr[-4000:]
    assert _status(out)["message"] == line


def test_ctrl_c_ends_in_the_preemption_line_and_75_then_the_rerun_finishes_with_0(tmp_path, chatml_model,
                                                                                  data_path):
    out = tmp_path / "out"
    args = _args(chatml_model, data_path, out)
    proc, _, stderr = _start(tmp_path, args, env={"MINI_TRAINER_TEST_STEP_SLEEP": "1"})
    deadline = time.monotonic() + 240
    while not _stepped(out):
        assert proc.poll() is None and time.monotonic() < deadline, stderr.read_text()[-4000:]
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the launcher's agent passes it to every rank
    code = proc.wait(timeout=SECONDS_TO_EXIT)
    text = stderr.read_text()
    status = _status(out)
    assert code == 75 and status["exit_code"] == 75, (status, text[-4000:])
    assert status["message"].startswith("preempted at step ") and status["message"].endswith(
        "run the same command to resume"), status
    assert _own_lines(text) == [f"{PROG}: exit status 75: {status['message']}"], text[-4000:]
    assert text.splitlines()[-1] == _own_lines(text)[0]
    assert "KeyboardInterrupt" not in text and not [word for word in TORCHRUN_REPORT if word in text], text[-4000:]

    rerun = tmp_path / "rerun"
    rerun.mkdir()
    code, text = _run(rerun, args)
    assert code == 0, text[-4000:]
    assert _own_lines(text) == [] and "resumed from" in text, text[-4000:]
    assert _status(out)["status"] == "finished"


def test_sigterm_during_the_reference_pass_says_so_with_130_and_the_same_command_starts_again(tmp_path,
                                                                                             chatml_model):
    """Before step 1 there is nothing to save: the line says where the run was and that the same command starts
    again (not that it resumes from a full state there is none of), and run_status.json says the same."""
    import math

    data = write_tokenized_pairs(tmp_path / "pairs", num_pairs=32, vocab_size=model_vocab_size(chatml_model))
    out = tmp_path / "out"
    args = ["--model-name-or-path", str(chatml_model), "--data-path", str(data), "--output-dir", str(out),
            "--objective", "dpo", "--batch-size", "16", "--max-tokens-per-gpu", "64", "--max-steps", "1",
            "--num-data-workers", "0", "--min-samples-per-checkpoint", "1000"]
    proc, _, stderr = _start(tmp_path, args, env={"MINI_TRAINER_TEST_PREPARE_SLEEP": "120"})
    deadline = time.monotonic() + 240
    while "MINI_TRAINER_TEST_PREPARE_SLEEP: sleeping" not in stderr.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, stderr.read_text()[-4000:]
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGTERM)
    code = proc.wait(timeout=SECONDS_TO_EXIT)
    text = stderr.read_text()
    line = ("stopped by SIGTERM during the reference pass, before the first step: nothing to save; the same command "
            "starts again")
    assert code == 130, text[-4000:]
    assert _own_lines(text) == [f"{PROG}: exit status 130: {line}"], text[-4000:]
    assert _status(out)["status"] == "interrupted" and _status(out)["exit_code"] == 130, _status(out)
    assert _status(out)["message"] == line
    assert "Traceback" not in text and not [word for word in TORCHRUN_REPORT if word in text], text[-4000:]
    assert not (out / "full_state").exists() and not list(tmp_path.rglob("reference_logps/*.npz"))

    assert_ok(torchrun(args, warm=True))  # the same command: a whole run from the start
    assert read_metrics(out)[0]["loss"] == math.log(2)


def test_a_typo_in_the_training_flags_is_refused_once_with_2_before_any_rank(tmp_path, chatml_model, data_path,
                                                                            capsys, monkeypatch):
    from minitrainer.run import cli

    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["run.py", "--nproc-per-node=2",
                                      *_args(chatml_model, data_path, out, "--max-stepz", "3")])
    with pytest.raises(SystemExit) as stop:
        cli()
    captured = capsys.readouterr()
    assert stop.value.code == 2, captured.err[-4000:]
    assert captured.err == f"{PROG}: error: unknown flag --max-stepz; did you mean --max-steps?\n"
    assert captured.out == ""
    assert not out.exists(), "no rank started"


@pytest.mark.parametrize("argv, torchrun_words, train_words", [
    (["--nproc-per-node", "2", "--standalone", "--max-steps", "3"], ["--nproc-per-node", "2", "--standalone"],
     ["--max-steps", "3"]),
    (["--nproc-per-node=2", "--log-dir=/x", "--", "--seed", "1"], ["--nproc-per-node=2", "--log-dir=/x"],
     ["--seed", "1"]),
    (["--output-dir", "o"], [], ["--output-dir", "o"]),
])
def test_torchruns_flags_end_at_the_first_word_that_is_not_one_of_them(argv, torchrun_words, train_words):
    from minitrainer.run import split_argv

    assert split_argv(argv) == (torchrun_words, train_words)
