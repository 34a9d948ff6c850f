"""Tests for process_data.py and chat_masking.py: exact labels per template, a
property test over random conversations, every bad-input case, whole-run
errors, --strict, determinism across --num-proc, and the CLI.

    .venv/bin/python -m pytest -q tests/test_process_data.py
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minitrainer.common.labels import IGNORE_INDEX
from minitrainer.common.log import logger
from minitrainer.data.chat_masking import ChatEncoder, Sample, SampleError, labels_from_token_spans, parse_row
from minitrainer.data.process_data import ProcessDataConfig, main, process_data, render_labels

ROOT = Path(__file__).resolve().parent.parent
# The end-of-turn token of each template family, written out (the encoder detects it).
EOS = {"chatml": "<|im_end|>", "qwen25": "<|im_end|>", "qwen3": "<|im_end|>", "llama3": "<|eot_id|>",
       "mistral": "</s>", "llama2": "</s>", "gemma": "<end_of_turn>", "qwen3think": "<|im_end|>",
       "tools": "<|im_end|>"}
ALTERNATING = ("mistral", "llama2")  # templates that fold the system prompt and refuse other roles


@pytest.fixture(scope="session")
def tokenizers(tiny_models):
    from transformers import AutoTokenizer

    return {name: AutoTokenizer.from_pretrained(path) for name, path in tiny_models.items()}


@pytest.fixture(scope="session")
def encoders(tokenizers):
    return {name: ChatEncoder(tok, max_sample_num_tokens=1 << 30) for name, tok in tokenizers.items()}


def encode(encoder: ChatEncoder, messages: list[dict]) -> Sample:
    (result,) = encoder.encode_rows([json.dumps({"messages": messages}).encode()])
    if isinstance(result, SampleError):
        raise result
    return result


def write_jsonl(path: Path, rows: list) -> Path:
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row, ensure_ascii=False)) + "\n")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(tmp_path: Path, model: Path, rows: list, **overrides) -> tuple[list[dict], list[dict], dict]:
    input_file = write_jsonl(tmp_path / "in.jsonl", rows)
    config = ProcessDataConfig(input_file=str(input_file), model_name_or_path=str(model),
                               output_dir=str(tmp_path / "out"), num_proc=1, **overrides)
    summary = process_data(config)
    out = tmp_path / "out"
    return read_jsonl(out / "data.jsonl"), read_jsonl(out / "rejected.jsonl"), summary


# ----------------------------------------------------------------------------
# Exact labels: each template's rendering written out by hand as (text, learned) segments


def expected_segments(template: str, messages: list[dict]) -> list[tuple[str, bool]]:
    """Conversations without tools or reasoning, rendered by hand; learned = after the generation prompt."""
    eos = EOS[template]
    if template in ("chatml", "qwen25", "qwen3", "qwen3think", "tools"):
        segments = []
        if template == "qwen25" and messages[0]["role"] != "system":
            segments.append(("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n", False))
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        for i, m in enumerate(messages):
            learned = m["role"] == "assistant"
            segments.append((f"<|im_start|>{m['role']}\n", False))
            if learned and (template == "qwen3" or (template == "qwen3think" and i > last_user)):
                segments.append(("<think>\n\n</think>\n\n", True))  # the model must write it after the prompt
            segments += [(m["content"], learned), (eos, learned), ("\n", False)]
        return segments
    if template == "gemma":
        segments = [("<bos>", False)]
        for m in messages:
            learned = m["role"] == "assistant"
            role = "model" if learned else m["role"]
            segments += [(f"<start_of_turn>{role}\n", False), (m["content"].strip(), learned), (eos, learned),
                         ("\n", False)]
        return segments
    if template == "llama3":
        segments = [("<|begin_of_text|>", False)]
        for m in messages:
            learned = m["role"] == "assistant"
            segments += [(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n", False),
                         (m["content"].strip(), learned), (eos, learned)]
        return segments
    assert template in ALTERNATING
    space = " " if template == "llama2" else ""
    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    segments = [("<s>", False)]
    for i, m in enumerate(messages[1:] if system else messages):
        if m["role"] == "user":
            prefix = f"{system}\n\n" if system and i == 0 else ""
            segments.append((f"[INST] {prefix}{m['content']} [/INST]", False))
        else:
            segments += [(space + m["content"], True), (eos, True)]
    return segments


CONVERSATIONS = {
    "single_turn": [{"role": "user", "content": "Hello there"},
                    {"role": "assistant", "content": "Hi! How can I help you today?"}],
    "multi_turn_system": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "What is two plus two?"},
                          {"role": "assistant", "content": "Four."},
                          {"role": "user", "content": "And the quick brown fox?"},
                          {"role": "assistant", "content": "It jumps over the lazy dog."}],
    "unicode": [{"role": "user", "content": "Ünïcödé, 中文?"},
                {"role": "assistant", "content": "Ja: 中文 und Emoji 🙂 sind Bytes."}],
}


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("template", sorted(EOS))
def test_exact_labels(tokenizers, encoders, template, conversation):
    messages = CONVERSATIONS[conversation]
    tok = tokenizers[template]
    segments = expected_segments(template, messages)
    assert "".join(text for text, _ in segments) == tok.apply_chat_template(messages, tokenize=False)
    expected_ids, expected_labels = [], []
    for text, learned in segments:
        ids = tok.encode(text, add_special_tokens=False)
        expected_ids += ids
        expected_labels += ids if learned else [IGNORE_INDEX] * len(ids)
    sample = encode(encoders[template], messages)
    assert sample.input_ids == list(tok.apply_chat_template(messages, tokenize=True)["input_ids"])
    assert sample.input_ids == expected_ids, "segments must tokenize like the whole text"
    assert sample.labels == expected_labels
    assert sample.num_loss_counted_tokens == sum(label != IGNORE_INDEX for label in expected_labels)


# ----------------------------------------------------------------------------
# Exact labels against a slow reference of the learning rule: one render per turn, token by token


def reference_labels(tok, messages: list[dict], end_of_turn: str, *, tools=None,
                     mask_reasoning: bool = False) -> tuple[list[int], list[int]]:
    """Each assistant turn: the characters from the end of its generation prompt through the first
    end-of-turn after it; a token is learned iff its first character is; reasoning text cut out."""
    full = tok.apply_chat_template(messages, tools=tools, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(tok.apply_chat_template(messages[:i], tools=tools, add_generation_prompt=True, tokenize=False))
        end = full.index(end_of_turn, start) + len(end_of_turn)
        reasoning = message.get("reasoning_content")
        if reasoning is None and "</think>" in message["content"]:
            reasoning = message["content"].split("</think>")[0].split("<think>")[-1]
        reasoning = (reasoning or "").strip()
        if mask_reasoning and reasoning and reasoning in full[start:end]:
            cut = full.index(reasoning, start)
            spans += [(start, cut), (cut + len(reasoning), end)]
        else:
            spans.append((start, end))
    encoding = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    labels = []
    for token, (first_char, _) in zip(encoding["input_ids"], encoding["offset_mapping"]):
        labels.append(token if any(a <= first_char < b for a, b in spans) else IGNORE_INDEX)
    return encoding["input_ids"], labels

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
TOOL_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
RICH = {
    "tool_call_only": ([{"role": "user", "content": "Weather in Paris?"},
                        {"role": "assistant", "tool_calls": [TOOL_CALL]},
                        {"role": "tool", "content": "sunny, 21 C"},
                        {"role": "assistant", "content": "It is sunny."}], TOOLS),
    "reply_and_tool_call": ([{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Weather?"},
                             {"role": "assistant", "content": "Let me look.", "tool_calls": [
                                 {"type": "function", "function": {"name": "get_weather",
                                                                   "arguments": '{"city": "Oslo"}'}}]},
                             {"role": "tool", "content": "rain"},
                             {"role": "assistant", "content": "Rain."}], TOOLS),
    "reasoning_content": ([{"role": "user", "content": "2+2?"},
                           {"role": "assistant", "content": "Four.", "reasoning_content": "Add two and two."},
                           {"role": "user", "content": "3+3?"},
                           {"role": "assistant", "content": "Six.", "reasoning_content": "Add three twice."}], None),
    "think_in_content": ([{"role": "user", "content": "Capital of France?"},
                          {"role": "assistant", "content": "<think>\nThe quick answer.\n</think>\n\nParis."}], None),
}


def _rich_cases():
    for name, (messages, tools) in RICH.items():
        templates = ["tools"] if tools else sorted(EOS)
        for template in templates:
            for mask in (False, True):
                yield pytest.param(template, name, mask, id=f"{template}-{name}-{'mask' if mask else 'learn'}")


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("template", sorted(EOS))
def test_labels_match_the_slow_reference(tokenizers, encoders, template, conversation):
    messages = CONVERSATIONS[conversation]
    input_ids, labels = reference_labels(tokenizers[template], messages, EOS[template])
    sample = encode(encoders[template], messages)
    assert sample.input_ids == input_ids and sample.labels == labels


@pytest.mark.parametrize("template, name, mask_reasoning", list(_rich_cases()))
def test_tools_and_reasoning_match_the_slow_reference(tokenizers, template, name, mask_reasoning):
    messages, tools = RICH[name]
    if template in ALTERNATING:
        messages = [m for m in messages if m["role"] != "system"]
    tok = tokenizers[template]
    encoder = ChatEncoder(tok, max_sample_num_tokens=1 << 30, mask_reasoning=mask_reasoning)
    row = {"messages": messages, **({"tools": tools} if tools else {})}
    (sample,) = encoder.encode_rows([json.dumps(row).encode()])
    assert not isinstance(sample, SampleError), sample
    clean = [{"content": "", **m} for m in messages]  # a tool-call-only turn is rendered with content ''
    input_ids, labels = reference_labels(tok, clean, EOS[template], tools=tools, mask_reasoning=mask_reasoning)
    assert sample.input_ids == input_ids
    assert sample.input_ids == list(tok.apply_chat_template(clean, tools=tools)["input_ids"])
    assert sample.labels == labels


def _learned_text(tok, input_ids: list[int], labels: list[int]) -> list[str]:
    """The learned runs, decoded."""
    runs, run = [], []
    for token, label in zip(input_ids, labels):
        if label != IGNORE_INDEX:
            run.append(token)
        elif run:
            runs.append(run)
            run = []
    if run:
        runs.append(run)
    return [tok.decode(r, clean_up_tokenization_spaces=False) for r in runs]


def test_tool_call_is_learned_and_tool_result_masked(tokenizers, tiny_models, tmp_path):
    messages, tools = RICH["tool_call_only"]
    data, rejected, summary = run(tmp_path, tiny_models["tools"], [{"id": 1, "messages": messages, "tools": tools}])
    assert not rejected and "tools" not in data[0]
    tok = tokenizers["tools"]
    text = tok.decode(data[0]["input_ids"])
    assert '"name": "get_weather"' in text and "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    learned = _learned_text(tok, data[0]["input_ids"], data[0]["labels"])
    assert learned == ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                       "It is sunny.<|im_end|>"]
    assert summary["tokenizer"]["end_of_turn_token"] == "<|im_end|>"


def test_template_without_tool_calls_rejects_such_rows(tiny_models, tmp_path):
    messages, tools = RICH["tool_call_only"]
    data, rejected, summary = run(tmp_path, tiny_models["chatml"],
                                  [{"messages": messages, "tools": tools}, GOOD], max_rejected_fraction=0.5)
    assert len(data) == 1 and rejected[0]["reason"] == "tool_calls_not_rendered"
    assert "does not render tool_calls" in rejected[0]["detail"]


@pytest.mark.parametrize("mask_reasoning", [False, True])
def test_reasoning_is_learned_unless_masked(tokenizers, mask_reasoning):
    tok = tokenizers["qwen3think"]
    messages = RICH["reasoning_content"][0]
    sample = encode(ChatEncoder(tok, max_sample_num_tokens=1 << 30, mask_reasoning=mask_reasoning), messages)
    learned = _learned_text(tok, sample.input_ids, sample.labels)
    # Qwen3 drops the reasoning of turns before the last user message: the first reply is learned as shown.
    assert learned[0] == "Four.<|im_end|>"
    if mask_reasoning:
        assert learned[1:] == ["<think>\n", "\n</think>\n\nSix.<|im_end|>"]
    else:
        assert learned[1:] == ["<think>\nAdd three twice.\n</think>\n\nSix.<|im_end|>"]


def test_space_prefixed_reply_keeps_its_first_token(tokenizers, encoders):
    """Mistral v0.1 / Llama-2: ' ' + reply; the first word's token carries the template's space."""
    tok = tokenizers["llama2"]
    messages = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris"}]
    sample = encode(encoders["llama2"], messages)
    assert _learned_text(tok, sample.input_ids, sample.labels) == [" Paris</s>"]


def test_end_of_turn_is_detected_not_assumed_eos(tokenizers, encoders, tiny_models, tmp_path):
    assert tokenizers["gemma"].eos_token == "<eos>"
    assert {name: encoder.end_of_turn_token for name, encoder in encoders.items()} == EOS
    data, _, summary = run(tmp_path, tiny_models["gemma"], [GOOD])
    assert summary["tokenizer"]["end_of_turn_token"] == "<end_of_turn>" and summary["num_written"] == 1


def test_end_of_turn_override_and_undetectable_template(tokenizers, tmp_path):
    plain = ("{%- for message in messages %}{{- message['role'] + ': ' + message['content'] + '\\n\\n' }}"
             "{%- endfor %}{%- if add_generation_prompt %}{{- 'assistant:' }}{%- endif %}")
    template_file = tmp_path / "plain.jinja"
    template_file.write_text(plain)
    input_file = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    argv = ["--input-file", str(input_file), "--model-name-or-path", str(tmp_path / "tok"), "--num-proc", "1",
            "--chat-template", str(template_file)]
    tokenizers["chatml"].save_pretrained(tmp_path / "tok")
    with pytest.raises(SystemExit) as err:
        main([*argv, "--output-dir", str(tmp_path / "a")])
    assert "--end-of-turn-token" in str(err.value) and "\n" not in str(err.value)
    summary = main([*argv, "--output-dir", str(tmp_path / "b"), "--end-of-turn-token", "\n\n"])
    (row,) = read_jsonl(tmp_path / "b" / "data.jsonl")
    tok = tokenizers["chatml"]
    learned = tok.decode([x for x in row["labels"] if x != IGNORE_INDEX])
    assert learned == " Hi! How can I help you today?\n\n"
    assert summary["tokenizer"]["chat_template_source"] == str(template_file)
    assert summary["tokenizer"]["chat_template"] == plain and summary["tokenizer"]["end_of_turn_token"] == "\n\n"


def test_no_sample_written_exits_non_zero_with_counts(tiny_models, tmp_path):
    input_file = write_jsonl(tmp_path / "in.jsonl", ["nope", {"messages": []}, {"messages": []}])
    with pytest.raises(SystemExit) as err:
        main(["--input-file", str(input_file), "--output-dir", str(tmp_path / "out"), "--model-name-or-path",
              str(tiny_models["chatml"]), "--num-proc", "1"])
    assert "no sample written" in str(err.value)
    assert "empty_messages 2" in str(err.value) and "invalid_json 1" in str(err.value)


SAME_PAIR = {"prompt": [{"role": "user", "content": "Hi"}], "chosen": [{"role": "assistant", "content": "Same."}],
             "rejected": [{"role": "assistant", "content": "Same."}]}
GOOD_PAIR = {**SAME_PAIR, "rejected": [{"role": "assistant", "content": "Other."}]}


@pytest.mark.parametrize("form", ["output_dir", "output_file"])
def test_a_run_that_writes_no_row_leaves_no_dataset_and_the_same_command_reruns(tiny_models, tmp_path, form):
    """Issue 68: a file of only bad pairs (both sides the same, a side empty) stops in one line naming the file,
    the counts by reason and the first bad row, and leaves no data file or summary (train.py would read an empty
    dataset): only the rejected rows' listing, which the same command replaces once the rows are fixed."""
    side_empty = {**SAME_PAIR, "rejected": []}
    input_file = write_jsonl(tmp_path / "pairs.jsonl", [SAME_PAIR, side_empty, SAME_PAIR])
    out = tmp_path / "out"
    data, listing = (out / "data.jsonl", out / "rejected.jsonl") if form == "output_dir" else \
        (out / "pairs_tkns.jsonl", out / "pairs_tkns.rejected.jsonl")
    argv = ["--input-file", str(input_file), f"--{form.replace('_', '-')}", str(out if form == "output_dir" else data),
            "--model-name-or-path", str(tiny_models["chatml"]), "--num-proc", "1"]
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert str(err.value) == (
        f"process_data.py: error: no pair written from the 3 row(s) of {input_file}; rejected: identical_sides 2, "
        f"empty_side 1 (first: {input_file}:1: identical_sides: chosen and rejected are the same tokens with the "
        f"same labels; each listed in {listing}); no {data.name} or summary was left: fix the rows and run again")
    assert sorted(p.name for p in out.iterdir()) == [listing.name]
    assert [row["reason"] for row in read_jsonl(listing)] == ["identical_sides", "empty_side", "identical_sides"]
    if form == "output_dir":  # train.py --data-path on the folder: refused, never its listing read as raw rows
        from minitrainer.data.cache import is_tokenized
        from minitrainer.data.sampler import load_tokenized_dataset

        assert is_tokenized(out)
        with pytest.raises(ValueError) as refusal:
            load_tokenized_dataset(str(out), cache_dir=str(tmp_path / "cache"))
        assert str(refusal.value) == (
            f"{out} holds only rejected.jsonl: the process_data.py run that wrote it kept no row (each is listed "
            "there with its reason); fix those rows and tokenize again")

    write_jsonl(input_file, [GOOD_PAIR, SAME_PAIR])
    summary = main(argv)  # no --overwrite: the listing alone guards no dataset
    assert summary["num_pairs"] == 1 and len(read_jsonl(data)) == 1
    assert [row["reason"] for row in read_jsonl(listing)] == ["identical_sides"]


