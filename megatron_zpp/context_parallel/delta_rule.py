"""Gated DeltaNet and Kimi Delta Attention under context parallelism: All-Scan over an affine state map.

Rank p's slice acts on the state entering it affinely (ops/gdn.py, ops/kda.py):

    S_out = M S_in + U,      o_t = o_loc,t + r_t^T S_in,      r_t = scale * P_t^T q_t

with P_t the product of the slice's transitions a_s (I - b_s k_s k_s^T) (KDA: (I - b_s k_s k_s^T) Diag(a_s))
up to token t, M = P_T [B,H,K,K] and (o_loc, U) the slice's pass from a zero state. `local_affine` gets all
four from the plain local pass and a transition pass over K x K matrices built on its WY form
(ops/delta_rule.py; `op` names the family: chunk_gdn or chunk_kda). The state entering each slice is the
scan over ranks S_in(p+1) = M(p) S_in(p) + U(p), done by one of

    "all-scan"    ZeCO's pipelined chain (all_scan.py), blocks cut along V (M mixes the K rows):
                  one state [B,H,K,V] sent per rank each way, whatever P
    "all-gather"  fla's KCP / LASP-2 style (lasp2.py): every rank gathers every (U, M): (P-1) x
                  H x K x (V+K) per rank, growing with P
    "ring"        LASP-1 (ring.py): the chain with whole states, latency P * tau(state)

Backward: the gradient reaching S_in from this slice's outputs, dS_corr = sum_t r_t do_t^T, goes
through the reverse scan dS_in(p) = dS_corr(p) + M(p)^T dS_out(p); then one backward of the plain op at
the entering state S_in with the cotangents (do, dS_out) gives q, k, v, g, beta their gradients (the
slice's outputs and leaving state are exactly the op's from S_in) and rank 0's head its own.

The forward scan needs (U, M) only: it starts in a background thread as soon as they are known and runs
while (o_loc, r) are computed; the reverse scan runs while that backward recomputes the states at S_in
(the chunked PyTorch forms; a kernel launch returns everything at once).

The short convolution before the operator reads kernel-1 tokens of the previous slice: halo.py.

KDA (ops/kda.py) is the same algebra with a per-channel decay, the transition (I - b k k^T) Diag(a_t): M is
dense [K, K] again and everything above holds with chunk_kda as the local operator (`op`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import recompute
from ..ops.delta_rule import padded_to_chunk
from ..ops.gdn import chunk_gdn, gdn_affine, gdn_vjp
from ..ops.kda import chunk_kda, kda_affine, kda_vjp
from ..topology import Group
from .scans import Known, check_algo, make_scan, overlapped
from .transition import Dense

# the op a layer names -> its context-parallel passes (ops/delta_rule.py): (o_loc, r, U, M) and the backward
PASSES = {chunk_gdn: (gdn_affine, gdn_vjp), chunk_kda: (kda_affine, kda_vjp)}


def local_affine(
    q, k, v, g, beta, scale: float, chunk_size: int, op=chunk_gdn, on_state=None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(o_loc [B,T,H,V], r [B,T,H,K], U [B,H,K,V], M [B,H,K,K]) of this slice, in the state's dtype (fp32, or fp64
    for fp64 inputs), no autograd: `op`'s plain local pass and its transition pass (ops/delta_rule.py);
    on_state(U, M) as soon as the two are known, before (o_loc, r)."""
    return PASSES[op][0](q, k, v, g, beta, scale, chunk_size, on_state)


