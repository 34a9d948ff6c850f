"""Config files: ``--config FILE`` (YAML or JSON) for every entry point whose CLI comes from a config dataclass.

    torchrun --nproc-per-node=8 train.py --config examples/full_8gpu.yaml --learning-rate 1e-5

A file is one mapping from the config's field names to values: the flags' names, written with
dashes or underscores (``learning-rate: 6e-6`` or ``learning_rate: 6e-6``). Flags given on the
command line override the file. Relative paths in it are read from the working directory, as the
same flags' values are. The Python API reads the same files: ``config_from_file(TrainConfig, path)``.

Each key and value is checked before the config is built: an unknown key is refused with our name
for it when it is another tool's (``num_train_epochs``: ``foreign_names.py``), else with the nearest
valid name, every unknown key of the file at once; a value of the wrong type with the type the field
takes; each as ``FILE:LINE: ...``, on one line. A config class may name keys that its run writes
beside the fields in its record (``TrainConfig.recorded_keys``: world size, device, versions in
``training_params.json``): those are skipped, so a run's record replays the run.

This module also holds what the CLI and the files share: the name suggestions and the field types.
It imports nothing of the toolkit but ``foreign_names`` (pure data), so ``utils`` can build on it.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal, TypeVar

from minitrainer.common.foreign_names import foreign_name_refusal
from minitrainer.common.refusals import listed

ConfigT = TypeVar("ConfigT")


def unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """``(T, True)`` for ``T | None``, else ``(tp, False)``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def nearest_name(word: str, names: list[str]) -> str | None:
    """The name a person most likely meant by ``word``, or None.

    Dashes and underscores are the same; then the closest spelling (difflib); then a short
    form made of the name's initials (``lr`` -> ``learning-rate``). Among several with the same
    initials the earliest in ``names`` wins: configs list their core fields first.
    """
    def canonical(name: str) -> str:
        return name.replace("_", "-")

    by_canonical = {canonical(name): name for name in names}
    if canonical(word) in by_canonical:
        return by_canonical[canonical(word)]
    close = difflib.get_close_matches(canonical(word), list(by_canonical), n=1)
    if close:
        return by_canonical[close[0]]
    if "-" not in canonical(word):
        for name in names:
            if "".join(part[0] for part in re.split(r"[-_]", name) if part) == word:
                return name
    return None


def did_you_mean(word: str, names: list[str]) -> str:
    """``"; did you mean NAME?"`` for the nearest name, or nothing."""
    name = nearest_name(word, names)
    return f"; did you mean {name}?" if name else ""


# ----------------------------------------------------------------------------
# Reading a file


