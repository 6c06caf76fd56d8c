"""Triton kernels for chunked Kimi Delta Attention (the gated delta rule with a per-channel decay), forward and
backward: the launch wrappers and their tile table. The kernels are in kda_fwd.py and kda_bwd.py; the math, in
torch, in ops/kda_chunked.py.

Layout as in megatron_zpp/ops/kda.py: q, k, g [B, T, H, K] and v, do [B, T, H, V] read with their own batch,
token and head strides (only the last dim must be contiguous); beta is copied once to fp32 [B, H, T]. Per-chunk
intermediates are fp32 [B, H, T, D] (D = C for A, L, T, K for W, V for U, v_new, dv_new) and states
[B, H, N, K, V]. Every kernel accumulates in fp32; dot operands are bf16 for bf16 inputs on a GPU and exact
fp32 products ("ieee", not tf32) for fp32 inputs (kernels/chunk_common.py's dot). Every grid is one axis over
(tile, chunk, batch * head); program ids and base offsets are 64-bit.

Decomposition (fla's chunk_kda, with the GLA kernels' intra-chunk numerics):

    _kda_scores_kernel        per sub-block of 16 rows: A = lower(sum_d q_id k_jd exp(seg[i, j, d])) and L's kernel
    _kda_prepare_kernel       per chunk: T = (I + beta L)^-1, W = T (beta exp(G) k), U = T (beta v)
    _delta_fwd_states_kernel  the scan over chunks per V tile: S_in per chunk, v_new = U - W S_in, the final state
    _delta_output_kernel      o = scale ((q exp(G)) S_in + A v_new)
    _delta_bwd_states_kernel  the reverse scan: d_ends (the gradient of each chunk's leaving state), dv_new, dh0
    _kda_bwd_state_grads_kernel  per chunk: the gradients through the states and W (dq, dk's shares, dW T^T)
    _kda_bwd_wy_kernel        per chunk: dv, the scores' gradient dA, and dL = -T^T dT T^T
    _kda_bwd_intra_kernel     per sub-block: through A and L the rest of dq and dk
    _kda_bwd_gate_kernel      per chunk: dg, and L's share of dbeta

The backward recomputes the forward's intermediates (scores, prepare and the state scan) from the inputs. The two
scans and the output are kernels/delta_rule.py's, shared with GDN (PER_CHANNEL=True).

Numerics: every exponent is a sum of g <= 0 over its own tokens: the decay from the chunk's start a cumsum, to its
end a reverse cumsum of g loaded one token later, a pair in two sub-blocks factors at a sub-block boundary
(prefix of the later, suffix of the earlier and the sub-blocks between), a pair in one sub-block a masked cumsum.
A -inf gate (a packed document's first token) only ever gives exp(-inf) = 0: the state resets exactly and
outputs and gradients stay finite. The gate's gradient is taken as the gradient of the cumulative exponents G_i
(dGc: +x where a factor grows with G_i, -x where it shrinks), reverse-summed over the chunk (the GLA kernels' form),
but the exponents to the chunk's end (suf_j) as their own exclusive prefix sum: the last token's undecayed term
would otherwise cancel in fp32 against the decayed rest (3.7e-5 at strong gates). dg is 0 where exp(g) underflows
fp32, as every term of the reference's is there.
"""

from __future__ import annotations

import torch
import triton

from . import target
from .chunk_common import LOG_TINY_FP32, SUB_BLOCK, bf16_dots, contiguous_fp32, strided
from .delta_rule import _delta_bwd_states_kernel, _delta_fwd_states_kernel, _delta_output_kernel
from .kda_bwd import _kda_bwd_gate_kernel, _kda_bwd_intra_kernel, _kda_bwd_state_grads_kernel, _kda_bwd_wy_kernel
from .kda_fwd import _kda_prepare_kernel, _kda_scores_kernel


def _cfg(num_warps: int = 4, num_stages: int = 1, **tiles: int) -> dict[str, int]:
    return dict(tiles, num_warps=num_warps, num_stages=num_stages)


