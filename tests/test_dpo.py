"""DPO on packed batches (``--objective dpo``): the pair losses, per-sequence sums, pair units in the sampler,
and 2-rank runs of train.py (warm calls, ``fixtures/e2e.py``: their numbers are the subject) against a plain
single-process DPO on the unpacked pairs."""

from __future__ import annotations

import importlib.util
import json
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fixtures.e2e import IGNORE_INDEX, assert_ok, model_vocab_size, read_metrics, torchrun, write_tokenized_pairs
from minitrainer.data.preference import PreferenceDataset
from minitrainer.data.sampler import InfiniteSampler, load_tokenized_dataset, make_batch_loader
from minitrainer.model.loss import chunked_cross_entropy_per_sequence, chunked_cross_entropy_sum
from minitrainer.objectives.dpo import DPOSettings, pair_losses
from minitrainer.tools.tiny_model import build_tiny_model
from minitrainer.train_config import TrainConfig


# ----------------------------------------------------------------------------
# Pure pieces


@pytest.mark.parametrize("loss, at_zero", [("sigmoid", math.log(2)), ("hinge", 1.0), ("ipo", 25.0)])
def test_every_pair_loss_has_its_closed_form_where_policy_equals_reference(loss, at_zero):
    zeros = torch.zeros(3, dtype=torch.float64)
    losses = pair_losses(zeros, zeros, torch.tensor([[4, 7]] * 3), DPOSettings(beta=0.1, loss=loss))
    assert losses.tolist() == pytest.approx([at_zero] * 3, rel=1e-15)


def test_pair_losses_match_their_definitions():
    generator = torch.Generator().manual_seed(0)
    chosen, rejected = torch.randn(8, generator=generator, dtype=torch.float64) * 5, torch.randn(8, dtype=torch.float64)
    tokens = torch.randint(1, 30, (8, 2), generator=generator)
    beta, eps = 0.2, 0.1
    margin = beta * (chosen - rejected)
    cdpo = pair_losses(chosen, rejected, tokens, DPOSettings(beta=beta, label_smoothing=eps))
    torch.testing.assert_close(cdpo, -(1 - eps) * F.logsigmoid(margin) - eps * F.logsigmoid(-margin))
    torch.testing.assert_close(pair_losses(chosen, rejected, tokens, DPOSettings(beta=beta, loss="hinge")),
                               torch.clamp(1 - margin, min=0))
    ipo = pair_losses(chosen, rejected, tokens, DPOSettings(beta=beta, loss="ipo"))
    torch.testing.assert_close(ipo, (chosen / tokens[:, 0] - rejected / tokens[:, 1] - 1 / (2 * beta)) ** 2)


def test_per_sequence_sums_equal_each_sequence_alone_across_chunk_boundaries():
    generator = torch.Generator().manual_seed(1)
    lengths = [5, 3, 7, 1, 4]
    hidden = torch.randn(sum(lengths), 8, generator=generator, requires_grad=True)
    weight = torch.randn(11, 8, generator=generator, requires_grad=True)
    labels = torch.randint(0, 11, (sum(lengths),), generator=generator)
    labels[::4] = IGNORE_INDEX
    sequence_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    sums = chunked_cross_entropy_per_sequence(hidden, weight, None, labels, sequence_ids,
                                              num_sequences=len(lengths), chunk_tokens=3)
    starts = np.cumsum([0, *lengths])
    alone = torch.stack([chunked_cross_entropy_sum(hidden[a:b], weight, None, labels[a:b])
                         for a, b in zip(starts[:-1], starts[1:])])
    torch.testing.assert_close(sums, alone, rtol=1e-6, atol=1e-6)
    # A nonlinear function of the sums, as a pair loss is: the gradients agree too.
    weights = torch.arange(1.0, len(lengths) + 1)
    grads = torch.autograd.grad((torch.sigmoid(sums) * weights).sum(), (hidden, weight))
    expected = torch.autograd.grad((torch.sigmoid(alone) * weights).sum(), (hidden, weight))
    for ours, theirs in zip(grads, expected):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_a_pair_is_one_unit_packed_whole_on_one_rank_and_used_once_per_epoch(tmp_path):
    data = write_tokenized_pairs(tmp_path / "pairs", num_pairs=40, vocab_size=200)
    dataset = load_tokenized_dataset(str(data), cache_dir=str(tmp_path / "cache"))
    assert isinstance(dataset, PreferenceDataset) and len(dataset) == 40
    seen = []
    budget, batch_size = 44, 8
    loaders = [make_batch_loader(dataset, batch_size=batch_size, max_tokens_per_rank=budget, rank=rank, world_size=2,
                                 seed=3, num_workers=0, balance="attention") for rank in (0, 1)]
    for _ in range(math.ceil(len(dataset) / batch_size)):
        batches = [next(loader) for loader in loaders]
        assert batches[0].num_samples == sum(mb.num_samples for b in batches for mb in b.minibatches)
        for batch in batches:
            for minibatch in batch.minibatches:
                assert minibatch.num_tokens <= budget
                assert minibatch.num_samples == len(minibatch.rows)
                ids, positions = minibatch.input_ids[0], minibatch.position_ids[0]
                starts = minibatch.cu_seqlens.tolist()
                assert len(starts) - 1 == 2 * len(minibatch.rows) or not minibatch.rows
                for index, row in enumerate(minibatch.rows):
                    for side, (input_ids, _) in enumerate(dataset.sequences(row)):
                        begin, end = starts[2 * index + side], starts[2 * index + side + 1]
                        assert ids[begin:end].tolist() == input_ids.tolist()
                        assert positions[begin:end].tolist() == list(range(end - begin))
                seen += list(minibatch.rows)
    for loader in loaders:
        loader.close()
    # Five batches of 8 are epoch 0: every pair that fits the budget exactly once, the others dropped.
    kept = [row for row in range(len(dataset)) if dataset.lengths[row] <= budget]
    assert sorted(seen) == kept and len(kept) < len(dataset)


