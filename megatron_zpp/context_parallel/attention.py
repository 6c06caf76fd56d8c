"""Causal softmax attention under context parallelism (all-gather of K and V).

Each CP rank holds a contiguous slice of T_local tokens (rank order). Keys and values are
all-gathered along the sequence; the local queries at global positions
cp.rank * T_local + i attend to every key at a position <= their own. Backward
reduce-scatters dK and dV back to the slices that own them.

Volume per rank (ring model): forward (P-1)/P of the gathered K|V, backward the same for
the reduce-scatter of their gradients.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import comm
from ..recompute import checkpoint
from ..topology import Group


class GatherSequence(torch.autograd.Function):
    """All-gather `dim` over the CP group (rank order); backward reduce-scatters along it."""

    @staticmethod
    def forward(ctx, x: Tensor, cp: Group, dim: int) -> Tensor:
        ctx.cp, ctx.dim = cp, dim
        xs = x.movedim(dim, 0).contiguous()  # comm concatenates along dim 0
        out = xs.new_empty((cp.size * xs.shape[0],) + tuple(xs.shape[1:]))
        comm.all_gather(out, xs, cp, "cp_attn_fwd")
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        gs = grad.movedim(ctx.dim, 0).contiguous()
        out = gs.new_empty((gs.shape[0] // ctx.cp.size,) + tuple(gs.shape[1:]))
        comm.reduce_scatter(out, gs, ctx.cp, "cp_attn_bwd")
        return out.movedim(0, ctx.dim), None, None


def attention_context_parallel(
    q: Tensor, k: Tensor, v: Tensor, cp: Group, dropout_p: float = 0.0, training: bool = False, recompute: bool = False
) -> Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys.

    q [B, H, T_local, D], k [B, G, T_local, D], v [B, G, T_local, Dv] (SDPA layout; GQA: H a
    multiple of G). Returns [B, H, T_local, Dv], equal to the slice of full causal attention.
    recompute: the attention after the K/V gather is recomputed in the backward (selective
    activation recompute; the gather is not repeated).
    """
    dropout = dropout_p if training else 0.0
    gqa = q.shape[1] != k.shape[1]
    if cp is None or cp.size == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, enable_gqa=gqa)
    T, Dk = q.shape[2], k.shape[-1]
    kv = GatherSequence.apply(torch.cat([k, v], dim=-1), cp, 2)  # one gather for both
    # Keys of later ranks are all masked: drop them (their gradient is then exactly 0).
    end = (cp.rank + 1) * T
    k_all, v_all = kv[:, :, :end, :Dk], kv[:, :, :end, Dk:]
    q_pos = cp.rank * T + torch.arange(T, device=q.device)
    mask = torch.arange(end, device=q.device)[None, :] <= q_pos[:, None]  # True = attend
    attend = functools.partial(F.scaled_dot_product_attention, attn_mask=mask, dropout_p=dropout, enable_gqa=gqa)
    return checkpoint(attend, q, k_all, v_all) if recompute else attend(q, k_all, v_all)
