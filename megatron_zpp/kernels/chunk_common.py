"""What the chunked linear-attention kernels share (GLA: gla*.py, Gated DeltaNet: gdn*.py, KDA: kda*.py), as fla's
`ops/common`. Device helpers: masked fp32 row loads, the dot of either precision (and its bf16 emulation for
the interpreter), the in-chunk decays (segment sums of g accumulated over their own tokens). Host helpers of
the launch wrappers: the dot mode of a launch (`bf16_dots`), inputs read in place with their strides
(`strided`), states as fp32 contiguous (`contiguous_fp32`). kernels/gla.py and kernels/gdn.py describe their
layouts and numerics."""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from . import target

SUB_BLOCK = 16  # tokens per sub-block of the intra-chunk tiles (the smallest tl.dot tile)
LOG_TINY_FP32 = math.log(torch.finfo(torch.float32).tiny)  # dg is 0 below this gate (as the reference)


def device_fn(fn):
    """@triton.jit for a helper called from kernels; a plain function under the CPU interpreter, which would
    otherwise re-patch triton.language on every call of a jit helper (milliseconds each)."""
    return fn if os.environ.get("TRITON_INTERPRET") == "1" else triton.jit(fn)


@device_fn
def load_rows(ptr, rows, cols, row_mask, col_mask, stride):
    """x[rows, cols] of a view with row stride `stride` (columns contiguous) as fp32, 0 outside the masks."""
    x = tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)
    return x.to(tl.float32)


@device_fn
def round_bf16(x):
    """fp32 x rounded to the nearest bf16 (ties to even), kept in fp32: bf16 operands emulated for the interpreter."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.to(tl.float32, bitcast=True)


@device_fn
def dot(a, b, BF16: tl.constexpr):
    """a @ b accumulated in fp32. BF16 1: bf16 operands (tensor cores), for bf16 inputs on a GPU; 2: the same
    operand rounding emulated in fp32 (the interpreter's bf16 arithmetic is unreliable; the products of two bf16
    values are exact in fp32); 0: exact fp32 products ("ieee", not tf32)."""
    if BF16 == 1:
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif BF16 == 2:
        out = tl.dot(round_bf16(a), round_bf16(b), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision="ieee")
    return out


@device_fn
def exclusive_suffix(g_ptr, rows, cols, col_mask, n_rows: tl.constexpr, stride):
    """sum_{s > r} g_s over a block of n_rows consecutive tokens: a reverse cumsum of g loaded one token later."""
    local = tl.arange(0, n_rows)
    g_next = load_rows(g_ptr, rows + 1, cols, local < n_rows - 1, col_mask, stride)
    return tl.cumsum(g_next, axis=0, reverse=True)


@device_fn
def blocks_between(g_ptr, cols, col_mask, lo, hi, C: tl.constexpr, stride):
    """sum of g over the chunk's local tokens lo <= s < hi (0 when hi <= lo): [BK]."""
    local = tl.arange(0, C)
    x = load_rows(g_ptr, local, cols, (local >= lo) & (local < hi), col_mask, stride)
    return tl.sum(x, axis=0)


@device_fn
def pair_decays(g, BT: tl.constexpr, SAME_TOKEN: tl.constexpr):
    """g [BT, BK] of one sub-block -> [i, j, BK]: exp(sum_{j<s<=i} g_s) for j < i (and 1 for j == i when
    SAME_TOKEN), else 0. Each segment sum is a cumsum of g masked to s > j: accumulated over its own tokens."""
    rt = tl.arange(0, BT)
    after_j = rt[:, None, None] > rt[None, :, None]  # [s or i, j, 1]
    seg = tl.cumsum(tl.where(after_j, g[:, None, :], 0.0), axis=0)
    keep = (rt[:, None, None] >= rt[None, :, None]) if SAME_TOKEN else after_j
    return tl.where(keep, tl.exp(seg), 0.0)


@device_fn
def unit_lower_inverse(L, rc, C: tl.constexpr):
    """(I + L)^-1 of a strictly lower [C, C] tile by forward substitution, row by row in fp32 (the delta rule's UT
    transform: Gated DeltaNet and KDA)."""
    eye = rc[:, None] == rc[None, :]
    inv = tl.where(eye, 1.0, 0.0)
    for i in range(1, C):
        at_i = rc[:, None] == i
        row = tl.sum(tl.where(at_i, L, 0.0), axis=0)  # L[i, :]
        new = tl.where(rc == i, 1.0, 0.0) - tl.sum(row[:, None] * inv, axis=0)
        inv = tl.where(at_i, new[None, :], inv)
    return inv