def test_an_empty_data_file_an_older_run_left_is_refused_naming_why(tiny_models, tmp_path):
    """What versions before issue 68 left after a run that wrote no row (an empty data.jsonl beside its summary and
    listing) is still refused by the loader train.py reads --data-path with, in one line that says why."""
    from minitrainer.data.cache import is_tokenized
    from minitrainer.data.sampler import load_tokenized_dataset

    out = tmp_path / "old_tkns"
    out.mkdir()
    (out / "data.jsonl").write_bytes(b"")
    (out / "rejected.jsonl").write_text(json.dumps({"line": 1, "reason": "identical_sides", "detail": "..."}) + "\n")
    (out / "summary.json").write_text(json.dumps({
        "kind": "preference", "num_lines": 3, "num_written": 0, "rejected_by_reason": {"identical_sides": 3},
        "outputs": {"data": str(out / "data.jsonl"), "rejected": str(out / "rejected.jsonl"),
                    "summary": str(out / "summary.json")}}))
    assert is_tokenized(out)  # train.py takes the folder as tokenized data and loads it
    with pytest.raises(ValueError) as err:
        load_tokenized_dataset(str(out), cache_dir=str(tmp_path / "cache"))
    assert str(err.value) == (
        f"{out}/data.jsonl: the file is empty (no rows): the process_data.py run that wrote it kept none of its 3 "
        f"input row(s) (rejected: identical_sides 3; listed in {out}/rejected.jsonl, counted in {out}/summary.json); "
        "fix those rows and tokenize again")
    (out / "summary.json").unlink()  # an empty file of no run's: the plain line
    with pytest.raises(ValueError, match=r"data\.jsonl: the file is empty \(no rows\)$"):
        load_tokenized_dataset(str(out), cache_dir=str(tmp_path / "cache"))


