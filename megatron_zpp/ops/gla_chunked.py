"""The chunked GLA computation on [B, H, N, C, D] blocks (N chunks of C tokens), pure tensor code
in the compute dtype (fp32, fp64 for fp64 inputs), no autograd inside (the chunk layout and the
checks: ops/chunking.py, shared with Gated DeltaNet): segment sums and decays, the state scans
over chunks, the forward and the backward, and their stages (ChunkGLAForward, ChunkGLABackward)
for code that interleaves them with communication (the context-parallel All-Scan). ops/gla.py
builds the public building blocks and the autograd Functions on them, and dispatches to the Triton
kernels.

Numerics: decays are never differences of long cumulative sums. Inside a chunk, in sub-blocks
of ~sqrt(C) tokens, the pairwise decay exp(sum_{j<s<=i} g_s) of two tokens of one sub-block is
a segment sum accumulated over its own tokens (Mamba-2's segsum, one diagonal i - j at a time,
so the pairs j > i are never formed); pairs in different sub-blocks factor through exclusive
suffix sums in j's sub-block, the sums of the sub-blocks in between and prefix sums in i's.
q's inter-chunk factor is a prefix sum from the chunk start, k's factor into the chunk's end
state an exclusive suffix sum (shifted, not total minus prefix). Only sums of g <= 0 are
exponentiated and nothing multiplies an infinity, so -inf gates (exp = 0) give finite outputs
and gradients; the gradient of g is exactly 0 there.

Gradient of g: with b_t the cumulative log decay, dL/db_t = q_t*dq_t - k_t*dk_t (full dq, dk)
and dg_t = sum_{u>=t} dL/db_u. It is applied chunk-locally, never as one long cumsum of
cancelling terms: for t in chunk n, dg_t = (reverse cumsum within chunk n of q*dq - k*dk)_t
+ sum_V S_end(n) * dS_end(n), dS_end(n) being the gradient reaching the state leaving chunk n
from later chunks (and d_final_state). `decay_grad` evaluates an exact rearrangement of it
that also drops the cancellation between the boundary term and k*dk of the inter-chunk part.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .chunking import check_chunk_size, check_shapes, compute_dtype, from_chunks, to_chunks

# ----------------------------------------------------------------------------------------
# Segment sums


def _suffix_sum_exclusive(x: Tensor, dim: int) -> Tensor:
    """out_j = sum_{s > j} x_s along dim: a reverse cumsum shifted by one (not total - prefix)."""
    n = x.shape[dim]
    out = torch.zeros_like(x)
    out.narrow(dim, 0, n - 1).copy_(x.flip(dim).cumsum(dim).narrow(dim, 0, n - 1).flip(dim))
    return out


def _prefix_sum_exclusive(x: Tensor, dim: int) -> Tensor:
    """out_j = sum_{s < j} x_s along dim: a cumsum shifted by one."""
    n = x.shape[dim]
    out = torch.zeros_like(x)
    out.narrow(dim, 1, n - 1).copy_(x.cumsum(dim).narrow(dim, 0, n - 1))
    return out


def sub_block(C: int) -> int:
    """Sub-block size ~sqrt(C): decay tensors are C*(c-1)/2*K (pairs in a sub-block) and C*(C/c)*K, not C*C*K."""
    return next((c for c in (4, 8, 16) if c * c >= C and C % c == 0), C)


class _IntraDecay(NamedTuple):
    """Decay factors of chunks split in M sub-blocks of c tokens; every exponent is <= 0.

    For i in sub-block I, j in sub-block J < I the decay exp(sum_{j<s<=i} g_s) factors as
    k_out[J, j] * between[I, J] * q_in[I, i]; for J == I and i - j = d >= 1 it is near[d-1][I, i-d].
    """

    near: list[Tensor]  # d = 1..c-1: [..., M, c-d, K] exp(sum_{i-d<s<=i} g_s) for i = d..c-1 of each sub-block
    q_in: Tensor  # [..., M, c, K] exp(sum from the sub-block's start to i, inclusive)
    k_out: Tensor  # [..., M, c, K] exp(sum from after j to the sub-block's end)
    between: Tensor  # [..., M(I), M(J), K] exp(sum over the sub-blocks strictly between J and I); 0 for J >= I


def _near_decays(gs: Tensor) -> list[Tensor]:
    """gs [..., c, K] -> for d = 1..c-1, exp(sum_{i-d<s<=i} g_s) for i = d..c-1: [..., c-d, K].

    Each segment sum is accumulated token by token over its own segment (no difference of two
    sums), and only the c(c-1)/2 pairs below the diagonal are ever formed or exponentiated.
    """
    c = gs.shape[-2]
    decays, seg = [], None
    for d in range(1, c):
        seg = gs[..., d:, :] if seg is None else seg[..., 1:, :] + gs[..., 1 : c - d + 1, :]
        decays.append(seg.exp())
    return decays


def _between_decays(block_sums: Tensor) -> Tensor:
    """Sub-block totals [..., M, K] -> [..., M(I), M(J), K]: exp(sum_{J<L<I} block_sums_L); 0 for J >= I."""
    M = block_sums.shape[-2]
    out = block_sums.new_zeros(*block_sums.shape[:-1], M, block_sums.shape[-1])
    out.diagonal(-1, dim1=-3, dim2=-2).fill_(1.0)  # adjacent sub-blocks: nothing between
    for d, decay in enumerate(_near_decays(block_sums[..., :-1, :]), 2):  # J = I - d
        out.diagonal(-d, dim1=-3, dim2=-2).copy_(decay.movedim(-2, -1))
    return out


def _intra_decay(g: Tensor) -> _IntraDecay:
    """g: [..., C, K] chunked log decays -> the factors of `_IntraDecay`."""
    C = g.shape[-2]
    c = sub_block(C)
    gs = g.unflatten(-2, (C // c, c))  # [..., M, c, K]
    return _IntraDecay(
        near=_near_decays(gs),
        q_in=gs.cumsum(-2).exp(),
        k_out=_suffix_sum_exclusive(gs, -2).exp(),
        between=_between_decays(gs.sum(-2)),
    )


# ----------------------------------------------------------------------------------------
# Intra-chunk scores and their adjoint


def _keys_between(k: Tensor, dec: _IntraDecay) -> Tensor | None:
    """[..., M(I), C(J, j), K]: k_j decayed to the start of sub-block I (0 unless J < I); None if M == 1.

    Row block I of the scores is then one matmul: (q * q_in)[I] @ keys_between[I]^T.
    """
    M, c = dec.q_in.shape[-3:-1]
    if M == 1:
        return None
    k_dec = k.unflatten(-2, (M, c)) * dec.k_out
    return (dec.between[..., :, :, None, :] * k_dec[..., None, :, :, :]).flatten(-3, -2)


def _queries_between(q: Tensor, dec: _IntraDecay) -> Tensor:
    """[..., M(J), C(I, i), K]: q_i with the decay from the end of sub-block J (0 unless I > J)."""
    M, c = dec.q_in.shape[-3:-1]
    q_dec = q.unflatten(-2, (M, c)) * dec.q_in
    between_t = dec.between.transpose(-3, -2).contiguous()  # else the product inherits its strides and flatten copies
    return (between_t[..., :, :, None, :] * q_dec[..., None, :, :, :]).flatten(-3, -2)


def _diag_blocks(x: Tensor, M: int) -> Tensor:
    """View of the M diagonal c x c blocks of x [..., C, C] as [..., c, c, M]."""
    return x.unflatten(-1, (M, -1)).unflatten(-3, (M, -1)).diagonal(dim1=-4, dim2=-2)


def _intra_scores(q: Tensor, k: Tensor, dec: _IntraDecay, keys_between: Tensor | None) -> Tensor:
    """A_ij = sum_k q_ik k_jk exp(sum_{j<s<=i} g_sk) for j <= i, else 0. q, k: [..., C, K] -> [..., C, C]."""
    M, c = dec.q_in.shape[-3:-1]
    qs, ks = q.unflatten(-2, (M, c)), k.unflatten(-2, (M, c))
    if keys_between is None:
        a = q.new_zeros(*q.shape[:-1], c)
    else:
        a = ((qs * dec.q_in) @ keys_between.transpose(-1, -2)).flatten(-3, -2)  # [..., C, C]
    a_same = _diag_blocks(a, M).movedim(-1, -3)  # [..., M, c, c] view
    a_same.diagonal(dim1=-2, dim2=-1).copy_((qs * ks).sum(-1))
    for d, decay in enumerate(dec.near, 1):  # pairs (i, i - d) of one sub-block
        a_same.diagonal(-d, dim1=-2, dim2=-1).copy_((qs[..., d:, :] * decay * ks[..., :-d, :]).sum(-1))
    return a


def _intra_score_grads(
    q: Tensor, k: Tensor, dA: Tensor, dec: _IntraDecay, keys_between: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Gradients of q and k through A = _intra_scores(q, k) given dA [..., C, C], except the same-token
    pairs (dA's diagonal is ignored: the caller adds dA_ii k_i and dA_ii q_i). Returns [..., C, K] each.

    dA need not be masked: only pairs j < i are read.
    """
    M, c = dec.q_in.shape[-3:-1]
    qs, ks = q.unflatten(-2, (M, c)), k.unflatten(-2, (M, c))
    if keys_between is not None:  # pairs in earlier sub-blocks
        dq = dec.q_in * (dA.unflatten(-2, (M, c)) @ keys_between)
        dk = dec.k_out * (dA.transpose(-1, -2).unflatten(-2, (M, c)) @ _queries_between(q, dec))
    else:
        dq, dk = torch.zeros_like(qs), torch.zeros_like(ks)
    dA_same = _diag_blocks(dA, M).movedim(-1, -3)  # [..., M, c, c] view
    for d, decay in enumerate(dec.near, 1):  # pairs (i, i - d) of one sub-block
        w = dA_same.diagonal(-d, dim1=-2, dim2=-1)[..., None] * decay  # [..., M, c-d, K]
        dq[..., d:, :].addcmul_(w, ks[..., :-d, :])
        dk[..., :-d, :].addcmul_(w, qs[..., d:, :])
    return dq.flatten(-3, -2), dk.flatten(-3, -2)


