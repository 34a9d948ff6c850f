"""KTO on unpaired feedback (``--objective kto``): the KL pairing, the units, the loss against its definition, and
2-rank runs of train.py (warm calls, ``fixtures/e2e.py``, but the SIGTERMed one) against a plain single-process
KTO on the unpacked rows: losses and gradient norms, step 1 exactly at the reference, a preemption resumed
exactly, LoRA with validation, and a preference file unpaired. TRL's KTOTrainer side by side:
tests/test_trl_kto.py.

    .venv/bin/python -m pytest -q tests/test_kto.py
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fixtures.e2e import (IGNORE_INDEX, assert_ok, model_vocab_size, read_metrics, torchrun, write_tokenized_pairs,
                          write_tokenized_unpaired)
from minitrainer.checkpoint.full_state import complete_checkpoints
from minitrainer.data.held_out import RowSubset
from minitrainer.data.rows import PairRows
from minitrainer.data.sampler import InfiniteSampler, collate_units, load_tokenized_dataset
from minitrainer.data.unpaired import KLUnits, UnpairedDataset, kl_partners, unpair
from minitrainer.objectives.kto import KL, OWN, KTOSettings, kl_baseline, kto_losses, one_sequence_each
from minitrainer.train_config import TrainConfig

BASE = {"output_dir": "out", "model_name_or_path": "m", "data_path": "d"}


# ----------------------------------------------------------------------------
# Pure pieces


def test_kl_partners_rotate_each_chunk_by_one_as_trl_builds_them():
    # TRL: examples["KL_completion_ids"] = [ids[-1]] + ids[:-1] per map batch of per_device_train_batch_size.
    assert kl_partners(10, 4).tolist() == [3, 0, 1, 2, 7, 4, 5, 6, 9, 8]
    assert kl_partners(9, 4).tolist() == [3, 0, 1, 2, 7, 4, 5, 6, 8]
    assert kl_partners(3, 8).tolist() == [2, 0, 1]


def test_a_preference_file_unpairs_in_trls_order(tmp_path):
    pairs = load_tokenized_dataset(str(write_tokenized_pairs(tmp_path / "pairs", num_pairs=5, vocab_size=60)),
                                   cache_dir=str(tmp_path / "cache"))
    rows = unpair(pairs)
    # TRL's _unpair_row on one map batch: its chosen sides, then its rejected sides.
    assert rows.desirable.tolist() == [True] * 5 + [False] * 5 and rows.unpaired_from == 5
    for row in range(10):
        expected = pairs.sequences(row % 5)[row // 5]
        for ours, theirs in zip(rows.sample_arrays(row), expected):
            assert ours.tolist() == theirs.tolist()
    assert rows.lengths.tolist() == [*pairs.side_lengths[:, 0], *pairs.side_lengths[:, 1]]


def test_kl_units_are_each_row_and_its_prompt_with_the_partners_completion(tmp_path):
    data = write_tokenized_unpaired(tmp_path / "rows", num_rows=11, vocab_size=60)
    rows = load_tokenized_dataset(str(data), cache_dir=str(tmp_path / "cache"))
    assert isinstance(rows, UnpairedDataset) and rows.sequences_per_unit == 1
    units = KLUnits(rows, chunk=4)
    lines = [json.loads(line) for line in (data / "data.jsonl").read_text().splitlines()]
    subset = RowSubset(units, np.array([6, 2, 9]))
    for kind in (units, subset, units.sides()):
        assert kind.lengths.shape == kind.num_loss_counted_tokens.shape == (len(kind),)
    for kind in (units, subset):
        assert isinstance(kind, PairRows) and kind.sequences_per_unit == 2
        assert kind.side_lengths.sum(axis=1).tolist() == kind.lengths.tolist()
    assert subset.desirable.tolist() == [lines[i]["desirable"] for i in (6, 2, 9)]
    for index, line in enumerate(lines):
        partner = lines[int(kl_partners(11, 4)[index])]
        cut, other_cut = line["labels"].count(IGNORE_INDEX), partner["labels"].count(IGNORE_INDEX)
        (own_ids, own_labels), (kl_ids, kl_labels) = units.sequences(index)
        assert own_ids.tolist() == line["input_ids"] and own_labels.tolist() == line["labels"]
        assert kl_ids.tolist() == line["input_ids"][:cut] + partner["input_ids"][other_cut:]
        assert kl_labels.tolist() == [IGNORE_INDEX] * cut + partner["labels"][other_cut:]
        assert units.side_lengths[index].tolist() == [len(own_ids), len(kl_ids)]
        shifted = [int((np.asarray(labels[1:]) != IGNORE_INDEX).sum()) for labels in (own_labels, kl_labels)]
        assert units.side_loss_tokens[index].tolist() == shifted
    assert units.content_digest() != KLUnits(rows, chunk=5).content_digest()


def test_one_sequence_each_is_the_row_of_those_sequences_alone(tmp_path):
    units = KLUnits(load_tokenized_dataset(str(write_tokenized_unpaired(tmp_path / "rows", num_rows=6, vocab_size=60)),
                                           cache_dir=str(tmp_path / "cache")), chunk=3)
    from minitrainer.data.sampler import collate_minibatch

    packed = collate_units(units, [4, 0, 5])
    for which in (OWN, KL):
        part = one_sequence_each(packed, which)
        alone = collate_minibatch([units.sequences(row)[which] for row in (4, 0, 5)])
        for name in ("input_ids", "labels", "position_ids", "cu_seqlens"):
            assert torch.equal(getattr(part, name), getattr(alone, name)), name
        assert (part.max_seqlen, part.num_loss_counted_tokens, part.num_tokens) == \
            (alone.max_seqlen, alone.num_loss_counted_tokens, alone.num_tokens)
        assert part.rows == (4, 0, 5)


def test_kto_losses_match_the_papers_definition():
    generator = torch.Generator().manual_seed(0)
    ratios = torch.randn(10, generator=generator, dtype=torch.float64) * 4
    desirable = torch.arange(10) % 3 != 0
    settings = KTOSettings(beta=0.3, desirable_weight=1.5, undesirable_weight=0.7)
    kl = torch.tensor(0.4, dtype=torch.float64)
    expected = torch.where(desirable, 1.5 * (1 - torch.sigmoid(0.3 * (ratios - kl))),
                           0.7 * (1 - torch.sigmoid(0.3 * (kl - ratios))))
    torch.testing.assert_close(kto_losses(ratios, desirable, kl, settings), expected, rtol=1e-15, atol=0)
    zeros = torch.zeros(4, dtype=torch.float64)
    assert kto_losses(zeros, torch.tensor([True, False, True, False]), torch.zeros((), dtype=torch.float64),
                      settings).tolist() == [0.75, 0.35, 0.75, 0.35]
    # The baseline is a mean, clamped at 0 (TRL: .mean().clamp(min=0)).
    assert kl_baseline(torch.tensor(-3.0), torch.tensor(4.0)) == 0
    assert kl_baseline(torch.tensor(3.0), torch.tensor(4.0)) == 0.75


def test_the_kto_flags_need_the_objective_and_sane_values():
    with pytest.raises(ValueError, match="--kto-beta needs --objective kto"):
        TrainConfig(**BASE, kto_beta=0.2)
    with pytest.raises(ValueError, match="--reference-model needs --objective dpo or kto"):
        TrainConfig(**BASE, objective="cpo", reference_model="ref")
    with pytest.raises(ValueError, match="--kto-kl-chunk must be at least 2"):
        TrainConfig(**BASE, objective="kto", kto_kl_chunk=1)
    with pytest.raises(ValueError, match="--kto-undesirable-weight must be positive"):
        TrainConfig(**BASE, objective="kto", kto_undesirable_weight=0.0)
    with pytest.raises(ValueError, match="--objective kto does not combine with --context-parallel-size 2"):
        TrainConfig(**BASE, objective="kto", context_parallel_size=2)


def test_each_objective_refuses_the_other_kinds_of_data_in_one_line(tmp_path):
    from fixtures.e2e import write_tokenized_jsonl

    cache = str(tmp_path / "cache")
    unpaired = load_tokenized_dataset(str(write_tokenized_unpaired(tmp_path / "rows", num_rows=4, vocab_size=50)),
                                      cache_dir=cache)
    sft_rows = load_tokenized_dataset(str(write_tokenized_jsonl(tmp_path / "sft" / "data.jsonl", num_samples=4,
                                                                vocab_size=50)), cache_dir=cache)
    pairs = load_tokenized_dataset(str(write_tokenized_pairs(tmp_path / "pairs", num_pairs=4, vocab_size=50)),
                                   cache_dir=cache)
    kto, sft, dpo = (TrainConfig(**BASE, objective=name).training_objective() for name in ("kto", "sft", "dpo"))
    assert "train them with --objective kto" in sft.data_error(unpaired, "rows")
    assert "holds unpaired feedback" in dpo.data_error(unpaired, "rows")
    assert "holds SFT rows" in kto.data_error(kto.training_rows(sft_rows), "sft")
    for rows in (unpaired, pairs):
        units = kto.training_rows(rows)
        assert isinstance(units, KLUnits) and kto.data_error(units, "data") is None
    assert len(kto.training_rows(pairs)) == 8


# ----------------------------------------------------------------------------
# Runs: 2 gloo ranks, several packed minibatches per rank

STEPS, BATCH, SEED, LR, BETA, CHUNK = 3, 16, 7, 1e-3, 0.1, 8
KTO_ARGS = ["--objective", "kto", "--batch-size", str(BATCH), "--max-tokens-per-gpu", "64", "--lr-scheduler",
            "constant", "--num-warmup-steps", "0", "--learning-rate", str(LR), "--seed", str(SEED),
            "--num-data-workers", "0", "--kto-desirable-weight", "1.3"]


def reference_kto(model_dir, data, *, steps: int, cache_dir: str) -> list[tuple[float, float, float]]:
    """Plain KTO in one process: each own and KL sequence alone through the model (no packing, no sharding), the
    reference log-probabilities from the starting model, the baseline the batch's clamped mean of KL log-ratios
    (no gradient), the mean over the batch's rows, AdamW. ``(loss, kl, gradient norm)`` per step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    units = KLUnits(load_tokenized_dataset(str(data), cache_dir=cache_dir), CHUNK)

    def logps(row: int) -> torch.Tensor:
        values = []
        for input_ids, labels in units.sequences(row):
            logits = model(input_ids=torch.tensor([input_ids.tolist()])).logits[0, :-1]
            values.append(-F.cross_entropy(logits, torch.tensor(labels[1:].tolist()), ignore_index=IGNORE_INDEX,
                                           reduction="sum"))
        return torch.stack(values)

    with torch.no_grad():
        reference = {row: logps(row) for row in range(len(units))}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0, eps=1e-8)
    sampler, results = InfiniteSampler(len(units), SEED), []
    settings = KTOSettings(beta=BETA, desirable_weight=1.3)
    for _ in range(steps):
        rows = [int(row) for row in sampler.take(BATCH)]
        ratios = torch.stack([logps(row) - reference[row] for row in rows])
        kl = ratios[:, KL].detach().mean().clamp(min=0)
        loss = kto_losses(ratios[:, OWN], torch.tensor(units.desirable[rows]), kl, settings).mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        results.append((loss.item(), kl.item(), norm.item()))
    return results


