"""Row formats (data/formats.py) through process_data.py: the same conversations written as
``messages`` and as ShareGPT, TRL prompt/completion and text, and alpaca rows give byte-identical
``input_ids`` and ``labels`` under real chat templates; bad rows of each kind are counted, listed
and skipped (exit 0), ``--strict`` stops at the first; a file of no accepted format is refused.

    .venv/bin/python -m pytest -q tests/test_formats.py
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minitrainer.common.labels import IGNORE_INDEX
from minitrainer.common.log import logger
from minitrainer.data.chat_masking import SampleError
from minitrainer.data.formats import parse_columns, read_row, unread_system
from minitrainer.data.process_data import ProcessDataConfig, main, process_data
from tests.test_process_data import read_jsonl, write_jsonl

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "fixtures" / "chat_templates"
# Real templates of released models, each on the tiny tokenizer that holds its special tokens.
REAL = {"qwen2.5": ("tools", TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"),
        "llama-3.1": ("llama3", TEMPLATES / "meta-llama-Llama-3.1-8B-Instruct.jinja")}

# The schemas of the public datasets' cards: ShareGPT as LLaMA-Factory documents it (glaive-style tool rows
# with `tools` as a JSON string), TRL's conversational prompt/completion, tatsu-lab/alpaca without `text`.
TOOL = {"name": "get_weather", "description": "Weather now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
MESSAGES_ROWS = [
    {"id": "a", "messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Capital of France?"},
                             {"role": "assistant", "content": "Paris."}]},
    {"id": "b", "messages": [{"role": "user", "content": "What is two plus two?"},
                             {"role": "assistant", "content": "Four."},
                             {"role": "user", "content": "And three plus three?"},
                             {"role": "assistant", "content": "Six."}]},
]
TOOL_ROW = {"id": "t", "tools": [{"type": "function", "function": TOOL}],
            "messages": [{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": CALL}]},
                         {"role": "tool", "content": "sunny, 21 C"},
                         {"role": "assistant", "content": "It is sunny."}]}
SHAREGPT_ROWS = [
    {"id": "a", "system": "Be brief.", "conversations": [{"from": "human", "value": "Capital of France?"},
                                                          {"from": "gpt", "value": "Paris."}]},
    {"id": "b", "conversations": [{"from": "human", "value": "What is two plus two?"}, {"from": "gpt", "value": "Four."},
                                  {"from": "human", "value": "And three plus three?"}, {"from": "gpt", "value": "Six."}]},
]
SHAREGPT_TOOL_ROW = {"id": "t", "conversations": [{"from": "human", "value": "Weather in Paris?"},
                                                  {"from": "function_call", "value": json.dumps(CALL)},
                                                  {"from": "observation", "value": "sunny, 21 C"},
                                                  {"from": "gpt", "value": "It is sunny."}],
                     "tools": json.dumps([TOOL])}
PROMPT_COMPLETION_ROWS = [
    {"id": "a", "prompt": MESSAGES_ROWS[0]["messages"][:2], "completion": MESSAGES_ROWS[0]["messages"][2:]},
    {"id": "b", "prompt": [{"role": "user", "content": "What is two plus two?"}],
     "completion": [{"role": "assistant", "content": "Four."}]},
]
PROMPT_COMPLETION_MESSAGES = [MESSAGES_ROWS[0], {"id": "b", "messages": PROMPT_COMPLETION_ROWS[1]["prompt"]
                                                 + PROMPT_COMPLETION_ROWS[1]["completion"]}]
ALPACA_ROWS = [
    {"instruction": "Give three tips for staying healthy.", "input": "",
     "output": "1. Eat well.\n2. Move daily.\n3. Sleep enough."},
    {"instruction": "Add the two numbers.", "input": "2 and 3", "output": "5", "system": "Be brief."},
    # LLaMA-Factory's multi-round alpaca: the earlier rounds in `history`.
    {"instruction": "And three plus three?", "input": "", "output": "Six.", "history": [["What is two plus two?", "Four."]]},
]
ALPACA_MESSAGES = [
    {"messages": [{"role": "user", "content": ALPACA_ROWS[0]["instruction"]},
                  {"role": "assistant", "content": ALPACA_ROWS[0]["output"]}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add the two numbers.\n2 and 3"},
                  {"role": "assistant", "content": "5"}]},
    {"messages": MESSAGES_ROWS[1]["messages"]},
]
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Gradient descent minimizes the loss, one step at a time."]


def tokenize(tmp_path: Path, name: str, rows: list, model: Path, **overrides) -> tuple[list[dict], list[dict], dict]:
    input_file = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    out = tmp_path / f"out-{name}"
    summary = process_data(ProcessDataConfig(input_file=str(input_file), model_name_or_path=str(model),
                                             output_dir=str(out), num_proc=1, num_printed_samples=0, **overrides))
    return read_jsonl(out / "data.jsonl"), read_jsonl(out / "rejected.jsonl"), summary


def tokens(rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    return [(row["input_ids"], row["labels"]) for row in rows]


@pytest.fixture(params=sorted(REAL))
def real(request, tiny_models):
    """(tiny model folder, --chat-template of a released model)."""
    tiny, template = REAL[request.param]
    return tiny_models[tiny], str(template)


# ----------------------------------------------------------------------------
# The same conversations in every format: identical tokens


@pytest.mark.parametrize("fmt", ["sharegpt", "prompt_completion", "alpaca", "text"])
def test_format_gives_the_tokens_of_its_messages_rows(tmp_path, real, fmt):
    model, template = real
    rows, messages = {
        "sharegpt": (SHAREGPT_ROWS, MESSAGES_ROWS),
        "prompt_completion": (PROMPT_COMPLETION_ROWS, PROMPT_COMPLETION_MESSAGES),
        "alpaca": (ALPACA_ROWS, ALPACA_MESSAGES),
        "text": ([{"text": text} for text in TEXTS],
                 [{"messages": [{"role": "pretrain", "content": text}]} for text in TEXTS]),
    }[fmt]
    expected, _, _ = tokenize(tmp_path, "messages", messages, model, chat_template=template)
    data, rejected, summary = tokenize(tmp_path, fmt, rows, model, chat_template=template)
    assert not rejected and tokens(data) == tokens(expected)
    assert [{k: v for k, v in row.items() if k not in ("input_ids", "labels")} for row in data] == \
        [{k: v for k, v in row.items() if k not in ("input_ids", "labels")} for row in expected]
    assert summary["rows_by_format"] == {fmt: len(rows)}


def test_sharegpt_and_gemma_role_names_in_messages_are_the_canonical_roles(tmp_path, real):
    """Issue 54: ``messages`` rows naming roles as ShareGPT (human, gpt, observation) or Gemma (model) do are read
    as ShareGPT rows are, not refused; the canonical spelling and the alias give the same tokens and labels."""
    model, template = real
    aliases = {"user": ("human",), "assistant": ("gpt", "model"), "tool": ("observation",)}
    expected_rows, rows = [], []
    for row in [*MESSAGES_ROWS, TOOL_ROW]:
        for k in range(2):  # each alias of a role in turn
            expected_rows.append(row)
            rows.append({**row, "messages": [{**m, "role": aliases[m["role"]][k % len(aliases[m["role"]])]}
                                             if m["role"] in aliases else m for m in row["messages"]]})
    assert {m["role"] for row in rows for m in row["messages"]} == {"system", "human", "gpt", "model", "observation"}
    expected, _, _ = tokenize(tmp_path, "messages", expected_rows, model, chat_template=template,
                              max_rejected_fraction=1.0)
    data, rejected, summary = tokenize(tmp_path, "aliases", rows, model, chat_template=template,
                                       max_rejected_fraction=1.0)
    assert tokens(data) == tokens(expected) and len(data) >= 4
    assert summary["rows_by_format"] == {"messages": len(rows)}
    assert "unknown_role" not in summary["rejected_by_reason"]


def test_sharegpts_other_assistant_names_and_mapped_names_give_the_tokens_of_gpt_and_human(tmp_path, real, caplog):
    """ShareGPT_Vicuna_unfiltered's chatgpt, bing and bard turns were refused one row at a time; they are the
    assistant's, and ``--sharegpt-roles`` reads other names: the tokens and labels of the same rows with gpt and
    human, each name's turns counted in summary.json and the log."""
    model, template = real
    others = iter(["chatgpt", "bing", "bard"])  # SHAREGPT_ROWS' three gpt turns, one name each
    renamed = [{**row, "conversations": [{**turn, "from": next(others)} if turn["from"] == "gpt" else turn
                                         for turn in row["conversations"]]} for row in SHAREGPT_ROWS]
    mapped = [{**row, "conversations": [{**turn, "from": {"human": "person", "gpt": "robot"}[turn["from"]]}
                                        for turn in row["conversations"]]} for row in SHAREGPT_ROWS]
    expected, _, plain = tokenize(tmp_path, "gpt", SHAREGPT_ROWS * 2, model, chat_template=template)
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            data, rejected, summary = tokenize(tmp_path, "others", renamed + mapped, model, chat_template=template,
                                               sharegpt_roles="robot=assistant,person=user")
    finally:
        logger.removeHandler(caplog.handler)
    assert not rejected and tokens(data) == tokens(expected) and len(data) == 4
    assert summary["rows_by_format"] == {"sharegpt": 4}
    assert summary["sharegpt_roles_mapped"] == {"person": 3, "robot": 3, "chatgpt": 1, "bing": 1, "bard": 1}
    assert plain["sharegpt_roles_mapped"] == {}
    (line,) = [message for message in caplog.messages if "ShareGPT turns under other names" in message]
    assert line.startswith("read 9 ShareGPT turns under other names: ") and "3 robot as assistant" in line
    assert "3 person as user" in line and "1 bard as assistant" in line
    with pytest.raises(SampleError, match="from 'person'; .*--sharegpt-roles NAME=ROLE reads other names") as err:
        read_row(mapped[0])  # without the flag, a name of its own is still refused
    assert err.value.reason == "unknown_role"


