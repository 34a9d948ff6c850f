"""Load a Hugging Face causal LM and shard it with FSDP2 (``fully_shard``).

``setup_model`` is a pipeline of named stages, in torchtitan's ``parallelize_llama`` order:

1. every rank builds the architecture on the ``meta`` device (no memory; a multimodal checkpoint's towers
   detached), and the attention backend is chosen from what it needs;
2. rank 0 alone loads the pretrained weights into host memory, once, in their stored dtype (bf16 for
   most checkpoints), so a 70B model is never held once per rank nor in fp32, and the fine-tuning method
   converts them (``methods/base.py``: LoRA adapters, QLoRA's NF4 quantization);
3. the method converts the meta model the same way (LoRA adapters, QLoRA's NF4 shells, OSFT's factor
   layers; nothing for full fine-tuning);
4. Liger kernels, then activation checkpointing per decoder block;
5. with ``--compile``, ``torch.compile`` per decoder block (``compile_blocks``): after AC, so the
   checkpoint wraps the compiled block and backward recomputes it compiled; before ``fully_shard``, whose
   hooks stay outside the compiled graph (FSDP2 disables dynamo on them), as torchtitan orders it;
6. ``fully_shard`` on every decoder block, then on the root (the loss wrapper, which owns embeddings,
   final norm and LM head), and the shards are materialised on the device;
7. ``set_model_state_dict(..., broadcast_from_rank0=True)`` fills the shards from rank 0's copy, less
   what the method fills itself (QLoRA's NF4 bytes, OSFT's factors), which it fills next; buffers that
   are not in the state dict (rotary ``inv_freq``) are broadcast explicitly.

The full model is never moved to one GPU before sharding.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, PretrainedConfig

from minitrainer.checkpoint.hf_export import export_dtype
from minitrainer.common.distributed import DistInfo
from minitrainer.common.log import log_rank_0
from minitrainer.methods.base import FineTuningMethod, ModelBuild, count_parameters
from minitrainer.model import recomputation
from minitrainer.model.attention import CONTEXT_PARALLEL, attention_needs, resolve_attn_implementation
from minitrainer.model.context_parallel import inner_backend, register_context_parallel_backend
from minitrainer.model.heads import sequence_classification_class
from minitrainer.model.loss import CausalLMWithLoss, decoder_of, find_decoder_blocks
from minitrainer.model.multimodal import (MultimodalExport, auto_model_class, detach_non_text, is_multimodal,
                                          stored_dtypes, text_only_export, whole_export)
from minitrainer.model.recurrent import run_mixers_per_sample
from minitrainer.model.score_head import SequenceScorer

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")


@dataclass(frozen=True)
class ModelSetup:
    """What ``setup_model`` resolved, printed once at startup."""

    attn_implementation: str
    param_dtype: torch.dtype
    num_blocks: int
    block_class: str
    mesh_shape: tuple[int, ...]
    num_trainable_params: int
    num_params: int
    context_parallel_inner: str | None = None  # the varlen backend context_parallel wraps (None: no CP)
    recomputation: str = "full"  # the policy the blocks were built with (auto: full, until resolve_auto)
    export_dtype: torch.dtype = torch.bfloat16  # what the Hugging Face exports write (--save-dtype, resolved)


def meta_model(config, trust_remote_code: bool) -> nn.Module:
    """The architecture on the meta device: no memory, no weights read. An image-text-to-text checkpoint
    is built whole (``multimodal.py``) and its non-text parts detached: what is left is what trains."""
    with torch.device("meta"):
        model = auto_model_class(config).from_config(config, dtype=torch.float32, attn_implementation="eager",
                                                     trust_remote_code=trust_remote_code)
    if is_multimodal(config):
        detach_non_text(model)
    return model


def apply_liger_kernels(model: nn.Module, *, device_type: str, compile: bool = False) -> bool:
    """Swap in Liger's RMSNorm, RoPE and SwiGLU kernels where the architecture has them.

    Call on the bare Hugging Face model before activation checkpointing and
    ``fully_shard`` (it rebinds module forwards; parameters are untouched, so
    a meta-device model is fine). The loss is not touched here: the fused
    linear cross-entropy lives in ``loss.CausalLMWithLoss``, so the sum-reduced
    normalisation is unchanged. Liger's RoPE patch replaces the
    ``apply_rotary_pos_emb`` of the model's transformers module for the whole
    process (Liger's own mechanism).

    Under ``compile`` the blocks are left to inductor, which fuses these
    elementwise kernels itself: dynamo cannot trace Liger's RMSNorm
    ``autograd.Function`` (an ``AssertionError`` at the first step on an H100,
    torch 2.11 with liger-kernel 0.8.5).

    Returns:
        True when kernels were applied; False (with a log line) under compile, on
        CPU or for an architecture Liger does not cover.
    """
    if compile:
        log_rank_0("--compile: Liger's RMSNorm, RoPE and SwiGLU are left to inductor, which fuses them itself "
                   "(dynamo cannot trace Liger's autograd Functions); its fused linear cross-entropy still applies",
                   level=logging.WARNING)
        return False
    if device_type != "cuda":
        log_rank_0("--use-liger-kernels needs a GPU (Triton kernels): keeping the PyTorch RMSNorm/RoPE/SwiGLU",
                   level=logging.WARNING)
        return False
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as err:
        raise ImportError("--use-liger-kernels needs liger-kernel: pip install -r requirements-cuda.txt") from err
    model_type = model.config.model_type
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        log_rank_0(f"Liger has no kernels for model type {model_type!r}: keeping its PyTorch RMSNorm/RoPE/SwiGLU "
                   "(the fused linear cross-entropy still applies)", level=logging.WARNING)
        return False
    _apply_liger_kernel_to_instance(model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
    log_rank_0(f"Liger RMSNorm, RoPE and SwiGLU applied to {model_type}")
    return True


def compile_refusal(device_type: str) -> str | None:
    """Why ``--compile`` cannot work here (one line), or None."""
    if not torch._dynamo.is_dynamo_supported():
        try:
            torch._dynamo.eval_frame.check_if_dynamo_supported()
        except RuntimeError as err:
            return f"--compile: torch.compile does not run here ({err}); train without --compile"
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return ("--compile: inductor's GPU backend needs Triton, which does not import here: "
                    "pip install triton (the version your torch wheel pins), or train without --compile")
        return None
    from torch._inductor import exc
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        return ("--compile: inductor's CPU backend needs a C++ compiler (g++ or clang++ on PATH, or $CXX) and "
                "none was found; install one (apt-get install g++) or train without --compile")
    return None


def compile_blocks(blocks: list[nn.Module], *, device_type: str) -> None:
    """``torch.compile`` each decoder block in place (regional compilation), with dynamic shapes.

    ``Module.compile`` keeps the module, its parameter names and its
    activation-checkpointing ``__call__``; identical blocks share one compiled
    graph. ``dynamic=True`` traces the token dimension symbolically from the
    first step on: packed rows change length every step, and one graph for all
    lengths is compiled once. (The default, automatic dynamic shapes, would
    first compile a graph specialised to step 1's length and recompile at step
    2; a resumed run would then specialise to another length and could round
    differently from the run it continues.) Length bucketing was not chosen:
    it pads every row, costing tokens, and still compiles one graph per bucket.

    Raises:
        ValueError: ``compile_refusal`` found a reason it cannot work.
    """
    error = compile_refusal(device_type)
    if error is not None:
        raise ValueError(error)
    for block in blocks:
        block.compile(dynamic=True)
    log_rank_0(f"torch.compile: {len(blocks)} decoder blocks ({type(blocks[0]).__name__}), inductor, dynamic "
               "token dimension (packed rows vary in length)")


def shard_group_size(strategy: str, world_size: int, local_world_size: int) -> int:
    """Ranks each parameter is sharded across: the last dimension of ``build_mesh``'s mesh."""
    return {"FULL_SHARD": world_size, "SHARD_GRAD_OP": world_size, "NO_SHARD": 1}.get(strategy, local_world_size)


def build_mesh(strategy: str, dist_info: DistInfo, local_world_size: int) -> DeviceMesh:
    """1-D mesh for FULL_SHARD/SHARD_GRAD_OP; 2-D (replicate, shard) for HYBRID_SHARD/NO_SHARD."""
    device_type = dist_info.device.type
    world = dist_info.world_size
    if strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    if strategy == "NO_SHARD":
        return init_device_mesh(device_type, (world, 1), mesh_dim_names=("replicate", "shard"))
    if world % local_world_size != 0:
        raise ValueError(f"HYBRID_SHARD needs equal GPUs per node: world size {world} is not a multiple "
                         f"of {local_world_size} processes per node")
    return init_device_mesh(device_type, (world // local_world_size, local_world_size),
                            mesh_dim_names=("replicate", "shard"))


def setup_model(*, model_name_or_path: str, model_config: PretrainedConfig | None = None, dist_info: DistInfo,
                attn_implementation: str,
                sharding_strategy: str, cpu_offload: bool, activation_checkpointing: str | bool,
                use_liger_kernels: bool, local_world_size: int,
                head_learned_positions_only: bool = True, compile: bool = False, trust_remote_code: bool = False,
                method: FineTuningMethod | None = None,
                context_parallel_size: int = 1, export_text_only: bool = False,
                save_dtype: str = "bfloat16") -> tuple[CausalLMWithLoss, ModelSetup]:
    """Build the sharded training module (model plus loss) on every rank, in named stages:

    build on meta (multimodal split) -> attention -> load on rank 0 (method.convert_loaded) ->
    method.convert -> kernels (Liger) -> activation checkpointing -> compile -> shard -> broadcast (less
    what method.hold_back keeps) -> method.fill -> buffers.

    Rank 0 loads before the meta model is converted: what a method initialises on the loaded model from the
    seeded RNG (LoRA's adapters) then draws the same numbers whatever the meta conversion draws (peft builds
    its adapter layers on the host, initialised, before moving them to the meta device).

    Args:
        model_name_or_path: local folder or hub id understood by ``from_pretrained``.
        model_config: its config when the caller has loaded it already (read here otherwise); not modified.
        dist_info: this process's place in the job.
        attn_implementation: 'auto' or a transformers attention backend.
        sharding_strategy: one of ``SHARDING_STRATEGIES``.
        cpu_offload: keep sharded parameters, gradients and optimizer state in host memory.
        activation_checkpointing: how each block recomputes in backward (``recomputation.POLICIES``; True/False:
            full/none); auto starts as full and ``recomputation.resolve_auto`` lowers it.
        use_liger_kernels: Liger fused linear cross-entropy (CUDA only).
        local_world_size: processes per node (HYBRID_SHARD's shard group).
        head_learned_positions_only: LM head and loss on labelled positions only (``loss.learned_positions``).
        compile: ``torch.compile`` each decoder block (``compile_blocks``).
        trust_remote_code: run the modelling code a checkpoint ships (off unless the user asks).
        method: the fine-tuning method (``methods/base.py``); None: full fine-tuning.
        context_parallel_size: above 1, attention runs as ``context_parallel`` around the resolved varlen
            backend (``context_parallel.inner_backend``).
        export_text_only: a multimodal checkpoint's exports hold its language model alone, as a causal LM.
        save_dtype: ``--save-dtype``: a dtype name, or ``auto`` for the checkpoint's own (``stored_dtype``).

    Returns:
        The FSDP2-wrapped ``CausalLMWithLoss`` (its ``method`` and ``multimodal_export`` are read by the
        exports) and what was resolved.
    """
    method = method or FineTuningMethod()
    device = dist_info.device
    cpu_offload = _offload_possible(cpu_offload, device)
    # fp32 master weights everywhere; bf16 compute only where the hardware makes it pay.
    param_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = (copy.deepcopy(model_config) if model_config is not None
              else AutoConfig.from_pretrained(model_name_or_path, trust_remote_code=trust_remote_code))
    config.use_cache = False
    # Read before meta_model: from_config writes the float32 it builds in into config.dtype.
    save_as = export_dtype(save_dtype, stored_dtype(config, model_name_or_path, dist_info)
                           if save_dtype == "auto" else None)
    model = meta_model(config, trust_remote_code)
    export = _multimodal_export(model, config, export_text_only=export_text_only, trust_remote_code=trust_remote_code)
    attn, inner = _set_attention(model, attn_implementation, device.type, context_parallel_size)
    mesh = build_mesh(sharding_strategy, dist_info, local_world_size)
    build = ModelBuild(model_name_or_path=model_name_or_path, multimodal_export=export, shard_size=mesh.shape[-1],
                       param_dtype=param_dtype, device=device,
                       weights_device=torch.device("cpu") if cpu_offload else device)
    full_state, real_buffers = (_load_on_rank_0(config, build, method, trust_remote_code=trust_remote_code)
                                if dist_info.rank == 0 else ({}, {}))
    method.convert(model, build)
    if getattr(model, "generation_config", None) is not None:  # a sequence classifier generates nothing
        model.generation_config.use_cache = False
    if use_liger_kernels:
        apply_liger_kernels(model, device_type=device.type, compile=compile)
    _run_mixers_per_sample(model)
    recompute = apply_activation_checkpointing(model, activation_checkpointing)
    blocks = find_decoder_blocks(model)
    if compile:
        compile_blocks(blocks, device_type=device.type)
    # The head follows the config (model/heads.py): a sequence classifier's score head, else the LM head.
    wrapper = (SequenceScorer(model) if sequence_classification_class(config) is not None
               else CausalLMWithLoss(model, use_liger_kernels=use_liger_kernels,
                                     head_learned_positions_only=head_learned_positions_only))
    wrapper.method, wrapper.multimodal_export = method, export
    num_trainable, num_params = count_parameters(model)
    _shard(wrapper, blocks, mesh=mesh, param_dtype=param_dtype, sharding_strategy=sharding_strategy,
           cpu_offload=cpu_offload, ignored_params=method.ignored_params(model, build))
    wrapper.to_empty(device=build.weights_device)
    held = method.hold_back(wrapper.model, full_state) if dist_info.rank == 0 else {}
    set_model_state_dict(wrapper.model, full_state, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True, cpu_offload=cpu_offload,
        strict=not method.weights_it_fills(wrapper.model)))  # what the method fills is not in the broadcast
    del full_state
    method.fill(wrapper.model, held, build)
    del held
    _broadcast_buffers(wrapper.model, real_buffers, device)
    del real_buffers
    log_rank_0(f"objective: logit processing {wrapper.logit_transform.describe()}; router loss "
               + (f"coef {wrapper.router_loss.coef:g} x per-sample load balancing over "
                  f"{wrapper.router_loss.num_experts} experts (top {wrapper.router_loss.top_k})"
                  if wrapper.router_loss else "none"))
    return wrapper, ModelSetup(attn_implementation=attn, param_dtype=param_dtype, num_blocks=len(blocks),
                               block_class=type(blocks[0]).__name__, mesh_shape=tuple(mesh.shape),
                               num_trainable_params=num_trainable, num_params=num_params,
                               context_parallel_inner=inner, recomputation=recompute, export_dtype=save_as)


# ----------------------------------------------------------------------------
# The stages of setup_model, in its order.


def _offload_possible(cpu_offload: bool, device: torch.device) -> bool:
    if cpu_offload and device.type == "cpu":
        log_rank_0("--cpu-offload has nothing to offload on CPU (FSDP2's CPUOffloadPolicy needs an "
                   "accelerator): parameters already live in host memory", level=logging.WARNING)
        return False
    return cpu_offload


def stored_dtype(config, model_name_or_path: str, dist_info: DistInfo) -> torch.dtype:
    """The checkpoint's own dtype, as ``from_pretrained(dtype="auto")`` reads it: its config's, else that of its
    first floating-point weight in its safetensors headers (a config naming none, as GPT-2's), else float32.
    Collective where the config names none: rank 0 reads the headers (fetching them once), the others hear it."""
    if config.dtype is not None:
        return config.dtype
    box = [None]
    if dist_info.rank == 0:
        stored = [dtype for dtype in stored_dtypes(model_name_or_path).values() if dtype.is_floating_point]
        box = [stored[0] if stored else torch.float32]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _multimodal_export(model: nn.Module, config, *, export_text_only: bool,
                       trust_remote_code: bool) -> MultimodalExport | None:
    """How a multimodal checkpoint is exported (None for a causal LM); the text-only key map is read from the
    meta model before any method renames a module."""
    if not is_multimodal(config):
        return None
    return (text_only_export(model, trust_remote_code=trust_remote_code) if export_text_only
            else whole_export(config, trust_remote_code=trust_remote_code))


def _set_attention(model: nn.Module, attn_implementation: str, device_type: str,
                   context_parallel_size: int) -> tuple[str, str | None]:
    """The backend the model's attention needs, wrapped by context parallelism when asked:
    ``(backend, the varlen backend context parallelism wraps, or None)``."""
    attn = resolve_attn_implementation(attn_implementation, device_type, attention_needs(model))
    inner = None
    if context_parallel_size > 1:
        inner, reason = inner_backend(attn, device_type)
        if inner is None:
            raise ValueError(reason)
        register_context_parallel_backend(inner)
        log_rank_0(f"attention: {CONTEXT_PARALLEL} over groups of {context_parallel_size} ranks, {reason}")
        attn = CONTEXT_PARALLEL
    if attn != "eager":
        model.set_attn_implementation(attn)
    return attn, inner


def _run_mixers_per_sample(model: nn.Module) -> None:
    """Hybrid models: linear-attention / SSM layers must not carry a state across packed samples (recurrent.py)."""
    mixers = run_mixers_per_sample(decoder_of(model), find_decoder_blocks(model))
    if mixers:
        mixer_classes = sorted({type(m).__name__ for m in mixers})
        log_rank_0(f"packed rows: {len(mixers)} recurrent token mixers ({', '.join(mixer_classes)}) run once per "
                   "packed sample, so no state flows from one sample into the next")


def apply_activation_checkpointing(model: nn.Module, policy: str | bool) -> str:
    """Make each decoder block recompute per ``policy`` (``recomputation.py``: full, selective, none, or auto,
    which starts as full); returns the policy applied."""
    applied = recomputation.initial_policy(recomputation.as_policy(policy), model)
    recomputation.set_policy(model, applied)
    return applied


def _shard(wrapper: CausalLMWithLoss, blocks: list[nn.Module], *, mesh: DeviceMesh, param_dtype: torch.dtype,
           sharding_strategy: str, cpu_offload: bool, ignored_params: set[nn.Parameter]) -> None:
    """``fully_shard`` every decoder block, then the root; gradients reduced in fp32."""
    fsdp_kwargs = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
        # SHARD_GRAD_OP keeps parameters gathered between forward and backward (ZeRO-2).
        "reshard_after_forward": sharding_strategy != "SHARD_GRAD_OP",
    }
    if cpu_offload:
        fsdp_kwargs["offload_policy"] = CPUOffloadPolicy()
    if ignored_params:
        fsdp_kwargs["ignored_params"] = ignored_params
    for block in blocks:
        fully_shard(block, **fsdp_kwargs)
    # The root (embeddings, final norm, LM head) keeps its parameters gathered from forward to
    # backward: backward needs the LM head first, so resharding would only gather it again.
    fully_shard(wrapper, **{**fsdp_kwargs, "reshard_after_forward": False})


