"""Image-text-to-text checkpoints: train the language model on text, keep the rest for the export.

A checkpoint whose config holds a text config of its own (``get_text_config()``)
and that transformers maps to ``AutoModelForImageTextToText`` (Gemma-3/4,
Qwen2.5-VL, Qwen3.5, Llama-4, Mistral-3, LLaVA, ...) is loaded whole, in its own
class. Its parts are read from the model's structure, never from a list of names::

    Qwen2_5_VLForConditionalGeneration
      model.visual          ─┐ non-text: detached before sharding, rank 0 keeps
      (projector, ...)      ─┘ their tensors (stored dtype, original keys)
      model.language_model  ─┐ text: what FSDP2 shards and trains
      lm_head               ─┘ (the decoder get_decoder() leads to, the output embeddings)

Every module and parameter outside the decoder and the LM head is *detached*
(set to None in its parent) on every rank before LoRA, activation checkpointing
and ``fully_shard``: the towers are never gathered, never on an accelerator and
never trained. The text-only forward of these models does not reach them
(``pixel_values`` is None), so the model's own ``forward(labels=...)`` still runs
and the start-up self-check compares against it. Rank 0 keeps the detached
tensors in host memory, as loaded; the export writes them back beside the
trained language model under their own names, in their stored dtype, with the
original config (``hf_export.py``). ``--export-text-only`` instead writes the
language model alone as the causal LM of its text config (``text_only_export``).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field

from torch import nn

from minitrainer.model.loss import decoder_of

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.json", "chat_template.jinja")
"""Files of a multimodal checkpoint that are neither weights, config nor tokenizer: copied into each export."""


def is_multimodal(config) -> bool:
    """Whether ``config`` is an image-text-to-text checkpoint with a text model inside."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    return (hasattr(config, "get_text_config") and config.get_text_config() is not config
            and type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING)


def auto_model_class(config):
    """The auto class that builds the checkpoint whole: image-text-to-text, a sequence classifier where the
    config names one (``heads.scoring_config``: a reward model), else causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSequenceClassification

    from minitrainer.model.heads import sequence_classification_class

    if is_multimodal(config):
        return AutoModelForImageTextToText
    return AutoModelForSequenceClassification if sequence_classification_class(config) else AutoModelForCausalLM


def text_modules(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """``(decoder, LM head)``: the modules of ``model`` that text training runs."""
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (LM head): its language model cannot "
                         "be trained as a causal LM")
    return decoder_of(model), head


def language_model_targets(model: nn.Module, targets) -> str | object:
    """peft ``target_modules`` confined to the language model: a regex over module names. Loaded onto the
    whole checkpoint, all-linear's plain names (``q_proj``, ``gate_proj``) would also adapt the towers."""
    if isinstance(targets, str):
        return targets  # already a pattern of the user's
    decoder = decoder_of(model)
    [prefix] = [name for name, module in model.named_modules() if module is decoder]
    return rf"{re.escape(prefix)}\..*\.({'|'.join(sorted(re.escape(name) for name in targets))})"


def detach_non_text(model: nn.Module) -> tuple[dict, list[str]]:
    """Remove every module, parameter and buffer outside the decoder and LM head from ``model``, in place.

    Returns:
        ``(state, names)``: the removed tensors under their state-dict keys in ``model`` (on rank 0 the
        loaded weights; meta tensors elsewhere), and the removed modules' and tensors' names.
    """
    text = text_modules(model)
    named = list(model.named_modules(remove_duplicate=False))
    text_names = {name for name, module in named if any(module is part for part in text)}
    # Every module on the way from the root to a text module is split further; the rest goes whole.
    ancestors = {".".join(name.split(".")[:depth]) for name in text_names for depth in range(len(name.split(".")))}
    text_tensors = {id(t) for part in text for t in (*part.parameters(), *part.buffers())}
    state, removed = {}, []
    for name, module in named:
        if name not in ancestors:
            continue
        prefix = f"{name}." if name else ""
        for child_name, child in list(module.named_children()):
            full = prefix + child_name
            if full in text_names or full in ancestors:
                continue
            if any(True for _ in child.parameters()) or any(True for _ in child.buffers()):
                state.update({prefix + key: value for key, value in child.state_dict(prefix=child_name + ".").items()
                              if id(value) not in text_tensors})
                removed.append(full)
            setattr(module, child_name, None)
        for tensor_name, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is None or id(tensor) in text_tensors:
                continue
            if tensor_name in module._parameters:
                module._parameters[tensor_name] = None
            else:
                persistent = tensor_name not in module._non_persistent_buffers_set
                module._buffers[tensor_name] = None
                if not persistent:
                    continue
            state[prefix + tensor_name] = tensor.detach()
            removed.append(prefix + tensor_name)
    return state, removed