# ----------------------------------------------------------------------------------------
# Scans over chunks (the only sequential loops)


def _scan_chunks(
    log_decay: Tensor, inputs: Tensor | None, start: Tensor | None, reverse: bool
) -> tuple[Tensor, Tensor]:
    """carry <- exp(log_decay[n]) * carry + inputs[n] over n = 0..N-1 (N-1..0 when reverse).

    log_decay: [B, H, N, K]; inputs: [B, H, N, K, V] or None (zero); start: [B, H, K, V] or None
    (zero). Returns (carries [B, H, N, K, V]: the carry before step n, the carry after the last step).
    """
    B, H, N, K = log_decay.shape
    V = (inputs if inputs is not None else start).shape[-1]
    carry = start if start is not None else log_decay.new_zeros(B, H, K, V)
    if N == 0:
        return log_decay.new_empty(B, H, N, K, V), carry
    decays = log_decay.exp()[..., None].unbind(2)
    steps = inputs.unbind(2) if inputs is not None else None
    carries: list[Tensor] = [carry] * N
    # one small op per chunk, stacked once at the end: no out= into strided views, which
    # torch.compile cannot trace (--torch-compile compiles the whole block with this scan in it)
    for n in range(N - 1, -1, -1) if reverse else range(N):
        carries[n] = carry
        carry = decays[n] * carry if steps is None else torch.addcmul(steps[n], decays[n], carry)
    return torch.stack(carries, 2), carry