def _yaml_loader() -> type:
    """PyYAML's safe loader reading ``6e-6`` as a number, as YAML 1.2 and JSON do (YAML 1.1, what
    PyYAML implements, wants a dot: ``6.0e-6``), so a learning rate written as people write it
    is a float, not a string."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"))
    return Loader


def _read_pairs(path: Path) -> list[tuple[Any, Any, int | None]]:
    """The file's top-level ``(key, value, line)`` triples, in order (duplicates kept, to refuse them)."""
    text = path.read_text()
    if path.suffix.lower() == ".json":
        try:
            pairs = json.loads(text, object_pairs_hook=_JsonPairs)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None
        if not isinstance(pairs, _JsonPairs):
            raise ValueError(f"{path}: expected one JSON object of settings")
        return [(key, dict(value) if isinstance(value, _JsonPairs) else value, _json_line(text, key))
                for key, value in pairs]
    import yaml

    loader = _yaml_loader()(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return []
        if not isinstance(node, yaml.MappingNode):
            raise ValueError(f"{path}:{node.start_mark.line + 1}: expected a mapping of settings (key: value lines)")
        return [(loader.construct_object(key, deep=True), loader.construct_object(value, deep=True),
                 key.start_mark.line + 1) for key, value in node.value]
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ValueError(f"{where}: not valid YAML ({getattr(err, 'problem', None) or err})") from None
    finally:
        loader.dispose()


class _JsonPairs(list):
    """A JSON object as its ``(key, value)`` pairs, in order, duplicates kept (``json.loads``'s pairs hook)."""


def _json_line(text: str, key: str) -> int | None:
    match = re.search(re.escape(json.dumps(key)) + r"\s*:", text)
    return text.count("\n", 0, match.start()) + 1 if match else None


# ----------------------------------------------------------------------------
# Checking keys and values


def read_config_file(config_cls: type, path: str | Path) -> dict[str, Any]:
    """The settings of a YAML or JSON config file, checked against ``config_cls``'s fields.

    Args:
        config_cls: the config dataclass (``TrainConfig``, ``ProcessDataConfig``, ...).
        path: a ``.yaml``/``.yml`` or ``.json`` file.

    Returns:
        Field name -> value, typed as the field takes it (lists as tuples, integers as floats
        where the field is a float); keys the class lists in ``recorded_keys`` left out.

    Raises:
        ValueError: the file is missing or unreadable, or a key or value is wrong; one line naming
            the file, the line and the key.
    """
    path = Path(path)
    if path.suffix.lower() not in (".yaml", ".yml", ".json"):
        raise ValueError(f"--config {path}: expected a .yaml, .yml or .json file")
    try:
        pairs = _read_pairs(path)
    except OSError as err:
        raise ValueError(f"--config {path}: {err.strerror or err}") from None
    fields = {field.name: field for field in dataclasses.fields(config_cls) if field.init}
    hints = typing.get_type_hints(config_cls)
    recorded = set(getattr(config_cls, "recorded_keys", ()))
    values: dict[str, Any] = {}
    lines: dict[str, int | None] = {}
    # Every unknown key at once: a file brought from another tool is answered in one go, not one key a try.
    unknown = [(f"{path}:{line}: " if line else f"{path}: ") + _unknown_key(str(key), list(fields))
               for key, _, line in pairs if str(key).replace("-", "_") not in (*fields, *recorded)]
    if unknown:
        raise ValueError(listed(unknown, f"--config {path}: {len(unknown)} unknown settings"))
    for key, value, line in pairs:
        where = f"{path}:{line}" if line else str(path)
        name = str(key).replace("-", "_")
        if name in recorded:
            continue
        if name in values:
            raise ValueError(f"{where}: {key!r} is given twice (first on line {lines[name]})")
        field = fields[name]
        checked = check_value(value, hints[name], choices=field.metadata.get("choices"),
                              parse=field.metadata.get("parse"))
        if checked is WRONG:
            options = typing.get_args(unwrap_optional(hints[name])[0]) or field.metadata.get("choices") or ()
            hint = did_you_mean(value, [str(option) for option in options]) if isinstance(value, str) else ""
            raise ValueError(f"{where}: {key} must be {describe_type(hints[name], field.metadata.get('choices'))}, "
                             f"got {value!r}{hint}")
        values[name], lines[name] = checked, line
    return values


def _unknown_key(key: str, fields: list[str]) -> str:
    """Another tool's name (``num_train_epochs``) with ours, else the nearest field, else the key alone."""
    name = key.replace("-", "_")
    return foreign_name_refusal(key, fields, as_flag=False) or f"unknown setting {key!r}{did_you_mean(name, fields)}"


def config_from_file(config_cls: type[ConfigT], path: str | Path) -> ConfigT:
    """The config a file describes, for the Python API (``dataclasses.replace`` changes a field).

    Raises:
        ValueError: as ``read_config_file``; a required field the file lacks; the config's own validation.
    """
    values = read_config_file(config_cls, path)
    missing = [field.name for field in dataclasses.fields(config_cls)
               if field.init and field.name not in values and field.default is dataclasses.MISSING
               and field.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{path}: no {', '.join(missing)} (required)")
    return config_cls(**values)


WRONG = object()
"""What ``check_value`` answers for a value its field cannot hold."""


def check_value(value: Any, hint: Any, *, choices: Any = None, parse: Callable[[str], Any] | None = None) -> Any:
    """``value`` as a field of type ``hint`` holds it, or ``WRONG``.

    A field whose flag value goes through a ``parse=`` function (``config_field``) also takes that
    text, converted as the flag's is (``max_tokens_per_gpu: "4096"``).
    """
    if parse is not None and isinstance(value, str):
        try:
            return parse(value)
        except ValueError:
            return WRONG
    tp, optional = unwrap_optional(hint)
    if value is None:
        return None if optional else WRONG
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            checked = check_value(value, arg)
            if checked is not WRONG:
                return checked
        return WRONG
    if origin is Literal:
        return value if value in typing.get_args(tp) else WRONG
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            return WRONG
        items = tuple(check_value(item, arg) for item, arg in zip(value, args))
        return WRONG if WRONG in items else items
    if origin is dict:
        return value if isinstance(value, dict) else WRONG
    if tp is bool:
        return value if isinstance(value, bool) else WRONG
    if tp is float:
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else WRONG
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else WRONG
    if tp is str:
        return value if isinstance(value, str) and (choices is None or value in choices) else WRONG
    return value  # a type the CLI also takes as it comes


def describe_type(hint: Any, choices: Any = None) -> str:
    """How a person reads a field's type: ``an integer``, ``one of 'a', 'b'``, ``a list of 2 numbers``..."""
    tp, optional = unwrap_optional(hint)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        text = " or ".join(describe_type(arg) for arg in typing.get_args(tp))
    elif origin is Literal or choices:
        text = "one of " + ", ".join(repr(c) for c in (typing.get_args(tp) if origin is Literal else choices))
    elif origin is dict:
        text = "a mapping"
    elif origin is tuple:
        args = typing.get_args(tp)
        text = f"a list of {len(args)} {describe_type(args[0]).removeprefix('a ').removeprefix('an ')}s"
    else:
        text = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))
    return f"{text} (or null)" if optional else text
