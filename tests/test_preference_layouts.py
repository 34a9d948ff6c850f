"""The preference datasets users download, each read as it comes with no flag: every layout's rows are written
here from its dataset card's schema, in the file kind the dataset ships (parquet, jsonl.gz), and each pair's
tokens must equal those of the same pair written as TRL's explicit prompt/chosen/rejected form.

    .venv/bin/python -m pytest -q tests/test_preference_layouts.py
"""

from __future__ import annotations

import gzip
import json
import logging
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from minitrainer.common.log import logger
from minitrainer.data.process_data import ProcessDataConfig, process_data
from tests.test_process_data import read_jsonl, write_jsonl


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


QUESTIONS = [("Capital of France?", "Paris.", "Lyon, I think."), ("2+2?", "4", "5"), ("Name a colour.", "Red.", "")]
SYSTEM = "You are an AI assistant. Answer briefly."


def run(tmp_path: Path, model: Path, input_file: Path, *, name: str, **overrides) -> tuple[list, list, dict]:
    out = tmp_path / f"out-{name}"
    overrides = {"num_proc": 1, "num_printed_samples": 0, **overrides}
    summary = process_data(ProcessDataConfig(input_file=str(input_file), model_name_or_path=str(model),
                                             output_dir=str(out), overwrite=True, **overrides))
    return read_jsonl(out / "data.jsonl"), read_jsonl(out / "rejected.jsonl"), summary


def explicit(tmp_path: Path, model: Path, rows: list[dict], *, name: str = "explicit") -> list[dict]:
    """The tokenized pairs of ``rows`` written as TRL's explicit prompt/chosen/rejected (JSON lines)."""
    data, rejected, summary = run(tmp_path, model, write_jsonl(tmp_path / f"{name}.jsonl", rows), name=name)
    assert not rejected and summary["rows_by_format"] == {"preference": len(rows)}
    return data


def parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def chatml(tiny_models) -> Path:
    return tiny_models["chatml"]


# ----------------------------------------------------------------------------
# HuggingFaceH4/ultrafeedback_binarized: prompt, prompt_id, chosen and rejected ([user, assistant]), messages (the
# chosen conversation), score_chosen, score_rejected; parquet splits train_prefs, test_prefs, train_sft, test_sft,
# train_gen, test_gen, all with these columns.

UF_SPLITS = ("train_prefs", "test_prefs", "train_sft", "test_sft", "train_gen", "test_gen")


def ultrafeedback_rows(split: str) -> list[dict]:
    return [{"prompt": f"{question} ({split})", "prompt_id": f"{index:064x}",
             "chosen": [user(f"{question} ({split})"), assistant(good)],
             "rejected": [user(f"{question} ({split})"), assistant(bad or "I do not know.")],
             "messages": [user(f"{question} ({split})"), assistant(good)], "score_chosen": 8.5, "score_rejected": 3.0}
            for index, (question, good, bad) in enumerate(QUESTIONS)]


def as_explicit(rows: list[dict], *, num_prompt: int = 1) -> list[dict]:
    return [{"prompt": row["chosen"][:num_prompt], "chosen": row["chosen"][num_prompt:],
             "rejected": row["rejected"][num_prompt:]} for row in rows]


@pytest.fixture
def ultrafeedback(tmp_path) -> Path:
    """The repository as ``huggingface-cli download --repo-type dataset`` leaves it."""
    for split in UF_SPLITS:
        parquet(tmp_path / "ultrafeedback_binarized" / "data" / f"{split}-00000-of-00001.parquet",
                ultrafeedback_rows(split))
    return tmp_path / "ultrafeedback_binarized"


@pytest.mark.parametrize("split", ["train_prefs", "train_sft", "test_gen"])
def test_ultrafeedback_binarized_reads_as_pairs_with_no_flag(tmp_path, chatml, ultrafeedback, split):
    """Every split is pairs ('chosen' and 'rejected' make a pair whatever else the row carries: its 'messages' is
    not read), its prompt the sides' shared user turn, as TRL's maybe_extract_prompt reads a prompt string beside
    conversational sides; the unread columns are named."""
    data, rejected, summary = run(tmp_path, chatml, ultrafeedback, name=split, split=split)
    assert summary["kind"] == "preference" and summary["num_pairs"] == 3 and not rejected
    assert summary["rows_by_format"] == {"preference_implicit": 3}
    assert summary["columns_not_read"] == {"messages": 3, "prompt_id": 3, "score_chosen": 3, "score_rejected": 3}
    assert data == explicit(tmp_path, chatml, as_explicit(ultrafeedback_rows(split)))


