"""Side by side with TRL 1.16's ``KTOTrainer``, in a venv of its own (``fixtures/trl_venv.py``): on the same model,
the same tokenized rows in the same order, the same KL pairs and the same hyperparameters (fp32, CPU, one
micro-batch per step on TRL's side, several packed minibatches per rank on ours), every step's loss, KL baseline,
rewards, log-probabilities, mean logits, entropy and gradient norm agree, on 1 and 2 ranks.

TRL builds its KL pairs by rotating the completions of each ``per_device_train_batch_size`` rows of its dataset;
ours are fixed by the file (``data/unpaired.py``), so TRL is handed ours (``fixtures/trl_kto.py``) and reads our
sampler's order. TRL's loss and baseline are the means of the ranks' own means: the global means here, where every
rank holds as many rows. Our side is a warm call (``fixtures/e2e.py``), TRL's a fresh process in its venv. Where
that venv cannot be built the test skips, except in CI, where it fails.

    .venv/bin/python -m pytest -q tests/test_trl_kto.py
"""

from __future__ import annotations

import pytest

from fixtures.e2e import (assert_ok, model_vocab_size, peer_comparison_args, read_metrics, torchrun,
                          write_tokenized_unpaired)
from fixtures.peer_venv import require
from fixtures.trl_kto import run_trl_kto
from fixtures.trl_venv import trl_python
from minitrainer.data.sampler import InfiniteSampler
from minitrainer.data.unpaired import kl_partners

NUM_ROWS, BATCH, STEPS, SEED, LR, CHUNK = 48, 16, 3, 7, 1e-3, 8
RELATIVE = ("loss", "logps/chosen", "logps/rejected", "grad_norm", "logits/chosen", "logits/rejected", "entropy")
DIFFERENCES = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins")
"""Beta times a difference of float32 log-probabilities of about 50 (an ulp is 4e-6): compared absolutely."""

# (beta, desirable weight, undesirable weight, ranks)
CASES = {"one_rank": (0.1, 1.0, 1.0, 1), "two_ranks_weighted": (0.5, 1.33, 0.8, 2)}


@pytest.fixture(scope="module")
def trl_venv():
    return require(trl_python)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_step_equals_trls_kto_trainer(case, trl_venv, chatml_model, tmp_path):
    beta, desirable_weight, undesirable_weight, ranks = CASES[case]
    data = write_tokenized_unpaired(tmp_path / "rows", num_rows=NUM_ROWS, vocab_size=model_vocab_size(chatml_model),
                                    seed=0)
    result = torchrun([*peer_comparison_args(chatml_model, data, tmp_path / "ours", batch_size=BATCH, steps=STEPS,
                                             lr=LR, seed=SEED),
                       "--objective", "kto", "--kto-beta", str(beta), "--kto-desirable-weight", str(desirable_weight),
                       "--kto-undesirable-weight", str(undesirable_weight), "--kto-kl-chunk", str(CHUNK)],
                      nproc=ranks, warm=True)
    assert_ok(result)
    ours = read_metrics(tmp_path / "ours")
    assert all(step["grad_accum"] > 1 for step in ours)  # packed into several minibatches per rank
    order = InfiniteSampler(NUM_ROWS, SEED).permutation(0).tolist()  # epoch 0's order: TRL reads it in turn
    theirs = run_trl_kto(chatml_model, data / "data.jsonl", order, kl_partners(NUM_ROWS, CHUNK).tolist(),
                         out_dir=tmp_path / "trl", world_size=ranks, per_device_batch_size=BATCH // ranks,
                         max_steps=STEPS, beta=beta, desirable_weight=desirable_weight,
                         undesirable_weight=undesirable_weight, learning_rate=LR, seed=SEED)
    assert len(theirs) == len(ours) == STEPS
    # Step 1: the policy is its own reference on both sides.
    assert ours[0]["kl"] == theirs[0]["kl"] == 0.0 and ours[0]["rewards/chosen"] == 0.0
    assert any(step["kl"] > 0 for step in theirs), [(m["kl"], t["kl"]) for m, t in zip(ours, theirs)]
    for step, (mine, trl) in enumerate(zip(ours, theirs), 1):
        assert sorted(sum(trl["rows"], [])) == sorted(order[(step - 1) * BATCH:step * BATCH])
        for name in (*RELATIVE, *DIFFERENCES):
            assert (name in mine) == (name in trl), (case, step, name)
            if name in trl:
                tolerance = dict(rel=1e-5, abs=1e-6) if name in RELATIVE else \
                    dict(rel=0, abs=2e-5 * (1 if name == "kl" else beta))
                assert mine[name] == pytest.approx(trl[name], **tolerance), (case, step, name)
