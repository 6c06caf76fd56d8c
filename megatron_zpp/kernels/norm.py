"""RMSNorm and LayerNorm over the last dim of a [rows, n] tensor, forward and backward.

Forward: one program per row, the whole row in registers (BLOCK_N = next power of two of n, masked),
fp32 math whatever the input dtype; per-row statistics (mean for LayerNorm, 1/rms) kept in fp32 for
the backward. Backward: each program walks a contiguous block of rows, writes dx per row and sums
its rows' weight (and bias) gradients in fp32 registers into one partial row; the partials
[programs, n] are then summed once (no atomics: the result does not depend on scheduling).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import target


@triton.jit
def _norm_fwd_kernel(
    x_ptr,
    y_ptr,
    w_ptr,
    b_ptr,
    mean_ptr,
    rstd_ptr,
    x_row_stride,
    y_row_stride,
    n,
    eps,
    IS_RMS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=0) / n
        xc = tl.where(mask, x - mean, 0.0)  # padding must not enter the variance
        tl.store(mean_ptr + row, mean)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / n + eps)
    tl.store(rstd_ptr + row, rstd)
    y = xc * rstd * w
    if not IS_RMS:
        y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    dw_part_ptr,
    db_part_ptr,
    dy_row_stride,
    x_row_stride,
    dx_row_stride,
    n_rows,
    n,
    rows_per_program,
    IS_RMS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for row in range(row_start, row_end):
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        if IS_RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(mask, (x - tl.load(mean_ptr + row)) * rstd, 0.0)
        wdy = w * dy
        # d/dx of xhat * w: project out the directions the normalisation removed
        dx = wdy - xhat * (tl.sum(wdy * xhat, axis=0) / n)
        if not IS_RMS:
            dx -= tl.sum(wdy, axis=0) / n
            db += dy
        dw += dy * xhat
        tl.store(dx_ptr + row * dx_row_stride + cols, (dx * rstd).to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_part_ptr + pid * n + cols, dw, mask=mask)
    if not IS_RMS:
        tl.store(db_part_ptr + pid * n + cols, db, mask=mask)


def _num_warps(block_n: int) -> int:
    return 4 if block_n <= 2048 else 8 if block_n <= 8192 else 16


def norm_fwd(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float):
    """x2d [rows, n] (unit column stride). Returns y (x's dtype), mean (None for RMSNorm), rstd: fp32 [rows]."""
    rows, n = x2d.shape
    is_rms = bias is None
    y = torch.empty_like(x2d)
    rstd = torch.empty(rows, device=x2d.device, dtype=torch.float32)
    mean = None if is_rms else torch.empty_like(rstd)
    block_n = triton.next_power_of_2(n)
    if rows:
        _norm_fwd_kernel[(rows,)](
            x2d, y, weight, weight if is_rms else bias, rstd if is_rms else mean, rstd,
            x2d.stride(0), y.stride(0), n, eps,
            IS_RMS=is_rms, BLOCK_N=block_n, num_warps=_num_warps(block_n),
        )  # fmt: skip
    return y, mean, rstd


def _default_programs(device: torch.device, rows: int) -> int:
    gpu = target.gpu(device)
    if gpu is not None:  # a few row blocks per SM keeps every SM busy, the partials small
        return min(rows, 4 * gpu.sm_count)
    return min(rows, 4)


def norm_bwd(
    dy2d: torch.Tensor,
    x2d: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    programs: int | None = None,
):
    """Gradients of norm_fwd: dx (x's dtype), dw and db (weight's dtype; db None for RMSNorm).
    `programs`: how many row blocks (default: from the device); their partials are summed once."""
    rows, n = x2d.shape
    is_rms = mean is None
    programs = max(1, programs or _default_programs(x2d.device, rows))
    rows_per_program = triton.cdiv(rows, programs)
    programs = triton.cdiv(rows, rows_per_program) if rows else 1
    dx = torch.empty_like(x2d)
    dw_part = torch.zeros(programs, n, device=x2d.device, dtype=torch.float32)
    db_part = dw_part if is_rms else torch.zeros_like(dw_part)
    block_n = triton.next_power_of_2(n)
    if rows:
        _norm_bwd_kernel[(programs,)](
            dy2d, x2d, weight, rstd if is_rms else mean, rstd, dx, dw_part, db_part,
            dy2d.stride(0), x2d.stride(0), dx.stride(0), rows, n, rows_per_program,
            IS_RMS=is_rms, BLOCK_N=block_n, num_warps=_num_warps(block_n),
        )  # fmt: skip
    dw = dw_part.sum(0).to(weight.dtype)
    db = None if is_rms else db_part.sum(0).to(weight.dtype)
    return dx, dw, db