def _load_on_rank_0(config, build: ModelBuild, method: FineTuningMethod, *,
                    trust_remote_code: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Rank 0 alone reads the checkpoint, in its stored dtype (bf16 for most): one copy of the weights in host
    memory, at its smallest, changed as the method changed the meta model. Returns ``(state dict, buffers)``;
    the loaded module is dropped, its tensors live on in them until the broadcast."""
    scoring = sequence_classification_class(config) is not None
    with _load_report_quiet() if scoring else contextlib.nullcontext():
        loaded, info = auto_model_class(config).from_pretrained(
            build.model_name_or_path, config=copy.deepcopy(config), dtype="auto", attn_implementation="eager",
            trust_remote_code=trust_remote_code, output_loading_info=True)
    if scoring and info["missing_keys"]:
        # A causal LM read as its sequence classifier: transformers' multi-line load report, said in one line.
        unused = sorted(info["unexpected_keys"])
        log_rank_0(f"{build.model_name_or_path}: a fresh score head ({', '.join(sorted(info['missing_keys']))}, "
                   f"initialised from --seed) on its decoder"
                   + (f"; {', '.join(unused)} not loaded (the causal LM's head)" if unused else ""))
    if build.multimodal_export is not None:
        _keep_non_text(loaded, build.multimodal_export, build.model_name_or_path)
    method.convert_loaded(loaded, build)
    return loaded.state_dict(), dict(loaded.named_buffers())


@contextlib.contextmanager
def _load_report_quiet():
    """transformers' load report at error level only, while a causal LM loads as its sequence classifier (its
    missing score head and unused LM head are expected, and said in one line instead)."""
    from transformers.utils import logging as transformers_logging

    level = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(level)


def _keep_non_text(loaded: nn.Module, export: MultimodalExport, model_name_or_path: str) -> None:
    """The towers and projectors stay on rank 0's host, as loaded: the whole export writes them back."""
    non_text_state, detached = detach_non_text(loaded)
    if export.key_map is None:
        unmatched = export.keep_non_text(non_text_state, model_name_or_path)
        if unmatched:
            log_rank_0(f"{len(unmatched)} frozen tensors ({', '.join(unmatched[:3])}, ...) are not under "
                       "these names in the checkpoint's files: exported in the dtype they loaded in",
                       level=logging.WARNING)
    num_frozen = sum(t.numel() for t in non_text_state.values())
    log_rank_0(f"{type(loaded).__name__}: training its language model ({type(decoder_of(loaded)).__name__} "
               f"and the LM head); {', '.join(detached[:4])}{', ...' if len(detached) > 4 else ''} "
               f"({num_frozen:,} parameters) stay frozen in rank 0's host memory for the exports, "
               "neither sharded nor trained")