def test_every_turn_end_is_learned_with_injected_system_prompt(tokenizers, encoders):
    """qwen25 injects a system prompt; the original tool then masked non-final end tokens."""
    messages = CONVERSATIONS["multi_turn_system"][1:]
    sample = encode(encoders["qwen25"], messages)
    eos_id = tokenizers["qwen25"].eos_token_id
    eos_positions = [i for i, t in enumerate(sample.input_ids) if t == eos_id]
    learned = [i for i in eos_positions if sample.labels[i] == eos_id]
    assert len(eos_positions) == 5 and len(learned) == 2  # system, user, assistant, user, assistant


@pytest.mark.parametrize("template", sorted(EOS))
def test_pretrain_is_content_plus_eos_all_learned(tokenizers, encoders, template):
    tok = tokenizers[template]
    content = "The quick brown fox 🙂 jumps."
    sample = encode(encoders[template], [{"role": "pretrain", "content": content}])
    expected = tok.encode(content, add_special_tokens=False) + [tok.eos_token_id]
    assert sample.input_ids == expected and sample.labels == expected and sample.is_pretrain


def test_tool_results_stay_masked(tokenizers, encoders):
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Calling the tool."},
                {"role": "tool", "content": "sunny, 21 C"}, {"role": "assistant", "content": "It is sunny."}]
    sample = encode(encoders["chatml"], messages)
    learned = [t for t, label in zip(sample.input_ids, sample.labels) if label != IGNORE_INDEX]
    tok = tokenizers["chatml"]
    assert tok.decode(learned) == "Calling the tool.<|im_end|>It is sunny.<|im_end|>"


