"""The stored DPO reference log-probabilities (issue 68): used only when computed from this run's model, data and
packing, never when unreadable, written whole or not at all, and what dead writers left removed.

    .venv/bin/python -m pytest -q tests/test_reference_store.py

``minitrainer/common/stores.py`` on real files (a full disk is a small tmpfs, mounted for the test: without root
that test skips and says so; a dead writer is a real process that exited), then a real 2-rank ``--objective
dpo`` run (three ``train.main`` calls in the warm job, ``fixtures/warm_jobs.py``) whose store is replaced by one
of another reference, then damaged: each rerun says so in one line and its step 1 is ln 2, the loss of the true
reference. The module is imported inside the tests, so that the run's test fails on the code before issue 68 on
its own assertion (a foreign store used, a traceback).
"""

from __future__ import annotations

import json
import logging
import math
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fixtures.e2e import ROOT, assert_ok, model_vocab_size, read_metrics, torchrun, write_tokenized_pairs
from minitrainer.common.log import logger
from tests.test_dpo import DPO_ARGS
from tests.test_faults import _fill, small_disk  # noqa: F401  (small_disk: the tmpfs fixture)

WHAT = "reference log-probabilities"
COMPUTED_FROM = {"reference_weights": "a1", "method": {}, "dtype": "torch.float32", "data": "d1", "packing": [16]}
SHAPES = {"train": (400, 2), "held_out": (3, 2)}


@pytest.fixture
def lines():
    """The toolkit logger's lines (``LEVEL message``) while the test runs."""
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(f"{record.levelname} {record.getMessage()}")

    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield seen
    logger.removeHandler(handler)
    logger.setLevel(level)


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {name: rng.normal(size=shape).astype(np.float32) for name, shape in SHAPES.items()}


