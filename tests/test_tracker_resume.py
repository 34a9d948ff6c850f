"""A resumed run continues its Weights & Biases run; a wandb that cannot start fails before the model loads.

    .venv/bin/python -m pytest -q tests/test_tracker_resume.py

wandb is a network service and an optional package (not installed here), so
these runs put a stand-in ``wandb`` package on PYTHONPATH: the boundary, not
the trainer, is replaced. It records every ``wandb.init`` call to a file and
can refuse to start as wandb does without credentials.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fixtures.e2e import model_vocab_size, torchrun, write_tokenized_jsonl

FAKE_WANDB = '''
import json, os, uuid

from . import errors


class _Run:
    def __init__(self, run_id):
        self.id = run_id

    def log(self, data, step):
        with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
            f.write(json.dumps({"log_step": step}) + "\\n")

    def finish(self):
        pass


def init(project, config, id=None, resume=None):
    if os.environ.get("FAKE_WANDB_FAIL"):
        raise errors.UsageError("api_key not configured (no-tty)")
    with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
        f.write(json.dumps({"init_id": id, "resume": resume}) + "\\n")
    return _Run(id or uuid.uuid4().hex[:8])
'''
FAKE_ERRORS = '''
class Error(Exception):
    pass


class UsageError(Error):
    pass
'''


@pytest.fixture(scope="module")
def fake_wandb(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fake_site")
    (root / "wandb").mkdir()
    (root / "wandb" / "__init__.py").write_text(FAKE_WANDB)
    (root / "wandb" / "errors.py").write_text(FAKE_ERRORS)
    return root


def _args(model: Path, data: Path, out: Path, steps: int) -> list[str]:
    return ["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out),
            "--batch-size", "8", "--max-tokens-per-gpu", "64", "--num-warmup-steps", "0", "--lr-scheduler",
            "constant", "--min-samples-per-checkpoint", "1000", "--num-data-workers", "0", "--max-steps", str(steps),
            "--wandb-project", "p"]


def test_resumed_run_continues_the_same_wandb_run(tmp_path, chatml_model, fake_wandb):
    import os

    vocab = model_vocab_size(chatml_model)
    data = write_tokenized_jsonl(tmp_path / "d.jsonl", num_samples=20, vocab_size=vocab, seed=2)
    log = tmp_path / "wandb_calls.jsonl"
    env = {"PYTHONPATH": f"{fake_wandb}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "FAKE_WANDB_LOG": str(log)}
    out = tmp_path / "out"
    for steps in (1, 2):
        result = torchrun(_args(chatml_model, data, out, steps), env=env)
        assert result.returncode == 0, result.stderr[-4000:]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    inits = [c for c in calls if "init_id" in c]
    assert inits[0] == {"init_id": None, "resume": None}
    saved = json.loads((out / "full_state" / "samples_16" / "trainer_state.json").read_text())["wandb_run_id"]
    first = json.loads((out / "full_state" / "samples_8" / "trainer_state.json").read_text())["wandb_run_id"]
    assert inits[1] == {"init_id": first, "resume": "allow"} and saved == first
    assert [c["log_step"] for c in calls if "log_step" in c] == [1, 2]

    failing = torchrun(_args(chatml_model, data, tmp_path / "fails", 1), env={**env, "FAKE_WANDB_FAIL": "1"})
    text = failing.stdout + failing.stderr
    assert failing.returncode != 0
    assert "wandb.init failed (api_key not configured" in text and "wandb login" in text
    assert "Loading weights" not in text, "the tracker is checked before the model loads"