def sync_gradients_on(model: nn.Module, *, sharding_strategy: str, final_minibatch: bool) -> None:
    """Reduce gradients across ranks only where waiting for the step's last minibatch costs no memory.

    NO_SHARD holds whole gradients anyway: skip every reduction until the last
    minibatch. HYBRID_SHARD: reduce-scatter within the node every minibatch (the
    gradients stay sharded) but all-reduce across nodes only on the last one.
    FULL_SHARD and SHARD_GRAD_OP reduce-scatter every minibatch: deferring would
    hold an unsharded fp32 gradient of the whole model on every rank.
    """
    if sharding_strategy == "NO_SHARD":
        model.set_requires_gradient_sync(final_minibatch)
    elif sharding_strategy == "HYBRID_SHARD":
        model.set_requires_all_reduce(final_minibatch)


def _broadcast_buffers(model: nn.Module, real_buffers: dict[str, torch.Tensor], device: torch.device) -> None:
    """Fill buffers (e.g. rotary inv_freq, often non-persistent) from rank 0's loaded model."""
    for name, buffer in model.named_buffers():
        # Rank 0's buffers are in the stored dtype; every rank stages in the module's dtype so sizes agree.
        staging = (real_buffers[name].to(device=device, dtype=buffer.dtype) if name in real_buffers
                   else torch.empty_like(buffer, device=device))
        dist.broadcast(staging, src=0)
        with torch.no_grad():
            buffer.copy_(staging)