def write_raw_feedback(path, num_rows: int = 40):
    """TRL's conversational unpaired preference rows, as a user downloads them: prompt, completion, label."""
    rng = np.random.default_rng(2)
    words = "the sky is blue green red sea sun moon bright dark".split()
    with path.open("w") as file:
        for index in range(num_rows):
            question = " ".join(rng.choice(words, size=int(rng.integers(2, 6))))
            answer = " ".join(rng.choice(words, size=int(rng.integers(1, 5))))
            file.write(json.dumps({"prompt": [{"role": "user", "content": f"Say {question}?"}],
                                   "completion": [{"role": "assistant", "content": answer}],
                                   "label": bool(index % 3)}) + "\n")
    return path


@pytest.fixture(scope="module")
def kto_runs(tmp_path_factory, chatml_model):
    """The warm runs several tests read: a whole run, the same run SIGTERMed on rank 1 after step 2 (a fresh
    launch: the preemption is the subject) and resumed, LoRA with validation on a raw feedback file (tokenized
    by the run), a preference file unpaired."""
    root = tmp_path_factory.mktemp("kto")
    vocab = model_vocab_size(chatml_model)
    data = write_tokenized_unpaired(root / "rows", num_rows=40, vocab_size=vocab)
    pairs = write_tokenized_pairs(root / "pairs", num_pairs=12, vocab_size=vocab)

    def args(out, data_path=data, steps=STEPS, *extra):
        return ["--model-name-or-path", str(chatml_model), "--data-path", str(data_path), *KTO_ARGS,
                "--output-dir", str(out), "--max-steps", str(steps), "--min-samples-per-checkpoint", "1000", *extra]

    runs = {"whole": torchrun(args(root / "whole"), warm=True),
            "signalled": torchrun(args(root / "stopped"), timeout=600, env={"MINI_TRAINER_TEST_SIGTERM": "2:1"})}
    runs["saved_on_signal"] = [p.name for p in complete_checkpoints(root / "stopped" / "full_state")]
    runs["resumed"] = torchrun(args(root / "stopped"), warm=True)
    runs["lora"] = torchrun(args(root / "lora", write_raw_feedback(root / "feedback.jsonl"), 2, "--lora-rank", "4",
                                 "--validation-split", "0.2", "--validation-every-n-steps", "1",
                                 "--max-tokens-per-gpu", "256"), warm=True)
    runs["pairs"] = torchrun(args(root / "pairs_run", pairs, 2, "--batch-size", "8"), warm=True)
    return root, data, runs