def _stored(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    from minitrainer.common.stores import write_store

    path, arrays = tmp_path / "reference_logps" / "ab12.npz", _arrays()
    assert write_store(path, arrays, computed_from=COMPUTED_FROM, what=WHAT)
    return path, arrays


# ----------------------------------------------------------------------------
# stores.py on real files


def test_a_store_reads_back_what_was_written_and_only_its_own_file_is_left(tmp_path, lines):
    from minitrainer.common.stores import read_store

    path, arrays = _stored(tmp_path)
    found = read_store(path, computed_from=json.loads(json.dumps(COMPUTED_FROM)), shapes=SHAPES, what=WHAT)
    assert found is not None and sorted(found) == sorted(arrays)
    for name, array in arrays.items():
        assert np.array_equal(found[name], array) and found[name].dtype == array.dtype
    assert [p.name for p in path.parent.iterdir()] == ["ab12.npz"], "no sidecar, no temporary file"
    assert lines == []


def test_a_store_computed_from_something_else_is_never_used_and_the_line_names_what_differs(tmp_path, lines):
    from minitrainer.common.stores import read_store

    path, _ = _stored(tmp_path)
    other = {**COMPUTED_FROM, "reference_weights": "b2", "data": "d2"}
    assert read_store(path, computed_from=other, shapes=SHAPES, what=WHAT) is None
    assert lines == [f"WARNING {WHAT}: {path} was computed from another reference_weights, data: computing them "
                     "again"]


@pytest.mark.parametrize("damage, problem", [
    ("flipped", "is unreadable (BadZipFile: Bad CRC-32 for file 'train.npy')"),
    ("truncated", "is unreadable (BadZipFile: File is not a zip file)"),
    ("short", "is unreadable (its 'train' has shape (400, 2), not (401, 2))"),
    ("old", "does not say what it was computed from (an older version wrote it)"),
])
def test_an_unreadable_store_is_one_line_and_never_used(tmp_path, lines, damage, problem):
    from minitrainer.common.stores import read_store

    path, arrays = _stored(tmp_path)
    shapes = SHAPES
    if damage == "flipped":
        data = bytearray(path.read_bytes())
        middle = len(data) // 2
        data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
        path.write_bytes(bytes(data))
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    elif damage == "short":
        shapes = {**SHAPES, "train": (401, 2)}  # the data has another pair now
    else:
        np.savez(path, **arrays)  # what the version before issue 68 wrote
    assert read_store(path, computed_from=COMPUTED_FROM, shapes=shapes, what=WHAT) is None
    level = "INFO" if damage == "old" else "WARNING"
    assert lines == [f"{level} {WHAT}: {path} {problem}: computing them again"]


def test_dead_writers_leftovers_are_removed_and_a_live_writers_kept(tmp_path, lines):
    from minitrainer.common.leftovers import process_start
    from minitrainer.common.stores import read_store, write_store

    folder = tmp_path / "reference_logps"
    folder.mkdir()
    path, other = folder / "ab12.npz", folder / "cd34.npz"
    # A real writer that named its files as this version does and as the one before it did, then died.
    script = ("import os, sys; from pathlib import Path; from minitrainer.common.leftovers import temporary_name\n"
              "for final in map(Path, sys.argv[1:]):\n"
              "    temporary_name(final).write_bytes(b'PK half')\n"
              "    final.with_name(f'.{final.name}.{os.getpid()}.tmp').write_bytes(b'PK half')\n")
    subprocess.run([sys.executable, "-c", script, str(path), str(other)], cwd=ROOT, check=True)
    dead = sorted(p.name for p in folder.iterdir())
    assert len(dead) == 4
    (folder / "ab12.json").write_text("")  # the sidecar the version before wrote, torn by the kill
    other.write_bytes(b"")
    (folder / "cd34.json").write_text("{}\n")
    live = subprocess.Popen(["sleep", "60"])
    try:
        kept = [folder / f".ab12.npz.tmp-{socket.gethostname()}-{live.pid}-{process_start(live.pid)}",
                folder / f".ab12.npz.{live.pid}.tmp"]
        for leftover in kept:
            leftover.write_bytes(b"PK writing")
        assert read_store(path, computed_from=COMPUTED_FROM, shapes=SHAPES, what=WHAT) is None
        assert sorted(folder.iterdir()) == sorted([*kept, other])
        assert write_store(path, _arrays(), computed_from=COMPUTED_FROM, what=WHAT)
        assert sorted(folder.iterdir()) == sorted([*kept, other, path])
    finally:
        live.kill()
        live.wait()
    assert len(lines) == 2 and all(line.startswith("INFO removed ") for line in lines), lines
    assert all(name in "".join(lines) for name in [*dead, "ab12.json", "cd34.json"])


def test_a_write_onto_a_full_disk_is_one_warning_and_leaves_nothing(small_disk, lines):  # noqa: F811
    from minitrainer.common.stores import write_store

    folder = small_disk(1) / "reference_logps"
    folder.mkdir()
    _fill(folder.parent)
    arrays = {"train": np.zeros((150_000, 2), np.float32), "held_out": np.zeros((0, 2), np.float32)}
    assert not write_store(folder / "ab12.npz", arrays, computed_from=COMPUTED_FROM, what=WHAT)
    assert list(folder.iterdir()) == [], "the partial temporary file is removed"
    assert lines == [f"WARNING {WHAT} not stored in {folder} ([Errno 28] No space left on device; they need 1.2 MB): "
                     "training goes on, and the next run computes them again"]


# ----------------------------------------------------------------------------
# A 2-rank DPO run whose stored reference is another model's, then damaged


def _run(model: Path, data: Path, out: Path):
    result = torchrun(["--model-name-or-path", str(model), "--data-path", str(data), *DPO_ARGS, "--output-dir",
                       str(out), "--max-steps", "1", "--min-samples-per-checkpoint", "1000"], warm=True)
    assert_ok(result)
    assert "Traceback" not in result.stderr, result.stderr[-4000:]
    return result, read_metrics(out)[0]["loss"]


def test_a_foreign_or_damaged_stored_reference_is_computed_again_and_step_one_is_ln2(tmp_path, chatml_model):
    data = write_tokenized_pairs(tmp_path / "pairs", num_pairs=40, vocab_size=model_vocab_size(chatml_model))
    folder = data / "reference_logps"
    first, loss = _run(chatml_model, data, tmp_path / "first")
    assert loss == pytest.approx(math.log(2), abs=1e-5)
    (path,) = folder.glob("*.npz")
    assert f"stored in {path}" in first.stderr
    with np.load(path) as stored:
        train, held_out = stored["train"], stored["held_out"]
        computed_from = json.loads(str(stored["computed_from"][()])) if "computed_from" in stored.files else {}
    assert sorted(p.name for p in folder.iterdir()) == [path.name], "no sidecar, no temporary file"

    # Another model's values under this name (as a copy of another run's store would be), and what a killed
    # writer of the version before left: its temporary file (its pid is gone) and an empty sidecar.
    np.savez(path, train=train + np.array([1.0, 0.0], np.float32), held_out=held_out,  # chosen sides' moved
             computed_from=np.array(json.dumps({**computed_from, "reference_weights": "another model"})))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    for leftover in (folder / f".{path.name}.{int(dead.stdout)}.tmp", path.with_suffix(".json")):
        leftover.write_bytes(b"")
    foreign, loss = _run(chatml_model, data, tmp_path / "foreign")
    assert (f"WARNING {WHAT}: {path} was computed from another reference_weights: computing them again"
            in foreign.stderr), foreign.stderr[-4000:]
    assert loss == pytest.approx(math.log(2), abs=1e-5), "the other model's values were used"
    assert sorted(p.name for p in folder.iterdir()) == [path.name], "the leftovers are removed"

    from minitrainer.common.stores import read_store

    shapes = {"train": train.shape, "held_out": held_out.shape}
    again = read_store(path, computed_from=computed_from, shapes=shapes, what=WHAT)
    assert again is not None and np.array_equal(again["train"], train), "the store is this model's again"

    damaged = bytearray(path.read_bytes())
    middle = len(damaged) // 2
    damaged[middle:middle + 8] = bytes(b ^ 0xFF for b in damaged[middle:middle + 8])
    path.write_bytes(bytes(damaged))
    unreadable, loss = _run(chatml_model, data, tmp_path / "damaged")
    assert f"WARNING {WHAT}: {path} is unreadable (" in unreadable.stderr, unreadable.stderr[-4000:]
    assert loss == pytest.approx(math.log(2), abs=1e-5)
    assert read_store(path, computed_from=computed_from, shapes=shapes, what=WHAT) is not None
