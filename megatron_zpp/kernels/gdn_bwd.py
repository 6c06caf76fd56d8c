"""Backward Triton kernels of chunked Gated DeltaNet: the per-chunk gradients (kernels/gdn.py describes the
decomposition and launches them; ops/gdn_chunked.py has the same math in torch; the reverse state scan is
kernels/delta_rule.py's, shared with KDA)."""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_common import delta_wy_backward, dot, load_rows
from .delta_rule import chunk_gates


@triton.jit
def _gdn_bwd_state_grads_kernel(
    q_ptr, k_ptr, g_ptr, beta_ptr, T_ptr, states_ptr, vnew_ptr, d_ends_ptr, do_ptr, dvnew_ptr,
    dq_ptr, dk_ptr, dTw_ptr, dG_ptr, dsuf_ptr, dbeta_ptr, T, N, scale,
    sqb, sqt, sqh, skb, skt, skh, sob, sot, soh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DO: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """Per chunk, K in tiles of BK (each with a loop over V tiles): the gradients through the states and W.

    dq = scale (do S_in^T) exp(G) and dk = (v_new dS_out^T) exp(suf) + beta exp(G) T^T dW, dW = -dv_new S_in^T,
    written to dq, dk (the scores' shares are added by _gdn_bwd_chunk_kernel); dW's share of dT (dW k_w^T) and
    these terms' shares of dbeta and of the exponents' gradients (dG_i, dsuf_j) to their buffers."""
    pid = tl.program_id(0).to(tl.int64)  # (chunk, b*H + h)
    i_n, i_bh = pid % N, pid // N
    b, h = i_bh // H, i_bh % H
    rc, rk, rv = tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BV)
    all_rows = rc < C
    row0 = i_n * C
    tok = i_bh * T + row0
    start, end, _ = chunk_gates(g_ptr + tok, rc, C)
    beta = tl.load(beta_ptr + tok + rc)
    inv = load_rows(T_ptr + tok * C, rc, rc, all_rows, all_rows, C)
    S_ptr = states_ptr + (i_bh * N + i_n) * (K * V)
    dE_ptr = d_ends_ptr + (i_bh * N + i_n) * (K * V)
    q_ptr += b * sqb + h * sqh + row0 * sqt
    k_ptr += b * skb + h * skh + row0 * skt
    do_ptr += b * sob + h * soh + row0 * sot
    out_rows = (b * T + row0 + rc) * H + h  # rows of the [B, T, H, K] gradients
    dTw = tl.zeros([C, C], dtype=tl.float32)
    dG = tl.zeros([C], dtype=tl.float32)
    dsuf = tl.zeros([C], dtype=tl.float32)
    dbeta = tl.zeros([C], dtype=tl.float32)
    d_total = tl.zeros([BV], dtype=tl.float32)
    for k0 in range(0, K, BK):
        mk = k0 + rk < K
        dq = tl.zeros([C, BK], dtype=tl.float32)
        dk_end = tl.zeros([C, BK], dtype=tl.float32)
        dW = tl.zeros([C, BK], dtype=tl.float32)
        for v0 in range(0, V, BV):
            mv = v0 + rv < V
            S = load_rows(S_ptr + k0 * V + v0, rk, rv, mk, mv, V)
            dE = load_rows(dE_ptr + k0 * V + v0, rk, rv, mk, mv, V)
            if HAS_DO:
                dq += dot(load_rows(do_ptr + v0, rc, rv, all_rows, mv, sot) * scale, tl.trans(S), BF16)
            dk_end += dot(load_rows(vnew_ptr + tok * V + v0, rc, rv, all_rows, mv, V), tl.trans(dE), BF16)
            dW -= dot(load_rows(dvnew_ptr + tok * V + v0, rc, rv, all_rows, mv, V), tl.trans(S), BF16)
            d_total += tl.sum(dE * S, axis=0)
        q_tile = load_rows(q_ptr + k0, rc, rk, all_rows, mk, sqt)
        k_tile = load_rows(k_ptr + k0, rc, rk, all_rows, mk, skt)
        k_w = k_tile * (beta * start)[:, None]
        dq = dq * start[:, None]
        dk_end = dk_end * end[:, None]
        dk_w = dot(tl.trans(inv), dW, BF16)
        dTw += dot(dW, tl.trans(k_w), BF16)
        dG += tl.sum(dq * q_tile, axis=1) + tl.sum(dk_w * k_w, axis=1)
        dsuf += tl.sum(dk_end * k_tile, axis=1)
        dbeta += tl.sum(dk_w * k_tile * start[:, None], axis=1)
        kd = out_rows[:, None] * K + k0 + rk[None, :]
        tl.store(dq_ptr + kd, dq, mask=mk[None, :])
        tl.store(dk_ptr + kd, dk_end + dk_w * (beta * start)[:, None], mask=mk[None, :])
    dG += tl.where(rc == C - 1, tl.sum(d_total, axis=0) * start, 0.0)  # the chunk total's decay of S_in
    tl.store(dTw_ptr + tok * C + rc[:, None] * C + rc[None, :], dTw)
    tl.store(dG_ptr + tok + rc, dG)
    tl.store(dsuf_ptr + tok + rc, dsuf)
    tl.store(dbeta_ptr + tok + rc, dbeta)


