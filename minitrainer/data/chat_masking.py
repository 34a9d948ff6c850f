"""Turn one JSONL row into ``(input_ids, labels)``: validation, rendering, masking.

``process_data.py`` drives these over a file with worker processes; everything
here works on one row or one chunk of rows and holds no global state.

The learning rule: what the model generates for each assistant turn in the
rendering of the whole conversation, ``full = render(messages)``: from the end
of that turn's assistant header through its end-of-turn token (and an EOS the
template writes right after it). Turns are located in ``full`` itself: the
conversation is rendered once more with private-use sentinels around every
message's content, and removing them must give ``full`` exactly
(``sentinel_turn_spans``); the header ends where the generation prompt
``render(messages[:i], add_generation_prompt=True)`` stops matching the text
after the previous message. No rendering of a prefix needs to be a prefix of
``full``, so reasoning templates (earlier reasoning stripped, ``<think>\\n`` in
the generation prompt), harmony (earlier turns closed by ``<|end|>``, the last
by ``<|return|>``) and templates moving the system prompt work. For a ChatML
template (``M`` = ``IGNORE_INDEX``)::

    text    <|im_start|> user \\n Hi <|im_end|> \\n <|im_start|> assistant \\n Hello ! <|im_end|> \\n
    labels       M        M   M  M      M      M       M           M      M  Hello ! <|im_end|>  M

Role headers, system/user/tool text, text the template injects and whatever
it emits after the end-of-turn token stay masked; a rendered tool call and
reasoning are learned like the reply (``mask_reasoning`` masks the reasoning
text). A pretrain row is ``encode(content) + [eos]``, every token learned.

The end-of-turn tokens are the tokenizer's special tokens the template writes
right after a reply (``detect_end_of_turn``, probed with and without a system
prompt and with the rows' ``tools``), not necessarily ``eos_token`` (Gemma's
``<end_of_turn>``). Where a template rewrites a reply beyond recognition (the
sentinels do not survive) the older incremental rule is used and the row
records it (``Sample.rule``); where that fails too the row is rejected
(``template_not_incremental``); it never guesses.

Character spans become token spans through one tokenization of ``full``
(its offsets). Boundary rule: a token belongs to the side of its first
character, so Mistral v0.1's ``' Paris'`` after ``[/INST]`` is learned and
ChatML's newline after ``<|im_end|>`` is not.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Container

import jinja2

from minitrainer.common.labels import IGNORE_INDEX

VALID_ROLES = ("system", "developer", "user", "assistant", "tool", "pretrain")
# OpenAI's newer name for the system message: a template that names the role gets it as is, any
# other the system message it knows (``ChatEncoder``).
_NAMES_DEVELOPER = re.compile(r"""(['"])developer\1""")
OUTPUT_FIELDS = ("input_ids", "labels", "len", "num_loss_counted_tokens")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Message fields transformers copies into each other before rendering (``_alias_reasoning_fields``);
# messages carrying any of them take the slower, exact library path.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Whether a turn is learned, as files written for other trainers mark it: OpenAI's ``weight`` (0 / 1), the
# ``train`` / ``training`` booleans that axolotl's ``message_field_training`` commonly names, and the ``loss``
# boolean of FastChat-style agent data (AgentInstruct, AgentGym: false on the in-context examples' replies).
# Templates ignore unknown keys, so a mark that were not read would silently learn a reply its author masked.
_TRAINING_MARKS = ("weight", "train", "training", "loss")
_SPAN_MARKS = ("train_detail", "training_detail")  # axolotl's character spans inside a turn
LEARNING_MARKS = _TRAINING_MARKS + _SPAN_MARKS
_ANY_MARK = frozenset(LEARNING_MARKS)
_NO_REASONING_FIELD = frozenset(_REASONING_FIELDS).isdisjoint  # of a message dict: none of its keys is one

# What a chat template may raise on a conversation it refuses: raise_exception()
# and undefined lookups are TemplateErrors; bad operands surface as Python errors.
# RecursionError: a template's macro may recurse without end on a row it was not written for (Hermes 3's
# json_to_python_type on a tool parameter whose "type" is a string it does not know, such as "date").
TEMPLATE_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError,
                   RecursionError)

CharSpan = tuple[int, int]
Renderer = Callable[[list[dict], bool], str]


class SampleError(Exception):
    """One row cannot become a sample; ``reason`` is a stable slug counted in the summary.

    ``audit`` marks a label-audit finding: the chat template or the masking failed on a row whose
    input was well formed (``encode_rows`` sets it). Otherwise the row itself is bad (an input error).
    ``row_format`` is set by ``formats.read_row`` when the row's format was found.
    """

    def __init__(self, reason: str, detail: str, *, audit: bool = False):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.audit = audit
        self.row_format: str | None = None  # the input format the row was found to be in, when known


@dataclass
class ChatRow:
    """One row in the ``messages`` format, as ``ChatEncoder.encode_rows`` takes it.

    ``formats`` converts the other input formats to it. ``fields`` is the row itself
    (``messages``, optional ``tools``, other fields copied to the output).
    """

    fields: dict[str, Any]
    num_prompt_messages: int = 0  # leading messages never learned (a prompt/completion row's prompt turns)
    num_prompt_chars: int | None = None  # a plain prompt/completion row (one pretrain message): its prompt's characters


@dataclass
class Sample:
    """One tokenized row. ``extra`` holds the row's other top-level fields, in order."""

    input_ids: list[int]
    token_spans: list[tuple[int, int]]  # learned tokens: labels[t0:t1] = input_ids[t0:t1]
    num_loss_counted_tokens: int
    is_pretrain: bool  # a text row: every token learned
    extra: dict[str, Any]
    is_prompt_completion: bool = False  # a plain prompt/completion row: no template, the prompt masked
    rule: str | None = None  # how the replies were located: "sentinel", "incremental"; None for pretrain
    num_replies: int = 0
    num_replies_end_learned: int = 0  # replies whose end-of-turn (and an EOS right after it) is learned
    num_replies_marked: int = 0  # replies shown but not learned: weight 0, or train / training / loss false

    @property
    def labels(self) -> list[int]:
        return labels_from_token_spans(self.input_ids, self.token_spans)

    def pieces(self, max_tokens: int) -> list[Sample]:
        """This sample, or, when it is longer than ``max_tokens`` (only a fully learned one may be),
        its consecutive pieces of at most ``max_tokens`` tokens, each opening with the last token of
        the one before. A sample's first token is never a target, so every token the whole sample
        would predict is predicted by exactly one piece::

            input_ids  a b c d e f g h EOS,  max_tokens 4:  [a b c d] [d e f g] [g h EOS]
        """
        num_tokens = len(self.input_ids)
        if num_tokens <= max_tokens:
            return [self]
        if self.token_spans != [(0, num_tokens)] or max_tokens < 2:
            raise ValueError(f"only a fully learned sample splits into pieces of >= 2 tokens, got spans "
                             f"{self.token_spans[:3]} and max_tokens {max_tokens}")
        return [Sample(ids, [(0, len(ids))], len(ids), is_pretrain=True, extra=self.extra)
                for start in range(0, num_tokens - 1, max_tokens - 1)
                for ids in (self.input_ids[start:start + max_tokens],)]

    def to_json_line(self, id_strings: list[str]) -> bytes:
        """The output row, compact. ``id_strings[i] == str(i)``: joining cached strings is ~6x
        faster than ``json.dumps`` on long int lists, which dominated the writing cost.

        Raises:
            SampleError: a copied field holds a lone surrogate (``lone_surrogate``).
        """
        ids, labels = self.json_lists(id_strings)
        extra = _strict_json(self.extra)[1:-1] if self.extra else ""
        line = (f'{{"input_ids":[{ids}],"labels":[{labels}],'
                f'"len":{len(self.input_ids)},"num_loss_counted_tokens":{self.num_loss_counted_tokens}'
                f'{"," if extra else ""}{extra}}}\n')
        try:
            return line.encode("utf-8")
        except UnicodeEncodeError:  # only the copied fields can hold one: the text was encoded
            raise lone_surrogate(extra) from None

    def json_lists(self, id_strings: list[str]) -> tuple[str, str]:
        """The JSON text of ``input_ids`` and of ``labels``, without their brackets."""
        strings = [id_strings[i] for i in self.input_ids]
        label_parts, pos = [], 0
        for t0, t1 in self.token_spans:
            label_parts.append(_MASKED * (t0 - pos))
            label_parts.append(",".join(strings[t0:t1]) + ",")
            pos = t1
        label_parts.append(_MASKED * (len(strings) - pos))
        return ",".join(strings), "".join(label_parts)[:-1]


@dataclass
class PairSample:
    """One preference pair: two samples of the same prompt, written as one output row."""

    chosen: Sample
    rejected: Sample

    @property
    def num_tokens(self) -> int:
        return len(self.chosen.input_ids) + len(self.rejected.input_ids)

    @property
    def num_loss_counted_tokens(self) -> int:
        return self.chosen.num_loss_counted_tokens + self.rejected.num_loss_counted_tokens

    def to_json_line(self, id_strings: list[str]) -> bytes:
        """The output row (``PAIR_OUTPUT_FIELDS``); ``len`` and ``num_loss_counted_tokens`` are both sides'."""
        chosen_ids, chosen_labels = self.chosen.json_lists(id_strings)
        rejected_ids, rejected_labels = self.rejected.json_lists(id_strings)
        return (f'{{"chosen_input_ids":[{chosen_ids}],"chosen_labels":[{chosen_labels}],'
                f'"rejected_input_ids":[{rejected_ids}],"rejected_labels":[{rejected_labels}],'
                f'"len":{self.num_tokens},"num_loss_counted_tokens":{self.num_loss_counted_tokens}}}\n').encode()


PAIR_OUTPUT_FIELDS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels", "len",
                      "num_loss_counted_tokens")
