"""LASP-2 baseline: the state scan over CP ranks by one all-gather of every rank's state.

Forward: all-gather (S_loc(j), log_gamma(j)) of every rank j (packed into one buffer), then
each rank scans locally over the ranks before it:

    S_in(p) = sum_{j<p} (prod_{j<i<p} gamma(i)) S_loc(j)

Backward: all-gather every rank's dS_corr(j) (the gradient reaching S_in(j)) and scan the
ranks after p:  dS_out(p) = dS_in(p+1),  dS_in(j) = dS_corr(j) + gamma(j) dS_out(j).
Then dS_loc(p) = dS_out(p) and d log_gamma(p) = sum_V dS_out(p) gamma(p) S_in(p).

Volume per rank (ring all-gather model): forward (P-1) * (state + gamma) bytes, backward
(P-1) states, growing with P, against one state each way for All-Scan. Latency is one
collective, not a chain.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import comm
from ..topology import Group


def _gather(x: Tensor, cp: Group, phase: str) -> Tensor:
    """[*] on each rank -> [P, *] in group-rank order."""
    x = x.contiguous()
    out = x.new_empty((cp.size,) + tuple(x.shape))
    comm.all_gather(out.view(-1), x.view(-1), cp, phase)
    return out


class GatherScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, S_loc: Tensor, log_gamma: Tensor, cp: Group) -> Tensor:
        n = S_loc.numel()
        packed = _gather(torch.cat([S_loc.reshape(-1), log_gamma.reshape(-1)]), cp, "cp_lasp2_fwd")
        S_all = packed[:, :n].view((cp.size,) + tuple(S_loc.shape))
        gamma_all = packed[:, n:].view((cp.size,) + tuple(log_gamma.shape)).exp()
        S_in = torch.zeros_like(S_loc)
        for j in range(cp.rank):
            S_in = S_all[j] + gamma_all[j][..., None] * S_in
        ctx.save_for_backward(gamma_all, S_in)
        ctx.cp = cp
        return S_in

    @staticmethod
    def backward(ctx, dS_corr: Tensor):
        gamma_all, S_in = ctx.saved_tensors
        cp = ctx.cp
        dS_corr_all = _gather(dS_corr, cp, "cp_lasp2_bwd")
        dS_out = torch.zeros_like(S_in)
        for j in range(cp.size - 1, cp.rank, -1):  # ends with dS_in(p+1) = dS_out(p)
            dS_out = dS_corr_all[j] + gamma_all[j][..., None] * dS_out
        gamma = gamma_all[cp.rank]
        return dS_out, (dS_out * S_in).sum(-1) * gamma, None


def lasp2_scan(S_loc: Tensor, log_gamma: Tensor, cp: Group) -> Tensor:
    """State entering this rank's slice by the LASP-2 all-gather. S_loc [B,H,K,V], log_gamma [B,H,K]."""
    return GatherScan.apply(S_loc, log_gamma, cp)
