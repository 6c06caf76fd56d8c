"""Causal softmax attention under context parallelism (all-gather of K and V).

Each CP rank holds a contiguous slice of T_local tokens (rank order). Keys and values are
all-gathered along the sequence; the local queries at global positions
cp.rank * T_local + i attend to every key at a position <= their own. Backward
reduce-scatters dK and dV back to the slices that own them. With packed documents
(`doc_ids`, the document of every token of the whole sequence, known on every rank) a
query also skips the keys of other documents: the same block-diagonal causal mask as one
rank's, cut to this rank's rows.

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
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cp: Group | None,
    dropout_p: float = 0.0,
    training: bool = False,
    doc_ids: Tensor | None = None,
    recompute: bool = False,
) -> Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys.

    q [B, H, T_local, D], k [B, G, T_local, D], v [B, G, T_local, Dv] (SDPA layout; GQA: H a
    multiple of G). Returns [B, H, T_local, Dv], equal to the slice of full causal attention.
    doc_ids [B, T] (T = P * T_local): each token's document; keys of other documents are masked.
    recompute: the attention after the K/V gather is recomputed in the backward (selective
    activation recompute; the gather is not repeated).
    """
    dropout = dropout_p if training else 0.0
    sdpa = functools.partial(F.scaled_dot_product_attention, dropout_p=dropout, enable_gqa=q.shape[1] != k.shape[1])
    T, Dk = q.shape[2], k.shape[-1]
    if cp is None or cp.size == 1:  # one rank holds the sequence: only the documents' mask
        mask = _mask(0, T, T, doc_ids, q.device) if doc_ids is not None else None
        attend = functools.partial(sdpa, attn_mask=mask, is_causal=mask is None)
        return checkpoint(attend, q, k, v) if recompute else attend(q, k, v)
    kv = GatherSequence.apply(torch.cat([k, v], dim=-1), cp, 2)  # one gather for both
    # Keys of later ranks are all masked: drop them (their gradient is then exactly 0).
    end = (cp.rank + 1) * T
    k_all, v_all = kv[:, :, :end, :Dk], kv[:, :, :end, Dk:]
    attend = functools.partial(sdpa, attn_mask=_mask(cp.rank * T, T, end, doc_ids, q.device))
    return checkpoint(attend, q, k_all, v_all) if recompute else attend(q, k_all, v_all)


def _mask(offset: int, q_len: int, kv_len: int, doc_ids: Tensor | None, device: torch.device) -> Tensor:
    """True = attend: queries at sequence positions offset.. over keys 0..kv_len-1, causal ([q, kv]), and
    within the query's document when doc_ids [B, T] is given ([B, 1, q, kv]: block-diagonal causal)."""
    q_pos = offset + torch.arange(q_len, device=device)
    mask = torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None]
    if doc_ids is None:
        return mask
    same = doc_ids[:, offset : offset + q_len, None] == doc_ids[:, None, :kv_len]
    return (mask & same)[:, None]
