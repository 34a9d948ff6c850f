"""Tests for preference (DPO) pairs through process_data.py: TRL's explicit and implicit preference rows,
conversational and plain strings, in every file kind, ``--columns``, each side learned exactly as SFT
learns its prompt/completion row, the EOS rule, and every bad-pair reason counted.

    .venv/bin/python -m pytest -q tests/test_preference_data.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minitrainer.common.labels import IGNORE_INDEX
from minitrainer.data.chat_masking import PAIR_OUTPUT_FIELDS
from minitrainer.data.formats import detect_format, implicit_prompt, turn_prefix
from minitrainer.data.process_data import ProcessDataConfig, process_data
from tests.test_process_data import read_jsonl, write_jsonl

USER = {"role": "user", "content": "Capital of France?"}
PARIS = {"role": "assistant", "content": "Paris."}
LYON = {"role": "assistant", "content": "Lyon, I think."}
HI = {"role": "user", "content": "Hi"}
SHAPES = {
    "conversational_explicit": [{"prompt": [USER], "chosen": [PARIS], "rejected": [LYON]},
                                {"prompt": [{"role": "user", "content": "2+2?"}],
                                 "chosen": [{"role": "assistant", "content": "4"}],
                                 "rejected": [{"role": "assistant", "content": "5"}]}],
    "conversational_implicit": [{"chosen": [USER, PARIS], "rejected": [USER, LYON]},
                                {"chosen": [HI, {"role": "assistant", "content": "Hello."}],
                                 "rejected": [HI, {"role": "assistant", "content": "Go."}]}],
    "string_explicit": [{"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " Lyon."},
                        {"prompt": "2+2 =", "chosen": " 4", "rejected": " 5"}],
    # Anthropic/hh-rlhf's whole strings: the prompt is the shared whole turns, up to the last "\n\nAssistant:"
    "string_implicit": [{"chosen": "\n\nHuman: Capital of France?\n\nAssistant: Paris.",
                         "rejected": "\n\nHuman: Capital of France?\n\nAssistant: Lyon."},
                        {"chosen": "\n\nHuman: 2+2?\n\nAssistant: 4", "rejected": "\n\nHuman: 2+2?\n\nAssistant: 5"}],
}
STRING_SPLIT = [{"prompt": "\n\nHuman: Capital of France?\n\nAssistant:", "chosen": " Paris.", "rejected": " Lyon."},
                {"prompt": "\n\nHuman: 2+2?\n\nAssistant:", "chosen": " 4", "rejected": " 5"}]
FILE_KINDS = ("jsonl", "json", "parquet", "arrow", "csv")


def tokenize(tmp_path: Path, model: Path, rows: list, *, name: str = "in", suffix: str = "jsonl",
             **overrides) -> tuple[list[dict], list[dict], dict]:
    """Write ``rows`` as a ``suffix`` file, run process_data on it: (data rows, rejected rows, summary)."""
    input_file = write_rows(tmp_path / f"{name}.{suffix}", rows)
    out = tmp_path / f"out-{name}-{suffix}"
    summary = process_data(ProcessDataConfig(input_file=str(input_file), model_name_or_path=str(model),
                                             output_dir=str(out), num_proc=overrides.pop("num_proc", 1),
                                             num_printed_samples=overrides.pop("num_printed_samples", 0),
                                             overwrite=True, **overrides))
    return read_jsonl(out / "data.jsonl"), read_jsonl(out / "rejected.jsonl"), summary


def write_rows(path: Path, rows: list) -> Path:
    """Each file kind the door reads; a table (csv) holds a conversation as its JSON text."""
    suffix = path.suffix[1:]
    if suffix == "jsonl":
        return write_jsonl(path, rows)
    if suffix == "json":
        path.write_text(json.dumps(rows))
        return path
    import pyarrow as pa

    if suffix == "csv":
        import pyarrow.csv as pacsv

        rows = [{key: value if isinstance(value, str) else json.dumps(value) for key, value in row.items()}
                for row in rows]
        pacsv.write_csv(pa.Table.from_pylist(rows), path)
        return path
    table = pa.Table.from_pylist(json.loads(json.dumps(rows, sort_keys=True)))
    if suffix == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, path)
    else:
        with pa.ipc.new_file(path, table.schema) as writer:
            writer.write_table(table)
    return path


def first_learned(labels: list[int]) -> int:
    return next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)


@pytest.fixture(scope="session")
def chatml(tiny_models) -> Path:
    return tiny_models["chatml"]


@pytest.fixture(scope="session")
def eos(chatml) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chatml).eos_token


# ----------------------------------------------------------------------------
# Shapes, file kinds, --columns


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("kind", FILE_KINDS)
def test_pairs_of_every_shape_in_every_file_kind(tmp_path, chatml, shape, kind):
    """Each pair is one row of exactly the pair fields, the same from every file kind; ``len`` and
    ``num_loss_counted_tokens`` are both sides'."""
    rows = SHAPES[shape]
    expected, _, _ = tokenize(tmp_path, chatml, rows, name="reference")
    data, rejected, summary = tokenize(tmp_path, chatml, rows, suffix=kind)
    assert data == expected and not rejected
    assert summary["kind"] == "preference" and summary["num_pairs"] == summary["num_written"] == len(rows)
    assert summary["rows_by_format"] == {"preference" if shape.endswith("explicit") else "preference_implicit": 2}
    for row in data:
        assert tuple(row) == PAIR_OUTPUT_FIELDS
        for side in ("chosen", "rejected"):
            ids, labels = row[f"{side}_input_ids"], row[f"{side}_labels"]
            assert len(ids) == len(labels) and all(label in (IGNORE_INDEX, i) for i, label in zip(ids, labels))
        assert row["len"] == len(row["chosen_input_ids"]) + len(row["rejected_input_ids"])
        assert row["num_loss_counted_tokens"] == sum(
            label != IGNORE_INDEX for side in ("chosen", "rejected") for label in row[f"{side}_labels"])
        # both sides share the prompt, learned from the same index on
        start = first_learned(row["chosen_labels"])
        assert start == first_learned(row["rejected_labels"]) and start > 0
        assert row["chosen_input_ids"][:start] == row["rejected_input_ids"][:start]