def test_straddling_token_at_reply_start_is_masked(tmp_path):
    """Header '\\n' + reply's leading spaces can merge into one BPE token: it stays masked."""
    from minitrainer.tools.tiny_model import build_tokenizer

    # A corpus of indented code makes '\\n' + 3 spaces one token, whatever order BPE breaks ties in.
    tok = build_tokenizer("chatml", tmp_path / "tok", corpus=["def f(a, b):\n    return a + b\n"] * 8)
    messages = [{"role": "user", "content": "code?"}, {"role": "assistant", "content": "    return a + b\n"}]
    text = tok.apply_chat_template(messages, tokenize=False)
    reply_start = text.index("    return")
    encoding = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    straddlers = [i for i, (s, e) in enumerate(encoding["offset_mapping"]) if s < reply_start < e]
    assert straddlers, "the vocabulary should merge the newline with the following spaces"
    sample = encode(ChatEncoder(tok, max_sample_num_tokens=1 << 30), messages)
    assert all(sample.labels[i] == IGNORE_INDEX for i in straddlers)
    learned = tok.decode([t for t, label in zip(sample.input_ids, sample.labels) if label != IGNORE_INDEX])
    expected = messages[1]["content"] + "<|im_end|>"
    assert learned != expected and expected.endswith(learned)
    assert expected[: len(expected) - len(learned)].isspace()


# ----------------------------------------------------------------------------
# Other templates: generation markers, non-incremental rendering


def _tokenizer_with_template(tok, template: str, path: Path):
    from transformers import AutoTokenizer

    tok.save_pretrained(path)
    (path / "chat_template.jinja").write_text(template)
    return AutoTokenizer.from_pretrained(path)


def test_generation_markers_change_nothing(tokenizers, tmp_path):
    """The learning rule is the generation prompt's; a template's {% generation %} blocks mark less."""
    marked = ("{%- for message in messages %}{%- if message['role'] == 'assistant' %}"
              "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] }}{% endgeneration %}"
              "{{- '<|im_end|>\\n' }}{%- else %}"
              "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
              "{%- endif %}{%- endfor %}"
              "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    tok = _tokenizer_with_template(tokenizers["chatml"], marked, tmp_path / "marked")
    encoder = ChatEncoder(tok, max_sample_num_tokens=1 << 30)
    messages = CONVERSATIONS["multi_turn_system"]
    plain = encode(ChatEncoder(tokenizers["chatml"], max_sample_num_tokens=1 << 30), messages)
    assert encode(encoder, messages).labels == plain.labels


def test_a_template_that_names_the_developer_role_gets_it(tokenizers, tmp_path):
    """A ``developer`` message is the system message unless the template names the role: then the
    template gets it as it is, and renders it as it chooses."""
    generic = ("{%- for message in messages %}"
               "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
               "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    naming = generic.replace("{%- for message in messages %}",
                             "{%- for message in messages %}{%- if message.role == 'developer' %}"
                             "{{- '<|im_start|>system\\n# Developer\\n' + message['content'] + '<|im_end|>\\n' }}"
                             "{%- continue %}{%- endif %}")
    developer = [{"role": "developer", "content": "Be brief."}, *CONVERSATIONS["single_turn"]]
    system = [{**developer[0], "role": "system"}, *developer[1:]]
    texts = {}
    for name, template in (("generic", generic), ("naming", naming)):
        tok = _tokenizer_with_template(tokenizers["chatml"], template, tmp_path / name)
        encoder = ChatEncoder(tok, max_sample_num_tokens=1 << 30)
        texts[name] = tok.decode(encode(encoder, developer).input_ids)
        assert encoder.developer_as_system == (name == "generic")
        rows = write_jsonl(tmp_path / "developer.jsonl", [{"messages": developer}])
        summary = process_data(ProcessDataConfig(input_file=str(rows), model_name_or_path=str(tmp_path / name),
                                                 num_proc=1, output_dir=str(tmp_path / f"out-{name}")))
        assert summary["tokenizer"]["developer_messages_as"] == ("system" if name == "generic" else "developer")
        assert (encode(encoder, developer).labels == encode(encoder, system).labels) == (name == "generic")
    assert texts["generic"].startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert texts["naming"].startswith("<|im_start|>system\n# Developer\nBe brief.<|im_end|>")


def test_template_rendering_old_turns_differently(tokenizers, tmp_path):
    """Like Qwen3: a <think> block only in the last assistant turn, so a turn's own render is not
    a prefix of the full render; the turn is learned as the full render shows it."""
    qwen3_like = ("{%- for message in messages %}{%- if message['role'] == 'assistant' and loop.last %}"
                  "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message['content'] + '<|im_end|>\\n' }}"
                  "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
                  "{%- endif %}{%- endfor %}"
                  "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    tok = _tokenizer_with_template(tokenizers["chatml"], qwen3_like, tmp_path / "qwen3like")
    sample = encode(ChatEncoder(tok, max_sample_num_tokens=1 << 30), CONVERSATIONS["multi_turn_system"])
    learned = tok.decode([t for t, label in zip(sample.input_ids, sample.labels) if label != IGNORE_INDEX])
    assert learned == "Four.<|im_end|><think>\n\n</think>\n\nIt jumps over the lazy dog.<|im_end|>"
    assert sample.input_ids == list(tok.apply_chat_template(CONVERSATIONS["multi_turn_system"])["input_ids"])


# Located by the sentinels in templates the older rule cannot follow: every rendering changes with the
# conversation's length (no rendering of a prefix is a prefix of the whole); the template writes a
# sentinel's private-use character itself, after every turn, so one follows the last sentinel of each
# generation prompt.
UNUSUAL_TEMPLATES = {
    "counting": ("{{- messages | length }} messages\\n"
                 "{%- for message in messages %}{{- message['role'] + ':\\n' + message['content'] + '<|im_end|>' }}"
                 "{%- endfor %}{%- if add_generation_prompt %}{{- 'assistant:\\n' }}{%- endif %}"),
    "writes_a_sentinel_character": (
        "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>\\n\ue000\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"),
}


@pytest.mark.parametrize("name", sorted(UNUSUAL_TEMPLATES))
def test_replies_are_located_in_the_full_rendering(tokenizers, tmp_path, name):
    tok = _tokenizer_with_template(tokenizers["chatml"], UNUSUAL_TEMPLATES[name], tmp_path / name)
    sample = encode(ChatEncoder(tok, max_sample_num_tokens=1 << 30), CONVERSATIONS["multi_turn_system"])
    assert sample.rule == "sentinel" and sample.num_replies == sample.num_replies_end_learned == 2
    assert _learned_text(tok, sample.input_ids, sample.labels) == [
        "Four.<|im_end|>", "It jumps over the lazy dog.<|im_end|>"]
    assert sample.input_ids == list(tok.apply_chat_template(CONVERSATIONS["multi_turn_system"])["input_ids"])


def test_template_rewriting_a_reply_falls_back_loudly(tokenizers, tmp_path):
    """A template that cuts replies short hides the sentinels: the older incremental rule is used and
    the row says so; a reply it cannot locate either is rejected, never guessed."""
    cutting = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + "
               "message['content'][:22] + '<|im_end|>\\n' }}{%- endfor %}"
               "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    tok = _tokenizer_with_template(tokenizers["chatml"], cutting, tmp_path / "cutting")
    encoder = ChatEncoder(tok, max_sample_num_tokens=1 << 30)
    sample = encode(encoder, CONVERSATIONS["multi_turn_system"])
    assert sample.rule == "incremental"
    assert _learned_text(tok, sample.input_ids, sample.labels) == ["Four.<|im_end|>", "It jumps over the lazy<|im_end|>"]
    counting = "{{- messages | length }}" + cutting
    tok = _tokenizer_with_template(tokenizers["chatml"], counting, tmp_path / "counting")
    with pytest.raises(SampleError) as err:
        encode(ChatEncoder(tok, max_sample_num_tokens=1 << 30), CONVERSATIONS["single_turn"])
    assert err.value.reason == "template_not_incremental"


# ----------------------------------------------------------------------------
# Property: learned tokens are exactly what follows each generation prompt, through its end-of-turn


TEXT = st.text(alphabet=st.sampled_from(list("abcdefghij XYZ0123456789.,!?'\"()\n\t-_äöü中文🙂")), min_size=1, max_size=40)
REPLY = TEXT.filter(lambda s: s.strip())
NAME = st.text(alphabet=st.sampled_from(list("abcxyz_")), min_size=1, max_size=8)


@st.composite
def conversations(draw, template: str):
    messages = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(TEXT)})
    for _ in range(draw(st.integers(1, 4))):
        if template not in ALTERNATING and draw(st.integers(0, 5)) == 0:
            messages.append({"role": "tool", "content": draw(TEXT)})
        messages.append({"role": "user", "content": draw(TEXT)})
        reply = {"role": "assistant", "content": draw(REPLY)}
        if template == "tools" and draw(st.booleans()):
            call = {"name": draw(NAME), "arguments": {"x": draw(TEXT)}}
            reply["tool_calls"] = [{"type": "function", "function": call}]
            if draw(st.booleans()):
                reply["content"] = ""
        if draw(st.integers(0, 2)) == 0:
            reply["reasoning_content"] = draw(REPLY)
        messages.append(reply)
    return messages


