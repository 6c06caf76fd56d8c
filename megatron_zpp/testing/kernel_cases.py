"""The kernel shapes that the ahead-of-time compile check (bench/compile_gpu.py) compiles and the GPU
check (bench/gpu_shapes.py) runs: one `Case` per call of the launch wrappers at one shape, on meta
tensors, and `all_cases()`, the full sweep with its CI subset marked."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from megatron_zpp.kernels import (
    cross_entropy,
    gdn,
    gla,
    grouped_gemm,
    kda,
    moe_permute,
    norm,
    quantize,
    rope,
    swiglu,
)
from megatron_zpp.ops.delta_rule import KERNEL_V
from megatron_zpp.ops.quantize import wire_bytes

META = torch.device("meta")
BF16, FP32 = torch.bfloat16, torch.float32
DTYPES = {"bf16": BF16, "fp32": FP32}


def empty(*shape, dtype=BF16):
    return torch.empty(*shape, device=META, dtype=dtype)


@dataclass(frozen=True)
class Case:
    """One call of the wrappers at one shape (`params` of its family's runner; bench/gpu_shapes.py runs the
    same shapes on a GPU). `strict`: a default configuration or a shape at risk, where spills fail the check
    (everywhere else they are reported)."""

    family: str
    name: str
    params: dict
    ci: bool = False
    strict: bool = False

    def run(self) -> None:
        RUNNERS[self.family](**self.params)()

    def device_bytes(self) -> int:
        """An upper bound of what bench/gpu_shapes.py holds on the GPU for this case: inputs, cotangents,
        the kernels' and the reference's outputs and gradients, the chunk states and three fp32 copies of
        the largest tensor for the reference's upcasts (the CI test keeps every CI case under 64 GiB, so
        the GPU check fits one 80 GB H100 with margin)."""
        return DEVICE_BYTES[self.family](**self.params)


# ---------------------------------------------------------------- the cases


def gla_case(B, T, H, D, C, dtype, h0):
    def run():
        q, g = empty(B, T, H, D, dtype=dtype), empty(B, T, H, D, dtype=FP32)
        state = empty(B, H, D, D, dtype=FP32) if h0 else None
        states, final = gla.fwd_states(q, q, g, state, C)
        gla.fwd_output(q, q, q, g, states, D**-0.5, C)
        gla.bwd(q, q, q, g, state, q, final if h0 else None, D**-0.5, C)  # recomputes the states, as training

    return run


def gdn_case(B, T, H, D, C, dtype, h0, V=None):
    """K = D key channels, V value channels (default D); a V wider than the kernels' KERNEL_V runs, as chunk_gdn
    runs it, in column groups of KERNEL_V: one launch each, all of the same shape (launched once here)."""

    def run():
        width = min(V or D, KERNEL_V)
        q, v, gate = empty(B, T, H, D, dtype=dtype), empty(B, T, H, width, dtype=dtype), empty(B, T, H, dtype=FP32)
        state = empty(B, H, D, width, dtype=FP32) if h0 else None
        gdn.fwd(q, q, v, gate, gate, state, D**-0.5, C)
        gdn.bwd(q, q, v, gate, gate, state, v, state, D**-0.5, C)  # recomputes the forward, as training

    return run


def kda_case(B, T, H, D, C, dtype, h0):
    def run():
        q, gate = empty(B, T, H, D, dtype=dtype), empty(B, T, H, D, dtype=FP32)
        beta, state = empty(B, T, H, dtype=FP32), empty(B, H, D, D, dtype=FP32) if h0 else None
        kda.fwd(q, q, q, gate, beta, state, D**-0.5, C)
        kda.bwd(q, q, q, gate, beta, state, q, state, D**-0.5, C)  # recomputes the forward, as training

    return run


def quant_case(bits, block, r, m, x_dtype, op, seed=None, accumulate=False, rows=8):
    def run():
        W = wire_bytes(m, block, bits)
        wire = empty(r, W, dtype=torch.uint8)
        if op == "quantize":
            x = empty(r, m, dtype=x_dtype)
            quantize.quantize(x, x.stride(0), m, m, r, m, wire, block, bits, seed)
        elif op == "dequantize":
            quantize.dequantize(wire, empty(r, m, dtype=x_dtype), m, block, bits)
        elif op == "dequantize_sum":
            quantize.dequantize_sum(wire, empty(m, dtype=FP32), m, block, bits, accumulate)
        else:  # qgZ's middle hop: the sum viewed [G, rows, chunk], out row j = [:, j, :]
            chunk = m // (rows * 8)
            out = empty(rows, wire_bytes(m // rows, block, bits), dtype=torch.uint8)
            quantize.dequantize_sum_quantize(wire, out, m, rows, chunk, block, bits, seed)

    return run


def norm_case(rows, n, dtype, rms):
    def run():
        x, w = empty(rows, n, dtype=dtype), empty(n, dtype=dtype)
        y, mean, rstd = norm.norm_fwd(x, w, None if rms else empty(n, dtype=dtype), 1e-5)
        norm.norm_bwd(x, x, w, mean, rstd)

    return run


def rope_case(B, T, H, D, dtype):
    def run():
        x, table = empty(B, T, H, D, dtype=dtype), empty(T, D, dtype=FP32)
        rope.rope(x, table, table, x)
        rope.rope(x, table, table, x, transpose=True)

    return run


def swiglu_case(rows, F, dtype):
    def run():
        h = empty(rows, 2 * F, dtype=dtype)
        swiglu.swiglu_bwd(swiglu.swiglu_fwd(h), h)

    return run


def ce_case(rows, V, dtype):
    def run():
        x, labels, stats = empty(rows, V, dtype=dtype), empty(rows, dtype=torch.int64), empty(rows, dtype=FP32)
        cross_entropy.ce_fwd_stats(x, labels)
        cross_entropy.ce_bwd(x, labels, stats, stats)
        cross_entropy.ce_bwd(x, labels, stats, stats, inplace=True)  # what the GPT's loss runs

    return run


def grouped_gemm_case(M, G, K, N, dtype):
    def run():
        x, w, dy = empty(M, K, dtype=dtype), empty(G, K, N, dtype=dtype), empty(M, N, dtype=dtype)
        offsets = empty(G + 1, dtype=torch.int64)
        grouped_gemm.gmm(x, w, offsets)  # forward
        grouped_gemm.gmm(dy, w, offsets, trans_w=True)  # dX
        grouped_gemm.gmm_wgrad(x, dy, offsets, dtype)  # dW

    return run


def moe_permute_case(N, K, H, dtype):
    def run():
        x, rows = empty(N, H, dtype=dtype), empty(N * K, H, dtype=dtype)
        index, inv, probs = empty(N * K, dtype=torch.int64), empty(N, K, dtype=torch.int64), empty(N * K, dtype=FP32)
        moe_permute.gather_rows(x, index)  # the permute
        moe_permute.slot_sum(rows, inv, probs, dtype)  # the unpermute (and the permute's backward, unscaled)
        moe_permute.gather_rows(x, index, probs)  # the unpermute's backward

    return run


def _size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _gla_bytes(B, T, H, D, C, dtype, h0):
    # q, k, v, dO, o, dq, dk, dv in dtype and g, dg in fp32; the chunk states three times (the forward's,
    # the backward's recomputed ones and their gradients); the reference runs one batch and head
    per_token, states = 8 * _size(dtype) + 8, 3 * -(-T // C) * D * D * 4
    return B * T * H * D * per_token + B * H * states + T * D * per_token + states


def _quantize_bytes(bits, block, r, m, x_dtype, op, seed=None, accumulate=False, rows=8):
    return 3 * r * m * _size(x_dtype) + 3 * r * wire_bytes(m, block, bits) + 3 * m * 4


def _gdn_bytes(B, T, H, D, C, dtype, h0, V=None):
    # as GLA's, with the WY factors (two [T, D] fp32 tensors a head) in place of the per-key gate (K != V: bounded
    # by the wider of the two)
    D = max(D, V or D)
    per_token, states = 8 * _size(dtype) + 16, 3 * -(-T // C) * D * D * 4
    return B * T * H * D * per_token + B * H * states + T * D * per_token + states


def _kda_bytes(B, T, H, D, C, dtype, h0):
    # as GDN's, with the per-key gate and its gradient and the backward's fp32 [T, D] buffers (dq, dk, dg and the
    # exponents' two gradients): twelve fp32 [T, D] tensors a head in all; the reference (one head) also holds its
    # pair decays' factors (log2 C levels of [T, D] fp32 and their gradients) and its [C, C] matrices ([T, C])
    per_token, states = 8 * _size(dtype) + 48, 3 * -(-T // C) * D * D * 4
    reference = (2 * C.bit_length() + 8) * T * D * 4 + 8 * T * C * 4
    return B * T * H * D * per_token + B * H * states + T * D * per_token + states + reference


# per kernel family: the launches of one case (on CPU tensors: the compile test intercepts them) and the device
# bytes its real-shape check needs (bench/gpu_shapes.py: the kernel and the reference)
FAMILIES = {
    "gla": (gla_case, _gla_bytes),
    "gdn": (gdn_case, _gdn_bytes),
    "kda": (kda_case, _kda_bytes),
    "quantize": (quant_case, _quantize_bytes),
    "norm": (norm_case, lambda rows, n, dtype, rms: rows * n * (6 * _size(dtype) + 12)),
    "rope": (rope_case, lambda B, T, H, D, dtype: B * T * H * D * (6 * _size(dtype) + 12)),
    "swiglu": (swiglu_case, lambda rows, F, dtype: rows * F * (9 * _size(dtype) + 24)),
    "cross_entropy": (ce_case, lambda rows, V, dtype: rows * V * (3 * _size(dtype) + 12)),
    # x, dx, y, dy and W, dW (kernel and reference), plus fp32 copies of the largest for the reference's upcasts
    "grouped_gemm": (
        grouped_gemm_case,
        lambda M, G, K, N, dtype: (
            (2 * M * (K + N) + 4 * G * K * N) * _size(dtype) + 3 * 4 * max(M * K, M * N, G * K * N)
        ),
    ),
}
FAMILIES["moe_permute"] = (  # tokens, routed copies and the combined output, kernel and reference (fp32 sums)
    moe_permute_case,
    lambda N, K, H, dtype: (2 * N * H + 2 * N * K * H) * _size(dtype) + 4 * N * (K + 1) * H,
)
RUNNERS = {family: runner for family, (runner, _) in FAMILIES.items()}
DEVICE_BYTES = {family: nbytes for family, (_, nbytes) in FAMILIES.items()}


def all_cases() -> list[Case]:
    """The full sweep; `ci` marks the CI subset: each kernel's default configuration (bf16, GLA chunk 64 at
    head dims 64/128/256, the ZeRO++ blocks int8/2048 and int4/64) and the shapes most at risk (the widest
    rows, more than 2^31 elements, more than 65535 chunks)."""
    return _linear_attention_cases() + _quantizer_cases() + _pointwise_cases()


# the linear-attention kernel families' sweeps: chunk lengths, head dims (K = V), and which heads the CI subset
# holds at the default configuration (C = 64, bf16). GDN's and KDA's kernels take C 16-64 and K, V <= 128, their widest
# heads in the CI subset; GLA's every width
LINEAR_SWEEPS = {
    "gla": ((16, 64, 128), (64, 128, 256), (64, 128, 256)),
    "gdn": ((16, 32, 64), (64, 128), (128,)),
    "kda": ((16, 32, 64), (64, 128), (128,)),
}
# at risk, at sizes that fit one 80 GB GPU (device_bytes): > 2^31 state elements (5*16*2048 chunks*128*128
# = 2.7e9) and > 65535 chunks in one sequence (2 heads of K=V=64: the chunk count is the risk, not the width)
LINEAR_AT_RISK = [
    ("[5,32768,16] >2^31 state elements", 5, 32768, 16, 128),
    ("[1,1048576,2] 65536 chunks", 1, 1 << 20, 2, 64),
]


def _linear_attention_cases() -> list[Case]:
    """The GLA, GDN and KDA chunk kernels: B=2, T=4096, H=16 (H is a constexpr; T, B only move the grid), then the
    shapes at risk."""
    cases = []
    for family, (chunks, dims, ci_dims) in LINEAR_SWEEPS.items():
        for C, D, dt, h0 in itertools.product(chunks, dims, ("bf16", "fp32"), (False, True)):
            default = C == 64 and dt == "bf16"
            name = f"{family} C={C} K=V={D} {dt}{' h0' if h0 else ''} [2,4096,16]"
            params = dict(B=2, T=4096, H=16, D=D, C=C, dtype=DTYPES[dt], h0=h0)
            cases.append(Case(family, name, params, default and D in ci_dims, default))
        for what, B, T, H, D in LINEAR_AT_RISK:
            params = dict(B=B, T=T, H=H, D=D, C=16, dtype=BF16, h0=True)
            cases.append(Case(family, f"{family} C=16 K=V={D} bf16 h0 {what}", params, True, True))
    # GDN at K != V (the full sweep; the CI subset's K = V = 128 differs from the first only by H): 32 value heads
    # (megatron-core's default) of K = 128 and V = 256 (run in column groups of 128), and a narrower K under V = 128
    for K, V in ((128, 256), (64, 128)):
        params = dict(B=2, T=4096, H=32, D=K, C=64, dtype=BF16, h0=True, V=V)
        cases.append(Case("gdn", f"gdn C=64 K={K} V={V} bf16 h0 [2,4096,32]", params, False, True))
    return cases


def _quantizer_cases() -> list[Case]:
    """ZeRO++'s qwZ and qgZ quantizers."""
    cases = []
    # ZeRO++ quantizers: qwZ int8 weights (block 2048), qgZ int4 gradients (block 64); 8 rows
    for bits, block in ((8, 2048), (4, 64)):
        for m, at_risk in ((1 << 24, False), (1 << 28, True)):  # 8 x 2^28 = 2^31 elements: at risk
            for dt in ("bf16", "fp32"):
                ci = dt == "bf16"
                tag = f"int{bits} block {block} [8,{m}] {dt}"
                ops = [("quantize", {}), ("dequantize", {})]
                ops += [("dequantize_sum", {"accumulate": False}), ("dequantize_sum", {"accumulate": True})]
                if bits == 4:
                    ops += [("quantize", {"seed": 1234}), ("dequantize_sum_quantize", {})]
                    ops += [("dequantize_sum_quantize", {"seed": 1234})]
                for op, kw in ops:
                    extra = "".join(f" {k}={v}" for k, v in kw.items())
                    params = dict(bits=bits, block=block, r=8, m=m, x_dtype=DTYPES[dt], op=op, **kw)
                    cases.append(Case("quantize", f"{op}{extra} {tag}", params, ci and at_risk, ci))
    return cases


