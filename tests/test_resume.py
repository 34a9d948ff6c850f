"""Runs that survive: exact resume after SIGKILL, kill during save, SIGTERM, world-size change, NaN steps.

    .venv/bin/python -m pytest -q tests/test_resume.py

Every fault is a real fresh ``torchrun`` of train.py with 2 gloo CPU processes on the
tiny local model, injected with test-only environment hooks that SIGKILL or signal
the real processes. The runs whose numbers are the subject (the reference, and the
resumes that must equal it) are ``train.main`` calls in a warm 2-rank (or 1-rank)
torchrun job (``fixtures/warm_jobs.py``): real ranks, files and gloo group, started once.
The killed run most resumes start from is killed once (``killed_after_first_state``)
and copied.
"""

from __future__ import annotations

import glob
import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fixtures.e2e import (ROOT, _free_port, assert_ok, model_vocab_size, pickle_enums, read_metrics, torchrun,
                          write_tokenized_jsonl)
from minitrainer.checkpoint.full_state import complete_checkpoints
from tests.test_faults import _no_worker_traceback

BATCH = 12
STEPS = 8
CHECKPOINT_EVERY = 4 * BATCH  # full state after step 4 and step 8


@pytest.fixture(scope="module")
def data_path(tmp_path_factory, chatml_model) -> Path:
    vocab = model_vocab_size(chatml_model)
    return write_tokenized_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", num_samples=60,
                                 vocab_size=vocab, seed=3)


def _args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out),
            "--batch-size", str(BATCH), "--max-tokens-per-gpu", "96", "--seed", "11",
            "--learning-rate", "1e-3", "--num-warmup-steps", "2", "--lr-scheduler", "cosine",
            "--max-steps", str(STEPS), "--min-samples-per-checkpoint", str(CHECKPOINT_EVERY),
            "--num-data-workers", "0", *extra]


def _checkpoint_names(out: Path) -> dict[str, list[str]]:
    return {kind: [p.name for p in complete_checkpoints(out / kind)] for kind in ("full_state", "hf_format")}


def _final_weights(out: Path) -> dict[str, torch.Tensor]:
    newest = complete_checkpoints(out / "hf_format")[-1]
    return load_file(newest / "model.safetensors")


def _assert_same_steps(a: list[dict], b: list[dict], *, values: tuple[str, ...] = ("loss", "lr", "grad_norm")) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        for key in values:
            assert math.isclose(ra[key], rb[key], rel_tol=1e-6, abs_tol=1e-12), (ra["step"], key, ra[key], rb[key])
        for key in ("num_samples", "samples_seen", "total_samples_accumulated", "batch_num_loss_counted_tokens"):
            assert ra[key] == rb[key], (ra["step"], key)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, chatml_model, data_path) -> Path:
    out = tmp_path_factory.mktemp("run_a")
    assert_ok(torchrun(_args(chatml_model, data_path, out), warm=True))
    return out


@pytest.fixture(scope="module")
def killed_after_first_state(tmp_path_factory, chatml_model, data_path) -> Path:
    """A run whose every rank SIGKILLed itself right after its first full state (step 4): one kill that the
    resumes below each start from, in a copy of their own (``_copy_killed``)."""
    out = tmp_path_factory.mktemp("killed") / "run"
    killed = torchrun(_args(chatml_model, data_path, out),
                      env={"MINI_TRAINER_TEST_KILL_AFTER_SAVE": str(CHECKPOINT_EVERY)})
    assert killed.returncode != 0
    assert [p.name for p in complete_checkpoints(out / "full_state")] == [f"samples_{CHECKPOINT_EVERY}"]
    return out


def _copy_killed(killed: Path, out: Path) -> Path:
    """A copy without the kill's stale lock: by a later test the dead rank's pid may be another process's (pid_max
    is 32768 on a busy host). The takeover itself is met by the resumes right after the other kills below."""
    return Path(shutil.copytree(killed, out, ignore=shutil.ignore_patterns(".lock")))


def test_sigkill_after_checkpoint_then_rerun_resumes_exactly(tmp_path, chatml_model, data_path, uninterrupted,
                                                             killed_after_first_state):
    out = _copy_killed(killed_after_first_state, tmp_path / "run_b")
    with (out / "training_metrics_0.jsonl").open("a") as f:
        f.write('{"step": 5, "lr": 0.0')  # a kill mid-write leaves half a line
    resumed = torchrun(_args(chatml_model, data_path, out), warm=True)
    assert_ok(resumed)
    assert f"resumed from {out / 'full_state' / f'samples_{CHECKPOINT_EVERY}'}" in resumed.stderr
    _assert_same_steps(read_metrics(out), read_metrics(uninterrupted))
    assert _checkpoint_names(out) == _checkpoint_names(uninterrupted), "same cadence with a resume in between"
    a, b = _final_weights(uninterrupted), _final_weights(out)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("by_name", [False, True], ids=["enum_by_value", "enum_by_name"])