@pytest.mark.parametrize("template", sorted(EOS))
def test_property_learned_text_is_what_follows_the_generation_prompt(tokenizers, encoders, template):
    tok, encoder, eot = tokenizers[template], encoders[template], EOS[template]

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(conversations(template))
    def check(messages):
        sample = encode(encoder, messages)
        assert sample.input_ids == list(tok.apply_chat_template(messages, tokenize=True)["input_ids"])
        assert all(label in (token, IGNORE_INDEX) for token, label in zip(sample.input_ids, sample.labels))
        full = tok.apply_chat_template(messages, tokenize=False)
        turns = []
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                start = len(tok.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=False))
                turns.append(full[start:full.index(eot, start) + len(eot)])
        learned = _learned_text(tok, sample.input_ids, sample.labels)
        assert len(learned) == len(turns)
        for text, turn in zip(learned, turns):
            # Only whitespace merged into a token that starts inside the generation prompt can be lost.
            assert turn.endswith(text) and not turn[: len(turn) - len(text)].strip()

    check()


# ----------------------------------------------------------------------------
# Bad input


GOOD = {"id": "good", "messages": CONVERSATIONS["single_turn"]}
BAD_LINES = [
    ('{"messages": [', "invalid_json"),
    ("[1, 2]", "not_an_object"),
    ({"id": 3}, "missing_messages"),
    ({"messages": "hi"}, "messages_not_a_list"),
    ({"messages": []}, "empty_messages"),
    ({"messages": ["hi"]}, "message_not_an_object"),
    ({"messages": [{"role": "User", "content": "x"}, {"role": "assistant", "content": "y"}]}, "unknown_role"),
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "y"}]}, "missing_content"),
    ({"messages": [{"role": "user", "content": {"x": 1}}, {"role": "assistant", "content": "y"}]},
     "non_string_content"),
    ({"messages": [{"role": "user", "content": ["x"]}, {"role": "assistant", "content": "y"}]}, "non_text_content"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " \n "}]},
     "empty_assistant_reply"),
    ({"messages": [{"role": "pretrain", "content": "  "}]}, "empty_pretrain"),
    ({"messages": [{"role": "pretrain", "content": "x"}, {"role": "user", "content": "y"}]},
     "pretrain_mixed_with_chat"),
    ({"messages": [{"role": "user", "content": "no reply"}]}, "no_loss_tokens"),
    ({"labels": [1], "messages": CONVERSATIONS["single_turn"]}, "reserved_field"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"name": "f"}]}]},
     "invalid_tool_calls"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [TOOL_CALL]},
                   {"role": "assistant", "content": "y"}]}, "invalid_tool_calls"),
    ({"messages": CONVERSATIONS["single_turn"], "tools": {"name": "f"}}, "invalid_tools"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "reasoning_content": 3}]},
     "non_string_reasoning"),
    ("", "blank_line"),
]


def test_every_bad_line_is_counted_and_listed(tiny_models, tokenizers, tmp_path):
    max_len = len(tokenizers["chatml"].apply_chat_template(GOOD["messages"])["input_ids"])
    long = {"id": "long", "messages": [GOOD["messages"][0], {"role": "assistant", "content": "Hi there! " * 10}]}
    rows = [GOOD] + [line for line, _ in BAD_LINES] + [long]
    data, rejected, summary = run(tmp_path, tiny_models["chatml"], rows, max_sample_num_tokens=max_len,
                                  max_rejected_fraction=1.0)
    assert [row["id"] for row in data] == ["good"]
    expected = [{"line": i + 2, "reason": reason} for i, (_, reason) in enumerate(BAD_LINES)]
    expected.append({"line": len(rows), "reason": "too_long"})
    assert [{"line": r["line"], "reason": r["reason"]} for r in rejected] == expected
    assert all(r["detail"] for r in rejected)
    assert summary["num_written"] == 1 and summary["num_rejected"] == len(BAD_LINES) + 1
    assert summary["rejected_by_reason"]["too_long"] == 1 and summary["num_lines"] == len(rows)


@given(num_tokens=st.integers(1, 60), max_tokens=st.integers(2, 12))
def test_pieces_of_a_long_text_predict_each_token_once(num_tokens, max_tokens):
    """A sample's first token is never a target: the pieces' targets are exactly the whole sample's."""
    ids = list(range(100, 100 + num_tokens))
    pieces = Sample(ids, [(0, num_tokens)], num_tokens, is_pretrain=True, extra={"id": "x"}).pieces(max_tokens)
    assert all(1 <= len(p.input_ids) <= max_tokens and p.labels == p.input_ids for p in pieces)
    assert all(p.extra == {"id": "x"} and p.is_pretrain for p in pieces)
    targets = [token for piece in pieces for token in piece.input_ids[1:]]
    assert targets == ids[1:] and pieces[0].input_ids[0] == ids[0]
    assert all(a.input_ids[-1] == b.input_ids[0] for a, b in zip(pieces, pieces[1:]))
    assert (len(pieces) == 1) == (num_tokens <= max_tokens)


def test_only_a_fully_learned_sample_splits():
    chat = Sample([1, 2, 3, 4, 5], [(2, 5)], 3, is_pretrain=False, extra={})
    assert chat.pieces(5) == [chat]
    with pytest.raises(ValueError, match="only a fully learned sample"):
        chat.pieces(4)


