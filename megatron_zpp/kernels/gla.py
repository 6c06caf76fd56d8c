"""Triton kernels for chunked gated linear attention (GLA), forward and backward: the launch wrappers and
their tile table. The kernels are in gla_fwd.py and gla_bwd.py; the device helpers they share with the Gated
DeltaNet kernels in chunk_common.py.

Layout as in megatron_zpp/ops/gla.py: q, k, g [B, T, H, K], v [B, T, H, V], read with their own batch, token
and head strides (the GLA layer's q, k, v are views of one projection output: read in place, never copied;
only the last dim must be contiguous); states [B, H, N, K, V] fp32, T = N * C. Every kernel loads its inputs
as fp32 and does its elementwise math and accumulation in fp32; dot operands are bf16 for bf16 inputs on a
GPU (the tensor cores; fp32 accumulation) and exact fp32 products ("ieee", not tf32) for fp32 inputs.

Addressing: every grid is one axis (limit 2^31 - 1) over (tile, chunk, batch * head), so a sequence may have
any number of chunks (axes 1 and 2 stop at 65535); program ids and every base offset are 64-bit (a tensor
may pass 2^31 elements: states at B x H x T > 2^21 with chunk 16 and K = V = 128); offsets inside a chunk
stay 32-bit. Tiles, warps and stages per kernel come from the config table by the wrappers (_GPU_CONFIGS).

Decomposition (the one of flash-linear-attention's chunk_gla, with our numerics):

    _fwd_states_kernel   the state entering each chunk, a scan over chunks per (K tile, V tile)
    _intra_scores_kernel A[i, j] = sum_k q_ik k_jk exp(sum_{j<s<=i} g_sk), j <= i in one chunk
    _output_kernel       o = scale * (A @ v + (q * exp(prefix)) @ S_in)
    _bwd_states_kernel   d_ends[n], the gradient reaching the state leaving chunk n (reverse scan)
    _score_grad_kernel   dA = scale * do @ v^T (lower triangle of each chunk)
    _dv_kernel           dv = (k * exp(suffix)) @ d_ends + A^T @ (scale * do)
    _intra_grad_kernel   dq, dk through A, without the same-token pairs
    _dqkg_kernel         adds the inter-chunk parts and the same-token pairs, and dg chunk-locally

Numerics: no exponent is ever positive and no two cumulative sums are subtracted. Within a chunk,
in sub-blocks of BT = 16 tokens, a pair (j in sub-block J, i in sub-block I > J) decays by
exp(prefix of I up to i) * exp(suffix of J after j + totals of the sub-blocks between); a pair in one
sub-block by a segment sum accumulated over its own tokens (a cumsum of g masked to s > j). Exclusive
suffix sums are reverse cumsums of g loaded one token later (a shift, not total minus prefix). So a
-inf gate (a hard reset) only ever gives exp(-inf) = 0 and finite outputs.
"""

from __future__ import annotations

import torch
import triton

from . import target
from .chunk_common import LOG_TINY_FP32, SUB_BLOCK, bf16_dots, contiguous_fp32, strided
from .gla_bwd import _bwd_states_kernel, _dqkg_kernel, _dv_kernel, _intra_grad_kernel, _score_grad_kernel
from .gla_fwd import _fwd_states_kernel, _intra_scores_kernel, _output_kernel

# ----------------------------------------------------------------------------------------
# Launch wrappers (inputs [B, T, H, D] with any batch / token / head strides; outputs fp32 unless asked)
#
# Every grid is one axis (limit 2^31 - 1) over (tile, chunk, batch * head), so the chunk count has no
# 65535 limit; program ids and every base offset are 64-bit (a tensor may pass 2^31 elements).