def test_step_one_is_at_the_reference_and_packed_sharded_steps_equal_plain_unpacked_kto(kto_runs, chatml_model):
    root, data, runs = kto_runs
    assert_ok(runs["whole"])
    metrics = read_metrics(root / "whole")
    first = metrics[0]
    # Policy and reference are one code path on the same packing: every log-ratio of step 1 is exactly 0.
    assert first["kl"] == 0.0 and first["rewards/chosen"] == 0.0 and first["rewards/rejected"] == 0.0
    assert first["loss"] == pytest.approx((1.3 * first["num_desirable"] + (BATCH - first["num_desirable"])) * 0.5
                                          / BATCH, rel=1e-12)
    assert all(m["grad_accum"] > 1 for m in metrics) and all(m["num_examples"] == BATCH for m in metrics)
    expected = reference_kto(chatml_model, data, steps=STEPS, cache_dir=str(root / "cache"))
    assert [m["loss"] for m in metrics] == pytest.approx([e[0] for e in expected], rel=1e-5)
    # A baseline is a difference of float32 log-probabilities of about 50 (an ulp is 4e-6): absolute.
    assert [m["kl"] for m in metrics] == pytest.approx([e[1] for e in expected], rel=0, abs=2e-5)
    assert [m["grad_norm"] for m in metrics] == pytest.approx([e[2] for e in expected], rel=1e-4)
    assert any(m["kl"] > 0 for m in metrics)  # the baseline moves off its clamp within the run
    assert "reference log-probabilities of 40 examples by the starting model" in runs["whole"].stderr