def test_the_preference_flags_need_the_objective_and_sane_values():
    base = {"output_dir": "out", "model_name_or_path": "m", "data_path": "d"}
    with pytest.raises(ValueError, match="--dpo-beta needs --objective dpo"):
        TrainConfig(**base, dpo_beta=0.5)
    with pytest.raises(ValueError, match="label-smoothing applies to --dpo-loss sigmoid"):
        TrainConfig(**base, objective="dpo", dpo_loss="ipo", dpo_label_smoothing=0.1)
    with pytest.raises(ValueError, match="does not combine with --context-parallel-size 2"):
        TrainConfig(**base, objective="dpo", context_parallel_size=2)
    with pytest.raises(ValueError, match="--dpo-beta must be positive"):
        TrainConfig(**base, objective="dpo", dpo_beta=0.0)


def test_each_objective_refuses_the_other_kind_of_data_in_one_line(tmp_path):
    from fixtures.e2e import write_tokenized_jsonl

    pairs = load_tokenized_dataset(str(write_tokenized_pairs(tmp_path / "pairs", num_pairs=4, vocab_size=50)),
                                   cache_dir=str(tmp_path / "cache"))
    rows = load_tokenized_dataset(str(write_tokenized_jsonl(tmp_path / "sft" / "data.jsonl", num_samples=4,
                                                            vocab_size=50)), cache_dir=str(tmp_path / "cache"))
    dpo = TrainConfig(model_name_or_path="m", data_path="d", output_dir="o", min_samples_per_checkpoint=1, objective="dpo").training_objective()
    sft = TrainConfig(model_name_or_path="m", data_path="d", output_dir="o", min_samples_per_checkpoint=1).training_objective()
    assert "holds SFT rows" in dpo.data_error(rows, "sft")
    assert "--objective dpo" in sft.data_error(pairs, "pairs")
    assert dpo.data_error(pairs, "pairs") is None and sft.data_error(rows, "sft") is None


def test_every_dataset_kind_is_the_rows_it_declares(tmp_path):
    """``data/rows.py``: what the sampler, the packer and the objectives read of a dataset, declared once; a
    kind's ``sequences_per_unit`` says which of the two shapes it has, and it has all of that one."""
    from fixtures.e2e import write_tokenized_jsonl
    from minitrainer.data.held_out import RowSubset
    from minitrainer.data.mix import MixedDataset, load_data
    from minitrainer.data.rows import PairRows, SampleRows

    cache = str(tmp_path / "cache")
    pairs = load_tokenized_dataset(str(write_tokenized_pairs(tmp_path / "pairs", num_pairs=6, vocab_size=50)),
                                   cache_dir=cache)
    paths = [write_tokenized_jsonl(tmp_path / name / "data.jsonl", num_samples=5, vocab_size=50) for name in "ab"]
    samples = load_tokenized_dataset(str(paths[0]), cache_dir=cache)
    mix = load_data(f"{paths[0]}:1,{paths[1]}:2", lambda path: load_tokenized_dataset(path, cache_dir=cache))
    assert isinstance(mix, MixedDataset)
    kinds = {"tokenized": samples, "mix": mix, "subset of samples": RowSubset(samples, np.array([3, 1])),
             "pairs": pairs, "subset of pairs": RowSubset(pairs, np.array([4, 0, 2])), "sides": pairs.sides()}
    for name, rows in kinds.items():
        shape = PairRows if rows.sequences_per_unit == 2 else SampleRows
        assert rows.sequences_per_unit in (1, 2) and isinstance(rows, shape), name
        assert rows.lengths.shape == rows.num_loss_counted_tokens.shape == (len(rows),), name
        units = [rows.sequences(i) if shape is PairRows else [rows.sample_arrays(i)] for i in range(len(rows))]
        assert [sum(len(ids) for ids, _ in unit) for unit in units] == rows.lengths.tolist(), name
        if shape is PairRows:
            assert rows.side_loss_tokens.sum(axis=1).tolist() == rows.num_loss_counted_tokens.tolist(), name
            assert rows.side_lengths.sum(axis=1).tolist() == rows.lengths.tolist(), name
    assert [name for name, rows in kinds.items() if rows.sequences_per_unit == 2] == ["pairs", "subset of pairs"]


