"""Load a Hugging Face causal LM and shard it with FSDP2 (``fully_shard``).

Order of operations (torchtitan's ``parallelize_llama`` order):

1. every rank builds the architecture on the ``meta`` device (no memory) and
   the attention backend is chosen from what it needs; rank 0 alone loads the
   pretrained weights into host memory, once, in their stored dtype (bf16 for
   most checkpoints), so a 70B model is never held once per rank nor in fp32;
2. activation checkpointing per decoder block (``gradient_checkpointing_enable``);
3. with ``--compile``, ``torch.compile`` per decoder block (``compile_blocks``):
   after AC, so the checkpoint wraps the compiled block and backward recomputes
   it compiled; before ``fully_shard``, whose hooks stay outside the compiled
   graph (FSDP2 disables dynamo on them), as torchtitan orders it;
4. ``fully_shard`` on every decoder block, then on the root (the loss wrapper,
   which owns embeddings, final norm and LM head);
5. the shards are materialised on the device and filled from rank 0's copy by
   ``set_model_state_dict(..., broadcast_from_rank0=True)``; buffers that are
   not in the state dict (rotary ``inv_freq``) are broadcast explicitly.

The full model is never moved to one GPU before sharding.
"""

from __future__ import annotations

import copy
import logging
import resource
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, PretrainedConfig

from attention import CONTEXT_PARALLEL, attention_needs, resolve_attn_implementation
from context_parallel import inner_backend, register_context_parallel_backend
from lora import LoraSettings, apply_lora, count_parameters
from loss import CausalLMWithLoss, decoder_of
from multimodal import (auto_model_class, detach_non_text, is_multimodal, language_model_targets, text_only_export,
                        whole_export)
from osft import FACTORS as OSFT_FACTORS
from osft import (RECONSTRUCTION_TOLERANCE, OSFTSettings, apply_osft, fill_osft_factors, osft_modules,
                  osft_targets)
from qlora import NF4, broadcast_nf4, gather_dequantized_state, is_nf4, pop_nf4, quantize_base_weights
from recurrent import run_mixers_per_sample
from utils import DistInfo, log_rank_0

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
    quantized: str = "none"  # what --lora-quantize-data-type did, for the startup log
    context_parallel_inner: str | None = None  # the varlen backend context_parallel wraps (None: no CP)


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