@triton.jit
def _gdn_bwd_wy_kernel(
    v_ptr, beta_ptr, T_ptr, vnew_ptr, do_ptr, dvnew_ptr, dTw_ptr, dA_ptr, dv_ptr, dbeta_ptr, T, N, scale,
    svb, svt, svh, sob, sot, soh,
    H: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr, HAS_DO: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """Per chunk, after _gdn_bwd_state_grads_kernel, V in tiles of BV: dv = beta T^T dv_new and its share of dbeta,
    the scores' gradient dA = scale do v_new^T, and dL = -T^T dT T^T (strictly lower; over dW's share of dT in
    its buffer). dv [B, T, H, V]; dA, dL [B, H, T, C] fp32."""
    delta_wy_backward(
        v_ptr, beta_ptr, T_ptr, vnew_ptr, do_ptr, dvnew_ptr, dTw_ptr, dA_ptr, dv_ptr, dbeta_ptr, T, N, scale,
        svb, svt, svh, sob, sot, soh, H, V, C, BV, HAS_DO, BF16,
    )  # fmt: skip


@triton.jit
def _gdn_bwd_chunk_kernel(
    q_ptr, k_ptr, g_ptr, beta_ptr, A_ptr, dA_ptr, dL_ptr, dG_ptr, dsuf_ptr, dq_ptr, dk_ptr, dg_ptr, dbeta_ptr, T, N,
    sqb, sqt, sqh, skb, skt, skh,
    H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """Per chunk, last: through L = beta_i (k k^T) exp(seg) and the scores A = (q k^T) exp(seg) the rest of dq, dk
    and dbeta, and dg from all the exponents' gradients (ops/gdn_chunked.py's bwd_chunks), K in tiles of BK.
    dq, dk [B, T, H, K] and dg, dbeta [B, H, T] contiguous fp32."""
    pid = tl.program_id(0).to(tl.int64)  # (chunk, b*H + h)
    i_n, i_bh = pid % N, pid // N
    b, h = i_bh // H, i_bh % H
    rc, rk = tl.arange(0, C), tl.arange(0, BK)
    all_rows = rc < C
    row0 = i_n * C
    tok = i_bh * T + row0
    out_rows = (b * T + row0 + rc) * H + h
    cc = rc[:, None] * C + rc[None, :]
    strict = rc[:, None] > rc[None, :]
    q_ptr += b * sqb + h * sqh + row0 * sqt
    k_ptr += b * skb + h * skh + row0 * skt
    kk = tl.zeros([C, C], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_tile = load_rows(k_ptr + k0, rc, rk, all_rows, k0 + rk < K, skt)
        kk += dot(k_tile, tl.trans(k_tile), BF16)
    # dg and dbeta are finished before the last K loop: fewer [C, C] tiles live at once
    _, _, pair = chunk_gates(g_ptr + tok, rc, C)
    kk = tl.where(strict, kk * pair, 0.0)
    dL = tl.load(dL_ptr + tok * C + cc)
    tl.store(dbeta_ptr + tok + rc, tl.load(dbeta_ptr + tok + rc) + tl.sum(dL * kk, axis=1))
    # dg_s = sum_{i>=s} dG_i + sum_{j<s} dsuf_j + sum_{i>=s, j<s} dseg[i, j]
    beta = tl.load(beta_ptr + tok + rc)
    dA = tl.load(dA_ptr + tok * C + cc)
    dseg = tl.where(strict, dA * tl.load(A_ptr + tok * C + cc), 0.0) + dL * beta[:, None] * kk
    # Inclusive sums only, no "inclusive minus own term": a token's own term can be far larger than the rest.
    from_s = tl.cumsum(dseg, axis=0, reverse=True)  # [s, j]: sum_{i>=s} dseg[i, j]
    before_s = rc[None, :] < rc[:, None]  # [s, j]: j < s
    seg_part = tl.sum(tl.where(before_s, from_s, 0.0), axis=1)
    dG, dsuf = tl.load(dG_ptr + tok + rc), tl.load(dsuf_ptr + tok + rc)
    dsuf_part = tl.sum(tl.where(before_s, dsuf[None, :], 0.0), axis=1)
    dg = tl.cumsum(dG, axis=0, reverse=True) + dsuf_part + seg_part
    tl.store(dg_ptr + tok + rc, dg)
    dkk = dL * beta[:, None] * pair
    dA_pair = dA * pair
    for k0 in range(0, K, BK):
        mk = k0 + rk < K
        q_tile = load_rows(q_ptr + k0, rc, rk, all_rows, mk, sqt)
        k_tile = load_rows(k_ptr + k0, rc, rk, all_rows, mk, skt)
        kd = out_rows[:, None] * K + k0 + rk[None, :]
        dq = tl.load(dq_ptr + kd, mask=mk[None, :], other=0.0) + dot(dA_pair, k_tile, BF16)
        dk = tl.load(dk_ptr + kd, mask=mk[None, :], other=0.0) + dot(tl.trans(dA_pair), q_tile, BF16)
        dk += dot(dkk, k_tile, BF16) + dot(tl.trans(dkk), k_tile, BF16)
        tl.store(dq_ptr + kd, dq, mask=mk[None, :])
        tl.store(dk_ptr + kd, dk, mask=mk[None, :])
