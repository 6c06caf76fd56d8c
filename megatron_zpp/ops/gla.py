"""Gated linear attention (GLA) in pure PyTorch.

Recurrence, per batch b and head h (state S is K x V, kept in fp32):

    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t        o_t = scale * q_t S_t

with g_t <= 0 the per-key log decay (-inf allowed: a hard reset). Shapes throughout:
q, k, g: [B, T, H, K]; v: [B, T, H, V]; states: [B, H, K, V]; outputs o: [B, T, H, V] in
v's dtype. Work is done in fp32 (fp64 when any input is fp64; bf16 is computed in fp32).

Chunked form (chunk of C tokens, N = T / C chunks). Building blocks, pure tensor code with
no autograd inside, so that other code (the context-parallel All-Scan) can interleave them
with its communication:

    chunk_gla_fwd_states   the state entering each chunk, and the final state (a scan over N)
    chunk_gla_fwd_output   o from intra-chunk scores plus the entering states (None: intra only)
    ChunkGLAForward        the reference forward in three stages (the local states from a zero
                           state, the intra-chunk output, then the initial state's share)
    chunk_gla_bwd          all gradients; recomputes the states unless given
    ChunkGLABackward       the reference backward in three stages (do's state gradient, the output
                           gradients, then the final-state gradient's share); chunk_gla_bwd chains them

`ChunkGLAFunction` chains them and saves only q, k, v, g (and the initial state); `chunk_gla`
and `chunk_gla_local` call it. Only the K x V recurrences over chunks are sequential loops;
all intra-chunk work is batched over chunks, so time is linear in N.

Numerics and the gradient of g: ops/gla_chunked.py.

The backward is linear in the output and final-state cotangents:

    chunk_gla_bwd(..., do, dS) == chunk_gla_bwd(..., do, None) + chunk_gla_bwd(..., None, dS)

and the dS-only call does no intra-chunk work (the All-Scan computes the do part while the
state gradient travels, then adds the dS part).

`chunk_gla_local` and `gla_state_correction` split a slice's output into the part from a
zero state and the part from an incoming state, which is what the sequence-parallel
All-Scan needs (ZeCO):

    chunk_gla(q, k, v, g, h0) == o_local + gla_state_correction(q, g, h0)
    final_state               == S_local + exp(log_gamma)[..., None] * h0
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import dispatch
from .chunking import check_chunk_size, check_shapes, compute_dtype, from_chunks, to_chunks
from .gla_chunked import ChunkGLABackward, ChunkGLAForward, bwd, chunk_decay, fwd_intra, fwd_output, fwd_states

__all__ = [
    "chunk_gla",
    "chunk_gla_local",
    "gla_state_correction",
    "chunk_gla_fwd_states",
    "chunk_gla_fwd_output",
    "chunk_gla_bwd",
    "ChunkGLAForward",
    "chunk_gla_uses_kernels",
    "ChunkGLABackward",
    "ChunkGLAFunction",
    "GLAStateCorrectionFunction",
]


dispatch.register("gla", "chunk fwd/bwd, fp32/bf16, chunk 16-128 (power of 2), K and V <= 256")


def _use_kernel(chunk_size: int, v: Tensor, qk: Tensor, *others: Tensor | None) -> bool:
    """Whether the Triton chunk kernels (megatron_zpp/kernels/gla.py) take this call; else the reference."""
    if not dispatch.use_triton(v):
        return False
    tensors = [t for t in (v, qk, *others) if t is not None]
    C, T, K, V = chunk_size, qk.shape[1], qk.shape[-1], v.shape[-1]
    return (
        all(t.dtype in (torch.float32, torch.bfloat16) for t in tensors)
        and 16 <= C <= 128
        and C & (C - 1) == 0
        and T > 0
        and K <= 256
        and V <= 256
    )


# The Triton launches as custom ops (dispatch.kernel_op), outputs fp32; autograd stays in the Functions
# below and in context_parallel/gla.py, which interleave these pieces with their communication.


def _kernels():
    from ..kernels import gla  # lazily: triton is needed only once a kernel runs

    return gla


@dispatch.kernel_op("gla_fwd_states")
def _fwd_states_kernel(
    k: Tensor, v: Tensor, g: Tensor, initial_state: Tensor | None, chunk_size: int
) -> tuple[Tensor, Tensor]:
    return _kernels().fwd_states(k, v, g, initial_state, chunk_size)


@_fwd_states_kernel.register_fake
def _(k, v, g, initial_state, chunk_size):
    B, T, H, K = k.shape
    V = v.shape[-1]
    return dispatch.fake_fp32(k, B, H, T // chunk_size, K, V), dispatch.fake_fp32(k, B, H, K, V)


@dispatch.kernel_op("gla_fwd_output")
def _fwd_output_kernel(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, states_in: Tensor, scale: float, chunk_size: int
) -> Tensor:
    return _kernels().fwd_output(q, k, v, g, states_in, scale, chunk_size)


@_fwd_output_kernel.register_fake
def _(q, k, v, g, states_in, scale, chunk_size):
    return dispatch.fake_fp32(q, *q.shape[:3], v.shape[-1])


@dispatch.kernel_op("gla_bwd")
def _bwd_kernel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    initial_state: Tensor | None,
    do: Tensor | None,
    d_final_state: Tensor | None,
    scale: float,
    chunk_size: int,
    states_in: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _kernels().bwd(q, k, v, g, initial_state, do, d_final_state, scale, chunk_size, states_in)


@_bwd_kernel.register_fake
def _(q, k, v, g, initial_state, do, d_final_state, scale, chunk_size, states_in):
    B, T, H, K = q.shape
    V = v.shape[-1]
    dq, dk, dg = (dispatch.fake_fp32(q, B, T, H, K) for _ in range(3))
    return dq, dk, dispatch.fake_fp32(q, B, T, H, V), dg, dispatch.fake_fp32(q, B, H, K, V)


def chunk_gla_fwd_states(
    k: Tensor, v: Tensor, g: Tensor, initial_state: Tensor | None, chunk_size: int
) -> tuple[Tensor, Tensor]:
    """States entering each chunk and the final state.

    k, g: [B, T, H, K]; v: [B, T, H, V]; initial_state: [B, H, K, V] or None (zeros).
    Returns (states_in [B, H, N, K, V], final_state [B, H, K, V]), fp32 (fp64 for fp64 inputs).
    """
    check_shapes(k, k, v, initial_state, True, g=g)
    check_chunk_size(k.shape[1], chunk_size)
    if _use_kernel(chunk_size, v, k, g, initial_state):
        return _fwd_states_kernel(k, v, g, initial_state, chunk_size)
    dt = compute_dtype(k, v, g, initial_state)
    k, v, g = (to_chunks(x, chunk_size, dt) for x in (k, v, g))
    start = initial_state.to(dt) if initial_state is not None else None
    return fwd_states(k, v, chunk_decay(g), start)


def chunk_gla_fwd_output(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, states_in: Tensor | None, scale: float | None, chunk_size: int
) -> Tensor:
    """o = scale * (intra-chunk scores @ v + (q * exp(prefix)) @ states_in), all chunks at once.

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; states_in: [B, H, N, K, V] (from chunk_gla_fwd_states),
    or None for the intra-chunk part only (zero entering states). Returns o [B, T, H, V] in fp32
    (fp64 for fp64 inputs). scale None means K**-0.5.
    """
    check_shapes(q, k, v, None, True, g=g)
    check_chunk_size(q.shape[1], chunk_size)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if _use_kernel(chunk_size, v, q, k, g, states_in):
        if states_in is None:  # the kernel always reads entering states
            B, T, H, K = q.shape
            states_in = q.new_zeros(B, H, T // chunk_size, K, v.shape[-1], dtype=torch.float32)
        return _fwd_output_kernel(q, k, v, g, states_in, scale, chunk_size)
    dt = compute_dtype(q, k, v, g, states_in)
    q, k, v, g = (to_chunks(x, chunk_size, dt) for x in (q, k, v, g))
    if states_in is None:
        return from_chunks(fwd_intra(q, k, v, g, scale))
    return from_chunks(fwd_output(q, k, v, g, chunk_decay(g), states_in.to(dt), scale))


def chunk_gla_uses_kernels(q: Tensor, k: Tensor, v: Tensor, g: Tensor, chunk_size: int) -> bool:
    """Whether chunk_gla_fwd_states / fwd_output / bwd run the Triton kernels for these inputs."""
    return _use_kernel(chunk_size, v, q, k, g)


def chunk_gla_bwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    initial_state: Tensor | None,
    do: Tensor | None,
    d_final_state: Tensor | None,
    scale: float | None,
    chunk_size: int,
    states_in: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of (o, final_state) = GLA(q, k, v, g, initial_state) given do and d_final_state.

    q, k, g: [B, T, H, K]; v, do: [B, T, H, V]; initial_state, d_final_state: [B, H, K, V];
    states_in: [B, H, N, K, V]. do / d_final_state None mean zero, initial_state None means
    zeros, states_in None is recomputed. Returns (dq [B,T,H,K], dk [B,T,H,K], dv [B,T,H,V],
    dg [B,T,H,K], d_initial_state [B,H,K,V]) in fp32 (fp64 for fp64 inputs).

    Linear in (do, d_final_state): bwd(do, dS) == bwd(do, None) + bwd(None, dS). With do None
    there is no intra-chunk work: only the reverse state scan and per-chunk matmuls.
    """
    check_shapes(q, k, v, initial_state, True, g=g)
    check_chunk_size(q.shape[1], chunk_size)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if _use_kernel(chunk_size, v, q, k, g, initial_state, do, d_final_state, states_in):
        return _bwd_kernel(q, k, v, g, initial_state, do, d_final_state, scale, chunk_size, states_in)
    dt = compute_dtype(q, k, v, g, initial_state)
    q, k, v, g = (to_chunks(x, chunk_size, dt) for x in (q, k, v, g))
    decay = chunk_decay(g)
    if states_in is None:
        states_in = fwd_states(k, v, decay, initial_state.to(dt) if initial_state is not None else None)[0]
    do = to_chunks(do, chunk_size, dt) if do is not None else None
    d_final_state = d_final_state.to(dt) if d_final_state is not None else None
    dq, dk, dv, dg, dh0 = bwd(q, k, v, g, decay, states_in.to(dt), do, d_final_state, scale)
    return from_chunks(dq), from_chunks(dk), from_chunks(dv), from_chunks(dg), dh0