class ScannedDeltaRule(torch.autograd.Function):
    """apply(q, k, v, g, beta, head, scan, scale, chunk_size, op) -> o [B,T,H,V] in the state's dtype: the local
    affine pass, S_in by `scan` (the scan over the CP ranks of S_out = M S_in + U; head: the state entering rank
    0's slice, None elsewhere or for zeros), and o = o_loc + r S_in. The scan starts, in a background thread, as
    soon as (U, M) are known and runs while (o_loc, r) are computed.

    Backward: dS_corr = r^T do first (the gradient reaching S_in from this slice's outputs), then the reverse
    scan dS_out, in the background while the backward of the plain op at S_in recomputes its states, then the
    rest of that backward with (do, dS_out), which gives q..beta their gradients and the head dS_corr + M^T dS_out.
    An activation-recompute rerun gets the state its first run received (recompute.recall): no second scan."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, head, scan, scale, chunk_size, op):
        kept, pending = recompute.recall(), []

        def start(U, M):
            entering = None if head is None else head.to(U.dtype)
            pending.append(Known(kept) if kept is not None else overlapped(scan.forward, U, Dense(M), entering))

        o_loc, r, _, _ = local_affine(q, k, v, g, beta, scale, chunk_size, op, start)
        S_in = recompute.remember(pending[0].result())
        ctx.save_for_backward(q, k, v, g, beta, r, S_in)
        ctx.scan, ctx.scale, ctx.chunk_size, ctx.op = scan, scale, chunk_size, op
        ctx.head_dtype = None if head is None else head.dtype
        return o_loc + torch.einsum("bthk,bhkv->bthv", r, S_in)

    @staticmethod
    def backward(ctx, do):
        q, k, v, g, beta, r, S_in = ctx.saved_tensors
        dS_corr = torch.einsum("bthk,bthv->bhkv", r, do.to(r.dtype))
        pending = overlapped(ctx.scan.backward, dS_corr.contiguous())  # dS_out: zeros on the last rank
        vjp = PASSES[ctx.op][1]
        *grads, dh0 = vjp(q, k, v, g, beta, S_in, do.to(v.dtype), pending.result, ctx.scale, ctx.chunk_size)
        d_head = None if ctx.head_dtype is None else dh0.to(ctx.head_dtype)
        return (*grads, d_head, None, None, None, None)


def delta_rule_context_parallel(
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
    op=chunk_gdn,
) -> Tensor:
    """Gated DeltaNet over a sequence split in contiguous slices over the CP group (rank order); with
    op=chunk_kda Kimi Delta Attention (the same affine map with a per-channel decay, g [B, T_local, H, K]).

    q, k [B, T_local, H, K]; v [B, T_local, H, V]; g, beta [B, T_local, H]; any T_local (chunk_gdn pads each
    slice's last chunk with identity tokens, which leave its (U, M) and outputs unchanged). Returns this rank's
    slice of chunk_gdn over the whole sequence, o [B, T_local, H, V] in v's dtype or out_dtype. `initial_state`
    [B,H,K,V] enters rank 0's slice (only rank 0 reads it). `blocks`: all-scan's block count along V (0:
    auto_blocks). Gradients are exact."""
    check_algo(algo)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if cp is None or cp.size == 1:
        return op(q, k, v, g, beta, scale, initial_state, chunk_size=chunk_size, out_dtype=out_dtype)[0]
    B, _, H, K = q.shape
    V = v.shape[-1]
    scan = make_scan(algo, cp, blocks, B * H * K * V * 4, q.device, V)
    head = initial_state if initial_state is not None and cp.rank == 0 else None
    return scanned_delta_rule(q, k, v, g, beta, scan, head, scale, chunk_size, out_dtype, op)


def scanned_delta_rule(
    q, k, v, g, beta, scan, head: Tensor | None, scale: float, chunk_size: int, out_dtype=None, op=chunk_gdn
) -> Tensor:
    """This slice's output (`op`: chunk_gdn or chunk_kda) with S_in from `scan` (any object with the scans' forward
    and backward): ScannedDeltaRule, rounded once to v's dtype or out_dtype; any slice length (identity tokens pad
    it to the chunk: ops/delta_rule.padded_to_chunk)."""

    def scanned(*inputs):
        return (ScannedDeltaRule.apply(*inputs, head, scan, scale, chunk_size, op),)

    (o,) = padded_to_chunk(scanned, chunk_size, q, k, v, g, beta)
    return o.to(v.dtype if out_dtype is None else out_dtype)
