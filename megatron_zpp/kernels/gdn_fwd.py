"""Forward Triton kernels of chunked Gated DeltaNet: the per-chunk WY/UT factors, the state scan and the
output (kernels/gdn.py describes the decomposition and launches them)."""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_common import device_fn, dot, load_rows, unit_lower_inverse


@device_fn
def _chunk_gates(g_ptr, rc, C: tl.constexpr):
    """g of one chunk [C] -> (exp(G_i) from the chunk start, exp(suf_j) to its end, the pair decays [i, j]:
    exp(sum_{j<s<=i} g_s) for j <= i, else 0). Every exponent is a sum of g <= 0 accumulated over its own
    tokens (masked cumsums, never a difference), so a -inf gate only ever gives exp(-inf) = 0."""
    g = tl.load(g_ptr + rc)
    g_next = tl.load(g_ptr + rc + 1, mask=rc + 1 < C, other=0.0)
    start = tl.exp(tl.cumsum(g, axis=0))
    end = tl.exp(tl.cumsum(g_next, axis=0, reverse=True))
    seg = tl.cumsum(tl.where(rc[:, None] > rc[None, :], g[:, None], 0.0), axis=0)  # [s -> i, j]
    pair = tl.where(rc[:, None] >= rc[None, :], tl.exp(seg), 0.0)
    return start, end, pair


@triton.jit
def _gdn_prepare_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, T_ptr, A_ptr, W_ptr, U_ptr, T, N,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BF16: tl.constexpr,
):  # fmt: skip
    """Per chunk: T = (I + L)^-1, the scores A = lower(q k^T exp(seg)), W = T (beta exp(G) k), U = T (beta v).
    K in tiles of BK (k k^T and q k^T accumulate over them), V in tiles of BV."""
    pid = tl.program_id(0).to(tl.int64)  # (chunk, b*H + h)
    i_n, i_bh = pid % N, pid // N
    b, h = i_bh // H, i_bh % H
    rc, rk, rv = tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BV)
    all_rows = rc < C
    row0 = i_n * C
    tok = i_bh * T + row0  # the [B, H, T, ...] intermediates' first row of this chunk
    start, _, pair = _chunk_gates(g_ptr + tok, rc, C)
    beta = tl.load(beta_ptr + tok + rc)
    k_ptr += b * skb + h * skh + row0 * skt
    q_ptr += b * sqb + h * sqh + row0 * sqt
    kk = tl.zeros([C, C], dtype=tl.float32)
    qk = tl.zeros([C, C], dtype=tl.float32)
    for k0 in range(0, K, BK):
        mk = k0 + rk < K
        k_tile = load_rows(k_ptr + k0, rc, rk, all_rows, mk, skt)
        kk += dot(k_tile, tl.trans(k_tile), BF16)
        qk += dot(load_rows(q_ptr + k0, rc, rk, all_rows, mk, sqt), tl.trans(k_tile), BF16)
    L = tl.where(rc[:, None] > rc[None, :], beta[:, None] * kk * pair, 0.0)
    inv = unit_lower_inverse(L, rc, C)
    cc = rc[:, None] * C + rc[None, :]
    tl.store(T_ptr + tok * C + cc, inv)
    tl.store(A_ptr + tok * C + cc, qk * pair)
    for k0 in range(0, K, BK):
        mk = k0 + rk < K
        k_tile = load_rows(k_ptr + k0, rc, rk, all_rows, mk, skt)
        W = dot(inv, k_tile * (beta * start)[:, None], BF16)
        tl.store(W_ptr + tok * K + k0 + rc[:, None] * K + rk[None, :], W, mask=mk[None, :])
    v_ptr += b * svb + h * svh + row0 * svt
    for v0 in range(0, V, BV):
        mv = v0 + rv < V
        vv = load_rows(v_ptr + v0, rc, rv, all_rows, mv, svt)
        U = dot(inv, vv * beta[:, None], BF16)
        tl.store(U_ptr + tok * V + v0 + rc[:, None] * V + rv[None, :], U, mask=mv[None, :])


