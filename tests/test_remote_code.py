"""A checkpoint that ships its own modelling code trains and resumes with --trust-remote-code.

    .venv/bin/python -m pytest -q tests/test_remote_code.py

The model folder is the tiny ChatML model re-registered under a model type that
transformers does not know, with ``auto_map`` pointing at the configuration and
modelling files beside the weights, as hub repositories with custom code are laid
out. Every start-up read of its config must pass ``trust_remote_code``; one that
does not fails with transformers' "trust_remote_code" refusal, and the resume
path (which reads the config to compare fingerprints) is where such a read hid.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fixtures.e2e import model_vocab_size, read_metrics, torchrun, write_tokenized_jsonl
from minitrainer.common import fault_injection

BATCH = 8
CHECKPOINT_EVERY = 2 * BATCH

CONFIGURATION = '''from transformers import Qwen2Config


class RemoteQwenConfig(Qwen2Config):
    model_type = "remote_qwen"
'''

MODELING = '''from transformers import Qwen2ForCausalLM

from .configuration_remote import RemoteQwenConfig


class RemoteQwenForCausalLM(Qwen2ForCausalLM):
    config_class = RemoteQwenConfig
'''


@pytest.fixture(scope="module")
def remote_model(tmp_path_factory, chatml_model) -> Path:
    folder = tmp_path_factory.mktemp("remote") / "model"
    shutil.copytree(chatml_model, folder)
    (folder / "configuration_remote.py").write_text(CONFIGURATION)
    (folder / "modeling_remote.py").write_text(MODELING)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="remote_qwen", architectures=["RemoteQwenForCausalLM"],
                  auto_map={"AutoConfig": "configuration_remote.RemoteQwenConfig",
                            "AutoModelForCausalLM": "modeling_remote.RemoteQwenForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def test_remote_code_model_refuses_without_the_flag_and_resumes_with_it(tmp_path, remote_model, chatml_model):
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoConfig.from_pretrained(remote_model)  # the folder really needs the flag
    data = write_tokenized_jsonl(tmp_path / "train.jsonl", num_samples=24, vocab_size=model_vocab_size(chatml_model),
                                 seed=5)
    out = tmp_path / "out"
    args = ["--model-name-or-path", str(remote_model), "--data-path", str(data), "--output-dir", str(out),
            "--batch-size", str(BATCH), "--max-tokens-per-gpu", "96", "--max-steps", "4",
            "--min-samples-per-checkpoint", str(CHECKPOINT_EVERY), "--num-data-workers", "0",
            "--trust-remote-code"]
    killed = torchrun(args, env={fault_injection.KILL_AFTER_SAVE: str(CHECKPOINT_EVERY)})
    assert killed.returncode != 0 and (out / "full_state" / f"samples_{CHECKPOINT_EVERY}").is_dir(), killed.stderr[-3000:]

    resumed = torchrun(args)
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    assert "resumed from" in resumed.stderr
    assert [record["step"] for record in read_metrics(out)] == [1, 2, 3, 4]