@dataclass
class MultimodalExport:
    """How a multimodal checkpoint is exported: whole (the default) or its language model alone."""

    config: object          # the exported config: the checkpoint's own, or its text config (--export-text-only)
    layout: nn.Module       # the exported class on the meta device: its key conversions are reverted on save
    key_map: dict[str, str] | None = None  # text-only: trained key -> causal-LM key
    non_text_state: dict = field(default_factory=dict)  # whole, rank 0: the frozen towers as loaded

    def state(self, text_state: dict) -> dict:
        """The exported state dict, under the key names ``save_pretrained`` writes for the exported class
        (transformers 5 renames some families' keys on load, Qwen2.5-VL's ``model.language_model.*``
        among them, and back on save)."""
        from transformers.core_model_loading import revert_weight_conversion

        if self.key_map is not None:
            text_state = {self.key_map[name]: tensor for name, tensor in text_state.items()}
        return {**revert_weight_conversion(self.layout, text_state), **self.non_text_state}

    def keep_non_text(self, non_text_state: dict, model_name_or_path: str) -> list[str]:
        """Rank 0: keep the detached tensors under their saved names, each in the dtype its source file
        stores it in (a composite config may load a tower in another dtype: casting back is exact).
        Returns the names the source files did not hold (kept as loaded)."""
        from transformers.core_model_loading import revert_weight_conversion

        stored = stored_dtypes(model_name_or_path)
        renamed = revert_weight_conversion(self.layout, non_text_state)
        self.non_text_state = {name: tensor.to(stored.get(name, tensor.dtype)) for name, tensor in renamed.items()}
        return sorted(set(renamed) - set(stored))


def stored_dtypes(model_name_or_path: str) -> dict:
    """``{tensor name: dtype}`` as the checkpoint's safetensors files store them (headers only, nothing loaded)."""
    import json
    from pathlib import Path

    import torch
    from safetensors import safe_open
    from transformers.utils import cached_file

    def find(name: str) -> Path | None:
        local = Path(model_name_or_path) / name
        if local.is_file():
            return local
        found = cached_file(model_name_or_path, name, _raise_exceptions_for_missing_entries=False,
                            _raise_exceptions_for_connection_errors=False)
        return Path(found) if found else None

    index = find("model.safetensors.index.json")
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index else ["model.safetensors"]
    dtypes = {}
    for file in files:
        path = find(file)
        if path is None:
            continue
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():
                dtypes[name] = getattr(torch, SAFETENSORS_DTYPES.get(handle.get_slice(name).get_dtype(), "float32"))
    return dtypes


SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def whole_export(model_config, *, trust_remote_code: bool = False) -> MultimodalExport:
    """The default export of a multimodal checkpoint: its own class and config, towers included."""
    import torch

    with torch.device("meta"):
        layout = auto_model_class(model_config).from_config(model_config, trust_remote_code=trust_remote_code)
    return MultimodalExport(config=model_config, layout=layout)


def text_only_export(model: nn.Module, *, trust_remote_code: bool = False) -> MultimodalExport:
    """``--export-text-only``: the causal LM of the text config, its keys matched to ``model``'s language model.

    The causal LM is built on the meta device and its decoder and LM head are
    matched to ``model``'s by position in the module tree.

    Raises:
        ValueError: the text config has no causal-LM class, or its keys do not match the language model's.
    """
    import torch
    from transformers import AutoModelForCausalLM

    text_config = copy.deepcopy(model.config.get_text_config())
    try:
        with torch.device("meta"):
            causal = AutoModelForCausalLM.from_config(text_config, trust_remote_code=trust_remote_code)
    except ValueError as err:
        raise ValueError(f"--export-text-only: its text config ({text_config.model_type!r}) has no causal-LM class "
                         f"in transformers ({str(err).splitlines()[0]}); export the whole checkpoint "
                         "instead") from err
    names = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    causal_names = {id(module): name for name, module in causal.named_modules(remove_duplicate=False)}
    key_map = {}
    for ours, theirs in zip(text_modules(model), text_modules(causal)):
        for key in ours.state_dict():
            key_map[f"{names[id(ours)]}.{key}"] = f"{causal_names[id(theirs)]}.{key}"
    expected = set(causal.state_dict())
    if set(key_map.values()) != expected:
        differ = sorted(expected.symmetric_difference(key_map.values()))[:3]
        raise ValueError(f"--export-text-only: its language model does not match {type(causal).__name__} "
                         f"(keys {differ}); export the whole checkpoint instead")
    text_config.architectures = [type(causal).__name__]
    return MultimodalExport(config=text_config, layout=causal, key_map=key_map)


def multimodal_preflight(config, *, trust_remote_code: bool, export_text_only: bool) -> str | None:
    """Rank 0, on the meta device: why this checkpoint's language model cannot be trained (or exported) alone,
    in one line naming the class, or None. A causal LM passes (``--export-text-only`` does not apply)."""
    import torch

    if not is_multimodal(config):
        return None
    with torch.device("meta"):
        model = auto_model_class(config).from_config(config, trust_remote_code=trust_remote_code)
    try:
        detach_non_text(model)
        if export_text_only:
            text_only_export(model, trust_remote_code=trust_remote_code)
    except ValueError as err:
        return f"{type(model).__name__} (model_type {config.model_type!r}): {err}"
    return None