# ----------------------------------------------------------------------------------------
# Autograd Functions and the public API


class ChunkGLAFunction(torch.autograd.Function):
    """(o [B,T,H,V] in v's dtype or out_dtype, final_state [B,H,K,V] fp32) = chunked GLA with its own backward.

    Saves only q, k, v, g and initial_state; the backward recomputes the entering states.
    apply(q, k, v, g, initial_state or None, scale or None (K**-0.5), chunk_size[, out_dtype or None]).
    """

    @staticmethod
    def forward(ctx, q, k, v, g, initial_state, scale, chunk_size, out_dtype=None):
        check_shapes(q, k, v, initial_state, True, g=g)
        check_chunk_size(q.shape[1], chunk_size)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        ctx.save_for_backward(q, k, v, g, initial_state)
        ctx.scale, ctx.chunk_size = scale, chunk_size
        out_dtype = v.dtype if out_dtype is None else out_dtype
        ctx.set_materialize_grads(False)  # a None cotangent skips its share of the backward
        if _use_kernel(chunk_size, v, q, k, g, initial_state):  # the building blocks run the kernels
            states_in, final_state = chunk_gla_fwd_states(k, v, g, initial_state, chunk_size)
            return chunk_gla_fwd_output(q, k, v, g, states_in, scale, chunk_size).to(out_dtype), final_state
        dt = compute_dtype(q, k, v, g, initial_state)
        qc, kc, vc, gc = (to_chunks(x, chunk_size, dt) for x in (q, k, v, g))
        decay = chunk_decay(gc)
        start = initial_state.to(dt) if initial_state is not None else None
        states_in, final_state = fwd_states(kc, vc, decay, start)
        o = fwd_output(qc, kc, vc, gc, decay, states_in, scale)
        return from_chunks(o).to(out_dtype), final_state

    @staticmethod
    def backward(ctx, do, d_final_state):
        q, k, v, g, initial_state = ctx.saved_tensors
        if do is None and d_final_state is None:
            return (None,) * 8
        if do is not None:  # o's gradient in v's dtype, as the cotangent of an output in v's dtype would be
            do = do.to(v.dtype)
        dq, dk, dv, dg, dh0 = chunk_gla_bwd(q, k, v, g, initial_state, do, d_final_state, ctx.scale, ctx.chunk_size)
        dh0 = dh0.to(initial_state.dtype) if initial_state is not None else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dh0, None, None, None