_MASKED = f"{IGNORE_INDEX},"


def _strict_json(fields: dict[str, Any]) -> str:
    """Copied fields as strict JSON. A table's timestamp, date or time (WildChat's ``timestamp``, a
    pandas ``datetime64`` column) is its ISO 8601 text; any other value JSON has no type for (decimal,
    duration, bytes) is its Python text: these had stopped the run. NaN and infinities (a float column's
    missing values) are null, as pandas and ``datasets`` write them: JSON has no such numbers, and
    pyarrow's reader, the fast path of the ``datasets`` loader train.py uses, refuses them and sends the
    whole file through pandas, in memory."""
    try:
        return json.dumps(fields, ensure_ascii=False, separators=(",", ":"), allow_nan=False, default=_as_text)
    except ValueError:
        return json.dumps(_finite(fields), ensure_ascii=False, separators=(",", ":"), default=_as_text)


def _as_text(value: Any) -> str:
    return value.isoformat() if isinstance(value, (datetime.date, datetime.time)) else str(value)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


# ----------------------------------------------------------------------------
# Validation


def parse_row(line: bytes) -> tuple[list[dict], dict[str, Any]]:
    """``parse_chat_row`` without the tools."""
    messages, _, extra, _ = parse_chat_row(line)
    return messages, extra


def load_row(line: bytes) -> dict[str, Any]:
    """One JSON line as a dict; ``SampleError`` for a blank line, bad JSON or a non-object."""
    if not line.strip():
        raise SampleError("blank_line", "the line is empty")
    try:
        row = json.loads(line)
    except UnicodeDecodeError as err:
        raise SampleError("invalid_utf8", f"the line is not UTF-8 ({err.reason} at byte {err.start}); "
                                          "save the file as UTF-8") from None
    except (ValueError, RecursionError) as err:
        raise SampleError("invalid_json", str(err)) from None
    if not isinstance(row, dict):
        raise SampleError("not_an_object", f"expected a JSON object, got {type(row).__name__}")
    return row


def json_field(value: str, reason: str, what: str) -> Any:
    """A field that holds JSON as text, parsed; ``SampleError(reason)`` saying ``what`` is not JSON."""
    try:
        return json.loads(value)
    except ValueError as err:
        raise SampleError(reason, f"{what} is not JSON: {err}") from None


def parse_chat_row(line: bytes) -> tuple[list[dict], list[dict] | None, dict[str, Any], tuple[int, ...]]:
    """Parse and validate one JSONL line in the ``messages`` format (``load_row`` + ``check_row``)."""
    return check_row(load_row(line))


