"""QLoRA: the frozen base weights of LoRA-adapted linear layers stored as NF4, through torchao.

    torchrun --nproc-per-node=2 train.py ... --lora-rank 16 --lora-quantize-data-type nf4

NF4 is the QLoRA paper's block-wise 4-bit NormalFloat: every block of 64
weights keeps 4-bit indices into 16 normal quantiles plus one absmax scale, and
the scales are themselves quantized to int8 in blocks of 256 ("double
quantization"), about 0.52 bytes per weight in all. torchao's ``NF4Tensor``
implements it as a tensor subclass that FSDP2 shards and all-gathers as is
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` move only the quantized
bytes) and that dequantizes in ``F.linear``, so peft's ``lora.Linear`` keeps
working unchanged on top of it::

    q_proj.base_layer.weight          NF4Tensor, frozen, [out, in], dtype = compute dtype
    q_proj.lora_A.default.weight      fp32, trainable, [r, in]
    q_proj.lora_B.default.weight      fp32, trainable, [out, r]

Only the base layers of adapted ``nn.Linear`` modules are quantized:
embeddings, norms and the LM head stay as they are. A weight is quantized
only when its FSDP shards split into whole double-quantization groups
(``NF4_GROUP`` = 64 x 256 weights per shard, out_features divisible by the
shard count); any other stays in full precision, frozen, and is counted in
the startup log (a handful of small projections at most on real models).

Loading follows ``setup/model.py``: rank 0 quantizes each weight as it holds
the loaded model (the full-precision copy exists only there, one weight at a
time in the compute dtype), then broadcasts the quantized bytes weight by
weight; each rank keeps its own rows.
"""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from minitrainer.common.log import log_rank_0
from minitrainer.methods.base import ModelBuild
from minitrainer.methods.lora import LoRA, LoraSettings, adapted_meta_model

NF4 = "nf4"
QUANTIZE_DATA_TYPES = ("none", NF4)
NF4_BLOCK_SIZE = 64  # weights per absmax scale (QLoRA paper)
NF4_SCALER_BLOCK_SIZE = 256  # scales per int8 double-quantization group (QLoRA paper)
NF4_GROUP = NF4_BLOCK_SIZE * NF4_SCALER_BLOCK_SIZE
_WAY_OUT = "use --lora-quantize-data-type none (LoRA on the full-precision base)"


@dataclass(frozen=True)
class QuantizeReport:
    """What ``quantize_base_weights`` did, for the startup log."""

    num_quantized: int
    num_kept: int
    kept_names: tuple[str, ...]
    num_quantized_elements: int
    num_full_bytes: int  # the quantized weights' bytes in the compute dtype
    num_nf4_bytes: int   # the same weights as NF4 (data + scales)


def _nf4_module():
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError as err:
        raise ImportError("--lora-quantize-data-type nf4 needs torchao: pip install 'torchao>=0.18'") from err
    return nf4_tensor


def is_nf4(tensor: torch.Tensor) -> bool:
    """True for a torchao ``NF4Tensor`` (a DTensor's local shard included); never imports torchao."""
    local = getattr(tensor, "_local_tensor", tensor)
    return type(local).__name__ == "NF4Tensor"


def nf4_refusal(shape: torch.Size, shard_size: int) -> str | None:
    """Why a weight of ``shape`` cannot be NF4 when sharded ``shard_size`` ways along dim 0, or None."""
    if len(shape) != 2:
        return f"{len(shape)}-D"
    if shape[0] % shard_size:
        return f"{shape[0]} rows do not split {shard_size} ways"
    if (shape[0] * shape[1]) % (NF4_GROUP * shard_size):
        return f"{shape[0]}x{shape[1]} is not a multiple of {NF4_GROUP} weights per shard"
    return None


def fused_experts(model: nn.Module) -> list[str]:
    """Names of 3-D parameters (MoE experts fused into one tensor, transformers 5), which NF4 cannot hold."""
    return [name for name, param in model.named_parameters() if param.dim() == 3]


