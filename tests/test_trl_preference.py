"""Side by side with TRL 1.16's ``CPOTrainer`` (sigmoid, hinge, ipo, simpo) and ``ORPOTrainer``, in a venv of their
own (``fixtures/trl_venv.py``): on the same model, the same tokenized pairs in the same order and the same
hyperparameters (fp32, CPU, one micro-batch per step on TRL's side, several packed minibatches per rank on ours),
every step's loss, rewards, log-probabilities, NLL, odds-ratio terms and gradient norm agree to 1e-5 relative,
on 1 and 2 ranks.

TRL's NLL term is each rank's token mean (DDP then averages the ranks' means); ours is the exact mean over the
batch's tokens. The two agree when every rank holds as many chosen tokens, so the pairs here have chosen sides
of one length (prompt and reply), the rejected sides of every length. TRL is fed our tokenized pairs
(``fixtures/trl_preference.py``); our side is a warm call (``fixtures/e2e.py``), TRL's a fresh process in its
venv. Where that venv cannot be built the test skips, except in CI, where it fails.

    .venv/bin/python -m pytest -q tests/test_trl_preference.py
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from fixtures.e2e import (IGNORE_INDEX, assert_ok, model_vocab_size, peer_comparison_args, read_metrics,
                          torchrun)
from fixtures.peer_venv import require
from fixtures.trl_preference import run_trl_preference
from fixtures.trl_venv import trl_python
from minitrainer.data.sampler import InfiniteSampler

NUM_PAIRS, BATCH, STEPS, SEED, LR = 32, 16, 2, 11, 1e-3
PAIR_KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
             "logps/rejected", "grad_norm")

# (our flags, TRL's trainer and settings, ranks)
CASES = {
    "simpo": (["--objective", "simpo"], {"trainer": "cpo", "loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.5,
                                         "cpo_alpha": 0.0}, 1),
    "simpo_2_ranks": (["--objective", "simpo", "--simpo-sft-weight", "0.2"],
                      {"trainer": "cpo", "loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.2}, 2),
    "cpo_sigmoid_2_ranks": (["--objective", "cpo"], {"trainer": "cpo", "loss_type": "sigmoid", "beta": 0.1,
                                                     "cpo_alpha": 1.0}, 2),
    "cpo_hinge": (["--objective", "cpo", "--cpo-loss", "hinge", "--cpo-beta", "0.5"],
                  {"trainer": "cpo", "loss_type": "hinge", "beta": 0.5, "cpo_alpha": 1.0}, 1),
    "cpo_ipo": (["--objective", "cpo", "--cpo-loss", "ipo", "--cpo-alpha", "0.5"],
                {"trainer": "cpo", "loss_type": "ipo", "beta": 0.1, "cpo_alpha": 0.5}, 1),
    "orpo": (["--objective", "orpo", "--orpo-beta", "0.5"], {"trainer": "orpo", "beta": 0.5}, 1),
    "orpo_2_ranks": (["--objective", "orpo"], {"trainer": "orpo", "beta": 0.1}, 2),
}


def compared(settings: dict) -> tuple[str, ...]:
    extra = ("nll_loss", "log_odds_ratio", "log_odds_chosen") if settings["trainer"] == "orpo" else \
        ("nll_loss",) if settings["cpo_alpha"] else ()  # TRL logs nll_loss 0 when it skips the term
    return PAIR_KEYS + extra


def write_equal_chosen_pairs(folder, *, vocab_size: int, seed: int):
    """Pairs whose chosen sides all have 6 prompt and 9 reply tokens; rejected replies of 2 to 20 tokens."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "data.jsonl").open("w") as file:
        for _ in range(NUM_PAIRS):
            prompt = rng.integers(5, vocab_size, size=6).tolist()
            replies = [rng.integers(5, vocab_size, size=n).tolist() for n in (9, int(rng.integers(2, 21)))]
            row = {}
            for name, reply in zip(("chosen", "rejected"), replies):
                row[f"{name}_input_ids"] = prompt + reply
                row[f"{name}_labels"] = [IGNORE_INDEX] * len(prompt) + reply
            row["len"] = sum(len(row[f"{name}_input_ids"]) for name in ("chosen", "rejected"))
            row["num_loss_counted_tokens"] = sum(len(reply) for reply in replies)
            file.write(json.dumps(row) + "\n")
    return folder


@pytest.fixture(scope="module")
def trl_venv():
    return require(trl_python)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, chatml_model):
    return write_equal_chosen_pairs(tmp_path_factory.mktemp("trl_preference_pairs"),
                                    vocab_size=model_vocab_size(chatml_model), seed=4)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_step_equals_trls_trainer(case, trl_venv, pairs, chatml_model, tmp_path):
    ours_flags, settings, ranks = CASES[case]
    result = torchrun([*peer_comparison_args(chatml_model, pairs, tmp_path / "ours", batch_size=BATCH, steps=STEPS,
                                             lr=LR, seed=SEED), *ours_flags], nproc=ranks, warm=True)
    assert_ok(result)
    ours = read_metrics(tmp_path / "ours")
    assert all(step["grad_accum"] > 1 for step in ours)  # packed into several minibatches per rank
    order = InfiniteSampler(NUM_PAIRS, SEED).permutation(0).tolist()  # epoch 0's order: TRL reads it in turn
    theirs = run_trl_preference(model_dir=chatml_model, pairs_jsonl=pairs / "data.jsonl", order=order,
                                out_dir=tmp_path / "trl", world_size=ranks, per_device_batch_size=BATCH // ranks,
                                max_steps=STEPS, learning_rate=LR, seed=SEED, **settings)
    assert len(theirs) == len(ours) == STEPS
    for step, (mine, trl) in enumerate(zip(ours, theirs), 1):
        assert sorted(sum(trl["rows"], [])) == sorted(order[(step - 1) * BATCH:step * BATCH])
        for name in compared(settings):
            assert mine[name] == pytest.approx(trl[name], rel=1e-5, abs=1e-6), (case, step, name)
