"""Gated linear attention (GLA) in pure PyTorch.

Recurrence, per batch b and head h (state S is K x V, kept in fp32):

    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t        o_t = scale * q_t S_t

with g_t <= 0 the per-key log decay. Shapes throughout: q, k, g: [B, T, H, K];
v: [B, T, H, V]; states: [B, H, K, V]; outputs o: [B, T, H, V] in v's dtype.
Work is done in fp32 (fp64 when any input is fp64).

Numerics: only non-positive log decays are ever exponentiated. Inside a chunk
the pairwise factor exp(b_i - b_j) (j <= i) is masked to -inf above the
diagonal *before* exp, so masked entries are exactly 0 with 0 gradient; across
chunks q is scaled by exp(b_i) and k by exp(b_last - b_j), both <= 1.

`chunk_gla_local` and `gla_state_correction` split a slice's output into the
part from a zero state and the part from an incoming state, which is what the
sequence-parallel All-Scan needs (ZeCO):

    chunk_gla(q, k, v, g, h0) == o_local + gla_state_correction(q, g, h0)
    final_state               == S_local + exp(log_gamma)[..., None] * h0
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["recurrent_gla", "chunk_gla", "chunk_gla_local", "gla_state_correction"]


def _compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """fp64 if any input is fp64, else fp32 (bf16/fp16 accumulate in fp32)."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, g: Tensor, h0: Tensor | None) -> None:
    if q.dim() != 4 or q.shape != k.shape or q.shape != g.shape:
        raise ValueError(
            f"q, k, g must share shape [B, T, H, K]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(g.shape)}"
        )
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] matching q's [B, T, H]; got {tuple(v.shape)}")
    B, _, H, K = q.shape
    if h0 is not None and tuple(h0.shape) != (B, H, K, v.shape[-1]):
        raise ValueError(f"initial_state must be [B, H, K, V]; got {tuple(h0.shape)}")


