"""The halo of a short causal convolution under context parallelism (Gated DeltaNet's kernel-4 convolution on
q, k, v; any mixer with one): the convolution at a slice's first tokens reads the last kernel-1 tokens of
the previous slice. They come by point-to-point from rank p-1 (zeros on rank 0, before the sequence), and
their gradient goes back the same way and is added to rank p-1's last tokens. An activation-recompute rerun
reuses the halo its first run received (recompute.recall): no second exchange."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import comm, recompute
from ..topology import Group
from .p2p import HALO_TAG, exchange

HALO_FWD, HALO_BWD = "cp_halo_fwd", "cp_halo_bwd"


class PreviousTokens(torch.autograd.Function):
    """apply(x [B,T,C], width, cp) -> [B,width,C]: the last `width` tokens of rank p-1's slice (zeros
    on rank 0); the backward sends their gradient back to p-1, which adds it to its last tokens."""

    @staticmethod
    def forward(ctx, x, width, cp):
        ctx.width, ctx.cp, ctx.length = width, cp, x.shape[1]
        kept = recompute.recall()
        if kept is not None:
            return kept
        halo = x.new_zeros(x.shape[0], width, x.shape[2])
        ops = []
        if cp.rank > 0:
            ops.append(comm.Recv(halo, cp.rank - 1, HALO_TAG))
        if cp.rank < cp.size - 1:
            ops.append(comm.Send(x[:, -width:].contiguous(), cp.rank + 1, HALO_TAG))
        exchange(ops, cp, HALO_FWD)
        return recompute.remember(halo)

    @staticmethod
    def backward(ctx, d_halo):
        cp, width = ctx.cp, ctx.width
        d_tail = d_halo.new_zeros(d_halo.shape)
        ops = []
        if cp.rank < cp.size - 1:
            ops.append(comm.Recv(d_tail, cp.rank + 1, HALO_TAG))
        if cp.rank > 0:
            ops.append(comm.Send(d_halo.contiguous(), cp.rank - 1, HALO_TAG))
        exchange(ops, cp, HALO_BWD)
        d_x = d_tail.new_zeros(d_tail.shape[0], ctx.length, d_tail.shape[2])
        d_x[:, -width:] = d_tail
        return d_x, None, None


def previous_tokens(x: Tensor, width: int, cp: Group) -> Tensor:
    """The `width` tokens before this rank's slice x [B,T,C] (zeros before the sequence), T >= width."""
    return PreviousTokens.apply(x, width, cp)
