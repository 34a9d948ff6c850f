"""Other tools' setting names point to ours: the table (``minitrainer/common/foreign_names.py``) against the peers'
real config classes and ours, and its use by the CLI and config files; underscore spellings of our flags.

    .venv/bin/python -m pytest -q tests/test_foreign_names.py

The peer tests read the field names of TRL's, axolotl's and mini_trainer 0.9's config classes from snapshots of
the pinned releases (``fixtures/peer_fields/``), which ``make peer-fields`` re-derives from the real packages in
venvs of their own (``fixtures/peer_config_venv.py``).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from fixtures.e2e import ROOT
from fixtures.peer_config_venv import PEERS as PEER_RELEASES, peer_fields
from minitrainer.common.cli import parse_config
from minitrainer.common.config_files import read_config_file
from minitrainer.common.foreign_names import (AXOLOTL, FOREIGN_NAMES, HF, MINI_TRAINER, OLD_TRL, PEERS, TRL,
                                              render_doc_tables)
from minitrainer.data.process_data import ProcessDataConfig
from minitrainer.integrations.hub_parameters import RULES
from minitrainer.tools.demo import DemoConfig
from minitrainer.train_config import TrainConfig

OURS = {field.name for cls in (TrainConfig, ProcessDataConfig) for field in dataclasses.fields(cls) if field.init}

COMMON = {
    TRL: ["num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate",
          "warmup_steps", "lr_scheduler_type", "logging_steps", "save_steps", "save_strategy",
          "eval_steps", "eval_strategy", "output_dir", "max_steps", "seed", "bf16", "gradient_checkpointing",
          "max_length", "packing", "dataset_text_field", "completion_only_loss", "assistant_only_loss", "beta",
          "loss_type", "model_name_or_path", "dataset_name", "report_to", "run_name", "weight_decay", "adam_beta1",
          "adam_beta2", "adam_epsilon", "max_grad_norm", "resume_from_checkpoint", "lora_r", "lora_alpha",
          "load_in_4bit", "use_peft", "save_total_limit"],
    OLD_TRL: ["max_seq_length", "warmup_ratio", "num_train_epochs", "per_device_train_batch_size", "dataset_text_field",
              "torch_dtype"],
    AXOLOTL: ["base_model", "datasets", "sequence_len", "sample_packing", "micro_batch_size",
              "gradient_accumulation_steps", "num_epochs", "learning_rate", "lr_scheduler", "warmup_steps",
              "output_dir", "adapter", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "load_in_4bit",
              "flash_attention", "val_set_size", "saves_per_epoch", "evals_per_epoch", "wandb_project",
              "dataset_prepared_path", "optimizer", "weight_decay", "bf16", "gradient_checkpointing",
              "logging_steps", "train_on_inputs", "resume_from_checkpoint"],
}
"""The names users bring, from the issue and the peers' example configs: each is ours or in the table."""

TRL_CLASSES = ("SFTConfig", "DPOConfig", "ScriptArguments", "ModelConfig")
PEER_CLASSES = {TRL: (*TRL_CLASSES, "RewardConfig"), OLD_TRL: (*TRL_CLASSES, "TrainingArguments"), HF: ("TrainingArguments",),
                AXOLOTL: ("AxolotlInputConfig",), MINI_TRAINER: ("TrainingArgs",)}
PEER_VENV = {TRL: "TRL", OLD_TRL: "TRL 0.19", HF: "TRL", AXOLOTL: "axolotl", MINI_TRAINER: "mini_trainer 0.9"}


@pytest.fixture(scope="module")
def real_fields():
    """Peer -> the field names of its config classes, from the snapshot of its pinned release."""
    def read(peer: str) -> set[str]:
        classes = peer_fields(PEER_VENV[peer])
        return {name for cls in PEER_CLASSES[peer] for name in classes[cls]}
    return read


