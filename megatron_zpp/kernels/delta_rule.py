"""The Triton kernels the delta-rule families share (Gated DeltaNet: kernels/gdn.py, a decay per head; Kimi Delta
Attention: kernels/kda.py, a decay per key channel): the state scan over chunks, the output and the reverse state
scan. They differ only in how a chunk's decays are read (PER_CHANNEL): per head, g is the fp32 [B, H, T] copy
(token stride 1) and one chunk_gates call gives the chunk's exp(G_i), exp(suf_j) and exp(G_{C-1}) for every state
row; per channel, g [B, T, H, K] is read with the rows of each K tile. Either way every exponent is a sum of
g <= 0 over its own tokens (a cumsum, a reverse cumsum loaded one token later), never a difference: a -inf gate
only ever gives exp(-inf) = 0."""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_common import device_fn, dot, exclusive_suffix, load_rows


@device_fn
def chunk_gates(g_ptr, rc, C: tl.constexpr):
    """A per-head g of one chunk [C] (contiguous) -> (exp(G_i) from the chunk start, exp(suf_j) to its end, the pair
    decays [i, j]: exp(sum_{j<s<=i} g_s) for j <= i, else 0). Masked cumsums, never a difference."""
    g = tl.load(g_ptr + rc)
    g_next = tl.load(g_ptr + rc + 1, mask=rc + 1 < C, other=0.0)
    start = tl.exp(tl.cumsum(g, axis=0))
    end = tl.exp(tl.cumsum(g_next, axis=0, reverse=True))
    seg = tl.cumsum(tl.where(rc[:, None] > rc[None, :], g[:, None], 0.0), axis=0)  # [s -> i, j]
    pair = tl.where(rc[:, None] >= rc[None, :], tl.exp(seg), 0.0)
    return start, end, pair