def test_resume_from_metadata_in_either_interpreters_form(tmp_path, chatml_model, data_path, uninterrupted,
                                                          killed_after_first_state, by_name):
    """A checkpoint written by one interpreter resumes under another: its .metadata is rewritten in
    the enum form of Python 3.11.2 (by name) or of 3.11.7/3.12 (by value), whichever runs this test."""
    out = _copy_killed(killed_after_first_state, tmp_path / "run_form")
    [saved] = complete_checkpoints(out / "full_state")
    with (saved / ".metadata").open("rb") as f:
        metadata = pickle.load(f)
    (saved / ".metadata").write_bytes(pickle_enums(metadata, by_name=by_name))
    resumed = torchrun(_args(chatml_model, data_path, out), warm=True)
    assert_ok(resumed)
    assert f"resumed from {saved}" in resumed.stderr
    _assert_same_steps(read_metrics(out), read_metrics(uninterrupted))
    a, b = _final_weights(uninterrupted), _final_weights(out)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)


FLAT_LAYOUT_RUN = ROOT / "fixtures" / "flat_layout_run"


def _flat_layout_args(out: Path) -> list[str]:
    """The flags ``fixtures/flat_layout_run/`` was written with (its README)."""
    return ["--model-name-or-path", str(FLAT_LAYOUT_RUN / "model"), "--data-path", str(FLAT_LAYOUT_RUN / "data.jsonl"),
            "--output-dir", str(out), "--batch-size", "8", "--max-tokens-per-gpu", "96", "--seed", "11",
            "--learning-rate", "1e-3", "--num-warmup-steps", "1", "--lr-scheduler", "cosine", "--max-steps", "4",
            "--min-samples-per-checkpoint", "16", "--num-data-workers", "0"]


def test_a_full_state_written_before_the_package_move_resumes_exactly(tmp_path):
    """A run preempted at step 2 by the code of the flat layout (every module at the root) resumes with
    today's: its two steps and the two resumed ones equal an uninterrupted run of today's code, and so do
    the final weights. Nothing in a full state names a module."""
    out = tmp_path / "resumed"
    shutil.copytree(FLAT_LAYOUT_RUN / "output", out)
    resumed = torchrun(_flat_layout_args(out), warm=True)
    assert_ok(resumed)
    assert f"resumed from {out / 'full_state' / 'samples_16'}" in resumed.stderr
    fresh = tmp_path / "fresh"
    assert_ok(torchrun(_flat_layout_args(fresh), warm=True))
    resumed_steps, fresh_steps = read_metrics(out), read_metrics(fresh)
    assert [r["step"] for r in resumed_steps] == [1, 2, 3, 4]
    _assert_same_steps(resumed_steps, fresh_steps, values=("loss", "grad_norm"))
    # Steps 1-2 were logged by the flat layout's code, which wrote the rate the *next* step would use; today's
    # writes the rate each step used. The schedule itself is unchanged: the rates are the same, one step apart.
    for old, new in zip(resumed_steps[:2], fresh_steps[1:3]):
        assert math.isclose(old["lr"], new["lr"], rel_tol=1e-9), (old, new)
    _assert_same_steps(resumed_steps[2:], fresh_steps[2:])
    a, b = _final_weights(fresh), _final_weights(out)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)


def test_kill_during_save_keeps_previous_checkpoint(tmp_path, chatml_model, data_path, uninterrupted):
    out = tmp_path / "run_c"
    result = torchrun(_args(chatml_model, data_path, out),
                      env={"MINI_TRAINER_TEST_KILL_DURING_SAVE": str(2 * CHECKPOINT_EVERY)})
    assert result.returncode != 0
    root = out / "full_state"
    assert [p.name for p in complete_checkpoints(root)] == [f"samples_{CHECKPOINT_EVERY}"]
    assert (root / f".samples_{2 * CHECKPOINT_EVERY}.tmp").exists(), "the interrupted save stays a .tmp"
    resumed = torchrun(_args(chatml_model, data_path, out), warm=True)
    assert_ok(resumed)
    assert "left behind by a save that was interrupted" in resumed.stderr
    assert not list(root.glob("*.tmp")), "the next start removes the leftover"
    _assert_same_steps(read_metrics(out), read_metrics(uninterrupted))