def check_row(row: dict[str, Any]) -> tuple[list[dict], list[dict] | None, dict[str, Any], tuple[int, ...]]:
    """Validate one row in the ``messages`` format.

    Returns:
        ``(messages, tools, extra, unlearned)``: the messages (keys with ``None`` values dropped, as
        ``apply_chat_template`` does, and empty ``tool_calls`` lists; a tool-call-only turn gets
        ``content ''``; text parts joined into one string; tool-call arguments given as a JSON string
        parsed), the row's ``tools`` (JSON schemas, passed to the template, not copied to the output),
        the row's other fields, and the indices of the assistant turns marked ``"weight": 0`` (shown,
        not learned).

    Raises:
        SampleError: with the reason the row is unusable.
    """
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
    clean, unlearned = [], []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise SampleError("message_not_an_object", f"message {index} is a {type(message).__name__}")
        role = message.get("role")
        if role not in VALID_ROLES:
            raise SampleError("unknown_role", f"message {index} has role {role!r}; allowed: {', '.join(VALID_ROLES)}")
        message = {key: value for key, value in message.items() if value is not None}
        if not _ANY_MARK.isdisjoint(message) and not _learned(index, role, message):
            unlearned.append(index)
        tool_calls = message.get("tool_calls")
        if tool_calls == []:  # what serialisers write for "no calls"; vLLM drops it too
            del message["tool_calls"]
            tool_calls = None
        if tool_calls is not None:
            message["tool_calls"] = _checked_tool_calls(index, role, tool_calls)
            # A turn that only calls a tool: templates index message['content'], so give it ''.
            message.setdefault("content", "")
        if message.get("content") is None:
            raise SampleError("missing_content", f"message {index} ({role}) has no content")
        if not isinstance(message["content"], str):
            message["content"] = _text_of_parts(index, role, message["content"])
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
    return clean, tools or None, extra, tuple(unlearned)


def _learned(index: int, role: str, message: dict[str, Any]) -> bool:
    """Whether an assistant turn is learned, by its marks (``_TRAINING_MARKS``, removed from ``message``):
    OpenAI's fine-tuning ``weight`` 0 shows the turn without learning it, 1 (the default) learns it;
    ``train`` / ``training`` / ``loss`` say the same as false / true. Other roles are never learned (a pretrain
    message always is), which their marks must not contradict."""
    spans = [key for key in _SPAN_MARKS if key in message]
    if spans:
        raise SampleError("invalid_weight", f"message {index} ({role}) has {spans[0]}: marks inside a turn are not "
                                            "supported; mark the whole turn (train, training, loss or weight)")
    weights = set()
    for key in _TRAINING_MARKS:
        if key not in message:
            continue
        mark = message.pop(key)
        if key == "weight" and mark not in (0, 1) or key != "weight" and not isinstance(mark, bool):
            expected = "0 or 1" if key == "weight" else "true or false"
            raise SampleError("invalid_weight", f"message {index} ({role}) has {key} {mark!r}; expected {expected}")
        weights.add(int(mark))
    learned = role in ("assistant", "pretrain")
    if len(weights) > 1:
        raise SampleError("invalid_weight", f"message {index} ({role}) has marks that disagree on learning it")
    if role != "assistant" and weights - {learned}:
        raise SampleError("invalid_weight", f"message {index} ({role}) is marked to be "
                                            f"{'not learned' if learned else 'learned'}: only assistant turns are "
                                            "chosen by weight; a pretrain message is always learned, others never")
    return weights != {0}


def _text_of_parts(index: int, role: str, content: Any) -> str:
    """Content as OpenAI's list of text parts: the texts joined by newlines, as vLLM serves them to a
    template that takes string content (the way it serves this toolkit's checkpoints)."""
    if not isinstance(content, list):
        raise SampleError("non_string_content", f"message {index} ({role}) content is a {type(content).__name__}")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise SampleError("non_text_content", f"message {index} ({role}) has a content part of type {kind!r}; "
                                                  'only text parts ({"type": "text", "text": ...}) are trained on')
        texts.append(part["text"])
    return "\n".join(texts)


def _checked_tool_calls(index: int, role: str, tool_calls: Any) -> list[dict]:
    """The turn's tool calls, arguments given as a JSON string (OpenAI's format) parsed into their
    object, as vLLM does before rendering: templates write ``arguments | tojson``, which would quote
    the string a second time. Missing or empty arguments become ``{}``, as there."""
    if role != "assistant":
        raise SampleError("invalid_tool_calls",
                          f"message {index} ({role}) has tool_calls; only assistant turns call tools")
    if not isinstance(tool_calls, list) or not tool_calls:
        raise SampleError("invalid_tool_calls", f"message {index} tool_calls must be a list")
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise SampleError("invalid_tool_calls", f"message {index}: each tool call needs "
                                                    "{\"function\": {\"name\": ..., \"arguments\": ...}}")
    if all(isinstance(call["function"].get("arguments"), (dict, list)) for call in tool_calls):
        return tool_calls
    parsed = []
    for call in tool_calls:
        arguments = call["function"].get("arguments")
        if arguments is None or isinstance(arguments, str) and not arguments.strip():
            arguments = {}
        elif isinstance(arguments, str):
            arguments = json_field(arguments, "invalid_tool_calls",
                                   f"message {index}: the arguments string of tool call {call['function']['name']!r}")
        parsed.append({**call, "function": {**call["function"], "arguments": arguments}})
    return parsed


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


def turn_spans(render: Renderer, messages: list[dict], *, end_of_turn: str | tuple[str, ...],
               eos_token: str | None = None, special_tokens: tuple[str, ...] = (),
               mask_reasoning: bool = False, masked: Container[int] = ()) -> tuple[str, list[CharSpan], str]:
    """The learned character spans of every assistant turn, by the learning rule (module docstring).

    Turns are located in the rendering of the whole conversation (``sentinel_turn_spans``); where a
    template rewrites a message beyond recognition the older incremental rule is used instead, and
    the row says so (its third value).

    Args:
        render: ``render(messages, add_generation_prompt) -> text``; raises
            ``SampleError`` when the template refuses the messages.
        messages: the conversation.
        end_of_turn: the string(s) that end an assistant turn (harmony ends the last reply with
            ``<|return|>``, earlier ones with ``<|end|>``, a tool call with ``<|call|>``).
        eos_token: learned too when the template writes it right after a turn's end-of-turn.
        special_tokens: the tokenizer's added tokens; a generation prompt is matched in pieces
            that end at one of them (or a newline), never inside one.
        mask_reasoning: leave each turn's reasoning text (``reasoning_text``) out of its span.
        masked: the indices of assistant turns that stay masked (a prompt's turns, ``weight`` 0).

    Returns:
        ``(full_text, spans, rule)``: sorted, disjoint ``[start, end)`` spans in ``full_text``, a
        reply's last span ending at its end-of-turn; ``rule`` is ``"sentinel"`` or
        ``"incremental"`` (the fallback).
    """
    ends = (end_of_turn,) if isinstance(end_of_turn, str) else tuple(end_of_turn)
    full = render(messages, False)
    located = sentinel_turn_spans(render, messages, full, ends=ends, eos_token=eos_token,
                                  special_tokens=special_tokens)
    if located is not None:
        rule, turns = "sentinel", located
    else:
        rule, turns = "incremental", incremental_turn_spans(render, messages, full, ends=ends)
    spans: list[CharSpan] = []
    for i, (start, end) in turns:
        if i in masked:
            continue
        message = messages[i]
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
    return full, spans, rule


