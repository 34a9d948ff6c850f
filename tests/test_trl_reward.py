"""Side by side with TRL 1.16's ``RewardTrainer``, in a venv of its own (``fixtures/trl_venv.py``): on the same
sequence classifier, the same tokenized pairs in the same order and the same hyperparameters (fp32, CPU, one
micro-batch per step on TRL's side, several packed minibatches per rank on ours), every step's loss, gradient norm,
accuracy, margin and mean, minimum and maximum reward agree, on 1 rank and on 2 with a margin column and TRL's
centring term.

TRL pads each side and reads its score at the last non-pad token; ours reads it at the last learned token inside a
packed row, so TRL is handed each side cut right after that token (``fixtures/trl_reward.py``). Our side is a warm
call (``fixtures/e2e.py``), TRL's a fresh process in its venv. Where that venv cannot be built the test skips,
except in CI, where it fails.

    .venv/bin/python -m pytest -q tests/test_trl_reward.py
"""

from __future__ import annotations

import pytest

from fixtures.e2e import (assert_ok, model_vocab_size, peer_comparison_args, read_metrics, torchrun,
                          write_tokenized_pairs)
from fixtures.peer_venv import require
from fixtures.trl_reward import run_trl_reward
from fixtures.trl_venv import trl_python
from minitrainer.data.sampler import InfiniteSampler
from tests.test_reward import sequence_classifier, with_margins

NUM_PAIRS, BATCH, STEPS, SEED, LR = 24, 8, 3, 7, 1e-3
RELATIVE = ("loss", "grad_norm", "mean_reward", "min_reward", "max_reward")
# (margin column, center coefficient, ranks)
CASES = {"one_rank": (False, None, 1), "two_ranks_margins_centred": (True, 0.01, 2)}


@pytest.fixture(scope="module")
def trl_venv():
    return require(trl_python)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_step_equals_trls_reward_trainer(case, trl_venv, chatml_model, tmp_path):
    margins, center, ranks = CASES[case]
    model = sequence_classifier(chatml_model, tmp_path / "classifier")
    data = write_tokenized_pairs(tmp_path / "pairs", num_pairs=NUM_PAIRS, vocab_size=model_vocab_size(chatml_model))
    if margins:
        data = with_margins(data, tmp_path / "margins")
    center_args = ["--reward-center-coefficient", str(center)] if center else []
    result = torchrun([*peer_comparison_args(model, data, tmp_path / "ours", batch_size=BATCH, steps=STEPS, lr=LR,
                                             seed=SEED), "--objective", "reward", *center_args],
                      nproc=ranks, warm=True)
    assert_ok(result)
    ours = read_metrics(tmp_path / "ours")
    assert all(step["grad_accum"] > 1 for step in ours)  # packed into several minibatches per rank
    order = InfiniteSampler(NUM_PAIRS, SEED).permutation(0).tolist()  # epoch 0's order: TRL reads it in turn
    theirs = run_trl_reward(model, data / "data.jsonl", order, out_dir=tmp_path / "trl", world_size=ranks,
                            per_device_batch_size=BATCH // ranks, max_steps=STEPS, learning_rate=LR,
                            center_rewards_coefficient=center, seed=SEED)
    assert len(theirs) == len(ours) == STEPS
    for step, (mine, trl) in enumerate(zip(ours, theirs), 1):
        assert sorted(sum(trl["rows"], [])) == sorted(order[(step - 1) * BATCH:step * BATCH])
        for name in RELATIVE:
            assert mine[name] == pytest.approx(trl[name], rel=1e-5, abs=1e-6), (case, step, name)
        # A mean difference of scores: 1e-5 relative to the scores themselves (it cancels most of their digits).
        scale = max(abs(trl["min_reward"]), abs(trl["max_reward"]))
        assert mine["margin"] == pytest.approx(trl["margin"], rel=0, abs=1e-5 * scale), (case, step)
        assert mine["accuracy"] == trl["accuracy"], (case, step)
