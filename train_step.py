"""One optimizer step on one packed batch, and its metrics line.

The step optimises the exact per-token mean cross-entropy over the whole batch,
whatever the packing: every minibatch's loss is a sum, scaled by the batch's
loss-token count, which the sampler knows before any forward.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from tqdm import tqdm

import data_mix
import divergence
import flops
from attention import model_inputs
from batch_metrics import StepCounts, step_record
from objective import router_aux_weight
from sampler import StepBatch
from setup_model_fsdp import sync_gradients_on
from setup_run import Run
from utils import DistInfo, log_rank_0, logger, peak_memory_gb, reset_peak_memory, synchronize


@dataclass
class StepResult:
    """This rank's sums of one step, and whether the update was applied."""

    started: float                 # perf_counter at the step's start
    forward_backward_time: float
    loss_sum: torch.Tensor         # summed cross-entropy of this rank's loss tokens
    backward_sum: torch.Tensor     # what was backpropagated (the scaled loss)
    router_aux_sum: torch.Tensor
    local_loss_tokens: int
    grad_norm: torch.Tensor
    finite: bool
    empty: bool                    # no loss tokens in the whole batch

    @property
    def applied(self) -> bool:
        return self.finite and not self.empty


def train_step(run: Run, batch: StepBatch) -> StepResult:
    """Forward and backward over this rank's minibatches, clip, then update unless the step is skipped."""
    model, dist_info, state = run.model, run.dist_info, run.state
    reset_peak_memory()
    start = time.perf_counter()
    # Sum-reduced CE over this rank's minibatches, divided by the whole batch's
    # loss-token count (known before any forward). FSDP averages gradients over
    # ranks, so multiplying by world_size turns that average back into the sum
    # the exact per-token mean needs. With context parallelism each rank's sum covers its own
    # shard of the group's row, so the sum over all ranks is still the batch's: the same factor holds.
    scale = dist_info.world_size / max(batch.batch_num_loss_counted_tokens, 1)
    loss_sum = torch.zeros((), device=dist_info.device)
    backward_sum = torch.zeros((), device=dist_info.device)
    router_aux_sum = torch.zeros((), device=dist_info.device)
    local_loss_tokens = 0
    attn, device = run.resolved.attn_implementation, dist_info.device
    for index, minibatch in enumerate(batch.minibatches):
        sync_gradients_on(model, sharding_strategy=run.config.fsdp_sharding_strategy,
                          final_minibatch=index == len(batch.minibatches) - 1)
        # MoE router loss (objective.py): per-sample, averaged over the batch's samples.
        aux_weight = router_aux_weight(
            model.router_loss, batch_num_loss_counted_tokens=batch.batch_num_loss_counted_tokens,
            batch_num_samples=batch.num_samples, minibatch_num_samples=minibatch.num_samples)
        mb_loss = model(**model_inputs(minibatch, attn, device), router_aux_weight=aux_weight)
        scaled = mb_loss * scale
        scaled.backward()
        loss_sum += model.last_ce_sum
        router_aux_sum += model.last_router_aux_sum
        backward_sum += scaled.detach()
        local_loss_tokens += minibatch.num_loss_counted_tokens
    synchronize()  # so the forward/backward time below is the device's, not the launch queue's
    forward_backward_time = time.perf_counter() - start
    run.method.before_clip(model, device=device)
    # The norm is reduced over every shard, so all ranks see the same value and
    # take the same skip decision without another collective.
    grad_norm = clip_grad_norm(model, run.config.max_grad_norm)
    finite = bool(torch.isfinite(grad_norm))  # CPU-GPU sync point, once per step
    # A batch without loss tokens has zero gradients: AdamW would still move the
    # weights (momentum, weight decay), so it is skipped like a non-finite step.
    empty = batch.batch_num_loss_counted_tokens == 0
    if finite and not empty:
        run.optimizer.step()
        run.method.after_update(model, device=device)
        run.scheduler.step()  # the schedule counts updates: skipped steps do not advance it
    run.optimizer.zero_grad(set_to_none=True)
    state.step += 1
    state.samples_seen = batch.end_position
    state.samples_trained += batch.num_samples if finite and not empty else 0
    state.num_bad_steps = 0 if finite else state.num_bad_steps + 1
    return StepResult(started=start, forward_backward_time=forward_backward_time, loss_sum=loss_sum,
                      backward_sum=backward_sum, router_aux_sum=router_aux_sum,
                      local_loss_tokens=local_loss_tokens, grad_norm=grad_norm, finite=finite, empty=empty)