def supported(q: torch.Tensor, v: torch.Tensor, chunk_size: int) -> bool:
    """Whether these kernels take the call: fp32/bf16, C a power of two in [16, 128], K and V <= 256."""
    C, K, V = chunk_size, q.shape[-1], v.shape[-1]
    return (
        q.dtype in (torch.float32, torch.bfloat16)
        and 16 <= C <= 128
        and C & (C - 1) == 0
        and 0 < K <= 256
        and 0 < V <= 256
        and q.shape[1] % C == 0
    )


# Per-kernel tiles, warps and pipeline stages on a GPU, keyed on (kernel, C, bf16 dot operands); tile widths
# are then capped at the padded K / V and at C. Chosen with megatron_zpp/testing/triton_aot.py (the largest
# tiles of a short list that compile with no register spills and at most 232 registers on sm_80 and sm_90 at
# K = V = 128), then checked for no spills at C in {16, 64, 128} x K = V in {64, 128, 256} x bf16 / fp32 x
# every specialization (initial state or not, do or not, final-state gradient or not); shared memory is under
# both limits. Tiles: BK / BV key / value widths, BC the score columns (rows for dv) per step,
# BR the score rows per program, DBK the key width of the [16, 16, keys] pair tiles of a diagonal sub-block.
def _cfg(num_warps: int = 4, num_stages: int = 2, **tiles: int) -> dict[str, int]:
    return dict(tiles, num_warps=num_warps, num_stages=num_stages)


_S32, _S16 = _cfg(BK=32, BV=32), _cfg(BK=16, BV=32)  # the scans: 32 x 32 state tiles, 16 programs a head at 128
_O64, _O32, _O16 = _cfg(BK=64, BV=64, BC=32), _cfg(BK=32, BV=32, BC=32), _cfg(BK=32, BV=32, BC=16)
_O32W8 = _cfg(BK=32, BV=32, BC=32, num_warps=8)
# kernel -> C -> (bf16 dot operands, fp32 "ieee" products); a C between two rows takes the larger C's row
_TABLE: dict[str, dict[int, tuple[dict[str, int], dict[str, int]]]] = {
    "fwd_states": {16: (_S32, _S32), 64: (_S32, _S16), 128: (_S16, _S16)},
    "bwd_states": {16: (_S32, _S32), 64: (_S32, _S16), 128: (_S32, _S16)},
    "intra_scores": {
        16: (_cfg(BK=64, DBK=16), _cfg(BK=64, DBK=16)),
        64: (_cfg(BK=64, DBK=16, num_stages=1), _cfg(BK=32, DBK=16)),  # 1 stage: no spills on Triton 3.6 and 3.9
        128: (_cfg(BK=64, DBK=16), _cfg(BK=32, DBK=16, num_stages=1)),
    },
    "output": {16: (_O64, _O32), 64: (_O64, _O16), 128: (_O32, _O32W8)},
    "dv": {16: (_O32, _O32), 64: (_O64, _O16), 128: (_O32, _O32W8)},
    "score_grad": {
        16: (_cfg(BR=16, BV=32), _cfg(BR=16, BV=32)),
        64: (_cfg(BR=64, BV=64), _cfg(BR=32, BV=32)),
        128: (_cfg(BR=64, BV=64), _cfg(BR=32, BV=32)),
    },
    "intra_grad": {16: (_cfg(BK=32), _cfg(BK=32)), 64: (_cfg(BK=16), _cfg(BK=16)), 128: (_cfg(BK=16), _cfg(BK=16))},
    "dqkg": {
        16: (_cfg(BK=16, BV=32), _cfg(BK=64, BV=64)),
        64: (_cfg(BK=32, BV=32), _cfg(BK=16, BV=32)),
        128: (_cfg(BK=16, BV=32, num_warps=8), _cfg(BK=16, BV=32, num_warps=8)),
    },
}


def _gpu_config(kernel: str, C: int, bf16: bool) -> dict[str, int]:
    rows = _TABLE[kernel]
    return rows[min((c for c in rows if c >= C), default=max(rows))][0 if bf16 else 1]


