"""qgZ: gradient reduce-scatter as a hierarchy of all-to-alls, optionally quantized.

A flat reduce-scatter over DP ranks spread on several nodes sends most of its bytes
across nodes. ZeRO++'s qgZ instead reduces hop by hop, innermost (fastest link) first:
each hop is one all-to-all inside a small group followed by a local sum, so the data a
rank sends shrinks by the hop's group size before it reaches the slower link. With
`bits` set, each hop quantizes what it sends once (int4 or int8, block-wise), so a
k-level hierarchy quantizes exactly k times whatever the world size, and every sum runs
in fp32 on dequantized values.

Slice order: rank p of the DP group owns chunk p of the result (as in reduce-scatter).
Write p in mixed radix over the hop sizes r_0, r_1, ...: p = d0 + r0*d1 + r0*r1*d2 + ...
with d_i = this rank's index in its hop-i group. Viewing the flat gradient as
[r_k, ..., r_1, r_0, C], hop i moves the axis of digit i to the front, so slice j of the
send buffer holds exactly the chunks whose digit i is j and goes to hop member j. For
two levels (D ranks per node) this is the ZeRO++ paper's reordering "slice p goes to
position (p % D) * nodes + p // D", generalised to any number of tiers and any hop
sizes (odd node counts included).

The result is the SUM over all DP ranks, not the mean: the caller divides by the DP
size exactly once (DeepSpeed's qgZ shipped results scaled by D by dividing per hop).
"""

from __future__ import annotations

import math

import torch

from .. import comm
from ..topology import Group
from .quantize import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8

_CODECS = {4: (quantize_int4, dequantize_int4), 8: (quantize_int8, dequantize_int8)}


def padded_numel(n: int, dp: int, block: int) -> int:
    """Smallest multiple of dp*block >= n: the flat gradient size qgZ accepts."""
    unit = dp * block
    return -(-n // unit) * unit


def _exchange(
    send: torch.Tensor, group: Group, phase: str, bits: int | None, block: int, wire_dtype: torch.dtype
) -> torch.Tensor:
    """All-to-all of send [r, ...] over `group` (slice j -> member j); returns the received
    [r, ...] (slice j from member j) in fp32. Quantized: data and scales as two all-to-alls."""
    if group.size == 1:
        return send.float()  # nothing moves, so nothing is quantized
    if bits is None:
        data = send.to(wire_dtype).contiguous()
        out = torch.empty_like(data)
        comm.all_to_all(out, data, group, phase)
        return out.float()
    quantize, dequantize = _CODECS[bits]
    # block-wise over the flattened buffer: each slice is a whole number of blocks
    q, scales = quantize(send.reshape(-1), block)
    q_out, s_out = torch.empty_like(q), torch.empty_like(scales)
    handles = [
        comm.all_to_all(q_out, q, group, phase, async_op=True),
        comm.all_to_all(s_out, scales, group, phase, async_op=True),
    ]
    for h in handles:
        h.wait()
    return dequantize(q_out, s_out, block, torch.float32).view(send.shape)


def hierarchical_reduce_scatter(
    flat: torch.Tensor, hops: list[Group], phase: str, bits: int | None, block: int
) -> torch.Tensor:
    """Reduce-scatter `flat` over the DP ranks spanned by `hops`, hop by hop.

    flat: [N] full local gradient (any float dtype), N a multiple of dp*block where
        dp = prod(h.size for h in hops) (use padded_numel).
    hops: this rank's group per hop, innermost first (e.g. [intra-node, inter-node]);
        group-rank index in hops[i] = DP digit d_i (see the module docstring), as
        Topology.dp_tier_groups builds them.
    bits: None (send flat.dtype as is), 8 or 4 (quantize once per hop).
    Returns [N/dp] in flat.dtype: chunk p (p = this rank's DP index) of the SUM over
    all DP ranks (not divided by dp). With bits=None this equals a flat reduce-scatter
    (exactly on integer-valued inputs, to round-off otherwise).
    """
    if bits not in (None, 4, 8):
        raise ValueError(f"bits must be None, 4 or 8, got {bits}")
    radices = [g.size for g in hops]
    dp = math.prod(radices)
    if flat.dim() != 1 or flat.numel() % (dp * block):
        raise ValueError(
            f"flat gradient of shape {tuple(flat.shape)} must be 1-D with numel a multiple of "
            f"dp*block = {dp}*{block}; pad it to padded_numel({flat.numel()}, {dp}, {block}) = "
            f"{padded_numel(flat.numel(), dp, block)} elements"
        )
    chunk = flat.numel() // dp
    cur = flat.view(*reversed(radices), chunk)  # [r_k, ..., r_1, r_0, C]
    for group in hops:
        send = cur.movedim(-2, 0).contiguous()  # [r_i, r_k, ..., r_{i+1}, C]
        recv = _exchange(send, group, phase, bits, block, flat.dtype)
        cur = recv.sum(dim=0)  # fp32: [r_k, ..., r_{i+1}, C]
    return cur.reshape(chunk).to(flat.dtype)
