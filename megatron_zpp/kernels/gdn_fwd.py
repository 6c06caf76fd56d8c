"""Forward Triton kernel of chunked Gated DeltaNet: the per-chunk WY/UT factors (kernels/gdn.py describes the
decomposition and launches them; the state scan and the output are kernels/delta_rule.py's, shared with KDA)."""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_common import dot, load_rows, unit_lower_inverse
from .delta_rule import chunk_gates


@triton.jit
def _gdn_prepare_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, T_ptr, A_ptr, W_ptr, U_ptr, T, N,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BF16: tl.constexpr,
):  # fmt: skip
    """Per chunk: T = (I + L)^-1, the scores A = lower(q k^T exp(seg)), W = T (beta exp(G) k), U = T (beta v).
    K in tiles of BK (k k^T and q k^T accumulate over them), V in tiles of BV."""
    pid = tl.program_id(0).to(tl.int64)  # (chunk, b*H + h)
    i_n, i_bh = pid % N, pid // N
    b, h = i_bh // H, i_bh % H
    rc, rk, rv = tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BV)
    all_rows = rc < C
    row0 = i_n * C
    tok = i_bh * T + row0  # the [B, H, T, ...] intermediates' first row of this chunk
    start, _, pair = chunk_gates(g_ptr + tok, rc, C)
    beta = tl.load(beta_ptr + tok + rc)
    k_ptr += b * skb + h * skh + row0 * skt
    q_ptr += b * sqb + h * sqh + row0 * sqt
    kk = tl.zeros([C, C], dtype=tl.float32)
    qk = tl.zeros([C, C], dtype=tl.float32)
    for k0 in range(0, K, BK):
        mk = k0 + rk < K
        k_tile = load_rows(k_ptr + k0, rc, rk, all_rows, mk, skt)
        kk += dot(k_tile, tl.trans(k_tile), BF16)
        qk += dot(load_rows(q_ptr + k0, rc, rk, all_rows, mk, sqt), tl.trans(k_tile), BF16)
    L = tl.where(rc[:, None] > rc[None, :], beta[:, None] * kk * pair, 0.0)
    inv = unit_lower_inverse(L, rc, C)
    cc = rc[:, None] * C + rc[None, :]
    tl.store(T_ptr + tok * C + cc, inv)
    tl.store(A_ptr + tok * C + cc, qk * pair)
    for k0 in range(0, K, BK):
        mk = k0 + rk < K
        k_tile = load_rows(k_ptr + k0, rc, rk, all_rows, mk, skt)
        W = dot(inv, k_tile * (beta * start)[:, None], BF16)
        tl.store(W_ptr + tok * K + k0 + rc[:, None] * K + rk[None, :], W, mask=mk[None, :])
    v_ptr += b * svb + h * svh + row0 * svt
    for v0 in range(0, V, BV):
        mv = v0 + rv < V
        vv = load_rows(v_ptr + v0, rc, rv, all_rows, mv, svt)
        U = dot(inv, vv * beta[:, None], BF16)
        tl.store(U_ptr + tok * V + v0 + rc[:, None] * V + rv[None, :], U, mask=mv[None, :])
