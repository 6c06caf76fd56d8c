"""Megatron's --check-for-nan-in-loss-and-grad: a step whose loss or global gradient norm is not
finite is never applied. The decision is agreed by every rank of the world with one all-reduce
(MAX) of two flags, issued every step whatever the values, so no collective depends on the data.

--fp16 keeps its skip-and-rescale for overflowing gradients; anything else non-finite (any dtype's
loss, fp32/bf16 gradients) stops the run (training/step.py), unless the check is turned off
(--no-check-for-nan-in-loss-and-grad), where, as in Megatron, fp32/bf16 steps are applied anyway.

The same all-reduce carries the requests to stop (training/distributed.ExitSignal registers them
with set_stop_source: a caught signal, Ctrl-C, --exit-duration-in-mins), so a Ctrl-C stops every
rank after the same step without a collective of its own. The flags travel as 8 bytes (uint8
lanes), as the two fp32 flags did."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake

from .. import comm

STOP_LANES = 3  # what a stop source reports: (signal, duration, interrupt), each 0 or 1
_stop_source = [None]  # () -> STOP_LANES ints, or None: nothing to stop for


def set_stop_source(fn) -> None:
    """Register (or, with None, remove) what each step's agreement asks about stopping."""
    _stop_source[0] = fn


@dataclass(frozen=True)
class StepCheck:
    """What an engine's step found and did: the global norm before clipping, whether the loss and
    the gradients were finite on every rank, and whether AdamW stepped."""

    grad_norm: float
    loss_finite: bool = True
    grads_finite: bool = True
    applied: bool = True
    stop: tuple[int, ...] = (0,) * STOP_LANES  # the stop source's lanes, agreed (any rank's request)

    @property
    def finite(self) -> bool:
        return self.loss_finite and self.grads_finite


def agree_finite(loss: float, grad_norm: float, group, device) -> tuple[bool, bool, tuple[int, ...]]:
    """(loss finite, gradients finite, stop lanes) on every rank of `group`: one all-reduce (MAX)."""
    stop = list(_stop_source[0]() if _stop_source[0] else (0,) * STOP_LANES)
    lanes = [int(not math.isfinite(loss)), int(not math.isfinite(grad_norm)), *stop]
    flags = torch.tensor(lanes + [0] * (8 - len(lanes)), dtype=torch.uint8, device=device)
    comm.all_reduce(flags, group, "step_check", op=torch.distributed.ReduceOp.MAX)
    agreed = [0] * len(flags) if is_fake(flags) else flags.tolist()  # a dry run's fake flags: a finite step
    return agreed[0] == 0, agreed[1] == 0, tuple(agreed[2 : 2 + STOP_LANES])


def check_step(loss: float, grad_norm: float, group, device, loss_scale, skip_nonfinite: bool) -> StepCheck:
    """The agreed StepCheck, `applied` decided: a finite step always is; a non-finite one never under
    --fp16 (`loss_scale` given) or the check (`skip_nonfinite`), else (check off) it is, as before."""
    loss_ok, grads_ok, stop = agree_finite(loss, grad_norm, group, device)
    applied = (loss_ok and grads_ok) or (loss_scale is None and not skip_nonfinite)
    return StepCheck(grad_norm, loss_ok, grads_ok, applied, stop)
