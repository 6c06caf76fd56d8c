"""LASP-1 baseline: the state scan over CP ranks as a serial ring of whole-state messages.

Same math as All-Scan (all_scan.py): S_in(p+1) = S_loc(p) + gamma(p) * S_in(p), backward
dS_in(p) = dS_corr(p) + gamma(p) * dS_out(p) sent to p-1. Rank p blocks until the whole
S_in has arrived from p-1, then sends the whole S_out to p+1 and waits for it to leave, so
the chain's latency is P * tau(state) (no pipelining); each rank still sends one state.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import comm
from ..topology import Group
from .all_scan import ChainScan


def ring_chain(local: Tensor, gamma: Tensor, cp: Group, step: int, phase: str) -> Tensor:
    src, dst = cp.rank - step, cp.rank + step
    x_in = torch.zeros(local.shape, dtype=local.dtype, device=local.device)
    if 0 <= src < cp.size:
        comm.recv(x_in, src, cp).wait()
    if 0 <= dst < cp.size:
        comm.send((local + gamma[..., None] * x_in).contiguous(), dst, cp, phase).wait()
    return x_in


def ring_scan(S_loc: Tensor, log_gamma: Tensor, cp: Group) -> Tensor:
    """State entering this rank's slice by the LASP-1 ring. S_loc [B,H,K,V], log_gamma [B,H,K]."""
    return ChainScan.apply(S_loc, log_gamma, cp, ring_chain, "ring")
