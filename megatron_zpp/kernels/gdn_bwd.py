"""Backward Triton kernels of chunked Gated DeltaNet: the reverse state scan and the per-chunk gradients
(kernels/gdn.py describes the decomposition and launches them; ops/gdn_chunked.py has the same math in torch)."""

from __future__ import annotations

import triton
import triton.language as tl

from .gdn_fwd import _chunk_gates
from .gla_common import _dot, _load_rows


@triton.jit
def _gdn_bwd_states_kernel(
    q_ptr, k_ptr, g_ptr, A_ptr, W_ptr, do_ptr, dS_ptr, d_ends_ptr, dvnew_ptr, dh0_ptr, T, N, scale,
    sqb, sqt, sqh, skb, skt, skh, sob, sot, soh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NV: tl.constexpr, HAS_DO: tl.constexpr, HAS_DS: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """Reverse scan per (V tile, head): d_ends[n] (the gradient of the state leaving chunk n), dv_new and dh0.

    dv_new = scale A^T do + (k exp(suf)) dS_out;  dS_in = exp(G_{C-1}) dS_out + scale (q exp(G))^T do - W^T dv_new."""
    pid = tl.program_id(0).to(tl.int64)  # (V tile, b*H + h)
    i_v, i_bh = (pid % NV).to(tl.int32), pid // NV
    b, h = i_bh // H, i_bh % H
    rc, rk, rv = tl.arange(0, C), tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    mk, mv, all_rows = rk < K, rv < V, rc < C
    kv = rk[:, None] * V + rv[None, :]
    mkv = mk[:, None] & mv[None, :]
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DS:
        dS = tl.load(dS_ptr + i_bh * (K * V) + kv, mask=mkv, other=0.0)
    q_ptr += b * sqb + h * sqh
    k_ptr += b * skb + h * skh
    do_ptr += b * sob + h * soh
    for step in range(N):
        i_n = N - 1 - step
        tok = i_bh * T + i_n * C
        tl.store(d_ends_ptr + (i_bh * N + i_n) * (K * V) + kv, dS, mask=mkv)
        start, end, _ = _chunk_gates(g_ptr + tok, rc, C)
        kk = _load_rows(k_ptr + i_n * C * skt, rc, rk, all_rows, mk, skt)
        dv_new = _dot(kk * end[:, None], dS, BF16)
        total = tl.sum(tl.where(rc == C - 1, start, 0.0), axis=0)
        dS = dS * total
        if HAS_DO:
            do = _load_rows(do_ptr + i_n * C * sot, rc, rv, all_rows, mv, sot) * scale
            A = _load_rows(A_ptr + tok * C, rc, rc, all_rows, all_rows, C)
            qq = _load_rows(q_ptr + i_n * C * sqt, rc, rk, all_rows, mk, sqt)
            dv_new += _dot(tl.trans(A), do, BF16)
            dS += _dot(tl.trans(qq * start[:, None]), do, BF16)
        tl.store(dvnew_ptr + tok * V + rc[:, None] * V + rv[None, :], dv_new, mask=mv[None, :])
        W = _load_rows(W_ptr + tok * K, rc, rk, all_rows, mk, K)
        dS -= _dot(tl.trans(W), dv_new, BF16)
    tl.store(dh0_ptr + i_bh * (K * V) + kv, dS, mask=mkv)


@triton.jit
def _gdn_bwd_chunk_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, T_ptr, A_ptr, states_ptr, vnew_ptr, d_ends_ptr, do_ptr, dvnew_ptr,
    dq_ptr, dk_ptr, dv_ptr, dg_ptr, dbeta_ptr, T, N, scale,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DO: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """Per chunk: dq, dk, dv, dg, dbeta from the scans' states, v_new, d_ends and dv_new (ops/gdn_chunked.py's
    bwd_chunks). dq, dk, dv [B, T, H, D] and dg, dbeta [B, H, T] contiguous, fp32."""
    pid = tl.program_id(0).to(tl.int64)  # (chunk, b*H + h)
    i_n, i_bh = pid % N, pid // N
    b, h = i_bh // H, i_bh % H
    rc, rk, rv = tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BV)
    mk, all_rows = rk < K, rc < C
    row0 = i_n * C
    tok = i_bh * T + row0
    start, end, pair = _chunk_gates(g_ptr + tok, rc, C)
    beta = tl.load(beta_ptr + tok + rc)
    inv = _load_rows(T_ptr + tok * C, rc, rc, all_rows, all_rows, C)
    S_ptr = states_ptr + (i_bh * N + i_n) * (K * V)
    dE_ptr = d_ends_ptr + (i_bh * N + i_n) * (K * V)
    v_ptr += b * svb + h * svh + row0 * svt
    do_ptr += b * sob + h * soh + row0 * sot
    out_rows = (b * T + row0 + rc) * H + h  # rows of the [B, T, H, D] gradients
    dq_state = tl.zeros([C, BK], dtype=tl.float32)
    dA = tl.zeros([C, C], dtype=tl.float32)  # scale do v_new^T
    dk_end = tl.zeros([C, BK], dtype=tl.float32)
    dW = tl.zeros([C, BK], dtype=tl.float32)
    dT = tl.zeros([C, C], dtype=tl.float32)
    d_total = tl.zeros([BV], dtype=tl.float32)
    dbeta = tl.zeros([C], dtype=tl.float32)
    for v0 in range(0, V, BV):
        mv = v0 + rv < V
        S = _load_rows(S_ptr + v0, rk, rv, mk, mv, V)
        dE = _load_rows(dE_ptr + v0, rk, rv, mk, mv, V)
        v_new = _load_rows(vnew_ptr + tok * V + v0, rc, rv, all_rows, mv, V)
        dv_new = _load_rows(dvnew_ptr + tok * V + v0, rc, rv, all_rows, mv, V)
        vv = _load_rows(v_ptr + v0, rc, rv, all_rows, mv, svt)
        if HAS_DO:
            do = _load_rows(do_ptr + v0, rc, rv, all_rows, mv, sot) * scale
            dq_state += _dot(do, tl.trans(S), BF16)
            dA += _dot(do, tl.trans(v_new), BF16)
        dk_end += _dot(v_new, tl.trans(dE), BF16)
        dW -= _dot(dv_new, tl.trans(S), BF16)
        dT += _dot(dv_new, tl.trans(vv * beta[:, None]), BF16)
        d_total += tl.sum(dE * S, axis=0)
        dv_u = _dot(tl.trans(inv), dv_new, BF16)
        dbeta += tl.sum(dv_u * vv, axis=1)
        tl.store(dv_ptr + out_rows[:, None] * V + v0 + rv[None, :], dv_u * beta[:, None], mask=mv[None, :])
    qq = _load_rows(q_ptr + b * sqb + h * sqh + row0 * sqt, rc, rk, all_rows, mk, sqt)
    kk = _load_rows(k_ptr + b * skb + h * skh + row0 * skt, rc, rk, all_rows, mk, skt)
    strict = rc[:, None] > rc[None, :]
    # through T, W = T k_w and U = T (beta v)
    k_w = kk * (beta * start)[:, None]
    dT += _dot(dW, tl.trans(k_w), BF16)
    dk_w = _dot(tl.trans(inv), dW, BF16)
    dL = tl.where(strict, -_dot(_dot(tl.trans(inv), dT, BF16), tl.trans(inv), BF16), 0.0)
    # L = beta_i (k k^T) exp(seg), strictly lower
    kk_decay = tl.where(strict, _dot(kk, tl.trans(kk), BF16) * pair, 0.0)
    dkk = dL * beta[:, None] * pair
    dq_state = dq_state * start[:, None]
    dA_pair = dA * pair
    dq = dq_state + _dot(dA_pair, kk, BF16)
    dk = _dot(tl.trans(dA_pair), qq, BF16) + dk_end * end[:, None]
    dk += _dot(dkk, kk, BF16) + _dot(tl.trans(dkk), kk, BF16) + dk_w * (beta * start)[:, None]
    dbeta += tl.sum(dL * kk_decay, axis=1) + tl.sum(dk_w * kk * start[:, None], axis=1)
    # the exponents' gradients: G_i, suf_j, seg[i, j], each summed over the tokens its exponent spans
    A = _load_rows(A_ptr + tok * C, rc, rc, all_rows, all_rows, C)
    dG = tl.sum(dq_state * qq, axis=1) + tl.sum(dk_w * k_w, axis=1)
    dG += tl.where(rc == C - 1, tl.sum(d_total, axis=0) * start, 0.0)
    dsuf = tl.sum(dk_end * end[:, None] * kk, axis=1)
    dseg = tl.where(strict, dA * A, 0.0) + dL * beta[:, None] * kk_decay
    before = tl.where(rc[:, None] < rc[None, :], 1.0, 0.0)  # [j, s]: j < s
    seg_part = tl.sum(tl.where(rc[:, None] >= rc[None, :], _dot(dseg, before, 0), 0.0), axis=0)
    dg = tl.cumsum(dG, axis=0, reverse=True) + tl.sum(dsuf[:, None] * before, axis=0) + seg_part
    tl.store(dg_ptr + tok + rc, dg)
    tl.store(dbeta_ptr + tok + rc, dbeta)
    kd = out_rows[:, None] * K + rk[None, :]
    tl.store(dq_ptr + kd, dq, mask=mk[None, :])
    tl.store(dk_ptr + kd, dk, mask=mk[None, :])
