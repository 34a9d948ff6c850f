"""Padding-free attention for packed rows: ``cu_seqlens`` and two registered backends.

A packed minibatch is one row of several samples; attention must stay inside
each sample. The boundaries travel as cumulative sequence lengths, computed
once per minibatch and shared by every layer::

    input_ids     [ a0 a1 a2 | b0 b1 | c0 c1 c2 c3 ]     one row, T = 9
    position_ids  [  0  1  2 |  0  1 |  0  1  2  3 ]     restart at 0 per sample
    cu_seqlens    [  0,        3,      5,          9 ]   int32, num_samples + 1
    max_seqlen    4

    attention (x = attends), block-diagonal and causal:
         a a a b b c c c c
      a  x
      a  x x
      a  x x x
      b        x
      b        x x
      c            x
      c            x x
      ...

Backends registered with transformers' ``AttentionInterface``:

* ``torch_varlen``: PyTorch's own variable-length flash attention
  (``torch.nn.attention.varlen.varlen_attn``, torch >= 2.10, CUDA). Full
  flash-attention speed without the ``flash-attn`` package.
* ``reference_varlen``: a pure-torch loop of per-sample causal SDPA, usable on
  CPU, so tests drive a whole model through the same registration path.

Neither is registered with ``AttentionMaskInterface``: transformers then builds
no mask at all for them (no O(T^2) tensor) and hands ``attention_mask=None``.
Both read the boundaries from the ``cu_seq_lens_q/k`` and ``max_length_q/k``
keyword arguments the trainer passes (``attention_inputs``), and derive them
from ``position_ids`` only when those are absent.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minitrainer.common.labels import IGNORE_INDEX
from minitrainer.common.log import log_rank_0

TORCH_VARLEN = "torch_varlen"
REFERENCE_VARLEN = "reference_varlen"
VARLEN_BACKENDS = (TORCH_VARLEN, REFERENCE_VARLEN)
FLASH_BACKENDS = ("flash_attention_2", "flash_attention_3")
BOUNDARY_BACKENDS = FLASH_BACKENDS + VARLEN_BACKENDS
"""Backends that read packed boundaries from explicit ``cu_seq_lens``/``max_length`` kwargs."""
PACKED_ATTENTION = ("sdpa", "eager") + BOUNDARY_BACKENDS
"""Every backend that honours packed boundaries without padding."""
CONTEXT_PARALLEL = "context_parallel"
"""The backend ``--context-parallel-size`` wraps around one of the varlen ones (``context_parallel.py``); it is
chosen by that flag, never by ``--attn-implementation``, and reads its shard's plan from the forward's kwargs."""

MIN_TORCH_FOR_VARLEN = (2, 10)


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sample boundaries of a packed row: a new sample starts wherever ``position_ids == 0``.

    Args:
        position_ids: [1, T] or [T] positions restarting at 0 for each sample
            (several rows are read as one flattened row).

    Returns:
        ``cu_seqlens`` (int32 [num_samples + 1] on the same device, starting at 0
        and ending at T) and ``max_seqlen``, the longest sample, as a Python int.
    """
    flat = position_ids.reshape(-1)
    starts = (flat == 0).nonzero().flatten()
    if starts.numel() == 0 or int(starts[0]) != 0:  # the row must open a sample
        starts = torch.cat([starts.new_zeros(1), starts])
    end = torch.tensor([flat.numel()], device=flat.device, dtype=starts.dtype)
    cu_seqlens = torch.cat([starts, end]).to(torch.int32)
    max_seqlen = int(cu_seqlens.diff().max())  # CPU-GPU sync point: once per minibatch
    return cu_seqlens, max_seqlen


def attention_inputs(minibatch, attn_implementation: str, device: torch.device) -> dict[str, torch.Tensor | int]:
    """The boundary kwargs the trainer passes to the model for ``attn_implementation``.

    Flash and varlen backends get explicit ``cu_seq_lens_q/k`` and
    ``max_length_q/k`` (so no layer re-derives them); sdpa and eager get
    nothing, as transformers builds their block-diagonal mask from
    ``position_ids``. A context-parallel shard (``context_parallel.shard_minibatch``)
    gets its ``context_parallel_plan`` instead.

    Args:
        minibatch: a ``sampler.Minibatch`` (``cu_seqlens`` int32 [num_samples + 1],
            ``max_seqlen`` int, ``position_ids`` [1, T]).
        attn_implementation: the resolved backend name.
        device: where the model runs.
    """
    plan = getattr(minibatch, "context_parallel_plan", None)
    if plan is not None:
        return {"context_parallel_plan": plan}
    if attn_implementation not in BOUNDARY_BACKENDS + (CONTEXT_PARALLEL,):
        return {}
    if minibatch.cu_seqlens is None:
        cu_seqlens, max_seqlen = cu_seqlens_from_position_ids(minibatch.position_ids)
    else:
        cu_seqlens, max_seqlen = minibatch.cu_seqlens, int(minibatch.max_seqlen)
    num_tokens = minibatch.position_ids.numel()
    if int(cu_seqlens[-1]) != num_tokens:  # host tensors from the collator: no device sync
        raise ValueError(f"minibatch cu_seqlens covers {int(cu_seqlens[-1])} tokens but the row has {num_tokens}")
    cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int32, non_blocking=True)
    return {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens,
            "max_length_q": max_seqlen, "max_length_k": max_seqlen}


