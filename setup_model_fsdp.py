"""Load a Hugging Face causal LM and shard it with FSDP2 (``fully_shard``).

Order of operations (torchtitan's ``parallelize_llama`` order):

1. rank 0 loads the pretrained weights into host memory; every other rank
   builds the same architecture on the ``meta`` device (no memory), so a 70B
   model is never held once per rank;
2. activation checkpointing per decoder block (``gradient_checkpointing_enable``);
3. ``fully_shard`` on every decoder block, then on the root (the loss wrapper,
   which owns embeddings, final norm and LM head);
4. the shards are materialised on the device and filled from rank 0's copy by
   ``set_model_state_dict(..., broadcast_from_rank0=True)``; buffers that are
   not in the state dict (rotary ``inv_freq``) are broadcast explicitly.

The full model is never moved to one GPU before sharding.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

from attention import (FLASH_BACKENDS, TORCH_VARLEN, flash_attn_unavailable_reason, register_attention_backends,
                       torch_varlen_unavailable_reason)
from lora import LoraSettings, apply_lora, count_parameters
from loss import CausalLMWithLoss
from utils import DistInfo, log_rank_0

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
PACKED_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "torch_varlen", "reference_varlen")


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


def resolve_attn_implementation(requested: str, device_type: str) -> str:
    """Pick the attention backend for padding-free packed rows, and say why.

    'auto' -> ``flash_attention_2`` when ``flash_attn`` imports on CUDA, else
    ``torch_varlen`` (PyTorch's own varlen flash kernel, torch >= 2.10) on
    CUDA, else ``sdpa`` (CPU, tests). Every returned backend honours packed
    boundaries without padding: sdpa/eager through transformers'
    block-diagonal mask built from ``position_ids`` (O(T^2) memory), flash
    and varlen backends through explicit ``cu_seqlens``. Any other name is
    refused; a GPU-only backend asked for on CPU falls back to sdpa with a
    warning.
    """
    register_attention_backends()
    gpu_only = FLASH_BACKENDS + (TORCH_VARLEN,)
    if requested == "auto":
        if device_type != "cuda":
            return "sdpa"
        if flash_attn_unavailable_reason("flash_attention_2") is None:
            log_rank_0("attention: flash_attention_2 (flash_attn imports)")
            return "flash_attention_2"
        reason = torch_varlen_unavailable_reason()
        if reason is None:
            log_rank_0("attention: torch_varlen (flash_attn is not installed; PyTorch's varlen flash kernel)")
            return TORCH_VARLEN
        log_rank_0(f"attention: sdpa with a block-diagonal mask, slow for long rows: flash_attn is not "
                   f"installed and {reason}", level=logging.WARNING)
        return "sdpa"
    if requested not in PACKED_ATTENTION:
        raise ValueError(f"--attn-implementation {requested!r} cannot honour packed sequence boundaries "
                         f"without padding; choose one of auto, {', '.join(PACKED_ATTENTION)}")
    if requested in gpu_only and device_type != "cuda":
        log_rank_0(f"--attn-implementation {requested} needs a GPU: using sdpa on {device_type}",
                   level=logging.WARNING)
        return "sdpa"
    missing = flash_attn_unavailable_reason(requested) if requested in FLASH_BACKENDS else None
    if requested == TORCH_VARLEN:
        missing = torch_varlen_unavailable_reason()
    if missing is not None:
        raise ValueError(f"--attn-implementation {requested}: {missing}. Use --attn-implementation auto, or "
                         "install the CUDA extras (pip install -r requirements-cuda.txt)")
    return requested


def apply_liger_kernels(model: nn.Module, *, device_type: str) -> bool:
    """Swap in Liger's RMSNorm, RoPE and SwiGLU kernels where the architecture has them.

    Call on the bare Hugging Face model before activation checkpointing and
    ``fully_shard`` (it rebinds module forwards; parameters are untouched, so
    a meta-device model is fine). The loss is not touched here: the fused
    linear cross-entropy lives in ``loss.CausalLMWithLoss``, so the sum-reduced
    normalisation is unchanged. Liger's RoPE patch replaces the
    ``apply_rotary_pos_emb`` of the model's transformers module for the whole
    process (Liger's own mechanism).

    Returns:
        True when kernels were applied; False (with a warning) on CPU or for an
        architecture Liger does not cover.
    """
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


def find_decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks, found generically.

    Uses the model's own ``_no_split_modules`` (the classes Hugging Face never
    splits across devices: its decoder layers); falls back to the longest
    ``nn.ModuleList`` of same-class modules.
    """
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
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


def setup_model(*, model_name_or_path: str, dist_info: DistInfo, attn_implementation: str,
                sharding_strategy: str, cpu_offload: bool, activation_checkpointing: bool,
                use_liger_kernels: bool, local_world_size: int,
                lora: LoraSettings | None = None) -> tuple[CausalLMWithLoss, ModelSetup]:
    """Build the sharded training module (model plus loss) on every rank.

    Args:
        model_name_or_path: local folder or hub id understood by ``from_pretrained``.
        dist_info: this process's place in the job.
        attn_implementation: 'auto' or a transformers attention backend.
        sharding_strategy: one of ``SHARDING_STRATEGIES``.
        cpu_offload: keep sharded parameters, gradients and optimizer state in host memory.
        activation_checkpointing: recompute each block's activations in backward.
        use_liger_kernels: Liger fused linear cross-entropy (CUDA only).
        local_world_size: processes per node (HYBRID_SHARD's shard group).
        lora: inject LoRA adapters and freeze the base weights (None: full fine-tuning).

    Returns:
        The FSDP2-wrapped ``CausalLMWithLoss`` and what was resolved.
    """
    device = dist_info.device
    attn = resolve_attn_implementation(attn_implementation, device.type)
    if cpu_offload and device.type == "cpu":
        log_rank_0("--cpu-offload has nothing to offload on CPU (FSDP2's CPUOffloadPolicy needs an "
                   "accelerator): parameters already live in host memory", level=logging.WARNING)
        cpu_offload = False
    # fp32 master weights everywhere; bf16 compute only where the hardware makes it pay.
    param_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    config = AutoConfig.from_pretrained(model_name_or_path)
    config.use_cache = False
    if dist_info.rank == 0:
        model = AutoModelForCausalLM.from_pretrained(model_name_or_path, config=config, dtype=torch.float32,
                                                     attn_implementation=attn)
        if lora is not None:
            # Adapters are initialised here, on rank 0, and reach the other ranks with the weights.
            apply_lora(model, lora)
        full_state = model.state_dict()
        real_buffers = {name: buf.clone() for name, buf in model.named_buffers()}
        # Rank 0 keeps only the state dict in host memory; the module itself is rebuilt on meta
        # so every rank runs the identical sharding code below.
        del model
    else:
        full_state, real_buffers = {}, {}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    model.generation_config.use_cache = False
    lora_config = apply_lora(model, lora) if lora is not None else None
    if use_liger_kernels:
        # Rebinds RMSNorm/SwiGLU forwards (parameters untouched) and Liger's RoPE: before AC and fully_shard.
        apply_liger_kernels(model, device_type=device.type)

    if activation_checkpointing:
        # transformers 5 renamed the public switch; 4.x only has the old name.
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    wrapper = CausalLMWithLoss(model, use_liger_kernels=use_liger_kernels)
    wrapper.lora_config = lora_config
    num_trainable, num_params = count_parameters(model)

    mesh = build_mesh(sharding_strategy, dist_info, local_world_size)
    fsdp_kwargs = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
        # SHARD_GRAD_OP keeps parameters gathered between forward and backward (ZeRO-2).
        "reshard_after_forward": sharding_strategy != "SHARD_GRAD_OP",
    }
    if cpu_offload:
        fsdp_kwargs["offload_policy"] = CPUOffloadPolicy()
    blocks = find_decoder_blocks(model)
    block_class = type(blocks[0]).__name__
    for block in blocks:
        fully_shard(block, **fsdp_kwargs)
    fully_shard(wrapper, **fsdp_kwargs)

    wrapper.to_empty(device="cpu" if cpu_offload else device)
    set_model_state_dict(
        wrapper.model,
        full_state,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=cpu_offload),
    )
    del full_state
    _broadcast_buffers(wrapper.model, real_buffers, device)

    return wrapper, ModelSetup(attn_implementation=attn, param_dtype=param_dtype, num_blocks=len(blocks),
                               block_class=block_class, mesh_shape=tuple(mesh.shape),
                               num_trainable_params=num_trainable, num_params=num_params)


def _broadcast_buffers(model: nn.Module, real_buffers: dict[str, torch.Tensor], device: torch.device) -> None:
    """Fill buffers (e.g. rotary inv_freq, often non-persistent) from rank 0's loaded model."""
    for name, buffer in model.named_buffers():
        staging = real_buffers[name].to(device) if name in real_buffers else torch.empty_like(buffer, device=device)
        dist.broadcast(staging, src=0)
        with torch.no_grad():
            buffer.copy_(staging)


def gather_full_state_dict(wrapper: CausalLMWithLoss) -> dict[str, torch.Tensor]:
    """All-gather the Hugging Face state dict into rank 0's host memory (empty on other ranks).

    ``cpu_offload`` moves each gathered tensor off the GPU as it arrives, so a
    large model never needs its full size in GPU memory.
    """
    return get_model_state_dict(wrapper.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
