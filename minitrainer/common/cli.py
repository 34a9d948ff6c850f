"""Config dataclass -> command line: one argparse flag per field, with its help, over a ``--config`` file's
values, a refusal in one line (``prog: error: ...``, status 2), output on rank 0 only."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from typing import Any, Literal, TypeVar

from minitrainer.common.config_files import nearest_name, read_config_file, unwrap_optional
from minitrainer.common.exits import EXIT_USAGE
from minitrainer.common.foreign_names import foreign_name_refusal
from minitrainer.common.log import note_exit_line
from minitrainer.common.refusals import listed

ConfigT = TypeVar("ConfigT")


def config_field(default: Any = dataclasses.MISSING, *, help: str, **kwargs: Any) -> Any:
    """A dataclass field whose help text becomes the CLI flag's help.

    ``choices=`` restricts the CLI values; ``parse=`` is the CLI's string -> value
    function for fields whose type argparse cannot infer (e.g. ``int | Literal["auto"]``);
    ``action=`` is the flag's argparse action, for a flag that also stands alone (``--x``, ``--x V``, ``--no-x``);
    ``section=`` on a field opens a headed group of ``--help`` that holds it and the
    fields after it, up to the next section.
    """
    metadata = {"help": help}
    for key in ("choices", "parse", "section", "action"):
        if key in kwargs:
            metadata[key] = kwargs.pop(key)
    if "default_factory" in kwargs:
        return dataclasses.field(default_factory=kwargs.pop("default_factory"), metadata=metadata, **kwargs)
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


class _Parser(argparse.ArgumentParser):
    """argparse, with its output on rank 0 only and a refusal in one line.

    Under torchrun every rank parses the same argv: without this, ``--help`` or a typo printed the
    53-line usage once per rank. ``RANK`` is set by torchrun before any process group exists.
    A refusal is ``prog: error: ...`` alone: the usage block would bury that line.
    """

    def _print_message(self, message: str, file: Any = None) -> None:
        if int(os.environ.get("RANK", "0")) == 0:
            super()._print_message(message, file)

    def error(self, message: str) -> typing.NoReturn:
        note_exit_line(f"{self.prog}: error: {message}")
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_arg_parser(config_cls: type, *, description: str | None = None) -> argparse.ArgumentParser:
    """Generate an argparse parser from a config dataclass.

    Field ``foo_bar`` becomes ``--foo-bar``; booleans get ``--foo``/``--no-foo``;
    ``Literal`` types become choices; tuples become ``nargs``. Fields without a
    default are required. Sections (``config_field(section=...)``) become
    argparse groups, printed in field order. ``--config FILE`` comes first
    (``config_files.py``). Flags are never abbreviated: ``--lr`` must not
    silently mean ``--lr-scheduler``.
    """
    parser = _Parser(description=description, allow_abbrev=False)
    parser.add_argument("--config", metavar="FILE",
                        help="YAML or JSON file of these flags' values (names with dashes or underscores); "
                             "flags given here override it")
    group: argparse.ArgumentParser | argparse._ArgumentGroup = parser
    hints = typing.get_type_hints(config_cls)
    for field in dataclasses.fields(config_cls):
        if not field.init:
            continue
        if "section" in field.metadata:
            group = parser.add_argument_group(field.metadata["section"])
        flag = "--" + field.name.replace("_", "-")
        tp, _ = unwrap_optional(hints[field.name])
        kwargs: dict[str, Any] = {"help": field.metadata.get("help", ""), "dest": field.name}
        if field.default is not dataclasses.MISSING:
            kwargs["default"] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            kwargs["default"] = field.default_factory()
        else:
            kwargs["required"] = True
        if "parse" in field.metadata:
            kwargs["type"] = field.metadata["parse"]
        elif tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(tp) is Literal:
            kwargs["choices"] = list(typing.get_args(tp))
            kwargs["type"] = type(kwargs["choices"][0])
        elif typing.get_origin(tp) is tuple:
            args = typing.get_args(tp)
            kwargs["nargs"] = len(args)
            kwargs["type"] = args[0]
        else:
            kwargs["type"] = tp
            if "choices" in field.metadata:
                kwargs["choices"] = field.metadata["choices"]
        if "action" in field.metadata:
            kwargs["action"] = field.metadata["action"]
        action = group.add_argument(flag, **kwargs)
        # Set after add_argument: Python 3.11's BooleanOptionalAction appends its own default to the help.
        action.help = flag_help(field.metadata.get("help", ""), kwargs.get("default", dataclasses.MISSING))
    return parser


def flag_help(text: str, default: Any) -> str:
    """A flag's help with its default said once: not where the text already states it, nor when it is None."""
    if default is dataclasses.MISSING:
        return f"{text} (required)"
    if default is None or "default" in text:
        return text
    shown = " ".join(map(str, default)) if isinstance(default, tuple) else str(default)
    return f"{text} (default: {shown.replace('%', '%%')})"