class _ChunkDecay(NamedTuple):
    """Chunk-level decays of chunked g [B, H, N, C, K]."""

    q_in: Tensor  # [B, H, N, C, K] exp(sum from the chunk start to t, inclusive): q's factor onto S_in
    k_out: Tensor  # [B, H, N, C, K] exp(sum from after t to the chunk end): k's factor into S_end
    log_total: Tensor  # [B, H, N, K] the chunk's total log decay


def chunk_decay(g: Tensor) -> _ChunkDecay:
    prefix = g.cumsum(-2)
    return _ChunkDecay(prefix.exp(), _suffix_sum_exclusive(g, -2).exp(), prefix[..., -1, :])


# ----------------------------------------------------------------------------------------
# The chunked computation, on [B, H, N, C, D] blocks in the compute dtype


def fwd_states(k: Tensor, v: Tensor, decay: _ChunkDecay, start: Tensor | None) -> tuple[Tensor, Tensor]:
    """(states_in [B, H, N, K, V], final state [B, H, K, V])."""
    updates = (k * decay.k_out).transpose(-1, -2) @ v  # each chunk's end state from a zero state
    return _scan_chunks(decay.log_total, updates, start, reverse=False)


def fwd_intra(q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float) -> Tensor:
    """o [B, H, N, C, V] = scale * intra-chunk scores @ v: the output from zero entering states."""
    intra = _intra_decay(g)
    return (_intra_scores(q, k, intra, _keys_between(k, intra)) @ v).mul_(scale)