def learned_positions(labels: torch.Tensor) -> torch.Tensor:
    """Indices of the positions of ``labels`` ([T]) that have a target, never empty (``loss.py``'s head runs
    on these alone).

    A row without any learned position (a dummy minibatch, an all-prompt row)
    keeps its first position, whose label is ``IGNORE_INDEX``: the head still
    runs on one row and adds 0, so backward reaches every block and every
    rank joins FSDP's gradient reductions, as before.
    """
    positions = labels.ne(IGNORE_INDEX).nonzero().squeeze(1)  # [N]; on a device, a CPU-GPU sync point
    return positions if positions.numel() else positions.new_zeros(1)


def model_inputs(minibatch, attn_implementation: str, device: torch.device) -> dict:
    """The forward's keyword arguments for one packed (host) minibatch, on ``device``: copies from pinned memory
    that do not wait, and what depends on the data's values (sample boundaries, learned positions) found on
    the host first, so the forward never waits to read them back."""
    positions = learned_positions(minibatch.labels.flatten())
    if device.type != "cpu":
        positions = positions.pin_memory()
    return {
        "input_ids": minibatch.input_ids.to(device, non_blocking=True),
        "position_ids": minibatch.position_ids.to(device, non_blocking=True),
        "labels": minibatch.labels.to(device, non_blocking=True),
        "learned_positions": positions.to(device, non_blocking=True),
        # Explicit cu_seqlens for flash/varlen backends: computed once per minibatch, shared by every layer.
        **attention_inputs(minibatch, attn_implementation, device),
    }


# ----------------------------------------------------------------------------
# Boundaries inside an attention call


_derived_cache: list = [None, None, None]  # [weakref(position_ids), its _version, (cu_seqlens, max_seqlen)]


def _boundaries(backend: str, cu_seq_lens_q: torch.Tensor | None, max_length_q: int | torch.Tensor | None,
                position_ids: torch.Tensor | None, num_tokens: int) -> tuple[torch.Tensor, int]:
    """Explicit boundaries when given, else derived once per ``position_ids`` tensor."""
    if cu_seq_lens_q is not None:
        if max_length_q is None:
            raise ValueError(f"{backend}: cu_seq_lens_q was passed without max_length_q")
        cu_seqlens, max_seqlen = cu_seq_lens_q.to(torch.int32), int(max_length_q)
    elif position_ids is not None:
        # Every layer receives the same position_ids tensor: derive (and sync) once, not once per layer.
        ref, version, cached = _derived_cache
        if ref is not None and ref() is position_ids and version == position_ids._version:
            cu_seqlens, max_seqlen = cached
        else:
            cu_seqlens, max_seqlen = cu_seqlens_from_position_ids(position_ids)
            _derived_cache[:] = [weakref.ref(position_ids), position_ids._version, (cu_seqlens, max_seqlen)]
    else:
        raise ValueError(f"{backend} attention needs the packed sample boundaries: pass cu_seq_lens_q/k and "
                         "max_length_q/k (attention.attention_inputs) or position_ids restarting at 0 per sample")
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2 or max_seqlen > num_tokens:
        # Shape checks only: comparing cu_seqlens[-1] with T would sync the GPU in every layer
        # (attention_inputs checks it once per minibatch on the host instead).
        raise ValueError(f"{backend}: cu_seqlens of shape {tuple(cu_seqlens.shape)} with max_length "
                         f"{max_seqlen} cannot describe a packed row of {num_tokens} tokens")
    return cu_seqlens, max_seqlen


