"""LoRA through peft: low-rank adapters on the decoder's linear layers, base weights frozen.

    torchrun --nproc-per-node=2 train.py ... --lora-rank 16 --lora-alpha 32

peft injects its ``LoraLayer`` modules into the Hugging Face model in place,
so the model keeps its class (``get_decoder``, ``get_output_embeddings`` and
the loss module work unchanged) and each decoder block holds its frozen base
weights and its trainable adapters together: ``fully_shard`` per block gathers
both in one collective, and only the adapters get gradients, reductions and
optimizer state. Inside the model a targeted ``q_proj`` becomes::

    q_proj.base_layer.weight          frozen, [out, in]
    q_proj.lora_A.default.weight      trainable, [r, in]
    q_proj.lora_B.default.weight      trainable, [out, r], zero at start

so the forward is ``W x + scaling * B (A x)`` with ``scaling = alpha / r``
(``alpha / sqrt(r)`` with rsLoRA). This module maps that layout to the two
files users load (``export_states``): peft's adapter format and a merged
model whose ``W' = W + scaling * B @ A`` carries the original key names.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from torch import nn

from minitrainer.common.cli import comma_list
from minitrainer.methods.base import FineTuningMethod, ModelBuild

if TYPE_CHECKING:
    from minitrainer.model.multimodal import MultimodalExport

PEFT_INSTALL = "pip install -U 'peft>=0.19'"
ADAPTER_NAME = "default"
ALL_LINEAR = "all-linear"
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\." + ADAPTER_NAME + r"\.weight$")
_BASE_LAYER = ".base_layer."
_SAVED_KEY = re.compile(r"^(?P<module>.+)\.modules_to_save\." + ADAPTER_NAME + r"\.(?P<tensor>[^.]+)$")
_ORIGINAL_MODULE = ".original_module."


@dataclass(frozen=True)
class LoraSettings:
    """The LoRA flags of ``TrainConfig``, resolved."""

    rank: int
    alpha: float
    dropout: float
    target_modules: str
    use_rslora: bool
    merge_on_export: bool = True
    quantize_data_type: str = "none"  # "nf4": QLoRA, base weights of adapted layers in NF4 (qlora.py)

    def peft_config(self, model: nn.Module | None = None):
        """peft's ``LoraConfig``; with a model, ``all-linear`` becomes the names of its plain ``nn.Linear`` layers.

        peft's own ``all-linear`` also wraps MoE experts stored as fused 3-D parameters
        (transformers 5), whose adapters have no ``W + B @ A`` merge into the original keys.
        """
        from peft import LoraConfig

        from minitrainer.model.heads import output_head, score_head_name, sequence_classification_class

        targets = self.target_modules
        if targets != ALL_LINEAR:
            targets = comma_list(targets)
        elif model is not None:
            head = output_head(model)
            targets = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                              if _is_projection(module) and module is not head})
        # GPT-2-style Conv1D stores its weight as [in, out]: peft must know, and so must the merged export.
        fan_in_fan_out = model is not None and _targets_are_conv1d(model, targets)
        # A reward model's score head is new: it trains whole beside the adapters, and peft saves it with them.
        scoring = model is not None and sequence_classification_class(model.config) is not None
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=targets,
                          use_rslora=self.use_rslora, bias="none", task_type="SEQ_CLS" if scoring else "CAUSAL_LM",
                          modules_to_save=[score_head_name(model)] if scoring else None,
                          fan_in_fan_out=fan_in_fan_out)


def _is_projection(module: nn.Module) -> bool:
    """A plain linear map peft's LoRA layer can wrap: ``nn.Linear`` or transformers' ``Conv1D``.

    A Linear subclass with its own forward (Llama-4's router returns (scores, logits)) is not:
    its output is not one tensor.
    """
    from transformers.pytorch_utils import Conv1D

    return (isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward) or isinstance(module, Conv1D)


def _targets_are_conv1d(model: nn.Module, targets) -> bool:
    from transformers.pytorch_utils import Conv1D

    names = set(targets) if not isinstance(targets, str) else set()
    kinds = {isinstance(module, Conv1D) for name, module in model.named_modules()
             if name.rsplit(".", 1)[-1] in names and _is_projection(module)}
    return kinds == {True}


def apply_lora(model: nn.Module, settings: LoraSettings):
    """Inject adapters into ``model`` in place and freeze everything else.

    Works on a meta-device model too (the adapters are then meta as well).

    Returns:
        The resolved ``peft.LoraConfig`` (``target_modules`` expanded to the
        module names it matched), which the adapter export saves.

    Raises:
        ValueError: nothing matched, a target is not a linear layer, or peft
            refuses the architecture; one line, naming the flag.
    """
    from peft import get_peft_model

    from minitrainer.model.heads import output_head

    try:
        peft_model = get_peft_model(model, settings.peft_config(model))
    except (ValueError, TypeError, NotImplementedError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"--lora-target-modules {settings.target_modules}: peft cannot adapt "
                         f"{type(model).__name__} ({first})") from err
    config = peft_model.peft_config[ADAPTER_NAME]
    from transformers.pytorch_utils import Conv1D

    adapted = [m for m in model.modules() if hasattr(m, "lora_A")]
    bases = [m.get_base_layer() for m in adapted]
    not_linear = sorted({type(m).__name__ for m, base in zip(adapted, bases)
                         if not isinstance(base, (nn.Linear, Conv1D))})
    if not_linear:
        raise ValueError(f"--lora-target-modules {settings.target_modules} matches {', '.join(not_linear)} "
                         "layers; only linear layers can be adapted and merged here")
    if len({isinstance(base, Conv1D) for base in bases}) > 1:
        # One adapter config holds one weight layout, which the merged export follows.
        raise ValueError(f"--lora-target-modules {settings.target_modules} matches both nn.Linear and Conv1D "
                         "layers; name the modules of one kind")
    if hasattr(output_head(model), "lora_A"):
        # The loss multiplies the hidden states by the head's weight itself (chunked or Liger
        # cross-entropy), so an adapter on the head would be silently left out of every step.
        raise ValueError(f"--lora-target-modules {settings.target_modules} adapts the LM head, which the "
                         "loss reads as a plain weight: leave it out (all-linear already does)")
    # peft swapped the modules inside ``model`` in place; the PeftModel shell is not needed.
    return config


def adapted_meta_model(model_config, settings: LoraSettings) -> nn.Module:
    """The architecture on the meta device with adapters injected, as training injects them: no memory, no
    weights. Raises ``apply_lora``'s one-line ``ValueError``, and one naming the install where peft is
    missing or fails to import beside this transformers or torchao (peft 0.17 asks transformers 5 for
    ``HybridCache``, 0.18 asks torchao 0.18 for a class it removed): rank 0's preflight would otherwise end
    in a traceback and the other ranks in a lost connection."""
    from minitrainer.model.multimodal import auto_model_class, detach_non_text, is_multimodal

    if importlib.util.find_spec("peft") is None:
        raise ValueError(f"--lora-rank needs peft, which is not installed here: {PEFT_INSTALL}")
    with torch.device("meta"):
        model = auto_model_class(model_config).from_config(model_config)
    if is_multimodal(model_config):
        detach_non_text(model)  # adapters go on the language model only, as in training
    try:
        apply_lora(model, settings)
    except ImportError as err:
        from importlib.metadata import version

        raise ValueError(f"--lora-rank: peft {version('peft')} does not work with the libraries installed here "
                         f"({err}): {PEFT_INSTALL}") from err
    return model


def lora_preflight(model_config, settings: LoraSettings) -> str | None:
    """Adapt a meta-device copy of the architecture: the error line, or None."""
    try:
        adapted_meta_model(model_config, settings)
    except ValueError as err:
        return str(err)
    return None


def lora_scaling(config) -> float:
    """The factor of ``B @ A`` in peft's forward, from a ``peft.LoraConfig``."""
    return config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)