def quantize_base_weights(model: nn.Module, *, shard_size: int, dtype: torch.dtype,
                          device: torch.device | None = None) -> QuantizeReport:
    """Replace the base weight of every adapted ``nn.Linear`` by an NF4 copy, in place.

    Call after ``lora.apply_lora``. Works on a meta-device model too (the NF4
    tensors are then meta as well and only fix shapes for ``fully_shard``).

    Args:
        model: the model with peft's adapters injected.
        shard_size: ranks each weight is sharded across (the FSDP mesh's shard dimension).
        dtype: the compute dtype; weights are cast to it before quantization, and
            dequantize to it (bf16 on GPU, fp32 on CPU).
        device: where to compute the quantization, one weight at a time (the NF4
            result returns to the weight's own device). On CPU torchao's nearest-level
            search runs at roughly 4M weights/s per core: a 70B base would take hours,
            so rank 0 quantizes on its GPU when it has one.

    Raises:
        ValueError: one line naming the way out, when the model has fused 3-D
            experts or no adapted linear layer can be quantized.
    """
    to_nf4 = _nf4_module().to_nf4
    experts = fused_experts(model)
    if experts:
        raise ValueError(f"--lora-quantize-data-type nf4: {type(model).__name__} stores its MoE experts as fused "
                         f"3-D parameters ({experts[0]}, ...), which NF4 cannot quantize; {_WAY_OUT}")
    quantized, kept = 0, []
    num_elements = num_full_bytes = num_nf4_bytes = 0
    for name, module in model.named_modules():
        if not hasattr(module, "lora_A"):
            continue
        base = module.get_base_layer()
        if not isinstance(base, nn.Linear) or is_nf4(base.weight):
            continue
        if nf4_refusal(base.weight.shape, shard_size) is not None:
            kept.append(name)
            continue
        home = base.weight.device
        with torch.no_grad():
            nf4 = to_nf4(base.weight.detach().to(device=device or home, dtype=dtype), NF4_BLOCK_SIZE,
                         NF4_SCALER_BLOCK_SIZE).to(home)  # NF4Tensor.to(device) keeps it NF4
        # Assigning the Parameter drops the full-precision tensor: one weight at a time is ever doubled.
        base.weight = nn.Parameter(nf4, requires_grad=False)
        quantized += 1
        num_elements += nf4.numel()
        num_full_bytes += nf4.numel() * nf4.element_size()
        num_nf4_bytes += sum(t.numel() * t.element_size() for t in
                             (nf4.quantized_data, nf4.quantized_scalers, nf4.quantization_factor, nf4.scaler_mean))
    if not quantized:
        why = (f"none of its {len(kept)} adapted linear layers splits into whole {NF4_GROUP}-weight NF4 groups "
               f"per shard across {shard_size} ranks ({kept[0]})" if kept else "no adapted linear layer to quantize")
        raise ValueError(f"--lora-quantize-data-type nf4: {type(model).__name__}: {why}; {_WAY_OUT}, "
                         "or adapt other --lora-target-modules")
    return QuantizeReport(num_quantized=quantized, num_kept=len(kept), kept_names=tuple(kept),
                          num_quantized_elements=num_elements, num_full_bytes=num_full_bytes, num_nf4_bytes=num_nf4_bytes)