def test_split_long_text_keeps_every_token_of_a_long_text_row(tiny_models, tokenizers, tmp_path):
    """Without the flag a text row over the limit is too_long (and the detail names the flag); with it,
    the row's pieces hold its tokens, and conversations over the limit stay too_long either way."""
    tok = tokenizers["chatml"]
    limit = len(tok.apply_chat_template(GOOD["messages"])["input_ids"]) - 1
    text = "The quick brown fox jumps over the lazy dog. " * limit
    whole = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    rows = [{"id": "doc", "text": text}, GOOD, {"id": "short", "text": "Short."}]
    (tmp_path / "reject").mkdir()
    (tmp_path / "split").mkdir()
    data, rejected, summary = run(tmp_path / "reject", tiny_models["chatml"], rows, max_sample_num_tokens=limit,
                                  max_rejected_fraction=1.0)
    assert [(r["line"], r["reason"]) for r in rejected] == [(1, "too_long"), (2, "too_long")]
    assert "--split-long-text" in rejected[0]["detail"] and "--split-long-text" not in rejected[1]["detail"]
    data, rejected, summary = run(tmp_path / "split", tiny_models["chatml"], rows, max_sample_num_tokens=limit,
                                  max_rejected_fraction=1.0, split_long_text=True)
    assert [(r["line"], r["reason"]) for r in rejected] == [(2, "too_long")]
    pieces = [row for row in data if row["id"] == "doc"]
    assert len(pieces) > 2 and all(row["len"] <= limit and row["labels"] == row["input_ids"] for row in pieces)
    assert pieces[0]["input_ids"] + [t for row in pieces[1:] for t in row["input_ids"][1:]] == whole
    assert [row["id"] for row in data] == ["doc"] * len(pieces) + ["short"]
    assert summary["num_lines"] == 3 and summary["num_written"] == len(pieces) + 1
    assert summary["num_split_rows"] == 1 and summary["num_split_samples"] == len(pieces)
    assert summary["num_pretrain"] == summary["num_written"] and summary["num_rejected"] == 1


def test_split_long_text_needs_room_for_a_target(tmp_path):
    with pytest.raises(ValueError, match="--split-long-text needs --max-sample-num-tokens >= 2"):
        ProcessDataConfig(input_file="x.jsonl", model_name_or_path="m", output_dir=str(tmp_path),
                          max_sample_num_tokens=1, split_long_text=True)


def test_template_refusal_does_not_stop_the_run(tiny_models, tmp_path):
    not_alternating = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                                    {"role": "assistant", "content": "c"}]}
    data, rejected, _ = run(tmp_path, tiny_models["mistral"], [not_alternating, GOOD], max_rejected_fraction=0.5)
    assert [row["id"] for row in data] == ["good"]
    assert rejected[0]["line"] == 1 and rejected[0]["reason"] == "template_error"
    assert "alternate" in rejected[0]["detail"]


def test_output_row_carries_fields_and_counts(tiny_models, tmp_path):
    row = {"id": 7, "source": {"name": "unit", "tags": ["a"]}, "messages": CONVERSATIONS["single_turn"]}
    (out,), _, summary = run(tmp_path, tiny_models["llama3"], [row])
    assert list(out) == ["input_ids", "labels", "len", "num_loss_counted_tokens", "id", "source"]
    assert out["id"] == 7 and out["source"] == row["source"]
    assert out["len"] == len(out["input_ids"]) == len(out["labels"])
    assert out["num_loss_counted_tokens"] == sum(label != IGNORE_INDEX for label in out["labels"])
    assert summary["tokenizer"]["masking"] == "sentinel"
    assert summary["tokenizer"]["chat_template_source"] == "tokenizer"
    assert summary["config"]["model_name_or_path"] == str(tiny_models["llama3"])


def test_strict_stops_at_first_bad_line(tiny_models, tmp_path):
    input_file = write_jsonl(tmp_path / "in.jsonl", [GOOD, GOOD, "nope", {"messages": []}])
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as err:
        main(["--input-file", str(input_file), "--output-dir", str(out), "--model-name-or-path",
              str(tiny_models["chatml"]), "--num-proc", "1", "--strict"])
    assert str(err.value).endswith(f"{input_file}:3: invalid_json: Expecting value: line 1 column 1 (char 0)")
    assert not (out / "data.jsonl").exists() and not (out / "summary.json").exists()
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]


def test_a_cut_off_json_line_is_said_so_with_its_file_and_line_and_counted(tiny_models, tmp_path, caplog):
    """A file cut short (or a write interrupted) leaves a line json reports as "Invalid control character at:
    line 1 column 58" or "Unterminated string starting at": it is said in plain words, listed and counted like
    any bad row; an error inside a line keeps json's message."""
    good = json.dumps(GOOD)
    cut = good[:57]
    input_file = tmp_path / "in.jsonl"
    input_file.write_text("\n".join([good, cut, good, '{"id": x}', good[:30]]))  # the last line has no newline
    cut_off = "the JSON is cut off after {} characters (the file was truncated or a write was interrupted)"
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            summary = process_data(ProcessDataConfig(input_file=str(input_file), output_dir=str(tmp_path / "out"),
                                                     model_name_or_path=str(tiny_models["chatml"]), num_proc=1))
    finally:
        logger.removeHandler(caplog.handler)
    rejected = read_jsonl(tmp_path / "out" / "rejected.jsonl")
    assert [(r["line"], r["reason"], r["detail"]) for r in rejected] == [
        (2, "invalid_json", cut_off.format(57)), (4, "invalid_json", "Expecting value: line 1 column 8 (char 7)"),
        (5, "invalid_json", cut_off.format(30))]
    assert summary["num_written"] == 2 and summary["input_errors"]["by_reason"] == {"invalid_json": 3}
    assert f"input error example invalid_json, line 2: {cut_off.format(57)}" in caplog.text
    with pytest.raises(SystemExit) as err:
        main(["--input-file", str(input_file), "--output-dir", str(tmp_path / "strict"), "--model-name-or-path",
              str(tiny_models["chatml"]), "--num-proc", "1", "--strict"])
    assert str(err.value).endswith(f"{input_file}:2: invalid_json: {cut_off.format(57)}")


def test_examples_name_their_file_when_the_input_has_several(tiny_models, tokenizers, tmp_path, caplog):
    """A glob of shards, each with a row too long on its line 2: the examples said "line 2" six times over."""
    max_len = len(tokenizers["chatml"].apply_chat_template(GOOD["messages"])["input_ids"])
    long = {"id": "long", "messages": [GOOD["messages"][0], {"role": "assistant", "content": "Hi there! " * 10}]}
    folder = tmp_path / "shards"
    folder.mkdir()
    files = [str(write_jsonl(folder / f"{name}.jsonl", [GOOD, long, "nope"])) for name in ("a", "b")]
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            summary = process_data(ProcessDataConfig(
                input_file=str(folder / "*.jsonl"), output_dir=str(tmp_path / "out"), num_proc=1,
                model_name_or_path=str(tiny_models["chatml"]), max_sample_num_tokens=max_len))
    finally:
        logger.removeHandler(caplog.handler)
    examples = summary["input_errors"]["examples"]
    assert [(e["file"], e["line"]) for e in examples["too_long"]] == [(files[0], 2), (files[1], 2)]
    assert [(e["file"], e["line"]) for e in examples["invalid_json"]] == [(files[0], 3), (files[1], 3)]
    assert [(r["file"], r["line"], r["reason"]) for r in read_jsonl(tmp_path / "out" / "rejected.jsonl")] == [
        (files[0], 2, "too_long"), (files[0], 3, "invalid_json"), (files[1], 2, "too_long"),
        (files[1], 3, "invalid_json")]
    for file in files:
        assert f"input error example too_long, {file} line 2: " in caplog.text
        assert f"input error example invalid_json, {file} line 3: " in caplog.text


