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

The pair scores sum_d x_id y_jd exp(seg[i, j, d]) (`pair_dot`) never build the [C, C, K] pair decays. The chunk
is halved recursively: a pair (i, j) sits in opposite halves of exactly one block, whose split m (the left half's
last token) factors its decay, exp(seg[i, j]) = exp(seg[i, m]) exp(seg[m, j]), a row factor per token of the right
half times a column factor per token of the left: every block's pairs are one matmul of [h, K] by [K, h]
(`Halvings`; log2 C levels of C K factors each, where the pair decays are C^2 K). The same factors take the
scores' backward (`pair_dot_vjp`): x's, y's and g's gradients, the last as the gradients of each factor's exponent
summed over the tokens it spans. A C that is not a power of two is padded to one inside (g = 0, x = y = 0 on the
padding, after every real token of the chunk).

Numerics: no exponent is a difference of two cumulative sums. Every exponent (G_i, suf_j, the factors') is a sum
of g <= 0 over a span, so every factor is in [0, 1], their product is the pair decay to rounding, and a -inf gate
gives exp = 0 on its channel: a reset on every channel (a packed document's first token) clears the state
exactly, outputs and gradients stay finite and g's gradient is 0 there.

Backward (all chunks at once except the reverse state scan `bwd_states`): with dS_out the gradient reaching the
state leaving a chunk, dv_new = scale A^T do + (k * exp(suf)) dS_out and
dS_in = Diag(exp(G_{C-1})) dS_out + scale (q * exp(G))^T do - W^T dv_new; `bwd_chunks` takes the rest through
T, W, U and the scores. g's gradient gathers, channel by channel, the gradients of the exponents G_i, suf_j and
the factors' and sums each over the tokens its exponent spans.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .chunking import unit_lower_inverse


def sum_after(g: Tensor) -> Tensor:
    """sum_{s>j} g_s along the token axis (-2): a shifted reverse cumsum, never "inclusive minus own term"."""
    out = torch.zeros_like(g)
    out[..., :-1, :] = g.flip(-2).cumsum(-2)[..., :-1, :].flip(-2)
    return out


def sum_before(x: Tensor) -> Tensor:
    """sum_{j<s} x_j along the token axis (-2): a shifted cumsum."""
    out = torch.zeros_like(x)
    out[..., 1:, :] = x.cumsum(-2)[..., :-1, :]
    return out


class Halvings:
    """The pair decays exp(seg[i, j]) of one chunking of g [..., C, K], factored at the recursive halvings of the
    chunk (padded to a power of two): per level h (blocks of 2h tokens, h = 1, 2, ..., C/2), the right halves'
    row factors exp(sum_{m<s<=i} g_s) and the left halves' column factors exp(sum_{j<s<=m} g_s) [..., C/2h, h, K]."""

    def __init__(self, g: Tensor):
        self.size = g.shape[-2]
        self.padded = 1 << (self.size - 1).bit_length()
        g = self.pad(g)
        self.levels = []
        h = 1
        while h < self.padded:
            left, right = self.halves(g, h)
            self.levels.append((h, right.cumsum(-2).exp(), sum_after(left).exp()))
            h *= 2

    def pad(self, x: Tensor) -> Tensor:
        """[..., C, K] -> [..., C', K] (zeros after the chunk's tokens)."""
        return torch.nn.functional.pad(x, (0, 0, 0, self.padded - self.size)) if self.padded > self.size else x

    def pad2(self, x: Tensor) -> Tensor:
        """[..., C, C] -> [..., C', C']."""
        extra = self.padded - self.size
        return torch.nn.functional.pad(x, (0, extra, 0, extra)) if extra else x

    def crop(self, x: Tensor) -> Tensor:
        return x[..., : self.size, :] if self.padded > self.size else x

    def halves(self, x: Tensor, h: int) -> tuple[Tensor, Tensor]:
        """Views of x [..., C', K]'s left and right halves of its blocks of 2h tokens: [..., C'/2h, h, K] each."""
        blocks = x.unflatten(-2, (self.padded // (2 * h), 2, h))
        return blocks[..., 0, :, :], blocks[..., 1, :, :]

    def block_pairs(self, A: Tensor, h: int) -> Tensor:
        """A view of A [..., C', C']'s pairs at level h, i in a block's right half and j in its left:
        [..., C'/2h, h, h]."""
        nb = self.padded // (2 * h)
        blocks = A.unflatten(-1, (nb, 2, h)).unflatten(-4, (nb, 2, h))  # [.., nb, 2, h, nb, 2, h]
        return torch.diagonal(blocks[..., :, 1, :, :, 0, :], dim1=-4, dim2=-2).movedim(-1, -3)


def pair_dot(x: Tensor, y: Tensor, pairs: Halvings) -> Tensor:
    """[..., C, C]: sum_d x_id y_jd exp(seg[i, j, d]) for j <= i, else 0 (scores with q, L's kernel with k)."""
    x, y = pairs.pad(x), pairs.pad(y)
    A = torch.diag_embed((x * y).sum(-1))  # seg[i, i] = 0
    for h, rows, cols in pairs.levels:
        (_, x_right), (y_left, _) = pairs.halves(x, h), pairs.halves(y, h)
        pairs.block_pairs(A, h).copy_((x_right * rows) @ (y_left * cols).transpose(-1, -2))
    return A[..., : pairs.size, : pairs.size]


def pair_dot_vjp(dA: Tensor, x: Tensor, y: Tensor, pairs: Halvings) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dy, dg) [..., C, K] of sum_{j<=i} dA_ij pair_dot(x, y)_ij (dA above the diagonal is ignored). dg: each
    level's factor exponents' gradients, a row factor's summed over the tokens s <= i of its span, a column
    factor's over the tokens s > j of its."""
    dA, x, y = pairs.pad2(dA), pairs.pad(x), pairs.pad(y)
    diag = torch.diagonal(dA, dim1=-2, dim2=-1)[..., None]
    dx, dy, dg = diag * y, diag * x, torch.zeros_like(x)
    for h, rows, cols in pairs.levels:
        (_, x_right), (y_left, _) = pairs.halves(x, h), pairs.halves(y, h)
        (_, dx_right), (dy_left, _) = pairs.halves(dx, h), pairs.halves(dy, h)
        dg_left, dg_right = pairs.halves(dg, h)
        x_rows, y_cols, dA_h = x_right * rows, y_left * cols, pairs.block_pairs(dA, h)
        d_rows = dA_h @ y_cols  # the gradient of x_right * rows
        d_cols = dA_h.transpose(-1, -2) @ x_rows  # of y_left * cols
        dx_right += d_rows * rows
        dy_left += d_cols * cols
        dg_right += (d_rows * x_rows).flip(-2).cumsum(-2).flip(-2)  # a row factor spans m < s <= i
        dg_left += sum_before(d_cols * y_cols)  # a column factor spans j < s <= m
    return pairs.crop(dx), pairs.crop(dy), pairs.crop(dg)


class Decays:
    """The exponents of one chunking of g [..., C, K] (every one a sum of g <= 0, per channel), their exps and the
    pair decays' factors."""

    def __init__(self, g: Tensor):
        C = g.shape[-2]
        idx = torch.arange(C, device=g.device)
        self.strict = idx[:, None] > idx[None, :]  # [i, j]: j < i
        self.start = g.cumsum(-2).exp()  # exp(G_i) [..., C, K]
        self.end = sum_after(g).exp()  # exp(suf_j) [..., C, K]
        self.total = self.start[..., -1, :]  # exp(G_{C-1}) [..., K]
        self.pairs = Halvings(g)


def prepare(k: Tensor, v: Tensor, beta: Tensor, dec: Decays) -> tuple[Tensor, Tensor, Tensor]:
    """(T [.., C, C], W [.., C, K], U [.., C, V]) of every chunk."""
    L = beta[..., :, None] * torch.where(dec.strict, pair_dot(k, k, dec.pairs), 0.0)
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
    return scale * ((q * dec.start) @ states_in + pair_dot(q, k, dec.pairs) @ v_new)


def entering_factors(q: Tensor, k: Tensor, dec: Decays) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """What the state entering a chunk does there (context parallelism's transition pass, ops/delta_rule.py):
    (q * exp(G) [.., C, K], the scores A [.., C, C], k * exp(suf) [.., C, K], the chunk's decay exp(G_{C-1})
    [.., K]): o = scale (q * exp(G) - A W) S_in + ..., S_out = (Diag(exp(G_{C-1})) - (k * exp(suf))^T W) S_in + ..."""
    return q * dec.start, pair_dot(q, k, dec.pairs), k * dec.end, dec.total


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
    A_t = pair_dot(q, k, dec.pairs).transpose(-1, -2) * scale
    q_start_t = (q * dec.start).transpose(-1, -2) * scale
    k_end = k * dec.end
    ends, dv_new = [None] * N, [None] * N
    for n in reversed(range(N)):
        ends[n] = dS
        dv_new[n] = A_t[:, :, n] @ do[:, :, n] + k_end[:, :, n] @ dS
        dS = dec.total[:, :, n, :, None] * dS + q_start_t[:, :, n] @ do[:, :, n]
        dS = dS - W[:, :, n].transpose(-1, -2) @ dv_new[n]
    return torch.stack(ends, 2), torch.stack(dv_new, 2), dS


def gate_grad(dG: Tensor, dsuf: Tensor) -> Tensor:
    """dg_s = sum_{i>=s} dG_i + sum_{j<s} dsuf_j, per chunk and channel (dG, dsuf [..., C, K]): the gradients of
    the exponents G_i and suf_j summed over the tokens each spans (the pair decays': pair_dot_vjp)."""
    return dG.flip(-2).cumsum(-2).flip(-2) + sum_before(dsuf)


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
    start, end = dec.start, dec.end
    k_w = beta[..., None] * start * k  # W = T k_w
    v_u = beta[..., None] * v  # U = T v_u
    # the output's two terms
    dq_state = scale * (do @ tr(states_in)) * start
    dA = scale * (do @ tr(v_new))  # through the scores (pair_dot_vjp reads its lower triangle)
    dq_scores, dk, dg_scores = pair_dot_vjp(dA, q, k, dec.pairs)
    dq = dq_state + dq_scores
    # the leaving state's term (k exp(suf))^T v_new
    dk_end = v_new @ tr(d_ends)
    dk = dk + dk_end * end
    # v_new = U - W S_in, W = T k_w, U = T v_u, T = (I + L)^-1
    dW = -dv_new @ tr(states_in)
    dT = dv_new @ tr(v_u) + dW @ tr(k_w)
    dk_w, dv_u = tr(T) @ dW, tr(T) @ dv_new
    dL = -(tr(T) @ dT @ tr(T)) * dec.strict
    # L = beta_i sum_d k_id k_jd exp(seg[i, j, d]), strictly lower
    kk_decay = torch.where(dec.strict, pair_dot(k, k, dec.pairs), 0.0)
    dkk = dL * beta[..., :, None]
    dk_rows, dk_cols, dg_kk = pair_dot_vjp(dkk, k, k, dec.pairs)
    dk = dk + dk_rows + dk_cols + beta[..., None] * start * dk_w
    dv = beta[..., None] * dv_u
    dbeta = (dL * kk_decay).sum(-1) + (dv_u * v).sum(-1) + (dk_w * start * k).sum(-1)
    # the exponents' gradients per channel: G_i (q's and W's factors, the chunk total), suf_j, the pair decays'
    dG = dq_state * q + dk_w * k_w
    dG[..., -1, :] += (d_ends * states_in).sum(-1) * dec.total
    dsuf = dk_end * end * k
    return dq, dk, dv, gate_grad(dG, dsuf) + dg_scores + dg_kk, dbeta
