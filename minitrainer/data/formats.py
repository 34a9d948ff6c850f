"""Input row formats: find a row's format from its keys and convert it to the ``messages`` format.

Pure functions, a row dict in, a ``ChatRow`` out (``chat_masking`` then validates and encodes
it; ``read_row`` also counts, in a ``Counter`` its caller keeps, the ShareGPT turns read under a mapped
name); ``process_data.py`` runs them in its workers. A JSON line that ran out of text is refused as
cut off (``_cut_off``), not in json's words. The formats (docs/data.md has an example of each):

    format             a row has                       becomes
    messages           messages                        itself (other fields copied, as always); roles
                                                       human -> user, gpt / model -> assistant,
                                                       observation -> tool (as ShareGPT's)
                                                       OpenAI's legacy functions / function_call -> tools
    sharegpt           conversations [{from, value}]   messages; system, human -> user, gpt / model / chatgpt /
                                                       bing / bard -> assistant (--sharegpt-roles maps more
                                                       names), function_call -> an assistant tool call,
                                                       observation / tool -> tool; a turn's learning marks
                                                       (weight, train, training, loss) kept;
                                                       an {input, output} turn (Capybara) -> user, assistant
    prompt_completion  prompt, completion              lists of messages: prompt + completion through the
                                                       template, only the completion's replies learned (a
                                                       string completion is one reply);
                                                       strings: no template, prompt masked, completion + EOS;
                                                       label false (TRL's unpaired preference, KTO) in an SFT
                                                       file: rejected
    unpaired           prompt, completion, label       the prompt/completion row without its label, and
                                                       ``desirable`` (``read_unpaired``; a file's kind, not a
                                                       format: its rows count as prompt_completion)
    text               text                            a pretrain row (every token learned)
    alpaca             instruction, output             [system], [history's rounds], user (instruction
                       (input, system, history         + newline + input), assistant (output)
                       optional)
    preference         prompt, chosen, rejected        a pair (``read_pair``): each side a prompt/completion
                                                       row of the prompt and that side
    preference_implicit  chosen, rejected              a pair; the prompt is the sides' shared whole turns
                                                       (``implicit_prompt``, ``turn_prefix``)
    (either)           margin (optional)               the pair's ``margin`` (``read_pair(margins=True)``),
                                                       when the file's first pair has one

A row with ``chosen`` and ``rejected`` is a pair whatever else it carries (UltraFeedback binarized's
``messages`` beside them is not read); else a row with ``messages`` is read so whatever else it carries,
and an explicit preference row (``prompt`` too) is not also an implicit one. Otherwise exactly one of
the other shapes must match: no match is ``missing_messages``, two (an alpaca row with a ``text``
column) is ``ambiguous_format``; ``--input-format`` picks one. ``--columns`` renames columns first.
Pairs and SFT rows never share a file: ``read_row`` refuses a pair (``preference_row``), ``read_pair``
any other row (``not_a_pair``). ``_pair`` says where a pair's prompt comes from (docs/preference.md).
A file of unpaired feedback rows (KTO's) reads each with ``read_unpaired``, which refuses a row of
another format (``not_unpaired``) or without a bool ``label`` (``missing_label``, ``label_not_bool``).
A pair file whose first pair has a ``margin`` (TRL's RewardTrainer's per-pair margin) reads every pair's with
it, refusing a pair without one (``missing_margin``) or whose margin is no finite number (``invalid_margin``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import numbers
import os
import re
from collections import Counter
from typing import Any, NamedTuple

from minitrainer.data.chat_masking import LEARNING_MARKS, ChatRow, SampleError, json_field, load_row
from minitrainer.data.sources import BadRow

MARGIN_COLUMN = "margin"  # a pair's reward margin (TRL's RewardTrainer), read in and written out under this name
FORMATS = ("messages", "sharegpt", "prompt_completion", "text", "alpaca", "preference", "preference_implicit")
PAIR_FORMATS = ("preference", "preference_implicit")  # rows read by read_pair, never by read_row
INPUT_FORMATS = ("auto",) + FORMATS
# The keys that make each format (all must be there); "chosen" and "rejected" win over every other shape, then
# "messages" (detect_format).
SHAPES = {"messages": ("messages",), "sharegpt": ("conversations",), "prompt_completion": ("prompt", "completion"),
          "text": ("text",), "alpaca": ("instruction", "output"), "preference": ("prompt", "chosen", "rejected"),
          "preference_implicit": ("chosen", "rejected")}
# The column names --columns may map to.
COLUMNS = ("messages", "conversations", "prompt", "completion", "text", "instruction", "input", "output", "system",
           "tools", "chosen", "rejected", MARGIN_COLUMN)
ACCEPTED = "; ".join(f"{name} ({' + '.join(keys)})" for name, keys in SHAPES.items())

# The column holding a format's conversation, which is never a string of text (a prompt may be).
_TURNS = {"messages": "messages", "sharegpt": "conversations"}

SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "model": "assistant", "function_call": "assistant", "observation": "tool", "tool": "tool"}
# Roles a ``messages`` row may use in place of the canonical ones, read as ShareGPT reads them: ShareGPT's
# human / gpt / observation, and model (Gemma's assistant). function_call, a whole tool call, stays ShareGPT's.
MESSAGE_ROLE_ALIASES = {role: canonical for role, canonical in SHAREGPT_ROLES.items()
                        if role != canonical and role != "function_call"}
# Other names ShareGPT files in the wild give the assistant (ShareGPT_Vicuna_unfiltered's chatgpt, bing, bard),
# kept apart from SHAREGPT_ROLES so the summary can say how many turns were read under a name that is not the
# format's own (sharegpt_roles_mapped); --sharegpt-roles adds to them (parse_sharegpt_roles).
SHAREGPT_MAPPED_ROLES = {"chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}
SHAREGPT_TARGETS = tuple(dict.fromkeys(role for name, role in SHAREGPT_ROLES.items() if name != "function_call"))


def parse_columns(text: str | None) -> dict[str, str]:
    """``"prompt=question,completion=answer"`` -> ``{"question": "prompt", "answer": "completion"}``
    (input column -> accepted name). ``ValueError`` names the first bad pair."""
    mapping: dict[str, str] = {}
    for pair in (text or "").split(","):
        if not pair.strip():
            continue
        name, sep, column = (part.strip() for part in pair.partition("="))
        if not sep or not column or name not in COLUMNS:
            raise ValueError(f"--columns {pair!r}: expected NAME=COLUMN with NAME one of {', '.join(COLUMNS)}")
        mapping[column] = name
    return mapping


def parse_sharegpt_roles(text: str | None) -> dict[str, str]:
    """``"robot=assistant,person=user"`` -> ``SHAREGPT_MAPPED_ROLES`` with ``{"robot": "assistant", "person":
    "user"}`` added (a turn's ``from`` -> its role). ``ValueError`` names the first bad item."""
    mapping = dict(SHAREGPT_MAPPED_ROLES)
    given: set[str] = set()
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, role = (part.strip() for part in item.partition("="))
        if not sep or not name or role not in SHAREGPT_TARGETS:
            raise ValueError(f"--sharegpt-roles {item!r}: expected NAME=ROLE with ROLE one of "
                             f"{', '.join(SHAREGPT_TARGETS)}")
        if name in SHAREGPT_ROLES:
            raise ValueError(f"--sharegpt-roles {item!r}: {name!r} is ShareGPT's own name for "
                             f"{SHAREGPT_ROLES[name]}; map only other names")
        if name in given:
            raise ValueError(f"--sharegpt-roles {item!r}: {name!r} is mapped twice")
        given.add(name)
        mapping[name] = role
    return mapping


def detect_format(row: dict[str, Any]) -> str:
    """The row's format by its keys; ``SampleError`` for none or several (module docstring)."""
    if "chosen" in row and "rejected" in row:
        # A pair whatever else it carries: UltraFeedback binarized keeps its chosen conversation in 'messages' too.
        return "preference" if "prompt" in row else "preference_implicit"
    if "messages" in row:
        return "messages"
    found = [name for name, keys in SHAPES.items() if all(key in row for key in keys)]
    if len(found) == 1:
        return found[0]
    keys = ", ".join(map(repr, row)) or "none"
    if not found:
        raise SampleError("missing_messages", f"no 'messages' field nor another accepted format: the row has keys "
                                              f"{keys}; accepted: {ACCEPTED}")
    raise SampleError("ambiguous_format", f"the row has the keys of {' and '.join(found)} ({keys}); "
                                          "--input-format picks one")


def row_format(row: dict[str, Any], input_format: str = "auto") -> str:
    """The format the row is read as: detected (``"auto"``) or forced, its keys checked."""
    fmt = detect_format(row) if input_format == "auto" else input_format
    missing = [key for key in SHAPES[fmt] if key not in row]
    if missing:
        raise SampleError("missing_messages" if fmt == "messages" else "missing_field",
                          f"no {' nor '.join(map(repr, missing))} field (--input-format {fmt}); the row has keys "
                          f"{', '.join(map(repr, row)) or 'none'}")
    return fmt


def read_row(raw: Any, *, input_format: str = "auto", columns: dict[str, str] | None = None,
             from_table: bool = False, roles: dict[str, str] | None = None,
             mapped: Counter | None = None) -> tuple[str, ChatRow]:
    """Convert one input row.

    Args:
        raw: a JSON line (``bytes``), a parsed row (a table row, a JSON array element) or a
            ``BadRow`` the reader could not parse.
        input_format: ``"auto"`` (detect per row) or one of ``FORMATS``.
        columns: input column -> accepted name (``parse_columns``), applied first.
        from_table: ``raw`` is an Arrow table's row (``_without_struct_nulls``).
        roles: ShareGPT ``from`` names read as roles beyond the format's own (``parse_sharegpt_roles``;
            default ``SHAREGPT_MAPPED_ROLES``).
        mapped: where a converted row's ShareGPT turns read under such a name are counted, by name (the
            one count a caller keeps across rows; a refused row adds nothing).

    Returns:
        ``(format, chat_row)``.

    Raises:
        SampleError: the row is not an object of an accepted format, or not a valid row of its format.
    """
    row, fmt = _row_and_format(raw, input_format=input_format, columns=columns)
    if fmt in PAIR_FORMATS:
        err = SampleError("preference_row", "a chosen/rejected pair in a file of SFT rows (its first convertible "
                                            "row is not a pair; 'chosen' and 'rejected' make a row a pair whatever "
                                            "else it holds): give pairs a file of their own"
                          + ("; --input-format messages reads its 'messages' as SFT" if "messages" in row else ""))
        err.row_format = fmt
        raise err
    if from_table:
        row = _without_struct_nulls(row)
    try:
        chat_row, names = _convert(fmt, row, SHAREGPT_MAPPED_ROLES if roles is None else roles)
    except SampleError as err:
        err.row_format = fmt
        raise
    if mapped is not None:
        mapped.update(names)
    return fmt, chat_row


class Pair(NamedTuple):
    """One preference row read (``read_pair``): its two sides, the columns it does not read and its margin."""

    format: str  # "preference" (a prompt given) or "preference_implicit" (the sides' shared turns)
    chosen: ChatRow
    rejected: ChatRow
    not_read: tuple[str, ...]  # the row's columns no side uses (ratings, ids, UltraFeedback's 'messages'), by name
    margin: float | None = None  # read only in a file of pairs with margins (read_pair's margins)


def read_pair(raw: Any, *, input_format: str = "auto", columns: dict[str, str] | None = None,
              from_table: bool = False, margins: bool = False) -> Pair:
    """Convert one preference row (TRL's explicit ``prompt``/``chosen``/``rejected`` or implicit
    ``chosen``/``rejected``, conversational or plain strings, and the layouts of docs/preference.md)
    into its two sides.

    Each side is the prompt/completion row of the prompt and that side (``_prompt_completion``), so
    what a side learns is exactly what SFT learns of that row. Arguments as ``read_row``'s, and:

    Args:
        margins: the row is of a file of pairs with margins (its first pair has a ``margin``): the
            row's ``margin`` is read, and must be a finite number (``_margin``); else it is a column
            not read, as any other.

    Returns:
        The ``Pair``: its format, the chosen and the rejected side, the columns it does not read (by the
        names the input gives them), its margin (None unless ``margins``).

    Raises:
        SampleError: not a preference row (``not_a_pair``), no margin (``missing_margin``) or one that is
            no finite number (``invalid_margin``) with ``margins``, no prompt found (``no_shared_prompt``),
            an empty side (``empty_side``), or a side that is not a valid prompt/completion row.
    """
    loaded = _loaded(raw)
    row, fmt = _row_and_format(loaded, input_format=input_format, columns=columns)
    if fmt not in PAIR_FORMATS:
        decided = f"its {', '.join(map(repr, SHAPES[fmt]))}, no 'chosen' and 'rejected'"
        err = SampleError("not_a_pair", f"a {fmt} row ({decided}) in a file of preference pairs (its first "
                                        "convertible row is a pair): give SFT rows a file of their own")
        err.row_format = fmt
        raise err
    if from_table:
        # A CSV cell holds no list: a conversation there is JSON text (as _convert reads a 'messages' cell).
        row = _without_struct_nulls({key: _json_turns(value) if key in SHAPES["preference"] else value
                                     for key, value in row.items()})
    source = {name: column for column, name in (columns or {}).items()}  # accepted name -> the input's column
    try:
        margin = _margin(row, source.get(MARGIN_COLUMN, MARGIN_COLUMN), from_table=from_table) if margins else None
        # A prompt --columns names from another column is a question (Intel/orca_dpo_pairs' prompt=question).
        named = source.get("prompt", "prompt") in loaded.keys() - {"prompt"}
        found, chosen, rejected, read = _pair(fmt, row, prompt_named=named)
    except SampleError as err:
        err.row_format = fmt
        raise
    read |= {MARGIN_COLUMN} if margins else set()
    return Pair(found, chosen, rejected, tuple(source.get(key, key) for key in row if key not in read), margin)


_MARGIN_FILE = "a file of pairs with margins (its first pair has one)"


def _margin(row: dict[str, Any], name: str, *, from_table: bool) -> float:
    """The pair's margin as a float, or why it has none: ``missing_margin`` (absent, null, an empty CSV
    cell), ``invalid_margin`` (a bool, a list, text that is no number, NaN or an infinity). ``name`` is the
    input's column, as the error says it."""
    value = row.get(MARGIN_COLUMN)
    if value is None or from_table and isinstance(value, str) and not value.strip():
        got = "is null" if MARGIN_COLUMN in row else "is missing"
        raise SampleError("missing_margin", f"'{name}' {got} in {_MARGIN_FILE}: give every pair a number")
    number = None
    # A CSV cell is text: its number is read as float() reads it. A JSON string is refused, as a bool is: such
    # a file was written wrong, and a guess would train on it.
    if from_table and isinstance(value, str):
        with contextlib.suppress(ValueError):
            number = float(value)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        with contextlib.suppress(OverflowError):  # an int beyond float64's range
            number = float(value)
    if number is None or not math.isfinite(number):
        kind = {bool: "a bool", **_JSON_TYPES}.get(type(value), type(value).__name__) if number is None \
            else "not finite"
        raise SampleError("invalid_margin", f"'{name}' is {_cut_value(value)}{f' ({kind})' if kind else ''}, not a "
                                            "finite number: a pair's margin is how much more the chosen reply "
                                            "should be preferred")
    return number


def read_unpaired(raw: Any, *, columns: dict[str, str] | None = None,
                  from_table: bool = False) -> tuple[str, ChatRow]:
    """Convert one unpaired feedback row (TRL's unpaired preference, KTO's data): ``prompt``,
    ``completion`` (plain strings or lists of messages) and ``label``, true for a desirable completion,
    false for an undesirable one.

    The row is read as ``read_row`` reads it without its label, so its tokens and labels are exactly
    those SFT gives the prompt/completion row; ``label`` becomes the first copied field, ``desirable``.
    Arguments as ``read_row``'s.

    Returns:
        ``("prompt_completion", chat_row)``.

    Raises:
        SampleError: a row of another format (``not_unpaired``), no label (``missing_label``), a label
            that is no bool (``label_not_bool``), nothing to learn (``empty_completion``), or a row that is
            not a valid prompt/completion row.
    """
    row, fmt = _row_and_format(raw, input_format="auto", columns=columns)
    try:
        label = _feedback_label(row, fmt, from_table=from_table)
        chat_row = read_row({key: value for key, value in row.items() if key != "label"},
                            from_table=from_table)[1]
    except SampleError as err:
        err.row_format = fmt
        raise
    return fmt, dataclasses.replace(chat_row, fields={"desirable": label, **chat_row.fields})


_UNPAIRED_FILE = "a file of unpaired feedback rows (its first convertible row has 'prompt', 'completion' and 'label')"


def _feedback_label(row: dict[str, Any], fmt: str, *, from_table: bool) -> bool:
    """The label of an unpaired feedback row, or why the row is not one that can be learned from."""
    if fmt != "prompt_completion":
        raise SampleError("not_unpaired", f"a {fmt} row (its {', '.join(map(repr, SHAPES[fmt]))}) in "
                                          f"{_UNPAIRED_FILE}: give {fmt} rows a file of their own")
    if "label" not in row:
        raise SampleError("missing_label", f"no 'label' in {_UNPAIRED_FILE}: KTO's label is true (desirable) or "
                                           "false (undesirable); give SFT rows a file of their own")
    label = row["label"]
    if not isinstance(label, bool):
        # A CSV cell is text, so a CSV's labels are strings; only a typed column holds a bool.
        table_hint = "; this table's 'label' column holds text, as every CSV column does: give it as a bool " \
            "column (parquet, arrow) or the rows as JSON lines" if from_table and isinstance(label, str) else ""
        kind = _JSON_TYPES.get(type(label), type(label).__name__)
        raise SampleError("label_not_bool", f"'label' is {_cut_value(label)}{f' ({kind})' if kind else ''}, not a "
                                            "bool: KTO's label is true (desirable) or false (undesirable)"
                                            + table_hint)
    if "desirable" in row:
        raise SampleError("reserved_field", "input field 'desirable' would be overwritten by the output (the "
                                            "rows of an unpaired file gain it from 'label')")
    completion = row["completion"]
    if isinstance(completion, str) and not completion.strip() or isinstance(completion, list) and not completion:
        raise SampleError("empty_completion", "the completion is empty: nothing to learn")
    if isinstance(completion, list):
        replies = [turn for turn in completion if isinstance(turn, dict) and turn.get("role") == "assistant"]
        if replies and not any(map(_says_something, replies)):
            raise SampleError("empty_completion", "the completion's assistant content is empty: nothing to learn")
    return label


# How a label that is no bool is named: by its JSON type (null names itself).
_JSON_TYPES = {type(None): "", str: "a string", int: "a number", float: "a number", list: "a list", dict: "an object"}


def _cut_value(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 40 else text[:40] + "..."


def _says_something(turn: dict[str, Any]) -> bool:
    """A reply with something to learn: content (text, or parts ``check_row`` then reads) or a tool call."""
    content = turn.get("content")
    return bool(turn.get("tool_calls")) or (content.strip() != "" if isinstance(content, str) else bool(content))


def _loaded(raw: Any) -> dict[str, Any]:
    """The row as an object; a line that is no object raises."""
    if isinstance(raw, BadRow):
        raise SampleError(raw.reason, raw.detail)
    try:
        row = load_row(raw) if isinstance(raw, bytes) else raw
    except SampleError as err:
        cut = _cut_off(raw) if err.reason == "invalid_json" else None
        if cut is None:
            raise
        raise SampleError("invalid_json", cut) from None
    if not isinstance(row, dict):
        raise SampleError("not_an_object", f"expected a JSON object, got {type(row).__name__}")
    return row


# The beginnings of a token that a cut-off line may end in: json reports the error where the token starts,
# not at the end of the text.
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")
_NUMBER_TAILS = (".", "e", "E", "e-", "e+", "E-", "E+")
_ESCAPE_START = re.compile(r"\\|u[0-9a-fA-F]{0,4}")


def _cut_off(line: bytes) -> str | None:
    """A JSON line that ran out of text, said so: ``"the JSON is cut off after 57 characters (...)"``; None
    when it parses or its error lies elsewhere (json's own message then says where).

    Cut off means json's error stands where the text ends (a missing delimiter, value or closing bracket;
    the newline inside a string that never closes), in a string that never closes, or at a token the end
    cut short (``tru``, ``1.``, ``\\u00``)."""
    try:
        json.loads(line)
    except json.JSONDecodeError as err:
        rest = err.doc[err.pos:].rstrip()
        if (rest and not err.msg.startswith("Unterminated string") and rest not in _NUMBER_TAILS
                and not any(word.startswith(rest) for word in _LITERALS)
                and not ("escape" in err.msg and _ESCAPE_START.fullmatch(rest))):
            return None
        return (f"the JSON is cut off after {len(err.doc.rstrip())} characters (the file was truncated or a "
                "write was interrupted)")
    except (ValueError, RecursionError):  # not UTF-8, nested too deep: load_row's message says so
        pass
    return None


def _row_and_format(raw: Any, *, input_format: str, columns: dict[str, str] | None) -> tuple[dict[str, Any], str]:
    """The row as an object, ``--columns``' renames applied, and its format."""
    row = _loaded(raw)
    if columns:
        row = _renamed(row, columns)
    return row, row_format(row, input_format)


# Where a plain-string pair's prompt may stand when its sides share no whole turn (Intel/orca_dpo_pairs'
# 'question'; a prompt string beside conversational sides is looked for first).
QUESTION_COLUMNS = ("question", "instruction", "input")
# The ends of an assistant's header in plain-string conversations: a shared beginning of two plain sides is
# a prompt only up to the last of these (Anthropic/hh-rlhf's "\n\nHuman: ...\n\nAssistant:").
TURN_ENDS = ("\nAssistant:", "\nASSISTANT:", "### Assistant:", "### Response:", "<|im_start|>assistant\n",
             "<|assistant|>\n", "[/INST]")


def _pair(fmt: str, row: dict[str, Any], *, prompt_named: bool) -> tuple[str, ChatRow, ChatRow, set[str]]:
    """The pair's format as found, its sides and the columns read. Where the prompt comes from::

        prompt column                   sides                      prompt
        a list of messages              strings or lists           itself (TRL's explicit conversational)
        a string                        strings                    itself, plain text (TRL's standard), or,
                                                                   named by --columns prompt=COLUMN, a user turn
        a string (UltraFeedback, Tulu)  lists                      the sides' shared leading messages (TRL's
                                                                   maybe_extract_prompt); none shared: a user turn
        none                            lists                      the shared leading messages
        none (hh-rlhf)                  strings                    the shared beginning up to a whole turn's end
                                                                   (TURN_ENDS), never a few shared characters
        none, none of the above         (orca_dpo_pairs)           a QUESTION_COLUMNS string, as a user turn

    A prompt that is a user turn goes through the chat template, after the ``system`` column's message, so
    such a pair tokenizes as its explicit conversational form would.
    """
    if isinstance(row.get("tools"), str):  # a table's JSON string, as _convert reads it
        row = {**row, "tools": json_field(row["tools"], "invalid_tools", "'tools'")}
    chosen, rejected = row["chosen"], row["rejected"]
    prompt = row.get("prompt") if fmt == "preference" else None
    read = {"chosen", "rejected"} | ({"prompt"} if fmt == "preference" else set())
    found = "preference"
    plain = isinstance(prompt, str) and isinstance(chosen, str)
    if plain and prompt_named:
        prompt = [{"role": "user", "content": prompt}]
    elif not (plain or isinstance(prompt, list)):  # else TRL's explicit forms, as given
        found, prompt, chosen, rejected, column = _implicit(row, prompt, chosen, rejected)
        read.update([column] if column else [])
    rest = {}
    if isinstance(prompt, list):  # the template reads the tools and a system message, which plain text has not
        rest = {key: row[key] for key in ("tools",) if key in row}
        if "system" in row and not (prompt and isinstance(prompt[0], dict)
                                    and prompt[0].get("role") in ("system", "developer")):
            rest["system"] = row["system"]
        read |= rest.keys()
    sides = []
    for name, side in (("chosen", chosen), ("rejected", rejected)):
        if not side or isinstance(side, str) and not side.strip():
            raise SampleError("empty_side", f"'{name}' is empty" + (" once the prompt the sides share is taken out"
                                                                  if found == "preference_implicit" else ""))
        try:
            sides.append(_prompt_completion(prompt, side, dict(rest)))
        except SampleError as err:
            if err.reason in ("empty_completion", "empty_messages"):
                raise SampleError("empty_side", f"'{name}': {err.detail}") from None
            err.detail = f"'{name}': {err.detail}"
            raise
    return found, sides[0], sides[1], read


def _implicit(row: dict[str, Any], prompt: Any, chosen: Any, rejected: Any) -> tuple[str, Any, Any, Any, str | None]:
    """``(format, prompt, chosen, rejected, column)`` of a pair whose prompt is not given as TRL gives it:
    the sides' shared whole turns, else the prompt string or a ``QUESTION_COLUMNS`` string (its name
    returned as ``column``) as the user's turn; ``no_shared_prompt`` when there is none of these."""
    if type(chosen) is not type(rejected) or not isinstance(chosen, (str, list)):
        raise SampleError("invalid_pair", f"'chosen' is a {type(chosen).__name__} and 'rejected' a "
                                          f"{type(rejected).__name__}: both strings or both lists of messages")
    if isinstance(chosen, list):
        shared, chosen_rest, rejected_rest = implicit_prompt(chosen, rejected)
    else:
        end = turn_prefix(chosen, rejected)
        shared, chosen_rest, rejected_rest = chosen[:end], chosen[end:], rejected[end:]
    if shared:
        return "preference_implicit", shared, chosen_rest, rejected_rest, None
    if isinstance(prompt, str):
        return "preference", [{"role": "user", "content": prompt}], chosen, rejected, None
    column = next((key for key in QUESTION_COLUMNS if isinstance(row.get(key), str) and row[key].strip()), None)
    if column is not None:
        return "preference", [{"role": "user", "content": row[column]}], chosen, rejected, column
    # TRL would learn each whole side with no question before it (or after a few shared characters); a dataset
    # keeping its question in another column (Intel/orca_dpo_pairs' 'question') is what this is.
    what = "messages" if isinstance(chosen, list) else \
        f"whole turn (a beginning ending in {' or '.join(map(repr, TURN_ENDS[:2]))})"
    raise SampleError("no_shared_prompt", f"'chosen' and 'rejected' share no leading {what}, and the row has no "
                                          f"prompt column ({', '.join(('prompt',) + QUESTION_COLUMNS)}): name the "
                                          "prompt's column, e.g. --columns prompt=question")


def turn_prefix(chosen: str, rejected: str) -> int:
    """The length of the longest beginning two plain-string sides share that ends a turn: up to the end of
    the last assistant header (``TURN_ENDS``) inside their common prefix, so the prompt is whole turns and
    each reply starts after its header (hh-rlhf's ``"...\\n\\nAssistant:"``, the reply's space its own);
    0 when there is none."""
    shared = os.path.commonprefix([chosen, rejected])
    return max((shared.rfind(end) + len(end) for end in TURN_ENDS if end in shared), default=0)


def _json_turns(value: Any) -> Any:
    """A string holding a JSON list of messages (a conversation in a CSV cell) as that list; any other
    value, a plain text that only looks like one included, as is."""
    if not (isinstance(value, str) and value.lstrip().startswith("[{")):
        return value
    try:
        turns = json.loads(value)
    except ValueError:
        return value
    return turns if isinstance(turns, list) and all(isinstance(turn, dict) for turn in turns) else value


def implicit_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """``(prompt, chosen, rejected)``: the longest common prefix of the sides (messages of lists,
    characters of strings) taken out as the prompt; ``read_pair`` splits conversational pairs so and
    plain strings at a whole turn (``turn_prefix``). A port of TRL's ``extract_prompt``
    (trl/data_utils.py:548, TRL 1.16), quirks kept so a pair splits as TRL splits it: a string prompt
    gives its trailing space back to the sides; when one side is a prefix of the other the loop ends
    without a break and the last shared item still goes to the sides; and a first difference at index
    0 steps back to -1 when ``chosen`` ends with a space (Python's ``[-1]``)."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":  # TRL: the space belongs to the completion
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _renamed(row: dict[str, Any], columns: dict[str, str]) -> dict[str, Any]:
    """The row with ``--columns``' renames (input column -> accepted name) applied. A mapped column
    replaces a column already under its new name, wherever either stands in the row."""
    targets = {columns[key] for key in row if key in columns}
    return {columns.get(key, key): value for key, value in row.items() if key in columns or key not in targets}


# Names public datasets give these columns. Only a refusal's hint reads them (suggest_columns), and
# it offers only a mapping under which the row then converts: nothing is renamed unasked.
_PROMPT_NAMES = ("instruction", "question", "query", "problem", "prompt", "input", "user")
_ANSWER_NAMES = ("response", "answer", "output", "completion", "generated_solution", "solution", "target",
                 "assistant")
_TEXT_NAMES = ("content", "document", "body", "article", "passage")
_SYSTEM_NAMES = ("system", "system_prompt", "system_message")
_REPLY_ROLES = ("assistant", "gpt", "model", "function_call",
                *(name for name, role in SHAREGPT_MAPPED_ROLES.items() if role == "assistant"))


def suggest_columns(raw: Any, *, input_format: str = "auto", columns: str | None = None,
                    from_table: bool = False) -> list[tuple[str, str]]:
    """``--columns`` values (with ``columns``, the one given, kept in front) under which a row of no
    accepted shape converts, each with the format it is then read as: a column of role/content turns
    holding a prompt and a reply as ``messages`` (from/value or input/output: ``conversations``), one of
    prompt turns beside an answer-like string as a conversational prompt and its reply, a question-like
    and an answer-like string column as alpaca (through the chat template) and as plain
    prompt/completion (no template), or one text-like column as ``text``; of a preference row
    (``chosen`` and ``rejected``), only ``chosen``: as the completion of its ``prompt``, as the
    conversation when it holds one, or as the answer to a question-like column. The format is named
    with how it is then tokenized. Empty when none converts."""
    try:
        row = load_row(raw) if isinstance(raw, bytes) else raw
    except SampleError:
        return []
    if not isinstance(row, dict):
        return []
    row = _renamed(row, parse_columns(columns))
    if {"chosen", "rejected"} <= row.keys():  # preference rows: SFT learns the chosen reply, never the other
        chosen = {key: value for key, value in row.items() if key != "rejected"}
        candidates = [{"prompt": "prompt", "completion": "chosen"}] + _candidates(chosen, answers=("chosen",))
    else:
        candidates = _candidates(row)
    found = []
    for candidate in dict.fromkeys(tuple(candidate.items()) for candidate in candidates):
        candidate = dict(candidate)
        renames = {column: name for name, column in candidate.items() if name != column}
        try:
            fmt, chat_row = read_row(row, input_format=input_format, columns=renames, from_table=from_table)
        except SampleError:
            continue
        plain = chat_row.fields["messages"][0]["role"] == "pretrain"
        note = {"alpaca": " (through the chat template)", "prompt_completion": " (plain text, no chat template)"
                if plain else " (conversational, through the chat template)"}.get(fmt, "")
        found.append((",".join([*filter(None, [columns]), *(f"{name}={column}" for column, name in renames.items())]),
                      fmt + note))
    return found


def _candidates(row: dict[str, Any], answers: tuple[str, ...] = _ANSWER_NAMES) -> list[dict[str, str]]:
    """Renames (accepted name -> column) that may read ``row``, by its columns' shapes and names; an
    answer is a string column named one of ``answers``."""
    candidates, prompt_turns = [], []
    for key, value in row.items():
        first = value[0] if isinstance(value, list) and value else None
        if not isinstance(first, dict):
            continue
        if not any(map(_prompts, value)):
            continue  # replies alone (OpenAI's preference rows: preferred_output, non_preferred_output)
        if not any(map(_replies, value)):
            prompt_turns.append(key)  # a prompt whose reply may be a string column (Llama-Nemotron's input/output)
        elif {"role", "content"} <= first.keys():
            candidates.append({"messages": key})
        elif {"from", "value"} <= first.keys() or {"input", "output"} <= first.keys():
            candidates.append({"conversations": key})
    strings = [key for key, value in row.items() if isinstance(value, str)]
    prompt = next((key for key in _PROMPT_NAMES if key in strings), None)
    answer = next((key for key in answers if key in strings and key != prompt), None)
    system = {"system": next((key for key in _SYSTEM_NAMES if key in strings), "system")}
    if answer:
        candidates += [{"prompt": key, "completion": answer, **system} for key in prompt_turns[:1]]
    if prompt and answer:
        context = {"input": "context"} if "context" in strings and "input" not in row else {}
        candidates.append({"instruction": prompt, "output": answer, **context, **system})
        if prompt != "instruction":  # an instruction's row may hold more (input, context) than a prompt would
            candidates.append({"prompt": prompt, "completion": answer})
    return candidates + [{"text": key} for key in _TEXT_NAMES if key in strings][:1]


def unread_system(fmt: str, chat_row: ChatRow) -> str | None:
    """The copied column that looks like the system prompt of a conversation that has none, in a format
    that reads one from a ``system`` column (``--columns system=NAME`` then does): a non-empty string
    under a system-like name (Locutusque/function-calling-chatml's ``system_message``, which tells the
    model it may call functions). None otherwise."""
    messages = chat_row.fields.get("messages")
    if fmt not in ("sharegpt", "alpaca", "prompt_completion") or not isinstance(messages, list) or any(
            isinstance(message, dict) and message.get("role") in ("system", "developer", "pretrain")
            for message in messages):
        return None
    return next((key for key in _SYSTEM_NAMES if isinstance(chat_row.fields.get(key), str)
                 and chat_row.fields[key].strip()), None)


def _prompts(turn: Any) -> bool:
    """A turn that is not a reply: what a conversation offered for learning must hold before its replies."""
    return isinstance(turn, dict) and (turn.get("role") or turn.get("from")) not in _REPLY_ROLES


def _replies(turn: Any) -> bool:
    """A turn a model learns: an assistant's (``gpt``, ``function_call``), or an exchange's ``output``."""
    return isinstance(turn, dict) and ((turn.get("role") or turn.get("from")) in _REPLY_ROLES or "output" in turn)


def _without_struct_nulls(row: dict[str, Any]) -> dict[str, Any]:
    """A table row with the tool schemas and tool calls it has, not those of other rows.

    A column of structs holds every field any row has: a row's tool schema gains the other tools'
    parameters and its call's arguments the other calls' argument names, all ``None``, which a
    template would write as ``null`` and the model learn to call with. A table cannot tell such a
    ``None`` from a JSON null, so inside these two every ``None`` goes (a JSON string, parsed later,
    keeps its nulls)."""
    if isinstance(row.get("tools"), list):
        row = {**row, "tools": _no_nulls(row["tools"])}
    for key in ("messages", "prompt", "completion", "conversations", "chosen", "rejected"):
        turns = row.get(key)
        if isinstance(turns, list) and any(map(_calls_tools, turns)):
            row = {**row, key: [{**turn, "tool_calls": _no_nulls(turn["tool_calls"])} if _calls_tools(turn) else turn
                                for turn in turns]}
    return row


def _calls_tools(turn: Any) -> bool:
    return isinstance(turn, dict) and isinstance(turn.get("tool_calls"), list)


def _no_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _no_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_no_nulls(item) for item in value]
    return value


def _convert(fmt: str, row: dict[str, Any], roles: dict[str, str]) -> tuple[ChatRow, Counter]:
    """The row in the ``messages`` format, and its ShareGPT turns read under a ``roles`` name, by name."""
    if isinstance(row.get("tools"), str):
        # Tables keep tool schemas as one JSON string (LLaMA-Factory, hub parquet files): as a column of
        # structs, each schema would gain every other tool's parameters as nulls.
        row = {**row, "tools": json_field(row["tools"], "invalid_tools", "'tools'")}
    turns = _TURNS.get(fmt)
    if turns and isinstance(row[turns], str):
        # A CSV cell holds no list: a conversation there (or in any table column of strings) is JSON text.
        row = {**row, turns: json_field(row[turns], "messages_not_a_list", f"'{turns}' is a string and")}
    if fmt == "messages":
        row = _canonical_roles(row)
        return ChatRow(_openai_functions(row) if _uses_functions(row) else row), Counter()
    rest = {key: value for key, value in row.items() if key not in SHAPES[fmt]}
    if fmt == "text":
        return ChatRow({"messages": [{"role": "pretrain", "content": _decoded(row["text"])}], **rest}), Counter()
    if fmt == "alpaca":
        return ChatRow(_alpaca(row, rest)), Counter()
    if fmt == "sharegpt":
        fields, names = _sharegpt(row, rest, roles)
        return ChatRow(fields), names
    return _prompt_completion(row["prompt"], row["completion"], rest), Counter()


def _canonical_roles(row: dict[str, Any]) -> dict[str, Any]:
    """The row with ShareGPT's and Gemma's role names (``MESSAGE_ROLE_ALIASES``) as the canonical ones."""
    messages = row["messages"]
    if not isinstance(messages, list):
        return row
    renamed = [{**m, "role": MESSAGE_ROLE_ALIASES[m["role"]]}
               if isinstance(m, dict) and isinstance(m.get("role"), str) and m["role"] in MESSAGE_ROLE_ALIASES else m
               for m in messages]
    return row if all(a is b for a, b in zip(renamed, messages)) else {**row, "messages": renamed}


def _uses_functions(row: dict[str, Any]) -> bool:
    """OpenAI's fine-tuning files before tools: ``functions``, ``function_call`` turns, ``function`` results."""
    return "functions" in row or isinstance(row["messages"], list) and any(
        isinstance(m, dict) and (m.get("function_call") is not None or m.get("role") == "function")
        for m in row["messages"])


def _openai_functions(row: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's legacy function calling as the tools format it became: ``functions`` -> ``tools``, an
    assistant's ``function_call`` -> its one tool call, a ``function`` message -> a ``tool`` message."""
    row = dict(row)
    functions = row.pop("functions", None)
    if functions is not None:
        if row.get("tools") is not None:
            raise SampleError("invalid_tools", "the row has both 'functions' (OpenAI's legacy format) and 'tools'")
        if not isinstance(functions, list):
            raise SampleError("invalid_tools", "'functions' must be a list of JSON schema objects")
        row["tools"] = [{"type": "function", "function": schema} for schema in functions]
    if not isinstance(row["messages"], list):
        return row  # check_row says what is wrong with it
    messages = []
    for index, message in enumerate(row["messages"]):
        if isinstance(message, dict) and message.get("function_call") is not None:
            if message.get("tool_calls"):
                raise SampleError("invalid_tool_calls", f"message {index} has both function_call and tool_calls")
            message = {key: value for key, value in message.items() if key != "function_call"} | {
                "tool_calls": _tool_calls(index, message["function_call"])}
        elif isinstance(message, dict) and message.get("role") == "function":
            message = {**message, "role": "tool"}
        messages.append(message)
    row["messages"] = messages
    return row


def _decoded(text: Any) -> Any:
    """A text file's row arrives as bytes (``sources._text_rows``): decoded here, in the workers."""
    if not isinstance(text, bytes):
        return text
    try:
        return text.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SampleError("invalid_utf8", f"the text is not UTF-8: {err}") from None


def _string_or_none(row: dict[str, Any], key: str) -> str | None:
    value = row.get(key)
    if value is not None and not isinstance(value, str):
        raise SampleError("non_string_content", f"'{key}' is a {type(value).__name__}")
    return value


def _system_turns(rest: dict[str, Any]) -> list[dict[str, str]]:
    """The system message a ``system`` column holds (alpaca, ShareGPT and conversational prompt/completion
    rows read one), taken out of ``rest``: none when the column is missing or empty."""
    system = _string_or_none(rest, "system")
    rest.pop("system", None)
    return [{"role": "system", "content": system}] if system else []


def _alpaca(row: dict[str, Any], rest: dict[str, Any]) -> dict[str, Any]:
    """One user turn (instruction, then input on the next line, as LLaMA-Factory joins them), one reply,
    after the earlier rounds of LLaMA-Factory's ``history`` (``[[instruction, reply], ...]``), whose
    replies are learned too, as every reply of a conversation is."""
    instruction, extra_input = _string_or_none(row, "instruction"), _string_or_none(row, "input")
    output, messages = _string_or_none(row, "output"), _system_turns(rest)
    if instruction is None or output is None:
        raise SampleError("missing_content", f"'{'instruction' if instruction is None else 'output'}' is null")
    history = _history(rest.pop("history", None))
    rest.pop("input", None)
    for earlier, reply in history:
        messages += [{"role": "user", "content": earlier}, {"role": "assistant", "content": reply}]
    messages += [{"role": "user", "content": "\n".join(part for part in (instruction, extra_input) if part)},
                 {"role": "assistant", "content": output}]
    return {"messages": messages, **rest}


def _history(value: Any) -> list[list[str]]:
    if value is None:
        return []
    if not (isinstance(value, list) and all(isinstance(pair, (list, tuple)) and len(pair) == 2
                                            and all(isinstance(text, str) for text in pair) for pair in value)):
        raise SampleError("invalid_history", "'history' must be a list of [instruction, reply] string pairs")
    return value


def _sharegpt(row: dict[str, Any], rest: dict[str, Any], roles: dict[str, str]) -> tuple[dict[str, Any], Counter]:
    """The row's fields in the ``messages`` format, and its turns read under a ``roles`` name, by name."""
    turns = row["conversations"]
    if not isinstance(turns, list):
        raise SampleError("messages_not_a_list", f"'conversations' is a {type(turns).__name__}")
    if not turns:
        raise SampleError("empty_messages", "'conversations' is empty")
    messages, names = _system_turns(rest), Counter()
    for index, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise SampleError("message_not_an_object", f"turn {index} is a {type(turn).__name__}")
        if "from" not in turn and "role" in turn:  # a 'conversations' column in the messages format
            messages.append(turn)
            continue
        if "from" not in turn and {"input", "output"} <= turn.keys():  # LDJnr/Capybara: one exchange a turn
            if len(turn) > 2:  # an alpaca row has instruction beside them: a list of rows, not one conversation
                others = ", ".join(repr(key) for key in turn if key not in ("input", "output"))
                raise SampleError("invalid_exchange", f"turn {index} has 'input' and 'output' (an exchange) but also "
                                                      f"{others}, which an exchange does not hold")
            messages += [{"role": "user", "content": turn["input"]}, {"role": "assistant", "content": turn["output"]}]
            continue
        name = turn["from"] if isinstance(turn.get("from"), str) else None
        role = SHAREGPT_ROLES.get(name) or roles.get(name)
        if role is None:
            raise SampleError("unknown_role", f"turn {index} has from {turn.get('from')!r}; allowed: "
                                              f"{', '.join([*SHAREGPT_ROLES, *roles])}; --sharegpt-roles "
                                              "NAME=ROLE reads other names")
        if name not in SHAREGPT_ROLES:
            names[name] += 1
        if turn["from"] == "function_call":
            message = {"role": "assistant", "content": "", "tool_calls": _tool_calls(index, turn.get("value"))}
        else:
            message = {"role": role, "content": turn.get("value")}
        # weight 0 / 1 as in OpenAI's format (null in OpenHermes), axolotl's train / training, agent data's loss
        message.update({key: turn[key] for key in LEARNING_MARKS if turn.get(key) is not None})
        messages.append(message)
    if isinstance(rest.get("tools"), list):  # LLaMA-Factory lists bare function schemas
        rest["tools"] = [tool if not isinstance(tool, dict) or "function" in tool else
                         {"type": "function", "function": tool} for tool in rest["tools"]]
    return {"messages": messages, **rest}, names


def _tool_calls(index: int, value: Any) -> list[dict]:
    """A ShareGPT ``function_call`` turn's value (``{"name", "arguments"}`` or a list, maybe as a JSON
    string) as OpenAI ``tool_calls``."""
    calls = json_field(value, "invalid_tool_calls", f"turn {index} (function_call)") if isinstance(value, str) \
        else value
    calls = calls if isinstance(calls, list) else [calls]
    if not all(isinstance(call, dict) and "name" in call for call in calls):
        raise SampleError("invalid_tool_calls", f"turn {index} (function_call): expected "
                                                "{\"name\": ..., \"arguments\": ...}")
    return [{"type": "function", "function": {"name": call["name"], "arguments": call.get("arguments", {})}}
            for call in calls]


def _prompt_completion(prompt: Any, completion: Any, rest: dict[str, Any]) -> ChatRow:
    """TRL's prompt/completion: conversational (lists of messages) or plain strings. A string completion
    after a conversational prompt (Llama-Nemotron's post-training data: ``input`` messages, ``output``
    text) is the assistant's reply. A ``system`` column goes before a conversational prompt (Llama-Nemotron's
    ``system_prompt``, "detailed thinking on", switches its reasoning); plain strings have no system prompt."""
    if rest.get("label") is False:  # TRL's unpaired preference (KTO) rows: SFT learns a completion, never this one
        raise SampleError("undesirable_completion", "'label' is false: in TRL's unpaired preference (KTO) rows that "
                                                    "marks a completion not to learn; rows labelled true are learned")
    if isinstance(prompt, list):
        prompt = _system_turns(rest) + prompt
    if isinstance(prompt, list) and isinstance(completion, str):
        if not completion.strip():
            raise SampleError("empty_completion", "the completion is empty")
        completion = [{"role": "assistant", "content": completion}]
    if isinstance(prompt, list) and isinstance(completion, list):
        if not completion:
            raise SampleError("empty_messages", "'completion' is empty")
        return ChatRow({"messages": prompt + completion, **rest}, num_prompt_messages=len(prompt))
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion.strip():
            raise SampleError("empty_completion", "the completion is empty")
        return ChatRow({"messages": [{"role": "pretrain", "content": prompt + completion}], **rest},
                       num_prompt_chars=len(prompt))
    raise SampleError("invalid_prompt_completion", f"'prompt' is a {type(prompt).__name__} and 'completion' a "
                                                   f"{type(completion).__name__}: both strings, both lists of "
                                                   "messages, or a list of messages and the reply's string")
