"""The reference-free preference objectives (``--objective cpo``, ``simpo``, ``orpo``): their pair losses against
their definitions, a packed accumulated step against the same loss written plainly on unpacked sides (gradients
included), and 2-rank runs of train.py (warm calls, ``fixtures/e2e.py``) with every method, validation and
resume. TRL's trainers side by side: tests/test_trl_preference.py.

    .venv/bin/python -m pytest -q tests/test_reference_free.py
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fixtures.e2e import IGNORE_INDEX, assert_ok, model_vocab_size, read_metrics, torchrun, write_tokenized_pairs
from minitrainer.data.sampler import StepBatch, collate_units, load_tokenized_dataset
from minitrainer.objectives.cpo import CPOSettings, cpo_pair_losses
from minitrainer.objectives.orpo import SEQUENCES_PER_PAIR, log1mexp, odds_ratio_terms, whole_chosen_targets
from minitrainer.objectives.pairs import SideCounts
from minitrainer.tools.tiny_model import build_tiny_model
from minitrainer.train_config import TrainConfig

BASE = {"output_dir": "out", "model_name_or_path": "m", "data_path": "d"}


# ----------------------------------------------------------------------------
# Pure pieces


def test_cpo_and_simpo_losses_match_their_definitions():
    generator = torch.Generator().manual_seed(0)
    chosen, rejected = (torch.randn(8, generator=generator, dtype=torch.float64) * 3 for _ in range(2))
    beta, gamma = 0.3, 0.7
    difference = chosen - rejected

    def losses(loss):
        return cpo_pair_losses(chosen, rejected, CPOSettings(loss=loss, beta=beta, gamma=gamma))

    torch.testing.assert_close(losses("sigmoid"), -F.logsigmoid(beta * difference))
    torch.testing.assert_close(losses("hinge"), torch.clamp(1 - beta * difference, min=0))
    torch.testing.assert_close(losses("ipo"), (difference - 1 / (2 * beta)) ** 2)
    torch.testing.assert_close(losses("simpo"), -F.logsigmoid(beta * difference - gamma))
    assert CPOSettings(loss="simpo").length_normalised and CPOSettings(loss="ipo").length_normalised
    assert not CPOSettings(loss="sigmoid").length_normalised


def test_the_odds_ratio_is_the_log_of_the_odds_quotient():
    chosen = torch.tensor([-0.05, -0.69, -0.70, -3.0, -30.0], dtype=torch.float64)
    rejected = torch.tensor([-0.4, -2.0, -0.1, -3.0, -1e-9], dtype=torch.float64)
    torch.testing.assert_close(log1mexp(chosen), torch.log(1 - torch.exp(chosen)))
    ratio, log_odds = odds_ratio_terms(chosen, rejected)

    def odds(logp):
        return torch.exp(logp) / (1 - torch.exp(logp))

    torch.testing.assert_close(log_odds, torch.log(odds(chosen) / odds(rejected)))
    torch.testing.assert_close(ratio, F.logsigmoid(log_odds))
    assert log_odds[3] == 0.0


def test_orpo_scores_a_chosen_side_whole_and_each_reply_apart():
    """Two pairs in one row: every chosen target (prompt and reply) is labelled, split from the reply's by its
    sequence id; the rejected side keeps its learned targets only; no target crosses a side's end."""
    from minitrainer.data.sampler import collate_minibatch

    prompt, replies = [5, 6, 7], {"c0": [8, 9], "r0": [10], "c1": [11, 12, 13], "r1": [14, 15]}
    sides = [(prompt + reply, [IGNORE_INDEX] * len(prompt) + reply) for reply in replies.values()]
    packed = dataclasses.replace(collate_minibatch(sides), rows=(0, 1))
    filled, sequence_ids = whole_chosen_targets(packed)
    ids = packed.input_ids[0].tolist()
    targets = filled.labels[0].tolist()
    starts = packed.cu_seqlens.tolist()
    for side, (start, end) in enumerate(zip(starts[:-1], starts[1:])):
        pair, chosen = side // 2, side % 2 == 0
        assert targets[end - 1] == IGNORE_INDEX
        for position in range(start, end - 1):
            learned = packed.labels[0, position].item() != IGNORE_INDEX
            if chosen:
                assert targets[position] == ids[position + 1]
                assert sequence_ids[0, position] == SEQUENCES_PER_PAIR * pair + (0 if learned else 2)
            else:
                assert targets[position] == packed.labels[0, position].item()
                assert sequence_ids[0, position] == SEQUENCES_PER_PAIR * pair + 1