def test_a_sigtermed_run_resumes_equal_to_the_uninterrupted_one(kto_runs):
    root, _, runs = kto_runs
    assert runs["signalled"].returncode != 0, runs["signalled"].stderr[-2000:]
    assert runs["saved_on_signal"] == [f"samples_{2 * BATCH}"]
    assert_ok(runs["resumed"])
    assert "resumed from" in runs["resumed"].stderr
    assert "(computed before, for this model, data and packing)" in runs["resumed"].stderr
    whole, resumed = read_metrics(root / "whole"), read_metrics(root / "stopped")
    assert [m["step"] for m in resumed] == list(range(1, STEPS + 1))
    for ours, theirs in zip(resumed, whole):
        for name in ("loss", "kl", "grad_norm", "rewards/chosen", "rewards/rejected", "logps/chosen"):
            assert ours[name] == theirs[name], name


def test_lora_trains_a_raw_feedback_file_against_its_base_and_validates_with_the_held_out_baseline(kto_runs):
    root, _, runs = kto_runs
    assert_ok(runs["lora"])
    counts = re.search(r"kto: (\d+) desirable and (\d+) undesirable examples", runs["lora"].stderr)
    assert counts and sum(map(int, counts.groups())) == 32  # 40 rows, 8 held out
    assert "kto: the weights do not balance" in runs["lora"].stderr  # TRL's hint, its ranges
    lines = [json.loads(line) for line in (root / "lora" / "training_metrics_0.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "val_loss" not in line]
    validations = [line for line in lines if "val_loss" in line]
    assert steps[0]["kl"] == 0.0 and steps[0]["rewards/chosen"] == 0.0
    assert len(validations) == 2 and validations[0]["val_num_samples"] == 8
    assert all(math.isfinite(v["val_loss"]) and v["val_kl"] >= 0 for v in validations)
    assert "val_rewards/margins" in validations[-1]
    assert (root / "lora" / "hf_format" / "samples_32").is_dir()


def test_a_preference_file_trains_unpaired(kto_runs):
    root, _, runs = kto_runs
    assert_ok(runs["pairs"])
    assert "12 preference pairs unpaired into 24 examples" in runs["pairs"].stderr
    metrics = read_metrics(root / "pairs_run")
    first = metrics[0]
    assert first["num_examples"] == 8 and len(metrics) == 2 and first["kl"] == 0.0
    assert first["loss"] == pytest.approx((1.3 * first["num_desirable"] + 8 - first["num_desirable"]) * 0.5 / 8,
                                          rel=1e-12)


def test_a_sequence_classification_checkpoint_is_refused_in_one_line(tmp_path, chatml_model):
    """A reward model's folder (score head, no LM head) would load as a causal LM with a fresh random head."""
    from transformers import AutoModelForSequenceClassification

    folder = tmp_path / "classifier"
    AutoModelForSequenceClassification.from_pretrained(chatml_model, num_labels=1).save_pretrained(folder)
    data = write_tokenized_unpaired(tmp_path / "rows", num_rows=4, vocab_size=model_vocab_size(chatml_model))
    result = torchrun(["--model-name-or-path", str(folder), "--data-path", str(data), "--output-dir",
                       str(tmp_path / "out"), "--max-steps", "1"], warm=True)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    [line] = [line for line in result.stderr.splitlines() if "sequence-classification checkpoint" in line]
    assert f"{folder} is a sequence-classification checkpoint (Qwen2ForSequenceClassification" in line
    assert not (tmp_path / "out" / "hf_format").exists()
