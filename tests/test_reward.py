"""Bradley-Terry reward models (``--objective reward``): the scored positions, the loss against its definition,
and 2-rank runs of train.py (warm calls, ``fixtures/e2e.py``) against a plain single-process reward model on the
unpacked sides (losses, gradient norms, every metric), an exact resume, an export that transformers loads as a
``*ForSequenceClassification`` and that scores the held-out pairs as training's last validation did, and every
fine-tuning method (LoRA's adapter loads in peft with its score head). TRL's RewardTrainer side by side:
tests/test_trl_reward.py.

    .venv/bin/python -m pytest -q tests/test_reward.py
"""

from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import pytest
import torch

from fixtures.e2e import IGNORE_INDEX, assert_ok, model_vocab_size, read_metrics, torchrun, write_tokenized_pairs
from minitrainer.data.sampler import InfiniteSampler, collate_units, load_tokenized_dataset
from minitrainer.model.score_head import last_learned_positions
from minitrainer.objectives.reward import RunningExtremes, bradley_terry_losses
from minitrainer.tools.tiny_model import build_tiny_model
from minitrainer.train_config import TrainConfig

BASE = {"output_dir": "out", "model_name_or_path": "m", "data_path": "d"}
STEPS, BATCH, SEED, LR, CENTER = 4, 8, 7, 1e-3, 0.01


# ----------------------------------------------------------------------------
# Pure pieces