def test_each_objective_s_flags_need_it_and_sane_values():
    with pytest.raises(ValueError, match="--cpo-alpha needs --objective cpo"):
        TrainConfig(**BASE, objective="orpo", cpo_alpha=0.0)
    with pytest.raises(ValueError, match="--simpo-gamma needs --objective simpo"):
        TrainConfig(**BASE, objective="dpo", simpo_gamma=1.0)
    with pytest.raises(ValueError, match="--orpo-beta must be positive"):
        TrainConfig(**BASE, objective="orpo", orpo_beta=0.0)
    with pytest.raises(ValueError, match="--simpo-sft-weight must be non-negative"):
        TrainConfig(**BASE, objective="simpo", simpo_sft_weight=-1.0)
    with pytest.raises(ValueError, match="--objective cpo does not combine with --context-parallel-size 2"):
        TrainConfig(**BASE, objective="cpo", context_parallel_size=2)
    assert TrainConfig(**BASE, objective="simpo").training_objective().name == "simpo"


def test_each_objective_refuses_sft_rows_naming_itself(tmp_path):
    from fixtures.e2e import write_tokenized_jsonl

    rows = load_tokenized_dataset(str(write_tokenized_jsonl(tmp_path / "sft" / "data.jsonl", num_samples=4,
                                                            vocab_size=50)), cache_dir=str(tmp_path / "cache"))
    for name in ("cpo", "simpo", "orpo"):
        objective = TrainConfig(**BASE, objective=name).training_objective()
        assert f"--objective {name} needs preference pairs" in objective.data_error(rows, "sft.jsonl")


# ----------------------------------------------------------------------------
# A packed, accumulated step against the loss written plainly on unpacked sides


def plain_loss(model, dataset, rows, config: TrainConfig) -> torch.Tensor:
    """The objective as TRL's trainers define it, on each side alone (no packing), over all ``rows``."""
    chosen, rejected, chosen_tokens, rejected_tokens, nll_sum, nll_tokens = [], [], [], [], 0.0, 0
    whole_sum, whole_tokens = 0.0, 0
    for row in rows:
        for side, (input_ids, labels) in enumerate(dataset.sequences(row)):
            logits = model(input_ids=torch.tensor([input_ids.tolist()])).logits[0, :-1].double()
            targets = torch.tensor(labels[1:].tolist())
            ce = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
            learned = int((targets != IGNORE_INDEX).sum())
            (chosen if side == 0 else rejected).append(-ce)
            (chosen_tokens if side == 0 else rejected_tokens).append(learned)
            if side == 0:
                nll_sum, nll_tokens = nll_sum + ce, nll_tokens + learned
                whole = F.cross_entropy(logits, torch.tensor(input_ids[1:].tolist()), reduction="sum")
                whole_sum, whole_tokens = whole_sum + whole, whole_tokens + len(input_ids) - 1
    chosen, rejected = torch.stack(chosen), torch.stack(rejected)
    means = chosen / torch.tensor(chosen_tokens), rejected / torch.tensor(rejected_tokens)
    if config.objective == "orpo":
        log_odds = (means[0] - means[1]) - (torch.log1p(-torch.exp(means[0])) - torch.log1p(-torch.exp(means[1])))
        return whole_sum / whole_tokens - config.orpo_beta * F.logsigmoid(log_odds).mean()
    if config.objective == "simpo":
        margin = config.simpo_beta * (means[0] - means[1]) - config.simpo_gamma
        return -F.logsigmoid(margin).mean() + config.simpo_sft_weight * nll_sum / nll_tokens
    beta, difference = config.cpo_beta, chosen - rejected
    losses = {"sigmoid": lambda: -F.logsigmoid(beta * difference),
              "hinge": lambda: torch.relu(1 - beta * difference),
              "ipo": lambda: (means[0] - means[1] - 1 / (2 * beta)) ** 2}[config.cpo_loss]()
    return losses.mean() + config.cpo_alpha * nll_sum / nll_tokens


