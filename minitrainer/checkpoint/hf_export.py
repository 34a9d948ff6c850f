"""Hugging Face exports: ``<output-dir>/hf_format/samples_<N>/``.

Each export is a folder that ``AutoModelForCausalLM.from_pretrained`` (a reward model's:
``AutoModelForSequenceClassification``, ``model/heads.py``) and ``AutoTokenizer.from_pretrained`` load as is: safetensors in ``--save-dtype``
(``export_dtype``; bf16 by default) sharded at
5 GB (``model-0000x-of-0000y.safetensors`` plus ``model.safetensors.index.json``
when there is more than one shard), ``config.json`` (its ``dtype`` says which),
``generation_config.json`` and the tokenizer files; integer and bool tensors keep
their dtype. An image-text-to-text checkpoint (``multimodal.py``) is
exported whole, in its own class and config, for ``AutoModelForImageTextToText``:
the trained language model in that dtype, the frozen towers and projectors exactly as
they were loaded (their stored dtype), and the processor files
(``multimodal.PROCESSOR_FILES``) copied from the source; with
``--export-text-only``, the language model alone as the causal LM of its text
config. It is written into ``.samples_<N>.tmp`` and renamed
only when complete, so a crash mid-save never leaves a folder that looks
finished, nor one that a glob of exports (``samples_*``) lists.

A fine-tuning method decides what the gathered state becomes (``FineTuningMethod.export_state``): the
original model's weights (adapters merged, factors multiplied back), and files of its own beside them
(a peft adapter); its module's docstring says which.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import SafetensorError
from safetensors.torch import save_file

from minitrainer.checkpoint.full_state import complete_checkpoints, tmp_folder
from minitrainer.common import fault_injection
from minitrainer.common.distributed import first_error
from minitrainer.common.log import logger
from minitrainer.model.heads import sequence_classification_class
from minitrainer.model.loss import CausalLMWithLoss
from minitrainer.model.multimodal import PROCESSOR_FILES

MAX_SHARD_SIZE = "5GB"


def hf_checkpoint_dir(output_dir: str | Path, num_samples: int) -> Path:
    return Path(output_dir) / "hf_format" / f"samples_{int(num_samples)}"


def export_dtype(save_dtype: str, stored_dtype: torch.dtype | None) -> torch.dtype:
    """``--save-dtype`` as the dtype the exports write: ``auto`` is ``stored_dtype``, the checkpoint's own (the
    one ``from_pretrained(dtype="auto")`` reads); the other values are torch's own dtype names."""
    if save_dtype != "auto":
        return getattr(torch, save_dtype)
    assert stored_dtype is not None, "--save-dtype auto needs the checkpoint's own dtype"
    return stored_dtype


def _tied_output_key(model: torch.nn.Module) -> str | None:
    """State-dict key of the LM head weight when it is tied to the input embedding."""
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    # transformers ties by the config of the class that holds both (a multimodal model's own config:
    # Mistral-3 ties with its text config saying otherwise); the text config where that one is silent.
    tied = getattr(model.config, "tie_word_embeddings", None)
    if not (tied if tied is not None else getattr(text_config, "tie_word_embeddings", False)):
        return None
    head = model.get_output_embeddings()
    for name, module in model.named_modules():
        if module is head:
            return f"{name}.weight"
    return None


