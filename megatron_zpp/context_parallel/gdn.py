"""Gated DeltaNet under context parallelism: All-Scan over an affine state map.

Rank p's slice acts on the state entering it affinely (ops/gdn.py):

    S_out = M S_in + U,      o_t = o_loc,t + r_t^T S_in,      r_t = scale * P_t^T q_t

with P_t the product of the slice's transitions a_s (I - b_s k_s k_s^T) up to token t, M = P_T
[B,H,K,K] and (o_loc, U) the slice's pass from a zero state. All four come from the local chunked
operator run on [v, 0_K] from the initial state [0, I_K] (`local_affine`). The state entering
each slice is the scan over ranks S_in(p+1) = M(p) S_in(p) + U(p), done by one of

    "all-scan"    ZeCO's pipelined chain (all_scan.py), blocks cut along V (M mixes the K rows):
                  one state [B,H,K,V] sent per rank each way, whatever P
    "all-gather"  fla's KCP / LASP-2 style (lasp2.py): every rank gathers every (U, M): (P-1) x
                  H x K x (V+K) per rank, growing with P
    "ring"        LASP-1 (ring.py): the chain with whole states, latency P * tau(state)

Backward: the gradient reaching S_in from this slice's outputs, dS_corr = sum_t r_t do_t^T, goes
through the reverse scan dS_in(p) = dS_corr(p) + M(p)^T dS_out(p); this rank's (U, M) get dU =
dS_out and dM = dS_out S_in^T, and the local operator's backward carries them on to q, k, v, g, b.

The scan waits for the local operator (M and U come out of the same pass as o_loc), so its
latency is not hidden behind local work as GLA's is (gla.py).

The short convolution before the operator reads kernel-1 tokens of the previous slice: halo.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import recompute
from ..ops.gdn import chunk_gdn
from ..topology import Group
from .scans import check_algo, make_scan
from .transition import Dense


def local_affine(q, k, v, g, beta, scale: float, chunk_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(o_loc [B,T,H,V], r [B,T,H,K], U [B,H,K,V], M [B,H,K,K]) of this slice, in the state's dtype
    (fp32, or fp64 for fp64 inputs): one chunk_gdn call on [v, 0_K] from [0, I_K] (it runs the V + K
    columns in the kernels' widths itself)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = torch.promote_types(torch.promote_types(q.dtype, v.dtype), torch.float32)
    eye = torch.eye(K, dtype=dt, device=q.device).expand(B, H, K, K)
    wide = torch.cat([v, v.new_zeros(B, T, H, K)], dim=-1)
    h0 = torch.cat([eye.new_zeros(B, H, K, V), eye], dim=-1)
    o, S = chunk_gdn(q, k, wide, g, beta, scale, h0, True, chunk_size, out_dtype=dt)
    return o[..., :V], o[..., V:], S[..., :V], S[..., V:]


class EnteringState(torch.autograd.Function):
    """apply(U, M, head, scan) -> S_in [B,H,K,V]: the scan over the CP ranks of S_out = M S_in + U.

    head: the state entering rank 0's slice (None elsewhere, or for zeros). An activation-recompute
    rerun gets the state its first run received (recompute.recall): no second scan."""

    @staticmethod
    def forward(ctx, U, M, head, scan):
        kept = recompute.recall()
        S_in = kept if kept is not None else recompute.remember(scan.forward(U, Dense(M), head))
        ctx.save_for_backward(M, S_in)
        ctx.scan, ctx.has_head = scan, head is not None
        return S_in

    @staticmethod
    def backward(ctx, dS_corr):
        M, S_in = ctx.saved_tensors
        dS_out = ctx.scan.backward(dS_corr.contiguous())  # zeros on the last rank
        dM = torch.einsum("bhiv,bhjv->bhij", dS_out, S_in)
        d_head = dS_corr + Dense(M).apply_transposed(dS_out) if ctx.has_head else None
        return dS_out, dM, d_head, None


def gdn_context_parallel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    cp: Group | None,
    algo: str = "all-scan",
    blocks: int = 0,
    scale: float | None = None,
    chunk_size: int = 64,
    initial_state: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """Gated DeltaNet over a sequence split in contiguous slices over the CP group (rank order).

    q, k [B, T_local, H, K]; v [B, T_local, H, V]; g, beta [B, T_local, H]; any T_local (chunk_gdn pads each
    slice's last chunk with identity tokens, which leave its (U, M) and outputs unchanged). Returns this rank's
    slice of chunk_gdn over the whole sequence, o [B, T_local, H, V] in v's dtype or out_dtype. `initial_state`
    [B,H,K,V] enters rank 0's slice (only rank 0 reads it). `blocks`: all-scan's block count along V (0:
    auto_blocks). Gradients are exact."""
    check_algo(algo)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if cp is None or cp.size == 1:
        return chunk_gdn(q, k, v, g, beta, scale, initial_state, chunk_size=chunk_size, out_dtype=out_dtype)[0]
    B, _, H, K = q.shape
    V = v.shape[-1]
    scan = make_scan(algo, cp, blocks, B * H * K * V * 4, q.device, V)
    head = initial_state if initial_state is not None and cp.rank == 0 else None
    return scanned_gdn(q, k, v, g, beta, scan, head, scale, chunk_size, out_dtype)


def scanned_gdn(q, k, v, g, beta, scan, head: Tensor | None, scale: float, chunk_size: int, out_dtype=None) -> Tensor:
    """This slice's output: the local affine pass, S_in from `scan` (any object with the scans' forward and
    backward), and the correction r^T S_in."""
    o_loc, r, U, M = local_affine(q, k, v, g, beta, scale, chunk_size)
    S_in = EnteringState.apply(U, M, None if head is None else head.to(U.dtype), scan)
    o = o_loc + torch.einsum("bthk,bhkv->bthv", r, S_in)
    return o.to(v.dtype if out_dtype is None else out_dtype)