class GLAStateCorrectionFunction(torch.autograd.Function):
    """scale * (q * exp(B_t)) @ state_in with B_t = sum_{s<=t} g_s; saves only q, g and state_in.

    apply(q [B,T,H,K], g [B,T,H,K], state_in [B,H,K,V], scale) -> [B,T,H,V] in q's dtype.
    """

    @staticmethod
    def forward(ctx, q, g, state_in, scale):
        dt = compute_dtype(q, g, state_in)
        q_dec = q.to(dt) * g.to(dt).cumsum(dim=1).exp()
        ctx.save_for_backward(q, g, state_in)
        ctx.scale = scale
        return (torch.einsum("bthk,bhkv->bthv", q_dec, state_in.to(dt)) * scale).to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, g, state_in = ctx.saved_tensors
        dt = compute_dtype(q, g, state_in)
        decay = g.to(dt).cumsum(dim=1).exp()
        q_dt, do = q.to(dt), do.to(dt) * ctx.scale
        d_state = torch.einsum("bthk,bthv->bhkv", q_dt * decay, do)
        dq = torch.einsum("bthv,bhkv->bthk", do, state_in.to(dt)) * decay
        # dg_t = sum_{u>=t} q_u * dq_u over the slice: with no k*dk term there is no pair of large
        # terms that cancel, so one reverse cumsum is accurate here (it is what autograd computed).
        dg = (q_dt * dq).flip(1).cumsum(1).flip(1)
        return dq.to(q.dtype), dg.to(g.dtype), d_state.to(state_in.dtype), None


