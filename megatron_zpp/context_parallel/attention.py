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
    drop=None,
) -> Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys.

    q [B, H, T_local, D], k [B, G, T_local, D], v [B, G, T_local, Dv] (SDPA layout; GQA: H a
    multiple of G). Returns [B, H, T_local, Dv], equal to the slice of full causal attention.
    doc_ids [B, T] (T = P * T_local): each token's document; keys of other documents are masked.
    recompute: the attention after the K/V gather is recomputed in the backward (selective
    activation recompute; the gather is not repeated). drop: layout-invariant dropout of the
    probabilities (model/dropout.py; the attention then runs explicitly), None: SDPA's own dropout.
    """
    dropout = dropout_p if training else 0.0
    sdpa = functools.partial(F.scaled_dot_product_attention, dropout_p=dropout, enable_gqa=q.shape[1] != k.shape[1])
    T, Dk = q.shape[2], k.shape[-1]
    first = 0 if cp is None else cp.rank * T  # this slice's first query position
    if drop is not None and dropout:
        sdpa = functools.partial(_explicit, drop=drop, first_query=first)
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


def explicit_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, drop, first_query: int) -> Tensor:
    """softmax(q k^T / sqrt(D), masked) with `drop` applied to the probabilities, times v: SDPA's math path
    with another dropout. mask: bool, True = attend ([Tq, Tk] or [B, 1, Tq, Tk]); None: causal. GQA: each
    key/value head serves H/G consecutive query heads, as SDPA's enable_gqa."""
    heads, groups = q.shape[1], k.shape[1]
    if groups != heads:
        k, v = k.repeat_interleave(heads // groups, dim=1), v.repeat_interleave(heads // groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    wide = torch.promote_types(scores.dtype, torch.float32)  # the softmax in fp32 for bf16 (fp64 stays)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")).to(wide), dim=-1).to(q.dtype)
    return torch.matmul(drop(probs, first_query), v)


def _explicit(q, k, v, attn_mask=None, is_causal=False, *, drop, first_query: int) -> Tensor:
    """explicit_attention with SDPA's keywords (the CP path's masks are given, one rank's may be causal)."""
    return explicit_attention(q, k, v, None if is_causal else attn_mask, drop, first_query)


def _mask(offset: int, q_len: int, kv_len: int, doc_ids: Tensor | None, device: torch.device) -> Tensor:
    """True = attend: queries at sequence positions offset.. over keys 0..kv_len-1, causal ([q, kv]), and
    within the query's document when doc_ids [B, T] is given ([B, 1, q, kv]: block-diagonal causal)."""
    q_pos = offset + torch.arange(q_len, device=device)
    mask = torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None]
    if doc_ids is None:
        return mask
    same = doc_ids[:, offset : offset + q_len, None] == doc_ids[:, None, :kv_len]
    return (mask & same)[:, None]