def test_kill_during_an_export_leaves_nothing_a_glob_of_exports_finds(tmp_path, chatml_model, data_path):
    out = tmp_path / "run_export_kill"
    result = torchrun(_args(chatml_model, data_path, out, "--max-steps", "4"),
                      env={"MINI_TRAINER_TEST_KILL_DURING_EXPORT": str(CHECKPOINT_EVERY)})
    assert result.returncode != 0
    exports = out / "hf_format"
    assert list(exports.glob(".*.tmp")), "the interrupted export is still on disk, under its temporary name"
    # What a serving job or an eval sweep globs: only finished exports, each one loadable.
    for pattern in ("samples_*", "*"):
        assert glob.glob(str(exports / pattern)) == [], pattern
    resumed = torchrun(_args(chatml_model, data_path, out, "--max-steps", "4"), warm=True)
    assert_ok(resumed)
    assert "left behind by a save that was interrupted" in resumed.stderr
    assert [p.name for p in exports.iterdir()] == [f"samples_{CHECKPOINT_EVERY}"]


def _assert_preempted(result, out: Path, step: int) -> None:
    """Each rank exits 75 (preempted, state saved), which torchrun reports as a failure whose root cause is our
    line; run_status.json says so for scripts (docs/training.md, "Exit statuses")."""
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "exitcode  : 75" in output, output[-4000:]
    assert f"preempted at step {step}, state saved in {out / 'full_state'}" in output.split("Root Cause", 1)[1]
    assert json.loads((out / "run_status.json").read_text())["status"] == "preempted"


def test_sigterm_checkpoints_and_exits_preempted_then_continues(tmp_path, chatml_model, data_path, uninterrupted):
    out = tmp_path / "run_d"
    _assert_preempted(torchrun(_args(chatml_model, data_path, out), env={"MINI_TRAINER_TEST_SIGTERM": "3:1"}),
                      out, 3)
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    [preempted] = complete_checkpoints(out / "full_state")
    assert preempted.name == f"samples_{3 * BATCH}"
    for rank in (0, 1):  # plain tensors and numbers: loads without pickle
        assert "torch" in torch.load(preempted / f"rng_rank{rank}.pt", weights_only=True)
    assert_ok(torchrun(_args(chatml_model, data_path, out), warm=True))
    _assert_same_steps(read_metrics(out), read_metrics(uninterrupted))
    names = _checkpoint_names(out)
    assert names["hf_format"] == _checkpoint_names(uninterrupted)["hf_format"], "same cadence across a preemption"


def test_group_sigterm_with_data_workers_checkpoints_and_resumes_exactly(tmp_path, chatml_model, data_path,
                                                                         uninterrupted):
    """What SLURM and torchrun deliver: SIGTERM to every process of the group, data workers included."""
    out = tmp_path / "run_group"
    args = [*_args(chatml_model, data_path, out), "--num-data-workers", "1"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port", str(_free_port()),
           str(ROOT / "train.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": "",
           "MINI_TRAINER_TEST_STEP_SLEEP": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    metrics = out / "training_metrics_0.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be signalled"
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=240)
    # torchrun re-raises the SIGTERM it received after its workers exit: exit code 1 (documented in the
    # README; SLURM requeues on preemption whatever the code).
    assert proc.returncode in (0, 1), output[-4000:]
    assert "killed by signal" not in output, output[-4000:]
    done = read_metrics(out)
    assert 2 <= len(done) < STEPS
    assert complete_checkpoints(out / "full_state")[-1].name == f"samples_{len(done) * BATCH}", output[-4000:]
    assert_ok(torchrun(args, warm=True))
    _assert_same_steps(read_metrics(out), read_metrics(uninterrupted))
    a, b = _final_weights(uninterrupted), _final_weights(out)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)


def test_preempted_on_the_last_step_still_exports(tmp_path, chatml_model, data_path, uninterrupted):
    out = tmp_path / "run_last"
    _assert_preempted(torchrun(_args(chatml_model, data_path, out), env={"MINI_TRAINER_TEST_SIGTERM": f"{STEPS}:0"}),
                      out, STEPS)
    assert _checkpoint_names(out) == _checkpoint_names(uninterrupted)
    rerun = torchrun(_args(chatml_model, data_path, out), warm=True)
    assert_ok(rerun)
    assert "this run is already finished" in rerun.stderr


@pytest.mark.timing
def test_export_failure_on_rank_0_stops_every_rank_with_its_error(tmp_path, chatml_model, data_path):
    out = tmp_path / "run_export_fails"
    began = time.monotonic()
    result = torchrun(_args(chatml_model, data_path, out),
                      env={"MINI_TRAINER_TEST_FAIL_EXPORT": f"samples_{CHECKPOINT_EVERY}"}, timeout=240)
    assert result.returncode != 0
    assert time.monotonic() - began < 120, "no rank may wait for the collective timeout"
    output = result.stdout + result.stderr
    for rank in (0, 1):
        assert f"[rank{rank}] ERROR Hugging Face export" in output and "No space left" in output, output[-4000:]


