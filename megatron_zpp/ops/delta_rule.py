"""What the delta-rule ops (Gated DeltaNet: ops/gdn.py; Kimi Delta Attention: ops/kda.py) share around their
Triton kernels: which calls the kernels take, and the kernel launches as custom ops with their fakes. The two
families differ only in the decay's shape: a scalar per head (GDN, g [B, T, H]) or one per key channel (KDA,
g [B, T, H, K]), so their gate gradient has that shape too."""

from __future__ import annotations

import importlib

import torch
from torch import Tensor

from . import dispatch

KERNEL_V = 128  # the kernels' widest V: the ops run a wider V in column groups of this width


def use_kernel(chunk_size: int, q: Tensor, v: Tensor, *others: Tensor | None) -> bool:
    """Whether the Triton kernels take this call; else the chunked PyTorch reference."""
    if not dispatch.use_triton(v):
        return False
    tensors = [t for t in (q, v, *others) if t is not None]
    C, K, V = chunk_size, q.shape[-1], v.shape[-1]
    return (
        all(t.dtype in (torch.float32, torch.bfloat16) for t in tensors)
        and 16 <= C <= 64
        and C & (C - 1) == 0
        and q.shape[1] > 0
        and K <= 128
        and V <= KERNEL_V
    )


def kernel_ops(family: str, per_channel_gate: bool):
    """(forward, backward) of megatron_zpp/kernels/<family>.py as the custom ops <family>_fwd / <family>_bwd."""

    def kernels():  # lazily: triton is needed only once a kernel runs
        return importlib.import_module(f"megatron_zpp.kernels.{family}")

    def fwd(
        q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None, scale: float,
        chunk_size: int,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        return kernels().fwd(q, k, v, g, beta, initial_state, scale, chunk_size)

    def bwd(
        q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None, do: Tensor | None,
        d_final_state: Tensor | None, scale: float, chunk_size: int,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
        return kernels().bwd(q, k, v, g, beta, initial_state, do, d_final_state, scale, chunk_size)

    fwd_op, bwd_op = dispatch.kernel_op(f"{family}_fwd")(fwd), dispatch.kernel_op(f"{family}_bwd")(bwd)

    @fwd_op.register_fake
    def _(q, k, v, g, beta, initial_state, scale, chunk_size):
        B, T, H, K = q.shape
        return dispatch.fake_fp32(q, B, T, H, v.shape[-1]), dispatch.fake_fp32(q, B, H, K, v.shape[-1])

    @bwd_op.register_fake
    def _(q, k, v, g, beta, initial_state, do, d_final_state, scale, chunk_size):
        B, T, H, K = q.shape
        V, dg = v.shape[-1], (B, T, H, K) if per_channel_gate else (B, T, H)
        shapes = ((B, T, H, K), (B, T, H, K), (B, T, H, V), dg, (B, T, H), (B, H, K, V))  # dq dk dv dg db dh0
        return tuple(dispatch.fake_fp32(q, *shape) for shape in shapes)

    return fwd_op, bwd_op
