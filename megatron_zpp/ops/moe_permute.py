"""The MoE token permutation's kernel path (moe/permute.py holds the PyTorch reference and picks): the row
gather and the per-token slot sum of kernels/moe_permute.py as custom ops with their fakes, and the autograd
functions that chain them (the permute's backward is a slot sum, the unpermute's a gather)."""

from __future__ import annotations

import torch

from . import dispatch

dispatch.register("moe_permute", "fp32/bf16/fp16 tokens, any width")


def _kernels():
    from ..kernels import moe_permute  # lazily: triton is needed only once a kernel runs

    return moe_permute


@dispatch.kernel_op("moe_gather_rows")
def _gather_rows(x: torch.Tensor, index: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    return _kernels().gather_rows(x, index, scale, dtype)


@_gather_rows.register_fake
def _(x, index, scale, dtype):
    return x.new_empty(index.shape[0], x.shape[1], dtype=dtype)


@dispatch.kernel_op("moe_slot_sum")
def _slot_sum_op(rows: torch.Tensor, inv: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    return _kernels().slot_sum(rows, inv, scale, dtype)


@_slot_sum_op.register_fake
def _(rows, inv, scale, dtype):
    return rows.new_empty(inv.shape[0], rows.shape[1], dtype=dtype)


def inverse_map(token: torch.Tensor, slot: torch.Tensor, num_tokens: int, topk: int) -> torch.Tensor:
    """[N, topk] int64: the permuted row of each token's slot, -1 where none (the kernels' view of a Permutation)."""
    inv = torch.full((num_tokens, topk + 1), -1, dtype=torch.int64, device=token.device)
    inv[token, slot] = torch.arange(token.shape[0], device=token.device)
    return inv[:, :topk].contiguous()


class KernelGather(torch.autograd.Function):
    """x.index_select(0, token) by the gather kernel; the backward is the slot-sum kernel."""

    @staticmethod
    def forward(ctx, x, token, inv):
        ctx.save_for_backward(inv)
        x = x if x.stride(-1) == 1 else x.contiguous()
        return _gather_rows(x, token, None, x.dtype)

    @staticmethod
    def backward(ctx, dy):
        (inv,) = ctx.saved_tensors
        return _slot_sum_op(dy.contiguous(), inv, None, dy.dtype), None, None


class KernelUnpermute(torch.autograd.Function):
    """sum over each token's rows of prob x row, in fp32, by the slot-sum kernel; the backward gathers."""

    @staticmethod
    def forward(ctx, y, probs, token, inv, dtype):
        y = y if y.stride(-1) == 1 else y.contiguous()
        ctx.save_for_backward(y, probs, token)
        return _slot_sum_op(y, inv, probs, dtype)

    @staticmethod
    def backward(ctx, dout):
        y, probs, token = ctx.saved_tensors
        dout = dout.contiguous()
        dy = _gather_rows(dout, token, probs, y.dtype)
        dprobs = (y.float() * _gather_rows(dout, token, None, torch.float32)).sum(dim=-1)
        return dy, dprobs, None, None, None