def test_ultrafeedback_binarized_forced_formats(tmp_path, chatml, ultrafeedback):
    """--input-format preference_implicit reads the sides, never the 'messages' beside them (which made every pair
    identical_sides); --input-format messages reads the chosen conversation as SFT."""
    expected = explicit(tmp_path, chatml, as_explicit(ultrafeedback_rows("train_prefs")))
    for fmt in ("preference", "preference_implicit"):
        data, rejected, _ = run(tmp_path, chatml, ultrafeedback, name=fmt, split="train_prefs", input_format=fmt)
        assert data == expected and not rejected
    data, _, summary = run(tmp_path, chatml, ultrafeedback, name="sft", split="train_sft", input_format="messages")
    assert summary["kind"] == "sft" and summary["num_chat"] == 3
    assert [row["messages"] for row in ultrafeedback_rows("train_sft")] == [row["chosen"] for row in data]


# ----------------------------------------------------------------------------
# The other conversational layouts, each in the parquet files its repository ships.

def tulu_rows() -> list[dict]:
    """allenai/llama-3.1-tulu-3-8b-preference-mixture: id, source, prompt (a string), chosen / rejected (with the
    user turn), chosen_rating, rejected_rating, chosen_model, rejected_model."""
    return [{"id": f"tulu-{index}", "source": "ultrafeedback", "prompt": question,
             "chosen": [user(question), assistant(good)], "rejected": [user(question), assistant(bad or "Blue.")],
             "chosen_rating": 5.0, "rejected_rating": 2.0, "chosen_model": "gpt-4", "rejected_model": "llama-7b"}
            for index, (question, good, bad) in enumerate(QUESTIONS)]


def trl_implicit_rows() -> list[dict]:
    """trl-lib/ultrafeedback_binarized: chosen / rejected conversations, score_chosen, score_rejected."""
    return [{"chosen": [user(question), assistant(good)], "rejected": [user(question), assistant(bad or "Blue.")],
             "score_chosen": 9.0, "score_rejected": 4.0} for question, good, bad in QUESTIONS]


def trl_explicit_rows() -> list[dict]:
    """TRL's explicit conversational form (trl-lib's prompt/chosen/rejected datasets)."""
    return as_explicit(trl_implicit_rows())


def capybara_rows() -> list[dict]:
    """argilla/distilabel-capybara-dpo-7k-binarized: source, instruction, multi-turn chosen / rejected differing in
    their last reply, chosen_rating, rejected_rating, chosen_model, rejected_model."""
    history = [user("Hi, can you help with geography?"), assistant("Of course.")]
    return [{"source": "Know-Logic", "instruction": "Hi, can you help with geography?",
             "chosen": [*history, user(question), assistant(good)],
             "rejected": [*history, user(question), assistant(bad or "Blue.")],
             "chosen_rating": 5, "rejected_rating": 1, "chosen_model": "gpt-4-1106-preview",
             "rejected_model": "argilla/notus-7b-v1"} for question, good, bad in QUESTIONS]


def dpo_mix_rows() -> list[dict]:
    """argilla/dpo-mix-7k: dataset, chosen / rejected conversations (a system message among the shared turns),
    chosen_rating, rejected_rating."""
    return [{"dataset": "argilla/distilabel-intel-orca-dpo-pairs",
             "chosen": [{"role": "system", "content": SYSTEM}, user(question), assistant(good)],
             "rejected": [{"role": "system", "content": SYSTEM}, user(question), assistant(bad or "Blue.")],
             "chosen_rating": 9.0, "rejected_rating": 6.0} for question, good, bad in QUESTIONS]


