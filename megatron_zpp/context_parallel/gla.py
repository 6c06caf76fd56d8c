"""Gated linear attention under context parallelism, with the state scan overlapped.

A slice's output is its local pass from a zero state plus the correction of the state
entering it (ZeCO):

    o = o_loc + scale * (q * exp(B_t)) @ S_in(p),    B_t = sum of g from the slice start to t

Forward: the local states come first (chunk_gla_fwd_states: the cheap state pass), the scan
of S_loc over the ranks starts at once in a background thread, and the intra-chunk output
(the expensive part, which needs no incoming state) is computed while the state travels;
then the correction is added, in fp32, and the sum rounded once. Backward: the gradient
reaching S_in is known from dO alone, so the reverse scan starts first, in the background,
while the local gradients are computed; the state's share (the gradient arriving from the
next rank, through S_loc and the slice's total decay) is added when it arrives
(chunk_gla_bwd is linear in its two cotangents).

The thread only issues this CP group's point-to-point calls or its all-gather, which the
main thread does not touch meanwhile; torch kernels and gloo waits release the GIL, so the
two run at once on CPU. On GPU both use the current stream (correct; overlapping them there
needs a side stream, not done yet).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import recompute
from ..ops.gla import (
    ChunkGLABackward,
    ChunkGLAForward,
    chunk_gla,
    chunk_gla_bwd,
    chunk_gla_fwd_output,
    chunk_gla_fwd_states,
    chunk_gla_uses_kernels,
)
from ..topology import Group
from .scans import Known, check_algo, make_scan, overlapped
from .transition import Decay


def _decayed_queries(q: Tensor, g: Tensor, dt: torch.dtype) -> Tensor:
    """q * exp(B_t), B_t = sum_{s<=t} g_s from the slice's first token (<= 0: no overflow)."""
    return q.to(dt) * g.to(dt).cumsum(dim=1).exp()


