"""Global gradient norm over every parallel dimension, each parameter counted once.

A parameter replicated over TP (norm weights) has the same gradient on every TP rank:
only TP rank 0 counts it. A tied embedding held by the first and the last pipeline stage
is counted on the first stage only. The squared sums are then added over the model-
parallel group (TP x PP), and over DP when gradients are sharded (ZeRO-2/3).

Routed experts are another part (`parts`): distinct over expert parallelism and replicated over the
expert-data-parallel group, their squares are added over the expert model-parallel group (expert TP x
EP x PP) and over the expert-data-parallel group when sharded. Each part is reduced over its own groups,
in a fixed order, then the parts are added."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from .. import comm


def counted_once(param, tp_rank: int, is_first_stage: bool) -> bool:
    if getattr(param, "expert_parallel", False):  # a routed expert: its own rank's, never a TP replica
        return True
    if getattr(param, "tp_split", None) is None and tp_rank != 0:
        return False
    if getattr(param, "pipeline_duplicate", False) and not is_first_stage:
        return False
    return True


def global_grad_norm(parts: list[tuple[list[torch.Tensor], list]], phase: str = "grad_norm") -> float:
    """sqrt of the sum of squares over `parts`, each (this rank's share of some gradients, the groups its
    squares are summed over); --log-params-norm passes the master weights, phase "params_norm"."""
    total, fake = 0.0, False
    for grads, groups_to_sum in parts:
        sq = torch.zeros(1, dtype=torch.float64, device=grads[0].device if grads else None)
        for g in grads:
            sq += g.double().pow(2).sum()
        for group in groups_to_sum:
            comm.all_reduce(sq, group, phase)
        if is_fake(sq):  # a dry run (fake tensors): no value, but every part's collectives, as a real step's
            fake = True
            continue
        total += sq.item()
    return 0.0 if fake else total**0.5  # a dry run has no clipping to decide


def clip_(grads: list[torch.Tensor], total_norm: float, max_norm: float) -> None:
    if max_norm > 0 and total_norm > max_norm:
        scale = max_norm / (total_norm + 1e-6)
        for g in grads:
            g.mul_(scale)


def clip_by_global_norm(
    parts: list[tuple[list[torch.Tensor], list]], grads: list[torch.Tensor], max_norm: float, loss_scale=None
) -> float:
    """Global norm of the counted gradients of `parts` ((each parameter once, the groups to sum over), as
    global_grad_norm), then clip all of `grads` by it. Returns the norm before clipping.
    `loss_scale` (--fp16): the gradients are first divided by it (the parts must view `grads`)."""
    if loss_scale is not None and loss_scale != 1.0:
        for g in grads:
            g.mul_(1.0 / loss_scale)  # a power of two: exact
    norm = global_grad_norm(parts)
    clip_(grads, norm, max_norm)
    return norm