# Sentinels: private-use characters no tokenizer sees (they are removed before tokenizing), so a
# template copies them through unchanged; ``_MARK`` finds them again.
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"
_MARK = re.compile("\ue000([a-z])(\\d+)\ue001")


def _mark(kind: str, index: int) -> str:
    return f"{_MARK_OPEN}{kind}{index}{_MARK_CLOSE}"


def _wrap(text: str, index: int, kinds: str = "oc") -> str:
    """``text`` between two sentinels, inside its leading and trailing whitespace (a template's
    ``trim`` then removes the same characters as on the plain text)."""
    core = text.strip()
    if not core:
        return text
    lead = len(text) - len(text.lstrip())
    return f"{text[:lead]}{_mark(kinds[0], index)}{core}{_mark(kinds[1], index)}{text[lead + len(core):]}"


def _with_sentinels(messages: list[dict]) -> list[dict]:
    """A copy of ``messages`` with each content and each tool call's name between sentinels."""
    marked = []
    for index, message in enumerate(messages):
        message = dict(message)
        message["content"] = _wrap(message["content"], index)
        if "tool_calls" in message:
            calls = []
            for call in message["tool_calls"]:
                call = dict(call)
                call["function"] = {**call["function"], "name": _wrap(call["function"]["name"], index, "nm")}
                calls.append(call)
            message["tool_calls"] = calls
        marked.append(message)
    return marked


def _strip_marks(text: str) -> tuple[str, list[tuple[int, str, int]]]:
    """``text`` without sentinels, and ``(position in that text, kind, message index)`` of each."""
    # One split in C gives [text, kind, index, text, kind, index, ..., text].
    parts = _MARK.split(text)
    pieces = parts[::3]
    marks, pos = [], 0
    for k in range(1, len(parts), 3):
        pos += len(parts[k - 1])
        marks.append((pos, parts[k], int(parts[k + 1])))
    return "".join(pieces), marks


def _after_last_mark(text: str) -> str:
    """What follows the last sentinel of ``text`` (all of it when it has none)."""
    # A mark holds one opener, at its start: when the last opener starts a mark, no mark follows it.
    # An opener that starts none (a template's own character) leaves the whole search to the regex.
    at = text.rfind(_MARK_OPEN)
    if at < 0:
        return text
    last = _MARK.match(text, at)
    if last is None:
        last = next(reversed(list(_MARK.finditer(text))), None)
    return text[last.end():] if last else text


def _common_prefix_len(a: str, b: str) -> int:
    """The length of the longest common prefix: a binary search of ``startswith`` comparisons in C,
    one when ``b`` starts with the whole of ``a`` (a generation prompt found whole, the usual case)."""
    if b.startswith(a):
        return len(a)
    low, high = 0, min(len(a), len(b))  # a[:low] == b[:low]; a[:high + 1] != b[:high + 1]
    while low < high:
        mid = (low + high + 1) // 2
        if b.startswith(a[low:mid], low):
            low = mid
        else:
            high = mid - 1
    return low


def _common_prefix_length(ids: list[int], other_ids: list[int]) -> int:
    """How many leading token ids the two lists share (TRL's ``common_prefix_length``)."""
    length = 0
    for token, other in zip(ids, other_ids):
        if token != other:
            break
        length += 1
    return length


def sentinel_turn_spans(render: Renderer, messages: list[dict], full: str, *, ends: tuple[str, ...],
                        eos_token: str | None, special_tokens: tuple[str, ...] = ()) -> list[tuple[int, CharSpan]] | None:
    """Each assistant turn's ``(index, (start, end))`` located in ``full`` itself, or None.

    The conversation is rendered once more with sentinels around every message's content (and
    tool-call names); removing them must give ``full`` exactly, else None (the caller falls
    back). For assistant message ``i``, with ``prev`` the last sentinel of an earlier message
    before its content::

        full    ... user text | <|im_end|>\n<|im_start|>assistant\n | <think>..</think>\n\n reply <|im_end|> | \n ...
                          prev ^   generation prompt tail (matched)  ^ start                          end ^

    ``start`` is where the generation prompt (``render(messages[:i], True)`` after its last
    sentinel) stops matching the text after ``prev``: a prompt that opens ``<think>\n`` where the
    rendered turn has no reasoning (DeepSeek-R1) stops at the header, one that matches whole
    leaves the reasoning that follows it learned (Qwen3). ``end`` is the first end-of-turn after
    the turn's last sentinel, plus ``eos_token`` when it follows at once (Command-R's
    ``<|END_RESPONSE|><|END_OF_TURN_TOKEN|>``). Returns None where a turn cannot be told apart.
    """
    if any(_MARK_OPEN in m["content"]
           or ("tool_calls" in m and _MARK_OPEN in json.dumps(m["tool_calls"], ensure_ascii=False))
           for m in messages):
        return None
    marked_messages = _with_sentinels(messages)
    try:
        marked = render(marked_messages, False)
    except SampleError:
        return None
    plain, marks = _strip_marks(marked)
    if plain != full:
        return None
    turns: list[tuple[int, CharSpan]] = []
    last_end = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        own = sorted(pos for pos, _, index in marks if index == i)
        if not own:
            if message.get("tool_calls"):
                raise SampleError("tool_calls_not_rendered", f"assistant message {i}: the chat template did not "
                                                             "render its tool calls")
            raise SampleError("reply_not_rendered", f"assistant message {i}: the chat template dropped the reply")
        first_own = own[0]
        before = [(pos, index) for pos, _, index in marks if pos <= first_own and index != i]
        prev_pos, prev_index = max(before) if before else (0, -1)
        if prev_index > i:
            return None  # a later message's text precedes this turn: no generation prompt leads to it
        after = [pos for pos, _, index in marks if pos > first_own and index != i]
        limit = min(after) if after else len(full)
        # Harmony names the tool again in the tool result's header: the turn's marks end at the first
        # end-of-turn between two of them.
        last_own = first_own
        for pos in own[1:]:
            if any(full.find(end, last_own, pos) >= 0 for end in ends):
                break
            last_own = pos
        try:
            prompt = render(marked_messages[:i], True)
        except SampleError:
            return None
        tail = _after_last_mark(prompt)
        matched = _align_prompt(tail, full, prev_pos, first_own, special_tokens)
        if matched is None:
            return None
        if special_tokens and full.startswith(special_tokens, matched):
            matched = _after_header(render, marked_messages[:i], prompt, full, matched, first_own, special_tokens)
        start = max(matched, last_end)
        hits = [at for at in (full.find(end, last_own, limit) for end in ends) if at >= 0]
        if not hits and message.get("tool_calls"):
            # Command-R+'s tool_use template closes a tool call with no token at all: the call is learned
            # up to the next turn's first special token (its header), which is the prompt's.
            opens = [at for at in (full.find(token, last_own, limit) for token in special_tokens) if at >= 0]
            if opens:
                turns.append((i, (start, min(opens))))
                last_end = min(opens)
                continue
        if not hits:
            raise SampleError("no_end_of_turn", f"assistant message {i}: no end-of-turn "
                                                f"({', '.join(map(repr, ends))}) after the reply in the rendering")
        at = min(hits)
        end = at + len(next(e for e in ends if full.startswith(e, at)))
        if eos_token and eos_token not in ends and full.startswith(eos_token, end) and end + len(eos_token) <= limit:
            end += len(eos_token)
        turns.append((i, (start, end)))
        last_end = end
    return turns


