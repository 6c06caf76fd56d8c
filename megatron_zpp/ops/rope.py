"""Rotary position embedding (RoPE), rotating pairs (x[i], x[i + D/2]) as GPT-NeoX and Llama do, with
cos/sin tables [T, D] from model/rope.py (positions are absolute: a context-parallel rank's tables
start at its slice's offset), or [B, T, D] when each sample has its own positions (--reset-position-ids).

`rope_reference` is the PyTorch math. `apply_rope` (out of place) and `apply_rope_qk` (the query and
key heads of the fused QKV projection, rotated in place) run the Triton kernel (kernels/rope.py)
under --kernels when it applies: fp32/bf16/fp16 heads with unit stride in D; else the reference.
"""

from __future__ import annotations

import torch

from . import dispatch

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
dispatch.register("rope", "fp32/bf16/fp16 q and k heads, in place, any even head dim")


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; cos/sin: [T, D] or [B, T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)  # broadcast over heads
    return x * cos + rotated * sin


def _kernel_applies(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    return (
        dispatch.use_triton(x)
        and x.dtype in KERNEL_DTYPES
        and x.dim() == 4
        and x.shape[-1] % 2 == 0
        and x.stride(-1) == 1
        and cos.shape == sin.shape
        and cos.shape in ((x.shape[1], x.shape[3]), (x.shape[0], x.shape[1], x.shape[3]))
    )


def _kernels():
    from ..kernels import rope  # lazily: triton is needed only once a kernel runs

    return rope


@dispatch.kernel_op("rope")
def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool) -> torch.Tensor:
    """x rotated (transpose: by the inverse rotation) into a new tensor."""
    return _kernels().rope(x, cos, sin, out=torch.empty_like(x), transpose=transpose)


@_rope.register_fake
def _(x, cos, sin, transpose):
    return torch.empty_like(x)


@dispatch.kernel_op("rope_", mutates_args=("x",))
def _rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """x rotated in place."""
    _kernels().rope(x, cos, sin, out=x)


@_rope_.register_fake
def _(x, cos, sin):
    return None


class RopeFunction(torch.autograd.Function):
    """The rotation through the Triton kernel, in place (the input is marked dirty) or into a new tensor.
    In place takes a plain tensor or a single view (a slice, .view of it), not an output of a
    multi-output view op such as split or chunk (autograd refuses those), nor a leaf requiring grad."""

    @staticmethod
    def forward(ctx, x, cos, sin, in_place: bool):
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        if in_place:
            _rope_(x, cos, sin)
            ctx.mark_dirty(x)
        out = x if in_place else _rope(x, cos, sin, False)
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        dy = dy if dy.stride(-1) == 1 else dy.contiguous()
        # into a new tensor: the incoming gradient may be shared with another consumer
        return _rope(dy, cos, sin, True), None, None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D] rotated into a new tensor."""
    if _kernel_applies(x, cos, sin):
        return RopeFunction.apply(x, cos, sin, False)
    return rope_reference(x, cos, sin)


def apply_rope_qk(
    qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """qk: [B, T, Hq + Hk, D], the query heads then the key heads as one view of the QKV projection
    (they lie side by side there; a slice, not a split output). Returns the rotated q [B, T, Hq, D] and
    k [B, T, Hk, D]: on the kernel path rotated in place in qk's storage (one launch for both; use
    the returned tensors), on the reference path new tensors (each head group rotated on its own).
    Under torch.compile the kernel path writes a new tensor (same values): AOTAutograd cannot trace an
    in-place autograd.Function on a view (torch 2.13: an internal assert in CopySlices)."""
    kv_heads = qk.shape[2] - q_heads
    if _kernel_applies(qk, cos, sin):
        in_place = not torch.compiler.is_compiling()
        return RopeFunction.apply(qk, cos, sin, in_place).split([q_heads, kv_heads], dim=2)
    q, k = qk.split([q_heads, kv_heads], dim=2)
    return rope_reference(q, cos, sin), rope_reference(k, cos, sin)