@device_fn
def delta_wy_backward(
    v_ptr, beta_ptr, T_ptr, vnew_ptr, do_ptr, dvnew_ptr, dTw_ptr, dA_ptr, dv_ptr, dbeta_ptr, T, N, scale,
    svb, svt, svh, sob, sot, soh,
    H: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr, HAS_DO: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """The delta rule's WY backward of one chunk (the program id's), for Gated DeltaNet's and KDA's kernels
    (gdn_bwd.py, kda_bwd.py), after their state-grads kernels: dv = beta T^T dv_new and its share of dbeta, the
    scores' gradient dA = scale do v_new^T, and dL = -T^T dT T^T (strictly lower; over dW's share of dT in its
    buffer). dv [B, T, H, V]; dA, dL [B, H, T, C] fp32; V in tiles of BV."""
    pid = tl.program_id(0).to(tl.int64)  # (chunk, b*H + h)
    i_n, i_bh = pid % N, pid // N
    b, h = i_bh // H, i_bh % H
    rc, rv = tl.arange(0, C), tl.arange(0, BV)
    all_rows = rc < C
    row0 = i_n * C
    tok = i_bh * T + row0
    beta = tl.load(beta_ptr + tok + rc)
    inv_t = tl.load(T_ptr + tok * C + rc[None, :] * C + rc[:, None])  # T^T, read transposed
    v_ptr += b * svb + h * svh + row0 * svt
    do_ptr += b * sob + h * soh + row0 * sot
    out_rows = (b * T + row0 + rc) * H + h
    cc = rc[:, None] * C + rc[None, :]
    dA = tl.zeros([C, C], dtype=tl.float32)
    dT = tl.load(dTw_ptr + tok * C + cc)
    dbeta = tl.load(dbeta_ptr + tok + rc)
    for v0 in range(0, V, BV):
        mv = v0 + rv < V
        dv_new = load_rows(dvnew_ptr + tok * V + v0, rc, rv, all_rows, mv, V)
        vv = load_rows(v_ptr + v0, rc, rv, all_rows, mv, svt)
        if HAS_DO:
            v_new = load_rows(vnew_ptr + tok * V + v0, rc, rv, all_rows, mv, V)
            dA += dot(load_rows(do_ptr + v0, rc, rv, all_rows, mv, sot) * scale, tl.trans(v_new), BF16)
        dT += dot(dv_new, tl.trans(vv * beta[:, None]), BF16)
        dv_u = dot(inv_t, dv_new, BF16)
        dbeta += tl.sum(dv_u * vv, axis=1)
        tl.store(dv_ptr + out_rows[:, None] * V + v0 + rv[None, :], dv_u * beta[:, None], mask=mv[None, :])
    tl.store(dA_ptr + tok * C + cc, dA)
    tl.store(dbeta_ptr + tok + rc, dbeta)
    for r0 in range(0, C, 16):  # dL in blocks of 16 rows: two chained [C, C] dots at once spill
        rr = r0 + tl.arange(0, 16)
        inv_t_rows = tl.load(T_ptr + tok * C + rc[None, :] * C + rr[:, None])  # rows rr of T^T
        dL = -dot(dot(inv_t_rows, dT, BF16), inv_t, BF16)
        dL = tl.where(rr[:, None] > rc[None, :], dL, 0.0)
        tl.store(dTw_ptr + tok * C + rr[:, None] * C + rc[None, :], dL)  # over dT in its buffer


EMULATE_BF16_DOTS = False  # tests: the interpreter rounds dot operands to bf16 as a GPU launch does


def bf16_dots(device: torch.device, *tensors: torch.Tensor | None) -> int:
    """The kernels' BF16 mode (see dot): 1, bf16 dot operands (fp32 accumulation) when the inputs are bf16, on a
    GPU; fp32 inputs get exact fp32 products (0; not tf32). The interpreter computes in fp32 (0), or emulates
    the GPU's bf16 operands (2) under EMULATE_BF16_DOTS."""
    if not all(t.dtype == torch.bfloat16 for t in tensors if t is not None):
        return 0
    if target.gpu(device) is not None:
        return 1
    return 2 if EMULATE_BF16_DOTS else 0


def strided(x: torch.Tensor, C: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """x [B, T, H, D] as the kernels read it, with its (batch, token, head) strides: any strides with a
    contiguous last dim (a projection's view is read in place, not copied); a chunk's rows must span < 2^31."""
    if x.stride(-1) != 1 or max(x.stride(1), x.stride(2)) * max(C, x.shape[2]) >= 2**31:
        x = x.contiguous()
    return x, (x.stride(0), x.stride(1), x.stride(2))


def contiguous_fp32(x: torch.Tensor | None) -> torch.Tensor | None:
    """A state (initial state, final-state gradient) as the kernels read it: fp32, contiguous; None stays None."""
    return None if x is None else x.to(torch.float32).contiguous()