# Per-kernel tiles, warps and stages on a GPU, keyed on bf16 dot operands or fp32 "ieee" products: BK the key
# tile, BV the value tile, DBK the key width of a diagonal sub-block's [16, 16, DBK] pair tiles. The state scans
# hold the state as one tile of the whole padded K (no BK) or as two tiles of BK rows (K <= 2 BK). Chosen with
# megatron_zpp/testing/triton_aot.py (bench/compile_gpu.py --family kda) at C = 64, K = V = 128: no spills on sm_80
# and sm_90 in bf16 (the default; also at the shapes at risk, C = 16) under Triton 3.9 and 3.6 (NVIDIA's image); in
# fp32 the two state scans spill (fp32 "ieee" dots hold more registers; docs/kernels.md lists them, as GDN's).
_TILES = _cfg(BK=32, BV=16, num_warps=8)
_TABLE: dict[str, tuple[dict[str, int], dict[str, int]]] = {
    "scores": (_cfg(BK=32, DBK=16), _cfg(BK=32, DBK=16)),
    "prepare": (_TILES, _cfg(BK=16, BV=16, num_warps=8)),  # fp32 at BK 32: 152 B spilled on sm_80
    "fwd_states": (_cfg(BV=16, num_warps=8), _cfg(BK=64, BV=16, num_warps=8)),  # 4 warps: 16 B on sm_80 (3.6)
    "output": (_TILES, _TILES),
    "bwd_states": (_cfg(BK=64, BV=16, num_warps=8), _cfg(BK=64, BV=16, num_warps=8)),  # whole K: sm_90 (3.6)
    "bwd_state_grads": (_cfg(BK=16, BV=32, num_warps=8), _cfg(BK=16, BV=16, num_warps=8)),  # BV 16: C 16 (3.6)
    "bwd_wy": (_TILES, _TILES),
    "bwd_intra": (_cfg(BK=16, num_warps=8), _cfg(BK=16, num_warps=8)),  # 4 warps spill, 2 spill more
    "bwd_gate": (_cfg(BK=32), _cfg(BK=32)),
}


def gpu_tiles(kernel: str, K: int, V: int, bf16: int) -> dict[str, int]:
    """A GPU launch's config: the table's row, tiles capped at the padded K / V (no BK: the padded K)."""
    cfg = dict(_TABLE[kernel][0 if bf16 else 1])
    pk, pv = max(16, triton.next_power_of_2(K)), max(16, triton.next_power_of_2(V))
    cfg["BK"] = min(cfg.get("BK", pk), pk)
    cfg["BV"] = min(cfg.get("BV", pv), pv)
    return cfg


def _config(kernel: str, K: int, V: int, bf16: int, device: torch.device, *drop: str) -> dict[str, int]:
    """The GPU table's config, or under the interpreter (CPU) whole padded K and V tiles; without `drop`'s keys."""
    if target.gpu(device) is not None:
        cfg = gpu_tiles(kernel, K, V, bf16)
    else:
        pk, pv = max(16, triton.next_power_of_2(K)), max(16, triton.next_power_of_2(V))
        cfg = dict(BK=pk, BV=pv, DBK=pk, num_warps=4, num_stages=1)
    if kernel != "scores":
        cfg.pop("DBK", None)
    return {key: val for key, val in cfg.items() if key not in drop}


def _per_head(x: torch.Tensor) -> torch.Tensor:
    """beta [B, T, H] -> fp32 [B, H, T] contiguous (one row of C values per chunk)."""
    return x.to(torch.float32).transpose(1, 2).contiguous()