def _after_header(render: Renderer, prefix: list[dict], prompt: str, full: str, matched: int, stop: int,
                  special_tokens: tuple[str, ...]) -> int:
    """Where the assistant header ends when the generation prompt matched only part of it.

    Command-R+'s tool_use template writes a fixed system turn after the last message whether or
    not a generation prompt follows, so the prompt after the previous message is that turn plus the
    header, and the text before a mid-conversation reply has only the header. The header is what
    ``add_generation_prompt`` adds to the rendering (``prompt`` minus ``render(prefix, False)``);
    when ``full[matched:stop]`` opens with it after nothing but special tokens and whitespace, the
    reply starts after it. Otherwise ``matched`` stands (Command-R7B's learned ``<|START_RESPONSE|>``).
    """
    try:
        plain = render(prefix, False)
    except SampleError:
        return matched
    if not prompt.startswith(plain) or len(prompt) == len(plain):
        return matched
    header = prompt[len(plain):].lstrip()
    at = full.find(header, matched - len(header), stop)
    if at < 0 or at + len(header) <= matched:
        return matched
    between = full[matched:at] if at > matched else ""
    for token in special_tokens:
        between = between.replace(token, "")
    return at + len(header) if not between.strip() else matched


def _align_prompt(tail: str, full: str, begin: int, stop: int, special_tokens: tuple[str, ...]) -> int | None:
    """Where the generation prompt ``tail`` ends in ``full[begin:stop]`` (the text between the previous
    message and this reply), or None when nothing of it is there.

    Matched piecewise, each piece ending at a special token or a newline of ``tail``: first the
    longest common prefix, then each further piece found after text made only of whitespace and
    special tokens (Hermes closes a tool result ``\\n<|im_end|>`` mid-conversation but
    ``<|im_end|>`` before a generation prompt). Pieces of ``tail`` not in the text are what the
    prompt gives the model and the rendered turn lacks (DeepSeek-R1's ``<think>\\n``).
    """
    def boundaries(text: str) -> list[int]:
        """Ends of pieces of ``text``, longest first."""
        cuts = {len(text)}
        for k in range(1, len(text)):
            if text[k - 1] == "\n" or text.endswith(special_tokens, 0, k):
                cuts.add(k)
        return sorted(cuts, reverse=True)

    def skippable(text: str) -> bool:
        for token in special_tokens:
            text = text.replace(token, "")
        return not text.strip()

    def inside_token(text: str, k: int) -> int | None:
        """The start of a special token of ``text`` that position ``k`` cuts, if any."""
        for token in special_tokens:
            at = text.find(token, max(0, k - len(token) + 1), k + len(token) - 1)
            if 0 <= at < k < at + len(token):
                return at
        return None

    pos, rest, between = begin, tail, full[begin:stop]
    matched = _common_prefix_len(rest, between)
    while matched and matched < len(rest):  # never stop inside a special token (<think> vs <tool_call>)
        cut = inside_token(rest, matched)
        cut = inside_token(between, matched) if cut is None else cut
        if cut is None:
            break
        matched = cut
    if rest and not matched and not skippable(between[:1]):
        return None
    pos, rest = pos + matched, rest[matched:]
    while rest:
        for k in boundaries(rest):
            found = full.find(rest[:k], pos, stop)
            if found >= 0 and skippable(full[pos:found]):
                pos, rest = found + k, rest[k:]
                break
        else:
            break
    return pos


def incremental_turn_spans(render: Renderer, messages: list[dict], full: str, *,
                           ends: tuple[str, ...]) -> list[tuple[int, CharSpan]]:
    """The older rule, for templates that rewrite a reply beyond recognition: learned =
    ``[len(render(messages[:i], True)), end of the turn's end-of-turn)`` in ``full``; needs
    every ``render(messages[:i], True)`` to be a prefix of ``full``."""
    turns: list[tuple[int, CharSpan]] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(messages[:i], True)
        start = len(before)
        if not full.startswith(before):
            raise SampleError("template_not_incremental",
                              f"reply {i} cannot be located: the template rewrites it and rendering "
                              f"messages[:{i}] is not a prefix of the conversation")
        if turns and start < turns[-1][1][1]:
            raise SampleError("template_not_incremental", f"assistant message {i} overlaps the previous reply")
        hits = [at for at in (full.find(end, start) for end in ends) if at >= 0]
        if not hits:
            raise SampleError("no_end_of_turn", f"assistant message {i}: no end-of-turn after the generation prompt")
        at = min(hits)
        turns.append((i, (start, at + len(next(e for e in ends if full.startswith(e, at))))))
    return turns


