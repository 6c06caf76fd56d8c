"""ZeCO's All-Scan: the state entering each context-parallel rank's slice of the sequence.

Each CP rank p holds a contiguous slice and has run its local GLA pass from a zero state,
giving S_loc(p) [B,H,K,V] (fp32, or fp64 for fp64 inputs) and the slice's total decay
gamma(p) = exp(sum of g over the slice) [B,H,K]. The state entering slice p is the
exclusive scan over ranks

    S_in(0) = h0 (or 0),    S_in(p+1) = S_out(p) = S_loc(p) + gamma(p) * S_in(p)

(gamma scales the K rows of the state). All-Scan splits the state along K into `blocks`
blocks; for each block rank p waits for the block of S_in from p-1 and at once sends its
block of S_out to p+1, so blocks pipeline down the chain: each rank sends one state in
total whatever P, and latency ~ tau(state) + (P-1) tau(state)/blocks. Each send is batched
with the receive of the next block, so that on NCCL (one ordered queue per communicator)
block i leaves before block i+1 is awaited: a pipeline, not a ring.

Backward is the same chain run in reverse over the state gradient:

    dS_out(P-1) = 0,    dS_out(p-1) = dS_in(p) = dS_corr(p) + gamma(p) * dS_out(p)

with dS_corr(p) the gradient reaching S_in(p) from the output correction of slice p.

Gated DeltaNet (gdn.py) has S_out = M(p) S_in + U(p), M [B,H,K,K] dense: M mixes the K rows, so
there the blocks are cut along V, and the backward applies M^T. The chain sees only the
transition (transition.py: Decay for GLA, Dense for GDN).

`auto_blocks` picks the block count that minimises the chain's time on the group's links
(chain.py, shared with the simulator). The LASP-1 ring (ring.py) is the same chain without pipelining; LASP-2
(lasp2.py) gathers every state instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import comm
from ..topology import Group
from .chain import best_blocks, link_hops
from .p2p import SCAN_BWD_TAG, SCAN_FWD_TAG, exchange


def auto_blocks(state_bytes: int, cp: Group, device: torch.device, extent: int) -> int:
    """Blocks of the All-Scan pipeline for a state of `state_bytes` over `cp`: the divisor of `extent` (the
    state's dimension the blocks cut: K for GLA, V for GDN) that minimises the chain's time on the group's hops
    (chain.py: (P - 2 + n) (alpha + bytes / (n beta)) over one link, with the device's link facts: the
    calibrated emulated preset on CPU, stated NVLink/InfiniBand figures on GPUs). 1 at P <= 2."""
    return best_blocks(link_hops(cp, device.type), state_bytes, extent)


def pipelined_chain(
    local: Tensor, apply, dim: int, cp: Group, step: int, phase: str, blocks: int, head: Tensor | None = None
) -> Tensor:
    """x_in from rank p - step (`head`, or zeros, at the chain's start); local + apply(x_in) goes to
    p + step, block by block along `dim` of the state. local [B,H,K,V]; apply(x, span) maps the
    blocks `span` of x_in (a transition's apply or apply_transposed); returns x_in [B,H,K,V]."""
    src, dst = cp.rank - step, cp.rank + step
    has_src, has_dst = 0 <= src < cp.size, 0 <= dst < cp.size
    tag = SCAN_FWD_TAG if step > 0 else SCAN_BWD_TAG  # block i: tag + i
    if blocks == 1:  # one message: the caller's layout, without the block-major copies
        return _whole_chain(local, apply, cp, (src, dst), tag, phase, head)
    # block-major layout: every block is one contiguous buffer
    loc = local.movedim(dim, 0)
    x_in = torch.zeros(loc.shape, dtype=local.dtype, device=local.device)
    if head is not None and not has_src:
        x_in.copy_(head.movedim(dim, 0))
    n = loc.shape[0]
    edges = [n * i // blocks for i in range(blocks + 1)]
    spans = [(a, b) for a, b in zip(edges, edges[1:]) if b > a]
    if has_src:  # block 0 alone; then each step sends block i with the receive of block i+1
        exchange([comm.Recv(x_in[spans[0][0] : spans[0][1]], src, tag)], cp, phase)
    for i, (a, b) in enumerate(spans):
        ops = []
        if has_dst:
            passed = apply(x_in[a:b].movedim(0, dim), slice(a, b)).movedim(dim, 0)
            ops.append(comm.Send((loc[a:b] + passed).contiguous(), dst, tag + i))
        if has_src and i + 1 < len(spans):
            c, d = spans[i + 1]
            ops.append(comm.Recv(x_in[c:d], src, tag + i + 1))
        exchange(ops, cp, phase)
    return x_in.movedim(0, dim).contiguous()  # the caller's layout, as the ring's: one copy of one state


def _whole_chain(local: Tensor, apply, cp: Group, peers: tuple[int, int], tag: int, phase: str, head) -> Tensor:
    """pipelined_chain in one block: receive the whole x_in from `src`, send local + apply(x_in) to `dst`."""
    src, dst = peers
    x_in = torch.zeros_like(local)
    if 0 <= src < cp.size:
        exchange([comm.Recv(x_in, src, tag)], cp, phase)
    elif head is not None:
        x_in.copy_(head)
    if 0 <= dst < cp.size:
        exchange([comm.Send((local + apply(x_in)).contiguous(), dst, tag)], cp, phase)
    return x_in


class AllScan:
    """The state scan by ZeCO's All-Scan, blocks cut along the transition's free dimension;
    `backward` reuses the forward's transition."""

    name = "allscan"

    def __init__(self, cp: Group, blocks: int):
        if blocks < 1:
            raise ValueError(f"all-scan blocks must be >= 1 (got {blocks})")
        self.cp, self.blocks = cp, blocks

    def forward(self, S_loc: Tensor, transition, head: Tensor | None) -> Tensor:
        self.transition = transition
        return pipelined_chain(
            S_loc, transition.apply, transition.dim, self.cp, +1, "cp_allscan_fwd", self.blocks, head
        )

    def backward(self, dS_corr: Tensor) -> Tensor:
        t = self.transition
        return pipelined_chain(dS_corr, t.apply_transposed, t.dim, self.cp, -1, "cp_allscan_bwd", self.blocks)