def _fwd_inter(o: Tensor, q: Tensor, q_in: Tensor, states_in: Tensor, scale: float) -> Tensor:
    """o += scale * (q * q_in) @ states_in, in place: the entering states' share of the output."""
    return o.add_((q * q_in) @ states_in, alpha=scale)


def fwd_output(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, decay: _ChunkDecay, states_in: Tensor, scale: float
) -> Tensor:
    """o [B, H, N, C, V] = scale * (intra-chunk scores @ v + (q * q_in) @ states_in)."""
    intra = _intra_decay(g)
    o = _intra_scores(q, k, intra, _keys_between(k, intra)) @ v
    o += (q * decay.q_in) @ states_in  # scaled once, after the sum
    return o.mul_(scale)


def _decayed_over_chunks(log_total: Tensor, state: Tensor, before: bool) -> Tensor:
    """[B, H, N, K, V]: exp(sum of log_total over the chunks before n (after n if not before)) * state."""
    if log_total.shape[2] == 0:
        return log_total.new_empty(*log_total.shape, state.shape[-1])
    sums = _prefix_sum_exclusive(log_total, 2) if before else _suffix_sum_exclusive(log_total, 2)
    return sums.exp()[..., None] * state[:, :, None]


def bwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    decay: _ChunkDecay,
    states_in: Tensor,
    do: Tensor | None,
    d_final_state: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dg) in blocks and d_initial_state [B, H, K, V]; do / d_final_state None are zero.

    The three stages of `ChunkGLABackward` in a row (the All-Scan runs its scan between them).
    """
    stages = ChunkGLABackward.from_blocks(q, k, v, g, decay, states_in, do, scale)
    stages.output_grads()
    return stages.finish_blocks(d_final_state)


def _output_grads(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, do: Tensor, decay: _ChunkDecay, states_in: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients through o (intra-chunk scores and entering states), in blocks.

    Returns (dq, dk_intra, dv_intra, d_log_decay) with d_log_decay = q*dq - k*dk_intra less the
    same-token pair: that pair (j = i, decay 1) adds dA_ii q_i k_i to both q*dq and k*dk, which
    cancel exactly in dg; leaving it out avoids their round-off (dominant at strong decays).
    """
    intra = _intra_decay(g)
    keys_between = _keys_between(k, intra)
    do = do * scale
    dA = do @ v.transpose(-1, -2)
    dA_same = dA.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)
    dq, dk = _intra_score_grads(q, k, dA, intra, keys_between)
    dq += (do @ states_in.transpose(-1, -2)) * decay.q_in
    d_log_decay = q * dq - k * dk
    dq, dk = dq.addcmul_(dA_same, k), dk.addcmul_(dA_same, q)
    dv = _intra_scores(q, k, intra, keys_between).transpose(-1, -2) @ do
    return dq, dk, dv, d_log_decay