@pytest.mark.parametrize(("value", "problem"), [
    ("robot", "--sharegpt-roles 'robot': expected NAME=ROLE with ROLE one of system, user, assistant, tool"),
    ("robot=assistant,person=bot",
     "--sharegpt-roles 'person=bot': expected NAME=ROLE with ROLE one of system, user, assistant, tool"),
    ("=user", "--sharegpt-roles '=user': expected NAME=ROLE with ROLE one of system, user, assistant, tool"),
    ("gpt=user", "--sharegpt-roles 'gpt=user': 'gpt' is ShareGPT's own name for assistant; map only other names"),
    ("robot=assistant,robot=user", "--sharegpt-roles 'robot=user': 'robot' is mapped twice"),
])
def test_a_bad_sharegpt_roles_item_is_refused_in_one_line_naming_it(value, problem):
    with pytest.raises(ValueError) as err:
        ProcessDataConfig(input_file="in.jsonl", model_name_or_path="m", output_dir="out", sharegpt_roles=value)
    assert str(err.value).endswith(f"\n  - {problem}") and str(err.value).count("\n") == 1


def test_capybaras_input_output_exchanges_are_user_and_assistant_turns(tmp_path, real):
    """LDJnr/Capybara (and Pure-Dove, Verified-Camel) hold a conversation as ``{input, output}`` exchanges."""
    model, template = real
    turns = MESSAGES_ROWS[1]["messages"]
    capybara = {"source": "GPT4LLM", "conversation": [{"input": turns[i]["content"], "output": turns[i + 1]["content"]}
                                                      for i in range(0, len(turns), 2)]}
    expected, _, _ = tokenize(tmp_path, "messages", [{"source": "GPT4LLM", "messages": turns}], model,
                              chat_template=template)
    data, rejected, summary = tokenize(tmp_path, "capybara", [capybara], model, chat_template=template,
                                       columns="conversations=conversation")
    assert not rejected and tokens(data) == tokens(expected) and data[0]["source"] == "GPT4LLM"
    assert summary["rows_by_format"] == {"sharegpt": 1}


def test_sharegpt_tool_call_and_observation_are_the_messages_tool_turns(tmp_path, tiny_models):
    model, template = tiny_models["tools"], str(REAL["qwen2.5"][1])
    expected, _, _ = tokenize(tmp_path, "messages", [TOOL_ROW], model, chat_template=template)
    data, rejected, summary = tokenize(tmp_path, "sharegpt", [SHAREGPT_TOOL_ROW], model, chat_template=template)
    assert not rejected and tokens(data) == tokens(expected)
    assert summary["audit"]["num_replies"] == 2  # the tool call and the answer, both learned


