"""Start-up checks that the user's data and the trainer's objective fit the model.

* ``check_data_fits_model`` (rank 0, before the model is built): every token id
  in the data is below the model's vocabulary size, and the tokenizer
  ``process_data.py`` recorded in its ``summary.json`` agrees with the model's
  (refused in one line naming both otherwise, unless ``--allow-tokenizer-mismatch``).
  A bad id would otherwise end in an index error deep inside the forward pass
  (a device-side assert on GPU); an id of another vocabulary trains silently wrong.
* ``audit_refusal`` (rank 0, as each source loads): data whose ``summary.json``
  records a failed label audit is refused in one line, unless the failure was
  allowed when it was tokenized (``--allow-audit-failures``).
* ``check_loss_terms`` (every rank, before the first step): on a few real rows
  (the shortest; a window of ``MAX_ROW_TOKENS`` of a longer one), one at a time and
  unpacked, the trainer's loss (``loss.CausalLMWithLoss``: decoder, chunked or
  fused cross-entropy, the model's logit processing and router loss as
  ``model/loss_terms.py`` reads them) equals the Hugging Face model's own
  ``forward(input_ids, labels=...).loss``. Both run through the same sharded
  module in the same compute dtype, so for a 70B model it costs a few forward
  passes of short rows: seconds. The same rows packed into one row must give
  the sum of their losses alone: attention keeps packed samples apart. Every rank runs the same rows (FSDP gathers
  collectively) and reaches the same verdict; ``--skip-objective-check`` skips it.
  The trainer's loss is the LM head applied to the decoder's output; a model whose
  forward runs more between the two (the masked-LM prediction head of the
  BERT-style encoders transformers also registers as causal LMs) is stopped
  with that reason, read from what its own forward fed the head
  (``head_input``), not with a shape error or an unexplained loss gap.
* ``check_scores`` (every rank, before the first step, in place of ``check_loss_terms`` for a reward model,
  ``model/score_head.py``): on a few real sequences, each cut right after its last learned token, the trainer's
  score (the decoder, then the score head at that token) equals the Hugging Face sequence classifier's own pooled
  score, each alone and packed into one row. A pad token that is also the sequences' last learned token is named:
  transformers' pooling would read the token before it, so the export would score differently from training.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from minitrainer.common.commands import command
from minitrainer.common.distributed import reshard
from minitrainer.common.labels import IGNORE_INDEX
from minitrainer.common.log import log_rank_0
from minitrainer.model.attention import attention_inputs
from minitrainer.model.loss import decoder_of
from minitrainer.model.loss_terms import router_aux_weight
from minitrainer.model.score_head import last_learned_index

NUM_ROWS = 3
MAX_ROW_TOKENS = 256
MIN_LOSS_TOKENS = 4
RELATIVE_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8, torch.bfloat16: 2e-2, torch.float16: 5e-3}
"""Largest relative loss difference accepted per compute dtype: a few roundings of the loss's
reductions, far below what a skipped logit scale or router loss costs on a real checkpoint."""


# ----------------------------------------------------------------------------
# Data against model


def check_data_fits_model(dataset, data_path: str, model_name: str, model_config, *,
                          trust_remote_code: bool = False, allow_tokenizer_mismatch: bool = False) -> str | None:
    """Rank 0: an error line when a token id is out of the model's vocabulary, or when the data was
    tokenized with a tokenizer that differs from the model's (a warning instead with ``allow_tokenizer_mismatch``).

    Args:
        dataset: a ``sampler.TokenizedDataset``; the ``summary.json`` beside its file records the tokenizer.
        data_path: the ``--data-path`` source, as the user named it (for messages).
        model_name: the model's ``--model-name-or-path``.
        model_config: its config (``AutoConfig``), loaded once at start-up.
    """
    from transformers import AutoTokenizer

    vocab_size = getattr(model_config.get_text_config(), "vocab_size", None) or model_config.vocab_size
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        tokenizer = None  # a bare model folder: nothing to compare the recorded tokenizer with
    except TypeError as err:  # files of one tokenizer class under a config that names another (HyperCLOVAX)
        return (f"{model_name}: its tokenizer does not load ({type(err).__name__}: {str(err).splitlines()[0]}); "
                "every export saves it: give the checkpoint its own tokenizer files")

    max_id = dataset.max_token_id()
    if max_id is not None and max_id >= vocab_size:
        return (f"--data-path {data_path} holds token id {max_id}, but {model_name} has a vocabulary of "
                f"{vocab_size}: the data was tokenized for another model. Re-run "
                f"{command('minitrainer.data.process_data')} with --model-name-or-path {model_name}")
    recorded = (recorded_summary(Path(dataset.path)) or {}).get("tokenizer")
    if recorded is None or tokenizer is None:
        return None
    ours = {"num_tokens": len(tokenizer), "eos_token": tokenizer.eos_token, "bos_token": tokenizer.bos_token}
    differs = [f"{key} {recorded.get(key)!r} vs {value!r}" for key, value in ours.items()
               if key in recorded and recorded[key] != value]
    if differs:
        problem = (f"--data-path {data_path} was tokenized with {recorded.get('name_or_path')!r} but the model is "
                   f"{model_name!r}, and their tokenizers differ ({'; '.join(differs)}): the model would learn from "
                   "ids that mean something else to it")
        if not allow_tokenizer_mismatch:
            return (f"{problem}. Tokenize it with this model's tokenizer ({command('minitrainer.data.process_data')} "
                    f"--model-name-or-path {model_name}, or train on the raw file), or pass --allow-tokenizer-mismatch")
        log_rank_0(f"{problem}; training anyway (--allow-tokenizer-mismatch)", level=logging.WARNING)
    elif recorded.get("name_or_path") != model_name:
        log_rank_0(f"the data was tokenized with {recorded.get('name_or_path')!r}, the model is {model_name!r}: "
                   "their tokenizers agree in size and special tokens")
    return None


def audit_refusal(dataset, data_path: str, *, allowed_now: bool = False) -> str | None:
    """Rank 0: one line when the ``summary.json`` beside ``dataset``'s file records a failed label audit
    that was not allowed when it was tokenized (``process_data.py --allow-audit-failures``); a warning when
    it was. ``allowed_now``: train.py tokenized it itself, under this run's ``--allow-audit-failures``."""
    summary = recorded_summary(Path(dataset.path)) or {}
    audit = summary.get("audit")
    if not isinstance(audit, dict) or audit.get("passed", True):
        return None
    rules = "; ".join(audit.get("broken_rules") or ["no rule recorded"])
    if allowed_now or (summary.get("config") or {}).get("allow_audit_failures"):
        log_rank_0(f"--data-path {data_path}: its label audit failed ({rules}) and that was allowed when it was "
                   "tokenized (--allow-audit-failures): training on it", level=logging.WARNING)
        return None
    return (f"--data-path {data_path}: its label audit failed when it was tokenized ({rules}); fix the masking "
            "(docs/data.md#the-label-audit) or, to train on it anyway, tokenize it with --allow-audit-failures "
            "(process_data.py, or train.py on the raw file)")


