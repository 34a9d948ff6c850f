"""The fixture assets load through the same from_pretrained path users hit.

    .venv/bin/python -m pytest -q tests/test_tiny_model.py
"""

import json
import subprocess
import sys

import pytest
from jinja2.exceptions import TemplateError
from transformers import AutoModelForCausalLM, AutoTokenizer

from fixtures.e2e import ROOT
from tests.conftest import TEMPLATE_NAMES


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_assets_load_and_template_renders(tiny_models, name):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models[name])
    model = AutoModelForCausalLM.from_pretrained(tiny_models[name])
    assert model.config.vocab_size == len(tokenizer)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    # Gemma ends turns with <end_of_turn>, never writing its eos_token <eos>.
    assert "Hello" in text and (tokenizer.eos_token in text) == (name != "gemma")


def test_mistral_template_refuses_non_alternating_roles(tiny_models):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["mistral"])
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(TemplateError, match="alternate"):
        tokenizer.apply_chat_template(messages, tokenize=False)


def test_the_command_prints_no_torchao_noise(tmp_path):
    """transformers imports torchao (when installed) whose CPU build warns about kernels it cannot load, and
    torch warns about its pytree registrations: nothing a user can act on (issue 54). Nor a redrawn bar."""
    result = subprocess.run([sys.executable, "-m", "minitrainer.tools.tiny_model", "--output-dir",
                             str(tmp_path / "tiny"), "--hidden-size", "32", "--num-layers", "1"],
                            cwd=ROOT, capture_output=True, timeout=300)
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    stderr = result.stderr.decode()
    assert "torchao" not in stderr and "_pytree" not in stderr, stderr
    assert "\r" not in stderr, stderr
    assert json.loads(result.stdout)["output_dir"] == str(tmp_path / "tiny")
