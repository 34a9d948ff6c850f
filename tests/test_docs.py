"""The README documents every flag of both entry points, and the CLIs build from the dataclasses.

    .venv/bin/python -m pytest -q tests/test_docs.py
"""

import dataclasses
from pathlib import Path

import pytest

from process_data import ProcessDataConfig
from train import TrainConfig
from utils import build_arg_parser, parse_config

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


@pytest.mark.parametrize("config_cls", [TrainConfig, ProcessDataConfig])
def test_every_flag_is_in_the_readme(config_cls):
    missing = [f.name for f in dataclasses.fields(config_cls) if f"`--{f.name.replace('_', '-')}`" not in README]
    assert not missing, f"README lacks {missing}"


@pytest.mark.parametrize("config_cls", [TrainConfig, ProcessDataConfig])
def test_every_field_has_help(config_cls):
    assert all(f.metadata.get("help") for f in dataclasses.fields(config_cls))
    build_arg_parser(config_cls).format_help()


def test_spec_command_line_parses_with_spec_defaults():
    config = parse_config(TrainConfig, [
        "--output-dir", "./output/", "--data-path", "./data/chat_tkns",
        "--model-name-or-path", "Qwen/Qwen2.5-1.5B-instruct", "--min-samples-per-checkpoint", "2000",
        "--num-warmup-steps", "20", "--max-tokens-per-gpu", "128000", "--batch-size", "128",
        "--use-liger-kernels", "--seed", "8888", "--learning-rate", "6e-6", "--logging-level", "debug"])
    assert config.max_tokens_per_gpu == 128000 and config.use_liger_kernels and config.logging_level == "DEBUG"
    defaults = TrainConfig(output_dir="o", min_samples_per_checkpoint=1)
    assert (defaults.batch_size, defaults.max_tokens_per_gpu, defaults.learning_rate, defaults.num_warmup_steps,
            defaults.lr_scheduler, defaults.seed, defaults.fsdp_sharding_strategy) == (
        1024, 10000, 5e-6, 10, "constant_with_warmup", 42, "FULL_SHARD")
    assert parse_config(TrainConfig, ["--output-dir", "o", "--min-samples-per-checkpoint", "1",
                                      "--max-tokens-per-gpu", "auto"]).max_tokens_per_gpu == "auto"


def test_invalid_values_are_all_reported_at_once():
    with pytest.raises(ValueError) as err:
        TrainConfig(output_dir="o", min_samples_per_checkpoint=0, batch_size=-1, logging_level="loud")
    message = str(err.value)
    assert "--min-samples-per-checkpoint" in message and "--batch-size" in message and "LOUD" in message


def test_compile_with_a_quantized_base_is_refused():
    with pytest.raises(ValueError, match="--compile with --lora-quantize-data-type nf4"):
        TrainConfig(output_dir="o", min_samples_per_checkpoint=1, lora_rank=4, lora_quantize_data_type="nf4",
                    compile=True)
