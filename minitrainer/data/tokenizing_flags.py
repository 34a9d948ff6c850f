"""How raw rows become tokens: the eleven settings process_data.py takes and a run (``train.py --data-path`` on raw
data, ``inspect_data``) passes on to it, each declared once here with its default, its choices and its help.

    mask_reasoning: bool = tokenizing_field("mask_reasoning")            # process_data.py's own field
    mask_reasoning: bool = tokenizing_field("mask_reasoning", run=True)  # train.py's, inspect_data's

A run names two of them after the data (``--data-split``, ``--data-subset``: its own ``--split`` would be
ambiguous beside the training flags); ``process_name`` is process_data.py's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minitrainer.common.cli import config_field
from minitrainer.data.formats import INPUT_FORMATS
from minitrainer.data.sources import TEXT_SAMPLE_BY


@dataclass(frozen=True)
class TokenizingFlag:
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    process_name: str | None = None
    """process_data.py's field name, where a run's differs."""


TOKENIZING_FLAGS = {
    "chat_template": TokenizingFlag(None, "jinja file that replaces the tokenizer's chat template"),
    "end_of_turn_token": TokenizingFlag(None, "the string that ends an assistant turn (default: the special token "
                                              "the template writes after a reply)"),
    "mask_reasoning": TokenizingFlag(False, "mask reasoning (reasoning_content, <think> blocks) instead of "
                                            "learning it with the reply"),
    "max_sample_num_tokens": TokenizingFlag(2147483647, "longer samples are rejected (and counted)"),
    "split_long_text": TokenizingFlag(False, "cut a text row longer than --max-sample-num-tokens into pieces "
                                             "(overlapping by one token) instead of rejecting it"),
    "input_format": TokenizingFlag("auto", "row format; auto recognises each row's from its keys",
                                   choices=tuple(INPUT_FORMATS)),
    "columns": TokenizingFlag(None, "rename input columns first, NAME=COLUMN,... "
                                    "(e.g. prompt=question,completion=answer)"),
    "sharegpt_roles": TokenizingFlag(None, "read more ShareGPT 'from' names as roles, NAME=ROLE,... (e.g. "
                                           "robot=assistant,person=user); chatgpt, bing, bard are assistant"),
    "data_split": TokenizingFlag("train", "split of a hub dataset id, a dataset folder (by file names or README.md "
                                          "configs) or a save_to_disk folder", process_name="split"),
    "data_subset": TokenizingFlag(None, "configuration (subset) of a hub dataset id or of a dataset folder's "
                                        "README.md", process_name="subset"),
    "text_sample_by": TokenizingFlag("line", "a .txt file's rows, each learned whole and ended by EOS: each line, "
                                             "each paragraph, or the whole file", choices=tuple(TEXT_SAMPLE_BY)),
}


def tokenizing_field(name: str, *, run: bool = False) -> Any:
    """The dataclass field of setting ``name`` (a ``TOKENIZING_FLAGS`` key): process_data.py's own, or with
    ``run`` a run's, whose help says it is for raw data."""
    flag = TOKENIZING_FLAGS[name]
    choices = {"choices": list(flag.choices)} if flag.choices else {}
    return config_field(flag.default, help=f"raw data: {flag.help}" if run else flag.help, **choices)


def tokenizing_settings(settings: Any) -> dict[str, Any]:
    """process_data.py's fields from a run's ``settings`` (a ``TrainConfig``, an ``InspectDataConfig``); a
    setting the run has no flag for is process_data.py's default, as the run cannot ask for another."""
    return {flag.process_name or name: getattr(settings, name, flag.default)
            for name, flag in TOKENIZING_FLAGS.items()}