def _check_supported(backend: str, attention_mask: torch.Tensor | None, query: torch.Tensor, dropout: float,
                     softcap: float | None, extra: dict) -> None:
    if attention_mask is not None:
        raise ValueError(f"{backend} attention is padding-free: it takes packed rows with position_ids, "
                         "not an attention_mask (use sdpa for padded batches)")
    if query.shape[0] != 1:
        raise ValueError(f"{backend} attention expects one packed row (batch size 1), got {query.shape[0]}")
    if dropout:
        raise ValueError(f"{backend} attention has no attention dropout (got {dropout}); set attention_dropout=0")
    if softcap is not None:
        raise ValueError(f"{backend} attention does not support logit softcapping")
    if extra.get("s_aux") is not None or extra.get("sinks") is not None:
        raise ValueError(f"{backend} attention does not implement attention sinks; use eager")


# ----------------------------------------------------------------------------
# The two backends (transformers' AttentionInterface contract)
#
# Both follow transformers' attention-function signature: positional
# (module, query, key, value, attention_mask), the module's own options as
# keywords, and **kwargs for whatever else the model forwards (use_cache,
# output_attentions...), which they ignore. query/key/value: [B, H, T, D];
# returns ([B, T, H, D], None).


def torch_varlen_attention_forward(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
    sliding_window: int | None = None, softcap: float | None = None, is_causal: bool | None = None,
    cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None,
    position_ids: torch.Tensor | None = None, **kwargs,
) -> tuple[torch.Tensor, None]:
    """Packed attention through ``torch.nn.attention.varlen.varlen_attn`` (flash kernel, CUDA)."""
    from torch.nn.attention.varlen import varlen_attn

    _check_supported(TORCH_VARLEN, attention_mask, query, dropout, softcap, kwargs)
    cu_seqlens, max_seqlen = _boundaries(TORCH_VARLEN, cu_seq_lens_q, max_length_q, position_ids, query.shape[2])
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    input_dtype = query.dtype
    value_dim = value.shape[-1]
    if value_dim != query.shape[-1]:
        # MLA (DeepSeek-V3, Kimi): values are narrower than queries/keys; the kernel takes one head size,
        # so values are zero-padded to it and the padding is cut from the output (as transformers does for flash).
        value = F.pad(value, (0, query.shape[-1] - value_dim))
    # The flash kernel takes fp16/bf16 only; fp32 compute (unusual on GPU) runs it in bf16.
    compute_dtype = input_dtype if input_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    # [1, H, T, D] -> [T, H, D]: undoes the projection's transpose, so usually a free view.
    q, k, v = (t.transpose(1, 2).squeeze(0).to(compute_dtype).contiguous() for t in (query, key, value))
    out = call_varlen_attn(varlen_attn, q, k, v, cu_seqlens, max_seqlen, causal=causal, scale=scaling,
                            sliding_window=sliding_window)
    return out[..., :value_dim].to(input_dtype).unsqueeze(0), None


def call_varlen_attn(varlen_attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                      max_seqlen: int, *, causal: bool, scale: float | None, sliding_window: int | None,
                      cu_seqlens_k: torch.Tensor | None = None, max_seqlen_k: int | None = None) -> torch.Tensor:
    """Adapt to ``varlen_attn``'s signature, which changed between torch releases.

    torch 2.10 takes ``is_causal`` and equal head counts; later releases take
    ``window_size`` ((-1, 0) = causal), ``scale`` and ``enable_gqa``. Keys have
    their own boundaries (``cu_seqlens_k``) only under context parallelism, where
    a segment of queries attends a longer run of keys (flash's causal mask is
    aligned at the bottom right then).
    """
    params = _varlen_params(varlen_attn)
    head_dim = q.shape[-1]
    if scale is not None and "scale" not in params and abs(scale - head_dim**-0.5) > 1e-12:
        q = q * (scale * head_dim**0.5)  # the kernel applies 1/sqrt(D); fold the model's scale into q
    kwargs: dict = {}
    if "scale" in params:
        kwargs["scale"] = scale
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if "window_size" in params:
        left = -1 if sliding_window is None else sliding_window - 1
        kwargs["window_size"] = (left, 0) if causal else (left, -1)
    else:
        if sliding_window is not None:
            raise ValueError(f"this torch ({torch.__version__}) varlen_attn has no sliding window; "
                             "use a newer torch or flash_attention_2")
        kwargs["is_causal"] = causal
    if cu_seqlens_k is None:
        cu_seqlens_k, max_seqlen_k = cu_seqlens, max_seqlen
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k, **kwargs)


_VARLEN_PARAMS: dict[int, frozenset[str]] = {}


def _varlen_params(fn) -> frozenset[str]:
    key = id(fn)
    if key not in _VARLEN_PARAMS:
        _VARLEN_PARAMS[key] = frozenset(inspect.signature(fn).parameters)
    return _VARLEN_PARAMS[key]