def test_openai_legacy_functions_are_the_tools_format(tmp_path, real):
    """OpenAI's fine-tuning files from before tools (``functions``, ``function_call``, ``function`` results)
    give the tokens of the same conversation in the tools format."""
    model, template = real
    named = {**TOOL_ROW, "messages": [{**m, "name": "get_weather"} if m["role"] == "tool" else m
                                      for m in TOOL_ROW["messages"]]}
    legacy = {"id": "t", "functions": [TOOL], "messages": [
        TOOL_ROW["messages"][0],
        {"role": "assistant", "content": None, "function_call": {**CALL, "arguments": json.dumps(CALL["arguments"])}},
        {"role": "function", "name": "get_weather", "content": "sunny, 21 C"},
        TOOL_ROW["messages"][3]]}
    expected, _, _ = tokenize(tmp_path, "messages", [named], model, chat_template=template)
    data, rejected, summary = tokenize(tmp_path, "legacy", [legacy], model, chat_template=template)
    assert not rejected and tokens(data) == tokens(expected) and data[0]["id"] == "t" and "functions" not in data[0]
    assert summary["audit"]["num_replies"] == 2  # the call and the answer, both learned


def test_tools_as_one_json_string_are_the_tools_themselves(tmp_path, tiny_models):
    """How parquet files on the hub keep tool schemas, in every chat format."""
    model, template = tiny_models["tools"], str(REAL["qwen2.5"][1])
    expected, _, _ = tokenize(tmp_path, "messages", [TOOL_ROW], model, chat_template=template)
    as_string = {**TOOL_ROW, "tools": json.dumps(TOOL_ROW["tools"])}
    prompt_completion = {"id": "t", "tools": as_string["tools"], "prompt": TOOL_ROW["messages"][:1],
                         "completion": TOOL_ROW["messages"][1:]}
    for name, row in (("string", as_string), ("pc", prompt_completion)):
        data, rejected, _ = tokenize(tmp_path, name, [row], model, chat_template=template)
        assert not rejected and [row["input_ids"] for row in data] == [row["input_ids"] for row in expected]
    data, rejected, _ = tokenize(tmp_path, "bad", [as_string, {**TOOL_ROW, "tools": "[{"}], model,
                                 chat_template=template)
    assert len(data) == 1 and [(row["line"], row["reason"]) for row in rejected] == [(2, "invalid_tools")]


def test_conversational_prompt_turns_are_never_learned(tmp_path, tiny_models, tokenizers_by_name):
    """A multi-turn prompt: its assistant turn is masked, only the completion's reply is learned."""
    model = tiny_models["chatml"]
    turns = MESSAGES_ROWS[1]["messages"]
    data, rejected, _ = tokenize(tmp_path, "pc", [{"prompt": turns[:3], "completion": turns[3:]}], model)
    full, _, _ = tokenize(tmp_path, "messages", [{"messages": turns}], model)
    assert not rejected and data[0]["input_ids"] == full[0]["input_ids"]
    tok = tokenizers_by_name["chatml"]
    assert tok.decode([label for label in data[0]["labels"] if label != IGNORE_INDEX]) == "Six.<|im_end|>"
    assert tok.decode([label for label in full[0]["labels"] if label != IGNORE_INDEX]) == \
        "Four.<|im_end|>Six.<|im_end|>"


# ----------------------------------------------------------------------------
# OpenAI's fine-tuning format: per-reply weight, text parts, arguments as a JSON string

# OpenAI's own example of `weight`: the first reply shown, only the second learned.
WEIGHTED = [{"role": "system", "content": "Marv is a factual chatbot that is also sarcastic."},
            {"role": "user", "content": "What's the capital of France?"},
            {"role": "assistant", "content": "Paris", "weight": 0},
            {"role": "user", "content": "Can you be more sarcastic?"},
            {"role": "assistant", "content": "Paris, as if everyone doesn't know that already.", "weight": 1}]


def _learned(row: dict) -> set[int]:
    return {i for i, label in enumerate(row["labels"]) if label != IGNORE_INDEX}


def test_weight_0_shows_a_reply_without_learning_it(tmp_path, real):
    model, template = real
    plain = [{key: value for key, value in m.items() if key != "weight"} for m in WEIGHTED]
    swapped = [dict(m, weight=1 - m["weight"]) if "weight" in m else m for m in WEIGHTED]
    data, rejected, summary = tokenize(tmp_path, "weighted", [{"messages": WEIGHTED}, {"messages": swapped}], model,
                                       chat_template=template)
    (everything,), _, _ = tokenize(tmp_path, "plain", [{"messages": plain}], model, chat_template=template)
    (last_only,), _, _ = tokenize(tmp_path, "pc", [{"prompt": plain[:4], "completion": plain[4:]}], model,
                                  chat_template=template)
    assert not rejected and all(row["input_ids"] == everything["input_ids"] for row in data)
    first_only = _learned(everything) - _learned(last_only)
    assert first_only and _learned(last_only) and _learned(data[0]) == _learned(last_only)
    assert _learned(data[1]) == first_only and data[0]["labels"] == last_only["labels"]
    assert summary["audit"]["passed"] and summary["audit"]["num_replies"] == 2
    assert summary["audit"]["num_replies_marked_not_learned"] == 2
    # ShareGPT turns carry the same weight (OpenHermes-2.5 writes null on every turn: the default).
    sharegpt = [{"conversations": [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]],
                                    "value": m["content"], "weight": m.get("weight")} for m in messages]}
                for messages in (WEIGHTED, swapped, plain)]
    converted, rejected, _ = tokenize(tmp_path, "sharegpt", sharegpt, model, chat_template=template)
    assert not rejected and tokens(converted) == tokens(data + [everything])