def test_implicit_pairs_are_their_explicit_split(tmp_path, chatml):
    """An implicit pair gives what its explicit form gives: TRL's extract_prompt split for conversations, the
    shared whole turns for plain strings (here also TRL's split: the replies differ at their first character)."""
    conversational = [dict(zip(("prompt", "chosen", "rejected"), implicit_prompt(row["chosen"], row["rejected"])))
                      for row in SHAPES["conversational_implicit"]]
    strings = [{"prompt": row["chosen"][:end], "chosen": row["chosen"][end:], "rejected": row["rejected"][end:]}
               for row in SHAPES["string_implicit"] for end in (turn_prefix(row["chosen"], row["rejected"]),)]
    assert strings == STRING_SPLIT == [dict(zip(("prompt", "chosen", "rejected"), implicit_prompt(
        row["chosen"], row["rejected"]))) for row in SHAPES["string_implicit"]]
    for implicit, split in (("conversational_implicit", conversational), ("string_implicit", strings)):
        assert tokenize(tmp_path, chatml, SHAPES[implicit], name="implicit")[0] == \
            tokenize(tmp_path, chatml, split, name="explicit")[0]


@pytest.mark.parametrize("chosen, rejected, prompt", [
    ("\n\nHuman: Hi\n\nAssistant: I think so.", "\n\nHuman: Hi\n\nAssistant: I think not.",
     "\n\nHuman: Hi\n\nAssistant:"),
    ("\n\nHuman: A\n\nAssistant: B\n\nHuman: C\n\nAssistant: D",
     "\n\nHuman: A\n\nAssistant: B\n\nHuman: C\n\nAssistant: E",
     "\n\nHuman: A\n\nAssistant: B\n\nHuman: C\n\nAssistant:"),
    ("### Human: Hi ### Assistant: Yes", "### Human: Hi ### Assistant: No", "### Human: Hi ### Assistant:"),
    ("The capital of France is Paris.", "The capital of France is Lyon.", ""),  # shared characters, no turn
])
def test_a_plain_implicit_prompt_is_whole_turns(chosen, rejected, prompt):
    """Never a few shared characters (TRL's "...Assistant: I think"): up to the last assistant header."""
    assert chosen[:turn_prefix(chosen, rejected)] == prompt


