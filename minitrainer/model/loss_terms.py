"""The model's own loss terms, read from the model: logit processing and the MoE router loss.

``loss.CausalLMWithLoss`` runs the decoder and computes the cross-entropy on
hidden states itself (chunked or fused, never the full fp32 logits), so it
must re-apply whatever the architecture's ``forward`` does between its LM head
and its loss. Both pieces are derived from the loaded model, not from a list
of model names:

* ``LogitTransform``: the config attributes that causal-LM forwards in
  transformers apply to the logits (``LOGIT_CONFIG_ATTRIBUTES``);
* ``RouterLoss``: the load-balancing (router auxiliary) loss that MoE forwards
  add when ``config.output_router_logits`` is set, with the model's own
  ``num_experts``, ``num_experts_per_tok`` and ``router_aux_loss_coef``.

An architecture whose forward does something not covered here is caught by
the start-up self-check (``selfcheck.py``), which compares the trainer's loss
with the model's own ``forward(labels=...)``.

Router loss on packed rows: transformers' ``load_balancing_loss_func`` on one
unpadded sample is ``E * sum_e f_e * P_e`` with ``f_e`` the share of the
sample's top-k assignments (over all layers) going to expert ``e`` and ``P_e``
the mean router probability of ``e`` over the sample's tokens and layers. It
is not additive over tokens, so its value on a packed row depends on what was
packed with what. The trainer therefore optimises, per optimizer batch::

    sum(token CE) / loss tokens  +  router_aux_loss_coef * mean over samples of aux(sample)

where ``aux(sample)`` is exactly the ``aux_loss`` the model's own forward
returns for that sample alone. For a batch of one sample this is the model's
``forward(input_ids, labels=...).loss``; for any batch it does not depend on
packing, ranks or minibatches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from minitrainer.common import fault_injection

LOGIT_CONFIG_ATTRIBUTES = {
    # attribute: how the model's forward applies it to ``lm_head(hidden)``
    "logits_scaling": "divide",          # Granite, GraniteMoE: logits / logits_scaling
    "logit_scale": "multiply",           # Cohere, Cohere2: logits * logit_scale
    "final_logit_softcapping": "softcap",  # Gemma-2/3: cap * tanh(logits / cap), after any scaling
}
"""Config attributes a causal LM's forward applies to its logits before the loss."""



@dataclass(frozen=True)
class LogitTransform:
    """``logits -> softcap * tanh(scale * logits / softcap)`` (no cap when ``softcap`` is None)."""

    scale: float = 1.0
    softcap: float | None = None
    sources: tuple[str, ...] = ()

    @property
    def is_identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def describe(self) -> str:
        if self.is_identity:
            return "none"
        parts = [f"x {self.scale:g}"] if self.scale != 1.0 else []
        if self.softcap is not None:
            parts.append(f"softcap {self.softcap:g}")
        return ", ".join(parts) + f" (from config {', '.join(self.sources)})"


def logit_transform(model: nn.Module) -> LogitTransform:
    """The logit processing ``model``'s forward applies, read from its config (``LOGIT_CONFIG_ATTRIBUTES``)."""
    config = model.config.get_text_config()  # a multimodal model's logit processing is its text model's
    scale, softcap, sources = 1.0, None, []
    for attribute, kind in LOGIT_CONFIG_ATTRIBUTES.items():
        value = getattr(config, attribute, None)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        value = float(value)
        if kind == "divide" and value != 1.0:
            scale /= value
        elif kind == "multiply" and value != 1.0:
            scale *= value
        elif kind == "softcap" and value > 0:
            softcap = value
        else:
            continue
        sources.append(f"{attribute}={value:g}")
    if fault_injection.drops_logit_scale():
        scale = 1.0
    return LogitTransform(scale=scale, softcap=softcap, sources=tuple(sources))


@dataclass(frozen=True)
class RouterLoss:
    """The MoE load-balancing loss the model's forward adds: ``coef * aux``."""

    coef: float
    num_experts: int
    top_k: int


def router_loss(model: nn.Module) -> RouterLoss | None:
    """The router loss ``model``'s forward adds to its loss, or None when it adds none.

    The forward adds it when ``config.output_router_logits`` is true; it then
    reads ``num_experts``, ``num_experts_per_tok`` and ``router_aux_loss_coef``
    from the causal-LM module, which is where this reads them too.
    """
    if not getattr(model.config.get_text_config(), "output_router_logits", False):
        return None
    missing = [name for name in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")
               if not hasattr(model, name)]
    if missing:
        raise ValueError(f"{type(model).__name__}: config.output_router_logits is set but the model has no "
                         f"{', '.join(missing)}; the trainer cannot reproduce its router loss. Set "
                         "output_router_logits=false in config.json, or train without this architecture's router loss")
    return RouterLoss(coef=float(model.router_aux_loss_coef), num_experts=int(model.num_experts),
                      top_k=int(model.num_experts_per_tok))


def router_aux_sum(router_logits: tuple[torch.Tensor, ...], cu_seqlens: torch.Tensor, *, num_experts: int,
                   top_k: int) -> torch.Tensor:
    """Sum over the samples of a packed row of each sample's own load-balancing loss.

    Per sample, identical to transformers' ``load_balancing_loss_func`` on that
    sample alone (no attention mask): the same softmax in the logits' dtype,
    the same top-k, fp32 sums.

    Args:
        router_logits: one [T, E] tensor per MoE layer, for the packed row.
        cu_seqlens: [num_samples + 1] sample boundaries along T.
    """
    device = router_logits[0].device
    num_tokens = router_logits[0].shape[0]
    cu_seqlens = cu_seqlens.to(device=device, dtype=torch.long)
    num_segments = cu_seqlens.numel() - 1
    segment = torch.searchsorted(cu_seqlens[1:], torch.arange(num_tokens, device=device), right=True)
    counts = torch.zeros(num_segments, num_experts, dtype=torch.float32, device=device)
    prob_sums = torch.zeros(num_segments, num_experts, dtype=torch.float32, device=device)
    for layer_logits in router_logits:
        probs = torch.softmax(layer_logits, dim=-1)
        _, selected = torch.topk(probs, top_k, dim=-1)  # [T, k]
        flat = (segment[:, None] * num_experts + selected).reshape(-1)
        counts.view(-1).index_add_(0, flat, torch.ones(flat.numel(), dtype=torch.float32, device=device))
        prob_sums = prob_sums.index_add(0, segment, probs.float())
    rows = (cu_seqlens.diff().float() * len(router_logits)).clamp(min=1).unsqueeze(1)
    per_sample = (counts / rows * (prob_sums / rows)).sum(dim=1) * num_experts
    return per_sample.sum()


def router_aux_weight(router: RouterLoss | None, *, batch_num_loss_counted_tokens: int, batch_num_samples: int,
                      minibatch_num_samples: int) -> float:
    """Weight of a minibatch's router-loss sum inside the summed token loss the trainer divides.

    The trainer divides the summed loss by the batch's loss-token count N; the
    router term must come out as ``coef * sum(aux) / num_samples``, so its sum
    is weighted by ``coef * N / num_samples``. Dummy minibatches (no real
    samples) weigh 0.
    """
    if router is None or minibatch_num_samples == 0 or batch_num_samples == 0:
        return 0.0
    return router.coef * max(batch_num_loss_counted_tokens, 1) / batch_num_samples
