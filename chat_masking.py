"""Turn one JSONL row into ``(input_ids, labels)``: validation, rendering, masking.

``process_data.py`` drives these over a file with worker processes; everything
here works on one row or one chunk of rows and holds no global state.

The learning rule: what the model must generate after a generation prompt, up
to and including its end-of-turn token. For each assistant message ``i``::

    before = render(messages[:i], add_generation_prompt=True)
    learned characters = [len(before), end of the turn's end-of-turn token)

in ``full = render(messages)``. For a ChatML template (``M`` = ``IGNORE_INDEX``)::

    text    <|im_start|> user \\n Hi <|im_end|> \\n <|im_start|> assistant \\n Hello ! <|im_end|> \\n
    labels       M        M   M  M      M      M       M           M      M  Hello ! <|im_end|>  M

Role headers, system/user/tool text, text the template injects before the
generation prompt (a default system prompt, a date) and whatever it emits
after the end-of-turn token stay masked; a rendered tool call and reasoning
are learned like the reply (``mask_reasoning`` masks the reasoning text). A
pretrain row is ``encode(content) + [eos]``, every token learned.

The end-of-turn token is the tokenizer's special token the template writes
right after a reply (``detect_end_of_turn``), not necessarily ``eos_token``
(Gemma's ``<end_of_turn>``). Inside the turn it is the last occurrence in
``render(messages[:i + 1])`` after ``before``; when the full render shows the
turn differently (Qwen3 dropping an earlier turn's reasoning), the first one in
``full`` after ``before``. ``before`` must be a prefix of ``full``, else the
row is rejected (``template_not_incremental``); it never guesses.

Character spans become token spans through one tokenization of ``full``
(its offsets). Boundary rule: a token belongs to the side of its first
character, so Mistral v0.1's ``' Paris'`` after ``[/INST]`` is learned and
ChatML's newline after ``<|im_end|>`` is not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

import jinja2

from utils import IGNORE_INDEX

VALID_ROLES = ("system", "user", "assistant", "tool", "pretrain")
OUTPUT_FIELDS = ("input_ids", "labels", "len", "num_loss_counted_tokens")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Message fields transformers copies into each other before rendering (``_alias_reasoning_fields``);
# messages carrying any of them take the slower, exact library path.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# What a chat template may raise on a conversation it refuses: raise_exception()
# and undefined lookups are TemplateErrors; bad operands surface as Python errors.
TEMPLATE_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)

CharSpan = tuple[int, int]
Renderer = Callable[[list[dict], bool], str]


class SampleError(Exception):
    """One row cannot become a sample; ``reason`` is a stable slug counted in the summary."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass
class Sample:
    """One tokenized row. ``extra`` holds the row's other top-level fields, in order."""

    input_ids: list[int]
    token_spans: list[tuple[int, int]]  # learned tokens: labels[t0:t1] = input_ids[t0:t1]
    num_loss_counted_tokens: int
    is_pretrain: bool
    extra: dict[str, Any]

    @property
    def labels(self) -> list[int]:
        return labels_from_token_spans(self.input_ids, self.token_spans)

    def to_json_line(self, id_strings: list[str]) -> bytes:
        """The output row, compact. ``id_strings[i] == str(i)``: joining cached strings is ~6x
        faster than ``json.dumps`` on long int lists, which dominated the writing cost.
        """
        strings = [id_strings[i] for i in self.input_ids]
        label_parts, pos = [], 0
        for t0, t1 in self.token_spans:
            label_parts.append(_MASKED * (t0 - pos))
            label_parts.append(",".join(strings[t0:t1]) + ",")
            pos = t1
        label_parts.append(_MASKED * (len(strings) - pos))
        extra = json.dumps(self.extra, ensure_ascii=False, separators=(",", ":"))[1:-1] if self.extra else ""
        line = (f'{{"input_ids":[{",".join(strings)}],"labels":[{"".join(label_parts)[:-1]}],'
                f'"len":{len(strings)},"num_loss_counted_tokens":{self.num_loss_counted_tokens}'
                f'{"," if extra else ""}{extra}}}\n')
        return line.encode("utf-8")