def test_columns_map_other_names(tmp_path, chatml):
    rows = SHAPES["conversational_explicit"]
    renamed = [{"question": row["prompt"], "response_j": row["chosen"], "response_k": row["rejected"]} for row in rows]
    expected, _, _ = tokenize(tmp_path, chatml, rows, name="canonical")
    data, rejected, summary = tokenize(tmp_path, chatml, renamed, name="renamed",
                                       columns="prompt=question,chosen=response_j,rejected=response_k")
    assert data == expected and not rejected and summary["kind"] == "preference"


def test_explicit_shape_wins_over_implicit():
    assert detect_format({"prompt": "p", "chosen": "a", "rejected": "b"}) == "preference"
    assert detect_format({"chosen": "a", "rejected": "b"}) == "preference_implicit"
    # chosen and rejected make a pair whatever else the row carries (UltraFeedback binarized's 'messages')
    assert detect_format({"messages": [], "chosen": "a", "rejected": "b"}) == "preference_implicit"
    assert detect_format({"messages": [], "rejected": "b"}) == "messages"


@pytest.mark.parametrize("chosen, rejected, expected", [
    ("abc", "abd", ("ab", "c", "d")),
    ("a b", "a c", ("a", " b", " c")),  # the space goes back to the sides
    ("abc", "abcd", ("ab", "c", "cd")),  # a prefix: the loop ends without a break, the last shared item stays
    ("x y ", "z", ("x y", " ", "z")),  # a first difference at 0 steps back to -1 (Python's [-1])
    ([USER, PARIS], [USER, LYON], ([USER], [PARIS], [LYON])),
    ([USER, PARIS], [USER, PARIS, USER], ([USER], [PARIS], [PARIS, USER])),
])
def test_implicit_prompt_is_trls_extract_prompt(chosen, rejected, expected):
    assert implicit_prompt(chosen, rejected) == expected


# ----------------------------------------------------------------------------
# Each side is the SFT row of its reply


@pytest.mark.parametrize("template", ["chatml", "llama3", "gemma", "qwen3"])
def test_each_side_is_the_sft_tokenization_of_its_prompt_completion_row(tmp_path, tiny_models, template):
    model = tiny_models[template]
    rows = SHAPES["conversational_explicit"]
    data, _, _ = tokenize(tmp_path, model, rows, name="pairs")
    for side in ("chosen", "rejected"):
        sft, _, summary = tokenize(tmp_path, model, [{"prompt": row["prompt"], "completion": row[side]}
                                                     for row in rows], name=f"sft-{side}")
        assert summary["kind"] == "sft" and summary["num_pairs"] == 0
        assert [(row[f"{side}_input_ids"], row[f"{side}_labels"]) for row in data] == \
            [(row["input_ids"], row["labels"]) for row in sft]


def test_plain_strings_learn_from_a_shared_start_and_get_one_eos(tmp_path, chatml, eos):
    """Plain strings: the SFT row's tokens (EOS appended), both sides learning from the smaller first
    learned index (TRL's prompt_len); a text ending with the EOS gets no second one."""
    rows = SHAPES["string_explicit"]
    data, _, _ = tokenize(tmp_path, chatml, rows, name="pairs")
    for side in ("chosen", "rejected"):
        sft, _, _ = tokenize(tmp_path, chatml, [{"prompt": row["prompt"], "completion": row[side]} for row in rows],
                             name=f"sft-{side}")
        assert [row[f"{side}_input_ids"] for row in data] == [row["input_ids"] for row in sft]
        for pair, single in zip(data, sft):
            start = min(first_learned(single["labels"]), first_learned(pair["rejected_labels" if side == "chosen"
                                                                            else "chosen_labels"]))
            assert first_learned(pair[f"{side}_labels"]) == start
            assert pair[f"{side}_labels"][start:] == single["input_ids"][start:]
    with_eos = [{**row, "chosen": row["chosen"] + eos} for row in rows]
    assert tokenize(tmp_path, chatml, with_eos, name="with-eos")[0] == data
    # implicit pairs too: the EOS is stripped before the prompt is found, as TRL appends it after
    implicit = [{"chosen": row["chosen"] + eos, "rejected": row["rejected"]} for row in SHAPES["string_implicit"]]
    assert tokenize(tmp_path, chatml, implicit, name="implicit-eos")[0] == \
        tokenize(tmp_path, chatml, SHAPES["string_implicit"], name="implicit")[0]


