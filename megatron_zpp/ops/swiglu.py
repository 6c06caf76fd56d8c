"""SwiGLU activation on the fused [gate | up] output of the MLP's first projection (under TP each rank
holds its share of gate then its share of up): silu(gate) * up. The Triton kernel (kernels/swiglu.py)
runs under --kernels for fp32/bf16/fp16 inputs; else the PyTorch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import dispatch

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
dispatch.register("swiglu", "fp32/bf16/fp16, any width")


def swiglu_reference(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _kernels():
    from ..kernels import swiglu  # lazily: triton is needed only once a kernel runs

    return swiglu


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2d = t.reshape(-1, t.shape[-1])
    return t2d if t2d.stride(-1) == 1 else t2d.contiguous()


@dispatch.kernel_op("swiglu_fwd")
def _swiglu_fwd(h2d: torch.Tensor) -> torch.Tensor:
    return _kernels().swiglu_fwd(h2d)


@_swiglu_fwd.register_fake
def _(h2d):
    return h2d.new_empty(h2d.shape[0], h2d.shape[1] // 2)


@dispatch.kernel_op("swiglu_bwd")
def _swiglu_bwd(dy2d: torch.Tensor, h2d: torch.Tensor) -> torch.Tensor:
    return _kernels().swiglu_bwd(dy2d, h2d)


@_swiglu_bwd.register_fake
def _(dy2d, h2d):
    return h2d.new_empty(h2d.shape)


class SwiGLUFunction(torch.autograd.Function):
    """Saves only the [gate | up] input; the backward recomputes sigmoid(gate)."""

    @staticmethod
    def forward(ctx, h):
        ctx.save_for_backward(h)
        return _swiglu_fwd(_rows(h)).view(*h.shape[:-1], h.shape[-1] // 2)

    @staticmethod
    def backward(ctx, dy):
        (h,) = ctx.saved_tensors
        return _swiglu_bwd(_rows(dy), _rows(h)).view(h.shape)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """h: [..., 2F] -> [..., F]."""
    if dispatch.use_triton(h) and h.dtype in KERNEL_DTYPES and h.shape[-1] % 2 == 0:
        return SwiGLUFunction.apply(h)
    return swiglu_reference(h)