def recorded_summary(data_path: Path) -> dict | None:
    """The ``summary.json`` process_data.py wrote beside the data (a folder's, or ``F.summary.json``), if any."""
    if data_path.is_dir():
        candidates = [data_path / "summary.json"]
    else:
        candidates = [data_path.with_name(data_path.stem + ".summary.json"), data_path.parent / "summary.json"]
    for path in candidates:
        if path.is_file():
            try:
                summary = json.loads(path.read_text())
            except (OSError, ValueError):
                return None
            return summary if isinstance(summary, dict) else None
    return None


# ----------------------------------------------------------------------------
# Trainer objective against the model's own forward


@dataclass(frozen=True)
class Window:
    """Tokens ``[start, stop)`` of data row ``index``, checked as a row of their own: both losses see the
    same tokens, so a window of a long row tests the objective as well as a whole short row does."""

    index: int
    start: int
    stop: int
    length: int  # the whole row's

    @property
    def whole(self) -> bool:
        return self.stop - self.start == self.length

    def describe(self) -> str:
        return f"{self.length} tokens" if self.whole else f"tokens {self.start} to {self.stop} of its {self.length}"


def pick_rows(dataset, *, num_rows: int = NUM_ROWS, max_tokens: int = MAX_ROW_TOKENS,
              max_scanned: int = 1000) -> list[Window]:
    """The shortest rows (of the ``max_scanned`` shortest) with at least ``MIN_LOSS_TOKENS`` loss tokens (any
    loss token if too few have that); a row longer than ``max_tokens`` gives the window of that many tokens
    around its first learned ones, so data whose every row is long is checked too."""
    picked, fallback = [], []
    for index in np.argsort(dataset.lengths, kind="stable")[:max_scanned]:
        if len(picked) == num_rows:
            break
        _, labels = dataset.sample_arrays(int(index))
        window = _window(int(index), labels, max_tokens)
        num_loss = int((labels[window.start + 1:window.stop] != IGNORE_INDEX).sum())
        if num_loss >= MIN_LOSS_TOKENS:
            picked.append(window)
        elif num_loss and len(fallback) < num_rows:
            fallback.append(window)
    return picked or fallback