CASES = {
    "cpo_sigmoid": {"objective": "cpo"},
    "cpo_hinge": {"objective": "cpo", "cpo_loss": "hinge", "cpo_beta": 2.0, "cpo_alpha": 0.5},
    "cpo_ipo": {"objective": "cpo", "cpo_loss": "ipo", "cpo_alpha": 0.0},
    "simpo": {"objective": "simpo"},
    "simpo_sft": {"objective": "simpo", "simpo_gamma": 0.0, "simpo_sft_weight": 0.3},
    "orpo": {"objective": "orpo", "orpo_beta": 0.5},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_packed_accumulated_step_equals_the_plain_loss_gradients_included(case, chatml_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from minitrainer.model.loss import CausalLMWithLoss

    config = TrainConfig(**BASE, **CASES[case])
    objective = config.training_objective()
    data = write_tokenized_pairs(tmp_path / "pairs", num_pairs=6, vocab_size=model_vocab_size(chatml_model), seed=5)
    dataset = load_tokenized_dataset(str(data), cache_dir=str(tmp_path / "cache"))
    objective.train = SideCounts.of(dataset)
    model = AutoModelForCausalLM.from_pretrained(chatml_model, attn_implementation="sdpa", dtype=torch.float32)
    wrapper = CausalLMWithLoss(model)
    rows = [4, 1, 0, 5, 2]
    minibatches = [collate_units(dataset, part) for part in (rows[:2], rows[2:], [])]  # the last a dummy
    batch = StepBatch(minibatches=minibatches, batch_num_loss_counted_tokens=int(
        dataset.num_loss_counted_tokens[rows].sum()), num_samples=len(rows), num_dropped_samples=0,
        num_total_tokens=int(dataset.lengths[rows].sum()), start_position=0, end_position=len(rows), epoch=0,
        kept_indices=rows)
    sums = torch.zeros(len(objective.sum_names), dtype=torch.float64)
    for minibatch in minibatches:
        loss, minibatch_sums = objective.minibatch_loss(wrapper, minibatch, batch, attn="sdpa",
                                                        device=torch.device("cpu"), world_size=1)
        loss.backward()
        sums += minibatch_sums
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected = plain_loss(model, dataset, rows, config)
    expected.backward()
    counts = type("Counts", (), {"objective_sums": sums.tolist(), "num_samples": len(rows)})()
    assert objective.step_loss(counts) == pytest.approx(expected.item(), rel=1e-6)
    for ours, theirs in zip(packed_grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    record = objective.record(counts)
    assert record["num_pairs"] == len(rows) and 0 <= record["rewards/accuracies"] <= 1


# ----------------------------------------------------------------------------
# Runs: 2 gloo ranks, several packed minibatches per rank

ARGS = ["--batch-size", "16", "--max-tokens-per-gpu", "64", "--lr-scheduler", "constant", "--num-warmup-steps", "0",
        "--learning-rate", "1e-3", "--seed", "7", "--num-data-workers", "0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, chatml_model):
    """Warm runs that the tests below read: ORPO whole and stopped after 2 steps then resumed, SimPO with LoRA
    and validation, CPO with OSFT, SimPO with QLoRA."""
    root = tmp_path_factory.mktemp("reference_free")
    data = write_tokenized_pairs(root / "pairs", num_pairs=40, vocab_size=model_vocab_size(chatml_model))
    wide = build_tiny_model("chatml", root / "wide", hidden_size=256, intermediate_size=512, num_heads=4,
                            num_kv_heads=2)
    results = {}
    for name, model, extra, steps in [
        ("orpo", chatml_model, ["--objective", "orpo"], [4]),
        ("orpo_resumed", chatml_model, ["--objective", "orpo", "--min-samples-per-checkpoint", "32"], [2, 4]),
        ("simpo_lora", chatml_model, ["--objective", "simpo", "--lora-rank", "4", "--validation-split", "0.2",
                                      "--validation-every-n-steps", "1"], [2]),
        ("cpo_osft", chatml_model, ["--objective", "cpo", "--osft", "--osft-unfreeze-rank-ratio", "0.5"], [2]),
        ("simpo_qlora", wide, ["--objective", "simpo", "--lora-rank", "4", "--lora-quantize-data-type", "nf4"], [2]),
    ]:
        if name == "simpo_qlora" and importlib.util.find_spec("torchao") is None:
            continue
        out = root / name
        cadence = [] if "--min-samples-per-checkpoint" in extra else ["--min-samples-per-checkpoint", "1000"]
        results[name] = (out, [torchrun(["--model-name-or-path", str(model), "--data-path", str(data), *ARGS,
                                         *extra, *cadence, "--output-dir", str(out), "--max-steps", str(n)],
                                        warm=True) for n in steps])
    return root, data, results


def test_orpo_trains_on_two_ranks_with_no_reference_pass_and_resumes_exactly(runs):
    _, data, results = runs
    out, (result,) = results["orpo"]
    assert_ok(result)
    assert "reference log-probabilities" not in result.stderr and not (data / "reference_logps").exists()
    whole = read_metrics(out)
    assert all(m["grad_accum"] > 1 for m in whole) and whole[0]["num_pairs"] == 16
    assert whole[-1]["loss"] < whole[0]["loss"]
    for name in ("nll_loss", "log_odds_ratio", "log_odds_chosen", "rewards/margins", "logps/chosen"):
        assert all(math.isfinite(m[name]) for m in whole), name
    resumed_out, resumed = results["orpo_resumed"]
    for each in resumed:
        assert_ok(each)
    assert "resumed from" in resumed[1].stderr
    again = read_metrics(resumed_out)
    assert [m["step"] for m in again] == [1, 2, 3, 4]
    assert [m["loss"] for m in again] == [m["loss"] for m in whole]
    from transformers import AutoModelForCausalLM

    exported = sorted((out / "hf_format").glob("samples_*"))[-1]
    assert AutoModelForCausalLM.from_pretrained(exported).num_parameters() > 0


def test_simpo_with_lora_validates_on_held_out_pairs(runs):
    out, (result,) = runs[2]["simpo_lora"]
    assert_ok(result)
    lines = [json.loads(line) for line in (out / "training_metrics_0.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "val_loss" not in line]
    validations = [line for line in lines if "val_loss" in line]
    # LoRA adds exactly 0 at the start, and SimPO's loss is -log s(b D - g) there: D is the base model's.
    assert len(steps) == 2 and steps[1]["loss"] != steps[0]["loss"]
    assert len(validations) == 2 and all(0 <= v["val_rewards/accuracies"] <= 1 for v in validations)
    assert all(math.isfinite(v["val_loss"]) and "val_rewards/margins" in v for v in validations)
    assert (out / "hf_format" / "samples_32" / "adapter").is_dir()


def test_cpo_with_osft_and_simpo_with_qlora_train(runs):
    for name in ("cpo_osft", "simpo_qlora"):
        if name not in runs[2]:
            continue
        out, (result,) = runs[2][name]
        assert_ok(result)
        metrics = read_metrics(out)
        assert len(metrics) == 2 and all(math.isfinite(m["loss"]) for m in metrics), name
        assert metrics[1]["loss"] != metrics[0]["loss"], name
        assert np.isfinite(metrics[0]["nll_loss"]), name
