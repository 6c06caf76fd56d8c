"""Forward Triton kernels of chunked Kimi Delta Attention: the intra-chunk pair sums with per-channel decays and
the per-chunk WY/UT factors (kernels/kda.py describes the decomposition and launches them; the state scan and the
output are kernels/delta_rule.py's, shared with GDN)."""

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
