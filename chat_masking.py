"""Turn one JSONL row into ``(input_ids, labels)``: validation, rendering, masking.

``process_data.py`` drives these over a file with worker processes; everything
here works on one row or one chunk of rows and holds no global state.

Which tokens are learned, for a ChatML template (``M`` = ``IGNORE_INDEX``)::

    text    <|im_start|> user \\n Hi <|im_end|> \\n <|im_start|> assistant \\n Hello ! <|im_end|> \\n
    labels       M        M   M  M      M      M       M           M      M  Hello ! <|im_end|>  M

The reply's own tokens and its end-of-turn token (the tokenizer's EOS) are
learned; role headers, system/user/tool text, text the template injects (a
default system prompt, an empty ``<think></think>`` block) and whatever the
template emits after the EOS stay masked. A pretrain row is
``encode(content) + [eos]``, every token learned.

How the reply spans are found, without probe strings:
  1. Templates with ``{% generation %}`` markers: the marked character spans
     (``render_jinja_template(return_assistant_tokens_mask=True)``), each
     extended by an EOS that immediately follows it.
  2. Otherwise, incremental rendering. For the assistant message ``i``::

         before = render(messages[:i], add_generation_prompt=True)
         after  = render(messages[:i + 1])
         full   = render(messages)

     ``before`` must be a prefix of ``after``; the turn is
     ``after[len(before):]``. Inside it, the reply is the last occurrence of
     the message content (or its stripped form, for templates that trim)
     that ends before the turn's last EOS, and the EOS is the first one after
     the reply. When ``after`` is a prefix of ``full`` these are positions in
     ``full``; when only ``before`` is (templates that render earlier turns
     differently, like Qwen3 dropping old think blocks), the reply-through-EOS
     text is searched in ``full`` from ``len(before)`` without crossing an EOS.
     Anything else rejects the row with a reason; it never guesses.

Character spans become token spans through one tokenization of ``full``
(its offsets). Boundary rule: a token is learned iff every character it
covers lies inside a reply span. A BPE token that straddles the edge (e.g.
ChatML's header ``\\n`` merged with a reply's leading space into ``"\\n "``)
stays masked, so the learned text can lose leading whitespace of a reply,
never gain template text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

import jinja2

from utils import IGNORE_INDEX

VALID_ROLES = ("system", "user", "assistant", "tool", "pretrain")
OUTPUT_FIELDS = ("input_ids", "labels", "len", "num_loss_counted_tokens")
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")

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
    """Parse and validate one JSONL line.

    Returns:
        ``(messages, extra)``: the messages (keys with ``None`` values dropped,
        as ``apply_chat_template`` does) and the row's other fields.

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
        if message.get("content") is None:
            raise SampleError("missing_content", f"message {index} ({role}) has no content")
        if not isinstance(message["content"], str):
            raise SampleError("non_string_content",
                              f"message {index} ({role}) content is a {type(message['content']).__name__}")
        if role == "assistant" and not message["content"].strip():
            raise SampleError("empty_assistant_reply", f"message {index} is an empty assistant reply")
        clean.append({key: value for key, value in message.items() if value is not None})
    roles = [message["role"] for message in clean]
    if "pretrain" in roles:
        if len(clean) > 1:
            raise SampleError("pretrain_mixed_with_chat", "a 'pretrain' message must be the only message")
        if not clean[0]["content"].strip():
            raise SampleError("empty_pretrain", "the pretrain content is empty")
    extra = {key: value for key, value in row.items() if key != "messages"}
    return clean, extra


# ----------------------------------------------------------------------------
# Reply spans (characters)


def _locate_reply(text: str, start: int, stop: int, content: str, eos: str) -> tuple[int, int, int] | None:
    """In ``text[start:stop]``: (reply start, reply end, EOS start), or None."""
    last_eos = text.rfind(eos, start, stop)
    if last_eos < 0:
        return None
    for candidate in dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip())):
        begin = text.rfind(candidate, start, last_eos)
        if begin >= 0:
            end = begin + len(candidate)
            return begin, end, text.find(eos, end, stop)
    return None