@pytest.mark.parametrize("nproc", [1, 4])
def test_world_size_change_continues_the_same_stream(tmp_path, chatml_model, data_path, uninterrupted,
                                                     killed_after_first_state, nproc):
    """A 2-rank run resumed on 1 rank (a warm 1-rank job) or on 4 (a fresh torchrun: warm jobs have 1 or 2)."""
    out = _copy_killed(killed_after_first_state, tmp_path / f"run_ws{nproc}")
    if nproc == 4:
        assert_ok(torchrun(_args(chatml_model, data_path, out), nproc=4))
    else:
        assert_ok(torchrun(_args(chatml_model, data_path, out), nproc=1, warm=True))
    resumed, reference = read_metrics(out), read_metrics(uninterrupted)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    step5, ref5 = resumed[4], reference[4]
    assert step5["samples_seen"] == ref5["samples_seen"]
    assert step5["batch_num_loss_counted_tokens"] == ref5["batch_num_loss_counted_tokens"]
    assert math.isclose(step5["loss"], ref5["loss"], rel_tol=1e-5)


def test_nan_on_one_rank_is_skipped_by_all(tmp_path, chatml_model, data_path):
    out = tmp_path / "run_nan"
    assert_ok(torchrun(_args(chatml_model, data_path, out, "--max-steps", "4"), env={"MINI_TRAINER_TEST_NAN": "2:1"}))
    records = read_metrics(out)
    assert [r["skipped"] for r in records] == [False, True, False, False]
    assert records[1]["total_samples_accumulated"] == records[0]["total_samples_accumulated"]
    assert all(math.isfinite(r["loss"]) for i, r in enumerate(records) if i != 1)


def test_too_many_bad_steps_abort_clearly(tmp_path, chatml_model, data_path):
    out = tmp_path / "run_bad"
    result = torchrun(_args(chatml_model, data_path, out, "--max-bad-steps", "1"),
                      env={"MINI_TRAINER_TEST_NAN": "1:0"})
    assert result.returncode != 0
    assert "consecutive steps with non-finite" in result.stdout + result.stderr


def test_keep_last_n_and_mismatched_data_refused(tmp_path, chatml_model, data_path, uninterrupted):
    """Retention keeps the newest two of each kind; a rerun on other data is refused before training. The
    refusal is the suite's one fresh end-to-end resume refusal (the others are checked warm or in-process):
    the process output a user sees, every rank's exit and no trainer traceback."""
    out = tmp_path / "run_keep"
    assert_ok(torchrun(_args(chatml_model, data_path, out, "--min-samples-per-checkpoint", str(BATCH),
                       "--max-steps", "3", "--keep-last-n-checkpoints", "2"), warm=True))
    assert [p.name for p in complete_checkpoints(out / "full_state")] == ["samples_24", "samples_36"]
    assert [p.name for p in complete_checkpoints(out / "hf_format")] == ["samples_24", "samples_36"]
    other = write_tokenized_jsonl(tmp_path / "other.jsonl", num_samples=30, vocab_size=100, seed=9)
    result = torchrun(_args(chatml_model, other, out))
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "another model or dataset" in output
    _no_worker_traceback(output)
    state = json.loads((complete_checkpoints(out / "full_state")[-1] / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["samples_seen"] == 36


class _RunsCode:
    """What a crafted checkpoint could hold: unpickling it runs a shell command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_checkpoint_metadata_cannot_run_code(tmp_path, chatml_model, data_path, uninterrupted):
    from minitrainer.checkpoint.safe_metadata import MetadataSafeReader

    newest = complete_checkpoints(uninterrupted / "full_state")[-1]
    with (newest / ".metadata").open("rb") as f:
        plain = pickle.load(f)
    assert MetadataSafeReader(newest).read_metadata().state_dict_metadata == plain.state_dict_metadata

    out = tmp_path / "run_crafted"
    shutil.copytree(uninterrupted, out)
    crafted = complete_checkpoints(out / "full_state")[-1]
    marker = tmp_path / "code_ran"
    (crafted / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    pickle.loads(pickle.dumps(_RunsCode(tmp_path / "plain_pickle_runs_it")))
    assert (tmp_path / "plain_pickle_runs_it").exists(), "torch's own reader (plain pickle.load) would run it"

    result = torchrun(_args(chatml_model, data_path, out), warm=True)
    assert_ok(result)
    assert not marker.exists(), "resume ran code from a checkpoint folder"
    assert f"skipping unreadable checkpoint {crafted}" in result.stderr and "refusing posix.system" in result.stderr
    previous = complete_checkpoints(out / "full_state")[-2]
    assert f"resumed from {previous}" in result.stderr