def _window(index: int, labels: np.ndarray, max_tokens: int) -> Window:
    """The whole row when it fits, else ``max_tokens`` tokens from half of them before its first learned
    target (a window's first token predicts nothing, so it never starts on one)."""
    if len(labels) <= max_tokens:
        return Window(index, 0, len(labels), len(labels))
    learned = np.flatnonzero(labels[1:] != IGNORE_INDEX)
    first = int(learned[0]) + 1 if len(learned) else 0
    start = min(max(first - max_tokens // 2, 0), len(labels) - max_tokens)
    return Window(index, start, start + max_tokens, len(labels))


def _row_tensors(dataset, window: Window, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, unshifted labels, shifted labels)`` of one window, each [1, T]."""
    ids, labels = dataset.sample_arrays(window.index)
    ids, labels = ids[window.start:window.stop], labels[window.start:window.stop]
    input_ids = torch.tensor(ids.tolist(), dtype=torch.long, device=device).unsqueeze(0)
    unshifted = torch.tensor(labels.tolist(), dtype=torch.long, device=device).unsqueeze(0)
    shifted = torch.cat([unshifted[:, 1:], unshifted.new_full((1, 1), IGNORE_INDEX)], dim=1)
    return input_ids, unshifted, shifted


@torch.no_grad()
def packed_versus_alone(wrapper, dataset, rows: list[Window], *, attn_implementation: str,
                        device: torch.device) -> tuple[float, float]:
    """Summed token loss of ``rows`` packed into one row, and of each row alone (no router loss).

    Attention must keep packed samples apart; an architecture whose forward
    builds its mask without ``position_ids`` lets them see each other under
    sdpa/eager, and the sums differ.
    """
    pieces = [_row_tensors(dataset, window, device) for window in rows]
    was_training = wrapper.training
    wrapper.eval()
    try:
        alone = 0.0
        for input_ids, _, shifted in pieces:
            position_ids = torch.arange(input_ids.shape[1], device=device).unsqueeze(0)
            row = SimpleNamespace(cu_seqlens=None, max_seqlen=None, position_ids=position_ids)
            alone += float(wrapper(input_ids, position_ids, shifted,
                                   **attention_inputs(row, attn_implementation, device)))
        input_ids = torch.cat([p[0] for p in pieces], dim=1)
        shifted = torch.cat([p[2] for p in pieces], dim=1)
        position_ids = torch.cat([torch.arange(p[0].shape[1], device=device) for p in pieces]).unsqueeze(0)
        row = SimpleNamespace(cu_seqlens=None, max_seqlen=None, position_ids=position_ids)
        packed = float(wrapper(input_ids, position_ids, shifted, **attention_inputs(row, attn_implementation, device)))
    finally:
        wrapper.train(was_training)
        reshard(wrapper)
    return packed, alone


@torch.no_grad()
def compare_losses(wrapper, dataset, rows: list[Window], *, attn_implementation: str,
                   device: torch.device) -> list[tuple[Window, float, float]]:
    """``(row, trainer loss, model's own loss)`` per row, each row alone and unpacked."""
    results = []
    was_training = wrapper.training
    wrapper.eval()  # no dropout or router jitter: both sides must see the same function
    try:
        for window in rows:
            input_ids, unshifted, shifted = _row_tensors(dataset, window, device)
            num_loss = int((shifted != IGNORE_INDEX).sum())
            position_ids = torch.arange(input_ids.shape[1], device=device).unsqueeze(0)
            row = SimpleNamespace(cu_seqlens=torch.tensor([0, input_ids.shape[1]], dtype=torch.int32),
                                  max_seqlen=input_ids.shape[1], position_ids=position_ids)
            boundaries = attention_inputs(row, attn_implementation, device)
            weight = router_aux_weight(wrapper.router_loss, batch_num_loss_counted_tokens=num_loss,
                                       batch_num_samples=1, minibatch_num_samples=1)
            ours = wrapper(input_ids, position_ids, shifted, router_aux_weight=weight, **boundaries)
            reference = wrapper(input_ids, position_ids, unshifted, own_forward=True, **boundaries)
            results.append((window, float(ours) / num_loss, float(reference)))
    finally:
        wrapper.train(was_training)
        reshard(wrapper)
    return results


def check_loss_terms(wrapper, dataset, *, attn_implementation: str, compute_dtype: torch.dtype,
                    device: torch.device) -> None:
    """Stop every rank (SystemExit) when the trainer's loss is not the model's own; log the outcome."""
    began = time.perf_counter()
    model = wrapper.model
    name = f"{type(model).__name__} (model_type {model.config.model_type!r})"
    rows = pick_rows(dataset)
    if not rows:
        log_rank_0(f"objective self-check skipped: no loss token in the {MAX_ROW_TOKENS}-token windows of the "
                   "shortest rows", level=logging.WARNING)
        return
    tolerance = RELATIVE_TOLERANCE.get(compute_dtype, 2e-2)
    seen = head_input(wrapper, dataset, rows[0], attn_implementation=attn_implementation, device=device)
    if seen is not None and seen.decoder_width != seen.head_width:  # the trainer's head matmul cannot even run
        log_rank_0(_head_refusal(name, seen, attn_implementation), level=logging.ERROR)
        raise SystemExit(1)
    results = compare_losses(wrapper, dataset, rows, attn_implementation=attn_implementation, device=device)
    worst = max(results, key=lambda r: _relative_error(r[1], r[2]))
    error = _relative_error(worst[1], worst[2])
    if error > tolerance and seen is not None and not seen.same:
        log_rank_0(_head_refusal(name, seen, attn_implementation), level=logging.ERROR)
        raise SystemExit(1)
    if error > tolerance:
        window, ours, reference = worst
        router = wrapper.router_loss
        log_rank_0(
            f"objective self-check failed for {name}: on data row {window.index} ({window.describe()}, "
            f"alone, {str(compute_dtype).removeprefix('torch.')}) the trainer's loss is {ours:.6f} but the model's "
            f"own forward(labels=...) gives {reference:.6f} (relative error {error:.1e} > {tolerance:.0e}). The "
            "trainer would optimise a different objective than this architecture's (it applied logit processing "
            f"{wrapper.logit_transform.describe()}, router loss {'coef %g' % router.coef if router else 'none'}). "
            "Please report it with the model's config.json; --skip-objective-check trains anyway.",
            level=logging.ERROR)
        raise SystemExit(1)
    if len(rows) > 1:
        packed, alone = packed_versus_alone(wrapper, dataset, rows, attn_implementation=attn_implementation,
                                            device=device)
        packing_error = _relative_error(packed, alone)
        if packing_error > tolerance:
            log_rank_0(
                f"objective self-check failed for {name}: {len(rows)} rows packed into one give a summed loss of "
                f"{packed:.6f} but {alone:.6f} each alone (relative error {packing_error:.1e}): "
                + _packing_leak(model, attn_implementation), level=logging.ERROR)
            raise SystemExit(1)
    windows = sum(not window.whole for window in rows)
    on_windows = f" ({windows} long ones on a window of {MAX_ROW_TOKENS} tokens)" if windows else ""
    log_rank_0(f"objective self-check: the trainer's loss equals {name}'s own forward(labels=...) on {len(rows)} "
               f"rows{on_windows} (max relative error {error:.1e}, tolerance {tolerance:.0e}, "
               f"{time.perf_counter() - began:.2f}s)")


def _packing_leak(model, attn_implementation: str) -> str:
    """Why packed samples see each other, and the way out, from whether the decoder's forward takes position_ids."""
    if "position_ids" in inspect.signature(decoder_of(model).forward).parameters:
        return (f"attention {attn_implementation} lets packed samples see each other in this architecture (its "
                "forward builds the attention mask without position_ids). Choose a backend that takes explicit "
                "boundaries (flash_attention_2, torch_varlen) if the model accepts one on this device, or report "
                "it; --skip-objective-check trains anyway.")
    # BLOOM and MPT (ALiBi) build their mask from the attention mask alone; RWKV carries a recurrent state.
    return (f"its forward takes no position_ids, so nothing tells its layers where a packed sample starts and "
            f"packed samples see each other (attention {attn_implementation}; no attention backend changes that). "
            "Train a model whose forward takes position_ids, or report it; --skip-objective-check trains anyway, "
            "with packed samples leaking into each other.")


@dataclass(frozen=True)
class HeadInput:
    """What the model's own forward gave its LM head, against what its decoder returned, on one row."""

    decoder_width: int
    head_width: int
    same: bool                   # the head was given the decoder's output itself
    between: tuple[str, ...]     # modules holding parameters that are neither the decoder's nor the head's


@torch.no_grad()
def head_input(wrapper, dataset, window: Window, *, attn_implementation: str,
               device: torch.device) -> HeadInput | None:
    """Run the model's own forward on ``window`` of a data row and see what reaches its LM head.

    None when the forward does not call the decoder and the output-embedding
    module as modules (nothing seen, nothing to conclude: the loss comparison judges).
    """
    model = wrapper.model
    decoder, head = decoder_of(model), model.get_output_embeddings()
    decoder_out, head_in = [], []
    hooks = [decoder.register_forward_hook(lambda _module, _args, out: decoder_out.append(out[0])),
             head.register_forward_pre_hook(lambda _module, args: head_in.append(args[0] if args else None))]
    input_ids, unshifted, _ = _row_tensors(dataset, window, device)
    position_ids = torch.arange(input_ids.shape[1], device=device).unsqueeze(0)
    row = SimpleNamespace(cu_seqlens=torch.tensor([0, input_ids.shape[1]], dtype=torch.int32),
                          max_seqlen=input_ids.shape[1], position_ids=position_ids)
    was_training = wrapper.training
    wrapper.eval()
    try:
        wrapper(input_ids, position_ids, unshifted, own_forward=True,
                **attention_inputs(row, attn_implementation, device))
    finally:
        for hook in hooks:
            hook.remove()
        wrapper.train(was_training)
        reshard(wrapper)
    if not decoder_out or not head_in or not torch.is_tensor(decoder_out[0]) or not torch.is_tensor(head_in[0]):
        return None
    ours, theirs = decoder_out[0], head_in[0]  # [1, T, H] each when the head reads the decoder's output
    same = ours.shape == theirs.shape and torch.equal(ours, theirs)
    return HeadInput(decoder_width=ours.shape[-1], head_width=theirs.shape[-1], same=same,
                     between=() if same else _modules_between(model, decoder, head))


def _modules_between(model, decoder, head) -> tuple[str, ...]:
    """The outermost modules of ``model`` with parameters that belong neither to ``decoder`` nor to ``head``."""
    names = {id(module): name for name, module in model.named_modules()}
    skip = (names.get(id(decoder), "") + ".", names.get(id(head), "") + ".")
    inside = {id(p) for p in decoder.parameters()} | {id(p) for p in head.parameters()}
    found: list[str] = []
    for name, module in model.named_modules():
        if not name or module is decoder or module is head or name.startswith(skip) or \
                any(name.startswith(outer + ".") for outer in found):
            continue
        holds_ours = any(m is decoder or m is head for m in module.modules())
        if not holds_ours and any(id(p) not in inside for p in module.parameters()):
            found.append(name)
    return tuple(found)


def _head_refusal(name: str, seen: HeadInput, attn_implementation: str) -> str:
    between = ", ".join(seen.between) or "code outside its modules"
    return (f"objective self-check failed for {name}: its forward passes the decoder's output "
            f"({seen.decoder_width} features) through {between} before the LM head ({seen.head_width} features), "
            f"but the trainer's loss is the LM head applied to the decoder's output (attention "
            f"{attn_implementation}), so it would not train this architecture's objective. Such a head (the "
            "masked-LM prediction head of an encoder registered as a causal LM) is not supported here, and "
            "--skip-objective-check does not change that: fine-tune a decoder-only model, or train this one "
            "with a trainer that calls its own forward(labels=...).")


def _relative_error(ours: float, reference: float) -> float:
    if not (math.isfinite(ours) and math.isfinite(reference)):
        return math.inf
    return abs(ours - reference) / max(abs(reference), 1e-6)


# ----------------------------------------------------------------------------
# A reward model's scores against the model's own forward


def _scored_rows(dataset, *, num_rows: int = NUM_ROWS, max_tokens: int = MAX_ROW_TOKENS,
                 max_scanned: int = 1000) -> list[np.ndarray]:
    """The input ids of the shortest sequences (of the ``max_scanned`` shortest), each cut right after its last
    learned token, where a score head reads it (``model/score_head.py``)."""
    picked = []
    for index in np.argsort(dataset.lengths, kind="stable")[:max_scanned]:
        if len(picked) == num_rows:
            break
        ids, labels = dataset.sample_arrays(int(index))
        last = last_learned_index(labels)
        if last is not None and last + 1 <= max_tokens:
            picked.append(ids[:last + 1])
    return picked


@torch.no_grad()
def compare_scores(wrapper, rows: list[np.ndarray], *, attn_implementation: str,
                   device: torch.device) -> tuple[list[float], list[float], list[float]]:
    """``(trainer's scores alone, the same rows packed into one, the model's own forward's)``, one per row."""
    was_training = wrapper.training
    wrapper.eval()
    alone, own, pieces = [], [], []
    try:
        for ids in rows:
            input_ids = torch.tensor(ids.tolist(), dtype=torch.long, device=device).unsqueeze(0)
            position_ids = torch.arange(input_ids.shape[1], device=device).unsqueeze(0)
            row = SimpleNamespace(cu_seqlens=torch.tensor([0, input_ids.shape[1]], dtype=torch.int32),
                                  max_seqlen=input_ids.shape[1], position_ids=position_ids)
            boundaries = attention_inputs(row, attn_implementation, device)
            last = torch.tensor([input_ids.shape[1] - 1], device=device)
            alone.append(float(wrapper(input_ids, position_ids, input_ids, score_positions=last, **boundaries)[0]))
            own.append(float(wrapper(input_ids, position_ids, input_ids, own_forward=True, **boundaries)[0]))
            pieces.append((input_ids, position_ids))
        input_ids = torch.cat([p[0] for p in pieces], dim=1)
        position_ids = torch.cat([p[1] for p in pieces], dim=1)
        lengths = torch.tensor([p[0].shape[1] for p in pieces], device=device)
        cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
        row = SimpleNamespace(cu_seqlens=cu_seqlens, max_seqlen=int(lengths.max()), position_ids=position_ids)
        packed = wrapper(input_ids, position_ids, input_ids, score_positions=(cu_seqlens[1:] - 1).long(),
                         **attention_inputs(row, attn_implementation, device)).tolist()
    finally:
        wrapper.train(was_training)
        reshard(wrapper)
    return alone, packed, own


def check_scores(wrapper, dataset, *, attn_implementation: str, compute_dtype: torch.dtype,
                 device: torch.device) -> None:
    """A reward model's ``check_loss_terms``: on a few real sequences, each cut after its last learned token,
    the trainer's score (decoder, then the score head at that token) equals the Hugging Face model's own pooled
    score, alone and packed. Stops every rank (SystemExit) when it does not; logs the outcome."""
    began = time.perf_counter()
    model = wrapper.model
    name = f"{type(model).__name__} (model_type {model.config.model_type!r})"
    rows = _scored_rows(dataset)
    if not rows:
        log_rank_0(f"objective self-check skipped: no sequence ends its learned tokens within {MAX_ROW_TOKENS} "
                   "tokens", level=logging.WARNING)
        return
    tolerance = RELATIVE_TOLERANCE.get(compute_dtype, 2e-2)
    alone, packed, own = compare_scores(wrapper, rows, attn_implementation=attn_implementation, device=device)
    scale = max(1.0, *(abs(value) for value in own))  # scores sit near 0: relative to the largest, or to 1
    worst = max(range(len(rows)), key=lambda i: abs(alone[i] - own[i]))
    error = abs(alone[worst] - own[worst]) / scale
    if not math.isfinite(error) or error > tolerance:
        pad = getattr(model.config, "pad_token_id", None)
        why = (f" Its last token is the pad token ({pad}), and transformers pools a sequence classifier's score at "
               "the last token that is not the pad token: give the tokenizer a pad token of its own."
               if pad is not None and int(rows[worst][-1]) == pad else
               " The score head is not applied to the decoder's output as the model's own forward applies it; "
               "please report it with the model's config.json.")
        log_rank_0(f"objective self-check failed for {name}: on a {len(rows[worst])}-token sequence the trainer's "
                   f"score is {alone[worst]:.6f} but the model's own forward gives {own[worst]:.6f} (error "
                   f"{error:.1e} > {tolerance:.0e}).{why} --skip-objective-check trains anyway.", level=logging.ERROR)
        raise SystemExit(1)
    packing_error = max(abs(a - b) for a, b in zip(packed, alone)) / scale
    if not math.isfinite(packing_error) or packing_error > tolerance:
        log_rank_0(f"objective self-check failed for {name}: {len(rows)} sequences packed into one row score "
                   f"{[round(v, 6) for v in packed]} but {[round(v, 6) for v in alone]} each alone: "
                   + _packing_leak(model, attn_implementation), level=logging.ERROR)
        raise SystemExit(1)
    log_rank_0(f"objective self-check: the trainer's scores equal {name}'s own forward on {len(rows)} sequences, "
               f"alone and packed (max error {max(error, packing_error):.1e} of the largest score or 1, tolerance "
               f"{tolerance:.0e}, {time.perf_counter() - began:.2f}s)")
