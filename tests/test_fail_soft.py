"""Optional things (plots, the parameter record) never stop a run: one warning, and the run goes on.

    .venv/bin/python -m pytest -q tests/test_fail_soft.py

FLOPs/MFU (tests/test_flops.py, the Gemma-4 run in tests/test_architectures.py) and trackers
(tests/test_tracker_resume.py) are tested beside the code they exercise.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from minitrainer.common.distributed import DistInfo
from minitrainer.train_config import TrainConfig


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_plots_that_cannot_be_drawn_are_one_warning(tmp_path, caplog):
    """A run folder without metrics: plot_metrics raises; the demo warns and goes on without plots."""
    from minitrainer.tools.demo import make_plots

    with caplog.at_level(logging.WARNING):
        assert make_plots(tmp_path) == []
    [warning] = _warnings(caplog)
    assert "plots skipped" in warning and "no training_metrics_*.jsonl" in warning


@pytest.fixture
def params_args(tmp_path):
    # Path values, as a Python caller writes them: json.dumps refused them and setup stopped.
    config = TrainConfig(model_name_or_path="m", output_dir=tmp_path, data_path=tmp_path / "data.jsonl", min_samples_per_checkpoint=8)
    dist_info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    return config, dist_info, SimpleNamespace(attn_implementation="sdpa", context_parallel_inner=None,
                                              recomputation="full")


def test_training_params_record_non_json_values_as_text(params_args, tmp_path):
    from minitrainer.setup.run import _write_training_params

    _write_training_params(*params_args, 64)
    params = json.loads((tmp_path / "training_params.json").read_text())
    assert params["output_dir"] == str(tmp_path) and params["data_path"] == str(tmp_path / "data.jsonl")
    assert params["max_tokens_per_gpu_resolved"] == 64


def test_training_params_that_cannot_be_written_are_one_warning(params_args, tmp_path, caplog):
    from minitrainer.setup.run import _write_training_params

    (tmp_path / "training_params.json").mkdir()  # the record's name is taken by a folder: IsADirectoryError
    with caplog.at_level(logging.WARNING):
        _write_training_params(*params_args, 64)
    [warning] = _warnings(caplog)
    assert "training_params.json not written" in warning and "the run goes on" in warning
    assert Path(tmp_path / "training_params.json").is_dir()
