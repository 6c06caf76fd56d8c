"""The compile test's shapes run for real: each kernel against its PyTorch reference, max error printed.

    python -m bench.gpu_shapes --device cuda                     (bench/gpu_check.sh, stage 2)
    TRITON_INTERPRET=1 .venv/bin/python -m bench.gpu_shapes --device cpu --scale 1024   (CPU dry run)

The cases are bench/compile_gpu.py's CI subset (--all: the full sweep), at their shapes: each kernel's
default configuration and the shapes at risk (more than 2^31 elements, more than 65535 GLA/GDN/KDA chunks). The
kernels run the whole shape through the ops (megatron_zpp/ops, --kernels triton), forward and backward;
the reference (--kernels torch) runs the whole shape too, except GLA, GDN and KDA, whose references run the last
batch and head only (the far end of every tensor, where 64-bit offsets matter; both are independent per batch
and head). Error per output: |got - ref| / |ref| (L2 norms, as bench/kernels.py); the quantizer's wire bytes
must match exactly. --scale N divides the large dims (a dry run of the logic on CPU, under the
interpreter). Exit status 1 if any case is over its tolerance; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from megatron_zpp.ops import dispatch
from megatron_zpp.ops import quantize as q_ops
from megatron_zpp.ops.cross_entropy import local_stats, softmax_grad
from megatron_zpp.ops.gdn import chunk_gdn
from megatron_zpp.ops.gla import chunk_gla
from megatron_zpp.ops.grouped_gemm import grouped_mm
from megatron_zpp.ops.kda import chunk_kda
from megatron_zpp.ops.norm import layer_norm, rms_norm
from megatron_zpp.ops.rope import apply_rope
from megatron_zpp.ops.swiglu import swiglu
from megatron_zpp.testing.kernel_cases import all_cases

TOL = {torch.bfloat16: 3e-2, torch.float32: 1e-4}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.float(), ref.float()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def randn(shape, device, dtype, seed, scale=1.0):
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=device) * scale).to(dtype)


def both(device, fn):
    """fn() with the kernels, then with the references: (kernel outputs, reference outputs)."""
    out = {}
    for mode in ("triton", "torch"):
        dispatch.set_kernels(mode, device)
        out[mode] = fn()
    dispatch.set_kernels("auto", device)
    return out["triton"], out["torch"]


def grads(fn, inputs: list[torch.Tensor], cotangents: list[torch.Tensor]) -> list[torch.Tensor]:
    """[outputs..., input grads...] of fn(*inputs) backpropagated with the given cotangents."""
    leaves = [x.detach().requires_grad_() for x in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(outs, cotangents)
    return [o.detach() for o in outs] + [x.grad for x in leaves]


# ---------------------------------------------------------------- per family: {output name: error}


def check_gla(device, B, T, H, D, C, dtype, h0):
    q, k, v = (randn((B, T, H, D), device, dtype, s) for s in (1, 2, 3))
    g = F.logsigmoid(randn((B, T, H, D), device, torch.float32, 4)) / 16
    state = randn((B, H, D, D), device, torch.float32, 5) if h0 else None
    do = randn((B, T, H, D), device, dtype, 6)
    dS = randn((B, H, D, D), device, torch.float32, 7) if h0 else None

    def run(q, k, v, g, state, do, dS):
        inputs = [q, k, v, g] + ([state] if h0 else [])

        def fn(q, k, v, g, *s):
            o, final = chunk_gla(q, k, v, g, initial_state=s[0] if s else None, output_final_state=h0, chunk_size=C)
            return (o, final) if h0 else o

        return grads(fn, inputs, [do, dS] if h0 else [do])

    names = ["o"] + (["final"] if h0 else []) + ["dq", "dk", "dv", "dg"] + (["dh0"] if h0 else [])
    dispatch.set_kernels("triton", device)
    got = run(q, k, v, g, state, do, dS)
    dispatch.set_kernels("torch", device)
    last = lambda x: x[-1:, :, -1:].contiguous()  # noqa: E731 (the last batch and head)
    last_state = lambda x: None if x is None else x[-1:, -1:].contiguous()  # noqa: E731
    ref = run(last(q), last(k), last(v), last(g), last_state(state), last(do), last_state(dS))
    dispatch.set_kernels("auto", device)
    out = {}
    for name, a, b in zip(names, got, ref):
        out[name] = rel_err(last_state(a) if name in ("final", "dh0") else last(a), b)
    return out


def _check_delta_rule(op, per_key, device, B, T, H, D, C, dtype, h0, V=None):
    """A gated delta rule op (chunk_gdn: a gate per head; chunk_kda: per key channel) on the kernels against its
    chunked PyTorch form on the last batch and head; K = D, V value channels (default D)."""
    V = V or D
    q, k = (F.normalize(randn((B, T, H, D), device, torch.float32, s), dim=-1).to(dtype) for s in (1, 2))
    v = randn((B, T, H, V), device, dtype, 3)
    g = F.logsigmoid(randn((B, T, H, D) if per_key else (B, T, H), device, torch.float32, 4)) / 16
    beta = torch.sigmoid(randn((B, T, H), device, torch.float32, 8)).to(dtype)
    state = randn((B, H, D, V), device, torch.float32, 5) if h0 else None
    do = randn((B, T, H, V), device, dtype, 6)
    dS = randn((B, H, D, V), device, torch.float32, 7) if h0 else None

    def run(q, k, v, g, beta, state, do, dS):
        def fn(q, k, v, g, beta, *s):
            o, final = op(q, k, v, g, beta, None, s[0] if s else None, h0, C)
            return (o, final) if h0 else o

        return grads(fn, [q, k, v, g, beta] + ([state] if h0 else []), [do, dS] if h0 else [do])

    names = ["o"] + (["final"] if h0 else []) + ["dq", "dk", "dv", "dg", "dbeta"] + (["dh0"] if h0 else [])
    dispatch.set_kernels("triton", device)
    got = run(q, k, v, g, beta, state, do, dS)
    dispatch.set_kernels("torch", device)  # the reference on the last batch and head, as GLA's
    last = lambda x: x[-1:, :, -1:].contiguous()  # noqa: E731
    last_state = lambda x: None if x is None else x[-1:, -1:].contiguous()  # noqa: E731
    ref = run(last(q), last(k), last(v), last(g), last(beta), last_state(state), last(do), last_state(dS))
    dispatch.set_kernels("auto", device)
    out = {}
    for name, a, b in zip(names, got, ref):
        out[name] = rel_err(last_state(a) if name in ("final", "dh0") else last(a), b)
    return out


def check_gdn(device, B, T, H, D, C, dtype, h0, V=None):
    return _check_delta_rule(chunk_gdn, False, device, B, T, H, D, C, dtype, h0, V)


def check_kda(device, B, T, H, D, C, dtype, h0):
    return _check_delta_rule(chunk_kda, True, device, B, T, H, D, C, dtype, h0)


def check_quantize(device, bits, block, r, m, x_dtype, op, seed=None, accumulate=False, rows=8):
    x = randn((r, m), device, x_dtype, 11)
    stochastic = seed is not None
    gen = lambda: torch.Generator().manual_seed(seed or 0)  # noqa: E731 (the same seed draw for both)
    dispatch.set_kernels("torch", device)
    wire = q_ops.quantize_wire(x, block, bits)
    if op == "quantize":
        got, ref = both(device, lambda: q_ops.quantize_wire(x, block, bits, stochastic, gen()))
        return {"wire bytes differing": (got != ref).sum().item()}
    if op == "dequantize":
        got, ref = both(device, lambda: q_ops.dequantize_wire(wire, m, block, bits, torch.empty_like(x)))
        return {"out": rel_err(got, ref)}
    if op == "dequantize_sum":
        start = randn((m,), device, torch.float32, 12)
        got, ref = both(device, lambda: q_ops.dequantize_sum_wire(wire, m, block, bits, start.clone(), accumulate))
        return {"sum": rel_err(got, ref)}
    chunk = m // (rows * 8)
    got, ref = both(
        device, lambda: q_ops.dequantize_sum_quantize_wire(wire, m, block, bits, rows, chunk, stochastic, gen())
    )
    return {"wire bytes differing": (got != ref).sum().item()}


def check_norm(device, rows, n, dtype, rms):
    x, w, b = randn((rows, n), device, dtype, 21), randn((n,), device, dtype, 22), randn((n,), device, dtype, 23)
    dy = randn((rows, n), device, dtype, 24)
    if rms:
        fn, inputs, names = (lambda x, w: rms_norm(x, w, 1e-5)), [x, w], ["y", "dx", "dw"]
    else:
        fn, inputs, names = (lambda x, w, b: layer_norm(x, w, b, 1e-5)), [x, w, b], ["y", "dx", "dw", "db"]
    got, ref = both(device, lambda: grads(fn, inputs, [dy]))
    return {name: rel_err(a, b) for name, a, b in zip(names, got, ref)}


def check_rope(device, B, T, H, D, dtype):
    angles = torch.arange(T, device=device).float()[:, None] / 10000 ** (torch.arange(0, D, 2, device=device) / D)
    angles = torch.cat([angles, angles], -1)
    cos, sin = angles.cos(), angles.sin()
    x, dy = randn((B, T, H, D), device, dtype, 31), randn((B, T, H, D), device, dtype, 32)
    got, ref = both(device, lambda: grads(lambda x: apply_rope(x, cos, sin), [x], [dy]))
    return {name: rel_err(a, b) for name, a, b in zip(["out", "dx"], got, ref)}


def check_swiglu(device, rows, F, dtype):
    h, dy = randn((rows, 2 * F), device, dtype, 41), randn((rows, F), device, dtype, 42)
    got, ref = both(device, lambda: grads(swiglu, [h], [dy]))
    return {name: rel_err(a, b) for name, a, b in zip(["y", "dh"], got, ref)}


def check_cross_entropy(device, rows, V, dtype):
    x = randn((rows, V), device, dtype, 51, scale=4.0)
    labels = torch.randint(0, V, (rows,), generator=torch.Generator(device=device).manual_seed(52), device=device)
    labels[::7] = V + 3  # some rows' labels in another rank's slice
    dloss = randn((rows,), device, torch.float32, 53)

    def run():
        row_max, sum_exp, target = local_stats(x, labels)
        lse = row_max.float() + sum_exp.float().log()
        return [row_max, sum_exp, target, softmax_grad(x, labels, lse, dloss)]

    got, ref = both(device, run)
    return {name: rel_err(a, b) for name, a, b in zip(["max", "sum_exp", "target", "dx"], got, ref)}


def check_grouped_gemm(device, M, G, K, N, dtype):
    """The experts' grouped GEMM: uneven groups (one empty), forward, dX and dW against the per-expert loop."""
    gen = torch.Generator().manual_seed(61)
    cuts = torch.sort(torch.randint(0, M + 1, (G - 1,), generator=gen)).values
    sizes = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([M])]))
    sizes[G // 2] += sizes[0]  # group 0 empty: the kernels must skip it
    sizes[0] = 0
    x, w = randn((M, K), device, dtype, 62, K**-0.5), randn((G, K, N), device, dtype, 63)
    dy = randn((M, N), device, dtype, 64)
    sizes = sizes.to(device)
    got, ref = both(device, lambda: grads(lambda x, w: grouped_mm(x, w, sizes), [x, w], [dy]))
    return {name: rel_err(a, b) for name, a, b in zip(["y", "dx", "dw"], got, ref)}


CHECKS = {
    "gla": check_gla,
    "gdn": check_gdn,
    "kda": check_kda,
    "quantize": check_quantize,
    "norm": check_norm,
    "rope": check_rope,
}
CHECKS |= {"swiglu": check_swiglu, "cross_entropy": check_cross_entropy, "grouped_gemm": check_grouped_gemm}


def scaled(family: str, p: dict, s: int) -> dict:
    """The case's shape with its large dims divided by s (at least the kernels' minimum)."""
    if s == 1:
        return p
    p = dict(p)
    if family in ("gla", "gdn", "kda"):
        p |= {"B": min(p["B"], 2), "H": min(p["H"], 2), "T": max(2 * p["C"], p["T"] // s // p["C"] * p["C"])}
    elif family == "quantize":
        p |= {"m": max(p.get("rows", 8) * 8 * p["block"], p["m"] // s)}
    elif family in ("norm", "swiglu", "cross_entropy"):
        p |= {"rows": max(4, p["rows"] // s)}
    elif family == "rope":
        p |= {"B": 1, "T": max(8, p["T"] // s), "H": min(p["H"], 4)}
    elif family == "grouped_gemm":
        p |= {"M": max(2 * p["G"], p["M"] // s), "K": max(16, p["K"] // s), "N": max(16, p["N"] // s)}
    return p


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--all", action="store_true", help="the full sweep's shapes, not only the CI subset's")
    ap.add_argument("--family", nargs="+", default=None)
    ap.add_argument("--scale", type=int, default=1, help="divide the large dims by this (CPU dry run)")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_shapes: needs a CUDA GPU, and none is here (a CPU dry run: --device cpu --scale 1024)")
    if dispatch.why_not_triton(device):
        sys.exit(f"gpu_shapes: the kernels cannot run on {device}: {dispatch.why_not_triton(device)}")
    cases = [c for c in all_cases() if (a.all or c.ci) and (a.family is None or c.family in a.family)]
    results, failed = [], []
    print(f"{'case':<70} {'max err':>9} {'tol':>7} {'s':>6}  per output")
    for case in cases:
        p = scaled(case.family, case.params, a.scale)
        dtype = p.get("dtype", p.get("x_dtype"))
        t = time.perf_counter()
        try:
            errs = CHECKS[case.family](device, **p)
            error = None
        except Exception as e:  # noqa: BLE001 (a kernel that fails at a real shape is a result)
            errs, error = {}, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        seconds = time.perf_counter() - t
        tol = 0 if "wire bytes differing" in errs else TOL[dtype]  # the wire is bitwise the reference's
        worst = max(errs.values(), default=float("nan"))
        ok = error is None and worst <= tol
        detail = error or " ".join(f"{k}={v:.1e}" if isinstance(v, float) else f"{k}={v}" for k, v in errs.items())
        print(f"{case.name:<70} {worst:9.2e} {tol:7.0e} {seconds:6.1f}  {'' if ok else 'FAIL '}{detail}", flush=True)
        results.append({"case": case.name, "params": {k: str(v) for k, v in p.items()}, "errors": errs,
                        "max_err": worst, "tol": tol, "error": error, "seconds": seconds, "ok": ok})  # fmt: skip
        if not ok:
            failed.append(case.name)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"{len(cases) - len(failed)} of {len(cases)} cases within tolerance")
    print(json.dumps({"bench": "gpu_shapes", "device": str(device), "scale": a.scale, "results": results,
                      "failed": failed}))  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
