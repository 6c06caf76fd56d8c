"""Kimi Delta Attention (Kimi Linear, arXiv 2510.26692): the gated delta rule with a per-channel decay, in
PyTorch, with Triton kernels (megatron_zpp/kernels/kda.py) on CUDA.

Recurrence, per batch b and head h (state S is K x V, kept in fp32):

    S_t = (I - b_t k_t k_t^T) Diag(a_t) S_{t-1} + b_t k_t v_t^T        o_t = scale * S_t^T q_t

with a_t = exp(g_t), g_t [K] <= 0 the per-channel log decay (-inf allowed; -inf on every channel is a hard
reset, a packed document's first token) and b_t = beta_t in (0, 1). The layer L2-normalises q and k; this op
does not. Shapes as fla's `chunk_kda` (one value head per key head): q, k [B, T, H, K]; v [B, T, H, V];
g [B, T, H, K]; beta [B, T, H]; states [B, H, K, V]; o [B, T, H, V] in v's dtype (or out_dtype). Work is in fp32
(fp64 when any input is fp64; bf16 is computed in fp32).

    naive_recurrent_kda   the token loop (ops/kda_naive.py; any dtype; the tests' fp64 reference)
    chunk_kda             chunked WY/UT form with its own backward (ops/kda_chunked.py describes it); the
                          Triton kernels on CUDA when they take the call (`chunk_kda_uses_kernels`)

Context parallelism (context_parallel/gdn.py). A slice's entering state acts affinely: S_out = M S_in + U_loc
and o = o_loc + r S_in, r_t = scale * P_t^T q_t, P_t the product of the transitions up to t and M = P_T.
`kda_affine` gives (o_loc, r, U_loc, M): the plain pass, then a transition pass over K x K matrices on its WY
form (ops/delta_rule.py), not K more value columns; `kda_vjp` is the backward of chunk_kda at the entering state
(the slice's outputs and leaving state are chunk_kda(..., initial_state=S_in) exactly). The identity

    chunk_kda(q, k, [v, 0_K], g, beta, initial_state=[0_V, I_K], output_final_state=True)
        == (o' = [o_loc, r], final_state = [U_loc, M])      (V + K value columns)

(the recurrence is linear in (v, S) jointly) is what the tests check those against. The op takes any V != K
and an initial state that requires grad (its gradient is returned). The Triton kernels take V <= 128
(KERNEL_V): chunk_kda runs a wider V in column groups of 128, exactly, since the state's columns never mix; the
caller makes one call whatever the widths.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import dispatch, kda_chunked
from .chunking import check_chunk_size, check_shapes, compute_dtype, from_chunks, to_chunks
from .delta_rule import KERNEL_V, affine_kernels, affine_reference, as_inputs, kernel_ops, padded_to_chunk, vjp_kernels
from .delta_rule import use_kernel as _use_kernel
from .kda_chunked import Decays, bwd_chunks, bwd_states, fwd_output, fwd_states, prepare

__all__ = ["chunk_kda", "chunk_kda_uses_kernels", "ChunkKDAFunction", "kda_affine", "kda_vjp", "KERNEL_V"]

dispatch.register("kda", "chunk fwd/bwd, fp32/bf16, chunk 16-64 (power of 2), K <= 128, V in groups of 128")

_fwd_kernel, _bwd_kernel = kernel_ops("kda", per_channel_gate=True)


def chunk_kda_uses_kernels(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk_size: int) -> bool:
    """Whether chunk_kda runs the Triton kernels for these inputs (else the chunked PyTorch form); a V wider than
    the kernels' runs in column groups."""
    return _use_kernel(chunk_size, q, v[..., :KERNEL_V], k, g, beta)


def _chunks(q, k, v, g, beta, initial_state, chunk_size):
    """The inputs in chunks, in the compute dtype, and the chunk decays."""
    dt = compute_dtype(q, k, v, g, beta, initial_state)
    qc, kc, vc, gc = (to_chunks(x, chunk_size, dt) for x in (q, k, v, g))
    h0 = initial_state.to(dt) if initial_state is not None else None
    return dt, qc, kc, vc, to_chunks(beta, chunk_size, dt), Decays(gc), h0


def _reference_fwd(q, k, v, g, beta, initial_state, scale, chunk_size):
    _, qc, kc, vc, bc, dec, h0 = _chunks(q, k, v, g, beta, initial_state, chunk_size)
    _, W, U = prepare(kc, vc, bc, dec)
    states_in, v_new, final = fwd_states(kc, W, U, dec, h0)
    return from_chunks(fwd_output(qc, kc, v_new, states_in, dec, scale)), final


