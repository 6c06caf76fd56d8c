"""Forward Triton kernels of chunked GLA: the chunk states, the intra-chunk scores and the output
(kernels/gla.py describes the decomposition and launches them)."""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_common import blocks_between, dot, exclusive_suffix, load_rows, pair_decays


@triton.jit
def _fwd_states_kernel(
    k_ptr, v_ptr, g_ptr, h0_ptr, states_ptr, final_ptr, N,
    skb, skt, skh, svb, svt, svh, sgb, sgt, sgh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NK: tl.constexpr, NV: tl.constexpr, USE_H0: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)  # (V tile, K tile, b*H + h), V tiles fastest
    i_v, i_k, i_bh = (pid % NV).to(tl.int32), ((pid // NV) % NK).to(tl.int32), pid // (NV * NK)
    b, h = i_bh // H, i_bh % H
    rk, rv, rc = i_k * BK + tl.arange(0, BK), i_v * BV + tl.arange(0, BV), tl.arange(0, C)
    mk, mv, all_rows = rk < K, rv < V, rc < C
    kv = rk[:, None] * V + rv[None, :]
    mkv = mk[:, None] & mv[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        S = tl.load(h0_ptr + i_bh * (K * V) + kv, mask=mkv, other=0.0).to(tl.float32)
    k_ptr += b * skb + h * skh
    g_ptr += b * sgb + h * sgh
    v_ptr += b * svb + h * svh
    states_ptr += i_bh * N * (K * V)
    c64, kv64 = i_bh * 0 + C, i_bh * 0 + K * V  # 64-bit steps: the pointers advance one chunk per step
    for _ in range(N):
        tl.store(states_ptr + kv, S, mask=mkv)
        kk = load_rows(k_ptr, rc, rk, all_rows, mk, skt)
        gg = load_rows(g_ptr, rc, rk, all_rows, mk, sgt)
        k_out = tl.exp(exclusive_suffix(g_ptr, rc, rk, mk, C, sgt))
        vv = load_rows(v_ptr, rc, rv, all_rows, mv, svt)
        S = S * tl.exp(tl.sum(gg, axis=0))[:, None]
        S += dot(tl.trans(kk * k_out), vv, BF16)
        states_ptr += kv64
        k_ptr += c64 * skt
        g_ptr += c64 * sgt
        v_ptr += c64 * svt
    tl.store(final_ptr + i_bh * (K * V) + kv, S, mask=mkv)


@triton.jit
def _intra_scores_kernel(
    q_ptr, k_ptr, g_ptr, A_ptr, T, N,
    sqb, sqt, sqh, skb, skt, skh, sgb, sgt, sgh,
    H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, DBK: tl.constexpr,
    BF16: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)  # (sub-block, chunk, b*H + h)
    i_i, rest = (pid % (C // BT)).to(tl.int32), pid // (C // BT)
    i_n, i_bh = rest % N, rest // N
    b, h = i_bh // H, i_bh % H
    row0 = i_n * C
    q_ptr += b * sqb + row0 * sqt + h * sqh
    k_ptr += b * skb + row0 * skt + h * skh
    g_ptr += b * sgb + row0 * sgt + h * sgh
    A_ptr += ((b * T + row0) * H + h) * C
    rt = tl.arange(0, BT)
    rows_i = i_i * BT + rt
    all_t = rt < BT
    for j_blk in range(0, i_i):  # earlier sub-blocks: decays factor at the start of sub-block i_i
        rows_j = j_blk * BT + rt
        acc = tl.zeros([BT, BT], dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            mk = rk < K
            q_in = tl.exp(tl.cumsum(load_rows(g_ptr, rows_i, rk, all_t, mk, sgt), axis=0))
            qq = load_rows(q_ptr, rows_i, rk, all_t, mk, sqt) * q_in
            between = blocks_between(g_ptr, rk, mk, (j_blk + 1) * BT, i_i * BT, C, sgt)
            k_fac = tl.exp(exclusive_suffix(g_ptr, rows_j, rk, mk, BT, sgt) + between[None, :])
            kk = load_rows(k_ptr, rows_j, rk, all_t, mk, skt) * k_fac
            acc += dot(qq, tl.trans(kk), BF16)
        tl.store(A_ptr + rows_i[:, None] * (H * C) + (j_blk * BT + rt)[None, :], acc)
    acc = tl.zeros([BT, BT], dtype=tl.float32)
    for k0 in range(0, K, DBK):  # the diagonal sub-block: all its pairs at once, [i, j, key] tiles
        rk = k0 + tl.arange(0, DBK)
        mk = rk < K
        qq = load_rows(q_ptr, rows_i, rk, all_t, mk, sqt)
        kk = load_rows(k_ptr, rows_i, rk, all_t, mk, skt)
        decay = pair_decays(load_rows(g_ptr, rows_i, rk, all_t, mk, sgt), BT, True)
        acc += tl.sum(qq[:, None, :] * kk[None, :, :] * decay, axis=2)
    tl.store(A_ptr + rows_i[:, None] * (H * C) + (i_i * BT + rt)[None, :], acc)


@triton.jit
def _output_kernel(
    q_ptr, v_ptr, g_ptr, states_ptr, A_ptr, o_ptr, T, N, scale,
    sqb, sqt, sqh, svb, svt, svh, sgb, sgt, sgh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr, NV: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)  # (V tile, chunk, b*H + h)
    i_v, rest = (pid % NV).to(tl.int32), pid // NV
    i_n, i_bh = rest % N, rest // N
    b, h = i_bh // H, i_bh % H
    row0 = i_n * C
    rv, rc = i_v * BV + tl.arange(0, BV), tl.arange(0, C)
    mv, all_rows = rv < V, rc < C
    q_ptr += b * sqb + row0 * sqt + h * sqh
    g_ptr += b * sgb + row0 * sgt + h * sgh
    v_ptr += b * svb + row0 * svt + h * svh
    states_ptr += (i_bh * N + i_n) * (K * V)
    acc = tl.zeros([C, BV], dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < K
        q_in = tl.exp(tl.cumsum(load_rows(g_ptr, rc, rk, all_rows, mk, sgt), axis=0))
        qq = load_rows(q_ptr, rc, rk, all_rows, mk, sqt) * q_in
        acc += dot(qq, load_rows(states_ptr, rk, rv, mk, mv, V), BF16)
    A_ptr += ((b * T + row0) * H + h) * C
    for c0 in range(0, C, BC):  # the scores in column blocks (keys c0 .. c0 + BC)
        rj = c0 + tl.arange(0, BC)
        a = load_rows(A_ptr, rc, rj, all_rows, rj < C, H * C)
        acc += dot(a, load_rows(v_ptr, rj, rv, rj < C, mv, svt), BF16)
    o_ptr += ((b * T + row0) * H + h) * V
    tl.store(o_ptr + rc[:, None] * (H * V) + rv[None, :], acc * scale, mask=all_rows[:, None] & mv[None, :])