def test_axolotl_train_marks_choose_replies_as_weight_does(tmp_path, real):
    """axolotl's per-turn booleans (``message_field_training: train`` or ``training``) and the ``loss`` of
    FastChat-style agent data (AgentInstruct's ShareGPT turns, null on human turns) learn what the same
    weights learn; unread, the masked first reply would be learned silently."""
    model, template = real
    marked = {key: [{**{k: v for k, v in m.items() if k != "weight"}, **({key: bool(m["weight"])} if "weight" in m
                                                                         else {})} for m in WEIGHTED]
              for key in ("train", "training", "loss")}
    weighted, _, _ = tokenize(tmp_path, "weighted", [{"messages": WEIGHTED}], model, chat_template=template)
    rows = [{"messages": marked["train"]}, {"messages": marked["training"]},
            {"conversations": [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]],
                                "value": m["content"], **({"train": m["train"]} if "train" in m else {})}
                               for m in marked["train"]]},
            {"conversations": [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]],
                                "value": m["content"], "loss": m.get("loss")} for m in marked["loss"]]}]
    data, rejected, summary = tokenize(tmp_path, "marked", rows, model, chat_template=template)
    assert not rejected and tokens(data) == tokens(weighted * 4)
    assert summary["audit"]["passed"] and summary["audit"]["num_replies_marked_not_learned"] == 4


def test_content_as_text_parts_is_its_text(tmp_path, real):
    """OpenAI's list of text parts: one part is its text, several are joined by newlines as vLLM joins them."""
    model, template = real
    as_parts = [{**row, "messages": [{**m, "content": [{"type": "text", "text": m["content"]}]}
                                     for m in row["messages"]]} for row in MESSAGES_ROWS]
    two_parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Read this:"},
                                                           {"type": "text", "text": "Paris is in France."}]},
                              {"role": "assistant", "content": "Done."}]}
    joined = {"messages": [{"role": "user", "content": "Read this:\nParis is in France."},
                           {"role": "assistant", "content": "Done."}]}
    expected, _, _ = tokenize(tmp_path, "messages", MESSAGES_ROWS + [joined], model, chat_template=template)
    data, rejected, _ = tokenize(tmp_path, "parts", as_parts + [two_parts], model, chat_template=template)
    assert not rejected and tokens(data) == tokens(expected)


def test_tool_call_arguments_as_a_json_string_are_the_object(tmp_path, real):
    """OpenAI's format writes arguments as a JSON string; templates write ``arguments | tojson``, which would
    quote it again. Parsed first, as vLLM does when it serves the model, the row is the object's row."""
    from transformers import AutoTokenizer

    model, template = real
    call = {"type": "function", "function": {**CALL, "arguments": json.dumps(CALL["arguments"])}}
    as_string = {**TOOL_ROW, "messages": [TOOL_ROW["messages"][0], {**TOOL_ROW["messages"][1], "tool_calls": [call]},
                                          *TOOL_ROW["messages"][2:]]}
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = Path(template).read_text()
    assert tok.apply_chat_template(as_string["messages"], tools=TOOL_ROW["tools"], tokenize=False) != \
        tok.apply_chat_template(TOOL_ROW["messages"], tools=TOOL_ROW["tools"], tokenize=False)  # quoted twice
    no_arguments = [{**TOOL_ROW, "messages": [TOOL_ROW["messages"][0], {**TOOL_ROW["messages"][1], "tool_calls": [
        {"type": "function", "function": {"name": CALL["name"], **extra}}]}, *TOOL_ROW["messages"][2:]]}
        for extra in ({"arguments": {}}, {"arguments": ""}, {"arguments": None}, {})]
    expected, _, _ = tokenize(tmp_path, "object", [TOOL_ROW, no_arguments[0]], model, chat_template=template)
    data, rejected, _ = tokenize(tmp_path, "string", [as_string] + no_arguments[1:], model, chat_template=template)
    assert not rejected and tokens(data) == tokens(expected[:1] + expected[1:] * 3)


def test_an_empty_tool_calls_list_is_no_call(tmp_path, real):
    """``"tool_calls": []`` beside a reply, as serialisers write "no calls": the reply's row (vLLM drops it too)."""
    model, template = real
    with_empty = [{**row, "messages": [{**m, "tool_calls": []} if m["role"] == "assistant" else m
                                       for m in row["messages"]]} for row in MESSAGES_ROWS]
    expected, _, _ = tokenize(tmp_path, "messages", MESSAGES_ROWS, model, chat_template=template)
    data, rejected, _ = tokenize(tmp_path, "empty", with_empty, model, chat_template=template)
    assert not rejected and tokens(data) == tokens(expected)