class _Forward:
    """The forward's intermediates: A, L, T, W, U [B, H, T, .], states [B, H, N, K, V], v_new, final state."""

    def __init__(self, q, k, v, g, beta, initial_state, chunk_size, bf16):
        C = chunk_size
        (q, sq), (k, sk), (v, sv), (g, sg) = strided(q, C), strided(k, C), strided(v, C), strided(g, C)
        B, T, H, K = q.shape
        V, N = v.shape[-1], T // C
        beta = _per_head(beta)
        f32 = dict(dtype=torch.float32, device=q.device)
        self.A, self.L = torch.zeros(B, H, T, C, **f32), torch.zeros(B, H, T, C, **f32)
        _kda_scores_kernel[(C // SUB_BLOCK * N * B * H,)](
            q, k, g, self.A, self.L, T, N, *sq, *sk, *sg,
            H=H, K=K, C=C, BT=SUB_BLOCK, BF16=bf16, **_config("scores", K, V, bf16, q.device, "BV"),
        )  # fmt: skip
        self.T, self.W, self.U = (
            torch.empty_like(self.A),
            torch.empty(B, H, T, K, **f32),
            torch.empty(B, H, T, V, **f32),
        )
        _kda_prepare_kernel[(N * B * H,)](
            k, v, g, beta, self.L, self.T, self.W, self.U, T, N, *sk, *sv, *sg,
            H=H, K=K, V=V, C=C, BF16=bf16, **_config("prepare", K, V, bf16, q.device),
        )  # fmt: skip
        h0 = contiguous_fp32(initial_state)
        self.states = torch.empty(B, H, N, K, V, **f32)
        self.v_new, self.final = torch.empty(B, H, T, V, **f32), torch.empty(B, H, K, V, **f32)
        cfg = _config("fwd_states", K, V, bf16, q.device)
        NV = triton.cdiv(V, cfg["BV"])
        _delta_fwd_states_kernel[(NV * B * H,)](
            k, g, self.W, self.U, h0 if h0 is not None else self.final, self.states, self.v_new, self.final,
            T, N, *sk, *sg, H=H, K=K, V=V, C=C, NV=NV, SPLIT=K > cfg["BK"], USE_H0=h0 is not None,
            PER_CHANNEL=True, BF16=bf16, **cfg,
        )  # fmt: skip
        self.q, self.sq, self.k, self.sk, self.v, self.sv, self.g, self.sg = q, sq, k, sk, v, sv, g, sg
        self.beta = beta


def fwd(q, k, v, g, beta, initial_state, scale, chunk_size):
    """(o [B, T, H, V] fp32, final_state [B, H, K, V] fp32)."""
    C = chunk_size
    bf16 = bf16_dots(q.device, q, k, v)
    f = _Forward(q, k, v, g, beta, initial_state, C, bf16)
    B, T, H, K = f.q.shape
    V, N = f.v.shape[-1], T // C
    o = q.new_empty(B, T, H, V, dtype=torch.float32)
    cfg = _config("output", K, V, bf16, q.device)
    NV = triton.cdiv(V, cfg["BV"])
    _delta_output_kernel[(NV * N * B * H,)](
        f.q, f.g, f.A, f.states, f.v_new, o, T, N, scale, *f.sq, *f.sg,
        H=H, K=K, V=V, C=C, NV=NV, PER_CHANNEL=True, BF16=bf16, **cfg,
    )  # fmt: skip
    return o, f.final


def bwd(q, k, v, g, beta, initial_state, do, d_final_state, scale, chunk_size):
    """(dq, dk, dv [B, T, H, .], dg [B, T, H, K], dbeta [B, T, H], d_initial_state [B, H, K, V]), fp32; do /
    d_final_state None are zero."""
    C = chunk_size
    bf16 = bf16_dots(q.device, q, k, v, do)
    f = _Forward(q, k, v, g, beta, initial_state, C, bf16)
    B, T, H, K = f.q.shape
    V, N = f.v.shape[-1], T // C
    has_do = do is not None
    do, so = strided(do, C) if has_do else (f.v, f.sv)  # v: a placeholder when there is no do
    dS = contiguous_fp32(d_final_state)
    f32 = dict(dtype=torch.float32, device=q.device)
    d_ends, dv_new = torch.empty(B, H, N, K, V, **f32), torch.empty(B, H, T, V, **f32)
    dh0 = torch.empty(B, H, K, V, **f32)
    cfg = _config("bwd_states", K, V, bf16, q.device)
    NV = triton.cdiv(V, cfg["BV"])
    _delta_bwd_states_kernel[(NV * B * H,)](
        f.q, f.k, f.g, f.A, f.W, do, dS if dS is not None else dh0, d_ends, dv_new, dh0, T, N, scale,
        *f.sq, *f.sk, *f.sg, *so, H=H, K=K, V=V, C=C, NV=NV, SPLIT=K > cfg["BK"], HAS_DO=has_do,
        HAS_DS=dS is not None, PER_CHANNEL=True, BF16=bf16, **cfg,
    )  # fmt: skip
    dq, dk, dGc, dsuf, dg = (torch.empty(B, T, H, K, **f32) for _ in range(5))
    dv = torch.empty(B, T, H, V, **f32)
    dTw, dA = torch.empty(B, H, T, C, **f32), torch.empty(B, H, T, C, **f32)
    dbeta = torch.empty(B, H, T, **f32)
    _kda_bwd_state_grads_kernel[(N * B * H,)](
        f.q, f.k, f.g, f.beta, f.T, f.states, f.v_new, d_ends, do, dv_new, dq, dk, dGc, dsuf, dTw, dbeta,
        T, N, scale, *f.sq, *f.sk, *f.sg, *so,
        H=H, K=K, V=V, C=C, HAS_DO=has_do, BF16=bf16, **_config("bwd_state_grads", K, V, bf16, q.device),
    )  # fmt: skip
    _kda_bwd_wy_kernel[(N * B * H,)](
        f.v, f.beta, f.T, f.v_new, do, dv_new, dTw, dA, dv, dbeta, T, N, scale, *f.sv, *so,
        H=H, V=V, C=C, HAS_DO=has_do, BF16=bf16, **_config("bwd_wy", K, V, bf16, q.device, "BK"),
    )  # fmt: skip
    _kda_bwd_intra_kernel[(C // SUB_BLOCK * N * B * H,)](
        f.q, f.k, f.g, f.beta, dA, dTw, dq, dk, dGc, T, N, *f.sq, *f.sk, *f.sg,
        H=H, K=K, C=C, BT=SUB_BLOCK, BF16=bf16, **_config("bwd_intra", K, V, bf16, q.device, "BV"),
    )  # fmt: skip
    _kda_bwd_gate_kernel[(N * B * H,)](
        f.g, f.L, dTw, dGc, dsuf, dg, dbeta, T, N, LOG_TINY_FP32, *f.sg,
        H=H, K=K, C=C, **_config("bwd_gate", K, V, bf16, q.device, "BV"),
    )  # fmt: skip
    return dq, dk, dv, dg, dbeta.transpose(1, 2).contiguous(), dh0