def reduce_step(run: Run, batch: StepBatch, result: StepResult, *,
                preemption_requested: bool) -> tuple[StepCounts, bool]:
    """The step's sums over every rank, and whether any rank was asked to stop (SIGTERM/SIGUSR1)."""
    return reduce_step_counts(result.loss_sum, result.backward_sum, result.local_loss_tokens,
                              result.forward_backward_time, batch, run.dist_info, preemption_requested,
                              result.router_aux_sum if run.model.router_loss is not None else None)


def log_step(run: Run, batch: StepBatch, result: StepResult, counts: StepCounts, *, progress: tqdm) -> None:
    """Write the step's metrics line (file, trackers, progress bar)."""
    dist_info, state = run.dist_info, run.state
    synchronize()
    # Dropped (over-long) samples are warned about by the loader, with their rows; here they are counted.
    record = step_record(step=state.step, lr=run.scheduler.get_last_lr()[0], grad_norm=float(result.grad_norm),
                         counts=counts, world_size=dist_info.world_size,
                         time_per_batch=time.perf_counter() - result.started,
                         total_samples_accumulated=state.samples_trained, samples_seen=state.samples_seen,
                         epoch=batch.epoch, peak_memory_usage_gb=peak_memory_gb(), skipped=not result.applied)
    record.update(flops.speed_metrics(
        run.model_shape, batch.sample_lengths, num_loss_counted_tokens=counts.num_loss_counted_tokens,
        seconds=record["time_per_batch"], world_size=dist_info.world_size, peak_tflops=run.peak_tflops,
        frozen_base=run.method.frozen_base))
    if isinstance(run.dataset, data_mix.MixedDataset):
        record.update(run.dataset.source_metrics(run.config.seed, state.samples_seen))
    if run.metrics is not None:
        run.metrics.write(record)
    run.tracker.log(record)
    progress.update(1)
    progress.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_second']:.0f}",
                         samples=state.samples_seen)
    logger.debug("step %d: %s", state.step, record)


def report_skipped_step(run: Run, batch: StepBatch, result: StepResult) -> None:
    """Warn about a skipped update; abort after --max-bad-steps non-finite steps in a row, naming each one's samples."""
    state, config = run.state, run.config
    if result.finite:
        state.bad_step_samples = []
    else:
        state.bad_step_samples = [*state.bad_step_samples, [batch.start_position, batch.end_position]]
        logger.warning("step %d: non-finite loss or gradient norm (%s); update skipped (%d in a row)",
                       state.step, float(result.grad_norm), state.num_bad_steps)
        if state.num_bad_steps >= config.max_bad_steps:
            ranges = ", ".join(f"{start}..{end}" for start, end in state.bad_step_samples)
            logger.error("aborting: %d consecutive steps with non-finite loss or gradients "
                         "(--max-bad-steps %d); lower the learning rate or inspect the data of each: "
                         "samples %s of the stream", state.num_bad_steps, config.max_bad_steps, ranges)
            raise SystemExit(1)
    if result.empty and result.finite:
        log_rank_0("step %d: no loss-counted tokens in the batch (samples %d..%d); update skipped",
                   state.step, batch.start_position, batch.end_position, level=logging.WARNING)