def parse_config(config_cls: type[ConfigT], argv: list[str] | None = None, *, description: str | None = None) -> ConfigT:
    """Parse ``argv`` into ``config_cls``: its flags, over a ``--config`` file's values, over the defaults.

    Flags are also taken with underscores (``--max_steps``). An unknown flag (another tool's name with ours,
    ``foreign_names.py``, else the nearest known one), a bad config file or a ``ValueError`` from
    validation exits with code 2 and one ``prog: error: ...`` line, printed by rank 0.
    """
    parser = build_arg_parser(config_cls, description=description)
    argv = dashed_flags(sys.argv[1:] if argv is None else list(argv), parser._option_string_actions)
    # Checked before argparse, whose "required" error would come first and whose message has no suggestion.
    known = [flag[2:] for flag in parser._option_string_actions if flag.startswith("--")]
    unknown = [word.split("=", 1)[0] for word in argv
               if word.startswith("--") and word != "--" and word.split("=", 1)[0] not in parser._option_string_actions]
    if unknown:
        fields = [field.name for field in dataclasses.fields(config_cls) if field.init]
        parser.error(listed([_unknown_flag(flag, known, fields) for flag in unknown], f"{len(unknown)} unknown flags"))
    try:
        file_values = read_config_file(config_cls, path) if (path := _config_path(argv)) else {}
    except ValueError as err:
        parser.error(str(err))
    for action in parser._actions:
        if action.dest in file_values:  # a flag given in argv still overrides this default
            action.default, action.required = file_values[action.dest], False
    values = vars(parser.parse_args(argv))
    del values["config"]
    hints = typing.get_type_hints(config_cls)
    for name, value in values.items():
        if isinstance(value, list) and typing.get_origin(unwrap_optional(hints[name])[0]) is tuple:
            values[name] = tuple(value)
    try:
        return config_cls(**values)
    except ValueError as err:
        parser.error(str(err))


def dashed_flags(argv: list[str], flags: typing.Container[str]) -> list[str]:
    """``argv`` with each underscore spelling of a known flag written as the flag (``--max_steps 3``,
    ``--max_steps=3`` -> ``--max-steps``), as TRL's, Hugging Face's and torchrun's parsers take both;
    ``--help`` shows the dashed form only."""
    out = []
    for word in argv:
        name, eq, value = word.partition("=")
        if word.startswith("--") and "_" in name and name not in flags and name.replace("_", "-") in flags:
            word = name.replace("_", "-") + eq + value
        out.append(word)
    return out


def _unknown_flag(flag: str, known: list[str], fields: list[str]) -> str:
    """Another tool's name (``--num_train_epochs``) with ours, else the nearest known flag, else the flag alone."""
    foreign = foreign_name_refusal(flag, fields, as_flag=True)
    if foreign:
        return foreign
    name = nearest_name(flag[2:], known)
    return f"unknown flag {flag}" + (f"; did you mean --{name}?" if name else "")


def _config_path(argv: list[str]) -> str | None:
    """The value of ``--config`` in ``argv``, the last one given as argparse takes it (read before the
    other flags, which override the file)."""
    path = None
    for i, word in enumerate(argv):
        if word == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif word.startswith("--config="):
            path = word.split("=", 1)[1]
    return path


class BadMapping(argparse.ArgumentTypeError, ValueError):
    """argparse shows an ``ArgumentTypeError``'s own text; config files catch the ``ValueError``."""


def mapping_text(text: str) -> dict:
    """A flag's JSON or YAML mapping (``'{"momentum": 0.9}'``, ``'momentum: 0.9'``); an empty text is no settings."""
    import yaml

    if not text.strip():
        return {}
    try:
        value = yaml.safe_load(text)  # JSON is YAML, so one parser takes both
    except yaml.YAMLError as err:
        raise BadMapping(f"not a JSON or YAML mapping: {text!r} ({str(err).splitlines()[0]})") from None
    if not isinstance(value, dict):
        raise BadMapping(f"not a mapping of names to values: {text!r}")
    return value


def comma_list(text: str) -> list[str]:
    """The names of a comma-separated flag value (``"a, b,"`` -> ``["a", "b"]``)."""
    return [name.strip() for name in text.split(",") if name.strip()]
