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
from ..ops.moe_permute import KernelGather, KernelUnpermute, inverse_map


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
        return KernelGather.apply(x, token, perm.inv), perm
    return _Gather.apply(x, token, slot, topk), perm


def unpermute(y: torch.Tensor, perm: Permutation, dtype: torch.dtype) -> torch.Tensor:
    """y [M, H] -> [N, H] in `dtype`: sum over each token's experts of prob * expert output, in fp32."""
    if perm.inv is not None:
        return KernelUnpermute.apply(y, perm.probs, perm.token_index, perm.inv, dtype)
    weighted = y.float() * perm.probs.unsqueeze(-1)
    return _slot_sum(weighted, perm.token_index, perm.slot, perm.num_tokens, perm.topk).to(dtype)
