"""The shipped ``slurm_multi_node.sbatch`` on a real SLURM: preempted twice, requeued, resumed exactly.

    bash tests/install_slurm.sh            # Debian's slurm-wlm and munge (root; CI runs it)
    .venv/bin/python -m pytest -q tests/test_slurm.py

The test starts munged, slurmctld and slurmd on this host (``local_slurm.py``),
submits the script as users do (only the ``#SBATCH`` lines a CPU host lacks are
overridden, training flags after the script name), and delivers both of SLURM's
faults while it trains with a data-loader worker per rank:

1. the time-limit warning: ``USR1`` to the batch shell (what ``--signal=B:USR1@300``
   sends), whose trap asks the trainers to checkpoint and requeues the job;
2. ``scontrol requeue``: SIGTERM to every process of the job, then requeue.

Each attempt must write a preemption checkpoint, the next must resume from it,
and the finished run must equal an uninterrupted run of the same flags (a warm
2-rank call, ``fixtures/e2e.py``: its numbers are the subject, not its processes).

Between attempts SLURM holds the requeued job, as on any cluster, for a time set by
the job credential's lifetime (``local_slurm.CREDENTIAL_LIFETIME_S``: 10 s here, ~30 s
held; 120 s by default, ~2 min held). The test never lifts that hold by hand: a
relaunch racing the revocation of the old credential is refused by the node ("Job
credential revoked", issue 41).
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from fixtures.e2e import ROOT, _free_port, read_metrics, torchrun, write_tokenized_jsonl
from minitrainer.checkpoint.full_state import complete_checkpoints
from tests.local_slurm import LocalSlurm, unavailable_reason
from tests.test_resume import _assert_same_steps, _final_weights

BATCH = 12
STEPS = 10
CHECKPOINT_EVERY = 4 * BATCH


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except RuntimeError as err:
        cluster.stop()
        pytest.skip(f"the local SLURM daemons did not start on this machine: {err}")
    yield cluster
    cluster.stop()


def _train_flags() -> list[str]:
    return ["--batch-size", str(BATCH), "--max-tokens-per-gpu", "96", "--seed", "11", "--learning-rate", "1e-3",
            "--num-warmup-steps", "2", "--lr-scheduler", "cosine", "--max-steps", str(STEPS),
            "--num-data-workers", "1"]


def _wait(slurm: LocalSlurm, condition, what: str, log: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            text = log.read_text(errors="replace") if log.exists() else "(no job log)"
            pytest.fail(f"timed out waiting for {what}; job log:\n{text[-6000:]}\n{slurm.logs(40)}")
        time.sleep(0.2)


def _steps_logged(out: Path) -> int:
    path = out / "training_metrics_0.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_sbatch_script_survives_time_limit_and_requeue(slurm, tmp_path, chatml_model):
    vocab = AutoConfig.from_pretrained(chatml_model).vocab_size
    data = write_tokenized_jsonl(tmp_path / "data" / "train.jsonl", num_samples=80, vocab_size=vocab, seed=3)
    out, log = tmp_path / "out", tmp_path / "job.out"
    job = slurm.run(
        "sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", f"--cpus-per-task={slurm.cpus}",
        "--time=30", f"--output={log}",
        "--export=ALL,GPUS_PER_NODE=2,OMP_NUM_THREADS=1,CUDA_VISIBLE_DEVICES=,MINI_TRAINER_TEST_STEP_SLEEP=1,"
        f"MODEL={chatml_model},DATA={data},OUTPUT_DIR={out},PYTHON={sys.executable},"
        f"MIN_SAMPLES_PER_CHECKPOINT={CHECKPOINT_EVERY},RDZV_PORT={_free_port()}",
        str(ROOT / "slurm_multi_node.sbatch"), *_train_flags(), cwd=ROOT)

    def attempt_running(restart: int, steps: int):
        return lambda: slurm.job(job).get("Restarts") == str(restart) and _steps_logged(out) >= steps

    # 1. Time limit near: USR1 to the batch shell only, as --signal=B:USR1@300 delivers it.
    _wait(slurm, attempt_running(0, 2), "the first attempt to train two steps", log)
    slurm.run("scancel", "--batch", "--signal=USR1", job)
    _wait(slurm, lambda: slurm.job(job).get("Restarts") == "1", "the script to requeue its job", log)
    first = _preempted_at(log, 1)

    # 2. Preemption/requeue by the scheduler: SIGTERM to every process of the job (data workers too).
    _wait(slurm, attempt_running(1, first + 2), "the second attempt to train two more steps", log)
    slurm.run("scontrol", "requeue", job)
    _wait(slurm, lambda: slurm.job(job).get("Restarts") == "2", "the requeue", log)
    _wait(slurm, lambda: slurm.job(job).get("JobState") == "COMPLETED", "the job to complete", log)

    text = log.read_text(errors="replace")
    second = _preempted_at(log, 2)
    assert "killed by signal" not in text, text[-6000:]
    assert "received SIGUSR1" in text and "received SIGTERM" in text, text[-6000:]
    for restart, step in ((1, first), (2, second)):
        assert f"job {job} (restart {restart})" in text
        assert f"resumed from {out / 'full_state' / f'samples_{step * BATCH}'}: step {step}," in text, text[-6000:]
    assert first < second < STEPS
    assert not list(out.glob("*/*.tmp")), "no temporary checkpoint folder is left behind"

    reference = tmp_path / "uninterrupted"
    result = torchrun(["--model-name-or-path", str(chatml_model), "--data-path", str(data), "--output-dir",
                       str(reference), "--min-samples-per-checkpoint", str(CHECKPOINT_EVERY), *_train_flags()],
                      warm=True)
    assert result.returncode == 0, result.stderr[-4000:]
    _assert_same_steps(read_metrics(out), read_metrics(reference))
    assert [p.name for p in complete_checkpoints(out / "hf_format")] == \
        [p.name for p in complete_checkpoints(reference / "hf_format")], "same export cadence across two requeues"
    a, b = _final_weights(reference), _final_weights(out)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)


def _preempted_at(log: Path, attempts: int) -> int:
    """The step of the ``attempts``-th preemption save, read from the job log."""
    steps = [int(s) for s in re.findall(r"preemption signal received: saving full state at step (\d+)",
                                        log.read_text(errors="replace"))]
    assert len(steps) >= attempts, log.read_text(errors="replace")[-6000:]
    return steps[attempts - 1]