CONVERSATIONAL = {  # layout: (its rows, the shared leading messages, the columns not read, the format found)
    "tulu3_mixture": (tulu_rows, 1, ["chosen_model", "chosen_rating", "id", "rejected_model", "rejected_rating",
                                     "source"], "preference_implicit"),
    "trl_lib_implicit": (trl_implicit_rows, 1, ["score_chosen", "score_rejected"], "preference_implicit"),
    "trl_lib_explicit": (trl_explicit_rows, 0, [], "preference"),
    "argilla_capybara": (capybara_rows, 3, ["chosen_model", "chosen_rating", "instruction", "rejected_model",
                                            "rejected_rating", "source"], "preference_implicit"),
    "argilla_dpo_mix": (dpo_mix_rows, 2, ["chosen_rating", "dataset", "rejected_rating"], "preference_implicit"),
}


@pytest.mark.parametrize("layout", sorted(CONVERSATIONAL))
def test_conversational_layouts_read_as_they_come(tmp_path, tiny_models, layout):
    make_rows, num_prompt, not_read, fmt = CONVERSATIONAL[layout]
    rows = make_rows()
    model = tiny_models["llama3"]
    input_file = parquet(tmp_path / layout / "data" / "train-00000-of-00001.parquet", rows)
    data, rejected, summary = run(tmp_path, model, input_file, name=layout)
    assert summary["kind"] == "preference" and summary["num_pairs"] == len(rows) and not rejected
    assert summary["rows_by_format"] == {fmt: len(rows)}
    assert summary["columns_not_read"] == dict.fromkeys(not_read, len(rows))
    assert data == explicit(tmp_path, model, rows if num_prompt == 0 else as_explicit(rows, num_prompt=num_prompt))


def test_a_prompt_string_beside_replies_alone_is_the_user_turn(tmp_path, chatml):
    """Sides that share no message: the prompt string is then the user's turn, not redundant."""
    rows = [{"prompt": question, "chosen": [assistant(good)], "rejected": [assistant(bad or "Blue.")]}
            for question, good, bad in QUESTIONS]
    data, rejected, summary = run(tmp_path, chatml, parquet(tmp_path / "replies.parquet", rows), name="replies")
    assert not rejected and summary["rows_by_format"] == {"preference": 3} and not summary["columns_not_read"]
    assert data == explicit(tmp_path, chatml, [{**row, "prompt": [user(row["prompt"])]} for row in rows])


# ----------------------------------------------------------------------------
# Intel/orca_dpo_pairs: system, question, chosen, rejected, all strings (one parquet file).

def orca_rows() -> list[dict]:
    return [{"system": SYSTEM if index else "", "question": question, "chosen": good, "rejected": bad or "Blue."}
            for index, (question, good, bad) in enumerate(QUESTIONS)]


def orca_explicit() -> list[dict]:
    """The same pairs as explicit conversational messages: the system message (none where it is empty), the
    question as the user's turn, each reply the assistant's."""
    return [{"prompt": ([{"role": "system", "content": row["system"]}] if row["system"] else [])
             + [user(row["question"])], "chosen": [assistant(row["chosen"])],
             "rejected": [assistant(row["rejected"])]} for row in orca_rows()]


@pytest.mark.parametrize("template", ["chatml", "llama3"])
def test_orca_dpo_pairs_question_is_a_user_turn_through_the_template(tmp_path, tiny_models, template):
    """Detected (the sides share no whole turn; 'question' stands beside them) or named by --columns
    prompt=question: a user turn after the row's system message, the tokens of the explicit conversational pair."""
    model = tiny_models[template]
    input_file = parquet(tmp_path / "orca" / "data" / "train-00000-of-00001.parquet", orca_rows())
    expected = explicit(tmp_path, model, orca_explicit())
    for name, columns in (("detected", None), ("named", "prompt=question")):
        data, rejected, summary = run(tmp_path, model, input_file, name=name, columns=columns)
        assert data == expected and not rejected, name
        assert summary["rows_by_format"] == {"preference": 3} and summary["num_chat"] == 3
        assert not summary["columns_not_read"] and summary["num_prompt_completion"] == 0


