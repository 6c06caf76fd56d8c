"""Forward Triton kernels of chunked Kimi Delta Attention: the intra-chunk pair sums with per-channel decays, the
per-chunk WY/UT factors, the state scan and the output (kernels/kda.py describes the decomposition and launches
them)."""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_common import blocks_between, dot, exclusive_suffix, load_rows, pair_decays, unit_lower_inverse


@triton.jit
def _kda_scores_kernel(
    q_ptr, k_ptr, g_ptr, A_ptr, L_ptr, T, N, sqb, sqt, sqh, skb, skt, skh, sgb, sgt, sgh,
    H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, DBK: tl.constexpr,
    BF16: tl.constexpr,
):  # fmt: skip
    """Rows of sub-block I (BT tokens) of A = lower(sum_d q_id k_jd exp(seg[i, j, d])) and of L's kernel
    strict_lower(sum_d k_id k_jd exp(seg[i, j, d])), [B, H, T, C] fp32 (the blocks above the diagonal are not
    written). Earlier sub-blocks J factor their decay at I's start (prefix of I, suffix of J, the blocks between,
    each a sum of g over its own tokens); the diagonal block in [BT, BT, DBK] tiles of segment sums."""
    pid = tl.program_id(0).to(tl.int64)  # (sub-block, chunk, b*H + h)
    i_i, rest = (pid % (C // BT)).to(tl.int32), pid // (C // BT)
    i_n, i_bh = rest % N, rest // N
    b, h = i_bh // H, i_bh % H
    row0 = i_n * C
    q_ptr += b * sqb + row0 * sqt + h * sqh
    k_ptr += b * skb + row0 * skt + h * skh
    g_ptr += b * sgb + row0 * sgt + h * sgh
    out_ptr = (i_bh * T + row0) * C
    rt = tl.arange(0, BT)
    rows_i = i_i * BT + rt
    all_t = rt < BT
    for j_blk in range(0, i_i):
        rows_j = j_blk * BT + rt
        acc_a = tl.zeros([BT, BT], dtype=tl.float32)
        acc_l = tl.zeros([BT, BT], dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            mk = rk < K
            q_in = tl.exp(tl.cumsum(load_rows(g_ptr, rows_i, rk, all_t, mk, sgt), axis=0))
            between = blocks_between(g_ptr, rk, mk, (j_blk + 1) * BT, i_i * BT, C, sgt)
            k_fac = tl.exp(exclusive_suffix(g_ptr, rows_j, rk, mk, BT, sgt) + between[None, :])
            kj = tl.trans(load_rows(k_ptr, rows_j, rk, all_t, mk, skt) * k_fac)
            acc_a += dot(load_rows(q_ptr, rows_i, rk, all_t, mk, sqt) * q_in, kj, BF16)
            acc_l += dot(load_rows(k_ptr, rows_i, rk, all_t, mk, skt) * q_in, kj, BF16)
        cols = rows_i[:, None] * C + (j_blk * BT + rt)[None, :]
        tl.store(A_ptr + out_ptr + cols, acc_a)
        tl.store(L_ptr + out_ptr + cols, acc_l)
    acc_a = tl.zeros([BT, BT], dtype=tl.float32)
    acc_l = tl.zeros([BT, BT], dtype=tl.float32)
    for k0 in range(0, K, DBK):  # the diagonal sub-block: all its pairs at once, [i, j, key] tiles
        rk = k0 + tl.arange(0, DBK)
        mk = rk < K
        ki = load_rows(k_ptr, rows_i, rk, all_t, mk, skt)
        decay = pair_decays(load_rows(g_ptr, rows_i, rk, all_t, mk, sgt), BT, True) * ki[None, :, :]
        acc_a += tl.sum(load_rows(q_ptr, rows_i, rk, all_t, mk, sqt)[:, None, :] * decay, axis=2)
        acc_l += tl.sum(ki[:, None, :] * decay, axis=2)
    cols = rows_i[:, None] * C + (i_i * BT + rt)[None, :]
    tl.store(A_ptr + out_ptr + cols, acc_a)
    tl.store(L_ptr + out_ptr + cols, tl.where(rt[:, None] > rt[None, :], acc_l, 0.0))


@triton.jit
def _kda_prepare_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, L_ptr, T_ptr, W_ptr, U_ptr, T, N, skb, skt, skh, svb, svt, svh, sgb, sgt, sgh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BF16: tl.constexpr,
):  # fmt: skip
    """Per chunk: T = (I + beta L)^-1 (L the scores kernel's), W = T (beta exp(G) * k), U = T (beta v); K in tiles
    of BK, V in tiles of BV; exp(G) the per-channel decay from the chunk's start."""
    pid = tl.program_id(0).to(tl.int64)  # (chunk, b*H + h)
    i_n, i_bh = pid % N, pid // N
    b, h = i_bh // H, i_bh % H
    rc, rk, rv = tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BV)
    all_rows = rc < C
    row0 = i_n * C
    tok = i_bh * T + row0
    beta = tl.load(beta_ptr + tok + rc)
    cc = rc[:, None] * C + rc[None, :]
    inv = unit_lower_inverse(beta[:, None] * tl.load(L_ptr + tok * C + cc), rc, C)
    tl.store(T_ptr + tok * C + cc, inv)
    k_ptr += b * skb + h * skh + row0 * skt
    g_ptr += b * sgb + h * sgh + row0 * sgt
    for k0 in range(0, K, BK):
        mk = k0 + rk < K
        start = tl.exp(tl.cumsum(load_rows(g_ptr + k0, rc, rk, all_rows, mk, sgt), axis=0))
        k_w = load_rows(k_ptr + k0, rc, rk, all_rows, mk, skt) * start * beta[:, None]
        tl.store(W_ptr + tok * K + k0 + rc[:, None] * K + rk[None, :], dot(inv, k_w, BF16), mask=mk[None, :])
    v_ptr += b * svb + h * svh + row0 * svt
    for v0 in range(0, V, BV):
        mv = v0 + rv < V
        vv = load_rows(v_ptr + v0, rc, rv, all_rows, mv, svt)
        U = dot(inv, vv * beta[:, None], BF16)
        tl.store(U_ptr + tok * V + v0 + rc[:, None] * V + rv[None, :], U, mask=mv[None, :])


@triton.jit
def _kda_fwd_states_kernel(
    k_ptr, g_ptr, W_ptr, U_ptr, h0_ptr, states_ptr, vnew_ptr, final_ptr, T, N, skb, skt, skh, sgb, sgt, sgh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NV: tl.constexpr, SPLIT: tl.constexpr, USE_H0: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """The scan over chunks per (V tile, head): S_in of each chunk, v_new = U - W S_in, the final state, with
    S_out = Diag(exp(G_{C-1})) S_in + (k exp(suf))^T v_new. The state is one [BK, BV] tile, or with SPLIT two
    (rows BK..2BK-1 in S2; K <= 2 BK)."""
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
    g_ptr += b * sgb + h * sgh
    for n in range(N):
        i_n = i_bh * 0 + n  # 64-bit: the chunk's offsets below can pass 2^31
        tok = i_bh * T + i_n * C
        state_ptr = states_ptr + (i_bh * N + i_n) * (K * V)
        kc, gc = k_ptr + i_n * C * skt, g_ptr + i_n * C * sgt
        tl.store(state_ptr + kv, S, mask=mkv)
        v_new = load_rows(U_ptr + tok * V, rc, rv, all_rows, mv, V)
        v_new -= dot(load_rows(W_ptr + tok * K, rc, rk, all_rows, mk, K), S, BF16)
        if SPLIT:
            tl.store(state_ptr + kv2, S2, mask=mkv2)
            v_new -= dot(load_rows(W_ptr + tok * K, rc, rk2, all_rows, mk2, K), S2, BF16)
        tl.store(vnew_ptr + tok * V + rc[:, None] * V + rv[None, :], v_new, mask=mv[None, :])
        total = tl.exp(tl.sum(load_rows(gc, rc, rk, all_rows, mk, sgt), axis=0))
        k_end = load_rows(kc, rc, rk, all_rows, mk, skt) * tl.exp(exclusive_suffix(gc, rc, rk, mk, C, sgt))
        S = S * total[:, None] + dot(tl.trans(k_end), v_new, BF16)
        if SPLIT:
            total = tl.exp(tl.sum(load_rows(gc, rc, rk2, all_rows, mk2, sgt), axis=0))
            k_end = load_rows(kc, rc, rk2, all_rows, mk2, skt) * tl.exp(exclusive_suffix(gc, rc, rk2, mk2, C, sgt))
            S2 = S2 * total[:, None] + dot(tl.trans(k_end), v_new, BF16)
    tl.store(final_ptr + i_bh * (K * V) + kv, S, mask=mkv)
    if SPLIT:
        tl.store(final_ptr + i_bh * (K * V) + kv2, S2, mask=mkv2)


@triton.jit
def _kda_output_kernel(
    q_ptr, g_ptr, A_ptr, states_ptr, vnew_ptr, o_ptr, T, N, scale, sqb, sqt, sqh, sgb, sgt, sgh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NV: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """o = scale ((q * exp(G)) S_in + A v_new), o [B, T, H, V] contiguous; K in tiles of BK."""
    pid = tl.program_id(0).to(tl.int64)  # (V tile, chunk, b*H + h)
    i_v, rest = (pid % NV).to(tl.int32), pid // NV
    i_n, i_bh = rest % N, rest // N
    b, h = i_bh // H, i_bh % H
    rc, rk, rv = tl.arange(0, C), tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    mv, all_rows = rv < V, rc < C
    tok = i_bh * T + i_n * C
    A = load_rows(A_ptr + tok * C, rc, rc, all_rows, all_rows, C)
    o = dot(A, load_rows(vnew_ptr + tok * V, rc, rv, all_rows, mv, V), BF16)
    q_ptr += b * sqb + h * sqh + i_n * C * sqt
    g_ptr += b * sgb + h * sgh + i_n * C * sgt
    states_ptr += (i_bh * N + i_n) * (K * V)
    for k0 in range(0, K, BK):
        mk = k0 + rk < K
        start = tl.exp(tl.cumsum(load_rows(g_ptr + k0, rc, rk, all_rows, mk, sgt), axis=0))
        q_tile = load_rows(q_ptr + k0, rc, rk, all_rows, mk, sqt) * start
        o += dot(q_tile, load_rows(states_ptr + k0 * V, rk, rv, mk, mv, V), BF16)
    o_rows = (b * T + i_n * C + rc) * H + h
    tl.store(o_ptr + o_rows[:, None] * V + rv[None, :], scale * o, mask=mv[None, :])
