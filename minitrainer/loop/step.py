"""One optimizer step on one packed batch, and its metrics line.

The step optimises the objective's exact mean over the whole batch (SFT: per token; DPO: per pair),
whatever the packing: every minibatch's loss is a sum, scaled by the batch's
count, which the sampler knows before any forward (``objectives/``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from minitrainer.loop import divergence
from minitrainer.setup import flops
from minitrainer.report.metrics import StepCounts, step_record
from minitrainer.common.device import peak_memory_gb, reset_peak_memory
from minitrainer.common.distributed import DistInfo
from minitrainer.common.log import log_rank_0, logger
from minitrainer.data import mix as data_mix
from minitrainer.data.sampler import StepBatch
from minitrainer.optim.device_skip import skips_on_device, step_unless
from minitrainer.report.progress import Progress
from minitrainer.setup.model import sync_gradients_on
from minitrainer.setup.run import Run


class DeviceTimer:
    """Seconds of device work between ``start`` and ``stop``, read after the step's one synchronisation:
    events on an accelerator (no wait at ``stop``), the host clock on CPU, whose work is synchronous."""

    def __init__(self, device: torch.device) -> None:
        self.events = (None if device.type == "cpu" else
                       (torch.Event(device=device, enable_timing=True), torch.Event(device=device, enable_timing=True)))
        self.times = [time.perf_counter(), 0.0]
        if self.events:
            self.events[0].record()

    def stop(self) -> None:
        if self.events:
            self.events[1].record()
        else:
            self.times[1] = time.perf_counter()

    def seconds(self) -> float:
        """Only after the device reached ``stop`` (``reduce_step``'s read-back waits for it)."""
        return self.events[0].elapsed_time(self.events[1]) / 1000 if self.events else self.times[1] - self.times[0]


@dataclass
class StepResult:
    """This rank's sums of one step, and whether the update was applied."""

    started: float                 # perf_counter at the step's start
    forward_backward: DeviceTimer
    loss_sum: torch.Tensor         # summed cross-entropy of this rank's loss tokens
    backward_sum: torch.Tensor     # what was backpropagated (the scaled loss)
    router_aux_sum: torch.Tensor
    objective_sums: torch.Tensor   # the objective's own sums (TrainingObjective.sum_names)
    local_loss_tokens: int
    grad_norm: torch.Tensor | float  # a float once reduce_step has read it back
    finite: bool | None            # None until reduce_step reads it back (the update skipped itself on the device)
    empty: bool                    # no loss tokens in the whole batch
    lr: float                      # the learning rate this step's update used (or would have used, if skipped)
    diagnostics: torch.Tensor | dict | None = None  # --optimizer-diagnostics' local sums; a dict after reduce_step

    @property
    def applied(self) -> bool:
        return bool(self.finite) and not self.empty


def train_step(run: Run, batch: StepBatch) -> StepResult:
    """Forward and backward over this rank's minibatches, clip, then update unless the step is skipped.

    Nothing here waits for the device where the optimizer can skip a non-finite step by itself (fused
    AdamW on a GPU, ``device_skip.skips_on_device``): ``reduce_step`` reads the step back once, after the
    update is queued, and settles what depends on it (the schedule, the counters).
    """
    model, dist_info, state = run.model, run.dist_info, run.state
    reset_peak_memory()
    start = time.perf_counter()
    timer = DeviceTimer(dist_info.device)
    loss_sum = torch.zeros((), device=dist_info.device)
    backward_sum = torch.zeros((), device=dist_info.device)
    router_aux_sum = torch.zeros((), device=dist_info.device)
    objective_sums = torch.zeros(len(run.objective.sum_names), device=dist_info.device, dtype=torch.float64)
    local_loss_tokens = 0
    attn, device = run.resolved.attn_implementation, dist_info.device
    run.objective.begin_step(model, batch, attn=attn, device=device)
    for index, minibatch in enumerate(batch.minibatches):
        sync_gradients_on(model, sharding_strategy=run.config.fsdp_sharding_strategy,
                          final_minibatch=index == len(batch.minibatches) - 1)
        # The objective scales each minibatch's loss so the step optimises the exact mean over the whole batch.
        scaled, sums = run.objective.minibatch_loss(model, minibatch, batch, attn=attn, device=device,
                                                    world_size=dist_info.world_size)
        scaled.backward()
        loss_sum += model.last_ce_sum
        router_aux_sum += model.last_router_aux_sum
        backward_sum += scaled.detach()
        objective_sums += sums
        local_loss_tokens += minibatch.num_loss_counted_tokens
    timer.stop()
    run.method.before_clip(model, device=device)
    # The norm is reduced over every shard, so all ranks see the same value and
    # take the same skip decision without another collective.
    grad_norm = clip_grad_norm(model, run.config.max_grad_norm)
    # A batch without loss tokens has zero gradients: AdamW would still move the
    # weights (momentum, weight decay), so it is skipped like a non-finite step.
    empty = batch.batch_num_loss_counted_tokens == 0
    # Read before reduce_step advances the schedule: afterwards the scheduler holds the next step's rate.
    # float(): torchao's 8-bit AdamW keeps its learning rate as a host tensor (no recompile when it changes).
    lr = float(run.optimizer.param_groups[0]["lr"])
    before = run.diagnostics.before_update() if run.diagnostics is not None else None
    finite = None
    if empty:
        pass
    elif skips_on_device(run.optimizer) and not run.method.acts_after_update:
        step_unless(run.optimizer, torch.isfinite(grad_norm).logical_not().float())
    else:
        finite = bool(torch.isfinite(grad_norm))  # CPU-GPU sync point: this optimizer cannot skip by itself
        if finite:
            run.optimizer.step()
            run.method.after_update(model, device=device)
    diagnostics = run.diagnostics.after_update(before) if run.diagnostics is not None else None
    run.optimizer.zero_grad(set_to_none=True)
    state.step += 1
    state.samples_seen = batch.end_position
    return StepResult(started=start, forward_backward=timer, loss_sum=loss_sum, backward_sum=backward_sum,
                      router_aux_sum=router_aux_sum, objective_sums=objective_sums,
                      local_loss_tokens=local_loss_tokens, grad_norm=grad_norm,
                      finite=finite, empty=empty, lr=lr, diagnostics=diagnostics)


def reduce_step(run: Run, batch: StepBatch, result: StepResult, *,
                preemption_requested: bool) -> tuple[StepCounts, bool]:
    """The step's sums over every rank, and whether any rank was asked to stop (SIGTERM/SIGUSR1); then what
    depends on whether the update was applied: the schedule and the counters."""
    num_objective_sums = len(result.objective_sums)
    # The diagnostics' sums ride on the step's one all-reduce, after the objective's, and are split off again.
    sums = (result.objective_sums if result.diagnostics is None
            else torch.cat([result.objective_sums, result.diagnostics]))
    counts, preempted = reduce_step_counts(
        result.loss_sum, result.backward_sum, result.local_loss_tokens, 0.0, batch, run.dist_info,
        preemption_requested, result.router_aux_sum if run.model.router_loss is not None else None,
        grad_norm=result.grad_norm, objective_sums=sums)
    totals = counts.objective_sums
    counts = dataclasses.replace(counts, forward_backward_time=result.forward_backward.seconds(),
                                 objective_sums=totals[:num_objective_sums])
    result.grad_norm, result.finite = counts.grad_norm, math.isfinite(counts.grad_norm)
    if result.diagnostics is not None:
        result.diagnostics = run.diagnostics.metrics(totals[num_objective_sums:], applied=result.applied)
    state = run.state
    if result.applied:
        run.scheduler.step()  # the schedule counts updates: skipped steps do not advance it
    state.samples_trained += batch.num_samples if result.applied else 0
    state.num_bad_steps = 0 if result.finite else state.num_bad_steps + 1
    return counts, preempted


def log_step(run: Run, batch: StepBatch, result: StepResult, counts: StepCounts, *, progress: Progress) -> None:
    """Write the step's metrics line (file, trackers) and report progress (``--progress``)."""
    dist_info, state = run.dist_info, run.state
    # Dropped (over-long) samples are warned about by the loader, with their rows; here they are counted.
    record = step_record(step=state.step, lr=result.lr, grad_norm=result.grad_norm,
                         counts=counts, world_size=dist_info.world_size,
                         time_per_batch=time.perf_counter() - result.started,
                         total_samples_accumulated=state.samples_trained, samples_seen=state.samples_seen,
                         epoch=batch.epoch, peak_memory_usage_gb=peak_memory_gb(), skipped=not result.applied)
    record.update(run.objective.record(counts))
    record.update(result.diagnostics or {})
    record.update(flops.speed_metrics(
        run.model_shape, batch.sample_lengths, num_loss_counted_tokens=counts.num_loss_counted_tokens,
        seconds=record["time_per_batch"], world_size=dist_info.world_size, peak_tflops=run.peak_tflops,
        frozen_base=run.method.frozen_base))
    if isinstance(run.dataset, data_mix.MixedDataset):
        record.update(run.dataset.source_metrics(run.config.seed, state.samples_seen))
    if run.metrics is not None:
        run.metrics.write(record)
    run.tracker.log(record)
    progress.update(step=state.step, loss=record["loss"], tokens_per_second=record["tokens_per_second"],
                    samples=state.samples_seen, unit=run.objective.unit,
                    metrics={name: record.get(name) for name in run.objective.console_metrics})
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
        Whether the run must rewind (``loop.actions.rewind``): the batch is then in ``state.skipped_batches``.
    """
    state, config = run.state, run.config
    if not result.applied:
        return False
    loss = run.objective.step_loss(counts)
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
                       router_aux_sum: torch.Tensor | None = None, *,
                       grad_norm: torch.Tensor | None = None,
                       objective_sums: torch.Tensor | None = None) -> tuple[StepCounts, bool]:
    """All-reduce this step's sums and the preemption flags (any rank's signal stops all), and read them back
    with the gradient norm: one collective and one device-to-host read, the step's only synchronisation.

    Everything travels as float64, which holds the token counts exactly up to 2**53 (fp32 rounds past 2**24).
    ``forward_backward_time`` is this rank's (not summed).
    """
    device = loss_sum.device
    aux = loss_sum.new_zeros(()) if router_aux_sum is None else router_aux_sum.reshape(())
    # From pinned memory without waiting: a pageable host-to-device copy would wait for the device.
    host = torch.tensor([local_loss_tokens, int(preempt_requested)], dtype=torch.float64,
                        pin_memory=device.type != "cpu").to(device, non_blocking=True)
    extra = objective_sums if objective_sums is not None else loss_sum.new_zeros(0, dtype=torch.float64)
    sums = torch.cat([torch.stack([loss_sum, backward_sum, aux]).double(), host, extra])
    dist.all_reduce(sums)
    norm = (grad_norm if grad_norm is not None else loss_sum.new_zeros(())).double().reshape(1)
    loss_total, backward_total, router_aux_total, loss_tokens, preempts, *objective_totals, norm_value = (
        torch.cat([sums, norm]).tolist())  # CPU-GPU sync point: the step's one
    counts = StepCounts(loss_sum=loss_total, backward_loss_sum=backward_total,
                        batch_num_loss_counted_tokens=batch.batch_num_loss_counted_tokens,
                        num_loss_counted_tokens=int(loss_tokens), num_samples=batch.num_samples,
                        num_total_tokens=batch.num_total_tokens, num_dropped_samples=batch.num_dropped_samples,
                        num_minibatches=len(batch.minibatches), forward_backward_time=forward_backward_time,
                        router_aux_loss_sum=None if router_aux_sum is None else router_aux_total,
                        grad_norm=norm_value, objective_sums=tuple(objective_totals))
    return counts, preempts > 0