def incremental_reply_spans(render: Renderer, messages: list[dict], *, eos_token: str) -> tuple[str, list[CharSpan]]:
    """Character spans of every assistant reply and its EOS, by incremental rendering.

    Args:
        render: ``render(messages, add_generation_prompt) -> text``; raises
            ``SampleError`` when the template refuses the messages.
        messages: the conversation.
        eos_token: the end-of-turn string.

    Returns:
        ``(full_text, spans)``: sorted, disjoint ``[start, end)`` spans in ``full_text``.
    """
    full = render(messages, False)
    spans: list[CharSpan] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(messages[:i], True)
        after = full if i == len(messages) - 1 else render(messages[: i + 1], False)
        if not after.startswith(before) or not full.startswith(before):
            raise SampleError("template_not_incremental",
                              f"rendering messages[:{i}] is not a prefix of the conversation; cannot locate reply {i}")
        located = _locate_reply(after, len(before), len(after), message["content"], eos_token)
        if located is None or located[2] < 0:
            raise SampleError("no_end_of_turn", f"assistant message {i}: reply followed by {eos_token!r} not found "
                                                "in its rendered turn")
        begin, end, eos_begin = located
        if not full.startswith(after):
            # The template renders this turn differently once later turns follow: find the
            # reply-through-EOS text in the full render, without crossing into a later turn.
            tail = after[begin:eos_begin + len(eos_token)]
            found = full.find(tail, len(before))
            if found < 0 or full.find(eos_token, len(before), found) >= 0:
                raise SampleError("template_not_incremental", f"assistant message {i} is not rendered the same way "
                                                              "inside the full conversation")
            begin, end, eos_begin = found, found + (end - begin), found + (eos_begin - begin)
        if spans and begin < spans[-1][1]:
            raise SampleError("template_not_incremental", f"assistant message {i} overlaps the previous reply")
        if end == eos_begin:
            spans.append((begin, eos_begin + len(eos_token)))
        else:
            spans += [(begin, end), (eos_begin, eos_begin + len(eos_token))]
    return full, spans


def extend_by_eos(text: str, spans: list[CharSpan], eos_token: str) -> list[CharSpan]:
    """Generation-marker spans, each extended by an EOS that immediately follows it."""
    return [(a, b + len(eos_token)) if text.startswith(eos_token, b) else (a, b) for a, b in spans]


def has_generation_markers(chat_template: str) -> bool:
    return bool(_GENERATION_MARKER.search(chat_template))


# ----------------------------------------------------------------------------
# Tokens


def token_span(encoding, num_tokens: int, span: CharSpan) -> tuple[int, int]:
    """``[t0, t1)``: the tokens of ``encoding`` lying entirely inside the character span.

    ``encoding`` is a ``tokenizers.Encoding``; only its ``char_to_token`` and
    ``token_to_chars`` are used, so no per-token offset list is built.
    """
    a, b = span
    first = next((t for t in map(encoding.char_to_token, range(a, b)) if t is not None), None)
    if first is None:
        return 0, 0
    if encoding.token_to_chars(first)[0] < a:  # straddles the start: masked
        first += 1
    last = next(t for t in map(encoding.char_to_token, range(b - 1, a - 1, -1)) if t is not None)
    if encoding.token_to_chars(last)[1] > b:  # straddles the end: masked
        last -= 1
    # Byte-level BPE can split one character over several tokens with equal offsets.
    while last + 1 < num_tokens and encoding.token_to_chars(last + 1)[1] <= b:
        last += 1
    return (first, last + 1) if last >= first else (0, 0)


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

