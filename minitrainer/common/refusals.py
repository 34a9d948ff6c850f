"""How a refusal of several problems reads: a header line and one line per problem, whatever raised it (a
config's validation, unknown flags, unknown config-file keys), on the command line and through the APIs alike."""

from __future__ import annotations

INVALID = "invalid configuration"


def listed(problems: list[str], header: str) -> str:
    """A refusal of several problems: ``header:`` and one indented line each (joined on one line, thirteen of
    them were two thousand characters to take apart); a single problem is its own line."""
    if len(problems) == 1:
        return problems[0]
    return f"{header}:" + "".join(f"\n  - {problem}" for problem in problems)


def collect_errors(errors: list[str]) -> None:
    """Raise one ValueError listing every validation problem, if any."""
    if errors:
        raise ValueError(f"{INVALID}:" + "".join(f"\n  - {error}" for error in errors))


def problems_of(error: Exception) -> list[str]:
    """The problems a ``collect_errors`` (or ``listed``) refusal lists; any other error is one problem."""
    head, *items = str(error).split("\n  - ")
    return items if items and head.endswith(":") else [str(error)]