def chunk_gla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 16,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Chunked GLA (same result as `gla_naive.naive_recurrent_gla`). T must be a multiple of chunk_size.

    Returns (o [B,T,H,V] in v's dtype or out_dtype, final state [B,H,K,V] fp32/fp64 or None). out_dtype
    fp32 for bf16 inputs keeps the fp32 output as computed (no bf16 rounding; o's gradient is still taken
    in v's dtype).
    """
    o, final_state = ChunkGLAFunction.apply(q, k, v, g, initial_state, scale, chunk_size, out_dtype)
    return o, (final_state if output_final_state else None)


def chunk_gla_local(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float | None = None, chunk_size: int = 16
) -> tuple[Tensor, Tensor, Tensor]:
    """Local pass of one sequence slice from a zero state.

    Returns (o_local [B,T,H,V] in v's dtype, S_local [B,H,K,V] fp32, log_gamma [B,H,K] fp32),
    log_gamma being the slice's total log decay sum_t g_t (fp64 kept when inputs are fp64).
    """
    o, S = chunk_gla(q, k, v, g, scale, None, True, chunk_size)
    log_gamma = g.to(compute_dtype(q, k, v, g)).sum(dim=1)
    return o, S, log_gamma


def gla_state_correction(q: Tensor, g: Tensor, state_in: Tensor, scale: float | None = None) -> Tensor:
    """Output contribution of an incoming state: scale * (q * exp(B_t)) @ state_in.

    q, g: [B, T, H, K]; state_in: [B, H, K, V]. B_t = sum_{s<=t} g_s from the slice's first
    token (<= 0, so exp never overflows). Returns [B, T, H, V] in q's dtype.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return GLAStateCorrectionFunction.apply(q, g, state_in, scale)
