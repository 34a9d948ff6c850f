"""``--max-tokens-per-gpu auto`` recovery: a trial that fails mid-backward leaves FSDP as if it never ran.

    .venv/bin/python -m pytest -q tests/test_autotune.py

Real torchrun with 2 gloo CPU processes (``python -m tests.probe_recovery_run``); the failure is injected with the
test-only ``MINI_TRAINER_TEST_PROBE_FAIL`` hook, an allocation failure raised as a plain RuntimeError
half-way through backward. The clean run every failed one is compared with is one run for the module.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from fixtures.e2e import model_vocab_size, torchrun, write_tokenized_jsonl
from minitrainer.setup.autotune import is_allocation_failure, trial_fits


def test_allocation_failures_beyond_out_of_memory_error_mean_does_not_fit():
    def failing(message):
        def step(num_tokens):
            raise RuntimeError(message)
        return step

    assert not trial_fits(failing("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"), 8)
    assert is_allocation_failure(torch.OutOfMemoryError("CUDA out of memory"))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        trial_fits(failing("shape mismatch"), 8)  # a real bug is not a memory verdict
    assert not trial_fits(lambda n: None, 8, agree=lambda ok: False), "another rank's failure fails this one"


@pytest.fixture(scope="module")
def data(tmp_path_factory, chatml_model) -> Path:
    return write_tokenized_jsonl(tmp_path_factory.mktemp("data") / "d.jsonl", num_samples=12,
                                 vocab_size=model_vocab_size(chatml_model), seed=2)


def _probe_run(chatml_model: Path, data: Path, path: Path, env: dict) -> dict:
    run = torchrun([str(chatml_model), str(data), str(path)], module="tests.probe_recovery_run", env=env, timeout=240)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory, chatml_model, data) -> dict:
    """The trial and step with no failure injected: what every failed trial must leave FSDP as."""
    return _probe_run(chatml_model, data, tmp_path_factory.mktemp("clean") / "clean.json", {})


@pytest.mark.parametrize("failing_ranks", ["*", "none"])
def test_failed_trial_leaves_fsdp_consistent(tmp_path, chatml_model, data, clean_run, failing_ranks):
    failed = _probe_run(chatml_model, data, tmp_path / "failed.json",
                        {"MINI_TRAINER_TEST_PROBE_FAIL": f"64:{failing_ranks}"})
    assert failed["fitted"] is (failing_ranks == "none")
    assert clean_run["fitted"] is True
    assert failed["weights"] == pytest.approx(clean_run["weights"], rel=1e-6, abs=1e-9)


@pytest.mark.timing
def test_failure_on_one_rank_only_stops_the_job_without_a_hang(tmp_path, chatml_model, data):
    """Rank 0 is left inside a collective of the trial that rank 1 never joins: rank 1 waits for the
    verdicts only as long as the probe timeout, then stops the job with an error naming the way out."""
    began = time.monotonic()
    run = torchrun([str(chatml_model), str(data), str(tmp_path / "r.json")], module="tests.probe_recovery_run",
                   env={"MINI_TRAINER_TEST_PROBE_FAIL": "64:1", "MINI_TRAINER_PROBE_TIMEOUT_SECONDS": "5"},
                   timeout=240)
    assert run.returncode != 0
    assert time.monotonic() - began < 120, "no rank may wait for the 30-minute collective timeout"
    assert "a trial step failed (allocation failure) on rank 1, but the other ranks did not report within 5 s" \
        in run.stderr, run.stderr[-4000:]
    assert "Set --max-tokens-per-gpu to a number" in run.stderr
