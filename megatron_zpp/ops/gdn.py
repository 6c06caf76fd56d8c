"""Gated DeltaNet (the gated delta rule; Yang, Kautz, Hatamizadeh, arXiv 2412.06464) in PyTorch, with Triton
kernels (megatron_zpp/kernels/gdn.py) on CUDA.

Recurrence, per batch b and head h (state S is K x V, kept in fp32):

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T        o_t = scale * S_t^T q_t

with a_t = exp(g_t), g_t <= 0 the per-head log decay (-inf allowed: a hard reset, a packed document's first
token) and b_t = beta_t in (0, 1). The layer L2-normalises q and k; this op does not. Shapes as fla's:
q, k [B, T, H, K]; v [B, T, H, V]; g, beta [B, T, H]; states [B, H, K, V]; o [B, T, H, V] in v's dtype (or
out_dtype). Work is in fp32 (fp64 when any input is fp64; bf16 is computed in fp32).

    naive_recurrent_gdn   the token loop (ops/gdn_naive.py; any dtype; the tests' fp64 reference)
    chunk_gdn             chunked WY/UT form with its own backward (ops/gdn_chunked.py describes it); the
                          Triton kernels on CUDA when they take the call (`chunk_gdn_uses_kernels`); any T
                          (identity tokens pad the last chunk)

Context parallelism (context_parallel/gdn.py). A slice's entering state acts affinely: S_out = M S_in + U_loc
and o = o_loc + r S_in, r_t = scale * P_t^T q_t, P_t the product of the transitions up to t and M = P_T.
`gdn_affine` gives (o_loc, r, U_loc, M): the plain pass, then a transition pass over K x K matrices on its WY
form (ops/delta_rule.py), not K more value columns; `gdn_vjp` is the backward of chunk_gdn at the entering state
(the slice's outputs and leaving state are chunk_gdn(..., initial_state=S_in) exactly). The identity

    chunk_gdn(q, k, [v, 0_K], g, beta, initial_state=[0_V, I_K], output_final_state=True)
        == (o' = [o_loc, r], final_state = [U_loc, M])      (V + K value columns)

(the recurrence is linear in (v, S) jointly) is what the tests check those against. The op takes any V != K
and an initial state that requires grad (its gradient is returned). The Triton kernels take V <= 128
(KERNEL_V): chunk_gdn runs a wider V in column groups of 128, exactly, since the state's columns never mix; the
caller makes one call whatever the widths.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import dispatch, gdn_chunked
from .chunking import check_chunk_size, check_shapes, compute_dtype, from_chunks, to_chunks
from .delta_rule import KERNEL_V, affine_kernels, affine_reference, as_inputs, kernel_ops, padded_to_chunk, vjp_kernels
from .delta_rule import use_kernel as _use_kernel
from .gdn_chunked import (
    Decays,
    bwd_chunks,
    bwd_states,
    fwd_output,
    fwd_states,
    prepare,
)

__all__ = ["chunk_gdn", "chunk_gdn_uses_kernels", "ChunkGDNFunction", "gdn_affine", "gdn_vjp"]

dispatch.register("gdn", "chunk fwd/bwd, fp32/bf16, chunk 16-64 (power of 2), K <= 128, V in groups of 128")

_fwd_kernel, _bwd_kernel = kernel_ops("gdn", per_channel_gate=False)


def chunk_gdn_uses_kernels(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk_size: int) -> bool:
    """Whether chunk_gdn runs the Triton kernels for these inputs (else the chunked PyTorch form); a V wider than
    the kernels' runs in column groups."""
    return _use_kernel(chunk_size, q, v[..., :KERNEL_V], k, g, beta)


def _reference_fwd(q, k, v, g, beta, initial_state, scale, chunk_size):
    dt = compute_dtype(q, k, v, g, beta, initial_state)
    qc, kc, vc = (to_chunks(x, chunk_size, dt) for x in (q, k, v))
    gc, bc = to_chunks(g, chunk_size, dt), to_chunks(beta, chunk_size, dt)
    dec = Decays(gc)
    _, W, U = prepare(kc, vc, bc, dec)
    h0 = initial_state.to(dt) if initial_state is not None else None
    states_in, v_new, final = fwd_states(kc, W, U, dec, h0)
    return from_chunks(fwd_output(qc, kc, v_new, states_in, dec, scale)), final


def _reference_bwd(q, k, v, g, beta, initial_state, do, d_final_state, scale, chunk_size):
    dt = compute_dtype(q, k, v, g, beta, initial_state)
    qc, kc, vc = (to_chunks(x, chunk_size, dt) for x in (q, k, v))
    gc, bc = to_chunks(g, chunk_size, dt), to_chunks(beta, chunk_size, dt)
    dec = Decays(gc)
    T, W, U = prepare(kc, vc, bc, dec)
    h0 = initial_state.to(dt) if initial_state is not None else None
    states_in, v_new, _ = fwd_states(kc, W, U, dec, h0)
    doc = to_chunks(do, chunk_size, dt) if do is not None else torch.zeros_like(v_new)
    if callable(d_final_state):  # context parallelism's reverse scan, run while the states above were recomputed
        d_final_state = d_final_state()
    dS = d_final_state.to(dt) if d_final_state is not None else None
    d_ends, dv_new, dh0 = bwd_states(qc, kc, W, dec, doc, dS, scale)
    grads = bwd_chunks(qc, kc, vc, bc, dec, T, W, v_new, states_in, d_ends, doc, dv_new, scale)
    return (*(from_chunks(x) for x in grads), dh0)