_MASKED = f"{IGNORE_INDEX},"


# ----------------------------------------------------------------------------
# Validation


def parse_row(line: bytes) -> tuple[list[dict], dict[str, Any]]:
    """``parse_chat_row`` without the tools."""
    messages, _, extra = parse_chat_row(line)
    return messages, extra


def parse_chat_row(line: bytes) -> tuple[list[dict], list[dict] | None, dict[str, Any]]:
    """Parse and validate one JSONL line.

    Returns:
        ``(messages, tools, extra)``: the messages (keys with ``None`` values
        dropped, as ``apply_chat_template`` does; a tool-call-only turn gets
        ``content ''``), the row's ``tools`` (JSON schemas, passed to the
        template, not copied to the output) and the row's other fields.

    Raises:
        SampleError: with the reason the row is unusable.
    """
    if not line.strip():
        raise SampleError("blank_line", "the line is empty")
    try:
        row = json.loads(line)
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise SampleError("invalid_json", str(err)) from None
    if not isinstance(row, dict):
        raise SampleError("not_an_object", f"expected a JSON object, got {type(row).__name__}")
    if "messages" not in row:
        raise SampleError("missing_messages", "no 'messages' field")
    messages = row["messages"]
    if not isinstance(messages, list):
        raise SampleError("messages_not_a_list", f"'messages' is a {type(messages).__name__}")
    if not messages:
        raise SampleError("empty_messages", "'messages' is empty")
    reserved = [key for key in OUTPUT_FIELDS if key in row]
    if reserved:
        raise SampleError("reserved_field", f"input field(s) {reserved} would be overwritten by the output")
    clean = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise SampleError("message_not_an_object", f"message {index} is a {type(message).__name__}")
        role = message.get("role")
        if role not in VALID_ROLES:
            raise SampleError("unknown_role", f"message {index} has role {role!r}; allowed: {', '.join(VALID_ROLES)}")
        message = {key: value for key, value in message.items() if value is not None}
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            _check_tool_calls(index, role, tool_calls)
            # A turn that only calls a tool: templates index message['content'], so give it ''.
            message.setdefault("content", "")
        if message.get("content") is None:
            raise SampleError("missing_content", f"message {index} ({role}) has no content")
        if not isinstance(message["content"], str):
            raise SampleError("non_string_content",
                              f"message {index} ({role}) content is a {type(message['content']).__name__}")
        if role == "assistant" and not message["content"].strip() and not tool_calls:
            raise SampleError("empty_assistant_reply", f"message {index} is an empty assistant reply")
        for key in _REASONING_FIELDS:
            if key in message and not isinstance(message[key], str):
                raise SampleError("non_string_reasoning",
                                  f"message {index} {key} is a {type(message[key]).__name__}")
        clean.append(message)
    roles = [message["role"] for message in clean]
    if "pretrain" in roles:
        if len(clean) > 1:
            raise SampleError("pretrain_mixed_with_chat", "a 'pretrain' message must be the only message")
        if not clean[0]["content"].strip():
            raise SampleError("empty_pretrain", "the pretrain content is empty")
    tools = row.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools)):
        raise SampleError("invalid_tools", "'tools' must be a list of JSON schema objects")
    extra = {key: value for key, value in row.items() if key not in ("messages", "tools")}
    return clean, tools or None, extra


def _check_tool_calls(index: int, role: str, tool_calls: Any) -> None:
    if role != "assistant":
        raise SampleError("invalid_tool_calls",
                          f"message {index} ({role}) has tool_calls; only assistant turns call tools")
    if not isinstance(tool_calls, list) or not tool_calls:
        raise SampleError("invalid_tool_calls", f"message {index} tool_calls must be a non-empty list")
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise SampleError("invalid_tool_calls", f"message {index}: each tool call needs "
                                                    "{\"function\": {\"name\": ..., \"arguments\": ...}}")