def test_a_table_row_has_its_own_tools_and_arguments_not_the_columns(tmp_path, real):
    """Parquet's struct columns give each row's tool schema the other tools' parameters and each call the
    other calls' argument names, as nulls: dropped, the rows are their JSON lines' rows. A JSON string keeps
    its nulls (a table cannot tell them apart, a string can). The rows' keys are sorted: pyarrow before 24
    writes a struct's fields in sorted order, later ones in the order first seen, and only sorted rows read
    back the same under both."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    model, template = real
    search = {"name": "search", "description": "Search the web", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "top_k": {"type": "integer"}}, "required": ["query"]}}

    def row(tool: dict, call: dict, arguments) -> dict:
        return {"tools": [{"type": "function", "function": tool}], "messages": [
            TOOL_ROW["messages"][0], {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": call["name"], "arguments": arguments}}]},
            *TOOL_ROW["messages"][2:]]}

    rows = [row(TOOL, CALL, CALL["arguments"]), row(search, {"name": "search"}, {"query": "cats", "top_k": 3})]
    with_null = [row(TOOL, CALL, json.dumps({"city": "Paris", "unit": None}))] * 2
    for name, table_rows in (("structs", rows), ("strings", with_null)):
        table_rows = json.loads(json.dumps(table_rows, sort_keys=True))
        pq.write_table(pa.Table.from_pylist(table_rows), tmp_path / f"{name}.parquet")
        expected, _, _ = tokenize(tmp_path, name, table_rows, model, chat_template=template)
        out = tmp_path / f"out-{name}-parquet"
        process_data(ProcessDataConfig(input_file=str(tmp_path / f"{name}.parquet"), model_name_or_path=str(model),
                                       output_dir=str(out), num_proc=1, num_printed_samples=0, chat_template=template))
        assert tokens(read_jsonl(out / "data.jsonl")) == tokens(expected), name


def test_a_conversation_in_a_csv_cell_is_its_json_text(tmp_path, real):
    """A CSV cell holds no list: conversations exported to CSV are JSON strings, read as the lists they hold."""
    import csv

    model, template = real
    for name, rows, key in (("messages", MESSAGES_ROWS, "messages"), ("sharegpt", SHAREGPT_ROWS, "conversations")):
        path = tmp_path / f"{name}.csv"
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["id", key, "system"])
            writer.writeheader()
            writer.writerows({"id": row["id"], key: json.dumps(row[key]), "system": row.get("system", "")}
                             for row in rows)
        expected, _, _ = tokenize(tmp_path, name, rows, model, chat_template=template)
        out = tmp_path / f"out-{name}-csv"
        summary = process_data(ProcessDataConfig(input_file=str(path), model_name_or_path=str(model),
                                                 output_dir=str(out), num_proc=1, num_printed_samples=0,
                                                 chat_template=template))
        assert tokens(read_jsonl(out / "data.jsonl")) == tokens(expected) and summary["num_written"] == len(rows)


def test_a_string_completion_after_a_conversational_prompt_is_its_reply(tmp_path, real):
    """Llama-Nemotron's post-training rows: ``input`` messages and ``output`` the reply's text."""
    model, template = real
    turns = MESSAGES_ROWS[1]["messages"]
    row = {"input": turns[:3], "output": turns[3]["content"], "reasoning": "off", "category": "math"}
    expected, _, _ = tokenize(tmp_path, "lists", [{"prompt": turns[:3], "completion": turns[3:]}], model,
                              chat_template=template)
    data, rejected, summary = tokenize(tmp_path, "nemotron", [row], model, chat_template=template,
                                       columns="prompt=input,completion=output")
    assert not rejected and tokens(data) == tokens(expected) and summary["rows_by_format"] == {"prompt_completion": 1}
    assert (data[0]["reasoning"], data[0]["category"]) == ("off", "math")


def test_a_system_column_goes_before_a_conversational_prompt(tmp_path, real):
    """Llama-Nemotron's ``system_prompt`` ("detailed thinking on") switches its reasoning: it was copied as a
    field and never reached the template. Now it is the system message, as in alpaca and ShareGPT rows; an
    empty one is none."""
    model, template = real
    turns = MESSAGES_ROWS[0]["messages"]
    rows = [{"input": turns[1:2], "output": turns[2]["content"], "system_prompt": turns[0]["content"]},
            {"input": turns[1:2], "output": turns[2]["content"], "system_prompt": ""}]
    expected, _, _ = tokenize(tmp_path, "messages", [{"messages": turns}, {"messages": turns[1:]}], model,
                              chat_template=template)
    data, rejected, _ = tokenize(tmp_path, "nemotron", rows, model, chat_template=template,
                                 columns="prompt=input,completion=output,system=system_prompt")
    assert not rejected and tokens(data) == tokens(expected) and "system_prompt" not in data[0]
    # Plain strings have no template to hold a system prompt: the column stays a field.
    fmt, row = read_row({"prompt": "P ", "completion": "C", "system": "S"})
    assert row.fields == {"messages": [{"role": "pretrain", "content": "P C"}], "system": "S"}


def test_a_system_like_column_nothing_reads_is_named_with_the_columns_that_read_it(tmp_path, tiny_models, caplog):
    """Locutusque/function-calling-chatml's 'system_message' ("You are a helpful assistant with access to the
    following functions...") stands beside ShareGPT turns: it was copied, never rendered, without a word."""
    turns = [{"from": "human", "value": "Weather?"}, {"from": "gpt", "value": "Sunny."}]
    row = {"system_message": "You are a helpful assistant with access to the following functions.",
           "conversations": turns}
    assert unread_system(*read_row(row)) == "system_message"
    assert unread_system(*read_row(row, columns=parse_columns("system=system_message"))) is None
    assert unread_system(*read_row({**row, "system_message": " "})) is None
    assert unread_system(*read_row({**row, "conversations": [{"from": "system", "value": "S"}, *turns]})) is None
    assert unread_system(*read_row({"messages": [], "system_prompt": "S"})) is None  # messages reads no column
    assert unread_system(*read_row({"prompt": "P", "completion": "C", "system_prompt": "S"})) is None  # plain text
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger=logger.name):
            tokenize(tmp_path, "tools_in_system_message", [row] * 3, tiny_models["chatml"])
    finally:
        logger.removeHandler(caplog.handler)
    assert ("3 of the first 3 rows have no system message and a 'system_message' column, which is copied to the "
            "output, not read: --columns system=system_message makes it the system message") in caplog.messages


@pytest.fixture(scope="module")
def tokenizers_by_name(tiny_models):
    from transformers import AutoTokenizer

    return {name: AutoTokenizer.from_pretrained(tiny_models[name]) for name in ("chatml", "llama3")}


