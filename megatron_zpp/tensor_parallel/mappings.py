"""Every tensor-parallel communication pattern as an autograd function.

Forward and backward are conjugate: copy (identity / all-reduce), reduce (all-reduce /
identity), scatter and gather along the last dim, and Megatron's sequence-parallel pair
along the sequence dim (all-gather / reduce-scatter). All go through comm.py, so the
ledger sees them with their phase. `start_gather_seq` / `start_reduce_scatter_seq` issue the
sequence pair asynchronously: layers.py's column-parallel product, which enters the TP region
itself (copy / gather_from_sp fused with the matmul, so that under SP only the input's shard is
kept for the backward), overlaps them with its backward matmuls.
"""

from __future__ import annotations

import torch

from .. import comm
from ..topology import Group


def _all_reduce(x: torch.Tensor, group: Group, phase: str) -> torch.Tensor:
    x = x.contiguous()
    comm.all_reduce(x, group, phase)
    return x


def _gather_last(x: torch.Tensor, group: Group, phase: str) -> torch.Tensor:
    out = x.new_empty((group.size * x.shape[0],) + x.shape[1:])
    comm.all_gather(out, x.contiguous(), group, phase)
    return torch.cat(out.chunk(group.size, dim=0), dim=-1)


def _split_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x.chunk(group.size, dim=-1)[group.rank].contiguous()


def start_gather_seq(x: torch.Tensor, group: Group, phase: str, seq_dim: int = 1):
    """Start the all-gather of every rank's sequence shard: (handle, the gathered tensor, which
    holds the result once handle.wait() has returned)."""
    x = x.movedim(seq_dim, 0).contiguous()
    out = x.new_empty((group.size * x.shape[0],) + x.shape[1:])
    return comm.all_gather(out, x, group, phase, async_op=True), out.movedim(0, seq_dim)


def start_reduce_scatter_seq(x: torch.Tensor, group: Group, phase: str, seq_dim: int = 1):
    """Start the reduce-scatter of partial sums along the sequence: (handle, this rank's shard of
    the sum, valid once handle.wait() has returned)."""
    x = x.movedim(seq_dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // group.size,) + x.shape[1:])
    return comm.reduce_scatter(out, x, group, phase, async_op=True), out.movedim(0, seq_dim)


def gather_seq(x: torch.Tensor, group: Group, phase: str, seq_dim: int) -> torch.Tensor:
    handle, out = start_gather_seq(x, group, phase, seq_dim)
    handle.wait()
    return out


def _reduce_scatter_seq(x: torch.Tensor, group: Group, phase: str, seq_dim: int) -> torch.Tensor:
    handle, out = start_reduce_scatter_seq(x, group, phase, seq_dim)
    handle.wait()
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group, "tp_bwd_allreduce"), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group, "tp_fwd_allreduce")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group, "tp_fwd_allgather")

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    """Sequence-parallel region -> tensor-parallel region (all-gather along sequence)."""

    @staticmethod
    def forward(ctx, x, group, seq_dim):
        ctx.group, ctx.seq_dim = group, seq_dim
        return gather_seq(x, group, "sp_fwd_allgather", seq_dim)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group, "sp_bwd_reducescatter", ctx.seq_dim), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    """Tensor-parallel partial sums -> sequence-parallel shards (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, seq_dim):
        ctx.group, ctx.seq_dim = group, seq_dim
        return _reduce_scatter_seq(x, group, "sp_fwd_reducescatter", seq_dim)

    @staticmethod
    def backward(ctx, grad):
        return gather_seq(grad, ctx.group, "sp_bwd_allgather", ctx.seq_dim), None, None


class _SumOverTP(torch.autograd.Function):
    """A partial sum every TP rank then uses whole (e.g. a sum of squares over heads split by TP): all-reduce
    forward, and all-reduce backward (each rank's part reaches every rank's output)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce(x.clone(), group, "tp_fwd_allreduce")

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group, "tp_bwd_allreduce"), None


def _trivial(group: Group | None) -> bool:
    return group is None or group.size == 1


def copy_to_tp(x, group):
    return x if _trivial(group) else _CopyToTP.apply(x, group)


def reduce_from_tp(x, group):
    return x if _trivial(group) else _ReduceFromTP.apply(x, group)


def gather_from_tp(x, group):
    return x if _trivial(group) else _GatherFromTP.apply(x, group)


def gather_from_sp(x, group, seq_dim=1):
    return x if _trivial(group) else _GatherFromSP.apply(x, group, seq_dim)


def reduce_scatter_to_sp(x, group, seq_dim=1):
    return x if _trivial(group) else _ReduceScatterToSP.apply(x, group, seq_dim)


def sum_over_tp(x, group):
    return x if _trivial(group) else _SumOverTP.apply(x, group)
