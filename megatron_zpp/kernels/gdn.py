"""Triton kernels for chunked Gated DeltaNet (the gated delta rule), forward and backward: the launch wrappers
and their tile table. The kernels are in gdn_fwd.py and gdn_bwd.py; the math, in torch, in ops/gdn_chunked.py.

Layout as in megatron_zpp/ops/gdn.py: q, k [B, T, H, K] and v, do [B, T, H, V] read with their own batch,
token and head strides (only the last dim must be contiguous); g and beta are copied once to fp32 [B, H, T].
Per-chunk intermediates are fp32 [B, H, T, D] (D = C for T and A, K for W, V for U, v_new, dv_new) and
states [B, H, N, K, V]. Every kernel accumulates in fp32; dot operands are bf16 for bf16 inputs on a GPU and
exact fp32 products ("ieee", not tf32) for fp32 inputs (kernels/chunk_common.py's dot). The triangular inverse
is fp32 forward substitution. Every grid is one axis over (tile, chunk, batch * head); program ids and base
offsets are 64-bit.

Decomposition (fla's chunk_gated_delta_rule, with the GLA op's numerics):

    _gdn_prepare_kernel      per chunk: T = (I + L)^-1, A = lower(q k^T exp(seg)), W = T (beta exp(G) k), U = T (beta v)
    _delta_fwd_states_kernel the scan over chunks per V tile: S_in per chunk, v_new = U - W S_in, the final state
    _delta_output_kernel     o = scale ((q exp(G)) S_in + A v_new)
    _delta_bwd_states_kernel the reverse scan: d_ends (the gradient of each chunk's leaving state), dv_new, dh0
    _gdn_bwd_state_grads_kernel  per chunk: the gradients through the states and W (dq, dk's shares, dW T^T)
    _gdn_bwd_wy_kernel       per chunk: dv, the scores' gradient dA, and dL = -T^T dT T^T
    _gdn_bwd_chunk_kernel    per chunk: through L and A the rest of dq, dk, dbeta, and dg

The backward recomputes the forward's intermediates (prepare and the state scan) from the inputs. The two scans
and the output are kernels/delta_rule.py's, shared with KDA (PER_CHANNEL=False: g's per-head copy, token stride 1).

Numerics: every exponent is a sum of g <= 0 accumulated over its own tokens (a masked cumsum for the pair
decays, a reverse cumsum of g loaded one token later for the decay to the chunk's end), never a difference of
two cumulative sums: a -inf gate (a packed document's first token) only ever gives exp(-inf) = 0, so the
state resets exactly and outputs and gradients stay finite, with a zero gate gradient there.
"""

from __future__ import annotations

import torch
import triton

from . import target
from .chunk_common import bf16_dots, contiguous_fp32, strided
from .delta_rule import _delta_bwd_states_kernel, _delta_fwd_states_kernel, _delta_output_kernel
from .gdn_bwd import _gdn_bwd_chunk_kernel, _gdn_bwd_state_grads_kernel, _gdn_bwd_wy_kernel
from .gdn_fwd import _gdn_prepare_kernel


def _cfg(num_warps: int = 4, num_stages: int = 1, **tiles: int) -> dict[str, int]:
    return dict(tiles, num_warps=num_warps, num_stages=num_stages)


# Per-kernel tiles, warps and stages on a GPU, keyed on the chunk size (a C between two rows takes the larger
# row) and on bf16 dot operands or fp32 "ieee" products: BK the key tile, BV the value tile. The state scans hold
# the state as one tile of the whole padded K (no BK) or as two tiles of BK rows (K <= 2 BK). Chosen with
# megatron_zpp/testing/triton_aot.py (bench/compile_gpu.py --family gdn): no register spills on sm_80 and sm_90 in
# bf16 at C = 64 and the shapes at risk; docs/kernels.md lists the few other compiles that spill (fp32 scans).
def _rows(bf16: dict[str, int], fp32: dict[str, int], scan: bool = False, **fp32_c64: int) -> dict:
    """One kernel's rows: 4 warps up to C = 32, 8 at C = 64 (fp32 scans: 8 at every C); fp32_c64 overrides fp32's
    entry at C = 64."""
    rows = {}
    for c in (16, 32, 64):
        warps = 4 if c <= 32 else 8
        rows[c] = (dict(bf16, num_warps=warps), dict(fp32, num_warps=8 if scan else warps))
    rows[64][1].update(fp32_c64)
    return rows


