"""Triton kernels for chunked gated linear attention (GLA), forward and backward.

Layout as in megatron_zpp/ops/gla.py: q, k, g [B, T, H, K], v [B, T, H, V], read with their own batch, token
and head strides (the GLA layer's q, k, v are views of one projection output: read in place, never copied;
only the last dim must be contiguous); states [B, H, N, K, V] fp32, T = N * C. Every kernel loads its inputs
as fp32 and does its elementwise math and accumulation in fp32; dot operands are bf16 for bf16 inputs on a
GPU (the tensor cores; fp32 accumulation) and exact fp32 products ("ieee", not tf32) for fp32 inputs.

Addressing: every grid is one axis (limit 2^31 - 1) over (tile, chunk, batch * head), so a sequence may have
any number of chunks (axes 1 and 2 stop at 65535); program ids and every base offset are 64-bit (a tensor
may pass 2^31 elements: states at B x H x T > 2^21 with chunk 16 and K = V = 128); offsets inside a chunk
stay 32-bit. Tiles, warps and stages per kernel come from the config table by the wrappers (_GPU_CONFIGS).

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
def _load_rows(ptr, rows, cols, row_mask, col_mask, stride):
    """x[rows, cols] of a view with row stride `stride` (columns contiguous) as fp32, 0 outside the masks."""
    x = tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)
    return x.to(tl.float32)


@_device_fn
def _round_bf16(x):
    """fp32 x rounded to the nearest bf16 (ties to even), kept in fp32: bf16 operands emulated for the interpreter."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.to(tl.float32, bitcast=True)


@_device_fn
def _dot(a, b, BF16: tl.constexpr):
    """a @ b accumulated in fp32. BF16 1: bf16 operands (tensor cores), for bf16 inputs on a GPU; 2: the same
    operand rounding emulated in fp32 (the interpreter's bf16 arithmetic is unreliable; the products of two bf16
    values are exact in fp32); 0: exact fp32 products ("ieee", not tf32)."""
    if BF16 == 1:
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif BF16 == 2:
        out = tl.dot(_round_bf16(a), _round_bf16(b), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision="ieee")
    return out


@_device_fn
def _exclusive_suffix(g_ptr, rows, cols, col_mask, n_rows: tl.constexpr, stride):
    """sum_{s > r} g_s over a block of n_rows consecutive tokens: a reverse cumsum of g loaded one token later."""
    local = tl.arange(0, n_rows)
    g_next = _load_rows(g_ptr, rows + 1, cols, local < n_rows - 1, col_mask, stride)
    return tl.cumsum(g_next, axis=0, reverse=True)