def _reference_bwd(q, k, v, g, beta, initial_state, do, d_final_state, scale, chunk_size):
    dt, qc, kc, vc, bc, dec, h0 = _chunks(q, k, v, g, beta, initial_state, chunk_size)
    T, W, U = prepare(kc, vc, bc, dec)
    states_in, v_new, _ = fwd_states(kc, W, U, dec, h0)
    doc = to_chunks(do, chunk_size, dt) if do is not None else torch.zeros_like(v_new)
    if callable(d_final_state):  # context parallelism's reverse scan, run while the states above were recomputed
        d_final_state = d_final_state()
    dS = d_final_state.to(dt) if d_final_state is not None else None
    d_ends, dv_new, dh0 = bwd_states(qc, kc, W, dec, doc, dS, scale)
    grads = bwd_chunks(qc, kc, vc, bc, dec, T, W, v_new, states_in, d_ends, doc, dv_new, scale)
    return (*(from_chunks(x) for x in grads), dh0)


def _check(q, k, v, g, beta, initial_state, chunk_size):
    check_shapes(q, k, v, initial_state, True, g=g)
    check_shapes(q, k, v, None, False, beta=beta)
    check_chunk_size(q.shape[1], chunk_size)


class ChunkKDAFunction(torch.autograd.Function):
    """(o [B,T,H,V] in v's dtype or out_dtype, final_state [B,H,K,V] fp32) = chunked KDA with its own backward.

    Saves only the inputs; the backward recomputes T, W, U and the states (one forward's work).
    apply(q, k, v, g, beta, initial_state or None, scale or None (K**-0.5), chunk_size[, out_dtype or None]).
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, chunk_size, out_dtype=None):
        _check(q, k, v, g, beta, initial_state, chunk_size)
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


def chunk_kda(
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
    """Chunked KDA (same result as `kda_naive.naive_recurrent_kda`), any T: a T that is not a multiple of chunk_size
    is padded with identity tokens (ops/delta_rule.padded_to_chunk).

    Returns (o [B,T,H,V] in v's dtype or out_dtype, final state [B,H,K,V] fp32/fp64 or None). Gradients reach
    q, k, v, g, beta and initial_state. out_dtype fp32 for bf16 inputs keeps the fp32 output as computed.
    """
    rest = (scale, initial_state, output_final_state, chunk_size, out_dtype)
    return padded_to_chunk(lambda *x: _chunk_kda(*x, *rest), chunk_size, q, k, v, g, beta)


def _chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size, out_dtype):
    """chunk_kda at a T that is a multiple of chunk_size."""
    V = v.shape[-1]
    if V <= KERNEL_V or not _use_kernel(chunk_size, q, v[..., :KERNEL_V], k, g, beta, initial_state):
        o, final_state = ChunkKDAFunction.apply(q, k, v, g, beta, initial_state, scale, chunk_size, out_dtype)
        return o, (final_state if output_final_state else None)
    # The kernels take KERNEL_V value columns: a column of the state never mixes with another (the transitions
    # act on the K rows) and o's columns are q^T times the state's, so wider V runs exactly in column groups.
    groups = v.split(KERNEL_V, dim=-1)
    states = [None] * len(groups) if initial_state is None else initial_state.split(KERNEL_V, dim=-1)
    outs = [ChunkKDAFunction.apply(q, k, x, g, beta, s, scale, chunk_size, out_dtype) for x, s in zip(groups, states)]
    o, final_state = (torch.cat(parts, dim=-1) for parts in zip(*outs))
    return o, (final_state if output_final_state else None)


def kda_affine(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, chunk_size: int, on_state=None):
    """(o_loc [B,T,H,V], r [B,T,H,K], U [B,H,K,V], M [B,H,K,K]) of a context-parallel slice, no autograd, in the
    state's dtype: S_out = M S_in + U and o = o_loc + r S_in (ops/delta_rule.py: the plain pass, then the
    transition pass over K x K matrices); on_state(U, M) as soon as both are known."""
    _check(q, k, v, g, beta, None, chunk_size)
    if chunk_kda_uses_kernels(q, k, v, g, beta, chunk_size):
        return affine_kernels(_fwd_kernel, q, k, v, g, beta, scale, chunk_size, on_state)
    return affine_reference(kda_chunked, q, k, v, g, beta, scale, chunk_size, on_state)


def kda_vjp(q, k, v, g, beta, h0: Tensor, do: Tensor, d_final, scale: float, chunk_size: int):
    """(dq, dk, dv, dg, dbeta, dh0) of chunk_kda(q, k, v, g, beta, initial_state=h0) for the cotangents do (of o, in
    v's dtype) and d_final (of the final state; or a function returning it, called once the recompute is done),
    no autograd: context parallelism's backward (ops/delta_rule.py)."""
    if _use_kernel(chunk_size, q, v[..., :KERNEL_V], k, g, beta, h0, do):  # d_final: h0's dtype
        grads = vjp_kernels(_bwd_kernel, q, k, v, g, beta, h0, do, d_final, scale, chunk_size)
    else:
        grads = _reference_bwd(q, k, v, g, beta, h0, do, d_final, scale, chunk_size)
    return as_inputs(grads, q, k, v, g, beta, h0)
