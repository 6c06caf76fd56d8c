"""Backward Triton kernels of chunked GLA: the reverse state scan, the score and value gradients, the
intra-chunk and the inter-chunk gradients of q, k and g (kernels/gla.py describes the decomposition and
launches them)."""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_common import blocks_between, dot, exclusive_suffix, load_rows, pair_decays


@triton.jit
def _bwd_states_kernel(
    q_ptr, g_ptr, do_ptr, dS_ptr, d_ends_ptr, dh0_ptr, N, scale,
    sqb, sqt, sqh, sgb, sgt, sgh, sob, sot, soh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NK: tl.constexpr, NV: tl.constexpr, HAS_DO: tl.constexpr, HAS_DS: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)  # (V tile, K tile, b*H + h)
    i_v, i_k, i_bh = (pid % NV).to(tl.int32), ((pid // NV) % NK).to(tl.int32), pid // (NV * NK)
    b, h = i_bh // H, i_bh % H
    rk, rv, rc = i_k * BK + tl.arange(0, BK), i_v * BV + tl.arange(0, BV), tl.arange(0, C)
    mk, mv, all_rows = rk < K, rv < V, rc < C
    kv = rk[:, None] * V + rv[None, :]
    mkv = mk[:, None] & mv[None, :]
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DS:
        dS = tl.load(dS_ptr + i_bh * (K * V) + kv, mask=mkv, other=0.0).to(tl.float32)
    c64, kv64, last = i_bh * 0 + C, i_bh * 0 + K * V, i_bh * 0 + (N - 1)  # 64-bit; last: the last chunk
    q_ptr += b * sqb + last * C * sqt + h * sqh
    g_ptr += b * sgb + last * C * sgt + h * sgh
    do_ptr += b * sob + last * C * sot + h * soh
    d_ends_ptr += (i_bh * N + last) * (K * V)
    for _ in range(N):  # the pointers step back one chunk per step
        tl.store(d_ends_ptr + kv, dS, mask=mkv)
        gg = load_rows(g_ptr, rc, rk, all_rows, mk, sgt)
        dS = dS * tl.exp(tl.sum(gg, axis=0))[:, None]
        if HAS_DO:
            qq = load_rows(q_ptr, rc, rk, all_rows, mk, sqt) * tl.exp(tl.cumsum(gg, axis=0))
            dd = load_rows(do_ptr, rc, rv, all_rows, mv, sot)
            dS += dot(tl.trans(qq * scale), dd, BF16)
        d_ends_ptr -= kv64
        q_ptr -= c64 * sqt
        g_ptr -= c64 * sgt
        do_ptr -= c64 * sot
    tl.store(dh0_ptr + i_bh * (K * V) + kv, dS, mask=mkv)


@triton.jit
def _score_grad_kernel(
    do_ptr, v_ptr, dA_ptr, T, N, scale, sob, sot, soh, svb, svt, svh,
    H: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BR: tl.constexpr, BV: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)  # (row block, chunk, b*H + h)
    i_r, rest = (pid % (C // BR)).to(tl.int32), pid // (C // BR)
    i_n, i_bh = rest % N, rest // N
    b, h = i_bh // H, i_bh % H
    row0 = i_n * C
    do_ptr += b * sob + row0 * sot + h * soh
    v_ptr += b * svb + row0 * svt + h * svh
    rr, rc = i_r * BR + tl.arange(0, BR), tl.arange(0, C)
    all_r, all_c = rr < C, rc < C
    acc = tl.zeros([BR, C], dtype=tl.float32)
    for v0 in range(0, V, BV):
        rv = v0 + tl.arange(0, BV)
        mv = rv < V
        dd = load_rows(do_ptr, rr, rv, all_r, mv, sot)
        vv = load_rows(v_ptr, rc, rv, all_c, mv, svt)
        acc += dot(dd, tl.trans(vv), BF16)
    acc = tl.where(rr[:, None] >= rc[None, :], acc * scale, 0.0)
    dA_ptr += ((b * T + row0) * H + h) * C
    tl.store(dA_ptr + rr[:, None] * (H * C) + rc[None, :], acc)


@triton.jit
def _dv_kernel(
    k_ptr, g_ptr, do_ptr, A_ptr, d_ends_ptr, dv_ptr, T, N, scale,
    skb, skt, skh, sgb, sgt, sgh, sob, sot, soh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BC: tl.constexpr, NV: tl.constexpr, HAS_DO: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)  # (V tile, chunk, b*H + h)
    i_v, rest = (pid % NV).to(tl.int32), pid // NV
    i_n, i_bh = rest % N, rest // N
    b, h = i_bh // H, i_bh % H
    row0 = i_n * C
    rv, rc = i_v * BV + tl.arange(0, BV), tl.arange(0, C)
    mv, all_rows = rv < V, rc < C
    k_ptr += b * skb + row0 * skt + h * skh
    g_ptr += b * sgb + row0 * sgt + h * sgh
    d_ends_ptr += (i_bh * N + i_n) * (K * V)
    acc = tl.zeros([C, BV], dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < K
        k_out = tl.exp(exclusive_suffix(g_ptr, rc, rk, mk, C, sgt))
        kk = load_rows(k_ptr, rc, rk, all_rows, mk, skt) * k_out
        acc += dot(kk, load_rows(d_ends_ptr, rk, rv, mk, mv, V), BF16)
    if HAS_DO:
        do_ptr += b * sob + row0 * sot + h * soh
        A_ptr += ((b * T + row0) * H + h) * C
        for i0 in range(0, C, BC):  # the scores' rows (queries i0 .. i0 + BC)
            ri = i0 + tl.arange(0, BC)
            a = load_rows(A_ptr, ri, rc, ri < C, all_rows, H * C) * scale
            acc += dot(tl.trans(a), load_rows(do_ptr, ri, rv, ri < C, mv, sot), BF16)
    dv_ptr += ((b * T + row0) * H + h) * V
    tl.store(dv_ptr + rc[:, None] * (H * V) + rv[None, :], acc, mask=all_rows[:, None] & mv[None, :])


@triton.jit
def _intra_grad_kernel(
    q_ptr, k_ptr, g_ptr, dA_ptr, dq_ptr, dk_ptr, T, N,
    sqb, sqt, sqh, skb, skt, skh, sgb, sgt, sgh,
    H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)  # (sub-block, chunk, b*H + h)
    i_i, rest = (pid % (C // BT)).to(tl.int32), pid // (C // BT)
    i_n, i_bh = rest % N, rest // N
    b, h = i_bh // H, i_bh % H
    row0 = i_n * C
    q_ptr += b * sqb + row0 * sqt + h * sqh
    k_ptr += b * skb + row0 * skt + h * skh
    g_ptr += b * sgb + row0 * sgt + h * sgh
    dA_ptr += ((b * T + row0) * H + h) * C
    out_base = ((b * T + row0) * H + h) * K
    rt = tl.arange(0, BT)
    rows_i = i_i * BT + rt
    all_t = rt < BT
    n_sub = C // BT
    da_diag = load_rows(dA_ptr, rows_i, i_i * BT + rt, all_t, all_t, H * C)
    for k0 in range(0, K, BK):  # each key tile is finished in registers and stored once
        rk = k0 + tl.arange(0, BK)
        mk = rk < K
        qq = load_rows(q_ptr, rows_i, rk, all_t, mk, sqt)
        kk = load_rows(k_ptr, rows_i, rk, all_t, mk, skt)
        gg = load_rows(g_ptr, rows_i, rk, all_t, mk, sgt)
        dq = tl.zeros([BT, BK], dtype=tl.float32)
        for j_blk in range(0, i_i):  # keys in earlier sub-blocks
            rows_j = j_blk * BT + rt
            between = blocks_between(g_ptr, rk, mk, (j_blk + 1) * BT, i_i * BT, C, sgt)
            k_fac = tl.exp(exclusive_suffix(g_ptr, rows_j, rk, mk, BT, sgt) + between[None, :])
            k_earlier = load_rows(k_ptr, rows_j, rk, all_t, mk, skt) * k_fac
            da = load_rows(dA_ptr, rows_i, j_blk * BT + rt, all_t, all_t, H * C)
            dq += dot(da, k_earlier, BF16)
        dq = dq * tl.exp(tl.cumsum(gg, axis=0))
        dk = tl.zeros([BT, BK], dtype=tl.float32)
        for i_blk in range(i_i + 1, n_sub):  # queries in later sub-blocks
            rows_q = i_blk * BT + rt
            between = blocks_between(g_ptr, rk, mk, (i_i + 1) * BT, i_blk * BT, C, sgt)
            q_fac = tl.exp(tl.cumsum(load_rows(g_ptr, rows_q, rk, all_t, mk, sgt), axis=0) + between[None, :])
            q_later = load_rows(q_ptr, rows_q, rk, all_t, mk, sqt) * q_fac
            da = load_rows(dA_ptr, rows_q, i_i * BT + rt, all_t, all_t, H * C)
            dk += dot(tl.trans(da), q_later, BF16)
        dk = dk * tl.exp(exclusive_suffix(g_ptr, rows_i, rk, mk, BT, sgt))
        # pairs j < i inside the sub-block (the same-token pairs are the caller's)
        w = da_diag[:, :, None] * pair_decays(gg, BT, False)
        dq += tl.sum(w * kk[None, :, :], axis=1)
        dk += tl.sum(w * qq[:, None, :], axis=0)
        out = out_base + rows_i[:, None] * (H * K) + rk[None, :]
        tl.store(dq_ptr + out, dq, mask=mk[None, :])
        tl.store(dk_ptr + out, dk, mask=mk[None, :])


@triton.jit
def _dqkg_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, do_ptr, dA_ptr, states_ptr, d_ends_ptr, dq_ptr, dk_ptr, dg_ptr, T, N, scale,
    log_tiny, sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sgb, sgt, sgh, sob, sot, soh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NK: tl.constexpr, HAS_DO: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)  # (K tile, chunk, b*H + h)
    i_k, rest = (pid % NK).to(tl.int32), pid // NK
    i_n, i_bh = rest % N, rest // N
    b, h = i_bh // H, i_bh % H
    row0 = i_n * C
    rk, rc = i_k * BK + tl.arange(0, BK), tl.arange(0, C)
    mk, all_rows = rk < K, rc < C
    v_ptr += b * svb + row0 * svt + h * svh
    do_ptr += b * sob + row0 * sot + h * soh
    states_ptr += (i_bh * N + i_n) * (K * V)
    d_ends_ptr += (i_bh * N + i_n) * (K * V)
    dq_inter = tl.zeros([C, BK], dtype=tl.float32)
    dk_inter = tl.zeros([C, BK], dtype=tl.float32)
    entering = tl.zeros([BK], dtype=tl.float32)  # sum_V S_in * d_ends
    for v0 in range(0, V, BV):
        rv = v0 + tl.arange(0, BV)
        mv = rv < V
        D = load_rows(d_ends_ptr, rk, rv, mk, mv, V)
        S = load_rows(states_ptr, rk, rv, mk, mv, V)
        dk_inter += dot(load_rows(v_ptr, rc, rv, all_rows, mv, svt), tl.trans(D), BF16)
        entering += tl.sum(S * D, axis=1)
        if HAS_DO:
            dq_inter += dot(load_rows(do_ptr, rc, rv, all_rows, mv, sot), tl.trans(S), BF16)
    q_ptr += b * sqb + row0 * sqt + h * sqh
    k_ptr += b * skb + row0 * skt + h * skh
    g_ptr += b * sgb + row0 * sgt + h * sgh
    kk = load_rows(k_ptr, rc, rk, all_rows, mk, skt)
    gg = load_rows(g_ptr, rc, rk, all_rows, mk, sgt)
    dk_inter *= tl.exp(exclusive_suffix(g_ptr, rc, rk, mk, C, sgt))
    k_dk = kk * dk_inter
    # dg_t = sum_{j<t} k_j dk_inter_j + gamma sum_V S_in d_ends + revcumsum_t(q dq - k dk_intra), chunk-local
    # (the reference's rearrangement); the exclusive prefix is cumsum - own term: finite terms, round-off only.
    dg = tl.cumsum(k_dk, axis=0) - k_dk + (tl.exp(tl.sum(gg, axis=0)) * entering)[None, :]
    out = ((b * T + row0) * H + h) * K + rc[:, None] * (H * K) + rk[None, :]
    if HAS_DO:
        qq = load_rows(q_ptr, rc, rk, all_rows, mk, sqt)
        dq = tl.load(dq_ptr + out, mask=mk[None, :], other=0.0)
        dq += dq_inter * scale * tl.exp(tl.cumsum(gg, axis=0))
        dk = tl.load(dk_ptr + out, mask=mk[None, :], other=0.0)
        dg += tl.cumsum(qq * dq - kk * dk, axis=0, reverse=True)
        dA_ptr += ((b * T + row0) * H + h) * C
        da_same = tl.load(dA_ptr + rc * (H * C) + rc)[:, None]  # the same-token pairs
        dq += da_same * kk
        dk += dk_inter + da_same * qq
    else:
        dq = tl.zeros([C, BK], dtype=tl.float32)
        dk = dk_inter
    dg = tl.where(gg < log_tiny, 0.0, dg)
    tl.store(dq_ptr + out, dq, mask=mk[None, :])
    tl.store(dk_ptr + out, dk, mask=mk[None, :])
    tl.store(dg_ptr + out, dg, mask=mk[None, :])