@_device_fn
def _blocks_between(g_ptr, cols, col_mask, lo, hi, C: tl.constexpr, stride):
    """sum of g over the chunk's local tokens lo <= s < hi (0 when hi <= lo): [BK]."""
    local = tl.arange(0, C)
    x = _load_rows(g_ptr, local, cols, (local >= lo) & (local < hi), col_mask, stride)
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
        kk = _load_rows(k_ptr, rc, rk, all_rows, mk, skt)
        gg = _load_rows(g_ptr, rc, rk, all_rows, mk, sgt)
        k_out = tl.exp(_exclusive_suffix(g_ptr, rc, rk, mk, C, sgt))
        vv = _load_rows(v_ptr, rc, rv, all_rows, mv, svt)
        S = S * tl.exp(tl.sum(gg, axis=0))[:, None]
        S += _dot(tl.trans(kk * k_out), vv, BF16)
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
            q_in = tl.exp(tl.cumsum(_load_rows(g_ptr, rows_i, rk, all_t, mk, sgt), axis=0))
            qq = _load_rows(q_ptr, rows_i, rk, all_t, mk, sqt) * q_in
            between = _blocks_between(g_ptr, rk, mk, (j_blk + 1) * BT, i_i * BT, C, sgt)
            k_fac = tl.exp(_exclusive_suffix(g_ptr, rows_j, rk, mk, BT, sgt) + between[None, :])
            kk = _load_rows(k_ptr, rows_j, rk, all_t, mk, skt) * k_fac
            acc += _dot(qq, tl.trans(kk), BF16)
        tl.store(A_ptr + rows_i[:, None] * (H * C) + (j_blk * BT + rt)[None, :], acc)
    acc = tl.zeros([BT, BT], dtype=tl.float32)
    for k0 in range(0, K, DBK):  # the diagonal sub-block: all its pairs at once, [i, j, key] tiles
        rk = k0 + tl.arange(0, DBK)
        mk = rk < K
        qq = _load_rows(q_ptr, rows_i, rk, all_t, mk, sqt)
        kk = _load_rows(k_ptr, rows_i, rk, all_t, mk, skt)
        decay = _pair_decays(_load_rows(g_ptr, rows_i, rk, all_t, mk, sgt), BT, True)
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
        q_in = tl.exp(tl.cumsum(_load_rows(g_ptr, rc, rk, all_rows, mk, sgt), axis=0))
        qq = _load_rows(q_ptr, rc, rk, all_rows, mk, sqt) * q_in
        acc += _dot(qq, _load_rows(states_ptr, rk, rv, mk, mv, V), BF16)
    A_ptr += ((b * T + row0) * H + h) * C
    for c0 in range(0, C, BC):  # the scores in column blocks (keys c0 .. c0 + BC)
        rj = c0 + tl.arange(0, BC)
        a = _load_rows(A_ptr, rc, rj, all_rows, rj < C, H * C)
        acc += _dot(a, _load_rows(v_ptr, rj, rv, rj < C, mv, svt), BF16)
    o_ptr += ((b * T + row0) * H + h) * V
    tl.store(o_ptr + rc[:, None] * (H * V) + rv[None, :], acc * scale, mask=all_rows[:, None] & mv[None, :])


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
        gg = _load_rows(g_ptr, rc, rk, all_rows, mk, sgt)
        dS = dS * tl.exp(tl.sum(gg, axis=0))[:, None]
        if HAS_DO:
            qq = _load_rows(q_ptr, rc, rk, all_rows, mk, sqt) * tl.exp(tl.cumsum(gg, axis=0))
            dd = _load_rows(do_ptr, rc, rv, all_rows, mv, sot)
            dS += _dot(tl.trans(qq * scale), dd, BF16)
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
        dd = _load_rows(do_ptr, rr, rv, all_r, mv, sot)
        vv = _load_rows(v_ptr, rc, rv, all_c, mv, svt)
        acc += _dot(dd, tl.trans(vv), BF16)
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
        k_out = tl.exp(_exclusive_suffix(g_ptr, rc, rk, mk, C, sgt))
        kk = _load_rows(k_ptr, rc, rk, all_rows, mk, skt) * k_out
        acc += _dot(kk, _load_rows(d_ends_ptr, rk, rv, mk, mv, V), BF16)
    if HAS_DO:
        do_ptr += b * sob + row0 * sot + h * soh
        A_ptr += ((b * T + row0) * H + h) * C
        for i0 in range(0, C, BC):  # the scores' rows (queries i0 .. i0 + BC)
            ri = i0 + tl.arange(0, BC)
            a = _load_rows(A_ptr, ri, rc, ri < C, all_rows, H * C) * scale
            acc += _dot(tl.trans(a), _load_rows(do_ptr, ri, rv, ri < C, mv, sot), BF16)
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
    da_diag = _load_rows(dA_ptr, rows_i, i_i * BT + rt, all_t, all_t, H * C)
    for k0 in range(0, K, BK):  # each key tile is finished in registers and stored once
        rk = k0 + tl.arange(0, BK)
        mk = rk < K
        qq = _load_rows(q_ptr, rows_i, rk, all_t, mk, sqt)
        kk = _load_rows(k_ptr, rows_i, rk, all_t, mk, skt)
        gg = _load_rows(g_ptr, rows_i, rk, all_t, mk, sgt)
        dq = tl.zeros([BT, BK], dtype=tl.float32)
        for j_blk in range(0, i_i):  # keys in earlier sub-blocks
            rows_j = j_blk * BT + rt
            between = _blocks_between(g_ptr, rk, mk, (j_blk + 1) * BT, i_i * BT, C, sgt)
            k_fac = tl.exp(_exclusive_suffix(g_ptr, rows_j, rk, mk, BT, sgt) + between[None, :])
            k_earlier = _load_rows(k_ptr, rows_j, rk, all_t, mk, skt) * k_fac
            da = _load_rows(dA_ptr, rows_i, j_blk * BT + rt, all_t, all_t, H * C)
            dq += _dot(da, k_earlier, BF16)
        dq = dq * tl.exp(tl.cumsum(gg, axis=0))
        dk = tl.zeros([BT, BK], dtype=tl.float32)
        for i_blk in range(i_i + 1, n_sub):  # queries in later sub-blocks
            rows_q = i_blk * BT + rt
            between = _blocks_between(g_ptr, rk, mk, (i_i + 1) * BT, i_blk * BT, C, sgt)
            q_fac = tl.exp(tl.cumsum(_load_rows(g_ptr, rows_q, rk, all_t, mk, sgt), axis=0) + between[None, :])
            q_later = _load_rows(q_ptr, rows_q, rk, all_t, mk, sqt) * q_fac
            da = _load_rows(dA_ptr, rows_q, i_i * BT + rt, all_t, all_t, H * C)
            dk += _dot(tl.trans(da), q_later, BF16)
        dk = dk * tl.exp(_exclusive_suffix(g_ptr, rows_i, rk, mk, BT, sgt))
        # pairs j < i inside the sub-block (the same-token pairs are the caller's)
        w = da_diag[:, :, None] * _pair_decays(gg, BT, False)
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
        D = _load_rows(d_ends_ptr, rk, rv, mk, mv, V)
        S = _load_rows(states_ptr, rk, rv, mk, mv, V)
        dk_inter += _dot(_load_rows(v_ptr, rc, rv, all_rows, mv, svt), tl.trans(D), BF16)
        entering += tl.sum(S * D, axis=1)
        if HAS_DO:
            dq_inter += _dot(_load_rows(do_ptr, rc, rv, all_rows, mv, sot), tl.trans(S), BF16)
    q_ptr += b * sqb + row0 * sqt + h * sqh
    k_ptr += b * skb + row0 * skt + h * skh
    g_ptr += b * sgb + row0 * sgt + h * sgh
    kk = _load_rows(k_ptr, rc, rk, all_rows, mk, skt)
    gg = _load_rows(g_ptr, rc, rk, all_rows, mk, sgt)
    dk_inter *= tl.exp(_exclusive_suffix(g_ptr, rc, rk, mk, C, sgt))
    k_dk = kk * dk_inter
    # dg_t = sum_{j<t} k_j dk_inter_j + gamma sum_V S_in d_ends + revcumsum_t(q dq - k dk_intra), chunk-local
    # (the reference's rearrangement); the exclusive prefix is cumsum - own term: finite terms, round-off only.
    dg = tl.cumsum(k_dk, axis=0) - k_dk + (tl.exp(tl.sum(gg, axis=0)) * entering)[None, :]
    out = ((b * T + row0) * H + h) * K + rc[:, None] * (H * K) + rk[None, :]
    if HAS_DO:
        qq = _load_rows(q_ptr, rc, rk, all_rows, mk, sqt)
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


