"""The delta-rule ops (Gated DeltaNet: ops/gdn.py; Kimi Delta Attention: ops/kda.py) written once: `DeltaRuleOp`
binds a family's chunked PyTorch form (ops/gdn_chunked.py, ops/kda_chunked.py) and its Triton kernels
(kernels/<family>.py, as the custom ops <family>_fwd / <family>_bwd with their fakes) and dispatches between them:
which calls the kernels take, the autograd Function, a T padded to the chunk, a V wider than the kernels' in
column groups. The two families differ only in the decay's shape: a scalar per head (GDN, g [B, T, H]) or one per
key channel (KDA, g [B, T, H, K]), so their gate gradient has that shape too.

And the two passes of context parallelism (context_parallel/delta_rule.py), written once for both families. A slice
acts on the state entering it affinely, S_out = M S_in + U and o = o_loc + r S_in (r [T, K]), r_t = scale P_t^T q_t
with P_t the product of the transitions up to t and M = P_T. As the recurrence is linear in (v, S) jointly,

    op(q, k, [v, 0_K], g, beta, initial_state=[0_V, I_K], output_final_state=True)
        == (o' = [o_loc, r], final_state = [U, M])      (V + K value columns)

which is what the tests check the two passes against. The op takes any V != K and an initial state that requires
grad (its gradient is returned); the Triton kernels take V <= KERNEL_V and the op runs a wider V in column groups,
exactly (a column of the state never mixes with another): the caller makes one call whatever the widths.

    affine    (o_loc, r, U, M): the plain local pass from a zero state (o_loc, U), then the transition pass
              over K x K matrices only. Per chunk n, from the WY form the local pass already built (W [C, K]),
              the chunk's map of its entering state is
                  S_out = (D_n - (k exp(suf))^T W) S_in + ...,    o = scale (q exp(G) - A W) S_in + ...
              (D_n the chunk's decay, scalar or per key row; A the intra-chunk scores), so with P_0 = I,
                  r_n = scale (q exp(G) - A W) P_n,    P_{n+1} = D_n P_n - (k exp(suf))^T (W P_n),    M = P_N
              a rank-C update of a K x K matrix per chunk (4 C K^2 flops), not K more value columns through
              every step of the local pass (U, o and the states' share of its forward and backward).
    vjp       the backward: the slice's outputs and leaving state are chunk_<op>(q, k, v, g, beta, S_in) exactly,
              so q..beta get their gradients from ONE backward of the plain op at the entering state S_in with
              the cotangents (do, dS_out): no gradient flows through r, U or M (their gradients would only
              reach q..beta again), and dS_in = dS_corr + M^T dS_out comes out as its initial state's gradient.

Overlap (the chunked PyTorch forms): `affine` hands (U, M) to its caller (on_state) before it computes the
outputs' share (o_loc, r), so the scan runs meanwhile; `vjp` takes dS_out as a function and calls it only once
the backward's recompute (the WY form and the states from S_in) is done, so the reverse scan runs under that.
On the kernels a launch returns the outputs and the state together (no side streams yet, as GLA's operator).

On the kernels both run the families' existing kernels (the plain pass in column groups of KERNEL_V, the
transition pass as a forward on zero values from I, the vjp as their backward from S_in); elsewhere the chunked
PyTorch forms, sharing the local pass's WY form with the transition pass."""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
from torch import Tensor

from . import dispatch
from .chunking import check_chunk_size, check_shapes, compute_dtype, from_chunks, to_chunks

KERNEL_V = 128  # the kernels' widest V: the ops run a wider V in column groups of this width


def use_kernel(chunk_size: int, q: Tensor, v: Tensor, *others: Tensor | None) -> bool:
    """Whether the Triton kernels take this call; else the chunked PyTorch reference."""
    if not dispatch.use_triton(v):
        return False
    tensors = [t for t in (q, v, *others) if t is not None]
    C, K, V = chunk_size, q.shape[-1], v.shape[-1]
    return (
        all(t.dtype in (torch.float32, torch.bfloat16) for t in tensors)
        and 16 <= C <= 64
        and C & (C - 1) == 0
        and q.shape[1] > 0
        and K <= 128
        and V <= KERNEL_V
    )


