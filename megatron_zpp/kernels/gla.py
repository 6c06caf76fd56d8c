"""Triton kernels for chunked gated linear attention (GLA), forward and backward.

Layout as in megatron_zpp/ops/gla.py: q, k, g [B, T, H, K], v [B, T, H, V] (contiguous), states
[B, H, N, K, V] fp32, T = N * C. Every kernel loads its inputs as fp32 and accumulates in fp32.

Decomposition (the one of flash-linear-attention's chunk_gla, with our numerics):

    _fwd_states_kernel   the state entering each chunk, a scan over chunks per (K tile, V tile)
    _intra_scores_kernel A[i, j] = sum_k q_ik k_jk exp(sum_{j<s<=i} g_sk), j <= i in one chunk
    _output_kernel       o = scale * (A @ v + (q * exp(prefix)) @ S_in)
    _bwd_states_kernel   d_ends[n], the gradient reaching the state leaving chunk n (reverse scan)
    _score_grad_kernel   dA = scale * do @ v^T (lower triangle of each chunk)
    _dv_kernel           dv = (k * exp(suffix)) @ d_ends + A^T @ (scale * do)
    _intra_grad_kernel   dq, dk through A, without the same-token pairs
    _dqkg_kernel         adds the inter-chunk parts and the same-token pairs, and dg chunk-locally

Numerics: no exponent is ever positive and no two cumulative sums are subtracted. Within a chunk,
in sub-blocks of BT = 16 tokens, a pair (j in sub-block J, i in sub-block I > J) decays by
exp(prefix of I up to i) * exp(suffix of J after j + totals of the sub-blocks between); a pair in one
sub-block by a segment sum accumulated over its own tokens (a cumsum of g masked to s > j). Exclusive
suffix sums are reverse cumsums of g loaded one token later (a shift, not total minus prefix). So a
-inf gate (a hard reset) only ever gives exp(-inf) = 0 and finite outputs.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from . import target

SUB_BLOCK = 16  # tokens per sub-block of the intra-chunk tiles (the smallest tl.dot tile)
LOG_TINY_FP32 = math.log(torch.finfo(torch.float32).tiny)  # dg is 0 below this gate (as the reference)


def _device_fn(fn):
    """@triton.jit for a helper called from kernels; a plain function under the CPU interpreter, which would
    otherwise re-patch triton.language on every call of a jit helper (milliseconds each)."""
    return fn if os.environ.get("TRITON_INTERPRET") == "1" else triton.jit(fn)


@_device_fn
def _load_rows(ptr, rows, cols, row_mask, col_mask, stride: tl.constexpr):
    """x[rows, cols] of a [*, stride] row-major view as fp32, 0 outside the masks."""
    x = tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)
    return x.to(tl.float32)


@_device_fn
def _exclusive_suffix(g_ptr, rows, cols, col_mask, n_rows: tl.constexpr, stride: tl.constexpr):
    """sum_{s > r} g_s over a block of n_rows consecutive tokens: a reverse cumsum of g loaded one token later."""
    local = tl.arange(0, n_rows)
    g_next = _load_rows(g_ptr, rows + 1, cols, local < n_rows - 1, col_mask, stride)
    return tl.cumsum(g_next, axis=0, reverse=True)


@_device_fn
def _blocks_between(g_ptr, chunk_row0, cols, col_mask, lo, hi, C: tl.constexpr, stride: tl.constexpr):
    """sum of g over the chunk's local tokens lo <= s < hi (0 when hi <= lo): [BK]."""
    local = tl.arange(0, C)
    x = _load_rows(g_ptr, chunk_row0 + local, cols, (local >= lo) & (local < hi), col_mask, stride)
    return tl.sum(x, axis=0)


