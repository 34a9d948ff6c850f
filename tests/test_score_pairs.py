"""``minitrainer-score-pairs`` (minitrainer/tools/score_pairs.py): a reward model's scores of preference pairs, checked
against each side forwarded alone through plain transformers, raw and tokenized, batched and not, whole and as a
peft adapter; and its one-line refusals.

    .venv/bin/python -m pytest -q tests/test_score_pairs.py

The reward model is a tiny random ``Qwen2ForSequenceClassification`` (one label, ``pad_token_id`` set) made from
the tiny ChatML causal LM (``tools/tiny_model.py``) under a fixed seed; the pairs are the first rows of the
package's demo preference file.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from minitrainer.common.cli import build_arg_parser
from minitrainer.common.labels import IGNORE_INDEX
from minitrainer.data.process_data import ProcessDataConfig, process_data
from minitrainer.tools import score_pairs as tool
from minitrainer.tools.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parent.parent
DEMO_PAIRS = ROOT / "minitrainer" / "tools" / "demo_preferences.jsonl"
NUM_PAIRS = 6


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The causal LM, the reward model made from it, raw pairs, and those pairs tokenized by process_data."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    root = tmp_path_factory.mktemp("score_pairs")
    causal = build_tiny_model("chatml", root / "causal")
    tokenizer = AutoTokenizer.from_pretrained(causal)
    torch.manual_seed(1234)
    model = AutoModelForSequenceClassification.from_pretrained(causal, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    reward = root / "reward"
    model.save_pretrained(reward)
    tokenizer.save_pretrained(reward)
    raw = root / "pairs.jsonl"
    raw.write_text("".join(DEMO_PAIRS.read_text().splitlines(keepends=True)[:NUM_PAIRS]))
    tokenized = root / "pairs_tkns"
    process_data(ProcessDataConfig(input_file=str(raw), model_name_or_path=str(reward), output_dir=str(tokenized),
                                   num_proc=1, num_printed_samples=0))
    return {"root": root, "causal": causal, "reward": reward, "raw": raw, "tokenized": tokenized,
            "model": model.eval(), "cache": root / "cache"}


def run(capsys, *args: str) -> tuple[dict, list[dict], str]:
    """``main`` in this process: the printed JSON line, the --output lines, and stderr."""
    output = Path(args[args.index("--output") + 1]) if "--output" in args else None
    summary = tool.main(list(args))
    out, err = capsys.readouterr()
    printed = json.loads(out.strip().splitlines()[-1])
    assert printed == summary
    rows = [json.loads(line) for line in output.read_text().splitlines()] if output else []
    return printed, rows, err


def own_score(model, ids: list[int]) -> float:
    with torch.inference_mode():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def cut(ids: list[int], labels: list[int]) -> list[int]:
    last = max(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
    return ids[:last + 1]


def test_raw_pairs_score_as_each_side_alone_and_tokenized_pairs_score_the_same(world, capsys, tmp_path):
    rows = [json.loads(line) for line in (world["tokenized"] / "data.jsonl").read_text().splitlines()]
    expected = [(own_score(world["model"], cut(r["chosen_input_ids"], r["chosen_labels"])),
                 own_score(world["model"], cut(r["rejected_input_ids"], r["rejected_labels"]))) for r in rows]
    # The cut drops the template's tail (ChatML's newline after <|im_end|>): the side's last token is learned.
    assert all(r["chosen_labels"][-1] == IGNORE_INDEX for r in rows)

    common = ["--model", str(world["reward"]), "--device", "cpu"]
    raw_summary, raw_rows, raw_err = run(capsys, *common, "--data", str(world["raw"]), "--tokenized-data-dir",
                                         str(world["cache"]), "--output", str(tmp_path / "raw.jsonl"))
    assert "tokenizing it once" in raw_err
    scored = [score for r in raw_rows for score in (r["chosen"], r["rejected"])]
    assert scored == pytest.approx([score for pair in expected for score in pair], abs=1e-6)
    assert [r["row"] for r in raw_rows] == list(range(NUM_PAIRS))

    _, tokenized_rows, _ = run(capsys, *common, "--data", str(world["tokenized"]), "--output",
                               str(tmp_path / "tok.jsonl"))
    assert tokenized_rows == raw_rows

    import pyarrow as pa
    import pyarrow.parquet as pq

    table = tmp_path / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist(rows), table)
    parquet_summary, parquet_rows, _ = run(capsys, *common, "--data", str(table), "--output",
                                           str(tmp_path / "parquet.jsonl"))
    assert parquet_rows == raw_rows
    assert parquet_summary["pairs"] == raw_summary["pairs"] == NUM_PAIRS


def test_padded_batches_score_as_one_side_at_a_time(world, capsys, tmp_path):
    common = ["--model", str(world["reward"]), "--data", str(world["tokenized"]), "--device", "cpu"]
    _, alone, _ = run(capsys, *common, "--output", str(tmp_path / "b1.jsonl"))
    _, batched, _ = run(capsys, *common, "--batch-size", "4", "--output", str(tmp_path / "b4.jsonl"))
    lengths = {len(cut(r["chosen_input_ids"], r["chosen_labels"]))
               for r in map(json.loads, (world["tokenized"] / "data.jsonl").read_text().splitlines())}
    assert len(lengths) > 1  # the batches are padded
    for one, four in zip(alone, batched):
        assert one["row"] == four["row"]
        assert four["chosen"] == pytest.approx(one["chosen"], abs=1e-5)
        assert four["rejected"] == pytest.approx(one["rejected"], abs=1e-5)


def test_the_printed_summary_is_the_output_lines_summed_up(world, capsys, tmp_path):
    summary, rows, err = run(capsys, "--model", str(world["reward"]), "--data", str(world["tokenized"]),
                             "--batch-size", "3", "--output", str(tmp_path / "scores.jsonl"))
    chosen = np.array([r["chosen"] for r in rows])
    rejected = np.array([r["rejected"] for r in rows])
    assert summary["pairs"] == len(rows) == NUM_PAIRS and summary["unscored"] == 0
    assert summary["accuracy"] == pytest.approx(float(np.mean(chosen > rejected)))
    assert summary["margin"] == pytest.approx(float(np.mean(chosen - rejected)))
    assert summary["mean_reward"] == pytest.approx(float(np.mean(np.concatenate([chosen, rejected]))))
    assert all(r["margin"] == pytest.approx(r["chosen"] - r["rejected"]) for r in rows)
    assert (summary["model"], summary["data"], summary["dtype"]) == (str(world["reward"]), str(world["tokenized"]),
                                                                      "float32")
    assert f"accuracy {summary['accuracy']:.4f}" in err.strip().splitlines()[-1]


def test_a_side_that_learns_nothing_is_named_and_one_that_ends_in_the_pad_token_is_read_at_it(world, capsys,
                                                                                              tmp_path):
    """Transformers pools at the last token that is not the pad token: a side ending in it is scored at its last
    token (as training reads it) at every batch size; a pair with a side that learns nothing is counted, named."""
    model, pad = world["model"], world["model"].config.pad_token_id
    ends_in_pad = [5, 6, 7, pad]
    pairs = [(ends_in_pad, [IGNORE_INDEX, 6, 7, pad], [5, 9, 9, 8, 4], [IGNORE_INDEX] * 3 + [8, IGNORE_INDEX]),
             ([5, 6, 7], [IGNORE_INDEX, 6, 7], [5, 6], [IGNORE_INDEX] * 2),
             ([5, 10, 11, 12], [IGNORE_INDEX, 10, 11, IGNORE_INDEX], [5, 3, 2], [IGNORE_INDEX, 3, 2])]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"chosen_input_ids": c, "chosen_labels": cl, "rejected_input_ids": r,
                                        "rejected_labels": rl}) + "\n" for c, cl, r, rl in pairs))
    with torch.inference_mode():
        hidden = model.model(input_ids=torch.tensor([ends_in_pad])).last_hidden_state[0, -1]
        at_last_token = float(model.score(hidden)[0])
    assert abs(at_last_token - own_score(model, ends_in_pad)) > 1e-4  # the pooling would read another token

    for batch_size in ("1", "4"):
        summary, rows, err = run(capsys, "--model", str(world["reward"]), "--data", str(data), "--batch-size",
                                 batch_size, "--output", str(tmp_path / f"b{batch_size}.jsonl"))
        assert (summary["pairs"], summary["unscored"], summary["unscored_rows"]) == (2, 1, [1])
        assert rows[1] == {"row": 1, "chosen": None, "rejected": None, "margin": None,
                           "unscored": "the rejected side learns no token"}
        assert rows[0]["chosen"] == pytest.approx(at_last_token, abs=1e-5)
        assert rows[0]["rejected"] == pytest.approx(own_score(model, [5, 9, 9, 8]), abs=1e-5)
        assert rows[2]["chosen"] == pytest.approx(own_score(model, [5, 10, 11]), abs=1e-5)
        assert "1 sides end in the pad token" in err and "rows 0" in err
        assert "1 pairs not scored (the rejected side learns no token): rows 1" in err.strip().splitlines()[-1]


def test_a_peft_adapter_folder_scores_as_its_merged_model(world, capsys, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(7)
    base = AutoModelForSequenceClassification.from_pretrained(world["causal"], num_labels=1)
    adapted = get_peft_model(base, LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8,
                                              target_modules=["q_proj", "v_proj"], modules_to_save=["score"]))
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                parameter.normal_(0, 0.2)  # a trained adapter, not the identity it starts as
    tokenizer = AutoTokenizer.from_pretrained(world["causal"])
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    adapted.save_pretrained(adapter)
    tokenizer.save_pretrained(adapter)
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(world["causal"])
    adapted.merge_and_unload().save_pretrained(merged)
    tokenizer.save_pretrained(merged)

    common = ["--data", str(world["tokenized"]), "--batch-size", "4"]
    _, from_adapter, _ = run(capsys, "--model", str(adapter), *common, "--output", str(tmp_path / "a.jsonl"))
    _, from_merged, _ = run(capsys, "--model", str(merged), *common, "--output", str(tmp_path / "m.jsonl"))
    _, from_reward, _ = run(capsys, "--model", str(world["reward"]), *common, "--output", str(tmp_path / "r.jsonl"))
    for a, m, r in zip(from_adapter, from_merged, from_reward):
        assert a["chosen"] == pytest.approx(m["chosen"], abs=1e-5)
        assert a["rejected"] == pytest.approx(m["rejected"], abs=1e-5)
        assert abs(a["chosen"] - r["chosen"]) > 1e-4  # the adapter's own scores, not another model's


def refusal(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        tool.main(list(args))
    message = str(exit_.value.code)
    assert exit_.value.code not in (0, None)
    assert message.startswith("score_pairs.py: error: ") and "\n" not in message, message
    return message


def test_refusals_are_one_line(world, capsys, tmp_path):
    # A causal LM: one line, the command's own (SystemExit's message is all Python prints of it: no traceback).
    assert refusal(capsys, "--model", str(world["causal"]), "--data", str(world["tokenized"])) == (
        f"score_pairs.py: error: {world['causal']} is a causal LM (Qwen2ForCausalLM), not a reward model: train one "
        "with --objective reward")

    two_labels = tmp_path / "two_labels"
    two_labels.mkdir()
    config = json.loads((world["reward"] / "config.json").read_text())
    config["id2label"] = {"0": "LABEL_0", "1": "LABEL_1"}
    (two_labels / "config.json").write_text(json.dumps(config))
    assert "with 2 labels, not a reward model" in refusal(capsys, "--model", str(two_labels), "--data",
                                                          str(world["tokenized"]))

    sft = tmp_path / "chat.jsonl"
    sft.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                            {"role": "assistant", "content": "Hello!"}]}) + "\n")
    common = ["--model", str(world["reward"]), "--tokenized-data-dir", str(tmp_path / "cache")]
    assert "holds SFT rows" in refusal(capsys, *common, "--data", str(sft))
    sft_tokenized = tmp_path / "chat_tkns"
    process_data(ProcessDataConfig(input_file=str(sft), model_name_or_path=str(world["reward"]),
                                   output_dir=str(sft_tokenized), num_proc=1, num_printed_samples=0))
    assert "holds SFT rows (input_ids and labels)" in refusal(capsys, *common, "--data", str(sft_tokenized))
    unpaired = tmp_path / "feedback.jsonl"
    unpaired.write_text(json.dumps({"prompt": "Hi", "completion": "Hello!", "label": True}) + "\n")
    assert "holds unpaired feedback rows" in refusal(capsys, *common, "--data", str(unpaired))

    no_pad = tmp_path / "no_pad"
    shutil.copytree(world["reward"], no_pad)
    config = json.loads((no_pad / "config.json").read_text())
    config["pad_token_id"] = None
    (no_pad / "config.json").write_text(json.dumps(config))
    assert "has no pad_token_id" in refusal(capsys, "--model", str(no_pad), "--data", str(world["tokenized"]),
                                            "--batch-size", "2")
    assert "no such folder" in refusal(capsys, "--model", str(tmp_path / "nowhere"), "--data", str(sft))


def test_help_says_each_default_once_in_at_most_two_lines():
    """tests/test_cli_help.py's rules for the entry points' configs, for this one's."""
    parser = build_arg_parser(tool.ScorePairsConfig)
    formatter = parser._get_formatter()
    helps = {action.option_strings[0]: formatter._expand_help(action) for action in parser._actions
             if action.dest != "help"}
    for flag, text in helps.items():
        assert text.count("default") <= 1, f"{flag}: {text}"
        assert len(textwrap.wrap(text, 100 - 24 - 2)) <= 2, f"{flag} takes more than two lines: {text}"
        assert "_" not in flag
    assert helps["--batch-size"].endswith("(default: 1)") and helps["--model"].endswith("(required)")
