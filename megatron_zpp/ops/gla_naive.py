"""The GLA token loop (fla's `ops/gla/naive.py`): the reference the chunked forms and the kernels are tested
against, in any dtype (fp64 for the tests), autograd through it.

    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t        o_t = scale * q_t S_t
"""

from __future__ import annotations

import torch

from .chunking import check_shapes, compute_dtype

__all__ = ["naive_recurrent_gla"]


def naive_recurrent_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False):
    """Token-by-token reference, fla's signature: q, k, g [B,T,H,K], v [B,T,H,V], scale (None: K**-0.5),
    initial_state [B,H,K,V] or None. Returns (o [B,T,H,V], final state [B,H,K,V] or None)."""
    check_shapes(q, k, v, initial_state, True, g=g)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dt = compute_dtype(q, k, v, g, initial_state)
    v_dtype = v.dtype
    q, k, v, g = (x.to(dt) for x in (q, k, v, g))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)
    outs = []
    for t in range(T):
        S = g[:, t].exp()[..., None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S) * scale)
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, V)
    return o.to(v_dtype), (S if output_final_state else None)