def test_each_sequence_is_scored_at_its_last_learned_token(tmp_path):
    pairs = load_tokenized_dataset(str(write_tokenized_pairs(tmp_path / "pairs", num_pairs=5, vocab_size=60)),
                                   cache_dir=str(tmp_path / "cache"))
    packed = collate_units(pairs, [3, 0, 4])
    positions = last_learned_positions(packed.labels.flatten(), packed.cu_seqlens)
    starts = packed.cu_seqlens[:-1].long()
    for index, (position, start) in enumerate(zip(positions.tolist(), starts.tolist())):
        _, labels = pairs.sequences([3, 0, 4][index // 2])[index % 2]
        assert position - start == int(np.flatnonzero(labels != IGNORE_INDEX)[-1])
    # An unlearned tail (a template's newline after its end of turn) is not read; a sequence learning nothing is named.
    labels = torch.tensor([-100, 5, 6, -100, -100, -100, 7, -100, -100, -100, -100, -100])
    cu_seqlens = torch.tensor([0, 4, 8, 12], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"packed sequences \[2\] learn no token"):
        last_learned_positions(labels, cu_seqlens)
    assert last_learned_positions(labels[:8], cu_seqlens[:3]).tolist() == [3, 7]


def test_the_loss_is_bradley_terry_with_trls_margin_and_centring():
    generator = torch.Generator().manual_seed(0)
    chosen, rejected, margins = (torch.randn(9, generator=generator, dtype=torch.float64) for _ in range(3))
    expected = -torch.log(torch.sigmoid(chosen - rejected - margins)) + 0.3 * (chosen + rejected) ** 2
    torch.testing.assert_close(bradley_terry_losses(chosen, rejected, margins, center_coefficient=0.3), expected)
    assert bradley_terry_losses(torch.zeros(2), torch.zeros(2), torch.zeros(2), center_coefficient=0.0).tolist() \
        == pytest.approx([math.log(2)] * 2)
    # Increments over minibatches sum back to the running extremes; an empty minibatch adds nothing.
    extremes, total = RunningExtremes(), torch.zeros(3, dtype=torch.float64)
    for part in (torch.tensor([[0.5, -2.0]]), torch.zeros(0, 2), torch.tensor([[3.0, 1.0], [-1.0, 0.0]])):
        total += extremes.increment(part.double())
    assert total.tolist() == [3.0, 3.0, 2.0]


def test_the_reward_flags_need_the_objective_and_sane_values():
    with pytest.raises(ValueError, match="--reward-center-coefficient needs --objective reward"):
        TrainConfig(**BASE, reward_center_coefficient=0.1)
    with pytest.raises(ValueError, match="--reward-center-coefficient must be non-negative"):
        TrainConfig(**BASE, objective="reward", reward_center_coefficient=-1.0)
    with pytest.raises(ValueError, match="--objective reward does not combine with --context-parallel-size 2"):
        TrainConfig(**BASE, objective="reward", context_parallel_size=2)


# ----------------------------------------------------------------------------
# Runs: 2 gloo ranks, several packed minibatches per rank


def sequence_classifier(causal_lm, folder, *, num_labels: int = 1):
    """The tiny causal LM as a sequence classifier with a seeded score head, saved with its tokenizer: the
    checkpoint both sides of a comparison start from."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(3)
    model = AutoModelForSequenceClassification.from_pretrained(causal_lm, num_labels=num_labels)
    with torch.no_grad():
        model.score.weight.mul_(10)  # scores of a few units: the sigmoid is not flat around them
    tokenizer = AutoTokenizer.from_pretrained(causal_lm)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def with_margins(folder, out, seed: int = 1):
    """The tokenized pairs of ``folder`` with a ``margin`` column, as a margin-carrying file is tokenized."""
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    lines = (folder / "data.jsonl").read_text().splitlines()
    (out / "data.jsonl").write_text("".join(json.dumps({**json.loads(line), "margin": float(rng.uniform(0, 1))})
                                            + "\n" for line in lines))
    return out


def step_lines(out) -> list[dict]:
    """The run's step lines (its validation lines left out)."""
    return [line for line in read_metrics(out) if "val_loss" not in line]


def side_scores(model, pairs, row: int) -> torch.Tensor:
    """A pair's two scores, each side alone through the model, cut after its last learned token."""
    scores = []
    for input_ids, labels in pairs.sequences(row):
        last = int(np.flatnonzero(labels != IGNORE_INDEX)[-1])
        scores.append(model(input_ids=torch.tensor([input_ids[:last + 1].tolist()])).logits[0, 0])
    return torch.stack(scores)


def plain_reward_model(model_dir, data, *, steps: int, cache_dir: str) -> list[dict]:
    """A reward model in one process: each side alone, unpadded, through transformers' own sequence classifier;
    the exact mean over the batch's pairs; AdamW. Every step's loss, gradient norm and metrics."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    pairs = load_tokenized_dataset(str(data), cache_dir=cache_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0, eps=1e-8)
    sampler, results = InfiniteSampler(len(pairs), SEED), []
    for _ in range(steps):
        rows = [int(row) for row in sampler.take(BATCH)]
        scores = torch.stack([side_scores(model, pairs, row) for row in rows])
        margins = torch.tensor(pairs.margins[rows], dtype=torch.float32)
        loss = bradley_terry_losses(scores[:, 0], scores[:, 1], margins, center_coefficient=CENTER).mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        detached = scores.detach()
        results.append({"loss": loss.item(), "grad_norm": norm.item(),
                        "accuracy": (detached[:, 0] > detached[:, 1]).float().mean().item(),
                        "margin": (detached[:, 0] - detached[:, 1]).mean().item(),
                        "mean_reward": detached.mean().item(), "min_reward": detached.min().item(),
                        "max_reward": detached.max().item()})
    return results


def write_raw_pairs(path, num_pairs: int = 40):
    """TRL's conversational preference rows, as a user downloads them: prompt, chosen, rejected."""
    rng = np.random.default_rng(4)
    words = "the sky is blue green red sea sun moon bright dark".split()
    with path.open("w") as file:
        for _ in range(num_pairs):
            question, *answers = (" ".join(rng.choice(words, size=int(rng.integers(1, 6)))) for _ in range(3))
            file.write(json.dumps({"prompt": [{"role": "user", "content": f"Say {question}?"}],
                                   "chosen": [{"role": "assistant", "content": answers[0]}],
                                   "rejected": [{"role": "assistant", "content": answers[1]}]}) + "\n")
    return path


ARGS = ["--objective", "reward", "--batch-size", str(BATCH), "--max-tokens-per-gpu", "64", "--lr-scheduler",
        "constant", "--num-warmup-steps", "0", "--learning-rate", str(LR), "--seed", str(SEED),
        "--num-data-workers", "0", "--save-dtype", "float32"]


@pytest.fixture(scope="module")
def reward_runs(tmp_path_factory, chatml_model):
    """The warm runs the tests below read: a sequence classifier with margins, centring and a held-out file, whole
    and stopped after 2 steps then resumed; LoRA (on a raw file of pairs, tokenized by the run), QLoRA and OSFT on a
    causal LM given a fresh score head."""
    root = tmp_path_factory.mktemp("reward")
    vocab = model_vocab_size(chatml_model)
    classifier = sequence_classifier(chatml_model, root / "classifier")
    data = with_margins(write_tokenized_pairs(root / "pairs", num_pairs=40, vocab_size=vocab), root / "margins")
    held_out = write_tokenized_pairs(root / "held_out", num_pairs=10, vocab_size=vocab, seed=5)
    raw = write_raw_pairs(root / "raw_pairs.jsonl")
    wide = build_tiny_model("chatml", root / "wide", hidden_size=256, intermediate_size=512, num_heads=4,
                            num_kv_heads=2)
    runs = {}
    for name, model, source, extra, steps in [
        ("whole", classifier, data, ["--reward-center-coefficient", str(CENTER), "--validation-data-path",
                                     str(held_out), "--validation-every-n-steps", "2"], [STEPS]),
        ("resumed", classifier, data, ["--reward-center-coefficient", str(CENTER), "--min-samples-per-checkpoint",
                                       "16"], [2, STEPS]),
        ("lora", chatml_model, raw, ["--lora-rank", "4", "--no-lora-merge-on-export", "--validation-split", "0.2",
                                     "--validation-every-n-steps", "1", "--max-tokens-per-gpu", "256"], [2]),
        ("lora_merged", chatml_model, data, ["--lora-rank", "4"], [2]),
        ("osft", chatml_model, data, ["--osft", "--osft-unfreeze-rank-ratio", "0.5"], [2]),
        ("qlora", wide, data, ["--lora-rank", "4", "--lora-quantize-data-type", "nf4"], [2]),
    ]:
        if name == "qlora" and importlib.util.find_spec("torchao") is None:
            continue
        out = root / name
        cadence = [] if "--min-samples-per-checkpoint" in extra else ["--min-samples-per-checkpoint", "1000"]
        runs[name] = (out, [torchrun(["--model-name-or-path", str(model), "--data-path", str(source), *ARGS, *extra,
                                      *cadence, "--output-dir", str(out), "--max-steps", str(n)], warm=True)
                            for n in steps])
    return root, classifier, data, held_out, runs


def test_packed_sharded_steps_equal_a_plain_unpacked_reward_model(reward_runs):
    root, classifier, data, _, runs = reward_runs
    out, (result,) = runs["whole"]
    assert_ok(result)
    assert "objective self-check: the trainer's scores equal Qwen2ForSequenceClassification" in result.stderr
    metrics = step_lines(out)
    assert len(metrics) == STEPS and all(m["grad_accum"] > 1 and m["num_pairs"] == BATCH for m in metrics)
    expected = plain_reward_model(classifier, data, steps=STEPS, cache_dir=str(root / "cache"))
    for name in ("loss", "grad_norm", "mean_reward", "min_reward", "max_reward"):
        assert [m[name] for m in metrics] == pytest.approx([e[name] for e in expected], rel=1e-5), name
    # A mean difference of scores: 1e-5 relative to the scores themselves (it cancels most of their digits).
    for mine, plain in zip(metrics, expected):
        scale = max(abs(plain["min_reward"]), abs(plain["max_reward"]))
        assert mine["margin"] == pytest.approx(plain["margin"], rel=0, abs=1e-5 * scale)
    assert [m["accuracy"] for m in metrics] == [e["accuracy"] for e in expected]
    assert len({m["loss"] for m in metrics}) == STEPS


def test_a_resumed_run_equals_the_uninterrupted_one(reward_runs):
    root, _, _, _, runs = reward_runs
    out, results = runs["resumed"]
    for each in results:
        assert_ok(each)
    assert "resumed from" in results[1].stderr
    resumed, whole = step_lines(out), step_lines(root / "whole")
    assert [m["step"] for m in resumed] == list(range(1, STEPS + 1))
    for ours, theirs in zip(resumed, whole):
        for name in ("loss", "grad_norm", "accuracy", "margin", "min_reward", "max_reward"):
            assert ours[name] == theirs[name], name


def test_the_export_is_a_sequence_classifier_that_scores_as_training_validated(reward_runs):
    from transformers import AutoModelForSequenceClassification

    root, _, _, held_out, runs = reward_runs
    out, _ = runs["whole"]
    validation = [json.loads(line) for line in (out / "training_metrics_0.jsonl").read_text().splitlines()
                  if "val_loss" in line][-1]
    assert validation["step"] == STEPS and validation["val_num_samples"] == 10
    export = out / "hf_format" / f"samples_{STEPS * BATCH}"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"] and len(config["id2label"]) == 1
    assert not (export / "generation_config.json").exists()
    model = AutoModelForSequenceClassification.from_pretrained(export).eval()
    pairs = load_tokenized_dataset(str(held_out), cache_dir=str(root / "cache"))
    with torch.no_grad():
        scores = torch.stack([side_scores(model, pairs, row) for row in range(len(pairs))]).double()
    losses = bradley_terry_losses(scores[:, 0], scores[:, 1], torch.zeros(len(pairs), dtype=torch.float64),
                                  center_coefficient=CENTER)
    assert validation["val_loss"] == pytest.approx(losses.mean().item(), rel=1e-5)
    assert validation["val_accuracy"] == (scores[:, 0] > scores[:, 1]).double().mean().item()
    assert validation["val_margin"] == pytest.approx((scores[:, 0] - scores[:, 1]).mean().item(), rel=0, abs=2e-6)
    assert validation["val_min_reward"] == pytest.approx(scores.min().item(), rel=1e-5)
    assert validation["val_max_reward"] == pytest.approx(scores.max().item(), rel=1e-5)


def test_every_method_trains_a_fresh_score_head_on_a_causal_lm_and_exports_a_classifier(reward_runs, chatml_model):
    from peft import AutoPeftModelForSequenceClassification
    from transformers import AutoModelForSequenceClassification

    root, _, data, _, runs = reward_runs
    pairs = load_tokenized_dataset(str(data), cache_dir=str(root / "cache"))
    for name, (out, results) in runs.items():
        if name in ("whole", "resumed"):
            continue
        [result] = results
        assert_ok(result)
        metrics = step_lines(out)
        assert len(metrics) == 2 and metrics[1]["loss"] != metrics[0]["loss"], name
        assert all(math.isfinite(m["loss"]) and 0 <= m["accuracy"] <= 1 for m in metrics), name
    lora_out, (lora,) = runs["lora"]
    validations = [json.loads(line) for line in (lora_out / "training_metrics_0.jsonl").read_text().splitlines()
                   if "val_loss" in line]
    assert len(validations) == 2 and all("val_accuracy" in v and "val_margin" in v for v in validations)
    assert "a fresh score head (score.weight, initialised from --seed) on its decoder" in lora.stderr
    assert validations[0]["val_num_samples"] == 8  # 40 raw pairs, a fifth held out
    # The adapter alone (LoRA with the score head peft trains whole) loads onto the causal LM it was trained from.
    adapter = lora_out / "hf_format" / "samples_16"
    saved = json.loads((adapter / "adapter_config.json").read_text())
    assert saved["task_type"] == "SEQ_CLS" and "score" in saved["modules_to_save"]
    model = AutoPeftModelForSequenceClassification.from_pretrained(adapter, num_labels=1).eval()
    merged_out, _ = runs["lora_merged"]
    merged = AutoModelForSequenceClassification.from_pretrained(merged_out / "hf_format" / "samples_16").eval()
    peft_side = AutoPeftModelForSequenceClassification.from_pretrained(
        merged_out / "hf_format" / "samples_16" / "adapter", num_labels=1).eval()
    with torch.no_grad():
        for row in range(4):
            torch.testing.assert_close(side_scores(peft_side, pairs, row), side_scores(merged, pairs, row),
                                       rtol=1e-5, atol=1e-6)
        assert torch.isfinite(side_scores(model, pairs, 0)).all()
    for name in ("osft", "qlora"):
        if name in runs:
            export = sorted((runs[name][0] / "hf_format").glob("samples_*"))[-1]
            assert type(AutoModelForSequenceClassification.from_pretrained(export)).__name__ \
                == "Qwen2ForSequenceClassification", name


def test_a_classifier_with_other_labels_is_refused_in_one_line(tmp_path, chatml_model):
    folder = sequence_classifier(chatml_model, tmp_path / "two_labels", num_labels=2)
    data = write_tokenized_pairs(tmp_path / "pairs", num_pairs=4, vocab_size=model_vocab_size(chatml_model))
    result = torchrun(["--model-name-or-path", str(folder), "--data-path", str(data), "--objective", "reward",
                       "--output-dir", str(tmp_path / "out"), "--max-steps", "1"], warm=True)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    [line] = [line for line in result.stderr.splitlines() if "--objective reward:" in line]
    assert "Qwen2ForSequenceClassification with 2 labels; a reward model scores with one" in line
