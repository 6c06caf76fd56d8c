"""Cross-entropy over one rank's slice of the vocabulary, row by row, never holding more than one
tile of a row in fp32.

Forward: one program per row streams the row in tiles and keeps an online max and a sum of
exponentials relative to it (rescaled when the max grows), and picks the target logit when the
row's label falls in this slice. The caller combines the per-row pieces over TP.
Backward: one program per row recomputes softmax from the logits and the row's log-sum-exp and
writes (softmax - onehot) * grad into a buffer of the logits' dtype, or over the logits themselves
(`inplace`: each tile is read before the same program overwrites it, so no logits-sized buffer is
allocated; the caller guarantees nobody reads the logits afterwards). Offsets are int64 (row * stride:
8192 rows x 256K vocab is 2^31 elements).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 4096  # columns per tile (tests lower it to get several tiles and a ragged tail)
NUM_WARPS = 8  # 16 columns a thread at a full tile: fp32 backward spills with 4 warps (32 columns) on sm_90


@triton.jit
def _ce_fwd_kernel(x_ptr, labels_ptr, max_ptr, sum_exp_ptr, target_ptr, x_row_stride, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * x_row_stride
    m = float("-inf")
    s = 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))  # finite: every tile has a column < V
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    label = tl.load(labels_ptr + row)  # in this slice's numbering; outside [0, V) for another rank's
    inside = (label >= 0) & (label < V)
    target = tl.load(base + label, mask=inside, other=0.0).to(tl.float32)
    tl.store(max_ptr + row, m)
    tl.store(sum_exp_ptr + row, s)
    tl.store(target_ptr + row, target)


@triton.jit
def _ce_bwd_kernel(x_ptr, dx_ptr, labels_ptr, lse_ptr, dloss_ptr, x_row_stride, dx_row_stride, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(labels_ptr + row)
    lse = tl.load(lse_ptr + row)
    dloss = tl.load(dloss_ptr + row)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        p = tl.where(cols == label, p - 1.0, p)  # never true for a label outside the slice
        tl.store(dx_ptr + row * dx_row_stride + cols, (p * dloss).to(dx_ptr.dtype.element_ty), mask=mask)


def _block(V: int) -> int:
    return min(MAX_BLOCK, triton.next_power_of_2(V))


def ce_fwd_stats(x2d: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x2d [rows, V] (unit column stride), labels [rows] int64 in the slice's numbering ->
    fp32 [rows] each: the row max, sum exp(x - max), and x[label] (0 where the label is outside)."""
    rows, V = x2d.shape
    out = torch.empty(3, rows, device=x2d.device, dtype=torch.float32)
    if rows and V:
        _ce_fwd_kernel[(rows,)](
            x2d, labels, out[0], out[1], out[2], x2d.stride(0), V, BLOCK=_block(V), num_warps=NUM_WARPS, num_stages=2
        )
    return out[0], out[1], out[2]


def ce_bwd(
    x2d: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, dloss: torch.Tensor, inplace: bool = False
) -> torch.Tensor:
    """(softmax(x2d) - onehot(labels)) * dloss[:, None] in x2d's dtype; softmax = exp(x - lse),
    lse and dloss fp32 [rows]. inplace: written over x2d (and x2d returned) instead of a new tensor."""
    rows, V = x2d.shape
    dx = x2d if inplace else torch.empty_like(x2d, memory_format=torch.contiguous_format)
    if rows and V:
        _ce_bwd_kernel[(rows,)](
            x2d, dx, labels, lse, dloss, x2d.stride(0), dx.stride(0), V,
            BLOCK=_block(V), num_warps=NUM_WARPS, num_stages=2,
        )  # fmt: skip
    return dx