# ----------------------------------------------------------------------------------------
# Launch wrappers (inputs [B, T, H, D] with any batch / token / head strides; outputs fp32 unless asked)
#
# Every grid is one axis (limit 2^31 - 1) over (tile, chunk, batch * head), so the chunk count has no
# 65535 limit; program ids and every base offset are 64-bit (a tensor may pass 2^31 elements).


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


# Per-kernel tiles, warps and pipeline stages on a GPU, keyed on (kernel, C, bf16 dot operands); tile widths
# are then capped at the padded K / V and at C. Chosen with megatron_zpp/testing/triton_aot.py (the largest
# tiles of a short list that compile with no register spills and at most 232 registers on sm_80 and sm_90 at
# K = V = 128), then checked for no spills at C in {16, 64, 128} x K = V in {64, 128, 256} x bf16 / fp32 x
# every specialization (initial state or not, do or not, final-state gradient or not); shared memory is under
# both limits. Tiles: BK / BV key / value widths, BC the score columns (rows for dv) per step,
# BR the score rows per program, DBK the key width of the [16, 16, keys] pair tiles of a diagonal sub-block.
def _cfg(num_warps: int = 4, num_stages: int = 2, **tiles: int) -> dict[str, int]:
    return dict(tiles, num_warps=num_warps, num_stages=num_stages)