def _config(kernel: str, C: int, K: int, V: int, bf16: int, device: torch.device) -> dict[str, int]:
    """Tile widths (constexprs) and num_warps / num_stages of one launch. The interpreter (CPU) takes whole
    (padded) K and V tiles and whole chunks: fewer, larger programs."""
    if target.gpu(device) is not None:
        return gpu_tiles(kernel, C, K, V, bf16)
    pk, pv = max(16, triton.next_power_of_2(K)), max(16, triton.next_power_of_2(V))
    full = dict(BK=pk, BV=pv, BC=C, BR=C, DBK=pk, num_warps=4, num_stages=1)
    return {name: full[name] for name in _TABLE[kernel][16][0]}


def gpu_tiles(kernel: str, C: int, K: int, V: int, bf16: int) -> dict[str, int]:
    """A GPU launch's config: the table's entry with its tiles capped at the padded K / V and at C."""
    pk, pv = max(16, triton.next_power_of_2(K)), max(16, triton.next_power_of_2(V))
    cfg = dict(_gpu_config(kernel, C, bool(bf16)))
    for name, cap in (("BK", pk), ("DBK", pk), ("BV", pv), ("BC", C), ("BR", C)):
        if name in cfg:
            cfg[name] = min(cfg[name], cap)
    return cfg


def fwd_states(k, v, g, initial_state, chunk_size):
    """(states_in [B,H,N,K,V], final_state [B,H,K,V]) fp32."""
    C = chunk_size
    (k, sk), (v, sv), (g, sg) = strided(k, C), strided(v, C), strided(g, C)
    h0 = None if initial_state is None else initial_state.contiguous()
    B, T, H, K = k.shape
    V, N = v.shape[-1], T // C
    bf16 = bf16_dots(k.device, k, v)
    cfg = _config("fwd_states", C, K, V, bf16, k.device)
    NK, NV = triton.cdiv(K, cfg["BK"]), triton.cdiv(V, cfg["BV"])
    states = k.new_empty(B, H, N, K, V, dtype=torch.float32)
    final = k.new_empty(B, H, K, V, dtype=torch.float32)
    _fwd_states_kernel[(NK * NV * B * H,)](
        k, v, g, h0 if h0 is not None else final, states, final, N, *sk, *sv, *sg,
        H=H, K=K, V=V, C=C, NK=NK, NV=NV, USE_H0=h0 is not None, BF16=bf16, **cfg,
    )  # fmt: skip
    return states, final