# ----------------------------------------------------------------------------
# Reply spans (characters)


def reasoning_text(message: dict) -> str:
    """The reasoning of an assistant message: ``reasoning_content`` (or the ``thinking`` / ``reasoning``
    aliases transformers accepts), else a ``<think>`` block in its content."""
    reasoning = next((message[key] for key in _REASONING_FIELDS if isinstance(message.get(key), str)), None)
    if reasoning is None:
        content = message["content"]
        begin, end = content.find(THINK_OPEN), content.find(THINK_CLOSE)
        reasoning = content[begin + len(THINK_OPEN):end] if 0 <= begin < end else ""
    return reasoning.strip()


def turn_spans(render: Renderer, messages: list[dict], *, end_of_turn: str,
               mask_reasoning: bool = False) -> tuple[str, list[CharSpan]]:
    """The learned character spans of every assistant turn, by the learning rule (module docstring).

    Args:
        render: ``render(messages, add_generation_prompt) -> text``; raises
            ``SampleError`` when the template refuses the messages.
        messages: the conversation.
        end_of_turn: the string that ends an assistant turn.
        mask_reasoning: leave each turn's reasoning text (``reasoning_text``) out of its span.

    Returns:
        ``(full_text, spans)``: sorted, disjoint ``[start, end)`` spans in ``full_text``.
    """
    full = render(messages, False)
    spans: list[CharSpan] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(messages[:i], True)
        start = len(before)
        after = full if i == len(messages) - 1 else render(messages[: i + 1], False)
        if not full.startswith(before) or not after.startswith(before):
            raise SampleError("template_not_incremental",
                              f"rendering messages[:{i}] is not a prefix of the conversation; cannot locate reply {i}")
        if spans and start < spans[-1][1]:
            raise SampleError("template_not_incremental", f"assistant message {i} overlaps the previous reply")
        eot = after.rfind(end_of_turn, start)
        if eot < 0:
            raise SampleError("no_end_of_turn", f"assistant message {i}: no {end_of_turn!r} after the generation "
                                                "prompt in its rendered turn")
        if after is not full and not full.startswith(after):
            # The template renders this turn differently once later turns follow (Qwen3 drops
            # the reasoning of turns before the last user message): learn the turn as shown.
            eot = full.find(end_of_turn, start)
            if eot < 0:
                raise SampleError("template_not_incremental", f"assistant message {i} has no {end_of_turn!r} "
                                                              "inside the full conversation")
        end = eot + len(end_of_turn)
        for call in message.get("tool_calls", ()):
            if call["function"]["name"] not in full[start:end]:
                raise SampleError("tool_calls_not_rendered", f"assistant message {i}: the chat template did not "
                                                             f"render tool call {call['function']['name']!r}")
        reasoning = reasoning_text(message) if mask_reasoning else ""
        hidden = full.find(reasoning, start, end) if reasoning else -1
        if hidden >= 0:
            spans += [(start, hidden), (hidden + len(reasoning), end)]
        else:
            spans.append((start, end))
    return full, spans


def detect_end_of_turn(render: Renderer, special_tokens: list[str], eos_token: str | None) -> str | None:
    """The special token the template writes right after an assistant reply, or None.

    Renders a one-exchange conversation with a sentinel reply and reads what
    follows it (whitespace skipped: Llama-2 writes ``' ' + eos``); ``eos_token``
    wins a tie, else the longest special token.
    """
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": _SENTINEL}]
    try:
        text = render(messages, False)
    except SampleError:
        return None
    at = text.rfind(_SENTINEL)
    if at < 0:
        return None
    tail = text[at + len(_SENTINEL):].lstrip()
    if eos_token and tail.startswith(eos_token):
        return eos_token
    matches = [token for token in special_tokens if token and tail.startswith(token)]
    return max(matches, key=len) if matches else None


