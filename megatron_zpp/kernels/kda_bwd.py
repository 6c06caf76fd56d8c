"""Backward Triton kernels of chunked Kimi Delta Attention: the per-chunk gradients (kernels/kda.py describes the
decomposition and launches them; ops/kda_chunked.py has the same math in torch; the reverse state scan is
kernels/delta_rule.py's, shared with GDN)."""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_common import blocks_between, delta_wy_backward, device_fn, dot, exclusive_suffix, load_rows, pair_decays


@device_fn
def _state_products(
    S_ptr, dE_ptr, do_ptr, vnew_ptr, dvnew_ptr, scale, sot, mk,
    V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_DO: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """One chunk's products over V (tiles of BV) for the rows of one K tile: scale do S_in^T, v_new dS_out^T,
    -dv_new S_in^T ([C, BK] each) and sum_V S_in * dS_out ([BK])."""
    rc, rk, rv = tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BV)
    all_rows = rc < C
    dq = tl.zeros([C, BK], dtype=tl.float32)
    dk_end = tl.zeros([C, BK], dtype=tl.float32)
    dW = tl.zeros([C, BK], dtype=tl.float32)
    entering = tl.zeros([BK], dtype=tl.float32)
    for v0 in range(0, V, BV):
        mv = v0 + rv < V
        S = load_rows(S_ptr + v0, rk, rv, mk, mv, V)
        dE = load_rows(dE_ptr + v0, rk, rv, mk, mv, V)
        if HAS_DO:
            dq += dot(load_rows(do_ptr + v0, rc, rv, all_rows, mv, sot) * scale, tl.trans(S), BF16)
        dk_end += dot(load_rows(vnew_ptr + v0, rc, rv, all_rows, mv, V), tl.trans(dE), BF16)
        dW -= dot(load_rows(dvnew_ptr + v0, rc, rv, all_rows, mv, V), tl.trans(S), BF16)
        entering += tl.sum(dE * S, axis=1)
    return dq, dk_end, dW, entering


