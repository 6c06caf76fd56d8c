"""Grouped GEMM for the experts: the rows of X [M, K] come in G consecutive groups (expert g owns rows
offsets[g]..offsets[g+1]), each multiplied by its own matrix.

    gmm       Y[rows_g] = X[rows_g] @ W[g]         W [G, K, N]; with W's strides swapped, dX = dY @ W[g]^T
    gmm_wgrad dW[g] = X[rows_g]^T @ dY[rows_g]      [G, K, N]; an empty group gets zeros

No host sync: the offsets stay on the device. `gmm`'s grid has cdiv(M, BLOCK_M) + G row tiles (an upper
bound of sum_g cdiv(m_g, BLOCK_M)); each program walks the G offsets to find its group and tile, and a
program past the last tile does nothing. `gmm_wgrad` has one program per (K tile x N tile, group) and
loops over its group's rows (G on grid axis 1: at most 65535 experts). fp32 accumulation; bf16 inputs
take bf16 tensor-core dots on a GPU, fp32 inputs exact fp32 products ("ieee", not tf32); the interpreter
(CPU) computes in fp32. Row and group offsets are int64 (M x K passes 2^31 at 262144 tokens x 8192).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import target


@triton.jit
def _find_tile(offsets_ptr, tile, G, BLOCK_M: tl.constexpr):
    """(group, first row, end row) of row tile `tile`; group -1 past the last tile."""
    group = tl.full((), -1, tl.int32)
    row0 = tl.zeros((), tl.int64)
    row_end = tl.zeros((), tl.int64)
    seen = tl.zeros((), tl.int64)
    start = tl.load(offsets_ptr).to(tl.int64)
    for g in range(G):
        end = tl.load(offsets_ptr + g + 1).to(tl.int64)
        n_tiles = (end - start + BLOCK_M - 1) // BLOCK_M
        hit = (tile >= seen) & (tile < seen + n_tiles)
        group = tl.where(hit, g, group)
        row0 = tl.where(hit, start + (tile - seen) * BLOCK_M, row0)
        row_end = tl.where(hit, end, row_end)
        seen += n_tiles
        start = end
    return group, row0, row_end


@triton.jit
def _gmm_kernel(
    x_ptr, w_ptr, y_ptr, offsets_ptr, N, K, G,
    stride_xm, stride_wg, stride_wk, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0).to(tl.int64)
    group, row0, row_end = _find_tile(offsets_ptr, tile, G, BLOCK_M)
    if group >= 0:
        rows = row0 + tl.arange(0, BLOCK_M).to(tl.int64)
        cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask, col_mask = rows < row_end, cols < N
        w_base = w_ptr + group.to(tl.int64) * stride_wg
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
            k_mask = ks < K
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_mask[:, None] & k_mask[None, :])
            w_offs = ks[:, None] * stride_wk + cols[None, :] * stride_wn
            w = tl.load(w_base + w_offs, mask=k_mask[:, None] & col_mask[None, :])
            if BF16:
                acc += tl.dot(x.to(tl.bfloat16), w.to(tl.bfloat16))
            else:
                acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        y_offs = rows[:, None] * stride_ym + cols[None, :]
        tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _gmm_wgrad_kernel(
    x_ptr, dy_ptr, dw_ptr, offsets_ptr, K, N, n_tiles_n,
    stride_xm, stride_dym, stride_dwg, stride_dwk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    group = tl.program_id(1).to(tl.int64)
    ks = (tile // n_tiles_n).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = (tile % n_tiles_n).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask, col_mask = ks < K, cols < N
    start = tl.load(offsets_ptr + group).to(tl.int64)
    end = tl.load(offsets_ptr + group + 1).to(tl.int64)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M).to(tl.int64)
        row_mask = rows < end
        xt = tl.load(x_ptr + rows[None, :] * stride_xm + ks[:, None], mask=k_mask[:, None] & row_mask[None, :])
        dy = tl.load(dy_ptr + rows[:, None] * stride_dym + cols[None, :], mask=row_mask[:, None] & col_mask[None, :])
        if BF16:
            acc += tl.dot(xt.to(tl.bfloat16), dy.to(tl.bfloat16))
        else:
            acc += tl.dot(xt.to(tl.float32), dy.to(tl.float32), input_precision="ieee")
    dw_offs = group * stride_dwg + ks[:, None] * stride_dwk + cols[None, :]
    tl.store(dw_ptr + dw_offs, acc.to(dw_ptr.dtype.element_ty), mask=k_mask[:, None] & col_mask[None, :])


def _tiles(device: torch.device, bf16: bool, *dims: int) -> dict[str, int]:
    """Tile widths, warps and stages, chosen by the compile check (no spills on sm_80 or sm_90): 128 x 128 x 64
    bf16 tiles on a GPU when every width and row stride is a multiple of 16 elements (vectorised, pipelined
    loads); exact fp32 products run on FMA units and hold their operands in registers, so fp32 takes 32 x 64 x
    32; an unaligned width or stride (scalar, masked loads) 32 x 32 x 32; small tiles under the interpreter."""
    if target.gpu(device) is None:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1)
    if not all(d % 16 == 0 for d in dims):
        return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)
    if bf16:
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
    return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2)


def _bf16(device: torch.device, *tensors: torch.Tensor) -> bool:
    return target.gpu(device) is not None and all(t.dtype == torch.bfloat16 for t in tensors)


def gmm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, trans_w: bool = False) -> torch.Tensor:
    """x [M, K] (unit column stride), w [G, K, N] (or [G, N, K] read transposed when trans_w), offsets [G + 1]
    int64 on x's device (offsets[0] = 0, offsets[G] = M) -> [M, N] in x's dtype."""
    G = w.shape[0]
    K, N = (w.shape[2], w.shape[1]) if trans_w else (w.shape[1], w.shape[2])
    stride_wk, stride_wn = (w.stride(2), w.stride(1)) if trans_w else (w.stride(1), w.stride(2))
    y = torch.empty(x.shape[0], N, device=x.device, dtype=x.dtype)
    cfg = _tiles(x.device, _bf16(x.device, x, w), K, N, x.stride(0), max(w.stride(1), w.stride(2)), y.stride(0))
    if x.shape[0] and N:
        grid = (triton.cdiv(x.shape[0], cfg["BLOCK_M"]) + G, triton.cdiv(N, cfg["BLOCK_N"]))
        _gmm_kernel[grid](
            x, w, y, offsets, N, K, G, x.stride(0), w.stride(0), stride_wk, stride_wn, y.stride(0),
            BF16=_bf16(x.device, x, w), **cfg,
        )  # fmt: skip
    return y


def gmm_wgrad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dW [G, K, N] in `dtype`: dW[g] = x[rows_g]^T @ dy[rows_g] (x [M, K], dy [M, N], unit column strides)."""
    G, K, N = offsets.shape[0] - 1, x.shape[1], dy.shape[1]
    dw = torch.empty(G, K, N, device=x.device, dtype=dtype)
    cfg = _tiles(x.device, _bf16(x.device, x, dy), K, N, x.stride(0), dy.stride(0))
    n_tiles_n = triton.cdiv(N, cfg["BLOCK_N"])
    if G and K and N:
        _gmm_wgrad_kernel[(triton.cdiv(K, cfg["BLOCK_K"]) * n_tiles_n, G)](
            x, dy, dw, offsets, K, N, n_tiles_n, x.stride(0), dy.stride(0), dw.stride(0), dw.stride(1),
            BF16=_bf16(x.device, x, dy), **cfg,
        )  # fmt: skip
    return dw