@pytest.mark.parametrize("name", ["chatml", "llama3"])
def test_string_prompt_completion_is_the_tokenizers_encoding_with_the_prompt_masked(tmp_path, tiny_models,
                                                                                    tokenizers_by_name, name):
    """No template: encode(prompt + completion) + EOS, learned from where the tokens of the prompt alone and of
    the whole text diverge (TRL's common prefix): a prompt ending in a space keeps the completion's first word."""
    rows = [{"prompt": "The capital of France is", "completion": " Paris."},
            {"prompt": "Q: What is 2+2?\nA:", "completion": " 4"},
            {"prompt": "", "completion": "Only a completion."},
            {"prompt": "The capital of France is ", "completion": "Paris."}]
    data, rejected, summary = tokenize(tmp_path, "plain", rows, tiny_models[name])
    tok = tokenizers_by_name[name]
    assert not rejected and summary["rows_by_format"] == {"prompt_completion": 4}
    for row, out in zip(rows, data):
        ids = tok(row["prompt"] + row["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        prompt_ids = tok(row["prompt"], add_special_tokens=False)["input_ids"]
        first = next(i for i, (a, b) in enumerate(zip(prompt_ids + [None], ids)) if a != b)
        assert out["input_ids"] == ids and out["labels"] == [IGNORE_INDEX] * first + ids[first:]
    # A real BPE merges ' Paris' across the boundary (tests/test_trl_boundary.py); these tiny ones do not.


# ----------------------------------------------------------------------------
# Rows in, messages out (pure)


def test_read_row_converts_each_format():
    assert read_row(json.dumps(ALPACA_ROWS[1]).encode()) == ("alpaca", read_row(ALPACA_MESSAGES[1])[1])
    fmt, row = read_row({"prompt": "P ", "completion": "C", "source": "x"})
    assert fmt == "prompt_completion" and row.num_prompt_chars == 2
    assert row.fields == {"messages": [{"role": "pretrain", "content": "P C"}], "source": "x"}
    # A KTO row labelled true is learned like any other; its label is copied as other fields are.
    assert read_row({"prompt": "P ", "completion": "C", "label": True})[1].fields["label"] is True
    fmt, row = read_row(PROMPT_COMPLETION_ROWS[0])
    assert row.num_prompt_messages == 2 and row.fields["messages"] == MESSAGES_ROWS[0]["messages"]
    fmt, row = read_row(SHAREGPT_TOOL_ROW)
    assert (fmt, row.fields) == ("sharegpt", TOOL_ROW)
    # A 'conversations' column holding role/content messages; 'tool' as ShareGPT datasets name results.
    fmt, row = read_row({"conversations": [{"role": "user", "content": "x"}, {"from": "tool", "value": "y"}]})
    assert row.fields["messages"] == [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]
    # 'messages' wins whatever else the row carries (as before): ultrachat's 'prompt', a 'text' column.
    assert read_row({"messages": [], "prompt": "p", "text": "t"})[0] == "messages"


def test_columns_and_a_forced_format():
    columns = parse_columns("prompt=question, completion=answer")
    assert columns == {"question": "prompt", "answer": "completion"}
    assert read_row({"question": "Q ", "answer": "A"}, columns=columns)[0] == "prompt_completion"
    both = {"instruction": "a", "input": "", "output": "b", "text": "### Instruction: a ### Response: b"}
    assert read_row(both, input_format="alpaca")[1].fields["text"] == both["text"]  # kept as a field
    assert read_row(both, input_format="text")[1].fields["messages"][0]["content"] == both["text"]
    with pytest.raises(SampleError, match="missing_field: no 'output' field"):
        read_row({"instruction": "a"}, input_format="alpaca")
    # The mapped column is read, not a column already named so, wherever each stands in the row.
    for row in ({"question": "Q", "prompt": "P", "completion": "C"}, {"prompt": "P", "question": "Q", "completion": "C"}):
        assert read_row(row, columns=parse_columns("prompt=question"))[1].fields["messages"][0]["content"] == "QC"
    with pytest.raises(ValueError, match="NAME=COLUMN"):
        parse_columns("labels=x")


# A row with every kind of token a cut can fall inside: escapes, literals, numbers, nested containers.
CUT_ROW = ('{"messages": [{"role": "user", "content": "h\\u00e9llo \\"x\\""}, {"role": "assistant", "content": "ok", '
           '"weight": 1}], "n": [true, false, null, -12, 1.5e-3, -0.5E+2], "o": {}}')
CUT_OFF = "the JSON is cut off after {} characters (the file was truncated or a write was interrupted)"


def test_a_json_line_cut_anywhere_is_said_to_be_cut_off():
    """A truncated file's last line, or a write that was interrupted, was refused in json's words ("Invalid
    control character at: line 1 column 58", "Unterminated string starting at", "Expecting ',' delimiter"),
    the column of the cut given as a line 1 that is no line of the file."""
    assert json.loads(CUT_ROW)
    for end in range(1, len(CUT_ROW)):
        for newline in (b"", b"\n", b"\r\n"):  # the file's last line, or one a later write followed
            with pytest.raises(SampleError) as err:
                read_row(CUT_ROW[:end].encode() + newline)
            assert (err.value.reason, err.value.detail) == ("invalid_json", CUT_OFF.format(len(CUT_ROW[:end].rstrip())))


@pytest.mark.parametrize("line", ['{"a": x}', '{"a": tx}', '{"a": 1}{"b": 2}', "{'a': 1}", '{"a": 1.}',
                                  '{"a": "\\q"}', '{"a": "\\u12G4"}', '{"a": "x\ty"}', "nope"])
def test_a_json_error_inside_the_line_keeps_jsons_message(line):
    with pytest.raises(json.JSONDecodeError) as expected:
        json.loads(line)
    with pytest.raises(SampleError) as err:
        read_row(line.encode() + b"\n")
    assert (err.value.reason, err.value.detail) == ("invalid_json", str(expected.value))


BAD_ROWS = [
    ('{"instruction": "a", ', "invalid_json"),
    ({"id": 1, "question": "x", "answer": "y"}, "missing_messages"),
    ({"instruction": "a", "output": "b", "text": "c"}, "ambiguous_format"),
    ({"prompt": "a", "completion": "b", "messages": []}, "empty_messages"),
    ({"conversations": []}, "empty_messages"),
    ({"prompt": [{"role": "user", "content": "a"}], "completion": []}, "empty_messages"),
    ({"instruction": "a", "input": "", "output": 3}, "non_string_content"),
    ({"text": 5}, "non_string_content"),
    ({"conversations": [{"from": "human", "value": 7}, {"from": "gpt", "value": "y"}]}, "non_string_content"),
    ({"conversations": [{"from": "human", "value": ["x"]}, {"from": "gpt", "value": "y"}]}, "non_text_content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},
                   {"role": "assistant", "content": "A cat."}]}, "non_text_content"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "weight": 0.5}]},
     "invalid_weight"),
    ({"messages": [{"role": "user", "content": "x", "weight": 1}, {"role": "assistant", "content": "y"}]},
     "invalid_weight"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "weight": 0}]},
     "no_loss_tokens"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "train": "no"}]},
     "invalid_weight"),
    ({"messages": [{"role": "user", "content": "x", "training": True}, {"role": "assistant", "content": "y"}]},
     "invalid_weight"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "train": True,
                                                      "weight": 0}]}, "invalid_weight"),
    ({"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y", "train_detail": [
        {"begin_offset": 0, "end_offset": 0, "train": False}]}]}, "invalid_weight"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{'city': 'Paris'}"}}]}]}, "invalid_tool_calls"),
    ({"conversations": [{"from": "wizard", "value": "x"}]}, "unknown_role"),
    ({"functions": [TOOL], "tools": [{"type": "function", "function": TOOL}], "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}, "invalid_tools"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "function_call": {"arguments": "{}"}}]},
     "invalid_tool_calls"),
    ({"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": "{"}]},
     "invalid_tool_calls"),
    ({"prompt": "a", "completion": 3}, "invalid_prompt_completion"),
    ({"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}, "invalid_prompt_completion"),
    ({"prompt": [{"role": "user", "content": "a"}], "completion": " "}, "empty_completion"),
    ({"prompt": "a", "completion": "  "}, "empty_completion"),
    ({"instruction": None, "output": "b"}, "missing_content"),
    # TRL's unpaired preference (KTO) rows: one labelled false was learned, the reply the data says not to give.
    ({"prompt": "The sky is", "completion": " green.", "label": False}, "undesirable_completion"),
    ({"prompt": [{"role": "user", "content": "Sky?"}], "completion": [{"role": "assistant", "content": "Green."}],
      "label": False}, "undesirable_completion"),
    ({"instruction": "a", "output": "b", "history": [["only the question"]]}, "invalid_history"),
    # Each of these three stopped the run with a traceback.
    ({"conversations": [{"from": ["human"], "value": "x"}, {"from": "gpt", "value": "y"}]}, "unknown_role"),
    ({"messages": True, "functions": [TOOL]}, "messages_not_a_list"),
    # A list of alpaca rows read as one conversation of exchanges lost every instruction, silently.
    ({"conversations": [{"instruction": "Add.", "input": "2 3", "output": "5"}]}, "invalid_exchange"),
    ('{"messages": [{"role": "user", "content": "An emoji cut in two: \\ud83d"}, {"role": "assistant", '
     '"content": "y"}]}', "lone_surrogate"),
]


def test_bad_rows_of_each_format_are_counted_listed_and_skipped(tmp_path, tiny_models):
    rows = [ALPACA_ROWS[0]] + [row for row, _ in BAD_ROWS] + [SHAREGPT_ROWS[0], {"text": "plain"}]
    input_file = write_jsonl(tmp_path / "in.jsonl", rows)
    argv = ["--input-file", str(input_file), "--model-name-or-path", str(tiny_models["chatml"]), "--num-proc", "1"]
    summary = main([*argv, "--output-dir", str(tmp_path / "out")])  # returns: exit 0
    rejected = read_jsonl(tmp_path / "out" / "rejected.jsonl")
    assert [(r["line"], r["reason"]) for r in rejected] == [(i + 2, reason) for i, (_, reason) in enumerate(BAD_ROWS)]
    assert "'id', 'question', 'answer'" in rejected[1]["detail"] and "alpaca (instruction + output)" in \
        rejected[1]["detail"]
    assert summary["num_written"] == 3 and summary["input_errors"]["num_rows"] == len(BAD_ROWS)
    # Rows by the format found, bad ones too; bad JSON, no shape and two shapes have none.
    assert summary["rows_by_format"] == {"sharegpt": 9, "alpaca": 4, "prompt_completion": 7, "text": 2,
                                         "messages": 13}
    assert summary["audit"]["passed"] and summary["audit"]["num_rejected"] == 0
    with pytest.raises(SystemExit) as err:
        main([*argv, "--output-dir", str(tmp_path / "strict"), "--strict"])
    assert str(err.value).startswith(f"process_data.py: error: {input_file}:2: invalid_json: ")
    assert "\n" not in str(err.value)


# Row shapes of public datasets, from their cards: lmsys-chat-1m, databricks-dolly-15k, Open-Orca/OpenOrca,
# nvidia/HelpSteer2, bigcode/the-stack, a ShareGPT export under another name, LDJnr/Capybara; and a row nothing
# maps.
OTHER_SHAPES = {
    "lmsys": ({"conversation_id": "c1", "model": "vicuna-13b", "conversation": MESSAGES_ROWS[1]["messages"], "turn": 2},
              [("messages=conversation", "messages")]),
    "dolly": ({"instruction": "Name a colour.", "context": "Colours: red, blue.", "response": "Red.",
               "category": "closed_qa"}, [("output=response,input=context", "alpaca")]),
    "openorca": ({"id": "niv.1", "system_prompt": "You are a helpful assistant.", "question": "Name a colour.",
                  "response": "Red."}, [("instruction=question,output=response,system=system_prompt", "alpaca"),
                                        ("prompt=question,completion=response", "prompt_completion")]),
    "helpsteer": ({"prompt": "Name a colour.", "response": "Red.", "helpfulness": 3},
                  [("instruction=prompt,output=response", "alpaca"), ("completion=response", "prompt_completion")]),
    "stack": ({"content": "def f():\n    return 1\n", "lang": "Python"}, [("text=content", "text")]),
    "dialog": ({"id": 7, "dialog": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]},
               [("conversations=dialog", "sharegpt")]),
    "capybara": ({"source": "Airoboros", "conversation": [{"input": "Hi", "output": "Hello."},
                                                           {"input": "Bye", "output": "Goodbye."}]},
                 [("conversations=conversation", "sharegpt")]),
    "openmathinstruct": ({"problem": "What is 2+2?", "generated_solution": "2+2 = \\boxed{4}.",
                          "expected_answer": "4", "problem_source": "gsm8k"},
                         [("instruction=problem,output=generated_solution", "alpaca"),
                          ("prompt=problem,completion=generated_solution", "prompt_completion")]),
    # TRL's preference rows (prompt/chosen/rejected, chosen/rejected: trl_preference, Intel/orca_dpo_pairs) are
    # read as pairs now (tests/test_preference_data.py); a pair that does not convert is still refused with offers.
    # Plain strings that share a few characters but no whole turn, and no prompt column: no pair, nothing to offer
    # (Tulu 3's and UltraFeedback's layouts read as pairs now: tests/test_preference_layouts.py).
    "shared_characters_preference": ({"chosen": "The sky is blue.", "rejected": "The sky is green."}, []),
    # OpenAI's preference fine-tuning rows: the prompt is nested under 'input', which --columns cannot name. The
    # refusal offered messages=preferred_output (a reply without its question) and messages=non_preferred_output.
    "openai_preference": ({"input": {"messages": [{"role": "user", "content": "Capital of France?"}], "tools": []},
                           "preferred_output": [{"role": "assistant", "content": "Paris."}],
                           "non_preferred_output": [{"role": "assistant", "content": "Lyon."}]}, []),
    # Llama-Nemotron's post-training rows: the refusal offered messages=input, a prompt with no reply to learn.
    "nemotron": ({"input": [{"role": "user", "content": "Capital of France?"}], "output": "Paris.",
                  "system_prompt": "detailed thinking off", "reasoning": "off", "category": "chat"},
                 [("prompt=input,completion=output,system=system_prompt", "prompt_completion")]),
    "trl_prompt_only": ({"prompt": [{"role": "user", "content": "Capital of France?"}]}, []),
    "nothing": ({"id": 7, "score": 0.5}, []),
}


