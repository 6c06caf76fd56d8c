"""Gated DeltaNet (the gated delta rule; Yang, Kautz, Hatamizadeh, arXiv 2412.06464) in PyTorch, with Triton
kernels (megatron_zpp/kernels/gdn.py) on CUDA.

Recurrence, per batch b and head h (state S is K x V, kept in fp32):

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T        o_t = scale * S_t^T q_t

with a_t = exp(g_t), g_t <= 0 the per-head log decay (-inf allowed: a hard reset, a packed document's first
token) and b_t = beta_t in (0, 1). The layer L2-normalises q and k; this op does not. Shapes as fla's:
q, k [B, T, H, K]; v [B, T, H, V]; g, beta [B, T, H]; states [B, H, K, V]; o [B, T, H, V] in v's dtype (or
out_dtype). Work is in fp32 (fp64 when any input is fp64; bf16 is computed in fp32).

    naive_recurrent_gdn   the token loop (ops/gdn_naive.py; any dtype; the tests' fp64 reference)
    chunk_gdn             chunked WY/UT form with its own backward (ops/gdn_chunked.py describes it); the
                          Triton kernels on CUDA when they take the call (`chunk_gdn_uses_kernels`); any T
                          (identity tokens pad the last chunk)

Context parallelism (context_parallel/delta_rule.py): `gdn_affine` (the slice's affine map of its entering state) and
`gdn_vjp` (the backward at that state); ops/delta_rule.py, written once for GDN and KDA, states the map, the
identity the tests check them against, and the column groups of a V wider than the kernels' KERNEL_V = 128.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import dispatch, gdn_chunked
from .delta_rule import KERNEL_V, DeltaRuleOp

__all__ = ["chunk_gdn", "chunk_gdn_uses_kernels", "ChunkGDNFunction", "gdn_affine", "gdn_vjp", "KERNEL_V"]

dispatch.register("gdn", "chunk fwd/bwd, fp32/bf16, chunk 16-64 (power of 2), K <= 128, V in groups of 128")

OP = DeltaRuleOp("gdn", gdn_chunked, per_channel_gate=False)
ChunkGDNFunction = OP.function
chunk_gdn_uses_kernels = OP.uses_kernels
gdn_affine = OP.affine  # context parallelism's passes (ops/delta_rule.py)
gdn_vjp = OP.vjp


def chunk_gdn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Chunked GDN (same result as `gdn_naive.naive_recurrent_gdn`), any T: a T that is not a multiple of chunk_size
    is padded at the end with identity tokens (k = 0, beta = 0, g = 0: S_t = S_{t-1}), whose outputs are dropped, so
    the final state and every gradient are those of the T tokens.

    Returns (o [B,T,H,V] in v's dtype or out_dtype, final state [B,H,K,V] fp32/fp64 or None). Gradients reach
    q, k, v, g, beta and initial_state. out_dtype fp32 for bf16 inputs keeps the fp32 output as computed.
    """
    return OP(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size, out_dtype)
