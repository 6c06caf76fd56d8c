"""RMSNorm and LayerNorm over the last dim of a [rows, n] tensor, forward and backward.

Forward: one program per row, fp32 math whatever the input dtype; per-row statistics (mean for
LayerNorm, 1/rms) kept in fp32 for the backward. Up to MAX_ROW_BLOCK columns the whole row sits in
registers (BLOCK_N = next power of two of n, masked); a wider row streams in TILE_N tiles, two passes
for the statistics (mean, then the centred sum of squares) and one for the output, the row's later
reads coming from L1/L2.

Backward up to MAX_FUSED_BWD columns: one kernel; each program walks a contiguous block of rows with
the row in registers, writes dx per row and sums its rows' weight (and bias) gradients in fp32
registers into one partial row; the partials [programs, n] are then summed once (no atomics: the
result does not depend on scheduling). Wider rows (their row, weight and two gradient accumulators no
longer fit in registers without spilling) take two kernels, as Apex does: dx per row in tiles (one pass
for the row's two dot products, one for dx), then the weight/bias gradients by column tiles, each
program summing a block of rows of its tile in registers into a partial row.

Offsets are int64 (row index * stride: 32768 rows x 32768 columns is 2^30 elements, and strided rows
pass 2^31 sooner). Every launch passes its num_warps (and num_stages where a loop streams).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import target

# (tests lower these four to reach the tiled paths at small widths)
MAX_ROW_BLOCK = 16384  # forward: widest row held in registers
MAX_FUSED_BWD = 8192  # backward: widest row of the one-kernel path
TILE_N = 4096  # columns per tile of a wide row (forward, backward dx)
DW_TILE_N = 1024  # columns per program of the wide backward's dw/db kernel


@triton.jit
def _norm_fwd_kernel(
    x_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, x_row_stride, y_row_stride, n, eps,
    IS_RMS: tl.constexpr, BLOCK_N: tl.constexpr, TILED: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    y_row = y_ptr + row * y_row_stride
    cols = tl.arange(0, BLOCK_N)
    if not TILED:  # the whole row in registers
        mask = cols < n
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
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
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:  # tiles of BLOCK_N: statistics in two passes (as the whole-row path: mean, then centred squares)
        mean = 0.0
        if not IS_RMS:
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for start in range(0, n, BLOCK_N):
                acc += tl.load(x_row + start + cols, mask=start + cols < n, other=0.0).to(tl.float32)
            mean = tl.sum(acc, axis=0) / n
            tl.store(mean_ptr + row, mean)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(0, n, BLOCK_N):
            mask = start + cols < n
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            xc = x if IS_RMS else tl.where(mask, x - mean, 0.0)
            acc += xc * xc
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / n + eps)
        tl.store(rstd_ptr + row, rstd)
        for start in range(0, n, BLOCK_N):
            mask = start + cols < n
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            xc = x if IS_RMS else x - mean
            y = xc * rstd * w
            if not IS_RMS:
                y += tl.load(b_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + start + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr, db_part_ptr,
    dy_row_stride, x_row_stride, dx_row_stride, n_rows, n, rows_per_program,
    IS_RMS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for row in range(row_start, row_end):  # int64, as row_start: row * stride cannot wrap
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


@triton.jit
def _norm_bwd_dx_kernel(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dy_row_stride, x_row_stride, dx_row_stride, n,
    IS_RMS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Wide rows: dx of one row in tiles, the same formula as _norm_bwd_kernel."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    dy_row = dy_ptr + row * dy_row_stride
    dx_row = dx_ptr + row * dx_row_stride
    cols = tl.arange(0, BLOCK_N)
    rstd = tl.load(rstd_ptr + row)
    mean = 0.0 if IS_RMS else tl.load(mean_ptr + row)
    dot = tl.zeros((BLOCK_N,), dtype=tl.float32)  # wdy * xhat
    tot = tl.zeros((BLOCK_N,), dtype=tl.float32)  # wdy (LayerNorm)
    for start in range(0, n, BLOCK_N):
        mask = start + cols < n
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        xhat = x * rstd if IS_RMS else tl.where(mask, (x - mean) * rstd, 0.0)
        dot += w * dy * xhat
        if not IS_RMS:
            tot += w * dy
    c1 = tl.sum(dot, axis=0) / n
    c2 = 0.0 if IS_RMS else tl.sum(tot, axis=0) / n
    for start in range(0, n, BLOCK_N):
        mask = start + cols < n
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        xhat = x * rstd if IS_RMS else (x - mean) * rstd
        dx = w * dy - xhat * c1
        if not IS_RMS:
            dx -= c2
        tl.store(dx_row + start + cols, (dx * rstd).to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_dw_kernel(
    dy_ptr, x_ptr, mean_ptr, rstd_ptr, dw_part_ptr, db_part_ptr, dy_row_stride, x_row_stride,
    n_rows, n, rows_per_program,
    IS_RMS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Wide rows: partial dw (and db) of one column tile over one block of rows."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # 64-bit, as every offset here
    mask = cols < n
    pid = tl.program_id(1).to(tl.int64)
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
            xhat = (x - tl.load(mean_ptr + row)) * rstd
            db += dy
        dw += dy * xhat
    tl.store(dw_part_ptr + pid * n + cols, dw, mask=mask)
    if not IS_RMS:
        tl.store(db_part_ptr + pid * n + cols, db, mask=mask)


def _fwd_warps(block_n: int) -> int:
    """Whole-row forward: at most 32 fp32 elements of each row tensor a thread."""
    return 4 if block_n <= 2048 else 8 if block_n <= 8192 else 16


def _bwd_warps(block_n: int) -> int:
    """Whole-row backward (x, dy, w, dw, db live): at most 16 elements of each a thread."""
    return 4 if block_n <= 2048 else 8 if block_n <= 4096 else 16


def norm_fwd(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float):
    """x2d [rows, n] (unit column stride). Returns y (x's dtype), mean (None for RMSNorm), rstd: fp32 [rows]."""
    rows, n = x2d.shape
    is_rms = bias is None
    y = torch.empty_like(x2d)
    rstd = torch.empty(rows, device=x2d.device, dtype=torch.float32)
    mean = None if is_rms else torch.empty_like(rstd)
    tiled = n > MAX_ROW_BLOCK
    block_n = TILE_N if tiled else triton.next_power_of_2(n)
    if rows:
        _norm_fwd_kernel[(rows,)](
            x2d, y, weight, weight if is_rms else bias, rstd if is_rms else mean, rstd,
            x2d.stride(0), y.stride(0), n, eps,
            IS_RMS=is_rms, BLOCK_N=block_n, TILED=tiled,
            num_warps=8 if tiled else _fwd_warps(block_n), num_stages=2 if tiled else 1,
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
    fused = n <= MAX_FUSED_BWD
    col_tiles = 1 if fused else triton.cdiv(n, DW_TILE_N)
    # wide rows: the column tiles already give col_tiles programs per row block, so fewer row blocks
    programs = max(1, programs or triton.cdiv(_default_programs(x2d.device, rows), col_tiles))
    rows_per_program = triton.cdiv(rows, programs)
    programs = triton.cdiv(rows, rows_per_program) if rows else 1
    dx = torch.empty_like(x2d)
    dw_part = torch.zeros(programs, n, device=x2d.device, dtype=torch.float32)
    db_part = dw_part if is_rms else torch.zeros_like(dw_part)
    stats = rstd if is_rms else mean
    if rows and fused:
        block_n = triton.next_power_of_2(n)
        _norm_bwd_kernel[(programs,)](
            dy2d, x2d, weight, stats, rstd, dx, dw_part, db_part,
            dy2d.stride(0), x2d.stride(0), dx.stride(0), rows, n, rows_per_program,
            IS_RMS=is_rms, BLOCK_N=block_n, num_warps=_bwd_warps(block_n), num_stages=1,
        )  # fmt: skip
    elif rows:
        _norm_bwd_dx_kernel[(rows,)](
            dy2d, x2d, weight, stats, rstd, dx, dy2d.stride(0), x2d.stride(0), dx.stride(0), n,
            IS_RMS=is_rms, BLOCK_N=TILE_N, num_warps=8, num_stages=2,
        )  # fmt: skip
        _norm_bwd_dw_kernel[(col_tiles, programs)](
            dy2d, x2d, stats, rstd, dw_part, db_part, dy2d.stride(0), x2d.stride(0), rows, n, rows_per_program,
            IS_RMS=is_rms, BLOCK_N=DW_TILE_N, num_warps=4, num_stages=2,
        )  # fmt: skip
    dw = dw_part.sum(0).to(weight.dtype)
    db = None if is_rms else db_part.sum(0).to(weight.dtype)
    return dx, dw, db
