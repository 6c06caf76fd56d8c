"""The local half of token dispatch (megatron-core's moe_utils order): tokens gathered expert-major so each
expert's tokens are contiguous (in token order inside an expert), the experts run, and the results are
weighted by their routing probabilities and summed back into token order.

Capacity dropping (megatron-core's `apply_router_token_dropping`, drop policy "probs"): each expert keeps
at most capacity = ceil(tokens * topk / E * capacity_factor) tokens, the highest-probability ones (ties to
the lower token index); with `pad_to_capacity` every expert takes exactly `capacity` rows (the padding rows
carry probability 0, so they add nothing). Under a capacity factor large enough that capacity > tokens,
nothing is dropped.

No host sync where the routed row count is known: `num_out` = tokens x topk without dropping, experts x
capacity with padding (megatron-core's argsort permute); after dropping without padding it is counted.

The unpermute is deterministic: each token's (at most topk) weighted expert outputs are written to
distinct slots of a [tokens, topk + 1, H] buffer and summed over the first topk slots in expert order (no
atomics). A row of probability 0 (a padding row; a routed row whose product is 0 anyway) goes to the last,
discarded slot: padding never widens the buffer, and a non-finite padding row cannot reach a token. The
permutation's backward (a token's gradient is the sum over its copies) runs the same way, in fp32, instead
of index_select's backward (index_add, atomic adds in no fixed order on a GPU).

With the Triton kernels (kernels/moe_permute.py, on CUDA or under the interpreter) the gather and the slot sum
are one kernel each, over the inverse map `inv` [N, topk] (each token's rows in slot order): the same sums in
the same order, forward and backward."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..ops import dispatch

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


def capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """megatron-core's get_capacity over the routed token copies (tokens x topk)."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def drop_tokens(
    probs: torch.Tensor, routing_map: torch.Tensor, topk: int, capacity_factor: float, pad_to_capacity: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, routing_map) [N, E] with each expert's tokens past its capacity dropped (or padded up to it)."""
    num_tokens, num_experts = probs.shape
    cap = capacity(num_tokens, num_experts, topk, capacity_factor)
    if cap > num_tokens:
        keep = torch.ones_like(routing_map)
    else:
        order = torch.sort(probs, dim=0, descending=True, stable=True)[1][:cap]
        keep = torch.zeros_like(routing_map).scatter_(0, order, True)
    new_map = keep if pad_to_capacity else routing_map & keep
    return probs * new_map, new_map


@dataclass
class Permutation:
    """Where each row of the permuted tokens came from."""

    token_index: torch.Tensor  # [M] int64: the source token of each permuted row
    slot: torch.Tensor  # [M] int64: its place among its token's nonzero experts (0 = the lowest index; topk: none)
    probs: torch.Tensor  # [M] fp32: its routing probability
    tokens_per_expert: torch.Tensor  # [E] int64
    num_tokens: int
    topk: int
    inv: torch.Tensor | None = None  # [N, topk] each token's rows in slot order (-1: none): the kernels' path


def _slot_sum(rows: torch.Tensor, token: torch.Tensor, slot: torch.Tensor, num_tokens: int, topk: int):
    """sum over each token's rows (fp32, in slot order) of `rows` [M, H] -> [N, H] fp32."""
    buffer = rows.new_zeros(num_tokens, topk + 1, rows.shape[-1], dtype=torch.float32)
    return buffer.index_put((token, slot), rows.float())[:, :topk].sum(dim=1)


def inverse_map(token: torch.Tensor, slot: torch.Tensor, num_tokens: int, topk: int) -> torch.Tensor:
    """[N, topk] int64: the permuted row of each token's slot, -1 where none (the kernels' view of a Permutation)."""
    inv = torch.full((num_tokens, topk + 1), -1, dtype=torch.int64, device=token.device)
    inv[token, slot] = torch.arange(token.shape[0], device=token.device)
    return inv[:, :topk].contiguous()


class _KernelGather(torch.autograd.Function):
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


class _KernelUnpermute(torch.autograd.Function):
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


class _Gather(torch.autograd.Function):
    """x.index_select(0, token) with a deterministic backward (the slot sum)."""

    @staticmethod
    def forward(ctx, x, token, slot, topk):
        ctx.save_for_backward(token, slot)
        ctx.topk, ctx.num_tokens = topk, x.shape[0]
        return x.index_select(0, token)

    @staticmethod
    def backward(ctx, dy):
        token, slot = ctx.saved_tensors
        return _slot_sum(dy, token, slot, ctx.num_tokens, ctx.topk).to(dy.dtype), None, None, None


def permute(
    x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, topk: int, num_out: int | None = None
) -> tuple[torch.Tensor, Permutation]:
    """x [N, H], probs/routing_map [N, E] -> (the tokens expert-major [M, H], how to undo it). `num_out`: the
    number of routed rows when known (see above), else counted (a host sync)."""
    num_tokens = routing_map.shape[0]
    num_out = int(routing_map.sum()) if num_out is None else num_out
    flat = routing_map.T.reshape(-1).argsort(descending=True, stable=True)[:num_out]  # expert-major, tokens in order
    expert, token = flat // num_tokens, flat % num_tokens
    weighted = routing_map & (probs != 0)
    slot = torch.where(weighted, weighted.cumsum(dim=1) - 1, topk)[token, expert]
    perm = Permutation(token, slot, probs[token, expert], routing_map.sum(dim=0), num_tokens, topk)
    if dispatch.use_triton(x):
        perm.inv = inverse_map(token, slot, num_tokens, topk)
        return _KernelGather.apply(x, token, perm.inv), perm
    return _Gather.apply(x, token, slot, topk), perm


def unpermute(y: torch.Tensor, perm: Permutation, dtype: torch.dtype) -> torch.Tensor:
    """y [M, H] -> [N, H] in `dtype`: sum over each token's experts of prob * expert output, in fp32."""
    if perm.inv is not None:
        return _KernelUnpermute.apply(y, perm.probs, perm.token_index, perm.inv, dtype)
    weighted = y.float() * perm.probs.unsqueeze(-1)
    return _slot_sum(weighted, perm.token_index, perm.slot, perm.num_tokens, perm.topk).to(dtype)