@triton.jit
def _gdn_fwd_states_kernel(
    k_ptr, g_ptr, W_ptr, U_ptr, h0_ptr, states_ptr, vnew_ptr, final_ptr, T, N, skb, skt, skh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NV: tl.constexpr, SPLIT: tl.constexpr, USE_H0: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """The scan over chunks per (V tile, head): S_in of each chunk, v_new = U - W S_in, the final state. The state
    is one [BK, BV] tile, or with SPLIT two (rows BK..2BK-1 in S2; K <= 2 BK): fewer registers per dot."""
    pid = tl.program_id(0).to(tl.int64)  # (V tile, b*H + h)
    i_v, i_bh = (pid % NV).to(tl.int32), pid // NV
    b, h = i_bh // H, i_bh % H
    rc, rk, rv = tl.arange(0, C), tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    rk2 = BK + rk
    mk, mk2, mv, all_rows = rk < K, rk2 < K, rv < V, rc < C
    kv, kv2 = rk[:, None] * V + rv[None, :], rk2[:, None] * V + rv[None, :]
    mkv, mkv2 = mk[:, None] & mv[None, :], mk2[:, None] & mv[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    S2 = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        S = tl.load(h0_ptr + i_bh * (K * V) + kv, mask=mkv, other=0.0)
        if SPLIT:
            S2 = tl.load(h0_ptr + i_bh * (K * V) + kv2, mask=mkv2, other=0.0)
    k_ptr += b * skb + h * skh
    for n in range(N):
        i_n = i_bh * 0 + n  # 64-bit: the chunk's offsets below can pass 2^31
        tok = i_bh * T + i_n * C
        state_ptr = states_ptr + (i_bh * N + i_n) * (K * V)
        tl.store(state_ptr + kv, S, mask=mkv)
        start, end, _ = _chunk_gates(g_ptr + tok, rc, C)
        total = tl.sum(tl.where(rc == C - 1, start, 0.0), axis=0)
        v_new = load_rows(U_ptr + tok * V, rc, rv, all_rows, mv, V)
        v_new -= dot(load_rows(W_ptr + tok * K, rc, rk, all_rows, mk, K), S, BF16)
        if SPLIT:
            tl.store(state_ptr + kv2, S2, mask=mkv2)
            v_new -= dot(load_rows(W_ptr + tok * K, rc, rk2, all_rows, mk2, K), S2, BF16)
        tl.store(vnew_ptr + tok * V + rc[:, None] * V + rv[None, :], v_new, mask=mv[None, :])
        k_end = load_rows(k_ptr + i_n * C * skt, rc, rk, all_rows, mk, skt) * end[:, None]
        S = S * total + dot(tl.trans(k_end), v_new, BF16)
        if SPLIT:
            k_end = load_rows(k_ptr + i_n * C * skt, rc, rk2, all_rows, mk2, skt) * end[:, None]
            S2 = S2 * total + dot(tl.trans(k_end), v_new, BF16)
    tl.store(final_ptr + i_bh * (K * V) + kv, S, mask=mkv)
    if SPLIT:
        tl.store(final_ptr + i_bh * (K * V) + kv2, S2, mask=mkv2)


@triton.jit
def _gdn_output_kernel(
    q_ptr, g_ptr, A_ptr, states_ptr, vnew_ptr, o_ptr, T, N, scale, sqb, sqt, sqh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NV: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """o = scale ((q exp(G)) S_in + A v_new), o [B, T, H, V] contiguous; K in tiles of BK."""
    pid = tl.program_id(0).to(tl.int64)  # (V tile, chunk, b*H + h)
    i_v, rest = (pid % NV).to(tl.int32), pid // NV
    i_n, i_bh = rest % N, rest // N
    b, h = i_bh // H, i_bh % H
    rc, rk, rv = tl.arange(0, C), tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    mv, all_rows = rv < V, rc < C
    tok = i_bh * T + i_n * C
    start, _, _ = _chunk_gates(g_ptr + tok, rc, C)
    A = load_rows(A_ptr + tok * C, rc, rc, all_rows, all_rows, C)
    o = dot(A, load_rows(vnew_ptr + tok * V, rc, rv, all_rows, mv, V), BF16)
    q_ptr += b * sqb + h * sqh + i_n * C * sqt
    states_ptr += (i_bh * N + i_n) * (K * V)
    for k0 in range(0, K, BK):
        mk = k0 + rk < K
        q_tile = load_rows(q_ptr + k0, rc, rk, all_rows, mk, sqt)
        S = load_rows(states_ptr + k0 * V, rk, rv, mk, mv, V)
        o += dot(q_tile * start[:, None], S, BF16)
    o_rows = (b * T + i_n * C + rc) * H + h
    tl.store(o_ptr + o_rows[:, None] * V + rv[None, :], scale * o, mask=mv[None, :])