_TILES = _cfg(BK=32, BV=16)
_SCAN_BF16, _SCAN_FP32 = _cfg(BV=16), _cfg(BK=64, BV=16)
_TABLE: dict[str, dict[int, tuple[dict[str, int], dict[str, int]]]] = {
    "prepare": _rows(_TILES, _TILES, BK=16),
    "fwd_states": _rows(_SCAN_BF16, _SCAN_FP32, scan=True),
    "output": _rows(_TILES, _TILES),
    "bwd_states": _rows(_SCAN_BF16, _SCAN_FP32, scan=True),
    "bwd_state_grads": _rows(_TILES, _TILES),
    "bwd_wy": _rows(_TILES, _TILES),
    "bwd_chunk": _rows(_TILES, _TILES),
}
# Triton 3.6 (NVIDIA's PyTorch image) spilled two bf16 launches that 3.9 did not: these rows spill on neither
_TABLE["fwd_states"][64][0]["num_warps"] = 4  # K = V = 128 on sm_80: 16 B at 8 warps
_TABLE["bwd_state_grads"][16][0]["BK"] = 64  # K = V = 128 on sm_90: 4 B at BK = 32 (16 and 8 warps spill too)


def gpu_tiles(kernel: str, C: int, K: int, V: int, bf16: int) -> dict[str, int]:
    """A GPU launch's config: the table's row for C, tiles capped at the padded K / V (no BK: the padded K)."""
    rows = _TABLE[kernel]
    cfg = dict(rows[min((c for c in rows if c >= C), default=max(rows))][0 if bf16 else 1])
    pk, pv = max(16, triton.next_power_of_2(K)), max(16, triton.next_power_of_2(V))
    cfg["BK"] = min(cfg.get("BK", pk), pk)
    cfg["BV"] = min(cfg["BV"], pv)
    return cfg


def _config(kernel: str, C: int, K: int, V: int, bf16: int, device: torch.device) -> dict[str, int]:
    """The GPU table's config, or under the interpreter (CPU) whole padded K and V tiles."""
    if target.gpu(device) is not None:
        return gpu_tiles(kernel, C, K, V, bf16)
    pk, pv = max(16, triton.next_power_of_2(K)), max(16, triton.next_power_of_2(V))
    return dict(BK=pk, BV=pv, num_warps=4, num_stages=1)


def _per_head(x: torch.Tensor) -> torch.Tensor:
    """g or beta [B, T, H] -> fp32 [B, H, T] contiguous (one row of C values per chunk)."""
    return x.to(torch.float32).transpose(1, 2).contiguous()


class _Forward:
    """The forward's intermediates: T, A, W, U [B, H, T, .], states [B, H, N, K, V], v_new, final state."""

    def __init__(self, q, k, v, g, beta, initial_state, chunk_size, bf16):
        C = chunk_size
        (q, sq), (k, sk), (v, sv) = strided(q, C), strided(k, C), strided(v, C)
        B, T, H, K = q.shape
        V, N = v.shape[-1], T // C
        g, beta = _per_head(g), _per_head(beta)
        sg = (g.stride(0), g.stride(2), g.stride(1))  # [B, H, T]: the shared kernels' (batch, token, head) strides
        f32 = dict(dtype=torch.float32, device=q.device)
        self.T, self.A = torch.empty(B, H, T, C, **f32), torch.empty(B, H, T, C, **f32)
        self.W, self.U = torch.empty(B, H, T, K, **f32), torch.empty(B, H, T, V, **f32)
        cfg = _config("prepare", C, K, V, bf16, q.device)
        _gdn_prepare_kernel[(N * B * H,)](
            q, k, v, g, beta, self.T, self.A, self.W, self.U, T, N, *sq, *sk, *sv,
            H=H, K=K, V=V, C=C, BF16=bf16, **cfg,
        )  # fmt: skip
        h0 = contiguous_fp32(initial_state)
        self.states = torch.empty(B, H, N, K, V, **f32)
        self.v_new, self.final = torch.empty(B, H, T, V, **f32), torch.empty(B, H, K, V, **f32)
        cfg = _config("fwd_states", C, K, V, bf16, q.device)
        NV = triton.cdiv(V, cfg["BV"])
        _delta_fwd_states_kernel[(NV * B * H,)](
            k, g, self.W, self.U, h0 if h0 is not None else self.final, self.states, self.v_new, self.final,
            T, N, *sk, *sg, H=H, K=K, V=V, C=C, NV=NV, SPLIT=K > cfg["BK"], USE_H0=h0 is not None,
            PER_CHANNEL=False, BF16=bf16, **cfg,
        )  # fmt: skip
        self.q, self.sq, self.k, self.sk, self.v, self.sv, self.g, self.beta = q, sq, k, sk, v, sv, g, beta
        self.sg = sg