_SENTINEL = "Sentinel reply 42."


# ----------------------------------------------------------------------------
# Tokens


def token_span(encoding, num_tokens: int, text_len: int, span: CharSpan) -> tuple[int, int]:
    """``[t0, t1)``: the tokens of ``encoding`` whose first character lies in the character span.

    ``encoding`` is a ``tokenizers.Encoding`` of a ``text_len``-character text;
    only its ``char_to_token`` and ``token_to_chars`` are used, so no per-token
    offset list is built.
    """
    a, b = span
    if a >= b:
        return 0, 0
    return (_first_token_from(encoding, num_tokens, text_len, a),
            _first_token_from(encoding, num_tokens, text_len, b))


def _first_token_from(encoding, num_tokens: int, text_len: int, char: int) -> int:
    """The index of the first token whose first character is at or after ``char``."""
    token = encoding.char_to_token(char) if char < text_len else None
    while token is None and char + 1 < text_len:  # a character no token covers (a normalizer dropped it)
        char += 1
        token = encoding.char_to_token(char)
    if token is None:
        return num_tokens
    # Byte-level BPE can split one character over several tokens with equal offsets: step to the first.
    while token > 0 and encoding.token_to_chars(token - 1)[0] >= char:
        token -= 1
    while token < num_tokens and encoding.token_to_chars(token)[0] < char:
        token += 1
    return token


def labels_from_token_spans(input_ids: list[int], token_spans: list[tuple[int, int]]) -> list[int]:
    """Copy ``input_ids`` inside the spans, ``IGNORE_INDEX`` elsewhere (unshifted).

        input_ids  [ h h h r r r E n h h ]      token_spans [(3, 7)]
        labels     [ M M M r r r E M M M ]
    """
    labels = [IGNORE_INDEX] * len(input_ids)
    for t0, t1 in token_spans:
        labels[t0:t1] = input_ids[t0:t1]
    return labels


# ----------------------------------------------------------------------------
# The tokenizer-bound encoder

