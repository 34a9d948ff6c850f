"""`--help` of every entry point: each default said once, each flag's help a line or two.

    .venv/bin/python -m pytest -q tests/test_cli_help.py
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

from minitrainer.common.cli import build_arg_parser
from minitrainer.data.process_data import ProcessDataConfig
from minitrainer.tools.demo import DemoConfig
from minitrainer.tools.inspect_data import InspectDataConfig
from minitrainer.train_config import TrainConfig

CONFIGS = [TrainConfig, ProcessDataConfig, DemoConfig, InspectDataConfig]
HELP_WIDTH = 100 - 24 - 2  # argparse's help column on a 100-column terminal


def _flag_helps(config_cls) -> dict[str, str]:
    parser = build_arg_parser(config_cls)
    formatter = parser._get_formatter()
    return {action.option_strings[0]: formatter._expand_help(action)
            for action in parser._actions if action.dest != "help"}


@pytest.mark.parametrize("config_cls", CONFIGS, ids=lambda c: c.__name__)
def test_each_default_is_said_once(config_cls):
    for flag, text in _flag_helps(config_cls).items():
        assert text.count("default") <= 1, f"{flag}: {text}"


@pytest.mark.parametrize("config_cls", CONFIGS, ids=lambda c: c.__name__)
def test_each_flag_help_fits_two_lines(config_cls):
    for flag, text in _flag_helps(config_cls).items():
        assert len(textwrap.wrap(text, HELP_WIDTH)) <= 2, f"{flag} takes more than two lines: {text}"


@pytest.mark.parametrize("config_cls", CONFIGS, ids=lambda c: c.__name__)
def test_help_shows_the_dashed_flags_only(config_cls):
    """``--max_steps`` is taken as ``--max-steps`` (tests/test_foreign_names.py), but not offered as a second flag."""
    parser = build_arg_parser(config_cls)
    assert not [flag for action in parser._actions for flag in action.option_strings if "_" in flag]


def test_defaults_required_flags_and_stated_defaults_read_as_written():
    train_helps, data_helps = _flag_helps(TrainConfig), _flag_helps(ProcessDataConfig)
    assert all(train_helps[flag].endswith("(required)") for flag in ("--output-dir", "--model-name-or-path",
                                                                       "--data-path"))
    assert train_helps["--min-samples-per-checkpoint"].endswith("(default: 0)")
    assert train_helps["--batch-size"].endswith("(default: 1024)")
    assert train_helps["--adam-betas"].endswith("(default: 0.9 0.95)")
    assert train_helps["--resume"].endswith("(default: True)")
    assert train_helps["--max-tokens-per-gpu"].count("%") == 1  # the help's own "10%", not a format error
    assert "(default" not in train_helps["--max-steps"]  # None: no default to state
    assert data_helps["--num-proc"].endswith("(default: CPUs)")  # the text's own default, not the machine's


def test_train_help_runs_as_users_see_it():
    result = subprocess.run([sys.executable, "train.py", "--help"], capture_output=True, text=True,
                            env={"COLUMNS": "100", "PATH": "/usr/bin:/bin"}, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "(default: 1024)" in result.stdout
    assert not re.search(r"\(default[^()]*\)\s*\(default", result.stdout)