def detect_end_of_turn(render: Renderer, special_tokens: list[str], eos_token: str | None, *,
                       tools: list[dict] | None = None) -> tuple[str, ...]:
    """The special tokens the template writes right after an assistant reply; the first is the
    one after the last reply.

    Renders probe conversations the way rows are rendered: with and without a system prompt,
    with ``tools`` when given (tool-use templates raise without them), a reply followed by
    another exchange (harmony closes earlier replies differently) and, with tools, a tool call.
    It reads what follows each sentinel (whitespace skipped: Llama-2 writes ``' ' + eos``);
    ``eos_token`` wins a tie, else the longest special token. A probe the template refuses is
    skipped; nothing found gives ``()``.
    """
    def following(text: str, at: int, *, skip_text: bool) -> str | None:
        tail = text[at:].lstrip()
        while tail:
            if eos_token and tail.startswith(eos_token):
                return eos_token
            matches = [token for token in special_tokens if token and tail.startswith(token)]
            if matches:
                return max(matches, key=len)
            if not skip_text:
                return None
            tail = tail[1:]
        return None

    found: list[str] = []
    user = {"role": "user", "content": "Hello"}
    opener = _header_opener(render, [user], tools, following)
    reply = [{"role": "assistant", "content": f"{_SENTINEL} {n}."} for n in range(2)]
    probes = []
    for system in ([], [{"role": "system", "content": "Be brief."}]):
        probes.append(system + [user, reply[0], {"role": "user", "content": "And?"}, reply[1]])
        probes.append(system + [user, reply[1]])
        if tools:
            name = tools[0].get("function", tools[0]).get("name", "probe_tool")
            for arguments in ({"q": _SENTINEL}, json.dumps({"q": _SENTINEL})):
                call = {"type": "function", "function": {"name": name, "arguments": arguments}}
                probes.append(system + [user, {"role": "assistant", "content": "", "tool_calls": [call]},
                                        {"role": "tool", "content": _TOOL_SENTINEL}, reply[1]])
    for messages in probes:
        for with_tools in ((tools, None) if tools else (None,)):
            try:
                text = render(messages, False, with_tools)
            except SampleError:
                continue
            for n in range(2):
                at = text.find(f"{_SENTINEL} {n}.")
                token = following(text, at + len(f"{_SENTINEL} {n}."), skip_text=False) if at >= 0 else None
                if token and token not in found:
                    found.insert(len(found) if n == 0 else 0, token)  # the last reply's token comes first
            at = text.find(_SENTINEL)
            result = text.find(_TOOL_SENTINEL, at)
            if at >= 0 and not text.startswith(f"{_SENTINEL} ", at) and result > at:  # the tool call's arguments
                # A call closed by a token of its own (harmony's <|call|>, Command-R's <|END_ACTION|>):
                # the first special token after the arguments, unless a reply's end-of-turn closes it.
                if not any(token in text[at:result] for token in found):
                    token = following(text, at + len(_SENTINEL), skip_text=True)
                    if token and token not in found and token != opener:  # the next turn's header, not an end
                        found.append(token)
    if not found and tools is not _PROBE_TOOLS:
        # The template refused every probe with the rows' tools (Command-R+ needs a description for
        # each parameter): a fully described tool still shows how it ends a reply.
        return detect_end_of_turn(render, special_tokens, eos_token, tools=_PROBE_TOOLS)
    return tuple(found)


_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "probe_tool", "description": "A probe.", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "description": "A query."}}, "required": ["q"]}}}]


_SENTINEL = "Sentinel reply 42"
_TOOL_SENTINEL = "Sentinel result 43"


# ----------------------------------------------------------------------------
# Tokens


def _header_opener(render: Renderer, messages: list[dict], tools: list[dict] | None, following) -> str | None:
    """The special token an assistant header starts with (what the generation prompt adds to the
    rendering), or None: a tool call followed by it is closed by no token of its own (Command-R+)."""
    for with_tools in ((tools, None) if tools else (None,)):
        try:
            prompt, plain = render(messages, True, with_tools), render(messages, False, with_tools)
        except SampleError:
            continue
        if prompt.startswith(plain) and len(prompt) > len(plain):
            return following(prompt, len(plain), skip_text=False)
    return None


