"""Tests for unpaired feedback rows (TRL's unpaired preference format, KTO's data) through process_data.py:
each row tokenized exactly as its prompt/completion SFT row without the label, plus ``desirable``; the same
rows from JSON lines and from tables; every bad-row reason counted; the summary's counts.

    .venv/bin/python -m pytest -q tests/test_unpaired_data.py
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from minitrainer.common.log import logger
from minitrainer.data.process_data import ProcessDataConfig, process_data
from minitrainer.tools.tiny_model import build_tiny_model
from tests.test_preference_data import write_rows
from tests.test_process_data import read_jsonl

SKY = [{"role": "user", "content": "What colour is the sky?"}]
SHAPES = {
    "conversational": [
        {"prompt": SKY, "completion": [{"role": "assistant", "content": "Blue, on a clear day."}], "label": True,
         "id": "a"},
        {"prompt": SKY, "completion": [{"role": "assistant", "content": "Green."}], "label": False, "id": "b"},
        {"prompt": [{"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "4"}],
         "label": True, "id": "c"},
    ],
    "plain": [
        {"prompt": "The sky is", "completion": " blue.", "label": True, "id": "a"},
        {"prompt": "The sky is", "completion": " green.", "label": False, "id": "b"},
        {"prompt": "2+2 =", "completion": " 5", "label": False, "id": "c"},
    ],
}
GOOD, UNDESIRABLE = SHAPES["plain"][0], SHAPES["plain"][1]
CONVERSATIONAL = SHAPES["conversational"][0]
KTO = "KTO's label is true (desirable) or false (undesirable)"
BAD_ROWS = [  # each after a good first row, which makes the file an unpaired one
    ({"prompt": "The sky is", "completion": " grey."}, "missing_label", "no 'label'"),
    ({**GOOD, "label": 1}, "label_not_bool", "'label' is 1 (a number), not a bool: " + KTO),
    ({**GOOD, "label": "true"}, "label_not_bool", "'label' is \"true\" (a string), not a bool: " + KTO),
    ({**GOOD, "label": None}, "label_not_bool", "'label' is null, not a bool: " + KTO),
    ({**GOOD, "completion": ""}, "empty_completion", "the completion is empty"),
    ({**CONVERSATIONAL, "completion": []}, "empty_completion", "the completion is empty"),
    ({**CONVERSATIONAL, "completion": [{"role": "assistant", "content": " "}]}, "empty_completion",
     "the completion's assistant content is empty"),
    ({"messages": [*SKY, {"role": "assistant", "content": "Blue."}], "label": True}, "not_unpaired",
     "a messages row"),
]


@pytest.fixture(scope="module")
def chatml(tmp_path_factory) -> Path:
    """One real tokenizer (a trained BPE with ChatML's template) for the whole file."""
    return build_tiny_model("chatml", tmp_path_factory.mktemp("unpaired") / "chatml", with_model=False)


def tokenize(tmp_path: Path, model: Path, rows: list, *, name: str = "in", suffix: str = "jsonl",
             **overrides) -> tuple[list[dict], list[dict], dict]:
    input_file = write_rows(tmp_path / f"{name}.{suffix}", rows)
    out = tmp_path / f"out-{name}-{suffix}"
    summary = process_data(ProcessDataConfig(input_file=str(input_file), model_name_or_path=str(model),
                                             output_dir=str(out), num_proc=1, overwrite=True,
                                             num_printed_samples=overrides.pop("num_printed_samples", 0),
                                             **overrides))
    return read_jsonl(out / "data.jsonl"), read_jsonl(out / "rejected.jsonl"), summary


def without_label(rows: list[dict]) -> list[dict]:
    return [{key: value for key, value in row.items() if key != "label"} for row in rows]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_row_is_its_prompt_completion_sft_row_and_its_label(tmp_path, chatml, shape):
    """The tokens, labels, len and learned count of the row without its label, as SFT gives them; 'desirable'
    in the label's place (first of the copied fields), never 'label' beside 'labels'; a parquet and an arrow
    file of the same rows (a bool column) give the same output."""
    rows = SHAPES[shape]
    sft, _, sft_summary = tokenize(tmp_path, chatml, without_label(rows), name="sft")
    data, rejected, summary = tokenize(tmp_path, chatml, rows)
    assert sft_summary["kind"] == "sft" and summary["kind"] == "unpaired" and not rejected
    assert len(data) == len(rows)
    for row, out, expected in zip(rows, data, sft):
        assert list(out) == ["input_ids", "labels", "len", "num_loss_counted_tokens", "desirable", "id"]
        assert out["desirable"] is row["label"]
        assert {key: value for key, value in out.items() if key != "desirable"} == expected
    assert summary["rows_by_format"] == {"prompt_completion": len(rows)}
    for suffix in ("parquet", "arrow"):
        assert tokenize(tmp_path, chatml, rows, suffix=suffix)[0] == data


def test_a_csv_label_is_text_and_says_so(tmp_path, chatml):
    """A CSV holds no bool: every row's label is a string, so no row is learned from, and the run says why
    before tokenizing."""
    with pytest.raises(ValueError) as err:
        tokenize(tmp_path, chatml, SHAPES["plain"], suffix="csv")
    message = str(err.value)
    assert message.startswith("no unpaired feedback row that converts in the first 3 rows of ")
    assert "in.csv row 1: label_not_bool: 'label' is \"true\" (a string)" in message
    assert "as every CSV column does" in message and "\n" not in message


def test_each_bad_row_is_counted_by_reason_with_its_line(tmp_path, chatml):
    rows = [GOOD, *(row for row, _, _ in BAD_ROWS), UNDESIRABLE]
    data, rejected, summary = tokenize(tmp_path, chatml, rows)
    assert [(r["line"], r["reason"]) for r in rejected] == [(i + 2, reason) for i, (_, reason, _) in
                                                            enumerate(BAD_ROWS)]
    for record, (_, _, detail) in zip(rejected, BAD_ROWS):
        assert detail in record["detail"]
    assert [row["desirable"] for row in data] == [True, False]
    reasons = {"missing_label": 1, "label_not_bool": 3, "empty_completion": 3, "not_unpaired": 1}
    assert summary["rejected_by_reason"] == summary["input_errors"]["by_reason"] == reasons
    assert summary["num_written"] == 2 and summary["num_rejected"] == len(BAD_ROWS)
    with pytest.raises(ValueError) as err:
        tokenize(tmp_path, chatml, rows, name="strict", strict=True)
    assert str(err.value).startswith(f"{tmp_path / 'strict.jsonl'}:2: missing_label: no 'label' in a file of "
                                     "unpaired feedback rows")


def test_the_summary_counts_the_rows_by_label(tmp_path, chatml, caplog):
    rows = [*SHAPES["plain"], *SHAPES["conversational"], UNDESIRABLE]
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            data, _, summary = tokenize(tmp_path, chatml, rows, num_printed_samples=len(rows))
    finally:
        logger.removeHandler(caplog.handler)
    assert summary["kind"] == "unpaired" and summary["num_written"] == len(rows)
    assert (summary["num_desirable"], summary["num_undesirable"]) == (3, 4)
    assert (summary["num_chat"], summary["num_prompt_completion"], summary["num_pairs"]) == (3, 4, 0)
    assert summary["num_loss_counted_tokens"] == sum(row["num_loss_counted_tokens"] for row in data)
    assert any(message.startswith("an unpaired feedback file (KTO's data): its first convertible row (")
               for message in caplog.messages)
    assert any(message.startswith("wrote 7 unpaired feedback rows (3 desirable, 4 undesirable;")
               for message in caplog.messages)
    assert sum(message.startswith("sample ") and " (undesirable) labels:" in message
               for message in caplog.messages) == 4
    # A file whose first row has no label is an SFT file, as before: a labelled row there is an SFT row.
    sft, rejected, summary = tokenize(tmp_path, chatml, [*without_label(SHAPES["plain"][:1]), GOOD, UNDESIRABLE],
                                      name="sft")
    assert summary["kind"] == "sft" and (summary["num_desirable"], summary["num_undesirable"]) == (0, 0)
    assert sft[1]["label"] is True and [r["reason"] for r in rejected] == ["undesirable_completion"]
    # So is a file read with a format given.
    _, rejected, summary = tokenize(tmp_path, chatml, [GOOD, UNDESIRABLE], name="forced",
                                    input_format="prompt_completion")
    assert summary["kind"] == "sft" and [r["reason"] for r in rejected] == ["undesirable_completion"]
