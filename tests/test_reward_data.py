"""Tests for reward-model pairs (a preference pair with TRL's RewardTrainer ``margin``) through process_data.py
and the loader: the margin kept exactly from JSON lines, parquet, arrow and CSV, into ``PreferenceDataset.margins``
and a ``RowSubset``; a file without margins unchanged; the pair's tokens the same with and without its margin;
every bad margin counted with its line, ``--strict`` stopping at the first; the summary's ``has_margin``.

    .venv/bin/python -m pytest -q tests/test_reward_data.py
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from minitrainer.data.chat_masking import PAIR_OUTPUT_FIELDS
from minitrainer.data.held_out import RowSubset
from minitrainer.data.sampler import load_tokenized_dataset
from minitrainer.data.process_data import ProcessDataConfig, process_data
from minitrainer.tools.tiny_model import build_tiny_model
from tests.test_preference_data import write_rows
from tests.test_process_data import read_jsonl



def conversation(question: str, good: str, bad: str) -> dict:
    return {"prompt": [{"role": "user", "content": question}], "chosen": [{"role": "assistant", "content": good}],
            "rejected": [{"role": "assistant", "content": bad}]}


# A table's column holds one type: each shape is a file of its own (both TRL's explicit forms).
SHAPES = {
    "conversational": [conversation("Capital of France?", "Paris.", "Lyon, I think."),
                       conversation("Hi", "Hello.", "Go."), conversation("2+2?", "4", "5"),
                       conversation("Sky?", "Blue.", "Green.")],
    "plain": [{"prompt": "2+2 =", "chosen": " 4", "rejected": " 5"},
              {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
              {"prompt": "Paris is in", "chosen": " France.", "rejected": " Spain."},
              {"prompt": "Ice is", "chosen": " cold.", "rejected": " hot."}],
}
# Values a rounding decimal text would change: a third, the smallest subnormal, an integer, a negative zero.
MARGINS = [1 / 3, 5e-324, 2, -0.0]
# Mixed shapes for the JSON lines tests, hh-rlhf's implicit pair among them.
PAIRS = [SHAPES["conversational"][0], SHAPES["plain"][0], SHAPES["conversational"][1],
         {"chosen": "\n\nHuman: Sky?\n\nAssistant: Blue.", "rejected": "\n\nHuman: Sky?\n\nAssistant: Green."}]
WITH_MARGINS = [{**row, "margin": margin} for row, margin in zip(PAIRS, MARGINS)]
FINITE = "not a finite number"
BAD_MARGINS = [  # each after a good first pair with a margin, which makes the file one of pairs with margins
    ({**PAIRS[1]}, "missing_margin", "'margin' is missing in a file of pairs with margins"),
    ({**PAIRS[1], "margin": None}, "missing_margin", "'margin' is null"),
    ({**PAIRS[1], "margin": True}, "invalid_margin", f"'margin' is true (a bool), {FINITE}"),
    ({**PAIRS[1], "margin": "1.5"}, "invalid_margin", f"'margin' is \"1.5\" (a string), {FINITE}"),
    ({**PAIRS[1], "margin": [1.0]}, "invalid_margin", f"'margin' is [1.0] (a list), {FINITE}"),
    ({**PAIRS[1], "margin": math.inf}, "invalid_margin", f"'margin' is Infinity (not finite), {FINITE}"),
    ({**PAIRS[1], "margin": math.nan}, "invalid_margin", f"'margin' is NaN (not finite), {FINITE}"),
    ({**PAIRS[1], "margin": 10 ** 400}, "invalid_margin", f"(a number), {FINITE}"),
]


@pytest.fixture(scope="module")
def chatml(tmp_path_factory) -> Path:
    """One real tokenizer (a trained BPE with ChatML's template) for the whole file."""
    return build_tiny_model("chatml", tmp_path_factory.mktemp("reward") / "chatml", with_model=False)


def tokenize(tmp_path: Path, model: Path, rows: list, *, name: str = "in", suffix: str = "jsonl",
             **overrides) -> tuple[list[dict], list[dict], dict, Path]:
    """(data rows, rejected rows, summary, output folder) of process_data on ``rows`` as a ``suffix`` file."""
    input_file = write_rows(tmp_path / f"{name}.{suffix}", rows)
    out = tmp_path / f"out-{name}-{suffix}"
    summary = process_data(ProcessDataConfig(input_file=str(input_file), model_name_or_path=str(model),
                                             output_dir=str(out), num_proc=overrides.pop("num_proc", 1),
                                             overwrite=True, num_printed_samples=0, **overrides))
    return read_jsonl(out / "data.jsonl"), read_jsonl(out / "rejected.jsonl"), summary, out


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_margins_kept_exactly_from_every_file_kind_to_the_loader(tmp_path, chatml, shape):
    """The margin is the row's last field, the same float64 as given, from JSON lines and from tables (a CSV
    cell's text read as a number); the loaded pairs hold them as float64, a subset its rows' own."""
    expected = [float(margin) for margin in MARGINS]
    rows = [{**row, "margin": margin} for row, margin in zip(SHAPES[shape], MARGINS)]
    for suffix in ("jsonl", "parquet", "arrow", "csv"):
        data, rejected, summary, out = tokenize(tmp_path, chatml, rows, suffix=suffix)
        assert not rejected and summary["has_margin"] is True
        assert [tuple(row) for row in data] == [PAIR_OUTPUT_FIELDS + ("margin",)] * len(rows)
        got = [row["margin"] for row in data]
        assert got == expected and all(type(value) is float for value in got)
        assert math.copysign(1, got[3]) == -1  # -0.0 stays negative
        assert "margin" not in summary["columns_not_read"]
        pairs = load_tokenized_dataset(str(out), cache_dir=str(tmp_path / "cache"))
        assert pairs.margins.dtype == np.float64 and pairs.margins.tobytes() == np.array(expected).tobytes()
        subset = RowSubset(pairs, np.array([3, 1]))
        assert subset.margins.tobytes() == np.array([expected[3], expected[1]]).tobytes()
        assert subset.side_lengths.tolist() == pairs.side_lengths[[3, 1]].tolist()


def test_a_file_without_margins_is_as_before(tmp_path, chatml):
    """No margin in the first pair: no margin column, ``margins is None`` (subsets too), and a later pair's
    margin listed as not read, as any unread column is."""
    rows = [*PAIRS[:3], {**PAIRS[3], "margin": 1.0}]
    data, rejected, summary, out = tokenize(tmp_path, chatml, rows)
    assert not rejected and summary["has_margin"] is False and summary["num_pairs"] == len(rows)
    assert all(tuple(row) == PAIR_OUTPUT_FIELDS for row in data)
    assert summary["columns_not_read"] == {"margin": 1}
    pairs = load_tokenized_dataset(str(out), cache_dir=str(tmp_path / "cache"))
    assert pairs.margins is None and RowSubset(pairs, np.array([0, 2])).margins is None


def test_the_margin_changes_nothing_else(tmp_path, chatml):
    """The same pairs with and without margins: the same tokens, labels and counts, and the same summary
    apart from ``has_margin``; the content digest of the loaded pairs tells other margins apart."""
    plain, _, plain_summary, plain_out = tokenize(tmp_path, chatml, PAIRS, name="plain")
    scored, _, scored_summary, scored_out = tokenize(tmp_path, chatml, WITH_MARGINS, name="scored")
    assert [{key: value for key, value in row.items() if key != "margin"} for row in scored] == plain
    changed = [{**row, "margin": 7.0} if index == 2 else row for index, row in enumerate(WITH_MARGINS)]
    _, _, _, changed_out = tokenize(tmp_path, chatml, changed, name="changed")
    for key in ("num_written", "num_tokens", "num_loss_counted_tokens", "len", "rows_by_format", "audit"):
        assert scored_summary[key] == plain_summary[key], key
    cache = str(tmp_path / "cache")
    digests = [load_tokenized_dataset(str(out), cache_dir=cache).content_digest()
               for out in (plain_out, scored_out, changed_out, scored_out)]
    assert len(set(digests[:3])) == 3 and digests[3] == digests[1]


def test_each_bad_margin_is_counted_with_its_line_and_strict_stops(tmp_path, chatml):
    rows = [WITH_MARGINS[0], *(row for row, _, _ in BAD_MARGINS), WITH_MARGINS[2]]
    data, rejected, summary, _ = tokenize(tmp_path, chatml, rows)
    assert [(r["line"], r["reason"]) for r in rejected] == [(i + 2, reason) for i, (_, reason, _) in
                                                            enumerate(BAD_MARGINS)]
    for record, (_, _, detail) in zip(rejected, BAD_MARGINS):
        assert detail in record["detail"], record
    assert [row["margin"] for row in data] == [MARGINS[0], MARGINS[2]]
    reasons = {"missing_margin": 2, "invalid_margin": 6}
    assert summary["rejected_by_reason"] == summary["input_errors"]["by_reason"] == reasons
    assert summary["has_margin"] is True and summary["num_pairs"] == 2
    # Worker processes read the margins as the main process does, chunk by chunk.
    assert tokenize(tmp_path, chatml, rows, name="workers", num_proc=2, chunk_size=3)[:2] == (data, rejected)
    with pytest.raises(ValueError) as err:
        tokenize(tmp_path, chatml, rows, name="strict", strict=True)
    assert str(err.value).startswith(f"{tmp_path / 'strict.jsonl'}:2: missing_margin: 'margin' is missing in a "
                                     "file of pairs with margins")


def test_a_first_pair_with_a_null_margin_makes_a_file_with_margins(tmp_path, chatml):
    """A key present decides, as a table's column is in every row: its null is refused, not the column unread;
    a CSV's empty cell is a missing margin, its text that is no number an invalid one."""
    rows = [{**PAIRS[0], "margin": None}, *WITH_MARGINS[1:]]
    data, rejected, summary, _ = tokenize(tmp_path, chatml, rows)
    assert summary["has_margin"] is True and [row["margin"] for row in data] == [float(m) for m in MARGINS[1:]]
    assert [(r["line"], r["reason"]) for r in rejected] == [(1, "missing_margin")]
    csv_rows = [WITH_MARGINS[0], {**PAIRS[1], "margin": ""}, {**PAIRS[2], "margin": "lots"}, WITH_MARGINS[3]]
    data, rejected, _, _ = tokenize(tmp_path, chatml, csv_rows, suffix="csv")
    assert [(r["row"], r["reason"]) for r in rejected] == [(2, "missing_margin"), (3, "invalid_margin")]
    assert [row["margin"] for row in data] == [MARGINS[0], MARGINS[3]]


def test_columns_maps_another_column_to_margin(tmp_path, chatml):
    """``--columns margin=score_diff`` reads that column as the margin; errors name it by the input's name."""
    rows = [{**{key: value for key, value in row.items() if key != "margin"}, "score_diff": row["margin"]}
            for row in WITH_MARGINS]
    rows[1]["score_diff"] = "big"
    data, rejected, summary, _ = tokenize(tmp_path, chatml, rows, columns="margin=score_diff")
    assert summary["has_margin"] is True and "score_diff" not in summary["columns_not_read"]
    assert [row["margin"] for row in data] == [MARGINS[0], *map(float, MARGINS[2:])]
    assert [(r["line"], r["reason"]) for r in rejected] == [(2, "invalid_margin")]
    assert rejected[0]["detail"].startswith("'score_diff' is \"big\" (a string)")
