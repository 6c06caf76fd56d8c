"""The chunked Kimi Delta Attention computation on [B, H, N, C, D] blocks (N chunks of C tokens; g [B, H, N, C, K],
beta [B, H, N, C]), pure tensor code in the compute dtype (fp32, fp64 for fp64 inputs), no autograd inside: the
WY/UT forward and its hand-written backward. ops/kda.py builds the autograd Function on them and dispatches to the
Triton kernels (kernels/kda*.py), which follow the same decomposition.

KDA is Gated DeltaNet's chunk form with every decay a vector over the K channels. Per chunk, with
G_i = sum_{s<=i} g_s [K] (from the chunk's start), seg[i, j] = sum_{j<s<=i} g_s [K] and suf_j = sum_{j<s<C} g_s:

    L     = strict_lower(beta_i sum_d k_id k_jd exp(seg[i, j, d]))     T = (I + L)^-1 (forward substitution)
    W     = T (beta exp(G) * k)        U = T (beta v)                  [C, K], [C, V]
    v_new = U - W S_in                                                  (the delta-rule corrected values)
    A     = lower(sum_d q_id k_jd exp(seg[i, j, d]))                    the intra-chunk scores
    o     = scale (q * exp(G)) S_in + scale A v_new
    S_out = Diag(exp(G_{C-1})) S_in + (k * exp(suf))^T v_new

since within a chunk S_i = Diag(exp(G_i)) S_in + sum_{j<=i} Diag(exp(seg[i, j])) k_j v_new_j^T (fla's chunk_kda
has the same decomposition; its kernels take the pair decays as a difference of two cumulative sums).

Numerics: no exponent is a difference of two cumulative sums. seg is a cumsum of g masked to s > j (Mamba-2's
segsum, per channel: the pair decays are [C, C, K] per chunk, K times GDN's), suf an exclusive reverse cumsum, so
every exponent is a sum of g <= 0 and a -inf gate gives exp = 0 on its channel: a reset on every channel (a packed
document's first token) clears the state exactly, outputs and gradients stay finite and g's gradient is 0 there.

Backward (all chunks at once except the reverse state scan `bwd_states`): with dS_out the gradient reaching the
state leaving a chunk, dv_new = scale A^T do + (k * exp(suf)) dS_out and
dS_in = Diag(exp(G_{C-1})) dS_out + scale (q * exp(G))^T do - W^T dv_new; `bwd_chunks` takes the rest through
T, W, U and the scores. g's gradient gathers, channel by channel, the gradients of the exponents G_i, suf_j and
seg[i, j] and sums each over the tokens its exponent spans.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .chunking import unit_lower_inverse


class Decays:
    """The exponents of one chunking of g [..., C, K] (every one a sum of g <= 0, per channel) and their exps."""

    def __init__(self, g: Tensor):
        C = g.shape[-2]
        idx = torch.arange(C, device=g.device)
        self.strict = idx[:, None] > idx[None, :]  # [i, j]: j < i
        self.lower = idx[:, None] >= idx[None, :]
        # seg[i, j, d] = sum_{j<s<=i} g_sd: column j holds g_s for s > j, a cumsum down the rows
        seg = torch.where(self.strict[..., None], g[..., :, None, :], 0.0).cumsum(-3)
        self.pair = torch.where(self.lower[..., None], seg.exp(), 0.0)  # [..., C, C, K], 0 above the diagonal
        self.start = g.cumsum(-2).exp()  # exp(G_i) [..., C, K]
        suf = torch.zeros_like(g)
        suf[..., :-1, :] = g.flip(-2).cumsum(-2)[..., :-1, :].flip(-2)  # sum_{s>j}: a shifted reverse cumsum
        self.end = suf.exp()  # exp(suf_j) [..., C, K]
        self.total = self.start[..., -1, :]  # exp(G_{C-1}) [..., K]


def pair_dot(x: Tensor, y: Tensor, dec: Decays) -> Tensor:
    """[..., C, C]: sum_d x_id y_jd exp(seg[i, j, d]) for j <= i, else 0 (scores with q, L's kernel with k)."""
    return torch.einsum("...id,...ijd,...jd->...ij", x, dec.pair, y)


def prepare(k: Tensor, v: Tensor, beta: Tensor, dec: Decays) -> tuple[Tensor, Tensor, Tensor]:
    """(T [.., C, C], W [.., C, K], U [.., C, V]) of every chunk."""
    L = beta[..., :, None] * torch.where(dec.strict, pair_dot(k, k, dec), 0.0)
    T = unit_lower_inverse(L)
    W = T @ (beta[..., None] * dec.start * k)
    U = T @ (beta[..., None] * v)
    return T, W, U


def fwd_states(
    k: Tensor, W: Tensor, U: Tensor, dec: Decays, initial_state: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """The scan over chunks: (states_in [B,H,N,K,V], v_new [B,H,N,C,V], final_state [B,H,K,V])."""
    B, H, N, C, K = k.shape
    S = k.new_zeros(B, H, K, U.shape[-1]) if initial_state is None else initial_state
    k_end = (k * dec.end).transpose(-1, -2)
    states, v_new = [], []
    for n in range(N):
        states.append(S)
        v_new.append(U[:, :, n] - W[:, :, n] @ S)
        S = dec.total[:, :, n, :, None] * S + k_end[:, :, n] @ v_new[-1]
    return torch.stack(states, 2), torch.stack(v_new, 2), S


def fwd_output(q: Tensor, k: Tensor, v_new: Tensor, states_in: Tensor, dec: Decays, scale: float) -> Tensor:
    """o [B, H, N, C, V] = scale (q exp(G)) S_in + scale A v_new."""
    return scale * ((q * dec.start) @ states_in + pair_dot(q, k, dec) @ v_new)


def entering_factors(q: Tensor, k: Tensor, dec: Decays) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """What the state entering a chunk does there (context parallelism's transition pass, ops/delta_rule.py):
    (q * exp(G) [.., C, K], the scores A [.., C, C], k * exp(suf) [.., C, K], the chunk's decay exp(G_{C-1})
    [.., K]): o = scale (q * exp(G) - A W) S_in + ..., S_out = (Diag(exp(G_{C-1})) - (k * exp(suf))^T W) S_in + ..."""
    return q * dec.start, pair_dot(q, k, dec), k * dec.end, dec.total


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
    A_t = pair_dot(q, k, dec).transpose(-1, -2) * scale
    q_start_t = (q * dec.start).transpose(-1, -2) * scale
    k_end = k * dec.end
    ends, dv_new = [None] * N, [None] * N
    for n in reversed(range(N)):
        ends[n] = dS
        dv_new[n] = A_t[:, :, n] @ do[:, :, n] + k_end[:, :, n] @ dS
        dS = dec.total[:, :, n, :, None] * dS + q_start_t[:, :, n] @ do[:, :, n]
        dS = dS - W[:, :, n].transpose(-1, -2) @ dv_new[n]
    return torch.stack(ends, 2), torch.stack(dv_new, 2), dS


def gate_grad(dG: Tensor, dsuf: Tensor, dseg: Tensor) -> Tensor:
    """dg_s = sum_{i>=s} dG_i + sum_{j<s} dsuf_j + sum_{i>=s, j<s} dseg[i, j], per chunk and channel: dG, dsuf
    [..., C, K], dseg [..., C, C, K]. Inclusive sums only, no "inclusive minus own term"."""
    C = dG.shape[-2]
    idx = torch.arange(C, device=dG.device)
    before = (idx[:, None] < idx[None, :]).to(dG.dtype)  # [j, s]: j < s
    from_s = dseg.flip(-3).cumsum(-3).flip(-3)  # [s, j, d]: sum_{i>=s} dseg[i, j, d]
    seg_part = torch.where((idx[:, None] > idx[None, :])[..., None], from_s, 0.0).sum(-2)
    return dG.flip(-2).cumsum(-2).flip(-2) + before.transpose(0, 1) @ dsuf + seg_part


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
    pair_t = lambda x, y: torch.einsum("...ij,...id,...ijd->...jd", x, y, dec.pair)  # noqa: E731
    pair_mm = lambda x, y: torch.einsum("...ij,...jd,...ijd->...id", x, y, dec.pair)  # noqa: E731
    start, end = dec.start, dec.end
    k_w = beta[..., None] * start * k  # W = T k_w
    v_u = beta[..., None] * v  # U = T v_u
    # the output's two terms
    dq_state = scale * (do @ tr(states_in)) * start
    dA = torch.where(dec.lower, scale * (do @ tr(v_new)), 0.0)  # through the scores
    dq = dq_state + pair_mm(dA, k)
    dk = pair_t(dA, q)
    # the leaving state's term (k exp(suf))^T v_new
    dk_end = v_new @ tr(d_ends)
    dk = dk + dk_end * end
    # v_new = U - W S_in, W = T k_w, U = T v_u, T = (I + L)^-1
    dW = -dv_new @ tr(states_in)
    dT = dv_new @ tr(v_u) + dW @ tr(k_w)
    dk_w, dv_u = tr(T) @ dW, tr(T) @ dv_new
    dL = -(tr(T) @ dT @ tr(T)) * dec.strict
    # L = beta_i sum_d k_id k_jd exp(seg[i, j, d]), strictly lower
    kk_decay = torch.where(dec.strict, pair_dot(k, k, dec), 0.0)
    dkk = dL * beta[..., :, None]
    dk = dk + pair_mm(dkk, k) + pair_t(dkk, k) + beta[..., None] * start * dk_w
    dv = beta[..., None] * dv_u
    dbeta = (dL * kk_decay).sum(-1) + (dv_u * v).sum(-1) + (dk_w * start * k).sum(-1)
    # the exponents' gradients per channel: G_i (q's and W's factors, the chunk total), suf_j, seg[i, j]
    dG = dq_state * q + dk_w * k_w
    dG[..., -1, :] += (d_ends * states_in).sum(-1) * dec.total
    dsuf = dk_end * end * k
    rows = dA[..., None] * q[..., :, None, :] + dkk[..., None] * k[..., :, None, :]  # [i, j, d]
    dseg = torch.where(dec.strict[..., None], rows * k[..., None, :, :] * dec.pair, 0.0)
    return dq, dk, dv, gate_grad(dG, dsuf, dseg), dbeta