class ChunkGDNFunction(torch.autograd.Function):
    """(o [B,T,H,V] in v's dtype or out_dtype, final_state [B,H,K,V] fp32) = chunked GDN with its own backward.

    Saves only the inputs; the backward recomputes T, W, U and the states (one forward's work).
    apply(q, k, v, g, beta, initial_state or None, scale or None (K**-0.5), chunk_size[, out_dtype or None]).
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, chunk_size, out_dtype=None):
        check_shapes(q, k, v, initial_state, False, g=g, beta=beta)
        check_chunk_size(q.shape[1], chunk_size)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        ctx.save_for_backward(q, k, v, g, beta, initial_state)
        ctx.scale, ctx.chunk_size = scale, chunk_size
        ctx.set_materialize_grads(False)  # a None cotangent skips its share of the backward
        fwd = _fwd_kernel if _use_kernel(chunk_size, q, v, k, g, beta, initial_state) else _reference_fwd
        o, final_state = fwd(q, k, v, g, beta, initial_state, scale, chunk_size)
        return o.to(v.dtype if out_dtype is None else out_dtype), final_state

    @staticmethod
    def backward(ctx, do, d_final_state):
        q, k, v, g, beta, initial_state = ctx.saved_tensors
        if do is None and d_final_state is None:
            return (None,) * 9
        if do is not None:  # o's gradient in v's dtype, as the cotangent of an output in v's dtype would be
            do = do.to(v.dtype)
        use = _use_kernel(ctx.chunk_size, q, v, k, g, beta, initial_state, do, d_final_state)
        bwd = _bwd_kernel if use else _reference_bwd
        dq, dk, dv, dg, dbeta, dh0 = bwd(q, k, v, g, beta, initial_state, do, d_final_state, ctx.scale, ctx.chunk_size)
        dh0 = dh0.to(initial_state.dtype) if initial_state is not None else None
        grads = (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype), dh0)
        return (*grads, None, None, None)


def chunk_gdn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Chunked GDN (same result as `gdn_naive.naive_recurrent_gdn`), any T: a T that is not a multiple of chunk_size
    is padded at the end with identity tokens (k = 0, beta = 0, g = 0: S_t = S_{t-1}), whose outputs are dropped, so
    the final state and every gradient are those of the T tokens.

    Returns (o [B,T,H,V] in v's dtype or out_dtype, final state [B,H,K,V] fp32/fp64 or None). Gradients reach
    q, k, v, g, beta and initial_state. out_dtype fp32 for bf16 inputs keeps the fp32 output as computed.
    """
    rest = (scale, initial_state, output_final_state, chunk_size, out_dtype)
    return padded_to_chunk(lambda *x: _chunk_gdn(*x, *rest), chunk_size, q, k, v, g, beta)


def _chunk_gdn(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size, out_dtype):
    """chunk_gdn at a T that is a multiple of chunk_size."""
    V = v.shape[-1]
    if V <= KERNEL_V or not _use_kernel(chunk_size, q, v[..., :KERNEL_V], k, g, beta, initial_state):
        o, final_state = ChunkGDNFunction.apply(q, k, v, g, beta, initial_state, scale, chunk_size, out_dtype)
        return o, (final_state if output_final_state else None)
    # The kernels take KERNEL_V value columns: a column of the state never mixes with another (the transitions
    # act on the K rows) and o's columns are q^T times the state's, so wider V runs exactly in column groups.
    groups = v.split(KERNEL_V, dim=-1)
    states = [None] * len(groups) if initial_state is None else initial_state.split(KERNEL_V, dim=-1)
    outs = [ChunkGDNFunction.apply(q, k, x, g, beta, s, scale, chunk_size, out_dtype) for x, s in zip(groups, states)]
    o, final_state = (torch.cat(parts, dim=-1) for parts in zip(*outs))
    return o, (final_state if output_final_state else None)


def gdn_affine(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, chunk_size: int, on_state=None):
    """(o_loc [B,T,H,V], r [B,T,H,K], U [B,H,K,V], M [B,H,K,K]) of a context-parallel slice, no autograd, in the
    state's dtype: S_out = M S_in + U and o = o_loc + r S_in (ops/delta_rule.py: the plain pass, then the
    transition pass over K x K matrices); on_state(U, M) as soon as both are known."""
    check_shapes(q, k, v, None, False, g=g, beta=beta)
    check_chunk_size(q.shape[1], chunk_size)
    if chunk_gdn_uses_kernels(q, k, v, g, beta, chunk_size):
        return affine_kernels(_fwd_kernel, q, k, v, g, beta, scale, chunk_size, on_state)
    return affine_reference(gdn_chunked, q, k, v, g, beta, scale, chunk_size, on_state)


def gdn_vjp(q, k, v, g, beta, h0: Tensor, do: Tensor, d_final, scale: float, chunk_size: int):
    """(dq, dk, dv, dg, dbeta, dh0) of chunk_gdn(q, k, v, g, beta, initial_state=h0) for the cotangents do (of o, in
    v's dtype) and d_final (of the final state; or a function returning it, called once the recompute is done),
    no autograd: context parallelism's backward (ops/delta_rule.py)."""
    if _use_kernel(chunk_size, q, v[..., :KERNEL_V], k, g, beta, h0, do):  # d_final: h0's dtype
        grads = vjp_kernels(_bwd_kernel, q, k, v, g, beta, h0, do, d_final, scale, chunk_size)
    else:
        grads = _reference_bwd(q, k, v, g, beta, h0, do, d_final, scale, chunk_size)
    return as_inputs(grads, q, k, v, g, beta, h0)