@device_fn
def _head_gates(g_ptr, rc, C: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """Per head: the chunk's (exp(G_i), exp(suf_j)) [C], read once for every state row; per channel nothing yet
    (placeholders: _decays reads each K tile's)."""
    if PER_CHANNEL:
        start, end = rc, rc
    else:
        start, end, _ = chunk_gates(g_ptr, rc, C)
    return start, end


@device_fn
def _decays(g_ptr, rc, rk, mk, sgt, start, end, C: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """A chunk's decays for the state rows rk: per channel (g read here) g itself [C, BK] (_from_start takes it to
    exp(G_i) where it is used), exp(suf_j) [C, BK] and the chunk's exp(G_{C-1}) [BK, 1]; per head (_head_gates'
    start, end) exp(G_i) and exp(suf_j) as [C, 1] and exp(G_{C-1}) a scalar."""
    if PER_CHANNEL:
        g = load_rows(g_ptr, rc, rk, rc < C, mk, sgt)
        k_fac = tl.exp(exclusive_suffix(g_ptr, rc, rk, mk, C, sgt))
        total = tl.exp(tl.sum(g, axis=0))[:, None]
    else:
        g, k_fac = start[:, None], end[:, None]
        total = tl.sum(tl.where(rc == C - 1, start, 0.0), axis=0)
    return g, k_fac, total


@device_fn
def _from_start(g, PER_CHANNEL: tl.constexpr):
    """exp(G_i), the decay from the chunk's start, of _decays' first result (per head: already it)."""
    if PER_CHANNEL:
        g = tl.exp(tl.cumsum(g, axis=0))
    return g


@device_fn
def _scan_program(H: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr):
    """A scan's program (V tile, b*H + h): (b*H + h, b, h, the chunk's rows, the key rows, the value columns)."""
    pid = tl.program_id(0).to(tl.int64)
    i_v, i_bh = (pid % NV).to(tl.int32), pid // NV
    return i_bh, i_bh // H, i_bh % H, tl.arange(0, C), tl.arange(0, BK), i_v * BV + tl.arange(0, BV)


@device_fn
def _scan_states(ptr, rk, rv, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 LOAD: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    """A scan's state as two [BK, BV] tiles, rows rk and (with SPLIT; K <= 2 BK) the next BK rows, at the value
    columns rv: zeros, or loaded from ptr [K, V] when LOAD. (S, S2, their offsets, their masks)."""
    rk2 = BK + rk
    kv, kv2 = rk[:, None] * V + rv[None, :], rk2[:, None] * V + rv[None, :]
    mkv, mkv2 = (rk < K)[:, None] & (rv < V)[None, :], (rk2 < K)[:, None] & (rv < V)[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    S2 = tl.zeros([BK, BV], dtype=tl.float32)
    if LOAD:
        S = tl.load(ptr + kv, mask=mkv, other=0.0)
        if SPLIT:
            S2 = tl.load(ptr + kv2, mask=mkv2, other=0.0)
    return S, S2, kv, kv2, mkv, mkv2


@triton.jit
def _delta_fwd_states_kernel(
    k_ptr, g_ptr, W_ptr, U_ptr, h0_ptr, states_ptr, vnew_ptr, final_ptr, T, N, skb, skt, skh, sgb, sgt, sgh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NV: tl.constexpr, SPLIT: tl.constexpr, USE_H0: tl.constexpr, PER_CHANNEL: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """The scan over chunks per (V tile, head): S_in of each chunk, v_new = U - W S_in, the final state, with
    S_out = Diag(exp(G_{C-1})) S_in + (k exp(suf))^T v_new. The state is one [BK, BV] tile, or with SPLIT two
    (rows BK..2BK-1 in S2; K <= 2 BK): fewer registers per dot."""
    i_bh, b, h, rc, rk, rv = _scan_program(H, C, BK, BV, NV)
    rk2 = BK + rk
    mk, mk2, mv, all_rows = rk < K, rk2 < K, rv < V, rc < C
    S, S2, kv, kv2, mkv, mkv2 = _scan_states(h0_ptr + i_bh * (K * V), rk, rv, K, V, BK, BV, USE_H0, SPLIT)
    k_ptr += b * skb + h * skh
    g_ptr += b * sgb + h * sgh
    for n in range(N):
        i_n = i_bh * 0 + n  # 64-bit: the chunk's offsets below can pass 2^31
        tok = i_bh * T + i_n * C
        state_ptr = states_ptr + (i_bh * N + i_n) * (K * V)
        kc, gc = k_ptr + i_n * C * skt, g_ptr + i_n * C * sgt
        tl.store(state_ptr + kv, S, mask=mkv)
        start, end = _head_gates(gc, rc, C, PER_CHANNEL)
        v_new = load_rows(U_ptr + tok * V, rc, rv, all_rows, mv, V)
        v_new -= dot(load_rows(W_ptr + tok * K, rc, rk, all_rows, mk, K), S, BF16)
        if SPLIT:
            tl.store(state_ptr + kv2, S2, mask=mkv2)
            v_new -= dot(load_rows(W_ptr + tok * K, rc, rk2, all_rows, mk2, K), S2, BF16)
        tl.store(vnew_ptr + tok * V + rc[:, None] * V + rv[None, :], v_new, mask=mv[None, :])
        _, k_fac, total = _decays(gc, rc, rk, mk, sgt, start, end, C, PER_CHANNEL)
        S = S * total + dot(tl.trans(load_rows(kc, rc, rk, all_rows, mk, skt) * k_fac), v_new, BF16)
        if SPLIT:
            _, k_fac, total = _decays(gc, rc, rk2, mk2, sgt, start, end, C, PER_CHANNEL)
            S2 = S2 * total + dot(tl.trans(load_rows(kc, rc, rk2, all_rows, mk2, skt) * k_fac), v_new, BF16)
    tl.store(final_ptr + i_bh * (K * V) + kv, S, mask=mkv)
    if SPLIT:
        tl.store(final_ptr + i_bh * (K * V) + kv2, S2, mask=mkv2)


@triton.jit
def _delta_output_kernel(
    q_ptr, g_ptr, A_ptr, states_ptr, vnew_ptr, o_ptr, T, N, scale, sqb, sqt, sqh, sgb, sgt, sgh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NV: tl.constexpr, PER_CHANNEL: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """o = scale ((q * exp(G)) S_in + A v_new), o [B, T, H, V] contiguous; K in tiles of BK."""
    pid = tl.program_id(0).to(tl.int64)  # (V tile, chunk, b*H + h)
    i_v, rest = (pid % NV).to(tl.int32), pid // NV
    i_n, i_bh = rest % N, rest // N
    b, h = i_bh // H, i_bh % H
    rc, rk, rv = tl.arange(0, C), tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    mv, all_rows = rv < V, rc < C
    tok = i_bh * T + i_n * C
    g_ptr += b * sgb + h * sgh + i_n * C * sgt
    start, end = _head_gates(g_ptr, rc, C, PER_CHANNEL)
    A = load_rows(A_ptr + tok * C, rc, rc, all_rows, all_rows, C)
    o = dot(A, load_rows(vnew_ptr + tok * V, rc, rv, all_rows, mv, V), BF16)
    q_ptr += b * sqb + h * sqh + i_n * C * sqt
    states_ptr += (i_bh * N + i_n) * (K * V)
    for k0 in range(0, K, BK):
        mk = k0 + rk < K
        g, _, _ = _decays(g_ptr + k0, rc, rk, mk, sgt, start, end, C, PER_CHANNEL)
        q_tile = load_rows(q_ptr + k0, rc, rk, all_rows, mk, sqt) * _from_start(g, PER_CHANNEL)
        o += dot(q_tile, load_rows(states_ptr + k0 * V, rk, rv, mk, mv, V), BF16)
    o_rows = (b * T + i_n * C + rc) * H + h
    tl.store(o_ptr + o_rows[:, None] * V + rv[None, :], scale * o, mask=mv[None, :])


@triton.jit
def _delta_bwd_states_kernel(
    q_ptr, k_ptr, g_ptr, A_ptr, W_ptr, do_ptr, dS_ptr, d_ends_ptr, dvnew_ptr, dh0_ptr, T, N, scale,
    sqb, sqt, sqh, skb, skt, skh, sgb, sgt, sgh, sob, sot, soh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NV: tl.constexpr, SPLIT: tl.constexpr, HAS_DO: tl.constexpr, HAS_DS: tl.constexpr, PER_CHANNEL: tl.constexpr,
    BF16: tl.constexpr,
):  # fmt: skip
    """Reverse scan per (V tile, head): d_ends[n] (the gradient of the state leaving chunk n), dv_new and dh0;
    the state gradient in one [BK, BV] tile or, with SPLIT, two (as _delta_fwd_states_kernel).

    dv_new = scale A^T do + (k exp(suf)) dS_out;  dS_in = Diag(exp(G_{C-1})) dS_out + scale (q exp(G))^T do
    - W^T dv_new."""
    i_bh, b, h, rc, rk, rv = _scan_program(H, C, BK, BV, NV)
    rk2 = BK + rk
    mk, mk2, mv, all_rows = rk < K, rk2 < K, rv < V, rc < C
    dS, dS2, kv, kv2, mkv, mkv2 = _scan_states(dS_ptr + i_bh * (K * V), rk, rv, K, V, BK, BV, HAS_DS, SPLIT)
    q_ptr += b * sqb + h * sqh
    k_ptr += b * skb + h * skh
    g_ptr += b * sgb + h * sgh
    do_ptr += b * sob + h * soh
    for step in range(N):
        i_n = i_bh * 0 + (N - 1 - step)  # 64-bit: the chunk's offsets below can pass 2^31
        tok = i_bh * T + i_n * C
        kc, gc, qc = k_ptr + i_n * C * skt, g_ptr + i_n * C * sgt, q_ptr + i_n * C * sqt
        end_ptr = d_ends_ptr + (i_bh * N + i_n) * (K * V)
        tl.store(end_ptr + kv, dS, mask=mkv)
        start, end = _head_gates(gc, rc, C, PER_CHANNEL)
        g, k_fac, total = _decays(gc, rc, rk, mk, sgt, start, end, C, PER_CHANNEL)
        dv_new = dot(load_rows(kc, rc, rk, all_rows, mk, skt) * k_fac, dS, BF16)
        dS = dS * total
        if SPLIT:
            tl.store(end_ptr + kv2, dS2, mask=mkv2)
            g2, k_fac, total = _decays(gc, rc, rk2, mk2, sgt, start, end, C, PER_CHANNEL)
            dv_new += dot(load_rows(kc, rc, rk2, all_rows, mk2, skt) * k_fac, dS2, BF16)
            dS2 = dS2 * total
        if HAS_DO:
            do = load_rows(do_ptr + i_n * C * sot, rc, rv, all_rows, mv, sot) * scale
            A = load_rows(A_ptr + tok * C, rc, rc, all_rows, all_rows, C)
            dv_new += dot(tl.trans(A), do, BF16)
            q_start = load_rows(qc, rc, rk, all_rows, mk, sqt) * _from_start(g, PER_CHANNEL)
            dS += dot(tl.trans(q_start), do, BF16)
            if SPLIT:
                q_start = load_rows(qc, rc, rk2, all_rows, mk2, sqt) * _from_start(g2, PER_CHANNEL)
                dS2 += dot(tl.trans(q_start), do, BF16)
        tl.store(dvnew_ptr + tok * V + rc[:, None] * V + rv[None, :], dv_new, mask=mv[None, :])
        dS -= dot(tl.trans(load_rows(W_ptr + tok * K, rc, rk, all_rows, mk, K)), dv_new, BF16)
        if SPLIT:
            dS2 -= dot(tl.trans(load_rows(W_ptr + tok * K, rc, rk2, all_rows, mk2, K)), dv_new, BF16)
    tl.store(dh0_ptr + i_bh * (K * V) + kv, dS, mask=mkv)
    if SPLIT:
        tl.store(dh0_ptr + i_bh * (K * V) + kv2, dS2, mask=mkv2)
