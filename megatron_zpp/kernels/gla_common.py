"""Device helpers shared by the GLA chunk kernels (gla_fwd.py, gla_bwd.py): masked fp32 row loads, the dot
of either precision, the in-chunk decays. kernels/gla.py describes the layout and the numerics."""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

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
