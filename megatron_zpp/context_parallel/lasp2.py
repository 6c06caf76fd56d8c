"""LASP-2 baseline: the state scan over CP ranks by one all-gather of every rank's state.

Forward: all-gather (S_loc(j), T(j)) of every rank j (packed into one buffer; rank 0's
state already includes its initial state's share), then each rank scans locally over the
ranks before it:

    S_in(p) = S_loc(p-1) + T(p-1) S_in(p-1)     (S_in(0) = h0 or 0)

Backward: all-gather every rank's dS_corr(j) (the gradient reaching S_in(j)) and scan the
ranks after p:  dS_out(p) = dS_in(p+1),  dS_in(j) = dS_corr(j) + T(j)^T dS_out(j).

T is GLA's decay gamma [B,H,K] or Gated DeltaNet's M [B,H,K,K] (transition.py; fla's KCP
gathers the same (M, U) pairs). Volume per rank (ring all-gather model): forward (P-1) *
(state + T) bytes, backward (P-1) states, growing with P, against one state each way for
All-Scan. Latency is one collective, not a chain.
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


class GatherScan:
    name = "lasp2"

    def __init__(self, cp: Group):
        self.cp = cp

    def forward(self, S_loc: Tensor, transition, head: Tensor | None) -> Tensor:
        cp, n = self.cp, S_loc.numel()
        if head is not None and cp.rank == 0:  # what rank 0 passes on includes its initial state's share
            S_loc = S_loc + transition.apply(head)
        packed = _gather(torch.cat([S_loc.reshape(-1), transition.packed().reshape(-1)]), cp, "cp_lasp2_fwd")
        S_all = packed[:, :n].view((cp.size,) + tuple(S_loc.shape))
        self.transitions = [type(transition).unpacked(packed[j, n:], S_loc) for j in range(cp.size)]
        S_in = head.clone() if head is not None and cp.rank == 0 else torch.zeros_like(S_loc)
        for j in range(cp.rank):
            S_in = S_all[j] + self.transitions[j].apply(S_in)
        return S_in

    def backward(self, dS_corr: Tensor) -> Tensor:
        cp = self.cp
        dS_corr_all = _gather(dS_corr, cp, "cp_lasp2_bwd")
        dS_out = torch.zeros_like(dS_corr)
        for j in range(cp.size - 1, cp.rank, -1):  # ends with dS_in(p+1) = dS_out(p)
            dS_out = dS_corr_all[j] + self.transitions[j].apply_transposed(dS_out)
        return dS_out