def test_conversational_pairs_are_their_rendering_with_no_eos_appended(tmp_path, chatml):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chatml)
    rows = SHAPES["conversational_explicit"]
    data, _, _ = tokenize(tmp_path, chatml, rows)
    for pair, row in zip(data, rows):
        for side in ("chosen", "rejected"):
            text = tokenizer.apply_chat_template(row["prompt"] + row[side], tokenize=False)
            assert pair[f"{side}_input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------
# Bad pairs: counted and listed with a reason, never fatal


def test_every_bad_pair_reason_is_counted(tmp_path, chatml):
    good = SHAPES["conversational_explicit"][0]
    bad = {
        "identical_sides": {"prompt": [USER], "chosen": [PARIS], "rejected": [PARIS]},
        "empty_side": {"prompt": [USER], "chosen": [PARIS], "rejected": []},
        "prompt_mismatch": {"prompt": [USER], "chosen": [{"role": "user", "content": "More?"}, PARIS],
                            "rejected": [LYON]},
        "no_loss_tokens": {"prompt": [USER], "chosen": [PARIS], "rejected": [{**LYON, "weight": 0}]},
        "not_a_pair": {"messages": [USER, PARIS]},
        # Plain sides that share no whole turn, and no prompt-like column beside them (orca's 'question' is one).
        "no_shared_prompt": {"id": "Capital of France?", "chosen": "Paris.", "rejected": "Lyon."},
    }
    rows = [good, *bad.values(), {"prompt": "p", "chosen": "", "rejected": " x"},
            {"chosen": "\n\nHuman: Hi\n\nAssistant: same", "rejected": "\n\nHuman: Hi\n\nAssistant: same"}]
    data, rejected, summary = tokenize(tmp_path, chatml, rows)
    assert len(data) == 1 and summary["num_pairs"] == 1
    reasons = [row["reason"] for row in rejected]
    assert reasons == [*bad, "empty_side", "identical_sides"]
    assert [row["line"] for row in rejected] == list(range(2, len(rows) + 1))
    assert summary["rejected_by_reason"] == {"empty_side": 2, "identical_sides": 2, "no_loss_tokens": 1,
                                             "not_a_pair": 1, "prompt_mismatch": 1, "no_shared_prompt": 1}
    assert rejected[3]["detail"].startswith("rejected: ")  # the side is named


def test_too_long_counts_both_sides_never_one(tmp_path, chatml):
    rows = SHAPES["conversational_explicit"][:1]
    (row,), _, _ = tokenize(tmp_path, chatml, rows, name="free")
    longest = max(len(row["chosen_input_ids"]), len(row["rejected_input_ids"]))
    data, _, _ = tokenize(tmp_path, chatml, rows, name="exact", max_sample_num_tokens=row["len"])
    assert data == [row]
    for flags in ({}, {"split_long_text": True}):  # --split-long-text does not apply to pairs
        with pytest.raises(ValueError, match="no pair written"):
            tokenize(tmp_path, chatml, rows, name="short", max_sample_num_tokens=longest, **flags)
        rejected = read_jsonl(tmp_path / "out-short-jsonl" / "rejected.jsonl")
        assert [r["reason"] for r in rejected] == ["too_long"] and "a pair counts both sides" in rejected[0]["detail"]


def test_a_file_has_one_kind_decided_by_its_first_convertible_row(tmp_path, chatml):
    sft_row = {"messages": [USER, PARIS]}
    pair = SHAPES["conversational_explicit"][0]
    data, rejected, summary = tokenize(tmp_path, chatml, ["not json", sft_row, pair], name="sft")
    assert summary["kind"] == "sft" and summary["num_pairs"] == 0 and len(data) == 1
    assert [row["reason"] for row in rejected] == ["invalid_json", "preference_row"]
    broken_pair = {"prompt": [USER], "chosen": [], "rejected": [LYON]}  # not convertible: leaves the kind open
    data, rejected, summary = tokenize(tmp_path, chatml, [broken_pair, pair, sft_row], name="pairs")
    assert summary["kind"] == "preference" and summary["num_pairs"] == 1
    assert [row["reason"] for row in rejected] == ["empty_side", "not_a_pair"]


def test_workers_write_the_same_pairs(tmp_path, chatml):
    rows = [row for shape in ("conversational_explicit", "conversational_implicit") for row in SHAPES[shape]] * 3
    one, _, _ = tokenize(tmp_path, chatml, rows, name="one", chunk_size=2)
    two, _, summary = tokenize(tmp_path, chatml, rows, name="two", chunk_size=2, num_proc=2, num_printed_samples=2)
    assert one == two and summary["num_pairs"] == len(rows)


# ----------------------------------------------------------------------------
# TRL's own data preparation (the TRL venv, fixtures/trl_venv.py; about 20 s)

TRL_ROWS = [
    {"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " Lyon."},
    {"prompt": "The capital of France is ", "chosen": "Paris.", "rejected": "Lyon."},  # a token merging across
    {"prompt": "Q: 2+2? A:", "chosen": " 4</s>", "rejected": " 5"},  # </s>: the tokenizer's EOS, already there
    # hh-rlhf's whole strings; the prompt is the whole turn, which is TRL's split when the replies differ at once
    {"chosen": "\n\nHuman: Count.\n\nAssistant: 12345",
     "rejected": "\n\nHuman: Count.\n\nAssistant: Twelve and more"},
    {"prompt": [USER], "chosen": [PARIS], "rejected": [LYON]},
    {"chosen": [USER, PARIS], "rejected": [USER, LYON]},
]
# Run by the TRL venv: DPOTrainer._prepare_dataset on one row at a time (it decides extract_prompt and the EOS by
# the first example), printing its prompt_ids, chosen_ids and rejected_ids as JSON.
TRL_SCRIPT = r"""
import json, sys
from types import SimpleNamespace
import datasets, trl
from transformers import AutoTokenizer
from trl.trainer.dpo_trainer import DPOTrainer

rows, model = json.loads(open(sys.argv[1]).read()), sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(model)
trainer = SimpleNamespace(_tokenizer=tokenizer)  # all _prepare_dataset reads of its trainer
args = SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_start")
out = []
for row in rows:
    prepared = DPOTrainer._prepare_dataset(trainer, datasets.Dataset.from_list([row]), tokenizer, args, "train")[0]
    out.append({key: prepared[key] for key in ("prompt_ids", "chosen_ids", "rejected_ids")})
print(json.dumps({"trl": trl.__version__, "bos_token_id": tokenizer.bos_token_id, "rows": out}))
"""


@pytest.mark.parametrize("template", ["chatml", "llama3"])
def test_pairs_equal_trls_dpo_preparation(tmp_path, tiny_models, template):
    """Plain strings: TRL's sequences and completions exactly (TRL's BOS aside, as in test_trl_boundary.py).
    Conversations: TRL's sequences; the learned part starts at TRL's prompt_len and is TRL's completion up to
    the end-of-turn (TRL also learns the template's text after it, ChatML's newline)."""
    from fixtures.peer_venv import require
    from fixtures.trl_venv import TRL_VERSION, run_in_trl_venv, trl_python

    require(trl_python)
    from transformers import AutoTokenizer

    model = tiny_models[template]
    eos = AutoTokenizer.from_pretrained(model).eos_token
    rows = [{**row, "chosen": row["chosen"].replace("</s>", eos)} if isinstance(row["chosen"], str) else row
            for row in TRL_ROWS]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    result = run_in_trl_venv(TRL_SCRIPT, str(tmp_path / "rows.json"), str(model), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    theirs = json.loads(result.stdout.strip().splitlines()[-1])
    assert theirs["trl"] == TRL_VERSION
    ours = [tokenize(tmp_path, model, [row], name=f"row{i}")[0][0] for i, row in enumerate(rows)]
    for row, pair, trl_row in zip(rows, ours, theirs["rows"], strict=True):
        prompt_ids = trl_row["prompt_ids"]
        if prompt_ids[:1] == [theirs["bos_token_id"]] and pair["chosen_input_ids"][:1] != prompt_ids[:1]:
            prompt_ids = prompt_ids[1:]  # TRL tokenizes plain text with the special tokens; plain strings here take none
        for side in ("chosen", "rejected"):
            ids, labels, completion = pair[f"{side}_input_ids"], pair[f"{side}_labels"], trl_row[f"{side}_ids"]
            assert ids == prompt_ids + completion, (row, side)
            assert first_learned(labels) == len(prompt_ids), (row, side)
            learned = labels[len(prompt_ids):]
            if isinstance(row["chosen"], str):
                assert learned == completion, (row, side)
            else:
                num = sum(label != IGNORE_INDEX for label in learned)
                assert learned[:num] == completion[:num] and all(label == IGNORE_INDEX for label in learned[num:])