@pytest.mark.parametrize("shape", sorted(OTHER_SHAPES))
def test_the_refusal_offers_the_columns_that_read_the_file(tmp_path, tiny_models, shape):
    """Each --columns the refusal offers converts every row as the format it names; no offer is made
    that does not, and the accepted formats are listed once."""
    row, offers = OTHER_SHAPES[shape]
    input_file = write_jsonl(tmp_path / "in.jsonl", [row] * 3)
    argv = ["--input-file", str(input_file), "--model-name-or-path", str(tiny_models["chatml"]), "--num-proc", "1"]
    with pytest.raises(SystemExit) as err:
        main([*argv, "--output-dir", str(tmp_path / "out")])
    message = str(err.value)
    assert message.count("alpaca (instruction + output)") == 1 and "\n" not in message
    assert message.count(" reads it as ") == len(offers)
    for columns, fmt in offers:
        assert f"--columns {columns} reads it as {fmt}" in message
        if shape.startswith("trl_preference") and fmt == "prompt_completion":
            plain = isinstance(row["prompt"], str)
            assert f"{fmt} ({'plain text, no' if plain else 'conversational, through the'} chat template)" in message
        summary = main([*argv, "--output-dir", str(tmp_path / columns), "--columns", columns])
        assert summary["num_written"] == 3 and summary["rows_by_format"] == {fmt: 3}


