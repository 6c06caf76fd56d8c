"""Context (sequence) parallelism: each CP rank holds a contiguous slice of the sequence.

Gated linear attention (ZeCO, arXiv 2507.01004): a slice's output is its local pass from a
zero state plus the correction of the state entering it,

    o = o_loc + scale * (q * exp(B_t)) @ S_in(p),    B_t = sum of g from the slice start to t

and S_in(p) is the exclusive scan over ranks of (S_loc, gamma), done by one of

    "all-scan"    ZeCO's pipelined chain (all_scan.py): one state sent per rank, any P
    "all-gather"  LASP-2 (lasp2.py): every rank gathers all states: (P-1) states per rank
    "ring"        LASP-1 (ring.py): serial chain of whole states, latency P * tau(state)

Softmax attention under CP (attention.py) all-gathers K and V.
"""

from __future__ import annotations

from torch import Tensor

from ..ops.gla import chunk_gla, chunk_gla_local, gla_state_correction
from ..topology import Group
from .all_scan import all_scan
from .attention import attention_context_parallel
from .lasp2 import lasp2_scan
from .ring import ring_scan

__all__ = ["gla_context_parallel", "attention_context_parallel", "ALGOS"]

ALGOS = ("all-scan", "all-gather", "ring")


def gla_context_parallel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    cp: Group,
    algo: str = "all-scan",
    blocks: int = 1,
    scale: float | None = None,
    chunk_size: int = 16,
    initial_state: Tensor | None = None,
) -> Tensor:
    """GLA over a sequence split in contiguous slices over the CP group (rank order).

    q, k, g: [B, T_local, H, K]; v: [B, T_local, H, V]; T_local a multiple of chunk_size.
    Returns o [B, T_local, H, V] (v's dtype): this rank's slice of chunk_gla over the whole
    sequence. `initial_state` [B,H,K,V] is the state entering rank 0's slice; only rank 0
    reads it (and only there does it get a gradient). `blocks` is used by all-scan only.
    Gradients of q, k, v, g (and initial_state) are exact: the scans are autograd Functions.
    """
    if algo not in ALGOS:
        raise ValueError(f"unknown CP algorithm {algo!r}; choose one of {ALGOS}")
    if cp is None or cp.size == 1:
        return chunk_gla(q, k, v, g, scale, initial_state, chunk_size=chunk_size)[0]
    # Local pass first: it needs no incoming state, so it costs no wait on the chain.
    o_loc, S_loc, log_gamma = chunk_gla_local(q, k, v, g, scale, chunk_size)
    h0 = initial_state if cp.rank == 0 else None
    if h0 is not None:  # the state leaving rank 0 includes the decayed initial state
        S_loc = S_loc + log_gamma.exp()[..., None] * h0.to(S_loc.dtype)
    if algo == "all-scan":
        S_in = all_scan(S_loc, log_gamma, cp, blocks)
    elif algo == "all-gather":
        S_in = lasp2_scan(S_loc, log_gamma, cp)
    else:
        S_in = ring_scan(S_loc, log_gamma, cp)
    if h0 is not None:  # S_in is zero on rank 0; adding keeps the scan in the graph there
        S_in = S_in + h0.to(S_in.dtype)
    return o_loc + gla_state_correction(q, g, S_in, scale).to(o_loc.dtype)
