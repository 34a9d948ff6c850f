"""Side by side with TRL's ``DPOTrainer`` (the newest release, in a venv of its own: ``fixtures/trl_venv.py``):
on the same model, the same tokenized pairs in the same order and the same hyperparameters (fp32, CPU, one
micro-batch per step on TRL's side, several packed minibatches per rank on ours), every step's loss, rewards
and log-probabilities agree to 1e-5 relative, on 1 and 2 ranks.

TRL is fed our tokenized pairs (``fixtures/trl_dpo.py``), so the comparison is of the training, not of the
tokenization (``tests/test_preference_data.py`` compares that with TRL's own preparation). Our side is a warm call
(``fixtures/e2e.py``: its numbers are the subject), TRL's a fresh process in its venv. Where that venv cannot be
built the test skips, except in CI, where it fails (``fixtures.peer_venv.require``)."""

from __future__ import annotations

import math

import pytest

from fixtures.e2e import assert_ok, model_vocab_size, read_metrics, torchrun, write_tokenized_pairs
from fixtures.peer_venv import require
from fixtures.trl_dpo import run_trl_dpo
from fixtures.trl_venv import trl_python
from minitrainer.data.sampler import InfiniteSampler

NUM_PAIRS, BATCH, STEPS, SEED, LR = 32, 16, 2, 11, 1e-3
COMPARED = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
            "logps/rejected", "grad_norm")

# (ours, TRL's loss_type, loss_weights, label_smoothing, ranks). TRL 1.16's sigmoid ignores label smoothing:
# conservative DPO there is sigmoid plus robust, weighted; its SFT term is each rank's token mean, the exact
# batch mean only on one rank.
CASES = {
    "sigmoid_2_ranks": ([], ["sigmoid"], None, 0.0, 2),
    "ipo": (["--dpo-loss", "ipo"], ["ipo"], None, 0.0, 1),
    "hinge": (["--dpo-loss", "hinge"], ["hinge"], None, 0.0, 1),
    "label_smoothing": (["--dpo-label-smoothing", "0.1"], ["sigmoid", "robust"], [1.8, -0.8], 0.1, 1),
    "sft_term": (["--dpo-sft-weight", "0.5"], ["sigmoid", "sft"], [1.0, 0.5], 0.0, 1),
}


@pytest.fixture(scope="module")
def trl_venv():
    """TRL's venv, built first where it is not whole yet (``run_trl_dpo`` then finds it)."""
    return require(trl_python)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, chatml_model):
    folder = tmp_path_factory.mktemp("trl_dpo_pairs")
    return write_tokenized_pairs(folder, num_pairs=NUM_PAIRS, vocab_size=model_vocab_size(chatml_model), seed=3)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_step_equals_trl_dpo_trainer(case, trl_venv, pairs, chatml_model, tmp_path):
    ours_flags, loss_type, loss_weights, smoothing, ranks = CASES[case]
    result = torchrun(["--model-name-or-path", str(chatml_model), "--data-path", str(pairs),
                       "--output-dir", str(tmp_path / "ours"), "--objective", "dpo", "--dpo-beta", "0.1",
                       *ours_flags, "--batch-size", str(BATCH), "--max-tokens-per-gpu", "64",
                       "--max-steps", str(STEPS), "--learning-rate", str(LR), "--lr-scheduler", "constant",
                       "--num-warmup-steps", "0", "--seed", str(SEED), "--num-data-workers", "0",
                       "--min-samples-per-checkpoint", "100000", "--no-full-state"], nproc=ranks, warm=True)
    assert_ok(result)
    ours = read_metrics(tmp_path / "ours")
    assert all(step["grad_accum"] > 1 for step in ours)  # packed into several minibatches per rank
    # Epoch 0's order of our sampler: TRL reads the rows in it, sequentially.
    order = InfiniteSampler(NUM_PAIRS, SEED).permutation(0).tolist()
    theirs = run_trl_dpo(chatml_model, pairs / "data.jsonl", order, out_dir=tmp_path / "trl", world_size=ranks,
                         per_device_batch_size=BATCH // ranks, max_steps=STEPS, beta=0.1, loss_type=loss_type,
                         loss_weights=loss_weights, label_smoothing=smoothing, learning_rate=LR, seed=SEED)
    assert len(theirs) == len(ours) == STEPS
    for step, (mine, trl) in enumerate(zip(ours, theirs), 1):
        for name in COMPARED:
            assert mine[name] == pytest.approx(trl[name], rel=1e-5, abs=1e-6), (case, step, name)
    if case == "sigmoid_2_ranks":
        assert ours[0]["loss"] == math.log(2)  # exactly; TRL logs float32's ln 2