def decay_grad(
    d_log_decay: Tensor | None, k_dk_inter: Tensor, states_in: Tensor, d_ends: Tensor, log_total: Tensor, g: Tensor
) -> Tensor:
    """dg from dL/db_u = q_u*dq_u - k_u*dk_u, kept inside each chunk. Blocks [B, H, N, C, K] in and out.

    For t in chunk n, dg_t = sum_{u>=t in n} dL/db_u + sum_V S_end(n) * d_ends(n). Writing
    S_end(n) = gamma_n S_in(n) + sum_j (k_j exp(suffix_j))^T v_j, that boundary term is
    gamma_n sum_V S_in(n) * d_ends(n) + sum_j k_j * dk_inter_j, whose terms for j >= t cancel
    the -k_j * dk_inter_j of the sum over u >= t exactly. So
        dg_t = revcumsum_t(q*dq - k*dk_intra) + sum_{j<t} k_j*dk_inter_j + gamma_n sum_V S_in * d_ends,
    which drops a cancellation of size |S_end| |d_ends| (large with a final-state gradient).
    d_log_decay: q*dq - k*dk_intra (None: zero); k_dk_inter: k*dk_inter; states_in, d_ends:
    [B, H, N, K, V]; log_total: [B, H, N, K].
    """
    entering = log_total.exp() * torch.einsum("bhnkv,bhnkv->bhnk", states_in, d_ends)
    dg = _prefix_sum_exclusive(k_dk_inter, -2).add_(entering[..., None, :])
    if d_log_decay is not None:
        dg += d_log_decay.flip(-2).cumsum(-2).flip(-2)
    # dL/dg_t = exp(g_t) * <S_{t-1}, dS_t> is 0 to working precision once exp(g_t) is below the
    # smallest normal number (exactly 0 at a -inf gate); the sums above would leave round-off there.
    return dg.masked_fill_(g < math.log(torch.finfo(g.dtype).tiny), 0.0)


# ----------------------------------------------------------------------------------------
# Building blocks (pure tensor code, no autograd inside)


class ChunkGLAForward:
    """The reference forward in stages, so that the state entering the sequence can travel between them.

    A (constructor): the chunks, their decays and the local pass's states from a zero state;
    `final_state` is the state leaving the last chunk from a zero initial state. B `intra()`: the
    intra-chunk output, the bulk of the work (needs no entering state). C `finish(initial_state)`:
    folds the initial state into the entering states (in place, elementwise) and adds their share
    of the output; returns (o [B, T, H, V], states_in [B, H, N, K, V]). Public inputs are
    [B, T, H, D]; fp32 (fp64 for fp64). Each input is laid out in chunks and each decay computed
    once, where calling the building blocks one by one would redo them.
    """

    def __init__(self, q, k, v, g, scale: float | None, chunk_size: int):
        check_shapes(q, k, v, None, True, g=g)
        check_chunk_size(q.shape[1], chunk_size)
        self.scale = q.shape[-1] ** -0.5 if scale is None else scale
        dt = compute_dtype(q, k, v, g)
        self.q, self.k, self.v, self.g = (to_chunks(x, chunk_size, dt) for x in (q, k, v, g))
        self.decay = chunk_decay(self.g)
        self.states, self.final_state = fwd_states(self.k, self.v, self.decay, None)
        self.o = None

    def intra(self) -> None:
        """Stage B: the output from zero entering states."""
        if self.o is None:
            self.o = fwd_intra(self.q, self.k, self.v, self.g, self.scale)

    def finish(self, initial_state: Tensor | None) -> tuple[Tensor, Tensor]:
        """Stage C: (o [B, T, H, V], states_in [B, H, N, K, V]) from `initial_state` [B, H, K, V] (None: zeros)."""
        self.intra()
        if initial_state is not None:  # states[n] += exp(sum of the chunk decays before n) * S_0, no temporary
            before = _prefix_sum_exclusive(self.decay.log_total, 2).exp_()[..., None]
            self.states.addcmul_(before, initial_state.to(self.states.dtype)[:, :, None])
        return from_chunks(_fwd_inter(self.o, self.q, self.decay.q_in, self.states, self.scale)), self.states


