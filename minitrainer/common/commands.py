"""The command a hint prints for one of our entry points, as it runs where the user is: the console script
when the package is installed, ``<this interpreter> -m <module>`` in a checkout (whose ``.venv`` has no
console scripts unless the checkout was pip-installed too)."""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

CHECKOUT_ROOT = Path(__file__).resolve().parents[2]
"""The folder above the package: a checkout when it holds our ``pyproject.toml``, else site-packages."""


def in_checkout() -> bool:
    return (CHECKOUT_ROOT / "pyproject.toml").is_file() and (CHECKOUT_ROOT / "minitrainer").is_dir()


def command(module: str) -> str:
    """How to run ``module`` (``minitrainer.tools.inspect_data``) from the user's shell."""
    if not in_checkout():
        script = _console_script(module)
        if script is not None:
            return script
    return f"{_interpreter()} -m {module}"


def _console_script(module: str) -> str | None:
    """The console script our installed distribution declares for ``module``'s entry point, if any."""
    try:
        entry_points = metadata.distribution("minitrainer").entry_points
    except metadata.PackageNotFoundError:
        return None
    return next((ep.name for ep in entry_points if ep.group == "console_scripts"
                 and ep.value.split(":", 1)[0] == module), None)


def _interpreter() -> str:
    """This Python as the user would type it: relative when it lies under the working folder (``.venv/bin/python``)."""
    executable = Path(sys.executable)
    return str(executable.relative_to(Path.cwd())) if executable.is_relative_to(Path.cwd()) else str(executable)