def _pointwise_cases() -> list[Case]:
    """Norms, RoPE, SwiGLU and the cross-entropy."""
    cases = []
    # norms: widths up to 32768; 65540 rows x 32768 > 2^31 elements (bf16; fp32 at the widest rows only)
    for n in (1024, 2048, 4096, 8192, 16384, 32768):
        for dt in ("bf16", "fp32"):
            for rms in (True, False):
                rows = 65540 if n == 32768 and dt == "bf16" else 16384
                ci = (dt == "bf16" and n == 4096) or n == 32768  # the widest rows in both dtypes
                name = f"{'rms' if rms else 'layer'}_norm [{rows},{n}] {dt}"
                cases.append(Case("norm", name, dict(rows=rows, n=n, dtype=DTYPES[dt], rms=rms), ci, ci))
    # RoPE [B, T, H, D]: 8 x 16400 x 128 x 128 > 2^31 elements
    for B, T, H, D in ((2, 4096, 32, 128), (2, 4096, 16, 64), (2, 4096, 8, 256), (8, 16400, 128, 128)):
        for dt in ("bf16", "fp32"):
            ci = dt == "bf16" and D == 128
            cases.append(
                Case("rope", f"rope [{B},{T},{H},{D}] {dt}", dict(B=B, T=T, H=H, D=D, dtype=DTYPES[dt]), ci, ci)
            )
    # SwiGLU [rows, 2F]: 75000 x 28672 > 2^31 elements
    for rows, F in ((16384, 2816), (16384, 11008), (75000, 14336), (16384, 28672)):
        for dt in ("bf16", "fp32"):
            ci = dt == "bf16" and rows == 75000
            cases.append(
                Case("swiglu", f"swiglu [{rows},{2 * F}] {dt}", dict(rows=rows, F=F, dtype=DTYPES[dt]), ci, ci)
            )
    # cross-entropy: vocab 50k-256k; 8400 x 256000 > 2^31 elements
    for rows, V in ((8192, 50304), (8192, 128256), (8400, 256000)):
        for dt in ("bf16", "fp32"):
            ci = (dt == "bf16" and V == 50304) or V == 256000  # the widest vocabulary in both dtypes
            params = dict(rows=rows, V=V, dtype=DTYPES[dt])
            cases.append(Case("cross_entropy", f"cross_entropy [{rows},{V}] {dt}", params, ci, ci))
    # grouped GEMM (the MoE experts): Qwen3-MoE-like fc1 (h 2048 -> 2 x 768, 128 experts) and fc2, a ragged
    # shape (widths not multiples of 16: other tiles), and M x K > 2^31 (270000 routed tokens x 8192); the CI
    # subset holds one config of each tile choice (bf16 aligned, fp32 aligned, unaligned)
    for M, G, K, N, at_risk in (
        (32768, 128, 2048, 1536, False),
        (32768, 128, 768, 2048, False),
        (1000, 7, 1000, 333, False),
        (270000, 8, 8192, 1024, True),
    ):
        for dt in ("bf16", "fp32"):
            ci = (dt == "bf16" and (at_risk or K == 2048)) or M == 1000 or (dt == "fp32" and K == 2048)
            params = dict(M=M, G=G, K=K, N=N, dtype=DTYPES[dt])
            cases.append(Case("grouped_gemm", f"grouped_gemm [{M},{K}]x[{G},{K},{N}] {dt}", params, ci, ci))
    # the MoE token permutation: 32768 tokens top-8 at hidden 2048 (Qwen3-MoE-like), and N x K x H > 2^31 rows
    # (65536 tokens x top-8 x 8192)
    for N, K, H in ((32768, 8, 2048), (65536, 8, 8192)):
        for dt in ("bf16", "fp32"):
            params = dict(N=N, K=K, H=H, dtype=DTYPES[dt])
            ci = dt == "bf16" or H == 2048
            cases.append(Case("moe_permute", f"moe_permute [{N}x{K},{H}] {dt}", params, ci, ci))
    return cases