def test_a_file_of_no_accepted_format_is_refused_in_one_line(tmp_path, tiny_models):
    input_file = write_jsonl(tmp_path / "in.jsonl", [{"question": "q", "answer": "a"}] * 3)
    argv = ["--input-file", str(input_file), "--model-name-or-path", str(tiny_models["chatml"]), "--num-proc", "1"]
    with pytest.raises(SystemExit) as err:
        main([*argv, "--output-dir", str(tmp_path / "out")])
    message = str(err.value)
    assert "no row of an accepted format in the first 3 rows" in message and "'question', 'answer'" in message
    assert "--columns" in message and "\n" not in message and not (tmp_path / "out").exists()
    summary = main([*argv, "--output-dir", str(tmp_path / "mapped"), "--columns", "prompt=question,completion=answer"])
    assert summary["num_written"] == 3 and summary["rows_by_format"] == {"prompt_completion": 3}
    # alpaca with its 'text' column (tatsu-lab/alpaca's card): two shapes, refused with the flag that chooses
    write_jsonl(input_file, [dict(ALPACA_ROWS[0], text="Below is an instruction...")] * 2)
    with pytest.raises(SystemExit) as err:
        main([*argv, "--output-dir", str(tmp_path / "both")])
    assert "text and alpaca" in str(err.value) and "--input-format" in str(err.value)
    assert main([*argv, "--output-dir", str(tmp_path / "forced"), "--input-format", "alpaca"])["num_written"] == 2


# ----------------------------------------------------------------------------
# Any value anywhere: the row is a sample or one counted rejection, never the end of the run

_ODD_STRINGS = ["", " ", "\x00", "\ud83d", "<|im_end|>", "<|im_start|>assistant\n", "{", "[]", "null", "user",
                "assistant", "gpt", "human", "function_call", "text", "date"]
_ODD_KEYS = ["role", "content", "from", "value", "weight", "train", "tool_calls", "function", "name", "arguments",
             "type", "text", "messages", "conversations", "prompt", "completion", "instruction", "output", "tools"]
_ODD_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 2**70) | st.floats() | st.sampled_from(_ODD_STRINGS)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(_ODD_KEYS), inner, max_size=3),
    max_leaves=6)
_FUZZ_BASES = [MESSAGES_ROWS[1], TOOL_ROW, SHAREGPT_ROWS[0], SHAREGPT_TOOL_ROW, PROMPT_COMPLETION_ROWS[0],
               {"prompt": "The capital of France is", "completion": " Paris."}, {"text": TEXTS[0]}, *ALPACA_ROWS,
               {"functions": [TOOL], "messages": [{"role": "user", "content": "Weather?"},
                                                  {"role": "assistant", "function_call": CALL},
                                                  {"role": "function", "name": "get_weather", "content": "sunny"}]}]


def _paths(value, path=()):
    yield path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield from _paths(child, (*path, key))


@pytest.fixture(scope="module")
def fuzz_encoder(tiny_models):
    from minitrainer.data.process_data import load_tokenizer, make_encoder

    config = ProcessDataConfig(input_file="rows.jsonl", model_name_or_path=str(tiny_models["tools"]),
                               output_dir="unused")
    return config, make_encoder(config, load_tokenizer(config.model_name_or_path), end_of_turn=None)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_any_value_anywhere_in_a_row_is_a_sample_or_one_counted_rejection(fuzz_encoder, data):
    """Before, a ShareGPT turn whose 'from' was a list, 'messages' that was no list beside 'functions' and a JSON
    '\\ud83d' escape each stopped the run with a traceback; a table row (a dict) and a JSON line both."""
    import copy

    from minitrainer.data.sources import Chunk
    from minitrainer.data.process_data import encode_chunk

    config, encoder = fuzz_encoder
    row = copy.deepcopy(data.draw(st.sampled_from(_FUZZ_BASES)))
    for _ in range(data.draw(st.integers(1, 3))):
        paths = list(_paths(row))[1:]
        if not paths:
            break
        path = data.draw(st.sampled_from(paths))
        parent = row
        for key in path[:-1]:
            parent = parent[key]
        if data.draw(st.booleans()):
            parent[path[-1]] = data.draw(_ODD_VALUES)
        elif isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent.pop(path[-1])
    as_line = data.draw(st.booleans())
    raw = json.dumps(row).encode() if as_line else row
    result = encode_chunk(encoder, Chunk("rows.jsonl", "line" if as_line else "row", [1], [raw]), config=config)
    assert len(result.lengths) + sum(result.reasons.values()) == 1
