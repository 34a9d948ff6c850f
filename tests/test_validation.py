"""Validation loss, best export, early stopping, checkpoint policy and safe resume.

    .venv/bin/python -m pytest -q tests/test_validation.py

The invariants: the logged validation loss equals an unpacked single-process
computation over the same held-out samples; the split is a pure function of
the seed (training samples only the rest, on every rank and after resume);
the best export is replaced only on improvement; a resume with changed
training parameters is refused with a message naming them, or applied when
asked; every metrics line is strict JSON. End-to-end runs have 2 gloo CPU ranks
on the tiny local model: warm runs (``fixtures/warm_jobs.py``), but for the
SIGKILLed one and the one with an injected NaN, which are fresh torchruns.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from fixtures.e2e import assert_ok, model_vocab_size, torchrun, unpacked_loss_sum, write_tokenized_jsonl
from minitrainer.data import held_out
from minitrainer.loop import validation
from minitrainer.report.metrics import MetricsWriter
from minitrainer.checkpoint import resume_policy
from minitrainer.checkpoint import policy as checkpoint_policy
from minitrainer.checkpoint.full_state import complete_checkpoints
from minitrainer.data.sampler import InfiniteSampler, load_tokenized_dataset

BATCH = 8
BUDGET = 64
SEED = 5


def _reject_constant(name: str):
    raise ValueError(f"non-JSON constant {name}")


def strict_metrics(output_dir: Path) -> list[dict]:
    """Every line of rank 0's metrics file, parsed by a JSON parser that rejects NaN/Infinity."""
    lines = (Path(output_dir) / "training_metrics_0.jsonl").read_text().splitlines()
    return [json.loads(line, parse_constant=_reject_constant) for line in lines]


@pytest.fixture(scope="module")
def data_path(tmp_path_factory, chatml_model) -> Path:
    vocab = model_vocab_size(chatml_model)
    return write_tokenized_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", num_samples=30,
                                 vocab_size=vocab, seed=4)


def _args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out),
            "--batch-size", str(BATCH), "--max-tokens-per-gpu", str(BUDGET), "--seed", str(SEED),
            "--num-warmup-steps", "0", "--lr-scheduler", "constant", "--min-samples-per-checkpoint", "1000",
            "--num-data-workers", "0", *extra]