@pytest.mark.parametrize("release", PEER_RELEASES)
def test_each_snapshot_is_of_the_pinned_release(release):
    """A snapshot read for another version or by another script says how to refresh it (``make peer-fields``)."""
    assert peer_fields(release)


def _refusal(capsys, config_cls, argv) -> str:
    with pytest.raises(SystemExit) as stop:
        parse_config(config_cls, argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.rstrip("\n")


# ----------------------------------------------------------------------------
# The table


def test_every_target_is_one_of_our_fields_and_no_name_is_ours():
    for name, entry in FOREIGN_NAMES.items():
        assert name not in OURS, f"{name} is our own field: not a foreign name"
        assert set(entry.ours) <= OURS, f"{name} -> {entry.ours}: not all our fields"
        assert entry.whose and set(entry.whose) <= set(PEERS), name
        assert entry.ours or entry.note, f"{name}: we have none, and the table does not say why"


@pytest.mark.parametrize("peer", PEERS)
def test_every_name_is_a_real_field_of_the_peer(peer, real_fields):
    """The table cannot drift: each name it gives a peer is a field of that peer's real config classes."""
    fields = real_fields(peer)
    claimed = [name for name, entry in FOREIGN_NAMES.items() if peer in entry.whose]
    assert claimed
    assert not [name for name in claimed if name not in fields], f"not fields of {PEER_CLASSES[peer]}"


@pytest.mark.parametrize("peer", [TRL, OLD_TRL, AXOLOTL])
def test_commonly_used_names_are_covered(peer, real_fields):
    fields = real_fields(peer) | (real_fields(HF) if peer == TRL else set())
    assert not [name for name in COMMON[peer] if name not in fields], "the list names a field the peer lacks"
    assert not [name for name in COMMON[peer] if name not in OURS and name not in FOREIGN_NAMES]


def test_older_trl_names_are_gone_from_the_newest(real_fields):
    """A name tagged "older TRL" only is one TRL or transformers dropped since: else it is tagged TRL."""
    newest = real_fields(TRL) | real_fields(HF)
    assert not [name for name, entry in FOREIGN_NAMES.items() if entry.whose == (OLD_TRL,) and name in newest]


def test_every_field_of_mini_trainer_09_is_ours_or_in_the_table(real_fields):
    """0.9's TrainingArgs is small and mirrored field for field (compat/mini_trainer.py): all of it is answered."""
    assert not sorted(real_fields(MINI_TRAINER) - OURS - set(FOREIGN_NAMES))


def test_the_table_agrees_with_the_training_hub_table():
    """hub_parameters.py maps training_hub's names; where a name is in both, both point to the same field."""
    for name, rule in RULES.items():
        target = getattr(rule, "target", None)
        if name in FOREIGN_NAMES and target is not None:
            assert target in FOREIGN_NAMES[name].ours, f"{name}: hub -> {target}, table -> {FOREIGN_NAMES[name].ours}"


def test_docs_coming_from_lists_every_entry():
    doc = (ROOT / "docs" / "coming-from.md").read_text()
    assert render_doc_tables() in doc, "regenerate: python -m minitrainer.common.foreign_names"
    for name in FOREIGN_NAMES:
        assert f"| `{name}` |" in doc


# ----------------------------------------------------------------------------
# The CLI and config files


@pytest.mark.parametrize(("config_cls", "argv", "expected"), [
    (TrainConfig, ["--num_train_epochs", "2"],
     "--num_train_epochs is TRL's and Hugging Face's name; ours is --num-epochs"),
    (TrainConfig, ["--num-train-epochs=2"],
     "--num-train-epochs is TRL's and Hugging Face's name; ours is --num-epochs"),
    (TrainConfig, ["--dataset_name", "trl-lib/Capybara"], "--dataset_name is TRL's name; ours is --data-path"),
    (ProcessDataConfig, ["--dataset_name", "trl-lib/Capybara"], "--dataset_name is TRL's name; ours is --input-file"),
    (TrainConfig, ["--logging_steps", "10"], "--logging_steps is TRL's, Hugging Face's and axolotl's name; "
                                             "we have none: every step is logged to training_metrics_<rank>.jsonl"),
    (TrainConfig, ["--max_epochs", "1"], "--max_epochs is mini_trainer 0.9's name; ours is --num-epochs"),
    (TrainConfig, ["--save_steps", "100"], "--save_steps is TRL's, Hugging Face's and axolotl's name; ours is "
     "--min-samples-per-checkpoint (in samples, not steps: steps x --batch-size)"),
    (DemoConfig, ["--num_train_epochs", "2"], "--num_train_epochs is TRL's and Hugging Face's name; ours is "
                                              "num_epochs, which this command does not take"),
])
def test_a_foreign_flag_is_refused_naming_ours(capsys, config_cls, argv, expected):
    assert _refusal(capsys, config_cls, argv).endswith(f"error: {expected}")


def test_a_foreign_flag_and_a_typo_are_a_line_each(capsys):
    with pytest.raises(SystemExit):
        parse_config(TrainConfig, ["--base_model", "m", "--lerning-rate", "1"])
    assert capsys.readouterr().err.splitlines()[1:] == [
        "  - --base_model is axolotl's name; ours is --model-name-or-path",
        "  - unknown flag --lerning-rate; did you mean --learning-rate?"]


def test_the_refusal_as_users_see_it():
    result = subprocess.run([sys.executable, "train.py", "--num_train_epochs", "2"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == ("train.py: error: --num_train_epochs is TRL's and Hugging "
                                                      "Face's name; ours is --num-epochs")


def test_a_foreign_config_key_is_refused_naming_ours(tmp_path, capsys):
    path = tmp_path / "sft.yaml"
    path.write_text("output_dir: o\nmin_samples_per_checkpoint: 8\nlogging_steps: 10\n")
    assert _refusal(capsys, TrainConfig, ["--config", str(path)]).endswith(
        f"error: {path}:3: logging_steps is TRL's, Hugging Face's and axolotl's name; we have none: every step is "
        "logged to training_metrics_<rank>.jsonl")


def test_a_trl_config_file_is_answered_in_one_go(tmp_path):
    """The issue's file took six tries, one key each: every unknown key is named at once, ours first."""
    path = tmp_path / "sft.json"
    path.write_text('{"output_dir": "o", "dataset_name": "trl-lib/Capybara", "num_train_epochs": 1,\n'
                    ' "per_device_train_batch_size": 2, "logging_steps": 5, "lerning_rate": 1e-5, "seed": "x"}\n')
    with pytest.raises(ValueError) as refused:
        read_config_file(TrainConfig, path)
    header, *problems = str(refused.value).split("\n  - ")
    assert header == f"--config {path}: 5 unknown settings:" and len(problems) == 5, "a header, a line each"
    assert problems[0] == f"{path}:1: dataset_name is TRL's name; ours is data_path"
    assert problems[2].startswith(f"{path}:2: per_device_train_batch_size is TRL's and Hugging Face's name; ours "
                                  "is batch_size (samples per optimizer step")
    assert problems[4] == f"{path}:2: unknown setting 'lerning_rate'; did you mean learning_rate?"


def test_underscore_spellings_of_our_flags_are_taken():
    base = ["--output-dir", "o", "--model-name-or-path", "m", "--data-path", "d"]
    dashed = parse_config(TrainConfig, [*base, "--max-steps", "3", "--adam-betas", "0.8", "0.9", "--no-resume"])
    for argv in (["--max_steps", "3", "--adam_betas", "0.8", "0.9", "--no_resume"],
                 ["--max_steps=3", "--adam_betas", "0.8", "0.9", "--no_resume"]):
        assert parse_config(TrainConfig, [*base, *argv]) == dashed
    config = parse_config(TrainConfig, ["--output_dir=o", "--model_name_or_path=m", "--data_path=d", "--max_steps=3"])
    assert config.max_steps == 3
