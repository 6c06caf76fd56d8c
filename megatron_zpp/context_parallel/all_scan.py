"""ZeCO's All-Scan: the state entering each context-parallel rank's slice of the sequence.

Each CP rank p holds a contiguous slice and has run its local GLA pass from a zero state,
giving S_loc(p) [B,H,K,V] (fp32, or fp64 for fp64 inputs) and the slice's total log decay
log_gamma(p) [B,H,K]. The state entering slice p is the exclusive scan over ranks

    S_in(0) = 0,    S_in(p+1) = S_out(p) = S_loc(p) + gamma(p) * S_in(p),   gamma = exp(log_gamma)

(gamma scales the K rows of the state). All-Scan splits the state along K into `blocks`
blocks; for each block rank p waits for the block of S_in from p-1 and at once sends its
block of S_out to p+1, so blocks pipeline down the chain: each rank sends one state in
total whatever P, and latency ~ tau(state) + (P-1) tau(state)/blocks.

Backward is the same chain run in reverse over the state gradient:

    dS_out(P-1) = 0,    dS_out(p-1) = dS_in(p) = dS_corr(p) + gamma(p) * dS_out(p)

with dS_corr(p) the gradient reaching S_in(p) from the output correction of slice p. Then
dS_loc(p) = dS_out(p) and d log_gamma(p) = sum_V dS_out(p) * gamma(p) * S_in(p) (the gate
gradient's state term), which autograd carries into the local pass.

`ChainScan` is shared with the LASP-1 ring (ring.py), which differs only in its chain.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .. import comm
from ..topology import Group

# chain(local [B,H,K,V], gamma [B,H,K], cp, step, phase) -> x_in [B,H,K,V]: x_in comes from
# rank p - step (zero at the head of the chain); local + gamma * x_in goes to p + step.
Chain = Callable[[Tensor, Tensor, Group, int, str], Tensor]

FWD_TAG, BWD_TAG = 0, 1 << 12  # block i travels with tag base + i (forward/backward kept apart)


def all_scan_chain(local: Tensor, gamma: Tensor, cp: Group, step: int, phase: str, blocks: int = 1) -> Tensor:
    """One pass of the All-Scan chain, pipelined over `blocks` blocks of K rows."""
    src, dst = cp.rank - step, cp.rank + step
    has_src, has_dst = 0 <= src < cp.size, 0 <= dst < cp.size
    tag = FWD_TAG if step > 0 else BWD_TAG
    # K-major layout [K,B,H,V]: every block of K rows is one contiguous buffer.
    loc, gam = local.movedim(2, 0), gamma.movedim(2, 0)[..., None]
    x_in = torch.zeros(loc.shape, dtype=local.dtype, device=local.device)
    K = loc.shape[0]
    edges = [K * i // blocks for i in range(blocks + 1)]
    spans = [(a, b) for a, b in zip(edges, edges[1:]) if b > a]
    # Post every receive first, one batch per block (NCCL returns one handle per batch).
    recvs = [
        comm.p2p([comm.Recv(x_in[a:b], src, tag + i)], cp, phase) if has_src else [] for i, (a, b) in enumerate(spans)
    ]
    sends = []
    for i, (a, b) in enumerate(spans):
        for work in recvs[i]:
            work.wait()
        if has_dst:  # forward this block at once: the next rank starts while we wait for the rest
            out = (loc[a:b] + gam[a:b] * x_in[a:b]).contiguous()  # K-major like x_in
            sends += comm.p2p([comm.Send(out, dst, tag + i)], cp, phase)
    for work in sends:
        work.wait()
    return x_in.movedim(0, 2)


class ChainScan(torch.autograd.Function):
    """S_in = exclusive scan of (S_loc, gamma) over CP ranks; backward = the reverse chain."""

    @staticmethod
    def forward(ctx, S_loc: Tensor, log_gamma: Tensor, cp: Group, chain: Chain, name: str) -> Tensor:
        gamma = log_gamma.exp()  # log_gamma <= 0: no overflow, strong decays underflow to 0
        S_in = chain(S_loc, gamma, cp, +1, f"cp_{name}_fwd")
        ctx.save_for_backward(gamma, S_in)
        ctx.cp, ctx.chain, ctx.name = cp, chain, name
        return S_in

    @staticmethod
    def backward(ctx, dS_corr: Tensor):
        gamma, S_in = ctx.saved_tensors
        dS_out = ctx.chain(dS_corr, gamma, ctx.cp, -1, f"cp_{ctx.name}_bwd")
        d_log_gamma = (dS_out * S_in).sum(-1) * gamma
        return dS_out, d_log_gamma, None, None, None


def all_scan(S_loc: Tensor, log_gamma: Tensor, cp: Group, blocks: int = 1) -> Tensor:
    """State entering this rank's slice by ZeCO's All-Scan. S_loc [B,H,K,V], log_gamma [B,H,K]."""
    if blocks < 1:
        raise ValueError(f"all-scan blocks must be >= 1 (got {blocks})")

    def chain(local, gamma, group, step, phase):
        return all_scan_chain(local, gamma, group, step, phase, blocks)

    return ChainScan.apply(S_loc, log_gamma, cp, chain, "allscan")
