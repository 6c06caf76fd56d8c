"""LASP-1 baseline: the state scan over CP ranks as a serial ring of whole-state messages.

Same math as All-Scan (all_scan.py): S_in(p+1) = S_loc(p) + T(p) S_in(p), backward
dS_in(p) = dS_corr(p) + T(p)^T dS_out(p) sent to p-1 (T: transition.py). Rank p blocks until the whole
S_in has arrived from p-1, then sends the whole S_out to p+1 and waits for it to leave, so
the chain's latency is P * tau(state) (no pipelining); each rank still sends one state.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import comm
from ..topology import Group


def ring_chain(local: Tensor, apply, cp: Group, step: int, phase: str, head: Tensor | None = None) -> Tensor:
    src, dst = cp.rank - step, cp.rank + step
    x_in = torch.zeros(local.shape, dtype=local.dtype, device=local.device)
    if 0 <= src < cp.size:
        comm.recv(x_in, src, cp).wait()
    elif head is not None:
        x_in.copy_(head)
    if 0 <= dst < cp.size:
        comm.send((local + apply(x_in)).contiguous(), dst, cp, phase).wait()
    return x_in


class RingScan:
    name = "ring"

    def __init__(self, cp: Group):
        self.cp = cp

    def forward(self, S_loc: Tensor, transition, head: Tensor | None) -> Tensor:
        self.transition = transition
        return ring_chain(S_loc, transition.apply, self.cp, +1, "cp_ring_fwd", head)

    def backward(self, dS_corr: Tensor) -> Tensor:
        return ring_chain(dS_corr, self.transition.apply_transposed, self.cp, -1, "cp_ring_bwd")