@pytest.mark.parametrize("problem", ["missing", "empty", "output_exists", "no_template", "two_outputs"])
def test_whole_run_problems(tiny_models, tokenizers, tmp_path, problem):
    input_file = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    model = tiny_models["chatml"]
    argv = ["--output-dir", str(tmp_path / "out"), "--num-proc", "1"]
    if problem == "missing":
        input_file = tmp_path / "absent.jsonl"
        message = "does not exist"
    elif problem == "empty":
        input_file.write_text("\n  \n")
        message = "is empty"
    elif problem == "output_exists":
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "data.jsonl").write_text("old\n")
        message = "pass --overwrite"
    elif problem == "no_template":
        model = tmp_path / "no_template"
        tokenizers["chatml"].save_pretrained(model)
        (model / "chat_template.jinja").unlink()
        message = "has no chat template, but"
    else:
        argv += ["--output-file", str(tmp_path / "x.jsonl")]
        message = "exactly one of --output-dir and --output-file"
    with pytest.raises(SystemExit) as err:
        main(["--input-file", str(input_file), "--model-name-or-path", str(model), *argv])
    assert err.value.code != 0
    if problem == "two_outputs":
        return  # argparse printed the usage error
    assert message in str(err.value) and "\n" not in str(err.value)


def test_pretrain_only_needs_no_template(tokenizers, tmp_path):
    model = tmp_path / "no_template"
    tokenizers["llama3"].save_pretrained(model)
    (model / "chat_template.jinja").unlink()
    data, rejected, _ = run(tmp_path, model, [{"messages": [{"role": "pretrain", "content": "Plain text."}]}])
    assert len(data) == 1 and not rejected and data[0]["labels"] == data[0]["input_ids"]


def test_overwrite_replaces_output(tiny_models, tmp_path):
    run(tmp_path, tiny_models["chatml"], [GOOD])
    data, _, _ = run(tmp_path, tiny_models["chatml"], [GOOD, GOOD], overwrite=True)
    assert len(data) == 2


# ----------------------------------------------------------------------------
# Helpers, determinism, CLI


def test_labels_from_token_spans_and_printing(tokenizers):
    assert labels_from_token_spans([5, 6, 7, 8], [(1, 3)]) == [IGNORE_INDEX, 6, 7, IGNORE_INDEX]
    tok = tokenizers["chatml"]
    ids = tok.encode("ab<|im_end|>", add_special_tokens=False)
    labels = [IGNORE_INDEX] + ids[1:]
    assert render_labels(tok, ids, labels, "<M>") == "<M>" + tok.decode(ids[1:])
    assert parse_row(b'{"messages": [{"role": "user", "content": "x", "name": null}]}')[0] == [
        {"role": "user", "content": "x"}]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "process_data.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_num_proc_2_is_byte_identical_to_1_and_cli_round_trip(tiny_models, tmp_path, capfd):
    """--num-proc 2 writes the bytes --num-proc 1 does (each through ``main``, what the command runs); the command
    itself, one real process, writes the same tokens to an --output-file."""
    rows = []
    for i in range(150):
        name = sorted(CONVERSATIONS)[i % len(CONVERSATIONS)]
        rows.append({"id": i, "messages": CONVERSATIONS[name]})
        if i % 17 == 0:
            rows.append(BAD_LINES[i % len(BAD_LINES)][0])
        if i % 23 == 0:
            rows.append({"id": f"p{i}", "messages": [{"role": "pretrain", "content": f"Document number {i}."}]})
    input_file = write_jsonl(tmp_path / "in.jsonl", rows)
    outputs = {}
    for num_proc in (1, 2):
        out = tmp_path / f"out{num_proc}"
        main(["--input-file", str(input_file), "--output-dir", str(out), "--model-name-or-path",
              str(tiny_models["qwen3"]), "--num-proc", str(num_proc), "--chunk-size", "16",
              "--max-rejected-fraction", "0.1"])  # returns: exit status 0
        assert "<|mAsK|>" in capfd.readouterr().err  # the printed samples
        assert sorted(p.name for p in out.iterdir()) == ["data.jsonl", "rejected.jsonl", "summary.json"]
        outputs[num_proc] = [(out / name).read_bytes() for name in ("data.jsonl", "rejected.jsonl")]
    assert outputs[1] == outputs[2]
    assert outputs[1][0].count(b"\n") == 150 + 7

    single = tmp_path / "single" / "tokens.jsonl"
    result = _cli("--input-file", str(input_file), "--output-file", str(single), "--model-name-or-path",
                  str(tiny_models["qwen3"]), "--num-proc", "2", "--string-for-printing-masks", "[M]",
                  "--max-rejected-fraction", "0.1")
    assert result.returncode == 0, result.stderr
    assert "[M]" in result.stderr
    assert sorted(p.name for p in single.parent.iterdir()) == [
        "tokens.jsonl", "tokens.rejected.jsonl", "tokens.summary.json"]
    assert single.read_bytes() == outputs[1][0]


# ----------------------------------------------------------------------------
# Label audit


def test_audit_reports_what_is_learned(tiny_models, tokenizers, tmp_path):
    rows = [GOOD, {"messages": CONVERSATIONS["multi_turn_system"]},
            {"messages": [{"role": "pretrain", "content": "Plain text."}]}]
    data, _, summary = run(tmp_path, tiny_models["gemma"], rows)
    audit = summary["audit"]
    chat = [row for row in data if row["labels"] != row["input_ids"]]
    learned = sum(row["num_loss_counted_tokens"] for row in chat) / sum(row["len"] for row in chat)
    assert audit["learned_token_fraction"] == round(learned, 4) and 0 < learned < 1
    assert audit["num_replies"] == audit["num_replies_end_of_turn_learned"] == 3
    assert audit["num_chat_rows_in"] == audit["num_chat_rows_written"] == 2
    assert audit["rows_by_rule"] == {"sentinel": 2} and audit["passed"] and not audit["broken_rules"]