def kernel_ops(family: str, per_channel_gate: bool):
    """(forward, backward) of megatron_zpp/kernels/<family>.py as the custom ops <family>_fwd / <family>_bwd."""

    def kernels():  # lazily: triton is needed only once a kernel runs
        return importlib.import_module(f"megatron_zpp.kernels.{family}")

    def fwd(
        q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None, scale: float,
        chunk_size: int,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        return kernels().fwd(q, k, v, g, beta, initial_state, scale, chunk_size)

    def bwd(
        q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None, do: Tensor | None,
        d_final_state: Tensor | None, scale: float, chunk_size: int,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
        return kernels().bwd(q, k, v, g, beta, initial_state, do, d_final_state, scale, chunk_size)

    fwd_op, bwd_op = dispatch.kernel_op(f"{family}_fwd")(fwd), dispatch.kernel_op(f"{family}_bwd")(bwd)

    @fwd_op.register_fake
    def _(q, k, v, g, beta, initial_state, scale, chunk_size):
        B, T, H, K = q.shape
        return dispatch.fake_fp32(q, B, T, H, v.shape[-1]), dispatch.fake_fp32(q, B, H, K, v.shape[-1])

    @bwd_op.register_fake
    def _(q, k, v, g, beta, initial_state, do, d_final_state, scale, chunk_size):
        B, T, H, K = q.shape
        V, dg = v.shape[-1], (B, T, H, K) if per_channel_gate else (B, T, H)
        shapes = ((B, T, H, K), (B, T, H, K), (B, T, H, V), dg, (B, T, H), (B, H, K, V))  # dq dk dv dg db dh0
        return tuple(dispatch.fake_fp32(q, *shape) for shape in shapes)

    return fwd_op, bwd_op


# ---------------------------------------------------------------- context parallelism's passes


def transition_chain(W: Tensor, k_end: Tensor, decay: Tensor) -> tuple[Tensor, Tensor]:
    """(P [B,H,N,K,K] the transitions from the slice's start to each chunk's, M [B,H,K,K] to its end) from the
    chunks' W, k exp(suf) [B,H,N,C,K] and decay [B,H,N,1 or K] (a scalar or one per key row):
    P_0 = I, P_{n+1} = D_n P_n - k_end_n^T (W_n P_n), M = P_N."""
    B, H, N, C, K = W.shape
    P = torch.eye(K, dtype=W.dtype, device=W.device).expand(B, H, K, K)
    prefixes, k_end_t = [], k_end.transpose(-1, -2)
    for n in range(N):
        prefixes.append(P)
        P = decay[:, :, n, :, None] * P - k_end_t[:, :, n] @ (W[:, :, n] @ P)
    return torch.stack(prefixes, 2), P


def affine_reference(chunked: ModuleType, q, k, v, g, beta, scale: float, chunk_size: int, on_state=None):
    """(o_loc, r, U, M) by the chunked PyTorch form `chunked` (ops/gdn_chunked.py or ops/kda_chunked.py): one
    WY form for the plain local pass and the transition pass. on_state(U, M), if given, is called as soon as the
    two are known, before the outputs' share (o_loc, r) is computed: a scan can start while that runs."""
    dt = compute_dtype(q, k, v, g, beta)
    qc, kc, vc, gc, bc = (to_chunks(x, chunk_size, dt) for x in (q, k, v, g, beta))
    dec = chunked.Decays(gc)
    _, W, U = chunked.prepare(kc, vc, bc, dec)
    states_in, v_new, U_slice = chunked.fwd_states(kc, W, U, dec, None)
    q_start, A, k_end, decay = chunked.entering_factors(qc, kc, dec)
    P, M = transition_chain(W, k_end, decay)
    if on_state is not None:
        on_state(U_slice, M)
    o_loc = scale * (q_start @ states_in + A @ v_new)
    r = (scale * (q_start - A @ W)) @ P
    return from_chunks(o_loc), from_chunks(r), U_slice, M


def affine_kernels(fwd, q, k, v, g, beta, scale: float, chunk_size: int, on_state=None):
    """(o_loc, r, U, M) on the kernels: the plain pass in column groups of KERNEL_V, and (r, M) as the forward on K
    zero value columns from the initial state I (K <= KERNEL_V); on_state(U, M) at the end (a kernel returns the
    outputs and the state together: nothing left to overlap on this path)."""
    outs = [fwd(q, k, x, g, beta, None, scale, chunk_size) for x in v.split(KERNEL_V, dim=-1)]
    o_loc, U = (torch.cat(parts, dim=-1) for parts in zip(*outs))
    B, T, H, K = q.shape
    eye = torch.eye(K, dtype=torch.float32, device=q.device).expand(B, H, K, K).contiguous()
    r, M = fwd(q, k, v.new_zeros(B, T, H, K), g, beta, eye, scale, chunk_size)
    if on_state is not None:
        on_state(U, M)
    return o_loc, r, U, M


def vjp_kernels(bwd, q, k, v, g, beta, h0, do, d_final, scale: float, chunk_size: int):
    """The op's backward on the kernels, V in column groups of KERNEL_V: (dq, dk, dv, dg, dbeta, dh0)."""
    d_final = d_final() if callable(d_final) else d_final
    cols = lambda x: x.split(KERNEL_V, dim=-1)  # noqa: E731
    parts = []
    for x, s, d, e in zip(cols(v), cols(h0), cols(do), cols(d_final)):
        parts.append(bwd(q, k, x, g, beta, s, d, e, scale, chunk_size))
    dq, dk, dv, dg, dbeta, dh0 = zip(*parts)
    return sum(dq), sum(dk), torch.cat(dv, dim=-1), sum(dg), sum(dbeta), torch.cat(dh0, dim=-1)


def as_inputs(grads, *inputs: Tensor) -> tuple[Tensor, ...]:
    """Each gradient in its input's dtype."""
    return tuple(d.to(x.dtype) for d, x in zip(grads, inputs))


def padded_to_chunk(fn, chunk_size: int, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor):
    """fn(q, k, v, g, beta) -> (o [B, T', ...], *rest) at a T' that is a multiple of chunk_size: a T that is not is
    padded at the end with identity tokens (k = 0, beta = 0, g = 0: S_t = S_{t-1}, for GDN's scalar and KDA's
    per-channel decay alike), which change neither the state nor the outputs before them; their outputs are
    dropped, so the final state and every gradient are those of the T tokens."""
    T = q.shape[1]
    pad = -T % chunk_size if chunk_size > 0 else 0
    if not pad:
        return fn(q, k, v, g, beta)
    q, k, v, g, beta = (torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (q, k, v, g, beta))
    o, *rest = fn(q, k, v, g, beta)
    return (o[:, :T], *rest)


# ---------------------------------------------------------------- one family's op, written once


class DeltaRuleOp:
    """A delta-rule family's op: `chunked` its chunked PyTorch form (Decays, prepare, fwd_states, fwd_output,
    bwd_states, bwd_chunks, entering_factors), kernels/<family>.py its Triton kernels (fwd, bwd), g [B, T, H, K]
    when `per_channel_gate` else [B, T, H]. ops/gdn.py and ops/kda.py each build one and name its parts."""

    def __init__(self, family: str, chunked: ModuleType, per_channel_gate: bool):
        self.family, self.chunked, self.per_channel_gate = family, chunked, per_channel_gate
        self.fwd_kernel, self.bwd_kernel = kernel_ops(family, per_channel_gate)
        self.function = _chunk_function(self)

    def check(self, q, k, v, g, beta, initial_state, chunk_size: int) -> None:
        """The inputs' shapes and the chunk size, refused in one line (ops/chunking.py)."""
        check_shapes(q, k, v, initial_state, self.per_channel_gate, g=g)
        check_shapes(q, k, v, None, False, beta=beta)
        check_chunk_size(q.shape[1], chunk_size)

    def uses_kernels(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk_size: int) -> bool:
        """Whether the op runs the Triton kernels for these inputs (else the chunked PyTorch form); a V wider than
        the kernels' runs in column groups."""
        return use_kernel(chunk_size, q, v[..., :KERNEL_V], k, g, beta)

    def _chunks(self, q, k, v, g, beta, initial_state, chunk_size):
        """The inputs in chunks, in the compute dtype, and the chunk decays."""
        dt = compute_dtype(q, k, v, g, beta, initial_state)
        qc, kc, vc, gc = (to_chunks(x, chunk_size, dt) for x in (q, k, v, g))
        h0 = initial_state.to(dt) if initial_state is not None else None
        return dt, qc, kc, vc, to_chunks(beta, chunk_size, dt), self.chunked.Decays(gc), h0

    def reference_fwd(self, q, k, v, g, beta, initial_state, scale, chunk_size):
        """(o, final state) by the chunked PyTorch form."""
        _, qc, kc, vc, bc, dec, h0 = self._chunks(q, k, v, g, beta, initial_state, chunk_size)
        _, W, U = self.chunked.prepare(kc, vc, bc, dec)
        states_in, v_new, final = self.chunked.fwd_states(kc, W, U, dec, h0)
        return from_chunks(self.chunked.fwd_output(qc, kc, v_new, states_in, dec, scale)), final

    def reference_bwd(self, q, k, v, g, beta, initial_state, do, d_final_state, scale, chunk_size):
        """(dq, dk, dv, dg, dbeta, dh0) by the chunked PyTorch form; d_final_state may be a function returning it."""
        chunked = self.chunked
        dt, qc, kc, vc, bc, dec, h0 = self._chunks(q, k, v, g, beta, initial_state, chunk_size)
        T, W, U = chunked.prepare(kc, vc, bc, dec)
        states_in, v_new, _ = chunked.fwd_states(kc, W, U, dec, h0)
        doc = to_chunks(do, chunk_size, dt) if do is not None else torch.zeros_like(v_new)
        if callable(d_final_state):  # context parallelism's reverse scan, run while the states above were recomputed
            d_final_state = d_final_state()
        dS = d_final_state.to(dt) if d_final_state is not None else None
        d_ends, dv_new, dh0 = chunked.bwd_states(qc, kc, W, dec, doc, dS, scale)
        grads = chunked.bwd_chunks(qc, kc, vc, bc, dec, T, W, v_new, states_in, d_ends, doc, dv_new, scale)
        return (*(from_chunks(x) for x in grads), dh0)

    def __call__(self, q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size, out_dtype):
        """The op at any T (padded_to_chunk): (o, final state or None)."""
        rest = (scale, initial_state, output_final_state, chunk_size, out_dtype)
        return padded_to_chunk(lambda *x: self._whole_chunks(*x, *rest), chunk_size, q, k, v, g, beta)

    def _whole_chunks(self, q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size, out_dtype):
        """The op at a T that is a multiple of chunk_size."""
        if v.shape[-1] <= KERNEL_V or not use_kernel(chunk_size, q, v[..., :KERNEL_V], k, g, beta, initial_state):
            o, final_state = self.function.apply(q, k, v, g, beta, initial_state, scale, chunk_size, out_dtype)
            return o, (final_state if output_final_state else None)
        # The kernels take KERNEL_V value columns: a column of the state never mixes with another (the transitions
        # act on the K rows) and o's columns are q^T times the state's, so wider V runs exactly in column groups.
        groups = v.split(KERNEL_V, dim=-1)
        states = [None] * len(groups) if initial_state is None else initial_state.split(KERNEL_V, dim=-1)
        apply = self.function.apply
        outs = [apply(q, k, x, g, beta, s, scale, chunk_size, out_dtype) for x, s in zip(groups, states)]
        o, final_state = (torch.cat(parts, dim=-1) for parts in zip(*outs))
        return o, (final_state if output_final_state else None)

    def affine(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, chunk_size: int, on_state=None
    ):
        """(o_loc [B,T,H,V], r [B,T,H,K], U [B,H,K,V], M [B,H,K,K]) of a context-parallel slice, no autograd, in
        the state's dtype: S_out = M S_in + U and o = o_loc + r S_in (the plain pass, then the transition pass over
        K x K matrices); on_state(U, M) as soon as both are known."""
        self.check(q, k, v, g, beta, None, chunk_size)
        if self.uses_kernels(q, k, v, g, beta, chunk_size):
            return affine_kernels(self.fwd_kernel, q, k, v, g, beta, scale, chunk_size, on_state)
        return affine_reference(self.chunked, q, k, v, g, beta, scale, chunk_size, on_state)

    def vjp(self, q, k, v, g, beta, h0: Tensor, do: Tensor, d_final, scale: float, chunk_size: int):
        """(dq, dk, dv, dg, dbeta, dh0) of the op at initial_state=h0 for the cotangents do (of o, in v's dtype) and
        d_final (of the final state; or a function returning it, called once the recompute is done), no autograd:
        context parallelism's backward."""
        if use_kernel(chunk_size, q, v[..., :KERNEL_V], k, g, beta, h0, do):  # d_final: h0's dtype
            grads = vjp_kernels(self.bwd_kernel, q, k, v, g, beta, h0, do, d_final, scale, chunk_size)
        else:
            grads = self.reference_bwd(q, k, v, g, beta, h0, do, d_final, scale, chunk_size)
        return as_inputs(grads, q, k, v, g, beta, h0)


def _chunk_function(op: DeltaRuleOp) -> type[torch.autograd.Function]:
    """The family's autograd Function (ChunkGDNFunction, ChunkKDAFunction)."""

    class ChunkFunction(torch.autograd.Function):
        """(o [B,T,H,V] in v's dtype or out_dtype, final_state [B,H,K,V] fp32) = the chunked op with its own
        backward. Saves only the inputs; the backward recomputes T, W, U and the states (one forward's work).
        apply(q, k, v, g, beta, initial_state or None, scale or None (K**-0.5), chunk_size[, out_dtype or None])."""

        @staticmethod
        def forward(ctx, q, k, v, g, beta, initial_state, scale, chunk_size, out_dtype=None):
            op.check(q, k, v, g, beta, initial_state, chunk_size)
            scale = q.shape[-1] ** -0.5 if scale is None else scale
            ctx.save_for_backward(q, k, v, g, beta, initial_state)
            ctx.scale, ctx.chunk_size = scale, chunk_size
            ctx.set_materialize_grads(False)  # a None cotangent skips its share of the backward
            use = use_kernel(chunk_size, q, v, k, g, beta, initial_state)
            o, final_state = (op.fwd_kernel if use else op.reference_fwd)(
                q, k, v, g, beta, initial_state, scale, chunk_size
            )
            return o.to(v.dtype if out_dtype is None else out_dtype), final_state

        @staticmethod
        def backward(ctx, do, d_final_state):
            q, k, v, g, beta, initial_state = ctx.saved_tensors
            if do is None and d_final_state is None:
                return (None,) * 9
            if do is not None:  # o's gradient in v's dtype, as the cotangent of an output in v's dtype would be
                do = do.to(v.dtype)
            use = use_kernel(ctx.chunk_size, q, v, k, g, beta, initial_state, do, d_final_state)
            dq, dk, dv, dg, dbeta, dh0 = (op.bwd_kernel if use else op.reference_bwd)(
                q, k, v, g, beta, initial_state, do, d_final_state, ctx.scale, ctx.chunk_size
            )
            dh0 = dh0.to(initial_state.dtype) if initial_state is not None else None
            grads = (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype), dh0)
            return (*grads, None, None, None)

    ChunkFunction.__name__ = ChunkFunction.__qualname__ = f"Chunk{op.family.upper()}Function"
    return ChunkFunction