def lone_surrogate(text: str) -> SampleError | None:
    """``SampleError("lone_surrogate")`` when ``text`` holds half of a UTF-16 surrogate pair, else None.

    JSON may spell one (``"\\ud83d"``: an emoji cut in two, frequent in scraped chat dumps), and
    ``json.loads`` keeps it, but it is no Unicode character and the Rust tokenizer refuses the text.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return SampleError("lone_surrogate", f"the row holds {text[err.start]!r}, half of a UTF-16 surrogate pair "
                                             "(an emoji cut in two), which no tokenizer takes")
    return None


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


class _TemplateRenderer:
    """``template.render(**fixed, **per_call)`` with the fixed variables merged once.

    ``Template.render`` merges the environment's globals (a ``ChainMap``) into a new dict on every
    call; on short conversations that merge was about half the cost of a render, and a row takes
    2 + (its replies) renders. The context here holds the same variables with the same precedence
    (the call's over the fixed ones over the globals), so the text is the same.
    """

    def __init__(self, template, fixed: dict[str, Any]):
        from jinja2.runtime import new_context

        self._template = template
        self._new_context = new_context
        self._globals = dict(template.globals)
        self._fixed = {**self._globals, **fixed}

    def __call__(self, **variables: Any) -> str:
        template = self._template
        context = self._new_context(template.environment, template.name, template.blocks,
                                    {**self._fixed, **variables}, True, self._globals)
        return "".join(template.root_render_func(context))


class ChatEncoder:
    """Encodes chunks of rows with one Hugging Face fast tokenizer.

    Args:
        tokenizer: a fast tokenizer; its chat template renders the rows.
        max_sample_num_tokens: longer samples are rejected, except fully learned text when
            ``split_long_text``: kept whole, for ``Sample.pieces`` to cut.
        end_of_turn_token: the string(s) that end an assistant turn; ``None``
            finds them from the template's rendering (``detect_end_of_turn``).
        probe_tools: the rows' ``tools``, so that the probe renders as the rows will.
        mask_reasoning: mask each turn's reasoning text instead of learning it.

    Raises:
        ValueError: the template's end-of-turn token cannot be found (one line naming the flag that fixes it).
    """

    masking_method = "sentinel"

    def __init__(self, tokenizer, *, max_sample_num_tokens: int, end_of_turn_token: str | tuple[str, ...] | None = None,
                 mask_reasoning: bool = False, probe_tools: list[dict] | None = None, split_long_text: bool = False):
        from transformers.utils.chat_template_utils import render_jinja_template

        self.tokenizer = tokenizer
        self.backend = tokenizer.backend_tokenizer
        self.eos_token = tokenizer.eos_token
        self.eos_token_id = tokenizer.eos_token_id
        self.max_sample_num_tokens = max_sample_num_tokens
        self.split_long_text = split_long_text
        self.mask_reasoning = mask_reasoning
        self.chat_template = tokenizer.get_chat_template() if tokenizer.chat_template else None
        self.renders_tool_calls = bool(self.chat_template) and "tool_calls" in self.chat_template
        self.developer_as_system = not (self.chat_template and _NAMES_DEVELOPER.search(self.chat_template))
        self._render_jinja_template = render_jinja_template
        compiled = _compile_template(self.chat_template) if self.chat_template else None
        self.id_strings = [str(i) for i in range(max(len(tokenizer), self.backend.get_vocab_size(with_added_tokens=True)))]
        # The same variables apply_chat_template passes to the template.
        self._template_kwargs = dict(tokenizer.special_tokens_map)
        self._compiled = _TemplateRenderer(compiled, self._template_kwargs) if compiled is not None else None
        self.added_tokens = tuple(token.content for token in tokenizer.added_tokens_decoder.values() if token.content)
        if isinstance(end_of_turn_token, str):
            end_of_turn_token = (end_of_turn_token,)
        self.end_of_turn_tokens: tuple[str, ...] = tuple(end_of_turn_token or ())
        if self.chat_template and end_of_turn_token is None:
            special = [token.content for token in tokenizer.added_tokens_decoder.values() if token.special]
            self.end_of_turn_tokens = detect_end_of_turn(self.render, special, self.eos_token, tools=probe_tools)
            if not self.end_of_turn_tokens:
                raise ValueError("cannot find the chat template's end-of-turn token: no special token follows a "
                                 "reply in its rendering; pass --end-of-turn-token")
        self.end_of_turn_token = self.end_of_turn_tokens[0] if self.end_of_turn_tokens else None
        self._reply_end_strings = self.end_of_turn_tokens + ((self.eos_token,) if self.eos_token else ())

    def render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
        if self.chat_template is None:
            raise SampleError("no_chat_template", "the tokenizer has no chat template")
        try:
            if self._compiled is not None and all(map(_NO_REASONING_FIELD, messages)):
                # What render_jinja_template does for plain JSON messages without reasoning fields
                # (its copying and aliasing are no-ops then), minus ~60% of the Python overhead.
                return self._compiled(messages=messages, tools=tools, documents=None,
                                      add_generation_prompt=add_generation_prompt)
            texts, _ = self._render_jinja_template(
                conversations=[messages], tools=tools, chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt, **self._template_kwargs)
        except TEMPLATE_ERRORS as err:
            raise SampleError("template_error", f"the chat template refused the conversation: {err}") from None
        return texts[0]

    def reply_spans(self, messages: list[dict], tools: list[dict] | None = None, *,
                    masked: Container[int] = ()) -> tuple[str, list[CharSpan], str]:
        """The full rendered text, the learned character spans and the rule that located them
        (the assistant turns in ``masked`` stay masked)."""
        if not self.renders_tool_calls and any("tool_calls" in message for message in messages):
            raise SampleError("tool_calls_not_rendered", "the chat template does not render tool_calls; "
                                                         "pass --chat-template with one that does")
        render = self.render if tools is None else (lambda msgs, gen: self.render(msgs, gen, tools))
        return turn_spans(render, messages, end_of_turn=self.end_of_turn_tokens, eos_token=self.eos_token,
                          special_tokens=self.added_tokens, mask_reasoning=self.mask_reasoning,
                          masked=masked)

    def encode_rows(self, rows: list[bytes | ChatRow], *,
                    max_sample_num_tokens: int | None = None) -> list[Sample | SampleError]:
        """Encode a chunk of rows; one ``Sample`` or ``SampleError`` per row, in order.

        A row is a JSONL line in the ``messages`` format or a ``ChatRow`` (``formats``
        converts the other formats). All texts of the chunk go through the Rust tokenizer in one batch.
        ``max_sample_num_tokens`` replaces the encoder's limit (``encode_pairs`` checks a pair's length).
        """
        results: list[Sample | SampleError | None] = [None] * len(rows)
        # (index, text, spans or None without template, extra, rule, prompt chars, has a reply, replies marked)
        pending = []
        for index, row in enumerate(rows):
            try:
                chat_row = ChatRow(load_row(row)) if isinstance(row, bytes) else row
                messages, tools, extra, masked = check_row(chat_row.fields)
            except SampleError as err:
                results[index] = err
                continue
            if messages[0]["role"] == "pretrain":
                pending.append((index, messages[0]["content"], None, extra, None, chat_row.num_prompt_chars, False, 0))
                continue
            num_marked = sum(messages[i]["role"] == "assistant" for i in masked)
            if chat_row.num_prompt_messages:
                masked = (*range(chat_row.num_prompt_messages), *masked)
            if self.developer_as_system:
                for message in messages:  # check_row's own copies
                    if message["role"] == "developer":
                        message["role"] = "system"
            has_reply = any(message["role"] == "assistant" and i not in masked for i, message in enumerate(messages))
            try:
                text, spans, rule = self.reply_spans(messages, tools, masked=masked)
            except SampleError as err:
                err.audit = True  # a well-formed conversation the template (or the masking) failed on
                results[index] = err
                continue
            pending.append((index, text, spans, extra, rule, None, has_reply, num_marked))
        try:
            encodings = self.backend.encode_batch([item[1] for item in pending], add_special_tokens=False)
        except TypeError:  # a text the tokenizer does not take: found and rejected here, the others go on
            kept = []
            for item in pending:
                error = lone_surrogate(item[1])
                if error is None:
                    kept.append(item)
                else:
                    results[item[0]] = error
            if len(kept) == len(pending):
                raise
            pending = kept
            encodings = self.backend.encode_batch([item[1] for item in pending], add_special_tokens=False)
        # A plain prompt/completion row's prompt alone: where its tokens and the whole text's part is the
        # completion's start (TRL's common prefix), so a token merging across the boundary is learned.
        prompted = [item for item in pending if item[5] is not None]
        prompt_ids = dict(zip((item[0] for item in prompted), (encoding.ids for encoding in self.backend.encode_batch(
            [item[1][:item[5]] for item in prompted], add_special_tokens=False)))) if prompted else {}
        for (index, text, spans, extra, rule, prompt_chars, has_reply, num_marked), encoding in zip(pending, encodings):
            results[index] = self._finish(encoding, text, spans, extra, rule, prompt_ids=prompt_ids.get(index),
                                          has_reply=has_reply, num_marked=num_marked,
                                          max_tokens=max_sample_num_tokens or self.max_sample_num_tokens)
        return results

    def encode_pairs(self, pairs: list[tuple[ChatRow, ChatRow]]) -> list[PairSample | SampleError]:
        """Encode a chunk of preference pairs (``formats.read_pair``'s sides); one ``PairSample`` or
        ``SampleError`` per pair, in order. Each side is encoded as the SFT row it is, in one batch,
        then the pair is checked (``_check_pair``).

        Plain-string pairs follow TRL's ``DPOTrainer``: the EOS is appended only where the text does not
        already end with it, and both sides learn from one shared index, the smaller of the two sides'
        first learned token (TRL's ``prompt_len``), so a token merging across the prompt's end is learned
        by both or by neither::

            prompt "Q: 2+2?" chosen " 4"   [Q : 2 + 2 ?][ 4] EOS        shared start 6
                     rejected " 5"         [Q : 2 + 2 ?][ 5] EOS        labels M x6, then learned
        """
        rows = [side for pair in pairs for side in map(self._without_eos, pair)]
        # A side alone is never too long: the pair's length is what --max-sample-num-tokens bounds.
        encoded = self.encode_rows(rows, max_sample_num_tokens=1 << 62)
        return [self._check_pair(chosen, rejected) for chosen, rejected in zip(encoded[0::2], encoded[1::2])]

    def _without_eos(self, row: ChatRow) -> ChatRow:
        """A plain prompt/completion side whose text ends with the EOS, without it: ``_finish`` appends
        it once (TRL's ``add_eos`` does not double it)."""
        messages = row.fields.get("messages")
        if row.num_prompt_chars is None or not self.eos_token:
            return row
        content = messages[0]["content"]
        if not (isinstance(content, str) and content.endswith(self.eos_token)
                and len(content) - len(self.eos_token) >= row.num_prompt_chars):
            return row
        text = content[: -len(self.eos_token)]
        return ChatRow({**row.fields, "messages": [{**messages[0], "content": text}]},
                       num_prompt_messages=row.num_prompt_messages, num_prompt_chars=row.num_prompt_chars)

    def _check_pair(self, chosen: Sample | SampleError, rejected: Sample | SampleError) -> PairSample | SampleError:
        """The pair, or why it cannot train: a bad side (its reason, the side named), ``identical_sides``,
        ``prompt_mismatch`` (the tokens before each side's first learned token differ: templates that
        render the prompt differently, a token merging across its end) or ``too_long`` (both sides)."""
        for name, side in (("chosen", chosen), ("rejected", rejected)):
            if isinstance(side, SampleError):
                return SampleError(side.reason, f"{name}: {side.detail}", audit=side.audit)
        if chosen.is_prompt_completion and rejected.is_prompt_completion:
            start = min(chosen.token_spans[0][0], rejected.token_spans[0][0])
            chosen, rejected = (dataclasses.replace(side, token_spans=[(start, len(side.input_ids))],
                                                    num_loss_counted_tokens=len(side.input_ids) - start)
                                for side in (chosen, rejected))
        if chosen.input_ids == rejected.input_ids and chosen.labels == rejected.labels:
            return SampleError("identical_sides", "chosen and rejected are the same tokens with the same labels")
        start_c, start_r = chosen.token_spans[0][0], rejected.token_spans[0][0]
        if chosen.input_ids[:start_c] != rejected.input_ids[:start_r]:
            return SampleError("prompt_mismatch", f"the tokens before the first learned one differ between the sides "
                                                  f"({start_c} and {start_r} tokens): the pair has no common prompt")
        pair = PairSample(chosen, rejected)
        if pair.num_tokens > self.max_sample_num_tokens:
            return SampleError("too_long", f"{len(chosen.input_ids)} + {len(rejected.input_ids)} tokens > "
                                           f"--max-sample-num-tokens {self.max_sample_num_tokens} (a pair counts "
                                           "both sides)")
        return pair

    def _finish(self, encoding, text: str, spans: list[CharSpan] | None, extra: dict, rule: str | None, *,
                prompt_ids: list[int] | None = None, has_reply: bool = False,
                num_marked: int = 0, max_tokens: int) -> Sample | SampleError:
        """The sample of one encoded text. Without a template (``spans`` None): ``text + EOS``, learned
        from where the tokens of the prompt alone (``prompt_ids``) and of the whole text diverge, as TRL's
        ``SFTTrainer`` does (``common_prefix_length``): a token merging across the boundary is learned::

            prompt/completion  "Q: 2+2? " + "A: 4"      tokens [Q :  2 + 2 ?][ A : 4 ] EOS
            labels                                             M  M  M M M M   A : 4   EOS

            "The capital is " + "Paris."   prompt alone  [The  capital  is  ' ']
                                           whole text    [The  capital  is][ Paris .] EOS
            labels                                         M      M      M   Paris .  EOS
        """
        input_ids = encoding.ids
        if spans is None:
            first = _common_prefix_length(prompt_ids, input_ids) if prompt_ids else 0
            input_ids.append(self.eos_token_id)
            token_spans = [(first, len(input_ids))]
        else:
            token_spans = [token_span(encoding, len(input_ids), len(text), span) for span in spans]
        if len(input_ids) > max_tokens:
            is_text = spans is None and first == 0
            if not (is_text and self.split_long_text):
                hint = "; --split-long-text cuts a text row into pieces instead" if is_text else ""
                return SampleError("too_long", f"{len(input_ids)} tokens > --max-sample-num-tokens "
                                               f"{self.max_sample_num_tokens}{hint}")
        num_loss = sum(t1 - t0 for t0, t1 in token_spans)
        if num_loss == 0:
            # Audit finding only where a reply was there to learn; a conversation without one is bad input.
            return SampleError("no_loss_tokens", "no assistant token is learned in this conversation",
                               audit=has_reply)
        # The audit: the token holding the last character of a reply's end-of-turn is its last learned
        # token, and no EOS the template writes right after is left unlearned (the model must learn to
        # stop). mask_reasoning may split a reply in two spans: only spans ending at a reply's end count.
        num_replies = num_eot_learned = 0
        if spans is not None:
            for (a, b), (t0, t1) in zip(spans, token_spans):
                if text.endswith(self._reply_end_strings, 0, b):
                    num_replies += 1
                    num_eot_learned += (t1 > t0 and encoding.char_to_token(b - 1) == t1 - 1
                                        and not (t1 < len(input_ids) and input_ids[t1] == self.eos_token_id
                                                 and text.startswith(self.eos_token, b)))
        return Sample(input_ids, [span for span in token_spans if span[1] > span[0]], num_loss,
                      is_pretrain=spans is None and prompt_ids is None, extra=extra, rule=rule,
                      is_prompt_completion=prompt_ids is not None, num_replies=num_replies,
                      num_replies_end_learned=num_eot_learned, num_replies_marked=num_marked)
