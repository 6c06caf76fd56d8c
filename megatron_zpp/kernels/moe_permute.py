"""The token permutation of the MoE layer (moe/permute.py, its PyTorch reference) as two Triton kernels:

    gather_rows  y[r] = scale[r] * x[index[r]]                 [M, H] from x [N, H]: the permute (scale None) and
                                                               the unpermute's input gradient (scale = probs)
    slot_sum     out[n] = sum_s scale[inv[n, s]] * rows[inv[n, s]]  [N, H] from rows [M, H]: the unpermute
                                                               (scale = probs) and the permute's input gradient

`inv` [N, K] lists each token's permuted rows in slot order (-1: none), so a token's sum runs in a fixed order
in fp32 (no atomics: deterministic, as the reference's slot buffer). One program per (row, block of columns);
row offsets are int64 (M x H passes 2^31 at 262144 routed rows x 8192)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_WARPS = 4


def _block(h: int) -> int:
    return min(triton.next_power_of_2(max(h, 16)), 1024)


@triton.jit
def _gather_rows_kernel(
    x_ptr, index_ptr, scale_ptr, y_ptr, H, stride_x, stride_y, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    src = tl.load(index_ptr + r).to(tl.int64)
    v = tl.load(x_ptr + src * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        v = v * tl.load(scale_ptr + r).to(tl.float32)
    tl.store(y_ptr + r * stride_y + cols, v.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _slot_sum_kernel(
    rows_ptr, inv_ptr, scale_ptr, out_ptr, H, K, stride_r, stride_o, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(K):
        r = tl.load(inv_ptr + n * K + s).to(tl.int64)
        valid = r >= 0
        row = tl.where(valid, r, 0)  # row 0 exists (the wrapper returns zeros when there are no rows)
        v = tl.load(rows_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            v = v * tl.load(scale_ptr + row).to(tl.float32)
        acc += tl.where(valid, v, 0.0)
    tl.store(out_ptr + n * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gather_rows(x: torch.Tensor, index: torch.Tensor, scale: torch.Tensor | None = None, dtype=None) -> torch.Tensor:
    """x [N, H] (unit column stride), index [M] int64 -> [M, H] in `dtype` (default x's), rows scaled in fp32."""
    m, h = index.shape[0], x.shape[1]
    y = torch.empty(m, h, device=x.device, dtype=dtype or x.dtype)
    block = _block(h)
    if m and h:
        _gather_rows_kernel[(m, triton.cdiv(h, block))](
            x, index, scale if scale is not None else x, y, h, x.stride(0), y.stride(0),
            HAS_SCALE=scale is not None, BLOCK=block, num_warps=NUM_WARPS,
        )  # fmt: skip
    return y


def slot_sum(rows: torch.Tensor, inv: torch.Tensor, scale: torch.Tensor | None = None, dtype=None) -> torch.Tensor:
    """rows [M, H] (unit column stride), inv [N, K] int64 -> [N, H] in `dtype` (default rows'), summed in fp32."""
    n, k, h = inv.shape[0], inv.shape[1], rows.shape[1]
    out = torch.empty(n, h, device=rows.device, dtype=dtype or rows.dtype)
    if rows.shape[0] == 0:  # no routed row: every token's sum is empty
        return out.zero_()
    block = _block(h)
    if n and h:
        _slot_sum_kernel[(n, triton.cdiv(h, block))](
            rows, inv, scale if scale is not None else rows, out, h, k, rows.stride(0), out.stride(0),
            HAS_SCALE=scale is not None, BLOCK=block, num_warps=NUM_WARPS,
        )  # fmt: skip
    return out