def _unpacked_loss(model_dir: Path, dataset, rows) -> tuple[float, int]:
    """Per-token mean cross-entropy, one sample at a time, one process, no packing."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    samples = [dataset.sample(int(row)) for row in rows]
    with torch.no_grad():
        total, tokens = unpacked_loss_sum(model, [s for s in samples if len(s[0]) <= BUDGET], dtype=torch.float64)
    return total.item() / tokens, tokens


# ----------------------------------------------------------------------------
# Pure parts


@pytest.mark.parametrize("num_samples,fraction", [(2, 0.5), (10, 0.1), (101, 0.3), (1000, 0.05)])
def test_split_is_a_seeded_partition(num_samples, fraction):
    train, val = held_out.split_rows(num_samples, fraction, seed=3)
    again_train, again_val = held_out.split_rows(num_samples, fraction, seed=3)
    assert np.array_equal(train, again_train) and np.array_equal(val, again_val)
    assert np.array_equal(np.sort(np.concatenate([train, val])), np.arange(num_samples))
    assert len(val) == min(max(1, round(fraction * num_samples)), num_samples - 1)
    if num_samples >= 100:
        assert not np.array_equal(val, held_out.split_rows(num_samples, fraction, seed=4)[1])


@pytest.mark.parametrize("num_ranks", [1, 2, 3])
@pytest.mark.parametrize("group_size", [1, 5, 64])
def test_validation_plan_uses_every_fitting_sample_once(num_ranks, group_size):
    rng = np.random.default_rng(num_ranks * 100 + group_size)
    lengths = rng.integers(1, 80, size=57)
    counts = rng.integers(0, 10, size=57)
    plan = held_out.plan_validation(lengths, counts, max_tokens_per_rank=64, num_ranks=num_ranks,
                                      group_size=group_size)
    rows = [row for minibatch in plan.minibatches for slot in minibatch for row in slot]
    fits = np.flatnonzero(lengths <= 64)
    assert sorted(rows) == fits.tolist()
    assert all(len(minibatch) == num_ranks for minibatch in plan.minibatches)
    assert all(lengths[slot].sum() <= 64 for minibatch in plan.minibatches for slot in minibatch)
    assert plan.num_dropped_samples == 57 - fits.size
    assert plan.num_loss_counted_tokens == counts[fits].sum()


def test_improvement_threshold_and_patience():
    class Config:
        val_loss_improvement_threshold = 0.1
        save_best_val_loss = True
        early_stopping_patience = 2

    from minitrainer.checkpoint.train_state import TrainState

    state, saved = TrainState(), []
    verdicts = [validation.update_best(state, loss, config=Config, save_best=lambda loss=loss: saved.append(loss))
                for loss in (2.0, 1.95, 1.85, float("nan"), 1.8)]
    assert saved == [2.0, 1.85]
    assert state.best_val_loss == 1.85
    assert verdicts[:4] == [None, None, None, None] and "early stopping" in verdicts[4]


def test_cadences_are_resume_stable():
    # Sample cadence: a pass whenever the stream crosses a multiple of N, wherever a run resumed.
    positions = list(range(0, 200, 12))
    hits = [end for start, end in zip(positions, positions[1:])
            if validation.should_validate(step=end // 12, every_n_steps=None, samples_seen=end,
                                          previous_samples=start, every_n_samples=50)]
    assert hits == [60, 108, 156]
    assert [s for s in range(1, 10) if validation.should_validate(step=s, every_n_steps=3, samples_seen=0,
                                                                   previous_samples=0, every_n_samples=None)] == [3, 6, 9]
    assert [end for start, end in zip(positions, positions[1:]) if checkpoint_policy.crossed(start, end, 50)] == hits


def test_disk_plan_counts_retention_and_warns():
    plan = checkpoint_policy.plan_disk(num_params=1_500_000_000, param_bytes=4, total_samples=10_000,
                                       export_every=2000, keep_exports=None, full_state_every=2000,
                                       keep_full_states=2, full_state=True)
    assert (plan.num_exports, plan.num_full_states) == (5, 2)
    assert plan.export_bytes == 3_000_000_000 and plan.full_state_bytes == 18_000_000_000
    assert plan.total_bytes == 6 * 3_000_000_000 + 3 * 18_000_000_000
    _, warning = checkpoint_policy.disk_report(plan, free_bytes=10**9, output_dir="out")
    assert "free" in warning
    unbounded = checkpoint_policy.plan_disk(num_params=10, param_bytes=4, total_samples=None, export_every=5,
                                            keep_exports=None, full_state_every=5, keep_full_states=2,
                                            full_state=True)
    assert unbounded.total_bytes is None
    assert "no stop condition" in checkpoint_policy.disk_report(unbounded, 10**12, "out")[1]
    assert checkpoint_policy.full_states_kept(None, None) == 2
    assert checkpoint_policy.full_states_kept(None, 1) == 1
    assert checkpoint_policy.full_states_kept(5, 1) == 5


def test_validation_line_counts_what_the_loss_is_a_mean_over():
    """SFT's loss is per token: tokens; a preference objective's is per pair: pairs, with its reward metrics."""
    from minitrainer.objectives.dpo import DPOObjective

    assert validation.validation_line(step=50, val_loss=1.93, unit="samples", num_units=41,
                                      num_loss_counted_tokens=48211, metrics={}, seconds=3.2) \
        == "step 50: validation loss 1.9300 over 48211 tokens (3.20s)"
    extra = {"val_rewards/accuracies": 0.8286, "val_rewards/margins": 1.23449, "val_rewards/chosen": 2.0}
    metrics = {name: extra.get(f"val_{name}") for name in DPOObjective.console_metrics}
    assert validation.validation_line(step=5, val_loss=0.53344, unit=DPOObjective.unit, num_units=8,
                                      num_loss_counted_tokens=118, metrics=metrics, seconds=1.523) \
        == "step 5: validation loss 0.5334 over 8 pairs, acc 0.83, margin 1.234 (1.52s)"
    # No held-out pair: NaN loss and no fields, said as such.
    assert validation.validation_line(step=5, val_loss=float("nan"), unit="pairs", num_units=0,
                                      num_loss_counted_tokens=0, metrics=dict.fromkeys(metrics), seconds=0.0) \
        == "step 5: validation loss nan over 0 pairs, acc n/a, margin n/a (0.00s)"


def test_metrics_writer_writes_strict_json(tmp_path):
    writer = MetricsWriter(tmp_path / "training_metrics_0.jsonl")
    writer.write({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "skipped": True, "lr": 1e-5})
    writer.close()
    [record] = strict_metrics(tmp_path)
    assert record == {"step": 1, "loss": None, "grad_norm": None, "skipped": True, "lr": 1e-5}


def test_move_aside_names_the_folder(tmp_path):
    assert resume_policy.move_aside(tmp_path) is None
    (tmp_path / "full_state" / "samples_8").mkdir(parents=True)
    (tmp_path / "training_metrics_0.jsonl").write_text("{}\n")
    moved = resume_policy.move_aside(tmp_path, now=0)
    assert moved.name == "superseded_19700101T000000Z"
    assert (moved / "full_state" / "samples_8").is_dir() and (moved / "training_metrics_0.jsonl").is_file()
    assert not (tmp_path / "full_state").exists()


# ----------------------------------------------------------------------------
# End to end


def test_validation_loss_is_exact_and_split_excludes_training_rows(tmp_path, chatml_model, data_path):
    """lr 0 keeps the weights, so every validation must equal the reference on the initial model.

    The run is SIGKILLed after step 1's full state and rerun: the passes after the
    resume see the same split, and the best loss and patience count carry over.
    """
    out = tmp_path / "val"
    args = _args(chatml_model, data_path, out, "--learning-rate", "0", "--max-steps", "5",
                 "--validation-split", "0.25", "--validation-every-n-steps", "1", "--save-best-val-loss",
                 "--early-stopping-patience", "2", "--max-grad-norm", "0", "--min-samples-per-full-state", "8")
    killed = torchrun(args, env={"MINI_TRAINER_TEST_KILL_AFTER_SAVE": str(BATCH)})
    assert killed.returncode != 0
    assert_ok(torchrun(args, warm=True))
    records = strict_metrics(out)
    steps = [r for r in records if "loss" in r]
    vals = [r for r in records if "val_loss" in r]
    dataset = load_tokenized_dataset(str(data_path))
    train_rows, val_rows = held_out.split_rows(len(dataset), 0.25, SEED)
    ref_val, ref_tokens = _unpacked_loss(chatml_model, dataset, val_rows)
    assert [r["step"] for r in vals] == [1, 2, 3]
    for record in vals:
        assert record["val_loss"] == pytest.approx(ref_val, rel=1e-5)
        assert record["val_num_loss_counted_tokens"] == ref_tokens
    # Training sampled only the training rows, in the sampler's order over them.
    first = train_rows[InfiniteSampler(len(train_rows), SEED).take(BATCH)]
    assert not set(first.tolist()) & set(val_rows.tolist())
    ref_train, _ = _unpacked_loss(chatml_model, dataset, first)
    assert steps[0]["loss"] == pytest.approx(ref_train, rel=1e-5)
    # Equal losses never improve: the best export is from step 1; patience 2 stops after step 3.
    assert [r["step"] for r in steps] == [1, 2, 3]
    best = json.loads((out / "hf_format" / "best" / "best_val_loss.json").read_text())
    assert best["step"] == 1 and best["val_loss"] == pytest.approx(ref_val, rel=1e-5)
    assert AutoModelForCausalLM.from_pretrained(out / "hf_format" / "best") is not None
    # Own cadences: a full state every step, the newest 2 kept; exports only at the end (and best/).
    assert sorted(p.name for p in (out / "hf_format").iterdir()) == ["best", "samples_24"]
    assert [p.name for p in complete_checkpoints(out / "full_state")] == ["samples_16", "samples_24"]


def test_separate_validation_file_and_strict_json(tmp_path, chatml_model, data_path):
    vocab = model_vocab_size(chatml_model)
    val_path = write_tokenized_jsonl(tmp_path / "val.jsonl", num_samples=7, vocab_size=vocab, seed=8)
    out = tmp_path / "valfile"
    result = torchrun(_args(chatml_model, data_path, out, "--learning-rate", "0", "--max-steps", "2",
                            "--validation-data-path", str(val_path)), env={"MINI_TRAINER_TEST_NAN": "1:1"})
    assert_ok(result)
    records = strict_metrics(out)
    assert records[0]["skipped"] is True and records[0]["loss"] is None
    [val] = [r for r in records if "val_loss" in r]
    assert val["step"] == 2
    ref_val, ref_tokens = _unpacked_loss(chatml_model, load_tokenized_dataset(str(val_path)), range(7))
    assert val["val_loss"] == pytest.approx(ref_val, rel=1e-5) and val["val_num_loss_counted_tokens"] == ref_tokens
    assert f"step 2: validation loss {val['val_loss']:.4f} over {ref_tokens} tokens (" in result.stderr


def test_resume_refuses_changed_params_then_applies_them_when_asked(tmp_path, chatml_model, data_path):
    out = tmp_path / "run"
    assert_ok(torchrun(_args(chatml_model, data_path, out, "--learning-rate", "1e-3", "--max-steps", "2"), warm=True))

    refused = torchrun(_args(chatml_model, data_path, out, "--learning-rate", "2e-3", "--seed", "6",
                             "--max-steps", "3"), warm=True)
    text = refused.stdout + refused.stderr
    assert refused.returncode != 0
    assert "learning_rate: checkpoint 0.001, now 0.002" in text and "seed: checkpoint 5, now 6" in text
    assert "--output-dir" in text and "--allow-config-change" in text
    assert "sharded with" not in text, "the refusal comes before the model loads"

    assert_ok(torchrun(_args(chatml_model, data_path, out, "--learning-rate", "2e-3", "--max-steps", "3",
                       "--allow-config-change"), warm=True))
    steps = [r for r in strict_metrics(out) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["lr"] for r in steps] == [pytest.approx(1e-3), pytest.approx(1e-3), pytest.approx(2e-3)]

    finished = torchrun(_args(chatml_model, data_path, out, "--learning-rate", "2e-3", "--max-steps", "3"), warm=True)
    assert_ok(finished)
    assert "already finished (reached --max-steps 3)" in finished.stderr and "--max-steps" in finished.stderr

    fresh = torchrun(_args(chatml_model, data_path, out, "--learning-rate", "2e-3", "--max-steps", "1",
                           "--no-resume"), warm=True)
    assert_ok(fresh)
    [moved] = [p for p in out.iterdir() if p.name.startswith("superseded_")]
    assert f"moved the earlier run's checkpoints and metrics in {out} to {moved}" in fresh.stderr
    assert sorted(p.name for p in (moved / "full_state").iterdir()) == ["samples_16", "samples_24"]
    assert [r["step"] for r in strict_metrics(out)] == [1]
    assert [p.name for p in (out / "full_state").iterdir()] == ["samples_8"]


def test_plot_draws_validation_points_from_their_own_lines(tmp_path):
    matplotlib_image = pytest.importorskip("matplotlib.image")
    from minitrainer.tools.plot_metrics import plot_metrics

    def orange_pixels(path: Path) -> int:
        pixels = matplotlib_image.imread(path)[..., :3]
        return int((np.abs(pixels - np.array([1.0, 0.498, 0.055])).max(axis=-1) < 0.08).sum())

    steps = [{"step": s, "loss": 3 - 0.1 * s, "lr": 1e-5, "samples_seen": 8 * s} for s in range(1, 11)]
    counts = {}
    for name, vals in (("without", []), ("with", [{"step": s, "val_loss": 3.1 - 0.05 * s, "val_time_s": 0.1}
                                                  for s in (5, 10)])):
        run = tmp_path / name
        run.mkdir()
        lines = steps[:5] + vals[:1] + steps[5:] + vals[1:]
        (run / "training_metrics_0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        counts[name] = orange_pixels(plot_metrics(run)[0])
    assert counts["without"] == 0 < counts["with"]