def find_decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks, found generically.

    Uses the model's own ``_no_split_modules`` (the classes Hugging Face never
    splits across devices: its decoder layers); falls back to the longest
    ``nn.ModuleList`` of same-class modules.
    """
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    # Outermost only: some families list a block and a module inside it (Mamba: MambaBlock and MambaMixer),
    # and sharding both would shard the inner parameters twice.
    inner = {id(sub) for block in blocks for sub in block.modules() if sub is not block}
    # The embeddings stay with the root, beside the LM head they may be tied to (BERT-style models list
    # their embeddings module among _no_split_modules; a separate FSDP unit would split the tied weight).
    embeddings = [m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None]
    blocks = [block for block in blocks if id(block) not in inner
              and not any(e is sub for e in embeddings for sub in block.modules())]
    if blocks:
        return blocks
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best):
            if len({type(child) for child in module}) == 1:
                best = list(module)
    if not best:
        raise ValueError(f"cannot find the decoder blocks of {type(model).__name__}: it declares no "
                         "_no_split_modules and has no nn.ModuleList of identical blocks")
    return best


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
                sharding_strategy: str, cpu_offload: bool, activation_checkpointing: bool,
                use_liger_kernels: bool, local_world_size: int,
                head_learned_positions_only: bool = True, compile: bool = False, trust_remote_code: bool = False,
                lora: LoraSettings | None = None, osft: OSFTSettings | None = None,
                context_parallel_size: int = 1, export_text_only: bool = False) -> tuple[CausalLMWithLoss, ModelSetup]:
    """Build the sharded training module (model plus loss) on every rank.

    Args:
        model_name_or_path: local folder or hub id understood by ``from_pretrained``.
        model_config: its config when the caller has loaded it already (read here otherwise); not modified.
        dist_info: this process's place in the job.
        attn_implementation: 'auto' or a transformers attention backend.
        sharding_strategy: one of ``SHARDING_STRATEGIES``.
        cpu_offload: keep sharded parameters, gradients and optimizer state in host memory.
        activation_checkpointing: recompute each block's activations in backward.
        use_liger_kernels: Liger fused linear cross-entropy (CUDA only).
        local_world_size: processes per node (HYBRID_SHARD's shard group).
        head_learned_positions_only: LM head and loss on labelled positions only (``loss.learned_positions``).
        compile: ``torch.compile`` each decoder block (``compile_blocks``).
        trust_remote_code: run the modelling code a checkpoint ships (off unless the user asks).
        lora: inject LoRA adapters and freeze the base weights (None: full fine-tuning).
        osft: replace the targeted linear layers by their SVD factors (``osft.py``; None: dense).
        context_parallel_size: above 1, attention runs as ``context_parallel`` around the resolved varlen
            backend (``context_parallel.inner_backend``).
        export_text_only: a multimodal checkpoint's exports hold its language model alone, as a causal LM.

    Returns:
        The FSDP2-wrapped ``CausalLMWithLoss`` and what was resolved.
    """
    device = dist_info.device
    if cpu_offload and device.type == "cpu":
        log_rank_0("--cpu-offload has nothing to offload on CPU (FSDP2's CPUOffloadPolicy needs an "
                   "accelerator): parameters already live in host memory", level=logging.WARNING)
        cpu_offload = False
    # fp32 master weights everywhere; bf16 compute only where the hardware makes it pay.
    param_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    config = (copy.deepcopy(model_config) if model_config is not None
              else AutoConfig.from_pretrained(model_name_or_path, trust_remote_code=trust_remote_code))
    config.use_cache = False
    # Every rank builds the architecture on meta (no memory); its attention needs pick the backend.
    model = meta_model(config, trust_remote_code)
    multimodal = is_multimodal(config)
    # How a multimodal checkpoint is exported; its text-only key map is read before LoRA renames anything.
    export = None
    if multimodal:
        export = (text_only_export(model, trust_remote_code=trust_remote_code) if export_text_only
                  else whole_export(config, trust_remote_code=trust_remote_code))
    attn = resolve_attn_implementation(attn_implementation, device.type, attention_needs(model))
    inner = None
    if context_parallel_size > 1:
        inner, reason = inner_backend(attn, device.type)
        if inner is None:
            raise ValueError(reason)
        register_context_parallel_backend(inner)
        log_rank_0(f"attention: {CONTEXT_PARALLEL} over groups of {context_parallel_size} ranks, {reason}")
        attn = CONTEXT_PARALLEL
    if attn != "eager":
        model.set_attn_implementation(attn)
    # OSFT shells replace the targeted nn.Linear on meta, before anything else wraps the model (LoRA and
    # compile are refused with it; AC, Liger and fully_shard then see the factor layers).
    osft_names = _apply_osft_shells(model, osft)
    mesh = build_mesh(sharding_strategy, dist_info, local_world_size)
    quantize = lora is not None and lora.quantize_data_type == NF4
    if dist_info.rank == 0:
        # The stored dtype (bf16 for most checkpoints): one copy of the weights in host memory, at its
        # smallest. The loaded module is dropped; its tensors live on in the state dict until broadcast.
        loaded = auto_model_class(config).from_pretrained(model_name_or_path, config=copy.deepcopy(config),
                                                          dtype="auto", attn_implementation="eager",
                                                          trust_remote_code=trust_remote_code)
        if multimodal:
            # The towers and projectors stay here, on rank 0's host, as loaded: the export writes them back.
            non_text_state, detached = detach_non_text(loaded)
            if not export_text_only:
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
        if lora is not None:
            # Adapters are initialised here, on rank 0, and reach the other ranks with the weights.
            apply_lora(loaded, lora)
        if quantize:
            # QLoRA: rank 0 alone quantizes, weight by weight; the other ranks only ever see NF4 bytes.
            began = time.perf_counter()
            report = quantize_base_weights(loaded, shard_size=mesh.shape[-1], dtype=param_dtype, device=device)
            log_rank_0(f"QLoRA: {report.num_quantized} base weights in NF4 ({report.num_full_bytes / 2**20:.1f} MiB "
                       f"in {str(param_dtype).removeprefix('torch.')} -> {report.num_nf4_bytes / 2**20:.1f} MiB) "
                       f"on {device.type} in {time.perf_counter() - began:.1f}s; rank 0 peak host memory "
                       f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB after loading")
            if report.num_kept:
                log_rank_0(f"QLoRA: {report.num_kept} adapted linear layers stay in full precision (frozen): their "
                           f"shards do not split into whole NF4 groups ({', '.join(report.kept_names[:3])}, ...)",
                           level=logging.WARNING)
        full_state = loaded.state_dict()
        real_buffers = dict(loaded.named_buffers())
        del loaded
    else:
        full_state, real_buffers = {}, {}
    # The decomposed weights leave the broadcast: their factors are filled by fill_osft_factors instead.
    dense_weights = {name: full_state.pop(f"{name}.weight") for name in osft_names} if dist_info.rank == 0 else {}
    model.generation_config.use_cache = False
    lora_config = None
    if lora is not None:
        lora_config = apply_lora(model, lora)
        lora_config.base_model_name_or_path = model_name_or_path  # recorded in the adapter's config
        if multimodal and not export_text_only:
            lora_config.target_modules = language_model_targets(model, lora_config.target_modules)
        if quantize:
            # Meta NF4 shells with the shapes fully_shard cuts; broadcast_nf4 fills them.
            quantize_base_weights(model, shard_size=mesh.shape[-1], dtype=param_dtype)
    if use_liger_kernels:
        # Rebinds RMSNorm/SwiGLU forwards (parameters untouched) and Liger's RoPE: before AC and fully_shard.
        apply_liger_kernels(model, device_type=device.type, compile=compile)

    # Hybrid models: linear-attention / SSM layers must not carry a state across packed samples (recurrent.py).
    mixers = run_mixers_per_sample(decoder_of(model), find_decoder_blocks(model))
    if mixers:
        mixer_classes = sorted({type(m).__name__ for m in mixers})
        log_rank_0(f"packed rows: {len(mixers)} recurrent token mixers ({', '.join(mixer_classes)}) run once per "
                   "packed sample, so no state flows from one sample into the next")
    if activation_checkpointing and not getattr(model, "supports_gradient_checkpointing", True):
        log_rank_0(f"{type(model).__name__} does not support activation checkpointing: training without it "
                   "(more activation memory)", level=logging.WARNING)
        activation_checkpointing = False
    if activation_checkpointing:
        # transformers 5 renamed the public switch; 4.x only has the old name.
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    blocks = find_decoder_blocks(model)
    if compile:
        compile_blocks(blocks, device_type=device.type)
    wrapper = CausalLMWithLoss(model, use_liger_kernels=use_liger_kernels,
                               head_learned_positions_only=head_learned_positions_only)
    # Read by the export (hf_export.py): the adapter's config and whether to merge it.
    wrapper.lora_config = lora_config
    wrapper.lora_merge_on_export = lora is None or lora.merge_on_export
    wrapper.osft_upcast_dtype = osft.upcast_dtype if osft is not None else torch.float32
    # Read by the export too: how a multimodal checkpoint is written (None for a causal LM).
    wrapper.multimodal_export = export
    num_trainable, num_params = count_parameters(model)

    fsdp_kwargs = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
        # SHARD_GRAD_OP keeps parameters gathered between forward and backward (ZeRO-2).
        "reshard_after_forward": sharding_strategy != "SHARD_GRAD_OP",
    }
    if cpu_offload:
        fsdp_kwargs["offload_policy"] = CPUOffloadPolicy()
    if quantize and mesh.shape[-1] == 1:
        # Workaround: with a shard group of one rank (NO_SHARD, or a single process) FSDP2 skips the
        # all-gather and assumes one all-gather input per parameter, but an NF4 weight has three
        # (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, ``world_size == 1``). Every
        # rank holds whole weights there anyway, so FSDP2 simply leaves the frozen NF4 weights alone.
        fsdp_kwargs["ignored_params"] = {param for param in model.parameters() if is_nf4(param)}
    block_class = type(blocks[0]).__name__
    for block in blocks:
        fully_shard(block, **fsdp_kwargs)
    # The root (embeddings, final norm, LM head) keeps its parameters gathered from forward to
    # backward: backward needs the LM head first, so resharding would only gather it again.
    fully_shard(wrapper, **{**fsdp_kwargs, "reshard_after_forward": False})

    wrapper.to_empty(device="cpu" if cpu_offload else device)
    full_nf4 = pop_nf4(full_state)
    if osft_names and dist_info.rank == 0:
        # strict=False below lets the factors be absent; every other key must still match exactly.
        expected = {key for key in wrapper.model.state_dict() if key.rpartition(".")[2] not in OSFT_FACTORS}
        assert expected == set(full_state), f"state dict keys differ: {sorted(expected ^ set(full_state))[:5]}"
    set_model_state_dict(
        wrapper.model,
        full_state,
        # NF4 weights are not in rank 0's dict any more: broadcast_nf4 sends their bytes; nor are OSFT's
        # decomposed weights.
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=cpu_offload,
                                 strict=not quantize and not osft_names),
    )
    del full_state
    if quantize:
        broadcast_nf4(wrapper.model, full_nf4, device=torch.device("cpu") if cpu_offload else device)
    del full_nf4
    if osft_names:
        _fill_osft(wrapper.model, dense_weights, osft, device)
    del dense_weights
    _broadcast_buffers(wrapper.model, real_buffers, device)
    del real_buffers
    log_rank_0(f"objective: logit processing {wrapper.logit_transform.describe()}; router loss "
               + (f"coef {wrapper.router_loss.coef:g} x per-sample load balancing over "
                  f"{wrapper.router_loss.num_experts} experts (top {wrapper.router_loss.top_k})"
                  if wrapper.router_loss else "none"))

    return wrapper, ModelSetup(attn_implementation=attn, param_dtype=param_dtype, num_blocks=len(blocks),
                               block_class=block_class, mesh_shape=tuple(mesh.shape),
                               num_trainable_params=num_trainable, num_params=num_params,
                               context_parallel_inner=inner)


def _apply_osft_shells(model: nn.Module, osft: OSFTSettings | None) -> list[str]:
    """Replace the OSFT targets of the meta model by empty factor layers; returns their names."""
    if osft is None:
        return []
    log_rank_0(osft.describe())
    targets = osft_targets(model, blocks=find_decoder_blocks(model), patterns=osft.target_patterns)
    names = apply_osft(model, targets, unfreeze_rank_ratio=osft.unfreeze_rank_ratio, upcast_dtype=osft.upcast_dtype)
    if not names:
        log_rank_0(f"OSFT: ratio {osft.unfreeze_rank_ratio:g} freezes no direction of any of the {len(targets)} "
                   "targets: plain full fine-tuning", level=logging.WARNING)
    else:
        num_frozen = sum(model.get_submodule(name).S_high.numel() for name in names)
        num_trainable = sum(model.get_submodule(name).S_low.numel() for name in names)
        log_rank_0(f"OSFT: {len(names)} of {len(targets)} target matrices decomposed ({len(targets) - len(names)} "
                   f"too small to freeze a direction); {num_frozen:,} singular directions frozen, "
                   f"{num_trainable:,} trainable")
    return names


def _fill_osft(model: nn.Module, dense_weights: dict[str, torch.Tensor], osft: OSFTSettings,
               device: torch.device) -> None:
    """Decompose the weights across the ranks (by SVD FLOPs), check the factors reproduce them, log it."""
    # Every rank needs the factors (the replicas of HYBRID_SHARD too): the world group.
    report = fill_osft_factors(model, dense_weights, upcast_dtype=osft.upcast_dtype, comm_device=device)
    tolerance = RECONSTRUCTION_TOLERANCE[next(m for _, m in osft_modules(model)).U_low.dtype]
    log_rank_0(report.describe())
    if report.max_reconstruction_error > tolerance:  # the same number on every rank (all-reduced): all exit
        log_rank_0(f"OSFT self-check failed: the factors reproduce a weight only to "
                   f"{report.max_reconstruction_error:.1e} (tolerance {tolerance:.0e}); --osft-upcast-dtype "
                   "float64 decomposes more exactly", level=logging.ERROR)
        raise SystemExit(1)


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


def gather_full_state_dict(wrapper: CausalLMWithLoss) -> dict[str, torch.Tensor]:
    """All-gather the Hugging Face state dict into rank 0's host memory (empty on other ranks).

    ``cpu_offload`` moves each gathered tensor off the GPU as it arrives, so a
    large model never needs its full size in GPU memory. NF4 weights (QLoRA)
    come back dequantized, in the compute dtype.
    """
    if any(is_nf4(param) for param in wrapper.model.parameters()):
        return gather_dequantized_state(wrapper.model)
    return get_model_state_dict(wrapper.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
