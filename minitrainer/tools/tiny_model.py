"""Build tiny, real tokenizers and random causal LMs on disk, with no hub access.

Tests, the demo and the benchmarks use these in place of a downloaded model:
each is a genuine Hugging Face folder that ``AutoTokenizer.from_pretrained``
and ``AutoModelForCausalLM.from_pretrained`` load exactly as they load Qwen or
Llama.

    python -m minitrainer.tools.tiny_model --template chatml --output-dir /tmp/tiny-chatml
    python -m minitrainer.tools.tiny_model --template llama3 --vocab-size 32000 --output-dir /tmp/tok32k --no-model

Templates (each mirrors a real family's quirks):
  chatml     Qwen-style ``<|im_start|>role\\n...<|im_end|>\\n``
  qwen25     ChatML that injects a default system prompt when none is given
  qwen3      ChatML that injects an empty ``<think></think>`` block into assistant turns
  llama3     ``<|begin_of_text|>`` then ``<|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>``
  mistral    ``<s>[INST] ... [/INST]reply</s>``; folds the system prompt into the
             first user turn and raises when roles don't alternate
  llama2     Mistral v0.1 / Llama-2 form: ``[INST] ... [/INST]`` + ``' ' + reply + '</s>'``,
             so a reply's first word is tokenized with the template's space
  gemma      ``<start_of_turn>model\\n...<end_of_turn>\\n``; ``eos_token`` is ``<eos>``,
             not the turn terminator
  qwen3think Qwen3's reasoning form: ``reasoning_content`` (or ``<think>`` in the content)
             rendered as ``<think>\\n...\\n</think>\\n\\n`` only in turns after the last
             user message; earlier turns lose their reasoning
  tools      ChatML with Qwen2.5-style tools: a ``# Tools`` system block from ``tools``,
             ``<tool_call>`` JSON after the reply, tool results as ``<tool_response>``
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from minitrainer.common.log import setup_logging

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}" + CHATML_TEMPLATE
)

QWEN3_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

MISTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.first and system_message != '' %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- else %}{{- message['content'] + eos_token }}{%- endif %}"
    "{%- endfor %}"
)


LLAMA2_TEMPLATE = MISTRAL_TEMPLATE.replace("{{- message['content'] + eos_token }}",
                                          "{{- ' ' + message['content'] + eos_token }}")

GEMMA_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)

QWEN3_THINK_TEMPLATE = (
    "{%- set ns = namespace(last_query_index=-1) %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.last_query_index = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- set content = message['content'] %}"
    "{%- set reasoning = message['reasoning_content'] if message['reasoning_content'] is string else '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}"
    "{{- content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}"
    "{{- '<|im_start|>user\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + message['content'] }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- if loop.first and message['content'] %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{- (call['function']['arguments'] if call['function']['arguments'] is string "
    "else call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class TemplateSpec:
    chat_template: str
    bos_token: str | None
    eos_token: str
    pad_token: str
    special_tokens: tuple[str, ...]
    architecture: str  # "qwen2" or "llama"


TEMPLATES: dict[str, TemplateSpec] = {
    "chatml": TemplateSpec(CHATML_TEMPLATE, None, "<|im_end|>", "<|endoftext|>",
                           ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "qwen2"),
    "qwen25": TemplateSpec(QWEN25_TEMPLATE, None, "<|im_end|>", "<|endoftext|>",
                           ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "qwen2"),
    "qwen3": TemplateSpec(QWEN3_TEMPLATE, None, "<|im_end|>", "<|endoftext|>",
                          ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"), "qwen2"),
    "llama3": TemplateSpec(LLAMA3_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>",
                           ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                            "<|eot_id|>", "<|finetune_right_pad_id|>"), "llama"),
    "mistral": TemplateSpec(MISTRAL_TEMPLATE, "<s>", "</s>", "<unk>", ("<unk>", "<s>", "</s>"), "llama"),
    "llama2": TemplateSpec(LLAMA2_TEMPLATE, "<s>", "</s>", "<unk>", ("<unk>", "<s>", "</s>"), "llama"),
    "gemma": TemplateSpec(GEMMA_TEMPLATE, "<bos>", "<eos>", "<pad>",
                          ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"), "llama"),
    "qwen3think": TemplateSpec(QWEN3_THINK_TEMPLATE, None, "<|im_end|>", "<|endoftext|>",
                               ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"), "qwen2"),
    "tools": TemplateSpec(TOOLS_TEMPLATE, None, "<|im_end|>", "<|endoftext|>",
                          ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"), "qwen2"),
}

DEFAULT_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello! How can I help you today? I am a helpful assistant.",
    "def add(a, b):\n    return a + b\n",
    "Gradient descent minimizes the loss one small step at a time.",
    "Ünïcödé text, emoji 🙂, and 中文 characters are bytes too.",
    "system user assistant tool pretrain question answer",
]


def build_tokenizer(template: str, output_dir: str | Path, *, vocab_size: int = 512,
                    corpus: list[str] | None = None):
    """Train a byte-level BPE tokenizer with ``template``'s special tokens and chat template.

    Returns the saved tokenizer, re-loaded through ``AutoTokenizer.from_pretrained``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    spec = TEMPLATES[template]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(spec.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((corpus or DEFAULT_CORPUS) * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=spec.bos_token,
        eos_token=spec.eos_token,
        pad_token=spec.pad_token,
        chat_template=spec.chat_template,
        model_max_length=1 << 20,
    )
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(output_dir)
    return AutoTokenizer.from_pretrained(output_dir)


def build_model(tokenizer_dir: str | Path, output_dir: str | Path, *, architecture: str = "qwen2",
                hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                intermediate_size: int = 128, tie_word_embeddings: bool = False, seed: int = 0):
    """Save a randomly initialised causal LM whose vocabulary matches the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config_cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[architecture]
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    output_dir = Path(output_dir)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


def build_tiny_model(template: str, output_dir: str | Path, *, vocab_size: int = 512,
                     corpus: list[str] | None = None, with_model: bool = True, **model_kwargs) -> Path:
    """Tokenizer (and, by default, a matching random model) in one folder."""
    output_dir = Path(output_dir)
    build_tokenizer(template, output_dir, vocab_size=vocab_size, corpus=corpus)
    if with_model:
        build_model(output_dir, output_dir, architecture=TEMPLATES[template].architecture, **model_kwargs)
    return output_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--template", choices=sorted(TEMPLATES), default="chatml", help="chat template family")
    parser.add_argument("--output-dir", required=True, help="folder to write the tokenizer (and model) into")
    parser.add_argument("--vocab-size", type=int, default=512, help="BPE vocabulary size to train")
    parser.add_argument("--corpus-file", default=None, help="text file (one document per line) to train BPE on")
    parser.add_argument("--model", action=argparse.BooleanOptionalAction, default=True,
                        help="also save a random model matching the tokenizer")
    parser.add_argument("--hidden-size", type=int, default=64, help="model width")
    parser.add_argument("--num-layers", type=int, default=2, help="decoder blocks")
    args = parser.parse_args()
    # Before transformers imports torchao (its quantizers do, when installed): setup_logging quiets torchao's
    # CPU-build kernel warnings and torch's pytree deprecation at their loggers, as train.py does.
    setup_logging("INFO")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one shard: its bar is noise, and \r redraws in a log file
    corpus = None
    if args.corpus_file:
        corpus = [line for line in Path(args.corpus_file).read_text().splitlines() if line.strip()]
    path = build_tiny_model(args.template, args.output_dir, vocab_size=args.vocab_size, corpus=corpus,
                            with_model=args.model, hidden_size=args.hidden_size, num_layers=args.num_layers)
    print(json.dumps({"output_dir": str(path), "template": args.template}))


if __name__ == "__main__":
    main()
