"""One optimizer step over the micro-batches of the global batch (evaluation.py: the evaluations).

A step: forward/backward of every micro-batch (the pipeline schedule, which tells the
engine which backward is each chunk's last, so that it can reduce during it), then the
engine reduces the gradients over data parallel, clips them by the global norm and steps AdamW.
The loss is reported on every rank: the last pipeline stage holds it."""

from __future__ import annotations

import os

import torch
from torch._subclasses.fake_tensor import is_fake

from .. import comm
from ..checkpoint.rng import set_rng_state
from ..model.moe_mlp import moe_step
from ..optim import rates_at
from ..pipeline_parallel import run_schedule


def report_loss(run, losses: list[torch.Tensor]) -> float:
    """Mean loss over the global batch, known on every rank: broadcast from the last
    pipeline stage over PP, then averaged over DP x CP."""
    g = run.groups
    loss = torch.stack(losses).mean().reshape(1) if losses else torch.zeros(1, device=run.device)
    loss = loss.float()
    comm.broadcast(loss, g.pp.size - 1, g.pp, "loss_report")
    comm.all_reduce(loss, g.dp_cp, "loss_report")
    if is_fake(loss):  # a dry run (fake tensors): the collectives ran, no value to report
        return 0.0
    return loss.item() / g.dp_cp.size


def train_step(run, timers=None) -> tuple[float, float, float]:
    """One optimizer step over the global batch due after `run.state.consumed_samples` (it grows
    during a ramp-up). Returns (mean loss over the global batch, grad norm, lr).

    --fp16: the backward starts from the loss times the scaler's scale; a step whose gradients
    overflow is skipped (state.last_step_skipped, counted in state.skipped_iterations) and, as
    in Megatron, does not advance the learning-rate schedule. `timers` (--timing-log-level): times the
    forward-backward and the optimizer (reduction, clipping, AdamW)."""
    state = run.state  # what the step changes
    if state.pending_rng_state:  # a resumed run's RNG streams, after everything the set-up drew
        set_rng_state(state.pending_rng_state)
        state.pending_rng_state = None
    comm.ORDER.enabled = run.cfg.zero.check_collective_order
    run.dp.zero_grad()
    micro_batches = run.cfg.micro_batches_at(state.consumed_samples)
    scaler = state.loss_scaler
    timers = timers or _NO_TIMERS
    timers.start("forward-backward")
    losses = run_schedule(
        run.chunks,
        run.train_data,
        micro_batches,
        run.link,
        on_backward=run.dp.set_last_micro_batch,  # the last micro-batch's backward may reduce (overlap)
        loss_scale=scaler.scale if scaler else 1.0,
    )
    # the loss is reduced before the step: a collective after it would queue behind the weight
    # gathers that --overlap-param-gather leaves in flight for the next forward, and wait for them
    loss = report_loss(run, losses)
    timers.stop("forward-backward")
    # Megatron's count: the applied samples; --use-checkpoint-opt_param-scheduler: the checkpoint's schedule
    rates = rates_at(run.cfg, state.consumed_samples - state.skipped_samples, run.checkpoint_schedule)
    empty_cache(run, 1)
    timers.start("optimizer")
    check = run.dp.step(rates, scaler.scale if scaler else None, loss, run.cfg.train.check_for_nan_in_loss_and_grad)
    if run.cfg.zero.check_collective_order:  # every group's collectives of this step, compared across it
        comm.check_collective_order(run.groups)
    if run.cfg.model.num_experts:  # the expert bias moves; the log's router losses and expert loads
        run.moe_metrics.clear()  # a dict, kept on the (frozen) Run: the log line reads it
        run.moe_metrics.update(moe_step(run.chunks, run.groups, micro_batches, run.cfg.model.num_layers))
    timers.stop("optimizer")
    empty_cache(run, 2)
    state.last_step_skipped = not check.applied
    state.stop_request = check.stop  # agreed by every rank: ExitSignal.anywhere reads it (a Ctrl-C)
    refuse_nonfinite(run, loss, check)
    if scaler:
        scaler.update(state.last_step_skipped)
    if state.last_step_skipped:
        state.skipped_iterations += 1
        state.skipped_samples += run.cfg.train.global_batch_at(state.consumed_samples)
    return loss, check.grad_norm, rates.lr


def count_step(run, samples: int) -> None:
    """After train_step: the iteration and the samples it consumed, and the ledger's step count
    (comm.py reports bytes per step)."""
    run.state.iteration += 1
    run.state.consumed_samples += samples
    comm.LEDGER.step()


class _NoTimers:
    def start(self, name: str) -> None: ...

    def stop(self, name: str) -> None: ...


_NO_TIMERS = _NoTimers()


class NonFiniteStepError(RuntimeError):
    """A step whose loss or gradients are not finite (--check-for-nan-in-loss-and-grad): not applied,
    and the run stops; alike on every rank (the check is agreed)."""


def refuse_nonfinite(run, loss: float, check) -> None:
    """Raise NonFiniteStepError for a step the check refused: a non-finite loss (any dtype), non-finite
    fp32/bf16 gradients, or (--fp16) more than --max-skipped-steps overflowing steps in a row."""
    t, state = run.cfg.train, run.state
    if not t.check_for_nan_in_loss_and_grad:
        return
    state.consecutive_skips = 0 if check.finite else state.consecutive_skips + 1
    fp16_overflow = state.loss_scaler is not None and check.loss_finite
    if check.finite or (fp16_overflow and state.consecutive_skips <= t.max_skipped_steps):
        return
    what = "the loss is" if not check.loss_finite else "the gradients are"
    why = f"{what} not finite (loss {loss:g}, grad norm {check.grad_norm:g})"
    if fp16_overflow:
        why = f"{state.consecutive_skips} steps in a row overflowed in fp16 (--max-skipped-steps {t.max_skipped_steps})"
    raise NonFiniteStepError(f"iteration {state.iteration + 1}: {why}; the step was not applied. {_resume_hint(run)}")


def _resume_hint(run) -> str:
    if run.saves.last:
        root = os.path.dirname(run.saves.last)
        return f"The last good checkpoint is {run.saves.last}: resume with --load {root} (e.g. with a lower --lr)"
    return "No checkpoint was saved or loaded by this run: nothing to resume from (e.g. lower --lr and rerun)"


def empty_cache(run, level: int) -> None:
    """--empty-unused-memory-level: hand the accelerator's cached free blocks back (none on CPU)."""
    if run.cfg.train.empty_unused_memory_level >= level and run.device.type != "cpu":
        torch.accelerator.empty_cache()
