"""Grouped GEMM: Y[rows of group g] = X[rows of group g] @ W[g], the rows of X [M, K] in G consecutive groups
of `group_sizes` rows (the tokens of each expert, contiguous after the permutation), W [G, K, N].

The Triton kernel (kernels/grouped_gemm.py) runs forward and both backward products (dX = dY W[g]^T per
group, dW[g] = X_g^T dY_g) without a host sync, for fp32/bf16/fp16. The reference is a loop over the groups
(one matmul each; it reads the sizes on the host). Not torch._grouped_mm: on the CPU wheel (torch 2.13) it
takes fp32/bf16 only, wants 16-byte aligned strides, and its backward fails on an expanded gradient."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from . import dispatch

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
dispatch.register("grouped_gemm", "fp32/bf16/fp16, any sizes")


def grouped_mm_reference(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """One matmul per group (autograd through the slices); an empty group contributes nothing."""
    chunks = torch.split(x, group_sizes.tolist())
    out = [chunk @ w[g] for g, chunk in enumerate(chunks)]
    return torch.cat(out) if out else x.new_empty(0, w.shape[2])


def _kernels():
    from ..kernels import grouped_gemm  # lazily: triton is needed only once a kernel runs

    return grouped_gemm


@dispatch.kernel_op("grouped_mm_fwd")
def _gmm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, trans_w: bool) -> torch.Tensor:
    return _kernels().gmm(x, w, offsets, trans_w)


@_gmm.register_fake
def _(x, w, offsets, trans_w):
    return x.new_empty(x.shape[0], w.shape[1] if trans_w else w.shape[2])


@dispatch.kernel_op("grouped_mm_wgrad")
def _gmm_wgrad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _kernels().gmm_wgrad(x, dy, offsets, dtype)


@_gmm_wgrad.register_fake
def _(x, dy, offsets, dtype):
    return x.new_empty(offsets.shape[0] - 1, x.shape[1], dy.shape[1], dtype=dtype)


class GroupedMMFunction(torch.autograd.Function):
    """Saves X, W and the offsets; the backward is two more grouped GEMMs."""

    @staticmethod
    def forward(ctx, x, w, offsets):
        ctx.save_for_backward(x, w, offsets)
        return _gmm(x, w, offsets, False)

    @staticmethod
    def backward(ctx, dy):
        x, w, offsets = ctx.saved_tensors
        dy = dy if dy.stride(-1) == 1 else dy.contiguous()
        dx = _gmm(dy, w, offsets, True) if ctx.needs_input_grad[0] else None
        dw = _gmm_wgrad(x, dy, offsets, w.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def group_offsets(group_sizes: torch.Tensor) -> torch.Tensor:
    """[G] sizes -> [G + 1] int64 offsets on the same device (0, s0, s0 + s1, ...), no host sync."""
    return torch.nn.functional.pad(torch.cumsum(group_sizes, 0, dtype=torch.int64), (1, 0))


def grouped_mm(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """x [M, K], w [G, K, N], group_sizes [G] (integers summing to M) -> [M, N] in x's dtype. Fake tensors (a
    dry run: shapes only, the sizes have no values) take the kernel's ops, whose fake implementations need none."""
    kernel = dispatch.use_triton(x) or is_fake(x)
    if kernel and x.dtype in KERNEL_DTYPES and w.dtype == x.dtype:
        x = x if x.stride(-1) == 1 else x.contiguous()
        return GroupedMMFunction.apply(x, w.contiguous(), group_offsets(group_sizes))
    return grouped_mm_reference(x, w, group_sizes)