def save_hf_checkpoint(wrapper: CausalLMWithLoss, *, output_dir: str | Path, num_samples: int, tokenizer,
                       generation_config, rank: int, keep_last_n: int | None = None,
                       max_shard_size: str = MAX_SHARD_SIZE, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Gather the full model (collective: every rank calls this) and write it from rank 0.

    Args:
        wrapper: the FSDP-sharded training module.
        output_dir: the run's output folder.
        num_samples: samples consumed so far; names the folder.
        tokenizer: saved beside the weights.
        generation_config: the model's original generation config (or None).
        rank: this process's rank; only rank 0 writes.
        keep_last_n: once the new export is complete, delete all but the newest N.
        max_shard_size: safetensors shard size (Hugging Face's 5 GB by default).
        dtype: what the floating-point weights are written in (``export_dtype``; an adapter-only LoRA export's too).

    Returns:
        The final folder path.

    Raises:
        SystemExit: on every rank, promptly, when rank 0 could not write the
            export (disk full, permissions); every rank logs rank 0's error.
    """
    state = gather_full_state_dict(wrapper)
    final = hf_checkpoint_dir(output_dir, num_samples)
    error = None
    if rank == 0:
        try:
            _write_export(wrapper, state, final, tokenizer=tokenizer, generation_config=generation_config,
                          keep_last_n=keep_last_n, max_shard_size=max_shard_size, dtype=dtype)
        except (OSError, SafetensorError) as err:
            error = f"Hugging Face export {final} failed: {err}"
    # Rank 0's verdict instead of a bare barrier: the other ranks would otherwise wait in
    # their next collective until the process-group timeout for a rank that already died.
    error = first_error(error)
    if error is not None:
        logger.error("%s; earlier checkpoints are intact", error)
        raise SystemExit(1)
    return final


def _write_export(wrapper: CausalLMWithLoss, state: dict, final: Path, *, tokenizer, generation_config,
                  keep_last_n: int | None, max_shard_size: str, dtype: torch.dtype) -> None:
    """Rank 0's half of ``save_hf_checkpoint``: write ``final`` through a temporary folder (``tmp_folder``)."""
    fault_injection.fail_export(final)
    model = wrapper.model
    tmp = tmp_folder(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    multimodal = wrapper.multimodal_export
    # The original model's keys (a method's own layout undone: merged adapters, factors multiplied back);
    # a method's own files (a peft adapter) are written into tmp. None: no model weights to write.
    state = wrapper.method.export_state(state, tmp, multimodal_export=multimodal, dtype=dtype)
    if state is not None:
        tied_key = _tied_output_key(model)
        state = {
            name: (tensor.to(dtype) if tensor.is_floating_point() else tensor).contiguous()
            for name, tensor in state.items()
            if name != tied_key
        }
        config = model.config
        if sequence_classification_class(config) is not None:
            generation_config = None  # a sequence classifier generates nothing
        if sequence_classification_class(config) is not None and config.pad_token_id is None:
            # transformers pools a sequence classifier's score at the last non-pad token: batches need the id.
            config = copy.deepcopy(config)
            config.pad_token_id = tokenizer.pad_token_id
        if multimodal is not None:
            # Whole: the frozen towers beside the trained language model, bit for bit as loaded; or text-only.
            config = multimodal.config
            state = {name: tensor.contiguous() for name, tensor in multimodal.state(state).items()}
        _save_model(state, config, generation_config, tmp, max_shard_size, dtype)
    tokenizer.save_pretrained(tmp)
    if multimodal is not None and multimodal.key_map is None:
        _copy_processor_files(model.config, tmp)
    fault_injection.kill_at(fault_injection.KILL_DURING_EXPORT, int(final.name.removeprefix("samples_")))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    if keep_last_n:
        for old in complete_checkpoints(final.parent)[:-keep_last_n]:
            shutil.rmtree(old, ignore_errors=True)


def _save_model(state: dict[str, torch.Tensor], model_config, generation_config, folder: Path,
                max_shard_size: str, dtype: torch.dtype) -> None:
    """safetensors shards (with an index when sharded), the config stating ``dtype``, and the generation config."""
    split = split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({name: state[name] for name in names}, folder / filename, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": split.tensor_to_filename}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    config = copy.deepcopy(model_config)
    config.use_cache = True  # training turned the KV cache off; inference wants it back
    # On the sub-configs too, as from_pretrained sets them: a composite config's text_config would
    # otherwise name another dtype than its weights hold (the float32 the meta model was built in).
    for sub_config in [config, *(getattr(config, key, None) for key in getattr(config, "sub_configs", {}))]:
        if sub_config is not None:
            sub_config.dtype = dtype
    config.save_pretrained(folder)
    if generation_config is not None:
        generation_config.save_pretrained(folder)


def _copy_processor_files(model_config, folder: Path) -> None:
    """The source checkpoint's processor files (image/video preprocessor, chat template), copied as they are."""
    from transformers.utils import cached_file

    source = getattr(model_config, "_name_or_path", "")
    if not source:
        return
    for name in PROCESSOR_FILES:
        if (folder / name).exists():
            continue  # the tokenizer wrote its own (chat_template.jinja)
        path = Path(source) / name
        if not path.is_file():
            path = cached_file(source, name, _raise_exceptions_for_missing_entries=False,
                               _raise_exceptions_for_connection_errors=False)
        if path is not None and Path(path).is_file():
            shutil.copyfile(path, folder / name)


def gather_full_state_dict(wrapper: CausalLMWithLoss) -> dict[str, torch.Tensor]:
    """All-gather the Hugging Face state dict into rank 0's host memory (empty on other ranks), as the
    method holds it (``FineTuningMethod.gather_full_state``: QLoRA's NF4 weights come back dequantized)."""
    return wrapper.method.gather_full_state(wrapper.model)