def intra_scores(q, k, g, chunk_size):
    """A [B, T, H, C] fp32: the intra-chunk scores (row t, column j of t's chunk), 0 above the diagonal."""
    C = chunk_size
    (q, sq), (k, sk), (g, sg) = strided(q, C), strided(k, C), strided(g, C)
    B, T, H, K = q.shape
    bf16 = bf16_dots(q.device, q, k)
    A = q.new_zeros(B, T, H, C, dtype=torch.float32)
    _intra_scores_kernel[(C // SUB_BLOCK * (T // C) * B * H,)](
        q, k, g, A, T, T // C, *sq, *sk, *sg,
        H=H, K=K, C=C, BT=SUB_BLOCK, BF16=bf16, **_config("intra_scores", C, K, K, bf16, q.device),
    )  # fmt: skip
    return A


def fwd_output(q, k, v, g, states_in, scale, chunk_size, *, out_dtype=torch.float32):
    """o [B, T, H, V] (fp32, or out_dtype) = scale * (A @ v + (q * exp(prefix)) @ states_in)."""
    C = chunk_size
    (q, sq), (v, sv), (g, sg) = strided(q, C), strided(v, C), strided(g, C)
    states_in = contiguous_fp32(states_in)
    B, T, H, K = q.shape
    V, N = v.shape[-1], T // C
    bf16 = bf16_dots(q.device, q, v)
    cfg = _config("output", C, K, V, bf16, q.device)
    NV = triton.cdiv(V, cfg["BV"])
    A = intra_scores(q, k, g, C)
    o = q.new_empty(B, T, H, V, dtype=out_dtype)
    _output_kernel[(NV * N * B * H,)](
        q, v, g, states_in, A, o, T, N, scale, *sq, *sv, *sg, H=H, K=K, V=V, C=C, NV=NV, BF16=bf16, **cfg
    )  # fmt: skip
    return o


def bwd(q, k, v, g, initial_state, do, d_final_state, scale, chunk_size, states_in=None):
    """(dq, dk, dv, dg, d_initial_state), fp32; do / d_final_state None are zero."""
    C = chunk_size
    (q, sq), (k, sk), (v, sv), (g, sg) = (strided(x, C) for x in (q, k, v, g))
    has_do = do is not None
    do, so = strided(do, C) if has_do else (v, sv)  # v: a placeholder when there is no do
    B, T, H, K = q.shape
    V, N = v.shape[-1], T // C
    bf16 = bf16_dots(q.device, q, k, v, do)
    if states_in is None:
        states_in = fwd_states(k, v, g, initial_state, C)[0]
    states_in, dS = contiguous_fp32(states_in), contiguous_fp32(d_final_state)
    d_ends = q.new_empty(B, H, N, K, V, dtype=torch.float32)
    dh0 = q.new_empty(B, H, K, V, dtype=torch.float32)
    cfg = _config("bwd_states", C, K, V, bf16, q.device)
    NK, NV = triton.cdiv(K, cfg["BK"]), triton.cdiv(V, cfg["BV"])
    _bwd_states_kernel[(NK * NV * B * H,)](
        q, g, do, dS if dS is not None else dh0, d_ends, dh0, N, scale, *sq, *sg, *so,
        H=H, K=K, V=V, C=C, NK=NK, NV=NV, HAS_DO=has_do, HAS_DS=dS is not None, BF16=bf16, **cfg,
    )  # fmt: skip
    dq = q.new_empty(B, T, H, K, dtype=torch.float32)
    dk = torch.empty_like(dq)
    dg = torch.empty_like(dq)
    dv = q.new_empty(B, T, H, V, dtype=torch.float32)
    A = dA = dq  # placeholders when there is no do (never read)
    if has_do:
        A = intra_scores(q, k, g, C)
        dA = q.new_empty(B, T, H, C, dtype=torch.float32)
        cfg = _config("score_grad", C, K, V, bf16, q.device)
        _score_grad_kernel[(C // cfg["BR"] * N * B * H,)](
            do, v, dA, T, N, scale, *so, *sv, H=H, V=V, C=C, BF16=bf16, **cfg
        )  # fmt: skip
        _intra_grad_kernel[(C // SUB_BLOCK * N * B * H,)](
            q, k, g, dA, dq, dk, T, N, *sq, *sk, *sg,
            H=H, K=K, C=C, BT=SUB_BLOCK, BF16=bf16, **_config("intra_grad", C, K, V, bf16, q.device),
        )  # fmt: skip
    cfg = _config("dv", C, K, V, bf16, q.device)
    NV = triton.cdiv(V, cfg["BV"])
    _dv_kernel[(NV * N * B * H,)](
        k, g, do, A, d_ends, dv, T, N, scale, *sk, *sg, *so,
        H=H, K=K, V=V, C=C, NV=NV, HAS_DO=has_do, BF16=bf16, **cfg,
    )  # fmt: skip
    cfg = _config("dqkg", C, K, V, bf16, q.device)
    NK = triton.cdiv(K, cfg["BK"])
    _dqkg_kernel[(NK * N * B * H,)](
        q, k, v, g, do, dA, states_in, d_ends, dq, dk, dg, T, N, scale, LOG_TINY_FP32, *sq, *sk, *sv, *sg, *so,
        H=H, K=K, V=V, C=C, NK=NK, HAS_DO=has_do, BF16=bf16, **cfg,
    )  # fmt: skip
    return dq, dk, dv, dg, dh0
