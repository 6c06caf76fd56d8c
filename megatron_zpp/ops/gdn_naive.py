"""The Gated DeltaNet token loop (fla's `ops/gated_delta_rule/naive.py`): the reference the chunked form and
the kernels are tested against, in any dtype (fp64 for the tests), autograd through it.

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T        o_t = scale * S_t^T q_t
"""

from __future__ import annotations

import torch

from .chunking import check_shapes, compute_dtype

__all__ = ["naive_recurrent_gdn"]


def naive_recurrent_gdn(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """Token-by-token reference, fla's signature: q, k [B,T,H,K], v [B,T,H,V], g, beta [B,T,H], scale (None:
    K**-0.5), initial_state [B,H,K,V] or None. Returns (o [B,T,H,V] in v's dtype, final state [B,H,K,V] or None).

    The transition is applied as S - b k (k^T S), never forming a_t (I - b k k^T): a -inf gate (a_t = 0)
    multiplies the state by exactly 0, the same reset as the chunked forms."""
    check_shapes(q, k, v, initial_state, False, g=g, beta=beta)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dt = compute_dtype(q, k, v, g, beta, initial_state)
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)
    outs = []
    for t in range(T):
        kt, bt = k[:, t], beta[:, t, :, None]
        S = g[:, t].exp()[..., None, None] * S
        v_new = bt * (v[:, t] - torch.einsum("bhk,bhkv->bhv", kt, S))  # b (v - S^T k)
        S = S + kt[..., None] * v_new[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S) * scale)
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, V, dtype=dt)
    return o.to(v.dtype), (S if output_final_state else None)