def _compile_template(chat_template: str):
    """The template compiled exactly as ``apply_chat_template`` compiles it (cached by transformers)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a transformers without it: every render takes render_jinja_template
        return None
    return _compile_jinja_template(chat_template)


class ChatEncoder:
    """Encodes chunks of rows with one Hugging Face fast tokenizer.

    Args:
        tokenizer: a fast tokenizer; its chat template renders the rows.
        max_sample_num_tokens: longer samples are rejected.
        end_of_turn_token: the string that ends an assistant turn; ``None``
            finds it from the template's rendering (``detect_end_of_turn``).
        mask_reasoning: mask each turn's reasoning text instead of learning it.

    Raises:
        ValueError: the template's end-of-turn token cannot be found (one line naming the flag that fixes it).
    """

    masking_method = "generation_prompt"

    def __init__(self, tokenizer, *, max_sample_num_tokens: int, end_of_turn_token: str | None = None,
                 mask_reasoning: bool = False):
        from transformers.utils.chat_template_utils import render_jinja_template

        self.tokenizer = tokenizer
        self.backend = tokenizer.backend_tokenizer
        self.eos_token = tokenizer.eos_token
        self.eos_token_id = tokenizer.eos_token_id
        self.max_sample_num_tokens = max_sample_num_tokens
        self.mask_reasoning = mask_reasoning
        self.chat_template = tokenizer.get_chat_template() if tokenizer.chat_template else None
        self.renders_tool_calls = bool(self.chat_template) and "tool_calls" in self.chat_template
        self._render_jinja_template = render_jinja_template
        self._compiled = _compile_template(self.chat_template) if self.chat_template else None
        self.id_strings = [str(i) for i in range(max(len(tokenizer), self.backend.get_vocab_size(with_added_tokens=True)))]
        # The same variables apply_chat_template passes to the template.
        self._template_kwargs = dict(tokenizer.special_tokens_map)
        self.end_of_turn_token = end_of_turn_token
        if self.chat_template and end_of_turn_token is None:
            special = [token.content for token in tokenizer.added_tokens_decoder.values()]
            self.end_of_turn_token = detect_end_of_turn(self.render, special, self.eos_token)
            if self.end_of_turn_token is None:
                raise ValueError("cannot find the chat template's end-of-turn token: no special token follows a "
                                 "reply in its rendering; pass --end-of-turn-token")

    def render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
        if self.chat_template is None:
            raise SampleError("no_chat_template", "the tokenizer has no chat template")
        try:
            if self._compiled is not None and not any(
                    key in message for message in messages for key in _REASONING_FIELDS):
                # What render_jinja_template does for plain JSON messages without reasoning fields
                # (its copying and aliasing are no-ops then), minus ~60% of the Python overhead.
                return self._compiled.render(messages=messages, tools=tools, documents=None,
                                             add_generation_prompt=add_generation_prompt,
                                             **self._template_kwargs)
            texts, _ = self._render_jinja_template(
                conversations=[messages], tools=tools, chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt, **self._template_kwargs)
        except TEMPLATE_ERRORS as err:
            raise SampleError("template_error", f"the chat template refused the conversation: {err}") from None
        return texts[0]

    def reply_spans(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[str, list[CharSpan]]:
        """The full rendered text and the learned character spans."""
        if not self.renders_tool_calls and any("tool_calls" in message for message in messages):
            raise SampleError("tool_calls_not_rendered", "the chat template does not render tool_calls; "
                                                         "pass --chat-template with one that does")
        render = self.render if tools is None else (lambda msgs, gen: self.render(msgs, gen, tools))
        return turn_spans(render, messages, end_of_turn=self.end_of_turn_token, mask_reasoning=self.mask_reasoning)

    def encode_rows(self, lines: list[bytes]) -> list[Sample | SampleError]:
        """Encode a chunk of JSONL lines; one ``Sample`` or ``SampleError`` per line, in order.

        All texts of the chunk go through the Rust tokenizer in one batch.
        """
        results: list[Sample | SampleError | None] = [None] * len(lines)
        pending = []  # (index, text, spans or None for pretrain, extra)
        for index, line in enumerate(lines):
            try:
                messages, tools, extra = parse_chat_row(line)
                if messages[0]["role"] == "pretrain":
                    pending.append((index, messages[0]["content"], None, extra))
                else:
                    text, spans = self.reply_spans(messages, tools)
                    pending.append((index, text, spans, extra))
            except SampleError as err:
                results[index] = err
        encodings = self.backend.encode_batch([text for _, text, _, _ in pending], add_special_tokens=False)
        for (index, text, spans, extra), encoding in zip(pending, encodings):
            results[index] = self._finish(encoding, len(text), spans, extra)
        return results

    def _finish(self, encoding, text_len: int, spans: list[CharSpan] | None, extra: dict) -> Sample | SampleError:
        input_ids = encoding.ids
        if spans is None:
            input_ids.append(self.eos_token_id)
            token_spans = [(0, len(input_ids))]
        else:
            token_spans = [token_span(encoding, len(input_ids), text_len, span) for span in spans]
        if len(input_ids) > self.max_sample_num_tokens:
            return SampleError("too_long", f"{len(input_ids)} tokens > --max-sample-num-tokens "
                                           f"{self.max_sample_num_tokens}")
        num_loss = sum(t1 - t0 for t0, t1 in token_spans)
        if num_loss == 0:
            return SampleError("no_loss_tokens", "no assistant token is learned in this conversation")
        return Sample(input_ids, [span for span in token_spans if span[1] > span[0]], num_loss,
                      is_pretrain=spans is None, extra=extra)