@triton.jit
def _kda_bwd_state_grads_kernel(
    q_ptr, k_ptr, g_ptr, beta_ptr, T_ptr, states_ptr, vnew_ptr, d_ends_ptr, do_ptr, dvnew_ptr,
    dq_ptr, dk_ptr, dGc_ptr, dsuf_ptr, dTw_ptr, dbeta_ptr, T, N, scale,
    sqb, sqt, sqh, skb, skt, skh, sgb, sgt, sgh, sob, sot, soh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DO: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """Per chunk, K in tiles of BK (each with a loop over V tiles): the gradients through the states and W.

    dq = scale (do S_in^T) exp(G), dk = (v_new dS_out^T) exp(suf) + beta exp(G) T^T dW with dW = -dv_new S_in^T
    (the scores' shares are added by _kda_bwd_intra_kernel); dW's share of dT (dW k_w^T) and of dbeta; and these
    terms' shares of dGc, the gradient of the cumulative exponents G_i (kernels/kda.py): q dq + k_w dk_w and at
    the chunk's last token the decay of S_in; and dsuf_j = k_j dk_end_j, the gradient of the exponent suf_j."""
    pid = tl.program_id(0).to(tl.int64)  # (chunk, b*H + h)
    i_n, i_bh = pid % N, pid // N
    b, h = i_bh // H, i_bh % H
    rc, rk = tl.arange(0, C), tl.arange(0, BK)
    all_rows = rc < C
    row0 = i_n * C
    tok = i_bh * T + row0
    beta = tl.load(beta_ptr + tok + rc)
    inv = load_rows(T_ptr + tok * C, rc, rc, all_rows, all_rows, C)
    S_ptr = states_ptr + (i_bh * N + i_n) * (K * V)
    dE_ptr = d_ends_ptr + (i_bh * N + i_n) * (K * V)
    q_ptr += b * sqb + h * sqh + row0 * sqt
    k_ptr += b * skb + h * skh + row0 * skt
    g_ptr += b * sgb + h * sgh + row0 * sgt
    do_ptr += b * sob + h * soh + row0 * sot
    out_rows = (b * T + row0 + rc) * H + h  # rows of the [B, T, H, K] gradients
    dTw = tl.zeros([C, C], dtype=tl.float32)
    dbeta = tl.zeros([C], dtype=tl.float32)
    last = rc == C - 1
    for k0 in range(0, K, BK):
        mk = k0 + rk < K
        dq, dk_end, dW, entering = _state_products(
            S_ptr + k0 * V, dE_ptr + k0 * V, do_ptr, vnew_ptr + tok * V, dvnew_ptr + tok * V, scale, sot, mk,
            V, C, BK, BV, HAS_DO, BF16,
        )  # fmt: skip
        g = load_rows(g_ptr + k0, rc, rk, all_rows, mk, sgt)
        start = tl.exp(tl.cumsum(g, axis=0))
        q_tile = load_rows(q_ptr + k0, rc, rk, all_rows, mk, sqt)
        k_tile = load_rows(k_ptr + k0, rc, rk, all_rows, mk, skt)
        k_w = k_tile * start * beta[:, None]
        dq = dq * start
        dk_end = dk_end * tl.exp(exclusive_suffix(g_ptr, rc, k0 + rk, mk, C, sgt))
        dsuf = dk_end * k_tile
        dk_w = dot(tl.trans(inv), dW, BF16)
        dTw += dot(dW, tl.trans(k_w), BF16)
        dbeta += tl.sum(dk_w * k_tile * start, axis=1)
        at_end = tl.exp(tl.sum(g, axis=0)) * entering
        dGc = dq * q_tile + dk_w * k_w + tl.where(last[:, None], at_end[None, :], 0.0)
        kd = out_rows[:, None] * K + k0 + rk[None, :]
        tl.store(dq_ptr + kd, dq, mask=mk[None, :])
        tl.store(dk_ptr + kd, dk_end + dk_w * (beta[:, None] * start), mask=mk[None, :])
        tl.store(dGc_ptr + kd, dGc, mask=mk[None, :])
        tl.store(dsuf_ptr + kd, dsuf, mask=mk[None, :])
    tl.store(dTw_ptr + tok * C + rc[:, None] * C + rc[None, :], dTw)
    tl.store(dbeta_ptr + tok + rc, dbeta)


@triton.jit
def _kda_bwd_wy_kernel(
    v_ptr, beta_ptr, T_ptr, vnew_ptr, do_ptr, dvnew_ptr, dTw_ptr, dA_ptr, dv_ptr, dbeta_ptr, T, N, scale,
    svb, svt, svh, sob, sot, soh,
    H: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr, HAS_DO: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """Per chunk, after _kda_bwd_state_grads_kernel: dv, its share of dbeta, the scores' gradient dA and
    dL = -T^T dT T^T, as Gated DeltaNet's (kernels/chunk_common.py's delta_wy_backward)."""
    delta_wy_backward(
        v_ptr, beta_ptr, T_ptr, vnew_ptr, do_ptr, dvnew_ptr, dTw_ptr, dA_ptr, dv_ptr, dbeta_ptr, T, N, scale,
        svb, svt, svh, sob, sot, soh, H, V, C, BV, HAS_DO, BF16,
    )  # fmt: skip


@device_fn
def _from_earlier_blocks(
    dA_ptr, dL_ptr, beta_ptr, k_ptr, g_ptr, i_i, rk, mk, skt, sgt,
    C: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """Sub-block I's rows as the later token of a pair with the keys of every earlier sub-block J, the decay taken
    to I's start: (sum_j dA_ij k_j, sum_j beta_i dL_ij k_j) times exp(suffix of J after j + blocks between) [BT, BK]
    (the caller multiplies by the prefix of I up to i)."""
    rt = tl.arange(0, BT)
    rows_i, all_t = i_i * BT + rt, rt < BT
    beta_i = tl.load(beta_ptr + rows_i)
    dq_row = tl.zeros([BT, BK], dtype=tl.float32)
    dk_row = tl.zeros([BT, BK], dtype=tl.float32)
    for j_blk in range(0, i_i):
        rows_j = j_blk * BT + rt
        between = blocks_between(g_ptr, rk, mk, (j_blk + 1) * BT, i_i * BT, C, sgt)
        k_fac = tl.exp(exclusive_suffix(g_ptr, rows_j, rk, mk, BT, sgt) + between[None, :])
        kj = load_rows(k_ptr, rows_j, rk, all_t, mk, skt) * k_fac
        dq_row += dot(load_rows(dA_ptr, rows_i, rows_j, all_t, all_t, C), kj, BF16)
        dk_row += dot(load_rows(dL_ptr, rows_i, rows_j, all_t, all_t, C) * beta_i[:, None], kj, BF16)
    return dq_row, dk_row


@device_fn
def _from_later_blocks(
    dA_ptr, dL_ptr, beta_ptr, q_ptr, k_ptr, g_ptr, i_i, rk, mk, sqt, skt, sgt,
    C: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """Sub-block I's rows as the earlier token of a pair with the tokens i of every later sub-block:
    sum_i (dA_ij q_i + beta_i dL_ij k_i) exp(prefix of i's block up to i + blocks between) [BT, BK] (the caller
    multiplies by the suffix of I after j)."""
    rt = tl.arange(0, BT)
    rows_i, all_t = i_i * BT + rt, rt < BT
    dk_col = tl.zeros([BT, BK], dtype=tl.float32)
    for i_blk in range(i_i + 1, C // BT):
        rows_q = i_blk * BT + rt
        between = blocks_between(g_ptr, rk, mk, (i_i + 1) * BT, i_blk * BT, C, sgt)
        q_fac = tl.exp(tl.cumsum(load_rows(g_ptr, rows_q, rk, all_t, mk, sgt), axis=0) + between[None, :])
        dA = load_rows(dA_ptr, rows_q, rows_i, all_t, all_t, C)
        dkk = load_rows(dL_ptr, rows_q, rows_i, all_t, all_t, C) * tl.load(beta_ptr + rows_q)[:, None]
        dk_col += dot(tl.trans(dA), load_rows(q_ptr, rows_q, rk, all_t, mk, sqt) * q_fac, BF16)
        dk_col += dot(tl.trans(dkk), load_rows(k_ptr, rows_q, rk, all_t, mk, skt) * q_fac, BF16)
    return dk_col


@triton.jit
def _kda_bwd_intra_kernel(
    q_ptr, k_ptr, g_ptr, beta_ptr, dA_ptr, dL_ptr, dq_ptr, dk_ptr, dGc_ptr, T, N,
    sqb, sqt, sqh, skb, skt, skh, sgb, sgt, sgh,
    H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """Per sub-block I of BT tokens, K in tiles of BK: through the scores A (dA) and L (dkk = beta_i dL[i, j]) the
    rest of dq and dk for I's rows, added to the state-grads kernel's, and their shares of dGc: + q dq and
    + k dk as the row (later token i) of a pair, - k dk as its column (earlier token j). Pairs in other sub-blocks
    factor their decay at a sub-block boundary (as the scores kernel), pairs inside I in [BT, BT, BK] tiles; the
    same-token scores (A's diagonal, no decay) add to dq and dk only."""
    pid = tl.program_id(0).to(tl.int64)  # (sub-block, chunk, b*H + h)
    i_i, rest = (pid % (C // BT)).to(tl.int32), pid // (C // BT)
    i_n, i_bh = rest % N, rest // N
    b, h = i_bh // H, i_bh % H
    row0 = i_n * C
    q_ptr += b * sqb + row0 * sqt + h * sqh
    k_ptr += b * skb + row0 * skt + h * skh
    g_ptr += b * sgb + row0 * sgt + h * sgh
    tok = i_bh * T + row0
    dA_ptr += tok * C
    dL_ptr += tok * C
    beta_ptr += tok
    rt = tl.arange(0, BT)
    rows_i = i_i * BT + rt
    all_t = rt < BT
    dA_ii = load_rows(dA_ptr, rows_i, rows_i, all_t, all_t, C)
    same = tl.sum(tl.where(rt[:, None] == rt[None, :], dA_ii, 0.0), axis=1)  # dA[i, i]
    dkk_ii = load_rows(dL_ptr, rows_i, rows_i, all_t, all_t, C) * tl.load(beta_ptr + rows_i)[:, None]
    for k0 in range(0, K, BK):  # each key tile is finished in registers and stored once
        rk = k0 + tl.arange(0, BK)
        mk = rk < K
        qi = load_rows(q_ptr, rows_i, rk, all_t, mk, sqt)
        ki = load_rows(k_ptr, rows_i, rk, all_t, mk, skt)
        gi = load_rows(g_ptr, rows_i, rk, all_t, mk, sgt)
        dq_row, dk_row = _from_earlier_blocks(
            dA_ptr, dL_ptr, beta_ptr, k_ptr, g_ptr, i_i, rk, mk, skt, sgt, C, BT, BK, BF16
        )
        q_in = tl.exp(tl.cumsum(gi, axis=0))
        dq_row, dk_row = dq_row * q_in, dk_row * q_in
        dk_col = _from_later_blocks(
            dA_ptr, dL_ptr, beta_ptr, q_ptr, k_ptr, g_ptr, i_i, rk, mk, sqt, skt, sgt, C, BT, BK, BF16
        )
        dk_col = dk_col * tl.exp(exclusive_suffix(g_ptr, rows_i, rk, mk, BT, sgt))
        decay = pair_decays(gi, BT, False)  # pairs j < i inside the sub-block
        w = dA_ii[:, :, None] * decay
        dq_row += tl.sum(w * ki[None, :, :], axis=1)
        dk_col += tl.sum(w * qi[:, None, :], axis=0)
        w = dkk_ii[:, :, None] * decay
        dk_row += tl.sum(w * ki[None, :, :], axis=1)
        dk_col += tl.sum(w * ki[:, None, :], axis=0)
        out = ((b * T + row0 + rows_i) * H + h)[:, None] * K + rk[None, :]
        dGc = tl.load(dGc_ptr + out, mask=mk[None, :], other=0.0) + qi * dq_row + ki * (dk_row - dk_col)
        tl.store(dGc_ptr + out, dGc, mask=mk[None, :])
        dq = tl.load(dq_ptr + out, mask=mk[None, :], other=0.0) + dq_row + same[:, None] * ki
        tl.store(dq_ptr + out, dq, mask=mk[None, :])
        dk = tl.load(dk_ptr + out, mask=mk[None, :], other=0.0) + dk_row + dk_col + same[:, None] * qi
        tl.store(dk_ptr + out, dk, mask=mk[None, :])


@triton.jit
def _kda_bwd_gate_kernel(
    g_ptr, L_ptr, dL_ptr, dGc_ptr, dsuf_ptr, dg_ptr, dbeta_ptr, T, N, log_tiny, sgb, sgt, sgh,
    H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """Per chunk, last: dg_s = sum_{i>=s} dGc_i + sum_{j<s} dsuf_j (a reverse cumsum and a cumsum of dsuf loaded
    one token later: no "inclusive minus own term", which cancels a large undecayed dsuf_{C-1}; 0 where exp(g)
    is 0 in fp32, as the reference's every term is) into dg [B, T, H, K], and L's share of dbeta."""
    pid = tl.program_id(0).to(tl.int64)  # (chunk, b*H + h)
    i_n, i_bh = pid % N, pid // N
    b, h = i_bh // H, i_bh % H
    rc, rk = tl.arange(0, C), tl.arange(0, BK)
    all_rows = rc < C
    row0 = i_n * C
    tok = i_bh * T + row0
    cc = rc[:, None] * C + rc[None, :]
    dbeta = tl.load(dbeta_ptr + tok + rc) + tl.sum(tl.load(dL_ptr + tok * C + cc) * tl.load(L_ptr + tok * C + cc), 1)
    tl.store(dbeta_ptr + tok + rc, dbeta)
    g_ptr += b * sgb + h * sgh + row0 * sgt
    out_rows = (b * T + row0 + rc) * H + h
    for k0 in range(0, K, BK):
        mk = k0 + rk < K
        kd = out_rows[:, None] * K + k0 + rk[None, :]
        dGc = tl.load(dGc_ptr + kd, mask=mk[None, :], other=0.0)
        g = load_rows(g_ptr + k0, rc, rk, all_rows, mk, sgt)
        rows = out_rows - H  # the token before: an exclusive prefix sum of dsuf
        dsuf = tl.load(dsuf_ptr + rows[:, None] * K + k0 + rk[None, :], mask=(rc > 0)[:, None] & mk[None, :], other=0.0)
        dg = tl.where(g < log_tiny, 0.0, tl.cumsum(dGc, axis=0, reverse=True) + tl.cumsum(dsuf, axis=0))
        tl.store(dg_ptr + kd, dg, mask=mk[None, :])
