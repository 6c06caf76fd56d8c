"""The chunked Gated DeltaNet computation on [B, H, N, C, D] blocks (N chunks of C tokens; g and beta
[B, H, N, C]), pure tensor code in the compute dtype (fp32, fp64 for fp64 inputs), no autograd inside:
the WY/UT forward and its hand-written backward. ops/gdn.py builds the autograd Function on them and
dispatches to the Triton kernels (kernels/gdn*.py), which follow the same decomposition.

Per chunk, with G_i = sum_{s<=i} g_s (from the chunk's start), seg[i, j] = sum_{j<s<=i} g_s and
suf_j = sum_{j<s<C} g_s (the decay from token j to the chunk's end):

    L     = strict_lower(beta_i (k_i . k_j) exp(seg[i, j]))      T = (I + L)^-1 (forward substitution)
    W     = T (beta exp(G) k)        U = T (beta v)              [C, K], [C, V]
    v_new = U - W S_in                                            (the delta-rule corrected values)
    o     = scale (q exp(G)) S_in + scale (lower(q k^T exp(seg))) v_new
    S_out = exp(G_{C-1}) S_in + (k exp(suf))^T v_new

Numerics as in the GLA op: no exponent is a difference of two cumulative sums. seg is a cumsum of g masked
to s > j (Mamba-2's segsum), suf an exclusive reverse cumsum, so every exponent is a sum of g <= 0 and a
-inf gate (a packed document's first token) gives exp = 0: the state resets exactly, outputs and
gradients stay finite and the gradient of g is exactly 0 there.

Backward (all chunks at once except the reverse state scan `bwd_states`): with dS_out the gradient reaching
the state leaving a chunk, dv_new = scale lower(q k^T exp(seg))^T do + (k exp(suf)) dS_out and
dS_in = exp(G_{C-1}) dS_out + scale (q exp(G))^T do - W^T dv_new; `bwd_chunks` then takes the rest through
T, W and U. The gradient of g gathers the gradients of the exponents: of G_i (q's and W's factors and the
chunk total), of suf_j and of seg[i, j], and sums each over the tokens its exponent spans.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .chunking import unit_lower_inverse


class Decays:
    """The exponents of one chunking of g [..., C] (every one a sum of g <= 0) and their exps."""

    def __init__(self, g: Tensor):
        C = g.shape[-1]
        idx = torch.arange(C, device=g.device)
        self.strict = idx[:, None] > idx[None, :]  # [i, j]: j < i
        self.lower = idx[:, None] >= idx[None, :]
        # seg[i, j] = sum_{j<s<=i} g_s: column j holds g_s for s > j, a cumsum down the rows
        seg = torch.where(self.strict, g[..., :, None], 0.0).cumsum(-2)
        self.pair = torch.where(self.lower, seg.exp(), 0.0)  # exp(seg), 0 above the diagonal
        self.start = g.cumsum(-1).exp()  # exp(G_i)
        suf = torch.zeros_like(g)
        suf[..., :-1] = g.flip(-1).cumsum(-1)[..., :-1].flip(-1)  # sum_{s>j}: a shifted reverse cumsum
        self.end = suf.exp()  # exp(suf_j)
        self.total = self.start[..., -1]  # exp(G_{C-1})


def prepare(k: Tensor, v: Tensor, beta: Tensor, dec: Decays) -> tuple[Tensor, Tensor, Tensor]:
    """(T [.., C, C], W [.., C, K], U [.., C, V]) of every chunk."""
    L = beta[..., :, None] * (k @ k.transpose(-1, -2)) * torch.where(dec.strict, dec.pair, 0.0)
    T = unit_lower_inverse(L)
    W = T @ (beta[..., None] * dec.start[..., None] * k)
    U = T @ (beta[..., None] * v)
    return T, W, U


def fwd_states(
    k: Tensor, W: Tensor, U: Tensor, dec: Decays, initial_state: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """The scan over chunks: (states_in [B,H,N,K,V], v_new [B,H,N,C,V], final_state [B,H,K,V])."""
    B, H, N, C, K = k.shape
    S = k.new_zeros(B, H, K, U.shape[-1]) if initial_state is None else initial_state
    k_end = (k * dec.end[..., None]).transpose(-1, -2)
    states, v_new = [], []
    for n in range(N):
        states.append(S)
        v_new.append(U[:, :, n] - W[:, :, n] @ S)
        S = dec.total[:, :, n, None, None] * S + k_end[:, :, n] @ v_new[-1]
    return torch.stack(states, 2), torch.stack(v_new, 2), S


def scores(q: Tensor, k: Tensor, dec: Decays) -> Tensor:
    """The intra-chunk scores lower(q k^T exp(seg)) [.., C, C]."""
    return (q @ k.transpose(-1, -2)) * dec.pair


def fwd_output(q: Tensor, k: Tensor, v_new: Tensor, states_in: Tensor, dec: Decays, scale: float) -> Tensor:
    """o [B, H, N, C, V] = scale (q exp(G)) S_in + scale scores v_new."""
    return scale * ((q * dec.start[..., None]) @ states_in + scores(q, k, dec) @ v_new)


def entering_factors(q: Tensor, k: Tensor, dec: Decays) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """What the state entering a chunk does there (context parallelism's transition pass, ops/delta_rule.py):
    (q exp(G) [.., C, K], the scores [.., C, C], k exp(suf) [.., C, K], the chunk's decay exp(G_{C-1}) as the
    rows' scale [.., 1]): o = scale (q exp(G) - scores W) S_in + ..., S_out = (exp(G_{C-1}) - (k exp(suf))^T W) S_in
    + ...; a scalar per chunk (KDA's is one per key row)."""
    return q * dec.start[..., None], scores(q, k, dec), k * dec.end[..., None], dec.total[..., None]


def bwd_states(
    q: Tensor,
    k: Tensor,
    W: Tensor,
    dec: Decays,
    do: Tensor,
    d_final_state: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Reverse scan: (d_ends [B,H,N,K,V] (the gradient of each chunk's leaving state), dv_new, d_initial_state)."""
    B, H, N, C, K = k.shape
    dS = do.new_zeros(B, H, K, do.shape[-1]) if d_final_state is None else d_final_state
    A_t = scores(q, k, dec).transpose(-1, -2) * scale
    q_start_t = (q * dec.start[..., None]).transpose(-1, -2) * scale
    k_end = k * dec.end[..., None]
    ends, dv_new = [None] * N, [None] * N
    for n in reversed(range(N)):
        ends[n] = dS
        dv_new[n] = A_t[:, :, n] @ do[:, :, n] + k_end[:, :, n] @ dS
        dS = dec.total[:, :, n, None, None] * dS + q_start_t[:, :, n] @ do[:, :, n]
        dS = dS - W[:, :, n].transpose(-1, -2) @ dv_new[n]
    return torch.stack(ends, 2), torch.stack(dv_new, 2), dS


def _gate_grad(dG: Tensor, dsuf: Tensor, dseg: Tensor) -> Tensor:
    """dg_s = sum_{i>=s} dG_i + sum_{j<s} dsuf_j + sum_{i>=s, j<s} dseg[i, j], per chunk."""
    C = dG.shape[-1]
    idx = torch.arange(C, device=dG.device)
    before = (idx[:, None] < idx[None, :]).to(dG.dtype)  # [j, s]: j < s
    from_s = idx[:, None] >= idx[None, :]  # [i, s]: i >= s
    seg_part = torch.where(from_s, dseg @ before, 0.0).sum(-2)
    return dG.flip(-1).cumsum(-1).flip(-1) + dsuf @ before + seg_part


def bwd_chunks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    dec: Decays,
    T: Tensor,
    W: Tensor,
    v_new: Tensor,
    states_in: Tensor,
    d_ends: Tensor,
    do: Tensor,
    dv_new: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dg, dbeta) of every chunk, given the scans' v_new, states, d_ends and dv_new."""
    tr = lambda x: x.transpose(-1, -2)  # noqa: E731
    start, end = dec.start[..., None], dec.end[..., None]
    k_w = beta[..., None] * start * k  # W = T k_w
    v_u = beta[..., None] * v  # U = T v_u
    # the output's two terms
    dq_state = scale * (do @ tr(states_in)) * start
    dA = scale * (do @ tr(v_new)) * dec.pair  # d(q k^T) through the scores
    dq = dq_state + dA @ k
    dk = tr(dA) @ q
    # the leaving state's term (k exp(suf))^T v_new
    dk_end = v_new @ tr(d_ends)
    dk = dk + dk_end * end
    # v_new = U - W S_in, W = T k_w, U = T v_u, T = (I + L)^-1
    dW = -dv_new @ tr(states_in)
    dT = dv_new @ tr(v_u) + dW @ tr(k_w)
    dk_w, dv_u = tr(T) @ dW, tr(T) @ dv_new
    dL = -(tr(T) @ dT @ tr(T)) * dec.strict
    # L = beta_i (k k^T) exp(seg), strictly lower
    kk_decay = (k @ tr(k)) * dec.pair * dec.strict
    dkk = dL * beta[..., :, None] * dec.pair
    dk = dk + dkk @ k + tr(dkk) @ k + beta[..., None] * start * dk_w
    dv = beta[..., None] * dv_u
    dbeta = (dL * kk_decay).sum(-1) + (dv_u * v).sum(-1) + (dk_w * start * k).sum(-1)
    # the exponents' gradients: G_i (q's and W's factors, the chunk total), suf_j, seg[i, j]
    dG = (dq_state * q).sum(-1) + (dk_w * k_w).sum(-1)
    dG[..., -1] += (d_ends * states_in).sum((-1, -2)) * dec.total
    dsuf = (dk_end * end * k).sum(-1)
    dseg = dA * (q @ tr(k)) * dec.strict + dL * beta[..., :, None] * kk_decay
    return dq, dk, dv, _gate_grad(dG, dsuf, dseg), dbeta
