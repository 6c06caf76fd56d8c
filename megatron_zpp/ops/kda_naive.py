"""The Kimi Delta Attention token loop, written from the paper (Kimi Linear, arXiv 2510.26692, eq. 1): the
reference the chunked form and the kernels are tested against, in any dtype (fp64 for the tests), autograd
through it. KDA is Gated DeltaNet with a per-channel decay a_t in (0, 1]^K instead of one scalar per head:

    S_t = (I - b_t k_t k_t^T) Diag(a_t) S_{t-1} + b_t k_t v_t^T        o_t = scale * S_t^T q_t

a_t = exp(g_t), g_t [K] <= 0 (-inf allowed: a hard reset of that channel; -inf on every channel resets the
state, a packed document's first token). Also the dense transition of a span, the map the context-parallel
scans carry: S_out = M S_in + U with M = prod_t (I - b_t k_t k_t^T) Diag(a_t) [K, K].
"""

from __future__ import annotations

import torch
from torch import Tensor

from .chunking import check_shapes, compute_dtype

__all__ = ["naive_recurrent_kda", "naive_kda_transition"]


def _step(S: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """One token on S [B, H, K, D]: Diag(a) first, then S - b k (k^T S) + b k v^T, never forming the K x K
    transition (a -inf gate multiplies its rows by exactly 0). v [B, H, D] (zeros: the homogeneous part)."""
    S = g.exp()[..., None] * S
    v_new = beta[..., None] * (v - torch.einsum("bhk,bhkv->bhv", k, S))  # b (v - S^T k)
    return S + k[..., None] * v_new[..., None, :]


def naive_recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Token-by-token reference, fla's signature (`fla.ops.kda.naive_recurrent_kda`, one value head per key
    head): q, k [B,T,H,K], v [B,T,H,V], g [B,T,H,K] (log decay per channel), beta [B,T,H], scale (None:
    K**-0.5), initial_state [B,H,K,V] or None. Returns (o [B,T,H,V] in v's dtype, final state [B,H,K,V] in the
    compute dtype, or None). Computes in fp32, fp64 when any input is fp64."""
    check_shapes(q, k, v, initial_state, True, g=g)
    check_shapes(q, k, v, None, False, beta=beta)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dt = compute_dtype(q, k, v, g, beta, initial_state)
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)
    outs = []
    for t in range(T):
        S = _step(S, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S) * scale)
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, V, dtype=dt)
    return o.to(v.dtype), (S if output_final_state else None)


def naive_kda_transition(k: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """M [B, H, K, K] = prod_t (I - b_t k_t k_t^T) Diag(a_t), the last token's factor leftmost: the dense map a
    span applies to the state entering it (S_out = M S_in + the span's own state from zero). Token by token on
    the identity, in the compute dtype."""
    check_shapes(k, k, k, None, True, g=g)
    check_shapes(k, k, k, None, False, beta=beta)
    B, T, H, K = k.shape
    dt = compute_dtype(k, g, beta)
    k, g, beta = (x.to(dt) for x in (k, g, beta))
    M = torch.eye(K, dtype=dt, device=k.device).expand(B, H, K, K).clone()
    zero = k.new_zeros(B, H, K)
    for t in range(T):
        M = _step(M, k[:, t], k[:, t], zero, g[:, t], beta[:, t])
    return M