def reference_varlen_attention_forward(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
    sliding_window: int | None = None, softcap: float | None = None, is_causal: bool | None = None,
    cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None,
    position_ids: torch.Tensor | None = None, **kwargs,
) -> tuple[torch.Tensor, None]:
    """Packed attention as one causal SDPA per sample: slow, exact, runs anywhere."""
    _check_supported(REFERENCE_VARLEN, attention_mask, query, dropout, softcap, kwargs)
    cu_seqlens, _ = _boundaries(REFERENCE_VARLEN, cu_seq_lens_q, max_length_q, position_ids, query.shape[2])
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    return varlen_reference(query, key, value, cu_seqlens, scale=scaling, causal=causal,
                            sliding_window=sliding_window).transpose(1, 2), None


def varlen_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, *,
                     scale: float | None = None, causal: bool = True,
                     sliding_window: int | None = None) -> torch.Tensor:
    """Per-sample SDPA over ``cu_seqlens``.

    Args:
        query: [B, Hq, T, D]; key: [B, Hkv, T, D]; value: [B, Hkv, T, Dv] with Hq a multiple of Hkv
            (Dv != D in multi-head latent attention).
        cu_seqlens: [num_samples + 1] boundaries along T.

    Returns:
        [B, Hq, T, Dv].
    """
    out = query.new_empty(*query.shape[:-1], value.shape[-1])
    bounds = cu_seqlens.tolist()  # CPU-GPU sync point (reference only)
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end]
        mask = None
        if sliding_window is not None:
            pos = torch.arange(end - start, device=query.device)
            offset = pos[:, None] - pos[None, :]  # query minus key position
            mask = offset < sliding_window
            if causal:
                mask &= offset >= 0
        out[:, :, start:end] = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1])
    return out


# ----------------------------------------------------------------------------
# What an architecture's attention needs, and which backends honour it


@dataclass(frozen=True)
class AttentionNeeds:
    """What a model's attention asks of a backend, read from the (meta) model and its config."""

    model_class: str
    supports_sdpa: bool         # the model class's own ``_supports_sdpa``
    supports_flash: bool        # ``_supports_flash_attn``
    softcap: float | None       # ``config.attn_logit_softcapping``: tanh cap on attention scores
    sinks: bool                 # learned per-head sink logits (a ``sinks`` parameter in attention modules)
    sliding_window: int | None  # ``config.sliding_window`` (honoured by every backend offered here)
    attention_chunk_size: int | None = None  # Llama-4's chunked attention: no key before the query's chunk


def attention_needs(model: nn.Module) -> AttentionNeeds:
    """Read ``AttentionNeeds`` from a built model (the meta-device one is enough)."""
    config = model.config.get_text_config()  # a multimodal model trains its text model's attention
    sinks = any(isinstance(getattr(module, "sinks", None), nn.Parameter) for module in model.modules())
    window = getattr(config, "sliding_window", None)
    chunk = getattr(config, "attention_chunk_size", None)
    return AttentionNeeds(model_class=type(model).__name__, supports_sdpa=bool(getattr(model, "_supports_sdpa", False)),
                          supports_flash=bool(getattr(model, "_supports_flash_attn", False)),
                          softcap=getattr(config, "attn_logit_softcapping", None), sinks=sinks,
                          sliding_window=window if isinstance(window, int) else None,
                          attention_chunk_size=chunk if isinstance(chunk, int) else None)


def backend_refusal(backend: str, needs: AttentionNeeds) -> str | None:
    """Why ``backend`` would not compute this model's attention faithfully, or None when it does.

    eager is the model's own code and honours everything. sdpa is refused
    where the model class refuses it (softcapping, sinks). Flash kernels get
    no sinks through transformers' flash-attn 2/3 path (it drops them), the
    varlen backends here implement neither sinks, softcapping nor chunked attention.
    """
    name = needs.model_class
    if backend == "eager":
        return None
    if backend == "sdpa":
        return None if needs.supports_sdpa else f"{name} does not support sdpa"
    if needs.sinks:
        return f"{backend} does not implement {name}'s attention sinks"
    if backend in FLASH_BACKENDS:
        return None if needs.supports_flash else f"{name} does not support flash attention"
    if needs.softcap is not None:
        return f"{backend} does not implement {name}'s attention logit softcapping"
    if needs.attention_chunk_size is not None:
        return f"{backend} does not implement {name}'s chunked attention"
    return None


# ----------------------------------------------------------------------------
# Registration and availability