# ----------------------------------------------------------------------------
# Runs: 2 gloo ranks, several packed minibatches per rank


def reference_dpo_losses(model_dir, data, *, steps: int, batch_size: int, seed: int, lr: float, beta: float,
                         cache_dir: str, reference_dir=None) -> list[float]:
    """Plain DPO in one process: each side alone through the model (no packing, no sharding), reference
    log-probabilities from the starting model (or ``reference_dir``'s), the mean over the batch's pairs, AdamW."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    dataset = load_tokenized_dataset(str(data), cache_dir=cache_dir)

    def logps(row: int, of=model) -> torch.Tensor:
        values = []
        for input_ids, labels in dataset.sequences(row):
            logits = of(input_ids=torch.tensor([input_ids.tolist()])).logits[0, :-1]
            values.append(-F.cross_entropy(logits, torch.tensor(labels[1:].tolist()), ignore_index=IGNORE_INDEX,
                                           reduction="sum"))
        return torch.stack(values)

    reference_model = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32) if reference_dir \
        else model
    with torch.no_grad():
        reference = {row: logps(row, reference_model) for row in range(len(dataset))}
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0, eps=1e-8)
    sampler, losses = InfiniteSampler(len(dataset), seed), []
    for _ in range(steps):
        rows = [int(row) for row in sampler.take(batch_size)]
        ratios = torch.stack([logps(row) - reference[row] for row in rows])
        loss = -F.logsigmoid(beta * (ratios[:, 0] - ratios[:, 1])).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


DPO_ARGS = ["--objective", "dpo", "--batch-size", "16", "--max-tokens-per-gpu", "64", "--lr-scheduler", "constant",
            "--num-warmup-steps", "0", "--learning-rate", "1e-3", "--seed", "7", "--num-data-workers", "0"]


@pytest.fixture(scope="module")
def dpo_runs(tmp_path_factory, chatml_model):
    """One set of warm runs that several tests read: a whole run, the same run stopped after 2 steps and
    resumed, another reference model, LoRA with validation, QLoRA, OSFT."""
    root = tmp_path_factory.mktemp("dpo")
    data = write_tokenized_pairs(root / "pairs", num_pairs=40, vocab_size=model_vocab_size(chatml_model))
    # QLoRA quantizes whole NF4 groups: a wider model with the same tokenizer.
    wide = build_tiny_model("chatml", root / "wide", hidden_size=256, intermediate_size=512, num_heads=4,
                            num_kv_heads=2)
    runs = {}
    for name, model, extra, steps in [
        ("whole", chatml_model, [], [4]),
        ("resumed", chatml_model, ["--min-samples-per-checkpoint", "32"], [2, 4]),
        ("reference", chatml_model, ["--reference-model", str(root / "whole" / "hf_format" / "samples_64")], [2]),
        ("lora", chatml_model, ["--lora-rank", "4", "--validation-split", "0.2", "--validation-every-n-steps", "1"],
         [2]),
        ("qlora", wide, ["--lora-rank", "4", "--lora-quantize-data-type", "nf4"], [2]),
        ("osft", chatml_model, ["--osft", "--osft-unfreeze-rank-ratio", "0.5"], [2]),
    ]:
        out = root / name
        common = ["--model-name-or-path", str(model), "--data-path", str(data), *DPO_ARGS]
        results = [torchrun([*common, "--output-dir", str(out), "--max-steps", str(n),
                             *(extra if "--min-samples-per-checkpoint" in extra
                               else [*extra, "--min-samples-per-checkpoint", "1000"])], warm=True) for n in steps]
        runs[name] = (out, results)
    return root, data, runs


def test_step_one_is_ln2_and_packed_sharded_steps_equal_plain_unpacked_dpo(dpo_runs, chatml_model):
    root, data, runs = dpo_runs
    out, (result,) = runs["whole"]
    assert_ok(result)
    metrics = read_metrics(out)
    # Policy and reference are one code path on the same packing: the log-ratio of step 1 is exactly 0.
    assert metrics[0]["loss"] == math.log(2) and metrics[0]["rewards/margins"] == 0.0
    assert metrics[0]["rewards/accuracies"] == 0.0 and metrics[0]["num_pairs"] == 16
    assert all(m["grad_accum"] > 1 for m in metrics)  # several packed minibatches per rank
    expected = reference_dpo_losses(chatml_model, data, steps=4, batch_size=16, seed=7, lr=1e-3, beta=0.1,
                                    cache_dir=str(root / "cache"))
    assert [m["loss"] for m in metrics] == pytest.approx(expected, rel=1e-5)
    assert metrics[-1]["loss"] < math.log(2)
    for name in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "loss_backward"):
        assert all(math.isfinite(m[name]) for m in metrics)
    assert metrics[-1]["loss_backward"] == pytest.approx(metrics[-1]["loss"], rel=1e-5)
    assert "reference log-probabilities of 40 pairs by the starting model" in result.stderr
    from transformers import AutoModelForCausalLM

    exported = sorted((out / "hf_format").glob("samples_*"))[-1]
    assert AutoModelForCausalLM.from_pretrained(exported).num_parameters() > 0


def test_a_resumed_run_equals_the_uninterrupted_one_and_reuses_the_stored_reference(dpo_runs):
    _, data, runs = dpo_runs
    out, results = runs["resumed"]
    for result in results:
        assert_ok(result)
    assert "resumed from" in results[1].stderr
    assert re.search(r"reference log-probabilities: \S+\.npz \(computed before", results[1].stderr)
    whole = read_metrics(runs["whole"][0])
    resumed = read_metrics(out)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for ours, theirs in zip(resumed, whole):
        assert ours["loss"] == theirs["loss"] and ours["rewards/margins"] == theirs["rewards/margins"]
    assert len(list((data / "reference_logps").glob("*.npz"))) >= 1


def test_lora_trains_pairs_against_its_base_and_validates_on_held_out_pairs(dpo_runs):
    out, (result,) = dpo_runs[2]["lora"]
    assert_ok(result)
    lines = [json.loads(line) for line in (out / "training_metrics_0.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "val_loss" not in line]
    validations = [line for line in lines if "val_loss" in line]
    assert steps[0]["loss"] == math.log(2)
    assert len(validations) == 2 and all(0 <= v["val_rewards/accuracies"] <= 1 for v in validations)
    assert all(math.isfinite(v["val_loss"]) and "val_rewards/margins" in v for v in validations)
    # The console says pairs, with the rewards' accuracy and margin (report/progress.py, loop/validation.py).
    for step, v in zip(steps, validations):
        assert (f"step {step['step']}/2 ({step['step'] / 2:.0%}): loss {step['loss']:.4f}, "
                f"acc {step['rewards/accuracies']:.2f}, margin {step['rewards/margins']:.3f}, ") in result.stderr
        assert f"pairs {step['samples_seen']}, elapsed " in result.stderr
        assert (f"step {v['step']}: validation loss {v['val_loss']:.4f} over {v['val_num_samples']} pairs, "
                f"acc {v['val_rewards/accuracies']:.2f}, margin {v['val_rewards/margins']:.3f} (") in result.stderr
    assert validations[0]["val_num_samples"] == 8 and "samples 16" not in result.stderr


def test_another_reference_model_is_the_reference(dpo_runs, chatml_model):
    root, data, runs = dpo_runs
    out, (result,) = runs["reference"]
    assert_ok(result)
    reference_dir = root / "whole" / "hf_format" / "samples_64"
    assert f"reference log-probabilities of 40 pairs by {reference_dir}" in result.stderr
    metrics = read_metrics(out)
    assert metrics[0]["rewards/margins"] != 0.0  # the policy starts away from this reference
    expected = reference_dpo_losses(chatml_model, data, steps=2, batch_size=16, seed=7, lr=1e-3, beta=0.1,
                                    cache_dir=str(root / "cache"), reference_dir=reference_dir)
    assert [m["loss"] for m in metrics] == pytest.approx(expected, rel=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="QLoRA needs torchao")
def test_qlora_trains_pairs_against_its_nf4_base(dpo_runs):
    out, (result,) = dpo_runs[2]["qlora"]
    assert_ok(result)
    metrics = read_metrics(out)
    assert metrics[0]["loss"] == math.log(2) and metrics[1]["loss"] != math.log(2)
    assert (out / "hf_format" / "samples_32" / "adapter").is_dir()


def test_osft_trains_pairs(dpo_runs):
    out, (result,) = dpo_runs[2]["osft"]
    assert_ok(result)
    metrics = read_metrics(out)
    assert metrics[0]["loss"] == math.log(2) and metrics[1]["loss"] != math.log(2)


def test_a_missing_reference_model_is_named_by_its_flag():
    from minitrainer.model.paths import model_path_error

    assert model_path_error("./no-such-model", flag="--reference-model") == \
        "--reference-model ./no-such-model: no such folder"
