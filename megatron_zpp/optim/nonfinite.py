"""Megatron's --check-for-nan-in-loss-and-grad: a step whose loss or global gradient norm is not
finite is never applied. The decision is agreed by every rank of the world with one all-reduce
(MAX) of two flags, issued every step whatever the values, so no collective depends on the data.

--fp16 keeps its skip-and-rescale for overflowing gradients; anything else non-finite (any dtype's
loss, fp32/bf16 gradients) stops the run (training/step.py), unless the check is turned off
(--no-check-for-nan-in-loss-and-grad), where, as in Megatron, fp32/bf16 steps are applied anyway."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import comm


@dataclass(frozen=True)
class StepCheck:
    """What an engine's step found and did: the global norm before clipping, whether the loss and
    the gradients were finite on every rank, and whether AdamW stepped."""

    grad_norm: float
    loss_finite: bool = True
    grads_finite: bool = True
    applied: bool = True

    @property
    def finite(self) -> bool:
        return self.loss_finite and self.grads_finite


def agree_finite(loss: float, grad_norm: float, group, device) -> tuple[bool, bool]:
    """(loss finite, gradients finite) on every rank of `group`: one all-reduce of two flags."""
    flags = torch.tensor(
        [float(not math.isfinite(loss)), float(not math.isfinite(grad_norm))], dtype=torch.float32, device=device
    )
    comm.all_reduce(flags, group, "step_check", op=torch.distributed.ReduceOp.MAX)
    return flags[0].item() == 0, flags[1].item() == 0


def check_step(loss: float, grad_norm: float, group, device, loss_scale, skip_nonfinite: bool) -> StepCheck:
    """The agreed StepCheck, `applied` decided: a finite step always is; a non-finite one never under
    --fp16 (`loss_scale` given) or the check (`skip_nonfinite`), else (check off) it is, as before."""
    loss_ok, grads_ok = agree_finite(loss, grad_norm, group, device)
    applied = (loss_ok and grads_ok) or (loss_scale is None and not skip_nonfinite)
    return StepCheck(grad_norm, loss_ok, grads_ok, applied)
