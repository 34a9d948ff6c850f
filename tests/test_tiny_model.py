"""The fixture assets load through the same from_pretrained path users hit.

    .venv/bin/python -m pytest -q tests/test_tiny_model.py
"""

import pytest
from jinja2.exceptions import TemplateError
from transformers import AutoModelForCausalLM, AutoTokenizer

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