def report_divergence(run: Run, batch: StepBatch, result: StepResult, counts: StepCounts) -> bool:
    """Detect a divergence of a finite step (``divergence.detect``) and act on ``--on-divergence``.

    ``stop`` raises before this step's export or full state is written, so neither holds the diverged model.

    Returns:
        Whether the run must rewind (``run_actions.rewind``): the batch is then in ``state.skipped_batches``.
    """
    state, config = run.state, run.config
    if not result.applied:
        return False
    loss = counts.loss_sum / max(counts.batch_num_loss_counted_tokens, 1)
    why = divergence.detect(loss=loss, grad_norm=float(result.grad_norm),
                            num_loss_tokens=counts.batch_num_loss_counted_tokens,
                            recent_losses=state.recent_losses, loss_factor=config.divergence_loss_factor)
    if why is None:
        state.recent_losses = divergence.remember(state.recent_losses, loss)
        return False
    where = f"divergence at step {state.step} (samples {batch.start_position}..{batch.end_position} of the stream)"
    if config.on_divergence == "rewind" and len(state.skipped_batches) < divergence.MAX_SKIPPED_BATCHES:
        state.skipped_batches = [*state.skipped_batches, [batch.start_position, batch.end_position]]
        log_rank_0("%s: %s; rewinding to the last full state before it and skipping those samples", where, why,
                   level=logging.WARNING)
        return True
    if config.on_divergence == "rewind":
        why += f"; {divergence.MAX_SKIPPED_BATCHES} batches were already skipped, so it is not the data"
    if config.on_divergence != "warn":
        logger.error("stopping: %s: %s; the exports and full states before it are kept. Lower --learning-rate, "
                     "inspect those samples, or pass --on-divergence rewind (skip the batch) or warn (go on)",
                     where, why)
        raise SystemExit(1)
    if state.diverged_at_step is None:
        state.diverged_at_step = state.step
    log_rank_0("%s: %s; going on (--on-divergence warn): no later validation is taken as the best export",
               where, why, level=logging.WARNING)
    return False


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Total gradient norm over all shards (clipped when ``max_norm`` > 0)."""
    parameters = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm if max_norm > 0 else float("inf"))
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return norm


def reduce_step_counts(loss_sum: torch.Tensor, backward_sum: torch.Tensor, local_loss_tokens: int,
                       forward_backward_time: float, batch: StepBatch, dist_info: DistInfo, preempt_requested: bool,
                       router_aux_sum: torch.Tensor | None = None) -> tuple[StepCounts, bool]:
    """All-reduce this step's sums and the preemption flags (any rank's signal stops all).

    Counts travel as int64 so they stay exact past 2**24 tokens, where fp32 rounds.
    """
    aux = loss_sum.new_zeros(()) if router_aux_sum is None else router_aux_sum.float().reshape(())
    sums = torch.stack([loss_sum.float(), backward_sum.float(),
                        torch.tensor(forward_backward_time, device=loss_sum.device), aux.float()])
    integers = torch.tensor([local_loss_tokens, int(preempt_requested)], dtype=torch.int64, device=loss_sum.device)
    dist.all_reduce(sums)
    dist.all_reduce(integers)
    loss_total, backward_total, time_total, router_aux_total = sums.tolist()  # CPU-GPU sync point
    loss_tokens, preempts = integers.tolist()
    counts = StepCounts(loss_sum=loss_total, backward_loss_sum=backward_total,
                        batch_num_loss_counted_tokens=batch.batch_num_loss_counted_tokens,
                        num_loss_counted_tokens=loss_tokens, num_samples=batch.num_samples,
                        num_total_tokens=batch.num_total_tokens, num_dropped_samples=batch.num_dropped_samples,
                        num_minibatches=len(batch.minibatches), forward_backward_time_sum=time_total,
                        router_aux_loss_sum=None if router_aux_sum is None else router_aux_total)
    return counts, preempts > 0
