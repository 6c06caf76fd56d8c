"""SwiGLU on the fused [gate | up] output of the MLP's first projection: silu(gate) * up.

The input is [rows, 2F] (each TP rank's columns are its gate share then its up share), the output
[rows, F]. One program per (row, block of columns), fp32 math whatever the dtype. The backward
reads the same [gate | up] input and writes the gradient of both halves into one [rows, 2F] tensor,
the layout the projection's backward takes. Row offsets are int64 (rows x 2F passes 2^31 at 8192 x
2 x 131072), the column offsets too (the compile test holds every offset product to 64 bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _swiglu_fwd_kernel(h_ptr, y_ptr, h_row_stride, y_row_stride, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    gate = tl.load(h_ptr + row * h_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + row * h_row_stride + F + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(dy_ptr, h_ptr, dh_ptr, dy_row_stride, h_row_stride, dh_row_stride, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    dy = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(h_ptr + row * h_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + row * h_row_stride + F + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    # silu'(g) = sig(g) * (1 + g * (1 - sig(g)))
    dgate = dy * up * (sig + silu * (1.0 - sig))
    dup = dy * silu
    tl.store(dh_ptr + row * dh_row_stride + cols, dgate.to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dh_ptr + row * dh_row_stride + F + cols, dup.to(dh_ptr.dtype.element_ty), mask=mask)


NUM_WARPS = 4  # 8 columns a thread at a full block: one 16-byte access of bf16 per tensor


def _block(F: int) -> int:
    return min(1024, triton.next_power_of_2(F))


def swiglu_fwd(h2d: torch.Tensor) -> torch.Tensor:
    """h2d [rows, 2F] (unit column stride) -> silu(h[:, :F]) * h[:, F:], [rows, F] in h's dtype."""
    rows, F = h2d.shape[0], h2d.shape[1] // 2
    y = torch.empty(rows, F, device=h2d.device, dtype=h2d.dtype)
    block = _block(F)
    if rows and F:
        _swiglu_fwd_kernel[(rows, triton.cdiv(F, block))](
            h2d, y, h2d.stride(0), y.stride(0), F, BLOCK=block, num_warps=NUM_WARPS
        )
    return y


def swiglu_bwd(dy2d: torch.Tensor, h2d: torch.Tensor) -> torch.Tensor:
    """Gradient of swiglu_fwd with respect to h2d: [rows, 2F] in h's dtype."""
    rows, F = h2d.shape[0], h2d.shape[1] // 2
    dh = torch.empty(rows, 2 * F, device=h2d.device, dtype=h2d.dtype)
    block = _block(F)
    if rows and F:
        _swiglu_bwd_kernel[(rows, triton.cdiv(F, block))](
            dy2d, h2d, dh, dy2d.stride(0), h2d.stride(0), dh.stride(0), F, BLOCK=block, num_warps=NUM_WARPS
        )
    return dh