# ----------------------------------------------------------------------------
# Anthropic/hh-rlhf: chosen, rejected, whole conversations as strings ("\n\nHuman: ...\n\nAssistant: ..."), in
# jsonl.gz files by subset (helpful-base/train.jsonl.gz, harmless-base/test.jsonl.gz, ...).

HH_ROWS = [
    {"chosen": "\n\nHuman: Capital of France?\n\nAssistant: Paris.",
     "rejected": "\n\nHuman: Capital of France?\n\nAssistant: Lyon, I think."},
    {"chosen": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Name a colour.\n\nAssistant: Red, I would say.",
     "rejected": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Name a colour.\n\nAssistant: Rather not."},
    # The replies share their first words: the prompt still ends at the header, never inside the reply.
    {"chosen": "\n\nHuman: 2+2?\n\nAssistant: It is 4.", "rejected": "\n\nHuman: 2+2?\n\nAssistant: It is 5."},
]


def test_hh_rlhf_whole_strings_split_at_the_last_assistant_turn(tmp_path, chatml):
    folder = tmp_path / "hh-rlhf"
    for subset, split in (("helpful-base", "train"), ("harmless-base", "train"), ("helpful-base", "test")):
        (folder / subset).mkdir(parents=True, exist_ok=True)
        with gzip.open(folder / subset / f"{split}.jsonl.gz", "wt") as f:
            f.writelines(json.dumps(row) + "\n" for row in (HH_ROWS if split == "train" else HH_ROWS[:1]))
    data, rejected, summary = run(tmp_path, chatml, folder, name="hh")
    assert summary["kind"] == "preference" and summary["num_pairs"] == 6 and not rejected
    assert summary["rows_by_format"] == {"preference_implicit": 6} and summary["num_prompt_completion"] == 6
    split = []
    for row in HH_ROWS:
        end = row["chosen"].rindex("\n\nAssistant:") + len("\n\nAssistant:")
        split.append({"prompt": row["chosen"][:end], "chosen": row["chosen"][end:], "rejected": row["rejected"][end:]})
    assert split[2]["chosen"] == " It is 4."
    assert data == explicit(tmp_path, chatml, split) * 2


def test_plain_sides_without_a_whole_turn_or_a_question_are_refused_by_reason(tmp_path, chatml):
    """A pair of plain replies with no prompt anywhere is counted (no_shared_prompt), never split after a few
    shared characters; a file of nothing else is refused in one line naming the flag."""
    rows = [*HH_ROWS[:1], {"id": 1, "chosen": "The capital is Paris.", "rejected": "The capital is Lyon."}]
    data, rejected, summary = run(tmp_path, chatml, write_jsonl(tmp_path / "mixed.jsonl", rows), name="mixed")
    assert len(data) == 1 and summary["rejected_by_reason"] == {"no_shared_prompt": 1}
    assert "--columns prompt=question" in rejected[0]["detail"]
    with pytest.raises(ValueError, match="no_shared_prompt: .*--columns prompt=question") as err:
        run(tmp_path, chatml, write_jsonl(tmp_path / "none.jsonl", rows[1:] * 3), name="none")
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------
# The log of a pair file speaks of pairs


def test_the_log_of_a_pair_file_speaks_of_pairs(tmp_path, chatml, ultrafeedback, caplog):
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            _, _, summary = run(tmp_path, chatml, ultrafeedback, name="log", split="train_prefs",
                                num_printed_samples=1)
    finally:
        logger.removeHandler(caplog.handler)
    text = "\n".join(caplog.messages)
    assert "'chosen' and 'rejected', which make a row a pair" in text and "its 'messages' column is not read" in text
    assert "--input-format messages reads the file as SFT rows" in text
    assert "wrote 3 preference pairs (3 conversational, 0 plain strings;" in text and "wrote 3 samples" not in text
    assert "not read: messages, prompt_id, score_chosen, score_rejected" in text
    assert text.count("not read: messages") == 1
    assert "6 of 6 replies (both sides of 3 pairs) end with a learned end-of-turn" in text
    assert "0 of 3 pairs could not be masked" in text and "conversations" not in text
    assert re.search(r"^pair \d chosen labels:$", text, re.M) and not re.search(r"^sample \d", text, re.M)
    assert summary["audit"]["unit"] == "pairs"