def test_plain_prompt_completion_rows_are_counted_as_such(tiny_models, tmp_path, caplog):
    """Issue 54: plain-string prompt/completion rows are neither pretrain (every token learned) nor chat;
    they are counted apart, with the share of their tokens learned, and the audit does not call them chat."""
    plain = [{"prompt": f"Question {i}: what is {i}+{i}? Answer:", "completion": f" {2 * i}"} for i in range(4)]
    text = {"messages": [{"role": "pretrain", "content": "Plain text."}]}
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            data, _, summary = run(tmp_path, tiny_models["chatml"], [*plain, text])
    finally:
        logger.removeHandler(caplog.handler)
    assert (summary["num_written"], summary["num_chat"], summary["num_prompt_completion"],
            summary["num_pretrain"]) == (5, 0, 4, 1)
    audit = summary["audit"]
    learned = sum(row["num_loss_counted_tokens"] for row in data[:4]) / sum(row["len"] for row in data[:4])
    assert audit["num_prompt_completion_rows"] == 4 and 0 < learned < 1
    assert audit["prompt_completion_learned_token_fraction"] == round(learned, 4)
    assert audit["num_chat_rows_in"] == audit["num_chat_rows_written"] == 0 and audit["passed"]
    assert "of chat tokens learned" not in caplog.text
    assert f"{100 * round(learned, 4):.1f}% of the tokens of 4 plain prompt/completion rows learned" in caplog.text
    assert "(0 chat, 4 prompt/completion, 1 pretrain," in caplog.text


PYTHON_API = """
import json, sys
from minitrainer import ProcessDataConfig, process_data

summary = process_data(ProcessDataConfig(input_file=sys.argv[1], output_dir=sys.argv[2], model_name_or_path=sys.argv[3],
                                         num_proc=1))
print(json.dumps(summary))
"""


def test_the_python_api_returns_and_logs_the_counts_and_the_audit(tiny_models, tmp_path):
    """Issue 54: process_data() from Python, logging left unset, logs what the command line logs (the counts,
    the label audit), and returns them: rows read, written, dropped by reason, tokens, learned tokens, the audit."""
    user_only = {"messages": [{"role": "user", "content": "no reply"}]}
    input_file = write_jsonl(tmp_path / "in.jsonl", [GOOD, GOOD, user_only, "nope"])
    result = subprocess.run([sys.executable, "-c", PYTHON_API, str(input_file), str(tmp_path / "out"),
                             str(tiny_models["chatml"])], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert (summary["num_lines"], summary["num_written"], summary["num_rejected"]) == (4, 2, 2)
    assert summary["rejected_by_reason"] == {"invalid_json": 1, "no_loss_tokens": 1}
    data = read_jsonl(tmp_path / "out" / "data.jsonl")
    assert summary["num_tokens"] == sum(row["len"] for row in data)
    assert summary["num_loss_counted_tokens"] == sum(row["num_loss_counted_tokens"] for row in data) > 0
    assert summary["audit"]["passed"] and summary["audit"]["num_replies"] == 2
    assert summary == json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (f"INFO wrote 2 samples (2 chat, 0 prompt/completion, 0 pretrain, {summary['num_tokens']} tokens, "
            f"{summary['num_loss_counted_tokens']} loss-counted)") in result.stderr
    assert "INFO label audit: " in result.stderr and "of chat tokens learned" in result.stderr
    assert "skipped 2 bad input row(s)" in result.stderr


def test_audit_fails_on_too_many_rows_the_template_cannot_mask_unless_allowed(tiny_models, tmp_path):
    """The audit counts the conversations the template refused, not bad input (which is skipped)."""
    not_alternating = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                                    {"role": "assistant", "content": "c"}]}
    user_only = {"messages": [{"role": "user", "content": "no reply"}]}
    rows = [GOOD] * 3 + [not_alternating] * 4 + [user_only, "nope"]
    input_file = write_jsonl(tmp_path / "in.jsonl", rows)
    argv = ["--input-file", str(input_file), "--model-name-or-path", str(tiny_models["mistral"]), "--num-proc", "1"]
    with pytest.raises(SystemExit) as err:
        main([*argv, "--output-dir", str(tmp_path / "a")])
    assert ("label audit failed: 4 of 7 conversations could not be masked (57.1% > --max-rejected-fraction 0.01)"
            in str(err.value))
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    audit = summary["audit"]
    assert not audit["passed"] and audit["num_rows_zero_learned"] == 0
    assert audit["rejected_by_reason"] == {"template_error": 4}
    assert [e["line"] for e in audit["examples"]["template_error"]] == [4, 5, 6]  # three per reason
    assert "alternate" in audit["examples"]["template_error"][0]["detail"]
    assert summary["input_errors"]["by_reason"] == {"invalid_json": 1, "no_loss_tokens": 1}
    assert summary["input_errors"]["examples"]["invalid_json"] == [
        {"line": 9, "detail": "Expecting value: line 1 column 1 (char 0)", "text": "nope"}]
    assert summary["rejected_by_reason"] == {"invalid_json": 1, "no_loss_tokens": 1, "template_error": 4}
    assert main([*argv, "--output-dir", str(tmp_path / "b"), "--allow-audit-failures"])["audit"]["broken_rules"]
    assert main([*argv, "--output-dir", str(tmp_path / "c"), "--max-rejected-fraction", "0.6"])["audit"]["passed"]


def test_bad_input_rows_never_fail_the_run(tiny_models, tmp_path):
    """Issue 39: a few broken lines (bad JSON, a missing field) are skipped, counted and listed; exit 0."""
    user_only = {"messages": [{"role": "user", "content": "no reply"}]}
    rows = [GOOD] * 3 + [user_only] * 4 + ["nope", {"id": 9}]
    input_file = write_jsonl(tmp_path / "in.jsonl", rows)
    summary = main(["--input-file", str(input_file), "--model-name-or-path", str(tiny_models["chatml"]),
                    "--num-proc", "1", "--output-dir", str(tmp_path / "out")])
    assert summary["audit"]["passed"] and summary["audit"]["num_chat_rows_in"] == 3
    assert summary["input_errors"]["num_rows"] == 6
    assert summary["input_errors"]["by_reason"] == {"invalid_json": 1, "missing_messages": 1, "no_loss_tokens": 4}
    assert [row["line"] for row in read_jsonl(tmp_path / "out" / "rejected.jsonl")] == [4, 5, 6, 7, 8, 9]


def test_audit_rule_on_replies_without_a_learned_end(tiny_models):
    from minitrainer.data.process_data import ChunkAudit, _audit, _Totals

    totals = _Totals()
    totals.audit = ChunkAudit(num_chat_tokens=100, num_chat_loss_tokens=30, num_replies=3, num_replies_end_learned=2)
    config = ProcessDataConfig(input_file="x.jsonl", model_name_or_path=str(tiny_models["chatml"]), output_dir="o")
    audit = _audit(config, totals, num_lines=0)
    assert audit["broken_rules"] == ["1 of 3 replies have no learned end-of-turn (see --end-of-turn-token)"]


def test_tool_rows_steer_the_end_of_turn_probe(tokenizers, tmp_path):
    """A tool-use template that raises without ``tools`` (as Hermes' does): the run probes with the rows' tools."""
    tool_only = ("{%- if not tools %}{{- raise_exception('tools required') }}{%- endif %}"
                 + tokenizers["tools"].chat_template)
    model = tmp_path / "tool_only"
    _tokenizer_with_template(tokenizers["tools"], tool_only, model)
    messages, tools = RICH["tool_call_only"]
    data, rejected, summary = run(tmp_path, model, [{"messages": messages, "tools": tools}] * 2)
    assert len(data) == 2 and not rejected and summary["tokenizer"]["end_of_turn_tokens"] == ["<|im_end|>"]
    assert summary["audit"]["num_replies_end_of_turn_learned"] == 4