def register_attention_backends() -> None:
    """Register ``torch_varlen`` and ``reference_varlen`` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(TORCH_VARLEN, torch_varlen_attention_forward)
    AttentionInterface.register(REFERENCE_VARLEN, reference_varlen_attention_forward)


def torch_varlen_unavailable_reason() -> str | None:
    """Why ``torch_varlen`` cannot run in this torch build, or None when it can (CUDA still required)."""
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if version < MIN_TORCH_FOR_VARLEN:
        return f"torch {torch.__version__} has no varlen_attn (needs torch >= 2.10)"
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError as err:
        return f"torch.nn.attention.varlen does not import ({err})"
    return None


def flash_attn_unavailable_reason(name: str) -> str | None:
    """Why the flash-attn package behind ``name`` does not import, or None when it does."""
    module = "flash_attn_interface" if name == "flash_attention_3" else "flash_attn"
    try:
        __import__(module)
    except ImportError as err:
        return f"{module} does not import ({err})"
    return None


# ----------------------------------------------------------------------------
# Choosing the backend


def resolve_attn_implementation(requested: str, device_type: str, needs: AttentionNeeds | None = None) -> str:
    """Pick the attention backend for padding-free packed rows, and say why in one line.

    'auto' -> the first backend, in speed order for the device, that the
    architecture accepts (``attention.backend_refusal``) and that is available:
    on CUDA ``flash_attention_2`` (flash_attn imports), ``torch_varlen``
    (PyTorch's varlen flash kernel, torch >= 2.10), ``sdpa``, ``eager``; on CPU
    ``sdpa``, ``eager``. Every candidate honours packed boundaries without
    padding: sdpa/eager through transformers' block-diagonal mask built from
    ``position_ids`` (O(T^2) memory), flash and varlen backends through explicit
    ``cu_seqlens``. An explicit choice the architecture refuses, or that cannot
    honour packed boundaries, is a one-line error naming the accepted ones; a
    GPU-only backend asked for on CPU falls back to auto with a warning.

    Args:
        needs: what the model's attention needs (``attention.attention_needs``);
            None accepts every backend (no model at hand).
    """
    register_attention_backends()
    gpu_only = FLASH_BACKENDS + (TORCH_VARLEN,)
    refusal = (lambda name: None) if needs is None else (lambda name: backend_refusal(name, needs))
    if requested == "auto":
        candidates = (("flash_attention_2", TORCH_VARLEN, "sdpa", "eager") if device_type == "cuda"
                      else ("sdpa", "eager"))
        skipped = []
        for name in candidates:
            why_not = refusal(name) or backend_unavailable_reason(name)
            if why_not is None:
                reason = "; ".join(skipped) or ("fastest packed backend on " + device_type)
                level = logging.WARNING if device_type == "cuda" and name in ("sdpa", "eager") else logging.INFO
                log_rank_0(f"attention: {name} ({reason})", level=level)
                return name
            skipped.append(f"not {name}: {why_not}")
        raise AssertionError("eager accepts every architecture")
    error = explicit_attention_refusal(requested, needs)
    if error is not None:
        raise ValueError(error)
    if requested in gpu_only and device_type != "cuda":
        fallback = resolve_attn_implementation("auto", device_type, needs)
        log_rank_0(f"--attn-implementation {requested} needs a GPU: using {fallback} on {device_type}",
                   level=logging.WARNING)
        return fallback
    missing = backend_unavailable_reason(requested)
    if missing is not None:
        raise ValueError(f"--attn-implementation {requested}: {missing}. Use --attn-implementation auto, or "
                         "install the CUDA extras (pip install -r requirements-cuda.txt)")
    return requested


def explicit_attention_refusal(requested: str, needs: AttentionNeeds | None) -> str | None:
    """The one-line error for an explicit backend that cannot serve packed rows of this architecture, or None."""
    refusal = (lambda name: None) if needs is None else (lambda name: backend_refusal(name, needs))
    accepted = ", ".join(name for name in PACKED_ATTENTION if refusal(name) is None)
    if requested not in PACKED_ATTENTION:
        return (f"--attn-implementation {requested!r} cannot honour packed sequence boundaries "
                f"without padding; choose one of auto, {accepted}")
    why_not = refusal(requested)
    if why_not is not None:
        return f"--attn-implementation {requested}: {why_not}; this model accepts auto, {accepted}"
    return None


def backend_unavailable_reason(name: str) -> str | None:
    if name in FLASH_BACKENDS:
        return flash_attn_unavailable_reason(name)
    if name == TORCH_VARLEN:
        return torch_varlen_unavailable_reason()
    return None