@_device_fn
def _pair_decays(g, BT: tl.constexpr, SAME_TOKEN: tl.constexpr):
    """g [BT, BK] of one sub-block -> [i, j, BK]: exp(sum_{j<s<=i} g_s) for j < i (and 1 for j == i when
    SAME_TOKEN), else 0. Each segment sum is a cumsum of g masked to s > j: accumulated over its own tokens."""
    rt = tl.arange(0, BT)
    after_j = rt[:, None, None] > rt[None, :, None]  # [s or i, j, 1]
    seg = tl.cumsum(tl.where(after_j, g[:, None, :], 0.0), axis=0)
    keep = (rt[:, None, None] >= rt[None, :, None]) if SAME_TOKEN else after_j
    return tl.where(keep, tl.exp(seg), 0.0)


@triton.jit
def _fwd_states_kernel(
    k_ptr, v_ptr, g_ptr, h0_ptr, states_ptr, final_ptr, T, N,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    i_k, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = i_bh // H, i_bh % H
    rk, rv, rc = i_k * BK + tl.arange(0, BK), i_v * BV + tl.arange(0, BV), tl.arange(0, C)
    mk, mv, all_rows = rk < K, rv < V, rc < C
    kv = rk[:, None] * V + rv[None, :]
    mkv = mk[:, None] & mv[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        S = tl.load(h0_ptr + i_bh * K * V + kv, mask=mkv, other=0.0).to(tl.float32)
    kg_base, v_base = (b * T * H + h) * K, (b * T * H + h) * V
    for n in range(N):
        tl.store(states_ptr + (i_bh * N + n) * K * V + kv, S, mask=mkv)
        rows = n * C + rc
        kk = _load_rows(k_ptr + kg_base, rows, rk, all_rows, mk, H * K)
        gg = _load_rows(g_ptr + kg_base, rows, rk, all_rows, mk, H * K)
        k_out = tl.exp(_exclusive_suffix(g_ptr + kg_base, rows, rk, mk, C, H * K))
        vv = _load_rows(v_ptr + v_base, rows, rv, all_rows, mv, H * V)
        S = S * tl.exp(tl.sum(gg, axis=0))[:, None]
        S += tl.dot(tl.trans(kk * k_out), vv, input_precision=PREC)
    tl.store(final_ptr + i_bh * K * V + kv, S, mask=mkv)


@triton.jit
def _intra_scores_kernel(
    q_ptr, k_ptr, g_ptr, A_ptr, T,
    H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, DBK: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    i_i, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = i_bh // H, i_bh % H
    base = (b * T * H + h) * K
    a_base = (b * T * H + h) * C
    rt = tl.arange(0, BT)
    chunk_row0 = i_n * C
    rows_i = chunk_row0 + i_i * BT + rt
    all_t = rt < BT
    for j_blk in range(0, i_i):  # earlier sub-blocks: decays factor at the start of sub-block i_i
        rows_j = chunk_row0 + j_blk * BT + rt
        acc = tl.zeros([BT, BT], dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            mk = rk < K
            q_in = tl.exp(tl.cumsum(_load_rows(g_ptr + base, rows_i, rk, all_t, mk, H * K), axis=0))
            qq = _load_rows(q_ptr + base, rows_i, rk, all_t, mk, H * K) * q_in
            between = _blocks_between(g_ptr + base, chunk_row0, rk, mk, (j_blk + 1) * BT, i_i * BT, C, H * K)
            k_fac = tl.exp(_exclusive_suffix(g_ptr + base, rows_j, rk, mk, BT, H * K) + between[None, :])
            kk = _load_rows(k_ptr + base, rows_j, rk, all_t, mk, H * K) * k_fac
            acc += tl.dot(qq, tl.trans(kk), input_precision=PREC)
        tl.store(A_ptr + a_base + rows_i[:, None] * (H * C) + (j_blk * BT + rt)[None, :], acc)
    acc = tl.zeros([BT, BT], dtype=tl.float32)
    for k0 in range(0, K, DBK):  # the diagonal sub-block: all its pairs at once, [i, j, key] tiles
        rk = k0 + tl.arange(0, DBK)
        mk = rk < K
        qq = _load_rows(q_ptr + base, rows_i, rk, all_t, mk, H * K)
        kk = _load_rows(k_ptr + base, rows_i, rk, all_t, mk, H * K)
        decay = _pair_decays(_load_rows(g_ptr + base, rows_i, rk, all_t, mk, H * K), BT, True)
        acc += tl.sum(qq[:, None, :] * kk[None, :, :] * decay, axis=2)
    tl.store(A_ptr + a_base + rows_i[:, None] * (H * C) + (i_i * BT + rt)[None, :], acc)


@triton.jit
def _output_kernel(
    q_ptr, v_ptr, g_ptr, states_ptr, A_ptr, o_ptr, T, N, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    i_v, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = i_bh // H, i_bh % H
    rv, rc = i_v * BV + tl.arange(0, BV), tl.arange(0, C)
    mv, all_rows = rv < V, rc < C
    rows = i_n * C + rc
    kg_base, v_base = (b * T * H + h) * K, (b * T * H + h) * V
    acc = tl.zeros([C, BV], dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < K
        q_in = tl.exp(tl.cumsum(_load_rows(g_ptr + kg_base, rows, rk, all_rows, mk, H * K), axis=0))
        qq = _load_rows(q_ptr + kg_base, rows, rk, all_rows, mk, H * K) * q_in
        S = _load_rows(states_ptr + (i_bh * N + i_n) * K * V, rk, rv, mk, mv, V)
        acc += tl.dot(qq, S, input_precision=PREC)
    a = _load_rows(A_ptr + (b * T * H + h) * C, rows, rc, all_rows, all_rows, H * C)
    acc += tl.dot(a, _load_rows(v_ptr + v_base, rows, rv, all_rows, mv, H * V), input_precision=PREC)
    o_ptrs = o_ptr + v_base + rows[:, None] * (H * V) + rv[None, :]
    tl.store(o_ptrs, acc * scale, mask=all_rows[:, None] & mv[None, :])


@triton.jit
def _bwd_states_kernel(
    q_ptr, g_ptr, do_ptr, dS_ptr, d_ends_ptr, dh0_ptr, T, N, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DO: tl.constexpr, HAS_DS: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    i_k, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = i_bh // H, i_bh % H
    rk, rv, rc = i_k * BK + tl.arange(0, BK), i_v * BV + tl.arange(0, BV), tl.arange(0, C)
    mk, mv, all_rows = rk < K, rv < V, rc < C
    kv = rk[:, None] * V + rv[None, :]
    mkv = mk[:, None] & mv[None, :]
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DS:
        dS = tl.load(dS_ptr + i_bh * K * V + kv, mask=mkv, other=0.0).to(tl.float32)
    kg_base, v_base = (b * T * H + h) * K, (b * T * H + h) * V
    for step in range(N):
        n = N - 1 - step
        tl.store(d_ends_ptr + (i_bh * N + n) * K * V + kv, dS, mask=mkv)
        rows = n * C + rc
        gg = _load_rows(g_ptr + kg_base, rows, rk, all_rows, mk, H * K)
        dS = dS * tl.exp(tl.sum(gg, axis=0))[:, None]
        if HAS_DO:
            qq = _load_rows(q_ptr + kg_base, rows, rk, all_rows, mk, H * K) * tl.exp(tl.cumsum(gg, axis=0))
            dd = _load_rows(do_ptr + v_base, rows, rv, all_rows, mv, H * V)
            dS += tl.dot(tl.trans(qq), dd, input_precision=PREC) * scale
    tl.store(dh0_ptr + i_bh * K * V + kv, dS, mask=mkv)


@triton.jit
def _score_grad_kernel(
    do_ptr, v_ptr, dA_ptr, T, scale,
    H: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    b, h = i_bh // H, i_bh % H
    rc = tl.arange(0, C)
    rows, all_rows = i_n * C + rc, rc < C
    v_base = (b * T * H + h) * V
    acc = tl.zeros([C, C], dtype=tl.float32)
    for v0 in range(0, V, BV):
        rv = v0 + tl.arange(0, BV)
        mv = rv < V
        dd = _load_rows(do_ptr + v_base, rows, rv, all_rows, mv, H * V)
        vv = _load_rows(v_ptr + v_base, rows, rv, all_rows, mv, H * V)
        acc += tl.dot(dd, tl.trans(vv), input_precision=PREC)
    acc = tl.where(rc[:, None] >= rc[None, :], acc * scale, 0.0)
    tl.store(dA_ptr + (b * T * H + h) * C + rows[:, None] * (H * C) + rc[None, :], acc)


@triton.jit
def _dv_kernel(
    k_ptr, g_ptr, do_ptr, A_ptr, d_ends_ptr, dv_ptr, T, N, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DO: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    i_v, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = i_bh // H, i_bh % H
    rv, rc = i_v * BV + tl.arange(0, BV), tl.arange(0, C)
    mv, all_rows = rv < V, rc < C
    rows = i_n * C + rc
    kg_base, v_base = (b * T * H + h) * K, (b * T * H + h) * V
    acc = tl.zeros([C, BV], dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < K
        k_out = tl.exp(_exclusive_suffix(g_ptr + kg_base, rows, rk, mk, C, H * K))
        kk = _load_rows(k_ptr + kg_base, rows, rk, all_rows, mk, H * K) * k_out
        D = _load_rows(d_ends_ptr + (i_bh * N + i_n) * K * V, rk, rv, mk, mv, V)
        acc += tl.dot(kk, D, input_precision=PREC)
    if HAS_DO:
        a = _load_rows(A_ptr + (b * T * H + h) * C, rows, rc, all_rows, all_rows, H * C)
        dd = _load_rows(do_ptr + v_base, rows, rv, all_rows, mv, H * V)
        acc += tl.dot(tl.trans(a), dd, input_precision=PREC) * scale
    tl.store(dv_ptr + v_base + rows[:, None] * (H * V) + rv[None, :], acc, mask=all_rows[:, None] & mv[None, :])


@triton.jit
def _intra_grad_kernel(
    q_ptr, k_ptr, g_ptr, dA_ptr, dq_ptr, dk_ptr, T,
    H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, DBK: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    i_i, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = i_bh // H, i_bh % H
    base = (b * T * H + h) * K
    a_base = (b * T * H + h) * C
    rt = tl.arange(0, BT)
    chunk_row0 = i_n * C
    rows_i = chunk_row0 + i_i * BT + rt
    all_t = rt < BT
    n_sub = C // BT
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < K
        qq = _load_rows(q_ptr + base, rows_i, rk, all_t, mk, H * K)
        gg = _load_rows(g_ptr + base, rows_i, rk, all_t, mk, H * K)
        dq = tl.zeros([BT, BK], dtype=tl.float32)
        for j_blk in range(0, i_i):  # keys in earlier sub-blocks
            rows_j = chunk_row0 + j_blk * BT + rt
            between = _blocks_between(g_ptr + base, chunk_row0, rk, mk, (j_blk + 1) * BT, i_i * BT, C, H * K)
            k_fac = tl.exp(_exclusive_suffix(g_ptr + base, rows_j, rk, mk, BT, H * K) + between[None, :])
            kk = _load_rows(k_ptr + base, rows_j, rk, all_t, mk, H * K) * k_fac
            da = _load_rows(dA_ptr + a_base, rows_i, j_blk * BT + rt, all_t, all_t, H * C)
            dq += tl.dot(da, kk, input_precision=PREC)
        dq = dq * tl.exp(tl.cumsum(gg, axis=0))
        dk = tl.zeros([BT, BK], dtype=tl.float32)
        for i_blk in range(i_i + 1, n_sub):  # queries in later sub-blocks
            rows_q = chunk_row0 + i_blk * BT + rt
            between = _blocks_between(g_ptr + base, chunk_row0, rk, mk, (i_i + 1) * BT, i_blk * BT, C, H * K)
            g_q = _load_rows(g_ptr + base, rows_q, rk, all_t, mk, H * K)
            q_fac = tl.exp(tl.cumsum(g_q, axis=0) + between[None, :])
            q_later = _load_rows(q_ptr + base, rows_q, rk, all_t, mk, H * K) * q_fac
            da = _load_rows(dA_ptr + a_base, rows_q, i_i * BT + rt, all_t, all_t, H * C)
            dk += tl.dot(tl.trans(da), q_later, input_precision=PREC)
        dk = dk * tl.exp(_exclusive_suffix(g_ptr + base, rows_i, rk, mk, BT, H * K))
        out = rows_i[:, None] * (H * K) + rk[None, :]
        tl.store(dq_ptr + base + out, dq, mask=mk[None, :])
        tl.store(dk_ptr + base + out, dk, mask=mk[None, :])
    da = _load_rows(dA_ptr + a_base, rows_i, i_i * BT + rt, all_t, all_t, H * C)
    for k0 in range(0, K, DBK):  # pairs j < i inside the sub-block (the same-token pairs are the caller's)
        rk = k0 + tl.arange(0, DBK)
        mk = rk < K
        qq = _load_rows(q_ptr + base, rows_i, rk, all_t, mk, H * K)
        kk = _load_rows(k_ptr + base, rows_i, rk, all_t, mk, H * K)
        w = da[:, :, None] * _pair_decays(_load_rows(g_ptr + base, rows_i, rk, all_t, mk, H * K), BT, False)
        out = rows_i[:, None] * (H * K) + rk[None, :]
        dq = tl.load(dq_ptr + base + out, mask=mk[None, :], other=0.0) + tl.sum(w * kk[None, :, :], axis=1)
        tl.store(dq_ptr + base + out, dq, mask=mk[None, :])
        dk = tl.load(dk_ptr + base + out, mask=mk[None, :], other=0.0) + tl.sum(w * qq[:, None, :], axis=0)
        tl.store(dk_ptr + base + out, dk, mask=mk[None, :])


@triton.jit
def _dqkg_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, do_ptr, dA_ptr, states_ptr, d_ends_ptr, dq_ptr, dk_ptr, dg_ptr, T, N, scale,
    log_tiny, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, HAS_DO: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    i_k, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = i_bh // H, i_bh % H
    rk, rc = i_k * BK + tl.arange(0, BK), tl.arange(0, C)
    mk, all_rows = rk < K, rc < C
    rows = i_n * C + rc
    kg_base, v_base = (b * T * H + h) * K, (b * T * H + h) * V
    state_base = (i_bh * N + i_n) * K * V
    dq_inter = tl.zeros([C, BK], dtype=tl.float32)
    dk_inter = tl.zeros([C, BK], dtype=tl.float32)
    entering = tl.zeros([BK], dtype=tl.float32)  # sum_V S_in * d_ends
    for v0 in range(0, V, BV):
        rv = v0 + tl.arange(0, BV)
        mv = rv < V
        D = _load_rows(d_ends_ptr + state_base, rk, rv, mk, mv, V)
        S = _load_rows(states_ptr + state_base, rk, rv, mk, mv, V)
        dk_inter += tl.dot(_load_rows(v_ptr + v_base, rows, rv, all_rows, mv, H * V), tl.trans(D), input_precision=PREC)
        entering += tl.sum(S * D, axis=1)
        if HAS_DO:
            dd = _load_rows(do_ptr + v_base, rows, rv, all_rows, mv, H * V)
            dq_inter += tl.dot(dd, tl.trans(S), input_precision=PREC)
    qq = _load_rows(q_ptr + kg_base, rows, rk, all_rows, mk, H * K)
    kk = _load_rows(k_ptr + kg_base, rows, rk, all_rows, mk, H * K)
    gg = _load_rows(g_ptr + kg_base, rows, rk, all_rows, mk, H * K)
    dk_inter *= tl.exp(_exclusive_suffix(g_ptr + kg_base, rows, rk, mk, C, H * K))
    k_dk = kk * dk_inter
    # dg_t = sum_{j<t} k_j dk_inter_j + gamma sum_V S_in d_ends + revcumsum_t(q dq - k dk_intra), chunk-local
    # (the reference's rearrangement); the exclusive prefix is cumsum - own term: finite terms, round-off only.
    dg = tl.cumsum(k_dk, axis=0) - k_dk + (tl.exp(tl.sum(gg, axis=0)) * entering)[None, :]
    out = rows[:, None] * (H * K) + rk[None, :]
    if HAS_DO:
        dq = tl.load(dq_ptr + kg_base + out, mask=mk[None, :], other=0.0)
        dq += dq_inter * scale * tl.exp(tl.cumsum(gg, axis=0))
        dk = tl.load(dk_ptr + kg_base + out, mask=mk[None, :], other=0.0)
        dg += tl.cumsum(qq * dq - kk * dk, axis=0, reverse=True)
        da_same = tl.load(dA_ptr + (b * T * H + h) * C + rows * (H * C) + rc)[:, None]  # the same-token pairs
        dq += da_same * kk
        dk += dk_inter + da_same * qq
    else:
        dq = tl.zeros([C, BK], dtype=tl.float32)
        dk = dk_inter
    dg = tl.where(gg < log_tiny, 0.0, dg)
    tl.store(dq_ptr + kg_base + out, dq, mask=mk[None, :])
    tl.store(dk_ptr + kg_base + out, dk, mask=mk[None, :])
    tl.store(dg_ptr + kg_base + out, dg, mask=mk[None, :])


# ----------------------------------------------------------------------------------------
# Launch wrappers (inputs [B, T, H, D]; outputs fp32)


def supported(q: torch.Tensor, v: torch.Tensor, chunk_size: int) -> bool:
    """Whether these kernels take the call: fp32/bf16, C a power of two in [16, 128], K and V <= 256."""
    C, K, V = chunk_size, q.shape[-1], v.shape[-1]
    return (
        q.dtype in (torch.float32, torch.bfloat16)
        and 16 <= C <= 128
        and C & (C - 1) == 0
        and 0 < K <= 256
        and 0 < V <= 256
        and q.shape[1] % C == 0
    )


def _blocks(K: int, V: int, device: torch.device) -> tuple[int, int]:
    """Tile widths: whole (padded) K and V in the interpreter (fewer programs), at most 64 on a GPU."""
    cap = 256 if target.gpu(device) is None else 64
    return min(cap, max(16, triton.next_power_of_2(K))), min(cap, max(16, triton.next_power_of_2(V)))


def _diag_block(BK: int, device: torch.device) -> int:
    """Key width of the [BT, BT, keys] pair tiles of a diagonal sub-block: 16 keeps them in registers on a GPU."""
    return BK if target.gpu(device) is None else 16


def _precision(*tensors: torch.Tensor) -> str:
    """fp32 inputs get exact fp32 products; bf16 inputs may use tf32 on a GPU (accumulation stays fp32)."""
    if target.gpu(tensors[0].device) is not None and all(t.dtype == torch.bfloat16 for t in tensors):
        return "tf32"
    return "ieee"


def _c(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.contiguous()


def fwd_states(k, v, g, initial_state, chunk_size):
    """(states_in [B,H,N,K,V], final_state [B,H,K,V]) fp32."""
    k, v, g, h0 = _c(k), _c(v), _c(g), _c(initial_state)
    B, T, H, K = k.shape
    V, N = v.shape[-1], T // chunk_size
    BK, BV = _blocks(K, V, k.device)
    states = k.new_empty(B, H, N, K, V, dtype=torch.float32)
    final = k.new_empty(B, H, K, V, dtype=torch.float32)
    grid = (triton.cdiv(K, BK), triton.cdiv(V, BV), B * H)
    _fwd_states_kernel[grid](
        k, v, g, h0 if h0 is not None else final, states, final, T, N,
        H=H, K=K, V=V, C=chunk_size, BK=BK, BV=BV, USE_H0=h0 is not None, PREC=_precision(k, v),
    )  # fmt: skip
    return states, final


def intra_scores(q, k, g, chunk_size):
    """A [B, T, H, C] fp32: the intra-chunk scores (row t, column j of t's chunk), 0 above the diagonal."""
    q, k, g = _c(q), _c(k), _c(g)
    B, T, H, K = q.shape
    BK, _ = _blocks(K, 16, q.device)
    A = q.new_zeros(B, T, H, chunk_size, dtype=torch.float32)
    grid = (chunk_size // SUB_BLOCK, T // chunk_size, B * H)
    _intra_scores_kernel[grid](
        q, k, g, A, T, H=H, K=K, C=chunk_size, BT=SUB_BLOCK, BK=BK, DBK=_diag_block(BK, q.device), PREC=_precision(q, k)
    )  # fmt: skip
    return A


def fwd_output(q, k, v, g, states_in, scale, chunk_size):
    """o [B, T, H, V] fp32 = scale * (A @ v + (q * exp(prefix)) @ states_in)."""
    q, v, g = _c(q), _c(v), _c(g)
    states_in = states_in.to(torch.float32).contiguous()
    B, T, H, K = q.shape
    V, N = v.shape[-1], T // chunk_size
    BK, BV = _blocks(K, V, q.device)
    A = intra_scores(q, k, g, chunk_size)
    o = q.new_empty(B, T, H, V, dtype=torch.float32)
    _output_kernel[(triton.cdiv(V, BV), N, B * H)](
        q, v, g, states_in, A, o, T, N, scale, H=H, K=K, V=V, C=chunk_size, BK=BK, BV=BV, PREC=_precision(q, v)
    )  # fmt: skip
    return o


def bwd(q, k, v, g, initial_state, do, d_final_state, scale, chunk_size, states_in=None):
    """(dq, dk, dv, dg, d_initial_state), fp32; do / d_final_state None are zero."""
    q, k, v, g, do = _c(q), _c(k), _c(v), _c(g), _c(do)
    B, T, H, K = q.shape
    V, N, C = v.shape[-1], T // chunk_size, chunk_size
    BK, BV = _blocks(K, V, q.device)
    prec = _precision(q, k, v)
    if states_in is None:
        states_in = fwd_states(k, v, g, initial_state, C)[0]
    states_in = states_in.to(torch.float32).contiguous()
    dS = None if d_final_state is None else d_final_state.to(torch.float32).contiguous()
    d_ends = q.new_empty(B, H, N, K, V, dtype=torch.float32)
    dh0 = q.new_empty(B, H, K, V, dtype=torch.float32)
    _bwd_states_kernel[(triton.cdiv(K, BK), triton.cdiv(V, BV), B * H)](
        q, g, do if do is not None else q, dS if dS is not None else dh0, d_ends, dh0, T, N, scale,
        H=H, K=K, V=V, C=C, BK=BK, BV=BV, HAS_DO=do is not None, HAS_DS=dS is not None, PREC=prec,
    )  # fmt: skip
    dq = q.new_empty(B, T, H, K, dtype=torch.float32)
    dk = torch.empty_like(dq)
    dg = torch.empty_like(dq)
    dv = q.new_empty(B, T, H, V, dtype=torch.float32)
    A = dA = dq  # placeholders when there is no do (never read)
    if do is not None:
        A = intra_scores(q, k, g, C)
        dA = q.new_empty(B, T, H, C, dtype=torch.float32)
        _score_grad_kernel[(N, B * H)](do, v, dA, T, scale, H=H, V=V, C=C, BV=BV, PREC=prec)
        _intra_grad_kernel[(C // SUB_BLOCK, N, B * H)](
            q, k, g, dA, dq, dk, T, H=H, K=K, C=C, BT=SUB_BLOCK, BK=BK, DBK=_diag_block(BK, q.device), PREC=prec
        )  # fmt: skip
    _dv_kernel[(triton.cdiv(V, BV), N, B * H)](
        k, g, do if do is not None else v, A, d_ends, dv, T, N, scale,
        H=H, K=K, V=V, C=C, BK=BK, BV=BV, HAS_DO=do is not None, PREC=prec,
    )  # fmt: skip
    _dqkg_kernel[(triton.cdiv(K, BK), N, B * H)](
        q, k, v, g, do if do is not None else v, dA, states_in, d_ends, dq, dk, dg, T, N, scale, LOG_TINY_FP32,
        H=H, K=K, V=V, C=C, BK=BK, BV=BV, HAS_DO=do is not None, PREC=prec,
    )  # fmt: skip
    return dq, dk, dv, dg, dh0