class ContextParallelGLA(torch.autograd.Function):
    """apply(q, k, v, g, head, scan, scale, chunk_size) -> o [B,T,H,V] in v's dtype.

    head: the state entering rank 0's slice (None elsewhere, or for zeros); scan: an
    AllScan / GatherScan / RingScan over the CP group."""

    @staticmethod
    def forward(ctx, q, k, v, g, head, scan, scale, chunk_size):
        # The staged split (the local pass's own work, the scan between its stages) is reference code;
        # where the Triton kernels run, the kernel-backed local pass plus a correction is kept instead.
        ctx.staged = not chunk_gla_uses_kernels(q, k, v, g, chunk_size)
        if ctx.staged:  # the local states first; the intra-chunk output while S_in travels; then its share
            stages = ChunkGLAForward(q, k, v, g, scale, chunk_size)
            S_loc = stages.final_state
        else:
            states, S_loc = chunk_gla_fwd_states(k, v, g, None, chunk_size)
        dt = S_loc.dtype
        log_gamma = g.to(dt).sum(dim=1)  # [B,H,K]: the slice's total decay
        # an activation-recompute rerun reuses the state its first run received: no second scan
        kept = recompute.recall()
        if kept is not None:
            pending = Known(kept)
        else:
            pending = overlapped(scan.forward, S_loc, Decay(log_gamma), None if head is None else head.to(dt))
        if ctx.staged:
            stages.intra()
            S_in = recompute.remember(pending.result())
            o = stages.finish(S_in)[0]
        else:
            o = chunk_gla_fwd_output(q, k, v, g, states, scale, chunk_size)  # while the state travels
            S_in = recompute.remember(pending.result())
            o = o + torch.einsum("bthk,bhkv->bthv", _decayed_queries(q, g, dt), S_in) * scale
        ctx.save_for_backward(q, k, v, g, S_in, log_gamma)
        ctx.scan, ctx.scale, ctx.chunk_size = scan, scale, chunk_size
        ctx.head_dtype = None if head is None else head.dtype
        return o.to(v.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, g, S_in, log_gamma = ctx.saved_tensors
        if ctx.staged:
            dq, dk, dv, dg, d_head = _staged_backward(ctx, q, k, v, g, S_in, do)
        else:
            dq, dk, dv, dg, d_head = _corrected_backward(ctx, q, k, v, g, S_in, log_gamma, do)
        d_head = None if ctx.head_dtype is None else d_head.to(ctx.head_dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), d_head, None, None, None


def _staged_backward(ctx, q, k, v, g, S_in, do):
    """chunk_gla_bwd with initial state S_in and final-state gradient dS_out, whose reverse scan over
    the ranks runs between its stages: the gradient reaching S_in first, then the output gradients."""
    stages = ChunkGLABackward(q, k, v, g, None, do, ctx.scale, ctx.chunk_size, initial_state=S_in)
    pending = overlapped(ctx.scan.backward, stages.d_initial)
    stages.output_grads()  # while the state gradient travels
    return stages.finish(pending.result())  # dS_out: zeros on the last rank


def _corrected_backward(ctx, q, k, v, g, S_in, log_gamma, do):
    """The kernels' decomposition: the local backward plus the correction's, then the dS_out-only backward."""
    dt, scale, C = S_in.dtype, ctx.scale, ctx.chunk_size
    q_dec, do_t = _decayed_queries(q, g, dt), do.to(dt)
    dS_corr = torch.einsum("bthk,bthv->bhkv", q_dec, do_t) * scale  # gradient reaching S_in
    pending = overlapped(ctx.scan.backward, dS_corr)
    states, _ = chunk_gla_fwd_states(k, v, g, None, C)
    dq, dk, dv, dg, _ = chunk_gla_bwd(q, k, v, g, None, do, None, scale, C, states)  # the local part
    dq_corr = torch.einsum("bthv,bhkv->bthk", do_t, S_in) * scale * g.to(dt).cumsum(dim=1).exp()
    dq = dq + dq_corr
    # the correction's gate term: sum_{u>=t} q_u * dq_corr_u (no cancelling k term: one reverse cumsum)
    dg = dg + (q.to(dt) * dq_corr).flip(1).cumsum(1).flip(1)
    dS_out = pending.result()  # gradient of what this rank passed on (zeros on the last rank)
    _, dk_s, dv_s, dg_s, _ = chunk_gla_bwd(q, k, v, g, None, None, dS_out, scale, C, states)
    gamma = log_gamma.exp()
    d_log_gamma = (dS_out * S_in).sum(-1) * gamma  # S_out = S_loc + gamma * S_in
    dg = dg + dg_s + d_log_gamma[:, None]
    d_head = dS_corr + gamma[..., None] * dS_out
    return dq, dk + dk_s, dv + dv_s, dg, d_head


def gla_context_parallel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    cp: Group | None,
    algo: str = "all-scan",
    blocks: int = 0,
    scale: float | None = None,
    chunk_size: int = 16,
    initial_state: Tensor | None = None,
) -> Tensor:
    """GLA over a sequence split in contiguous slices over the CP group (rank order).

    q, k, g: [B, T_local, H, K]; v: [B, T_local, H, V]; T_local a multiple of chunk_size.
    Returns o [B, T_local, H, V] (v's dtype): this rank's slice of chunk_gla over the whole
    sequence. `initial_state` [B,H,K,V] is the state entering rank 0's slice; only rank 0
    reads it (and only there does it get a gradient). `blocks` is used by all-scan only (0:
    auto_blocks). Gradients of q, k, v, g (and initial_state) are exact.
    """
    check_algo(algo)
    if cp is None or cp.size == 1:
        return chunk_gla(q, k, v, g, scale, initial_state, chunk_size=chunk_size)[0]
    B, _, H, K = q.shape
    state_bytes = B * H * K * v.shape[-1] * 4
    scan = make_scan(algo, cp, blocks, state_bytes, q.device, K)
    head = initial_state if cp.rank == 0 else None
    return ContextParallelGLA.apply(q, k, v, g, head, scan, K**-0.5 if scale is None else scale, chunk_size)