def fwd(q, k, v, g, beta, initial_state, scale, chunk_size):
    """(o [B, T, H, V] fp32, final_state [B, H, K, V] fp32)."""
    C = chunk_size
    bf16 = bf16_dots(q.device, q, k, v)
    f = _Forward(q, k, v, g, beta, initial_state, C, bf16)
    B, T, H, K = f.q.shape
    V, N = f.v.shape[-1], T // C
    o = q.new_empty(B, T, H, V, dtype=torch.float32)
    cfg = _config("output", C, K, V, bf16, q.device)
    NV = triton.cdiv(V, cfg["BV"])
    _delta_output_kernel[(NV * N * B * H,)](
        f.q, f.g, f.A, f.states, f.v_new, o, T, N, scale, *f.sq, *f.sg,
        H=H, K=K, V=V, C=C, NV=NV, PER_CHANNEL=False, BF16=bf16, **cfg,
    )  # fmt: skip
    return o, f.final


def bwd(q, k, v, g, beta, initial_state, do, d_final_state, scale, chunk_size):
    """(dq, dk, dv [B, T, H, .], dg, dbeta [B, T, H], d_initial_state [B, H, K, V]), fp32; do / d_final_state
    None are zero."""
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
    cfg = _config("bwd_states", C, K, V, bf16, q.device)
    NV = triton.cdiv(V, cfg["BV"])
    _delta_bwd_states_kernel[(NV * B * H,)](
        f.q, f.k, f.g, f.A, f.W, do, dS if dS is not None else dh0, d_ends, dv_new, dh0, T, N, scale,
        *f.sq, *f.sk, *f.sg, *so, H=H, K=K, V=V, C=C, NV=NV, SPLIT=K > cfg["BK"], HAS_DO=has_do,
        HAS_DS=dS is not None, PER_CHANNEL=False, BF16=bf16, **cfg,
    )  # fmt: skip
    dq, dk = torch.empty(B, T, H, K, **f32), torch.empty(B, T, H, K, **f32)
    dv = torch.empty(B, T, H, V, **f32)
    dTw = torch.empty(B, H, T, C, **f32)
    dG, dsuf, dg, dbeta = (torch.empty(B, H, T, **f32) for _ in range(4))
    _gdn_bwd_state_grads_kernel[(N * B * H,)](
        f.q, f.k, f.g, f.beta, f.T, f.states, f.v_new, d_ends, do, dv_new, dq, dk, dTw, dG, dsuf, dbeta,
        T, N, scale, *f.sq, *f.sk, *so,
        H=H, K=K, V=V, C=C, HAS_DO=has_do, BF16=bf16, **_config("bwd_state_grads", C, K, V, bf16, q.device),
    )  # fmt: skip
    dA = torch.empty(B, H, T, C, **f32)
    cfg = _config("bwd_wy", C, K, V, bf16, q.device)
    cfg.pop("BK")
    _gdn_bwd_wy_kernel[(N * B * H,)](
        f.v, f.beta, f.T, f.v_new, do, dv_new, dTw, dA, dv, dbeta, T, N, scale, *f.sv, *so,
        H=H, V=V, C=C, HAS_DO=has_do, BF16=bf16, **cfg,
    )  # fmt: skip
    cfg = _config("bwd_chunk", C, K, V, bf16, q.device)
    cfg.pop("BV")
    _gdn_bwd_chunk_kernel[(N * B * H,)](
        f.q, f.k, f.g, f.beta, f.A, dA, dTw, dG, dsuf, dq, dk, dg, dbeta, T, N, *f.sq, *f.sk,
        H=H, K=K, C=C, BF16=bf16, **cfg,
    )  # fmt: skip
    return dq, dk, dv, dg.transpose(1, 2).contiguous(), dbeta.transpose(1, 2).contiguous(), dh0
