"""Kimi Delta Attention (Kimi Linear, arXiv 2510.26692): the gated delta rule with a per-channel decay, in
PyTorch, with Triton kernels (megatron_zpp/kernels/kda.py) on CUDA.

Recurrence, per batch b and head h (state S is K x V, kept in fp32):

    S_t = (I - b_t k_t k_t^T) Diag(a_t) S_{t-1} + b_t k_t v_t^T        o_t = scale * S_t^T q_t

with a_t = exp(g_t), g_t [K] <= 0 the per-channel log decay (-inf allowed; -inf on every channel is a hard
reset, a packed document's first token) and b_t = beta_t in (0, 1). The layer L2-normalises q and k; this op
does not. Shapes as fla's `chunk_kda` (one value head per key head): q, k [B, T, H, K]; v [B, T, H, V];
g [B, T, H, K]; beta [B, T, H]; states [B, H, K, V]; o [B, T, H, V] in v's dtype (or out_dtype). Work is in fp32
(fp64 when any input is fp64; bf16 is computed in fp32).

    naive_recurrent_kda   the token loop (ops/kda_naive.py; any dtype; the tests' fp64 reference)
    chunk_kda             chunked WY/UT form with its own backward (ops/kda_chunked.py describes it); the
                          Triton kernels on CUDA when they take the call (`chunk_kda_uses_kernels`)

Context parallelism (context_parallel/delta_rule.py): `kda_affine` (the slice's affine map of its entering state) and
`kda_vjp` (the backward at that state); ops/delta_rule.py, written once for GDN and KDA, states the map, the
identity the tests check them against, and the column groups of a V wider than the kernels' KERNEL_V = 128.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import dispatch, kda_chunked
from .delta_rule import KERNEL_V, DeltaRuleOp

__all__ = ["chunk_kda", "chunk_kda_uses_kernels", "ChunkKDAFunction", "kda_affine", "kda_vjp", "KERNEL_V"]

dispatch.register("kda", "chunk fwd/bwd, fp32/bf16, chunk 16-64 (power of 2), K <= 128, V in groups of 128")

OP = DeltaRuleOp("kda", kda_chunked, per_channel_gate=True)
ChunkKDAFunction = OP.function
chunk_kda_uses_kernels = OP.uses_kernels
kda_affine = OP.affine  # context parallelism's passes (ops/delta_rule.py)
kda_vjp = OP.vjp


def chunk_kda(
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
    """Chunked KDA (same result as `kda_naive.naive_recurrent_kda`), any T: a T that is not a multiple of chunk_size
    is padded with identity tokens (ops/delta_rule.padded_to_chunk).

    Returns (o [B,T,H,V] in v's dtype or out_dtype, final state [B,H,K,V] fp32/fp64 or None). Gradients reach
    q, k, v, g, beta and initial_state. out_dtype fp32 for bf16 inputs keeps the fp32 output as computed.
    """
    return OP(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size, out_dtype)