def pop_nf4(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove and return the NF4 entries of a state dict (they travel by ``broadcast_nf4``)."""
    return {name: state.pop(name) for name in [n for n, t in state.items() if is_nf4(t)]}


def broadcast_nf4(model: nn.Module, full_nf4: dict[str, torch.Tensor], *, device: torch.device) -> None:
    """Fill every NF4 shard of the ``fully_shard``-ed ``model`` from rank 0's full NF4 tensors.

    Collective: every rank calls it, rank 0 with ``full_nf4`` (``pop_nf4`` of its
    loaded state dict), the others with ``{}``. One weight at a time, rank 0
    broadcasts the quantized bytes and scales (about 0.52 bytes per weight);
    each rank copies its rows into its shard. ``torch.chunk`` along dim 0 is
    how ``fully_shard`` cut the shards, and ``nf4_refusal`` made every cut fall
    on a double-quantization group boundary, so the bytes split the same way.
    """
    from torch.distributed.tensor import DTensor

    for name, param in model.named_parameters():
        if not is_nf4(param):
            continue
        if isinstance(param, DTensor):
            local = param._local_tensor  # NF4Tensor, [out / shard_size, in]
            group = param.device_mesh.get_group(param.device_mesh.ndim - 1)  # the shard dimension
            shard_size, shard_rank = dist.get_world_size(group), dist.get_rank(group)
        else:
            local, shard_size, shard_rank = param, 1, 0  # left whole (FSDP2's ignored_params)
        pieces = {}
        for attr in ("quantized_data", "quantized_scalers", "quantization_factor"):
            shard = getattr(local, attr)
            full = (getattr(full_nf4[name], attr).to(device) if name in full_nf4
                    else torch.empty(shard.numel() * shard_size, dtype=shard.dtype, device=device))
            dist.broadcast(full, src=0)
            pieces[attr] = full.chunk(shard_size)[shard_rank]
        # The scalar mean of the scales and the 16-entry NF4 code book are shared by all shards;
        # ``to_empty`` re-allocates only the sharded tensors and leaves these two on the meta device.
        for attr in ("scaler_mean", "nf4"):
            shared = getattr(local, attr)
            value = (getattr(full_nf4[name], attr).to(device) if name in full_nf4
                     else torch.empty(shared.shape, dtype=shared.dtype, device=device))
            dist.broadcast(value, src=0)
            setattr(local, attr, value)
        with torch.no_grad():
            for attr, piece in pieces.items():
                getattr(local, attr).copy_(piece)


def gather_dequantized_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of a sharded QLoRA model in rank 0's host memory (empty elsewhere), NF4
    weights dequantized. Each rank dequantizes its own NF4 shard (a shard holds whole NF4 groups, see
    ``quantize_base_weights``, so its rows equal those of the dequantized whole) and the dense rows
    are gathered like any other DTensor. Gathering the NF4 DTensors themselves goes through
    torchao's asynchronous all-gathers, which are left unwaited and, on gloo, crashed a rank now
    and then mid-export."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    is_main = not dist.is_initialized() or dist.get_rank() == 0
    sharded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    full = {}
    for name, tensor in sharded.items():  # the same order on every rank: one collective per DTensor
        if isinstance(tensor, DTensor):
            if is_nf4(tensor):
                tensor = DTensor.from_local(tensor.to_local().get_original_weight(), tensor.device_mesh,
                                            tensor.placements, run_check=False, shape=tensor.shape,
                                            stride=tensor.stride())
            tensor = tensor.full_tensor()
        elif is_nf4(tensor):
            tensor = tensor.get_original_weight()
        if is_main:
            full[name] = tensor.detach().cpu()
    return full


def qlora_preflight(model_config, settings: LoraSettings, *, shard_size: int = 1) -> str | None:
    """Adapt and quantize a meta-device copy of the architecture: the error line, or None. ``shard_size`` is
    the FSDP shard group's size, which decides which weights split into whole NF4 groups."""
    try:
        quantize_base_weights(adapted_meta_model(model_config, settings), shard_size=shard_size, dtype=torch.float32)
    except (ValueError, ImportError) as err:  # ImportError: torchao missing (_nf4_module names the install)
        return str(err)
    return None


class QLoRA(LoRA):
    """LoRA on an NF4 base (module docstring): rank 0 quantizes, every rank holds NF4 shards, exports
    dequantize."""

    def fingerprint(self) -> dict:
        # The base's rounding changes every loss: a LoRA checkpoint is not a QLoRA one.
        return {"lora": self.fingerprint_fields() + [self.settings.quantize_data_type]}

    def preflight(self, model_config, *, meta_model, shard_size: int) -> str | None:
        return qlora_preflight(model_config, self.settings, shard_size=shard_size)

    def convert(self, model: nn.Module, build: ModelBuild) -> None:
        super().convert(model, build)
        # Meta NF4 shells with the shapes fully_shard cuts; broadcast_nf4 fills them.
        quantize_base_weights(model, shard_size=build.shard_size, dtype=build.param_dtype)

    def ignored_params(self, model: nn.Module, build: ModelBuild) -> set[nn.Parameter]:
        if build.shard_size > 1:
            return set()
        # Workaround: with a shard group of one rank (NO_SHARD, or a single process) FSDP2 skips the
        # all-gather and assumes one all-gather input per parameter, but an NF4 weight has three
        # (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, ``world_size == 1``). Every
        # rank holds whole weights there anyway, so FSDP2 simply leaves the frozen NF4 weights alone.
        return {param for param in model.parameters() if is_nf4(param)}

    def convert_loaded(self, model: nn.Module, build: ModelBuild) -> None:
        super().convert_loaded(model, build)
        # Rank 0 alone quantizes, weight by weight; the other ranks only ever see NF4 bytes.
        began = time.perf_counter()
        report = quantize_base_weights(model, shard_size=build.shard_size, dtype=build.param_dtype,
                                       device=build.device)
        log_rank_0(f"QLoRA: {report.num_quantized} base weights in NF4 ({report.num_full_bytes / 2**20:.1f} MiB "
                   f"in {str(build.param_dtype).removeprefix('torch.')} -> {report.num_nf4_bytes / 2**20:.1f} MiB) "
                   f"on {build.device.type} in {time.perf_counter() - began:.1f}s; rank 0 peak host memory "
                   f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB after loading")
        if report.num_kept:
            log_rank_0(f"QLoRA: {report.num_kept} adapted linear layers stay in full precision (frozen): their "
                       f"shards do not split into whole NF4 groups ({', '.join(report.kept_names[:3])}, ...)",
                       level=logging.WARNING)

    def weights_it_fills(self, model: nn.Module) -> set[str]:
        return {name for name, param in model.named_parameters() if is_nf4(param)}

    def hold_back(self, model: nn.Module, full_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return pop_nf4(full_state)

    def fill(self, model: nn.Module, held: dict[str, torch.Tensor], build: ModelBuild) -> None:
        broadcast_nf4(model, held, device=build.weights_device)

    def gather_full_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return gather_dequantized_state(model)