_S32, _S16 = _cfg(BK=32, BV=32), _cfg(BK=16, BV=32)  # the scans: 32 x 32 state tiles, 16 programs a head at 128
_O64, _O32, _O16 = _cfg(BK=64, BV=64, BC=32), _cfg(BK=32, BV=32, BC=32), _cfg(BK=32, BV=32, BC=16)
_O32W8 = _cfg(BK=32, BV=32, BC=32, num_warps=8)
# kernel -> C -> (bf16 dot operands, fp32 "ieee" products); a C between two rows takes the larger C's row
_TABLE: dict[str, dict[int, tuple[dict[str, int], dict[str, int]]]] = {
    "fwd_states": {16: (_S32, _S32), 64: (_S32, _S16), 128: (_S16, _S16)},
    "bwd_states": {16: (_S32, _S32), 64: (_S32, _S16), 128: (_S32, _S16)},
    "intra_scores": {
        16: (_cfg(BK=64, DBK=16), _cfg(BK=64, DBK=16)),
        64: (_cfg(BK=64, DBK=16), _cfg(BK=32, DBK=16)),
        128: (_cfg(BK=64, DBK=16), _cfg(BK=32, DBK=16, num_stages=1)),
    },
    "output": {16: (_O64, _O32), 64: (_O64, _O16), 128: (_O32, _O32W8)},
    "dv": {16: (_O32, _O32), 64: (_O64, _O16), 128: (_O32, _O32W8)},
    "score_grad": {
        16: (_cfg(BR=16, BV=32), _cfg(BR=16, BV=32)),
        64: (_cfg(BR=64, BV=64), _cfg(BR=32, BV=32)),
        128: (_cfg(BR=64, BV=64), _cfg(BR=32, BV=32)),
    },
    "intra_grad": {16: (_cfg(BK=32), _cfg(BK=32)), 64: (_cfg(BK=16), _cfg(BK=16)), 128: (_cfg(BK=16), _cfg(BK=16))},
    "dqkg": {
        16: (_cfg(BK=32, BV=32), _cfg(BK=64, BV=64)),
        64: (_cfg(BK=32, BV=32), _cfg(BK=16, BV=32)),
        128: (_cfg(BK=16, BV=32, num_warps=8), _cfg(BK=16, BV=32, num_warps=8)),
    },
}


def _gpu_config(kernel: str, C: int, bf16: bool) -> dict[str, int]:
    rows = _TABLE[kernel]
    return rows[min((c for c in rows if c >= C), default=max(rows))][0 if bf16 else 1]


def _config(kernel: str, C: int, K: int, V: int, bf16: int, device: torch.device) -> dict[str, int]:
    """Tile widths (constexprs) and num_warps / num_stages of one launch. The interpreter (CPU) takes whole
    (padded) K and V tiles and whole chunks: fewer, larger programs."""
    if target.gpu(device) is not None:
        return gpu_tiles(kernel, C, K, V, bf16)
    pk, pv = max(16, triton.next_power_of_2(K)), max(16, triton.next_power_of_2(V))
    full = dict(BK=pk, BV=pv, BC=C, BR=C, DBK=pk, num_warps=4, num_stages=1)
    return {name: full[name] for name in _TABLE[kernel][16][0]}


def gpu_tiles(kernel: str, C: int, K: int, V: int, bf16: int) -> dict[str, int]:
    """A GPU launch's config: the table's entry with its tiles capped at the padded K / V and at C."""
    pk, pv = max(16, triton.next_power_of_2(K)), max(16, triton.next_power_of_2(V))
    cfg = dict(_gpu_config(kernel, C, bool(bf16)))
    for name, cap in (("BK", pk), ("DBK", pk), ("BV", pv), ("BC", C), ("BR", C)):
        if name in cfg:
            cfg[name] = min(cfg[name], cap)
    return cfg