# Message fields transformers copies into each other before rendering (``_alias_reasoning_fields``);
# messages carrying any of them take the slower, exact library path.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _compile_template(chat_template: str):
    """The template compiled exactly as ``apply_chat_template`` compiles it (cached by transformers)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a transformers without it: every render takes render_jinja_template
        return None
    return _compile_jinja_template(chat_template)


class ChatEncoder:
    """Encodes chunks of rows with one Hugging Face fast tokenizer."""

    def __init__(self, tokenizer, *, max_sample_num_tokens: int):
        from transformers.utils.chat_template_utils import render_jinja_template

        self.tokenizer = tokenizer
        self.backend = tokenizer.backend_tokenizer
        self.eos_token = tokenizer.eos_token
        self.eos_token_id = tokenizer.eos_token_id
        self.max_sample_num_tokens = max_sample_num_tokens
        self.chat_template = tokenizer.get_chat_template() if tokenizer.chat_template else None
        self.uses_generation_markers = bool(self.chat_template) and has_generation_markers(self.chat_template)
        self._render_jinja_template = render_jinja_template
        self._compiled = _compile_template(self.chat_template) if self.chat_template else None
        self.id_strings = [str(i) for i in range(max(len(tokenizer), self.backend.get_vocab_size(with_added_tokens=True)))]
        # The same variables apply_chat_template passes to the template.
        self._template_kwargs = dict(tokenizer.special_tokens_map)

    @property
    def masking_method(self) -> str:
        return "generation_markers" if self.uses_generation_markers else "incremental_rendering"

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self._render(messages, add_generation_prompt=add_generation_prompt)[0]

    def _render(self, messages, *, add_generation_prompt=False, with_spans=False) -> tuple[str, list[CharSpan]]:
        if self.chat_template is None:
            raise SampleError("no_chat_template", "the tokenizer has no chat template")
        try:
            if self._compiled is not None and not with_spans and not any(
                    key in message for message in messages for key in _REASONING_FIELDS):
                # What render_jinja_template does for plain JSON messages without reasoning fields
                # (its copying and aliasing are no-ops then), minus ~60% of the Python overhead.
                return self._compiled.render(messages=messages, tools=None, documents=None,
                                             add_generation_prompt=add_generation_prompt,
                                             **self._template_kwargs), []
            texts, indices = self._render_jinja_template(
                conversations=[messages], chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt, return_assistant_tokens_mask=with_spans,
                **self._template_kwargs)
        except TEMPLATE_ERRORS as err:
            raise SampleError("template_error", f"the chat template refused the conversation: {err}") from None
        return texts[0], (indices[0] if with_spans else [])

    def reply_spans(self, messages: list[dict]) -> tuple[str, list[CharSpan]]:
        """The full rendered text and the learned character spans."""
        if self.uses_generation_markers:
            text, spans = self._render(messages, with_spans=True)
            return text, extend_by_eos(text, spans, self.eos_token)
        return incremental_reply_spans(self.render, messages, eos_token=self.eos_token)

    def encode_rows(self, lines: list[bytes]) -> list[Sample | SampleError]:
        """Encode a chunk of JSONL lines; one ``Sample`` or ``SampleError`` per line, in order.

        All texts of the chunk go through the Rust tokenizer in one batch.
        """
        results: list[Sample | SampleError | None] = [None] * len(lines)
        pending = []  # (index, text, spans or None for pretrain, extra)
        for index, line in enumerate(lines):
            try:
                messages, extra = parse_row(line)
                if messages[0]["role"] == "pretrain":
                    pending.append((index, messages[0]["content"], None, extra))
                else:
                    text, spans = self.reply_spans(messages)
                    pending.append((index, text, spans, extra))
            except SampleError as err:
                results[index] = err
        encodings = self.backend.encode_batch([text for _, text, _, _ in pending], add_special_tokens=False)
        for (index, _, spans, extra), encoding in zip(pending, encodings):
            results[index] = self._finish(encoding, spans, extra)
        return results

    def _finish(self, encoding, spans: list[CharSpan] | None, extra: dict) -> Sample | SampleError:
        input_ids = encoding.ids
        if spans is None:
            input_ids.append(self.eos_token_id)
            token_spans = [(0, len(input_ids))]
        else:
            token_spans = [token_span(encoding, len(input_ids), span) for span in spans]
        if len(input_ids) > self.max_sample_num_tokens:
            return SampleError("too_long", f"{len(input_ids)} tokens > --max-sample-num-tokens "
                                           f"{self.max_sample_num_tokens}")
        num_loss = sum(t1 - t0 for t0, t1 in token_spans)
        if num_loss == 0:
            return SampleError("no_loss_tokens", "no assistant token is learned in this conversation")
        return Sample(input_ids, [span for span in token_spans if span[1] > span[0]], num_loss,
                      is_pretrain=spans is None, extra=extra)
