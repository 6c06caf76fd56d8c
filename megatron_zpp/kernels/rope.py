"""Rotary position embedding on [B, T, H, D] heads, the half-rotation convention (pairs x[i], x[i + D/2],
GPT-NeoX / Llama), with cos/sin tables [T, D] (positions, CP offsets included, are in the tables), or
[B, T, D] when every sample has its own positions (packed documents).

One program per (token, block of heads): it loads the token's cos/sin row once and rotates its heads
in fp32. The output may alias the input (in place: the forward rotates q and k where they lie). The
backward is the transpose of the rotation, which for the model's tables (both halves equal) is the
rotation by -theta. Strided batch/token/head dims (views of a fused QKV projection); unit stride in D.
Offsets are int64 (token and head indices times their strides); 4 warps for about 4096 elements a
program (16 a thread: one 16-byte access per half-row of bf16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(
    x_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    T,
    H,
    half,
    x_stride_b,
    x_stride_t,
    x_stride_h,
    out_stride_b,
    out_stride_t,
    out_stride_h,
    table_stride_b,
    table_stride_t,
    TRANSPOSE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    b, t = token // T, token % T
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < half
    mask = (heads[:, None] < H) & col_mask[None, :]

    table = b * table_stride_b + t * table_stride_t + cols
    cos1 = tl.load(cos_ptr + table, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + table + half, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + table, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + table + half, mask=col_mask, other=0.0).to(tl.float32)[None, :]

    x_at = x_ptr + b * x_stride_b + t * x_stride_t + heads[:, None].to(tl.int64) * x_stride_h + cols[None, :]
    x1 = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_at + half, mask=mask, other=0.0).to(tl.float32)
    if TRANSPOSE:  # [[c1, -s1], [s2, c2]]^T
        o1 = x1 * cos1 + x2 * sin2
        o2 = x2 * cos2 - x1 * sin1
    else:  # x * cos + [-x2, x1] * sin
        o1 = x1 * cos1 - x2 * sin1
        o2 = x2 * cos2 + x1 * sin2
    out_at = out_ptr + b * out_stride_b + t * out_stride_t + heads[:, None].to(tl.int64) * out_stride_h + cols[None, :]
    tl.store(out_at, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_at + half, o2.to(out_ptr.dtype.element_ty), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, transpose: bool = False):
    """Rotate x [B, T, H, D] (stride 1 in D) into out (same shape; may be x itself) with cos/sin [T, D]
    or [B, T, D] (stride 1 in D, same strides). transpose: apply the transposed rotation (the backward)."""
    B, T, H, D = x.shape
    half = D // 2
    block_half = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(H), 4096 // block_half))  # about 4k elements a program
    grid = (B * T, triton.cdiv(H, block_h))
    if B * T and H:
        _rope_kernel[grid](
            x, out, cos, sin, T, H, half,
            x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1), out.stride(2),
            cos.stride(0) if cos.dim() == 3 else 0, cos.stride(-2),
            TRANSPOSE=transpose, BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=4,
        )  # fmt: skip
    return out