class ChunkGLABackward:
    """The reference backward in three stages, so that the state gradients can travel between them.

    A (constructor): the do part of the reverse chunk scan; `d_initial` is the gradient reaching
    the initial state from do alone. B `output_grads()`: the gradients through o, the bulk of
    the work (needs no state gradient). C `finish(d_final_state)`: adds the final-state
    gradient (decayed to every chunk end) and returns (dq, dk, dv, dg [B,T,H,*], d_initial_state).
    Public inputs are [B, T, H, D] with states_in [B, H, N, K, V] the states entering each chunk
    (from the true initial state), or None to recompute them from `initial_state` (None: zeros);
    do None means zero. Pure tensor code, fp32 (fp64 for fp64).
    """

    def __init__(
        self,
        q,
        k,
        v,
        g,
        states_in: Tensor | None,
        do: Tensor | None,
        scale: float | None,
        chunk_size: int,
        initial_state: Tensor | None = None,
    ):
        check_shapes(q, k, v, initial_state, True, g=g)
        check_chunk_size(q.shape[1], chunk_size)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        dt = compute_dtype(q, k, v, g, states_in)
        q, k, v, g = (to_chunks(x, chunk_size, dt) for x in (q, k, v, g))
        do = to_chunks(do, chunk_size, dt) if do is not None else None
        decay = chunk_decay(g)
        if states_in is None:  # recomputed on these blocks, the initial state folded into the scan
            states_in = fwd_states(k, v, decay, None if initial_state is None else initial_state.to(dt))[0]
        self._stage_a(q, k, v, g, decay, states_in.to(dt), do, scale)

    @classmethod
    def from_blocks(cls, q, k, v, g, decay: _ChunkDecay, states_in, do, scale: float) -> ChunkGLABackward:
        """The same on [B, H, N, C, D] blocks in the compute dtype (what chunk_gla_bwd holds)."""
        self = cls.__new__(cls)
        self._stage_a(q, k, v, g, decay, states_in, do, scale)
        return self

    def _stage_a(self, q, k, v, g, decay, states_in, do, scale) -> None:
        self.q, self.k, self.v, self.g, self.decay, self.states_in = q, k, v, g, decay, states_in
        self.do, self.scale, self._grads = do, scale, None
        B, H, N, _, K = q.shape
        if do is None:
            self.d_ends_do, self.d_initial = None, q.new_zeros(B, H, K, v.shape[-1])
        else:  # d_ends_do[n]: the gradient reaching the state leaving chunk n from the outputs of later chunks
            from_outputs = (q * decay.q_in).transpose(-1, -2) @ (do * scale)
            self.d_ends_do, self.d_initial = _scan_chunks(decay.log_total, from_outputs, None, reverse=True)

    def output_grads(self) -> None:
        """Stage B: (dq, dk_intra, dv_intra, d_log_decay) through o; nothing when do is None."""
        if self.do is not None and self._grads is None:
            self._grads = _output_grads(self.q, self.k, self.v, self.g, self.do, self.decay, self.states_in, self.scale)

    def finish_blocks(self, d_final_state: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Stage C on blocks: (dq, dk, dv, dg) [B, H, N, C, *] and d_initial_state [B, H, K, V]."""
        self.output_grads()
        q, k, v, decay = self.q, self.k, self.v, self.decay
        d_ends, d_initial = self.d_ends_do, self.d_initial
        if d_final_state is not None:
            d_final_state = d_final_state.to(q.dtype)
            if d_ends is None:
                d_ends = _decayed_over_chunks(decay.log_total, d_final_state, before=False)
            else:  # d_ends[n] += exp(sum of the chunk decays after n) * dS_final, in place (stage A's own tensor)
                after = _suffix_sum_exclusive(decay.log_total, 2).exp_()[..., None]
                d_ends.addcmul_(after, d_final_state[:, :, None])
            d_initial = d_initial + decay.log_total.sum(2).exp()[..., None] * d_final_state
        if d_ends is None:
            d_ends = self.states_in.new_zeros(self.states_in.shape)
        dk_inter = (v @ d_ends.transpose(-1, -2)) * decay.k_out
        dv = (k * decay.k_out) @ d_ends
        if self._grads is None:  # state gradient only: no intra-chunk work
            dq, dk, d_log_decay = torch.zeros_like(q), dk_inter, None
        else:
            dq, dk_intra, dv_intra, d_log_decay = self._grads
            dk, dv = dk_intra + dk_inter, dv + dv_intra
        dg = decay_grad(d_log_decay, k * dk_inter, self.states_in, d_ends, decay.log_total, self.g)
        return dq, dk, dv, dg, d_initial

    def finish(self, d_final_state: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Stage C: (dq, dk, dv, dg [B, T, H, *], d_initial_state [B, H, K, V]); d_final_state None is zero."""
        dq, dk, dv, dg, dh0 = self.finish_blocks(d_final_state)
        return from_chunks(dq), from_chunks(dk), from_chunks(dv), from_chunks(dg), dh0