def recurrent_gla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Token-by-token reference. Returns (o [B,T,H,V], final state [B,H,K,V] or None)."""
    _check_shapes(q, k, v, g, initial_state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dt = _compute_dtype(q, k, v, g, initial_state)
    v_dtype = v.dtype
    q, k, v, g = (x.to(dt) for x in (q, k, v, g))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)
    outs = []
    for t in range(T):
        S = g[:, t].exp()[..., None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S) * scale)
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, V)
    return o.to(v_dtype), (S if output_final_state else None)


def _sub_block(C: int) -> int:
    """Sub-block size ~sqrt(C): the pairwise-decay tensors are C*c*K and C*(C/c)*K, not C*C*K."""
    return next((c for c in (4, 8, 16) if c * c >= C and C % c == 0), C)


def _intra_chunk_scores(q: Tensor, k: Tensor, b: Tensor, c: int) -> Tensor:
    """A_ij = sum_k q_ik k_jk exp(b_ik - b_jk) for j <= i, else 0. q, k, b: [..., C, K].

    Split the chunk into sub-blocks of c tokens. Within a diagonal sub-block the decay is
    taken pairwise; b_i - b_j > 0 above the diagonal (may overflow), so mask to -inf
    *before* exp (exact 0, zero gradient). For sub-block J before token i, factor through
    r = last token of J: exp(b_i - b_r) * exp(b_r - b_j), both exponents <= 0.
    """
    C = q.shape[-2]
    M = C // c
    neg_inf = float("-inf")
    qs, ks, bs = (x.unflatten(-2, (M, c)) for x in (q, k, b))  # [..., M, c, K]
    upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)[:, :, None]
    decay = (bs[..., :, None, :] - bs[..., None, :, :]).masked_fill(upper, neg_inf).exp()
    A_diag = ((qs[..., :, None, :] * decay) * ks[..., None, :, :]).sum(-1)  # [..., M, c, c]
    if M == 1:
        return A_diag.squeeze(-3)
    b_ref = bs[..., -1, :]  # [..., M, K]
    k_ref = ks * (b_ref[..., None, :] - bs).exp()  # [..., M, c, K]
    blk = torch.arange(C, device=q.device) // c
    not_after = (blk[None, :] <= torch.arange(M, device=q.device)[:, None])[:, :, None]
    e = (b[..., None, :, :] - b_ref[..., :, None, :]).masked_fill(not_after, neg_inf)
    A_off = (q[..., None, :, :] * e.exp()) @ k_ref.transpose(-1, -2)  # [..., M(J), C, c]
    A = A_off.movedim(-3, -2).flatten(-2)  # [..., C, C]
    eye = torch.eye(M, dtype=q.dtype, device=q.device)  # place diagonal blocks
    return A + torch.einsum("...Iij,IJ->...IiJj", A_diag, eye).reshape(A.shape)


def _chunk_forward(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float | None, initial_state: Tensor | None, chunk_size: int
) -> tuple[Tensor, Tensor]:
    """Chunked GLA in the compute dtype. Returns (o [B,T,H,V] compute dtype, S_T)."""
    _check_shapes(q, k, v, g, initial_state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    if C <= 0 or T % C != 0:
        raise ValueError(f"sequence length T={T} must be a multiple of chunk_size={C}")
    N = T // C
    scale = K**-0.5 if scale is None else scale
    dt = _compute_dtype(q, k, v, g, initial_state)

    # [B, T, H, D] -> [B, H, N, C, D]: one matmul-friendly block per chunk.
    def blocks(x: Tensor) -> Tensor:
        return x.to(dt).reshape(B, N, C, H, x.shape[-1]).permute(0, 3, 1, 2, 4)

    q, k, v, g = blocks(q), blocks(k), blocks(v), blocks(g)
    b = g.cumsum(dim=3)  # log decay from chunk start, inclusive; <= 0
    b_last = b[..., -1:, :]  # [B, H, N, 1, K] total decay of each chunk

    # Intra-chunk (causal, decayed q.k scores), all chunks at once; no state involved.
    A = _intra_chunk_scores(q, k, b, _sub_block(C))  # [B, H, N, C, C]
    o = (A @ v) * scale

    # Per-chunk state contributions (from zero state) and chunk decays, all chunks at once.
    k_dec = k * (b_last - b).exp()  # exponent <= 0
    U = k_dec.transpose(-1, -2) @ v  # [B, H, N, K, V]
    gamma = b_last.squeeze(-2).exp()[..., None]  # [B, H, N, K, 1]

    # Short sequential scan over chunks: state entering each chunk.
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)
    states = []
    for n in range(N):
        states.append(S)
        S = gamma[:, :, n] * S + U[:, :, n]
    S_in = torch.stack(states, dim=2)  # [B, H, N, K, V]

    # Inter-chunk: contribution of the incoming state, batched over chunks.
    o = o + ((q * b.exp()) @ S_in) * scale
    o = o.permute(0, 2, 3, 1, 4).reshape(B, T, H, V)
    return o, S


def chunk_gla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 16,
) -> tuple[Tensor, Tensor | None]:
    """Chunked GLA (same result as `recurrent_gla`). T must be a multiple of chunk_size.

    Returns (o [B,T,H,V] in v's dtype, final state [B,H,K,V] fp32/fp64 or None).
    """
    o, S = _chunk_forward(q, k, v, g, scale, initial_state, chunk_size)
    return o.to(v.dtype), (S if output_final_state else None)


def chunk_gla_local(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float | None = None, chunk_size: int = 16
) -> tuple[Tensor, Tensor, Tensor]:
    """Local pass of one sequence slice from a zero state.

    Returns (o_local [B,T,H,V] in v's dtype, S_local [B,H,K,V] fp32, log_gamma [B,H,K] fp32),
    log_gamma being the slice's total log decay sum_t g_t (fp64 kept when inputs are fp64).
    """
    o, S = _chunk_forward(q, k, v, g, scale, None, chunk_size)
    log_gamma = g.to(_compute_dtype(q, k, v, g)).sum(dim=1)
    return o.to(v.dtype), S, log_gamma


def gla_state_correction(q: Tensor, g: Tensor, state_in: Tensor, scale: float | None = None) -> Tensor:
    """Output contribution of an incoming state: scale * (q * exp(B_t)) @ state_in.

    q, g: [B, T, H, K]; state_in: [B, H, K, V]. B_t = sum_{s<=t} g_s from the slice's first
    token (<= 0, so exp never overflows). Returns [B, T, H, V] in q's dtype.
    """
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dt = _compute_dtype(q, g, state_in)
    qd = q.to(dt) * g.to(dt).cumsum(dim=1).exp()
    return (torch.einsum("bthk,bhkv->bthv", qd, state_in.to(dt)) * scale).to(q.dtype)