def export_states(state: dict[str, torch.Tensor], *, scaling: float,
                  fan_in_fan_out: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split a gathered state dict of the adapted model into (merged model, peft adapter).

    Args:
        state: full state dict of the model with injected adapters (keys as in
            the module docstring).
        scaling: ``alpha / r`` (or rsLoRA's ``alpha / sqrt(r)``).
        fan_in_fan_out: the base layers store ``[in, out]`` (GPT-2's Conv1D).

    Returns:
        ``merged``: the original model's key names, every adapted weight
        replaced by ``W + scaling * B @ A`` computed in fp32; ``adapter``:
        peft's ``adapter_model.safetensors`` keys
        (``base_model.model.<module>.lora_A.weight``; a module peft trains whole, ``modules_to_save``, as
        ``base_model.model.<module>.weight``, its trained copy also in ``merged``).
    """
    factors: dict[str, dict[str, torch.Tensor]] = {}
    merged: dict[str, torch.Tensor] = {}
    adapter: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        saved = _SAVED_KEY.match(key)
        if saved:  # a module trained whole (a reward model's score head): its trained copy, in both files
            merged[f"{saved['module']}.{saved['tensor']}"] = tensor
            adapter[f"base_model.model.{saved['module']}.{saved['tensor']}"] = tensor
            continue
        if _ORIGINAL_MODULE in key:  # the untrained copy peft keeps beside it
            continue
        match = _LORA_KEY.match(key)
        if match:
            factors.setdefault(match["module"], {})[match["which"]] = tensor
            adapter[f"base_model.model.{match['module']}.lora_{match['which']}.weight"] = tensor
        else:
            merged[key.replace(_BASE_LAYER, ".")] = tensor
    for module, pair in factors.items():
        key = f"{module}.weight"
        delta = (pair["B"].float() @ pair["A"].float()) * scaling  # [out, r] @ [r, in] = [out, in]
        if fan_in_fan_out:
            delta = delta.T
        merged[key] = (merged[key].float() + delta).to(merged[key].dtype)
    return merged, adapter


def renamed_adapter(adapter: dict[str, torch.Tensor], key_map: dict[str, str]) -> dict[str, torch.Tensor]:
    """peft adapter keys (``base_model.model.<module>.lora_A.weight``) renamed for the text-only causal LM."""
    renamed = {}
    for key, tensor in adapter.items():
        module, which = key.removeprefix("base_model.model.").rsplit(".lora_", 1)
        renamed[f"base_model.model.{key_map[module + '.weight'].removesuffix('.weight')}.lora_{which}"] = tensor
    return renamed


def base_model_reference(model_name_or_path: str) -> str:
    """What an adapter export names as its base: a local folder as an absolute path, so that
    ``AutoPeftModelForCausalLM.from_pretrained(adapter)`` finds it from any working directory (a relative
    path read elsewhere is taken for a hub id); a hub id as given."""
    path = Path(model_name_or_path).expanduser()
    return str(path.resolve()) if path.is_dir() else model_name_or_path


def save_adapter(adapter: dict[str, torch.Tensor], lora_config, folder: Path, *, dtype: torch.dtype) -> None:
    """peft's adapter files, the weights in ``dtype``."""
    folder.mkdir(parents=True, exist_ok=True)
    lora_config.save_pretrained(folder)
    save_file({name: tensor.to(dtype).contiguous() for name, tensor in adapter.items()},
              folder / "adapter_model.safetensors", metadata={"format": "pt"})


class LoRA(FineTuningMethod):
    """Adapters on a frozen base (module docstring); exports the merged model plus ``adapter/``, or the
    adapter alone (``merge_on_export`` off)."""

    frozen_base = True

    def __init__(self, settings: LoraSettings) -> None:
        self.settings = settings
        self.peft_config = None  # peft's LoraConfig as ``convert`` resolved it: what the adapter export saves

    def describe(self) -> str:
        return f", LoRA rank {self.settings.rank}, alpha {self.settings.alpha:g} on {self.settings.target_modules}"

    def fingerprint(self) -> dict:
        return {"lora": self.fingerprint_fields()}

    def fingerprint_fields(self) -> list:
        """The settings that shape the adapters: a checkpoint of other adapters cannot be resumed."""
        settings = self.settings
        return [settings.rank, settings.alpha, settings.target_modules, settings.use_rslora]

    def preflight(self, model_config, *, meta_model, shard_size: int) -> str | None:
        return lora_preflight(model_config, self.settings)

    def convert(self, model: nn.Module, build: ModelBuild) -> None:
        from minitrainer.model.multimodal import language_model_targets

        config = apply_lora(model, self.settings)
        config.base_model_name_or_path = base_model_reference(build.model_name_or_path)  # in the adapter's config
        export = build.multimodal_export
        if export is not None and export.key_map is None:  # exported whole: the towers must not match
            config.target_modules = language_model_targets(model, config.target_modules)
        self.peft_config = config

    def convert_loaded(self, model: nn.Module, build: ModelBuild) -> None:
        # Adapters are initialised here, on rank 0, and reach the other ranks with the weights.
        apply_lora(model, self.settings)

    def export_state(self, state: dict[str, torch.Tensor], folder: Path, *, multimodal_export: MultimodalExport | None,
                     dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
        config = self.peft_config
        merged, adapter = export_states(state, scaling=lora_scaling(config), fan_in_fan_out=config.fan_in_fan_out)
        if multimodal_export is not None and multimodal_export.key_map is not None:
            adapter = renamed_adapter(adapter, multimodal_export.key_map)
            config = copy.deepcopy(config)
            config.base_model_name_or_path = None  # the base is the text-only export, not the source
            config.target_modules = sorted({key.split(".lora_")[0].rsplit(".", 1)[-1] for key in adapter})
        merge = self.settings.merge_on_export
        # The export's weights are in --save-dtype: the merged model's, or the adapter's where it is all there is.
        # Beside a merged model the adapter stays fp32, exact for resuming or merging onto another base.
        save_adapter(adapter, config, (folder / "adapter") if merge else folder,
                     dtype=torch.float32 if merge else dtype)
        return merged if merge else None

    def added_matrices(self, model: nn.Module) -> tuple[set[int], int]:
        # Adapter FLOPs are left out: the config-based count knows nothing of them.
        return {id(param) for name, param in model.named_parameters() if "lora_" in name}, 0