EMULATE_BF16_DOTS = False  # tests: the interpreter rounds dot operands to bf16 as a GPU launch does


def _bf16_dots(device: torch.device, *tensors: torch.Tensor | None) -> int:
    """The kernels' BF16 mode (see _dot): 1, bf16 dot operands (fp32 accumulation) when the inputs are bf16, on a
    GPU; fp32 inputs get exact fp32 products (0; not tf32). The interpreter computes in fp32 (0), or emulates
    the GPU's bf16 operands (2) under EMULATE_BF16_DOTS."""
    if not all(t.dtype == torch.bfloat16 for t in tensors if t is not None):
        return 0
    if target.gpu(device) is not None:
        return 1
    return 2 if EMULATE_BF16_DOTS else 0


def _strided(x: torch.Tensor, C: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """x [B, T, H, D] as the kernels read it, with its (batch, token, head) strides: any strides with a
    contiguous last dim (a projection's view is read in place, not copied); a chunk's rows must span < 2^31."""
    if x.stride(-1) != 1 or max(x.stride(1), x.stride(2)) * max(C, x.shape[2]) >= 2**31:
        x = x.contiguous()
    return x, (x.stride(0), x.stride(1), x.stride(2))


def _state(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.to(torch.float32).contiguous()


def fwd_states(k, v, g, initial_state, chunk_size):
    """(states_in [B,H,N,K,V], final_state [B,H,K,V]) fp32."""
    C = chunk_size
    (k, sk), (v, sv), (g, sg) = _strided(k, C), _strided(v, C), _strided(g, C)
    h0 = None if initial_state is None else initial_state.contiguous()
    B, T, H, K = k.shape
    V, N = v.shape[-1], T // C
    bf16 = _bf16_dots(k.device, k, v)
    cfg = _config("fwd_states", C, K, V, bf16, k.device)
    NK, NV = triton.cdiv(K, cfg["BK"]), triton.cdiv(V, cfg["BV"])
    states = k.new_empty(B, H, N, K, V, dtype=torch.float32)
    final = k.new_empty(B, H, K, V, dtype=torch.float32)
    _fwd_states_kernel[(NK * NV * B * H,)](
        k, v, g, h0 if h0 is not None else final, states, final, N, *sk, *sv, *sg,
        H=H, K=K, V=V, C=C, NK=NK, NV=NV, USE_H0=h0 is not None, BF16=bf16, **cfg,
    )  # fmt: skip
    return states, final


def intra_scores(q, k, g, chunk_size):
    """A [B, T, H, C] fp32: the intra-chunk scores (row t, column j of t's chunk), 0 above the diagonal."""
    C = chunk_size
    (q, sq), (k, sk), (g, sg) = _strided(q, C), _strided(k, C), _strided(g, C)
    B, T, H, K = q.shape
    bf16 = _bf16_dots(q.device, q, k)
    A = q.new_zeros(B, T, H, C, dtype=torch.float32)
    _intra_scores_kernel[(C // SUB_BLOCK * (T // C) * B * H,)](
        q, k, g, A, T, T // C, *sq, *sk, *sg,
        H=H, K=K, C=C, BT=SUB_BLOCK, BF16=bf16, **_config("intra_scores", C, K, K, bf16, q.device),
    )  # fmt: skip
    return A


def fwd_output(q, k, v, g, states_in, scale, chunk_size, *, out_dtype=torch.float32):
    """o [B, T, H, V] (fp32, or out_dtype) = scale * (A @ v + (q * exp(prefix)) @ states_in)."""
    C = chunk_size
    (q, sq), (v, sv), (g, sg) = _strided(q, C), _strided(v, C), _strided(g, C)
    states_in = _state(states_in)
    B, T, H, K = q.shape
    V, N = v.shape[-1], T // C
    bf16 = _bf16_dots(q.device, q, v)
    cfg = _config("output", C, K, V, bf16, q.device)
    NV = triton.cdiv(V, cfg["BV"])
    A = intra_scores(q, k, g, C)
    o = q.new_empty(B, T, H, V, dtype=out_dtype)
    _output_kernel[(NV * N * B * H,)](
        q, v, g, states_in, A, o, T, N, scale, *sq, *sv, *sg, H=H, K=K, V=V, C=C, NV=NV, BF16=bf16, **cfg
    )  # fmt: skip
    return o


def bwd(q, k, v, g, initial_state, do, d_final_state, scale, chunk_size, states_in=None):
    """(dq, dk, dv, dg, d_initial_state), fp32; do / d_final_state None are zero."""
    C = chunk_size
    (q, sq), (k, sk), (v, sv), (g, sg) = (_strided(x, C) for x in (q, k, v, g))
    has_do = do is not None
    do, so = _strided(do, C) if has_do else (v, sv)  # v: a placeholder when there is no do
    B, T, H, K = q.shape
    V, N = v.shape[-1], T // C
    bf16 = _bf16_dots(q.device, q, k, v, do)
    if states_in is None:
        states_in = fwd_states(k, v, g, initial_state, C)[0]
    states_in, dS = _state(states_in), _state(d_final_state)
    d_ends = q.new_empty(B, H, N, K, V, dtype=torch.float32)
    dh0 = q.new_empty(B, H, K, V, dtype=torch.float32)
    cfg = _config("bwd_states", C, K, V, bf16, q.device)
    NK, NV = triton.cdiv(K, cfg["BK"]), triton.cdiv(V, cfg["BV"])
    _bwd_states_kernel[(NK * NV * B * H,)](
        q, g, do, dS if dS is not None else dh0, d_ends, dh0, N, scale, *sq, *sg, *so,
        H=H, K=K, V=V, C=C, NK=NK, NV=NV, HAS_DO=has_do, HAS_DS=dS is not None, BF16=bf16, **cfg,
    )  # fmt: skip
    dq = q.new_empty(B, T, H, K, dtype=torch.float32)
    dk = torch.empty_like(dq)
    dg = torch.empty_like(dq)
    dv = q.new_empty(B, T, H, V, dtype=torch.float32)
    A = dA = dq  # placeholders when there is no do (never read)
    if has_do:
        A = intra_scores(q, k, g, C)
        dA = q.new_empty(B, T, H, C, dtype=torch.float32)
        cfg = _config("score_grad", C, K, V, bf16, q.device)
        _score_grad_kernel[(C // cfg["BR"] * N * B * H,)](
            do, v, dA, T, N, scale, *so, *sv, H=H, V=V, C=C, BF16=bf16, **cfg
        )  # fmt: skip
        _intra_grad_kernel[(C // SUB_BLOCK * N * B * H,)](
            q, k, g, dA, dq, dk, T, N, *sq, *sk, *sg,
            H=H, K=K, C=C, BT=SUB_BLOCK, BF16=bf16, **_config("intra_grad", C, K, V, bf16, q.device),
        )  # fmt: skip
    cfg = _config("dv", C, K, V, bf16, q.device)
    NV = triton.cdiv(V, cfg["BV"])
    _dv_kernel[(NV * N * B * H,)](
        k, g, do, A, d_ends, dv, T, N, scale, *sk, *sg, *so,
        H=H, K=K, V=V, C=C, NV=NV, HAS_DO=has_do, BF16=bf16, **cfg,
    )  # fmt: skip
    cfg = _config("dqkg", C, K, V, bf16, q.device)
    NK = triton.cdiv(K, cfg["BK"])
    _dqkg_kernel[(NK * N * B * H,)](
        q, k, v, g, do, dA, states_in, d_ends, dq, dk, dg, T, N, scale, LOG_TINY_FP32, *sq, *sk, *sv, *sg, *so,
        H=H, K=K, V=V, C=C, NK=NK, HAS_DO=has_do, BF16=bf16, **cfg,
    )  # fmt: skip
    return dq, dk, dv, dg, dh0
