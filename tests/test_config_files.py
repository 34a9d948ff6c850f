"""``--config FILE`` and the flags around it: files alone and overridden, a run's record replayed,
refusals in one line, no abbreviated flags, output on rank 0 only, and every example config.

    .venv/bin/python -m pytest -q tests/test_config_files.py
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.e2e import ROOT, assert_ok, model_vocab_size, read_metrics, torchrun, write_tokenized_jsonl
from minitrainer.common.cli import parse_config
from minitrainer.common.config_files import config_from_file, nearest_name, read_config_file
from minitrainer.data.process_data import ProcessDataConfig
from minitrainer.train_config import TrainConfig

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def _refusal(capsys, config_cls, argv) -> str:
    """The one stderr line of a refused command line."""
    with pytest.raises(SystemExit) as stop:
        parse_config(config_cls, argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no usage block
    return err


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_a_config_file_alone(tmp_path):
    path = _write(tmp_path / "run.yaml", "output-dir: out\nmodel_name_or_path: m\ndata-path: d\nmin_samples_per_checkpoint: 64\nlearning_rate: 6e-6\n"
                                         "adam_betas: [0.9, 0.99]\nmax_tokens_per_gpu: auto\nmax_steps: null\n"
                                         "use-liger-kernels: true\n")
    config = parse_config(TrainConfig, ["--config", path])
    assert config == TrainConfig(model_name_or_path="m", data_path="d", output_dir="out", min_samples_per_checkpoint=64, learning_rate=6e-6,
                                 adam_betas=(0.9, 0.99), max_tokens_per_gpu="auto", use_liger_kernels=True)
    assert isinstance(config.learning_rate, float)  # YAML 1.1 would read 6e-6 as a string


def test_flags_override_the_file(tmp_path):
    path = _write(tmp_path / "run.json", json.dumps({"output_dir": "out", "model_name_or_path": "m", "data_path": "d", "min_samples_per_checkpoint": 64,
                                                     "learning_rate": 1e-5, "resume": False, "batch_size": 32}))
    config = parse_config(TrainConfig, ["--learning-rate", "3e-4", f"--config={path}", "--resume",
                                        "--max-tokens-per-gpu", "100"])
    assert (config.learning_rate, config.resume, config.max_tokens_per_gpu, config.batch_size) == (3e-4, True, 100, 32)


def test_process_data_reads_a_config_file(tmp_path):
    path = _write(tmp_path / "data.yaml", "input_file: chat.jsonl\nmodel-name-or-path: tiny\noutput_dir: tkns\n"
                                          "num_proc: 2\n")
    config = parse_config(ProcessDataConfig, ["--config", path, "--num-proc", "3"])
    assert (config.input_file, config.output_dir, config.num_proc) == ("chat.jsonl", "tkns", 3)


def test_the_python_api_reads_the_same_files(tmp_path):
    path = _write(tmp_path / "run.yaml", "output_dir: out\nmodel_name_or_path: m\ndata_path: d\nmin_samples_per_checkpoint: 8\nlora_rank: 4\n")
    config = config_from_file(TrainConfig, path)
    assert config == TrainConfig(model_name_or_path="m", data_path="d", output_dir="out", min_samples_per_checkpoint=8, lora_rank=4)
    # A flag's own text for a field parsed from text: converted here as on the command line.
    text = "output_dir: out\nmodel_name_or_path: m\ndata_path: d\nmax_tokens_per_gpu: '4096'\n"
    assert config_from_file(TrainConfig, _write(tmp_path / "run.yaml", text)).max_tokens_per_gpu == 4096
    with pytest.raises(ValueError, match=r"run\.yaml: no data_path, model_name_or_path \(required\)"):
        config_from_file(TrainConfig, _write(tmp_path / "run.yaml", "output_dir: out\n"))


@pytest.mark.parametrize(("text", "expected"), [
    ("output_dir: o\nmin_samples_per_checkpoint: 8\nlerning_rate: 1e-5\n",
     "run.yaml:3: unknown setting 'lerning_rate'; did you mean learning_rate?"),
    ("output_dir: o\nlr: 1e-5\n", "run.yaml:2: unknown setting 'lr'; did you mean learning_rate?"),
    ("output_dir: o\nbatch_size: many\n", "run.yaml:2: batch_size must be an integer, got 'many'"),
    ("output_dir: o\nbatch_size: 1.5\n", "run.yaml:2: batch_size must be an integer, got 1.5"),
    ("output_dir: o\nresume: 'no'\n", "run.yaml:2: resume must be true or false, got 'no'"),
    ("output_dir: o\nadam_betas: 0.9\n", "run.yaml:2: adam_betas must be a list of 2 numbers, got 0.9"),
    ("output_dir: o\nlr_scheduler: cosin\n", "run.yaml:2: lr_scheduler must be one of 'linear', "),
    ("output_dir: o\nmax_steps: ten\n", "run.yaml:2: max_steps must be an integer (or null), got 'ten'"),
    ("output_dir: o\nmax_tokens_per_gpu: lots\n",
     "run.yaml:2: max_tokens_per_gpu must be an integer or one of 'auto', got 'lots'"),
    ("output_dir: o\noutput-dir: p\n", "run.yaml:2: 'output-dir' is given twice (first on line 1)"),
    ("- output_dir\n", "run.yaml:1: expected a mapping of settings"),
    ("output_dir: [o\n", "run.yaml:2: not valid YAML"),
])
def test_a_bad_key_or_value_is_refused_in_one_line(tmp_path, capsys, text, expected):
    path = _write(tmp_path / "run.yaml", text)
    assert expected in _refusal(capsys, TrainConfig, ["--config", path])


def test_no_model_or_data_is_one_usage_line_and_no_cadence_is_the_final_export(tmp_path, capsys):
    """The original's defaults went to the hub for a 3 GB model and looked for test.jsonl: now both are
    required, on the command line, in a config file and in TrainConfig; the checkpoint cadence is optional."""
    assert _refusal(capsys, TrainConfig, ["--output-dir", "o"]).endswith(
        "error: the following arguments are required: --data-path, --model-name-or-path\n")
    path = _write(tmp_path / "run.yaml", "output_dir: o\ndata_path: d\n")
    assert _refusal(capsys, TrainConfig, ["--config", path]).endswith(
        "error: the following arguments are required: --model-name-or-path\n")
    with pytest.raises(TypeError, match="missing 2 required keyword-only arguments: 'data_path' and "
                                        "'model_name_or_path'"):
        TrainConfig(output_dir="o")
    config = parse_config(TrainConfig, ["--config", path, "--model-name-or-path", "m"])
    assert config.min_samples_per_checkpoint == 0 and config.export_every > 2**62, "only the final export"
    assert parse_config(TrainConfig, ["--config", path, "--model-name-or-path", "m", "--min-samples-per-checkpoint",
                                      "64"]).export_every == 64


def test_several_problems_are_a_header_and_a_line_each(tmp_path, capsys):
    """Thirteen unknown keys joined by "; " were one 2,000-character line: a header, then one line per problem,
    each naming its file and line, with the same status and no traceback."""
    keys = ["lerning_rate", "num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps"]
    path = _write(tmp_path / "run.yaml", "".join(f"{key}: 1\n" for key in keys))
    with pytest.raises(SystemExit) as stop:
        parse_config(TrainConfig, ["--config", path, "--output-dir", "o", "--model-name-or-path", "m",
                                   "--data-path", "d"])
    lines = capsys.readouterr().err.splitlines()
    assert stop.value.code == 2 and lines[0].endswith(f" error: --config {path}: 4 unknown settings:")
    assert [line.split(": ", 1)[0] for line in lines[1:]] == [f"  - {path}:{n}" for n in range(1, 5)]
    assert all(key in line for key, line in zip(keys, lines[1:]))
    with pytest.raises(SystemExit):
        parse_config(TrainConfig, ["--output-dir", "o", "--lerning-rate", "1", "--max_seq_length", "8"])
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].endswith(" error: 2 unknown flags:") and len(lines) == 3
    assert "did you mean --learning-rate?" in lines[1] and "--max-sample-num-tokens" in lines[2]


def test_json_refusals_name_the_line(tmp_path, capsys):
    path = _write(tmp_path / "run.json", '{\n  "output_dir": "o",\n  "seed": "x"\n}\n')
    assert "run.json:3: seed must be an integer, got 'x'" in _refusal(capsys, TrainConfig, ["--config", path])
    path = _write(tmp_path / "run.json", '[{"output_dir": "o"}]')
    assert "run.json: expected one JSON object of settings" in _refusal(capsys, TrainConfig, ["--config", path])
    path = _write(tmp_path / "run.json", '{"output_dir": "o",}')
    assert "run.json:1: not valid JSON" in _refusal(capsys, TrainConfig, ["--config", path])
    assert "--config nowhere.yaml: No such file" in _refusal(capsys, TrainConfig, ["--config", "nowhere.yaml"])
    assert "expected a .yaml, .yml or .json file" in _refusal(capsys, TrainConfig, ["--config", "run.toml"])


@pytest.mark.parametrize(("argv", "expected"), [
    (["--lr", "1e-4"], "unknown flag --lr; did you mean --learning-rate?"),  # was taken as --lr-scheduler
    (["--learnig-rate", "1e-4"], "unknown flag --learnig-rate; did you mean --learning-rate?"),
    (["--learnig_rate=1e-4"], "unknown flag --learnig_rate; did you mean --learning-rate?"),
    (["--max-step", "4"], "unknown flag --max-step; did you mean --max-steps?"),
    (["--zzz"], "unknown flag --zzz\n"),
])
def test_unknown_flags_are_refused_with_the_nearest_one(capsys, argv, expected):
    # Reported before argparse's "required" error, which would hide the typo.
    assert _refusal(capsys, TrainConfig, argv).endswith(f"error: {expected}".rstrip("\n") + "\n")


def test_nearest_name_prefers_spelling_then_initials():
    names = ["batch_size", "learning_rate", "lr_scheduler", "lora_rank"]
    assert nearest_name("lr", names) == "learning_rate"  # initials; lora_rank comes later
    assert nearest_name("lr-scheduler", names) == "lr_scheduler"
    assert nearest_name("batchsize", names) == "batch_size"
    assert nearest_name("qq", names) is None


@pytest.mark.parametrize("rank", ["0", "1"])
def test_usage_and_refusals_print_on_rank_0_only(rank, monkeypatch, capsys):
    """torchrun sets RANK before any process group: the other ranks of a refused launch stay quiet, their whole
    process (a real ``python train.py``); rank 0 prints (the parse ``train.main`` runs, here in-process)."""
    for argv, code in ((["--lr", "1"], 2), (["--help"], 0)):
        if rank == "1":
            result = subprocess.run([sys.executable, "train.py", *argv], cwd=ROOT, env={**os.environ, "RANK": rank},
                                    capture_output=True, text=True, timeout=120)
            status, output = result.returncode, result.stdout + result.stderr
        else:
            monkeypatch.setenv("RANK", rank)
            with pytest.raises(SystemExit) as stop:
                parse_config(TrainConfig, argv)
            captured = capsys.readouterr()
            status, output = stop.value.code, captured.out + captured.err
        assert status == code
        assert (output == "") == (rank == "1"), output[-500:]


def _example(path: Path) -> TrainConfig:
    # tiny_cpu.yaml takes its paths as flags (the quick start's folders); a flag overrides the others' output_dir.
    paths = [] if "model_name_or_path" in path.read_text() else ["--model-name-or-path", "m", "--data-path", "d"]
    return parse_config(TrainConfig, ["--config", str(path.relative_to(ROOT)), "--output-dir", "o", *paths])


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_each_example_config_parses(path):
    """The ready configs users start from: every key known, every value typed, the config valid."""
    config = _example(path)
    assert config.has_stop_condition and config.output_dir == "o"


def test_examples_cover_full_lora_osft_long_context_and_a_mix():
    configs = [_example(path) for path in EXAMPLES]
    assert any(c.lora_rank == 0 and not c.osft and c.context_parallel_size == 1 for c in configs)
    assert any(c.lora_rank > 0 for c in configs) and any(c.osft for c in configs)
    assert any(c.context_parallel_size > 1 for c in configs) and any("," in c.data_path for c in configs)


# ----------------------------------------------------------------------------
# training_params.json replays its run


def _run_args(model: Path, data: Path, out: Path) -> list[str]:
    return ["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out),
            "--batch-size", "8", "--max-tokens-per-gpu", "64", "--seed", "3", "--learning-rate", "1e-2",
            "--num-warmup-steps", "1", "--lr-scheduler", "cosine", "--max-steps", "3",
            "--min-samples-per-checkpoint", "1000", "--num-data-workers", "0", "--no-full-state"]


def test_training_params_replay_the_run(tmp_path, chatml_model):
    data = write_tokenized_jsonl(tmp_path / "d.jsonl", num_samples=24, vocab_size=model_vocab_size(chatml_model),
                                 seed=4)
    first = tmp_path / "first"
    assert_ok(torchrun(_run_args(chatml_model, data, first), warm=True))
    record = json.loads((first / "training_params.json").read_text())
    fields = {field.name for field in dataclasses.fields(TrainConfig)}
    assert set(record) - fields == set(TrainConfig.recorded_keys)  # the record's extra keys are all skipped
    assert read_config_file(TrainConfig, first / "training_params.json")["output_dir"] == str(first)

    replay = tmp_path / "replay"
    assert_ok(torchrun(["--config", str(first / "training_params.json"), "--output-dir", str(replay)], warm=True))
    losses = [[line["loss"] for line in read_metrics(out)] for out in (first, replay)]
    assert len(losses[0]) == 3 and losses[0] == losses[1]
    replayed = json.loads((replay / "training_params.json").read_text())
    assert {**replayed, "output_dir": None} == {**record, "output_dir": None}
