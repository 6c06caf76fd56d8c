"""Per-kernel benchmark: our Triton kernel vs its PyTorch reference vs torch.compile of the reference vs
the best public peer (fla chunk_gla; Liger RMSNorm, LayerNorm, RoPE, SwiGLU, cross-entropy).

    .venv/bin/python bench/kernels.py                 (CPU: references and compiled references only)
    python bench/kernels.py --device cuda             (GPU: all four, after a correctness check of each kernel)

Per op, one call = forward + backward (quantize: quantize + dequantize), on the shapes of OPS below (real
training shapes on a GPU; small ones on CPU). Before timing, on a device where our kernels run natively, the
kernel's outputs and gradients are checked against the reference (max relative error printed; over the
op's tolerance the script exits 1 after the table). Then every system is timed: --warmup calls, then
--repeats calls with the systems interleaved in every repeat; the figure is the median. GB/s = the bytes an
ideal fused implementation must move (each input read once, each output written once, forward and
backward; per op in OPS) / time, beside the device's copy bandwidth (measured here: dst.copy_(src), read +
write). GLA also gets TFLOP/s of its chunked form (FLOPs counted in gla_flops).

On CPU our Triton kernels would run in the interpreter, which is for correctness (tests/kernels/), not
speed: only the reference and its compiled version are timed, and the table says so. The last stdout
line is one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_zpp.ops import dispatch
from megatron_zpp.ops.gla import chunk_gla
from megatron_zpp.ops.norm import layer_norm, rms_norm
from megatron_zpp.ops.quantize import dequantize_wire, quantize_wire, wire_bytes
from megatron_zpp.ops.rope import apply_rope
from megatron_zpp.ops.swiglu import swiglu
from megatron_zpp.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy


@dataclass
class Op:
    shapes: dict  # "gpu" / "cpu" -> shape parameters
    make: Callable  # (shape, device, dtype) -> dict of inputs (leaves require grad)
    ours: Callable  # inputs -> list of output tensors (forward and, for a differentiable op, gradients)
    ideal_bytes: Callable  # inputs -> bytes an ideal fused fwd+bwd moves
    tol: float  # max relative error of the kernel vs the reference (bf16: in the output dtype)
    peer: Callable | None = None  # inputs -> outputs, with the peer library; None: no public peer
    peer_name: str = ""
    flops: Callable | None = None


def fwd_bwd(fn, inputs: dict, out_grad_seed: int = 0) -> list[torch.Tensor]:
    """fn(**inputs) -> output; backward with a fixed random cotangent; returns [output, *input grads]."""
    leaves = [t for t in inputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    for t in leaves:
        t.grad = None
    out = fn(**inputs)
    gen = torch.Generator(device=out.device).manual_seed(out_grad_seed)
    out.backward(torch.randn(out.shape, generator=gen, device=out.device, dtype=out.dtype))
    return [out.detach()] + [t.grad for t in leaves]


def leaf(shape, device, dtype, scale=1.0):
    return (torch.randn(shape, device=device, dtype=torch.float32) * scale).to(dtype).requires_grad_()


def elt(inputs: dict, key: str) -> int:
    t = inputs[key]
    return t.numel() * t.element_size()


# ---------------------------------------------------------------- the ops


def make_norm(s, device, dtype):
    rows, width = s
    return {"x": leaf((rows, width), device, dtype), "weight": leaf((width,), device, dtype), "eps": 1e-5}


def make_layer_norm(s, device, dtype):
    return {**make_norm(s, device, dtype), "bias": leaf((s[1],), device, dtype)}


def liger_rms_norm(x, weight, eps):
    from liger_kernel.transformers.functional import liger_rms_norm as fn

    return fn(x, weight, eps, in_place=False)


def liger_layer_norm(x, weight, bias, eps):
    from liger_kernel.transformers.functional import liger_layer_norm as fn

    return fn(x, weight, bias, eps)


def make_rope(s, device, dtype):
    B, T, H, D = s
    angles = torch.arange(T, device=device).float()[:, None] / 10000 ** (torch.arange(0, D, 2, device=device) / D)
    angles = torch.cat([angles, angles], -1)
    return {"x": leaf((B, T, H, D), device, dtype), "cos": angles.cos(), "sin": angles.sin()}


def liger_rope(x, cos, sin):
    from liger_kernel.transformers.functional import liger_rope as rope

    q = x.transpose(1, 2)  # Liger's layout [B, H, T, D]
    return rope(q, q[:, :0], cos, sin)[0].transpose(1, 2)


def make_swiglu(s, device, dtype):
    rows, ffn = s
    return {"h": leaf((rows, 2 * ffn), device, dtype)}


def liger_swiglu(h):
    from liger_kernel.transformers.functional import liger_swiglu as fn

    gate, up = h.chunk(2, dim=-1)
    return fn(gate, up)


def make_ce(s, device, dtype):
    rows, vocab = s
    return {"logits": leaf((rows, vocab), device, dtype), "labels": torch.randint(0, vocab, (rows,), device=device)}


def ours_ce(logits, labels):
    return vocab_parallel_cross_entropy(logits, labels, None).mean()


def liger_ce(logits, labels):
    from liger_kernel.transformers.functional import liger_cross_entropy

    return liger_cross_entropy(logits, labels)


def make_gla(s, device, dtype):
    B, T, H, D = s
    g = F.logsigmoid(torch.randn(B, T, H, D, device=device)) / 16
    return {
        "q": leaf((B, T, H, D), device, dtype),
        "k": leaf((B, T, H, D), device, dtype),
        "v": leaf((B, T, H, D), device, dtype),
        "g": g.requires_grad_(),
    }


def ours_gla(q, k, v, g):
    return chunk_gla(q, k, v, g, chunk_size=64)[0]


def fla_gla(q, k, v, g):
    from fla.ops.gla import chunk_gla as fla_chunk_gla

    return fla_chunk_gla(q, k, v, g)[0]


def gla_flops(x: dict) -> float:
    """Chunked GLA with chunk C = 64: intra-chunk scores and output 2 * 2*B*T*C*D*H/2 (causal half), states
    in and out 2 * 2*B*T*D*D*H; backward about twice the forward."""
    B, T, H, D = x["q"].shape
    fwd = 2 * B * T * 64 * D * H + 4 * B * T * D * D * H
    return 3 * fwd


def make_quant(s, device, dtype):
    (n,) = s
    return {"x": torch.randn(n // 1024, 1024, device=device).to(dtype)}


def quant_roundtrip(x, bits=4, block=64):
    wire = quantize_wire(x, block, bits)
    return [dequantize_wire(wire, x.shape[1], block, bits, torch.empty_like(x))]


OPS = {
    "rms_norm": Op(
        {"gpu": (16384, 4096), "cpu": (2048, 1024)},
        make_norm,
        lambda x, weight, eps: rms_norm(x, weight, eps),
        lambda x: 5 * elt(x, "x"),  # fwd: x -> y; bwd: x, dy -> dx (weight and its grad negligible)
        2e-2,
        liger_rms_norm,
        "Liger rms_norm",
    ),
    "layer_norm": Op(
        {"gpu": (16384, 4096), "cpu": (2048, 1024)},
        make_layer_norm,
        lambda x, weight, bias, eps: layer_norm(x, weight, bias, eps),
        lambda x: 5 * elt(x, "x"),
        2e-2,
        liger_layer_norm,
        "Liger layer_norm",
    ),
    "rope": Op(
        {"gpu": (2, 4096, 32, 128), "cpu": (1, 1024, 8, 64)},
        make_rope,
        lambda x, cos, sin: apply_rope(x, cos, sin),
        lambda x: 4 * elt(x, "x"),  # fwd read + write, bwd read + write
        2e-2,
        liger_rope,
        "Liger rope",
    ),
    "swiglu": Op(
        {"gpu": (16384, 11008), "cpu": (2048, 2048)},
        make_swiglu,
        lambda h: swiglu(h),
        lambda x: 2.5 * elt(x, "h"),  # fwd: h -> y (h/2); bwd: h, dy -> dh
        2e-2,
        liger_swiglu,
        "Liger swiglu",
    ),
    "cross_entropy": Op(
        {"gpu": (8192, 128256), "cpu": (1024, 8192)},
        make_ce,
        ours_ce,
        lambda x: 3 * elt(x, "logits"),  # fwd read; bwd read + write dlogits
        2e-2,
        liger_ce,
        "Liger cross_entropy",
    ),
    "gla": Op(
        {"gpu": (1, 8192, 16, 128), "cpu": (1, 2048, 4, 64)},
        make_gla,
        ours_gla,
        lambda x: 3 * sum(elt(x, k) for k in "qkvg"),  # fwd read q,k,v,g write o; bwd read them + do, write 4
        3e-2,
        fla_gla,
        "fla chunk_gla",
        gla_flops,
    ),
    "quantize_int4": Op(
        {"gpu": (1 << 26,), "cpu": (1 << 22,)},
        make_quant,
        quant_roundtrip,
        lambda x: 2 * elt(x, "x") + 2 * wire_bytes(x["x"].numel(), 64, 4),  # read x, write wire, read it, write
        1e-6,
    ),
}


# --smoke: every op once at a toy shape, no torch.compile (its compile alone takes minutes on CPU)
SMOKE_SHAPES = {
    "rms_norm": (64, 128),
    "layer_norm": (64, 128),
    "rope": (1, 32, 2, 16),
    "swiglu": (64, 128),
    "cross_entropy": (32, 256),
    "gla": (1, 128, 2, 16),
    "quantize_int4": (1 << 14,),
}

# ---------------------------------------------------------------- running


def sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def call(op: Op, fn, inputs: dict) -> list[torch.Tensor]:
    return fn(**inputs) if op is OPS["quantize_int4"] else fwd_bwd(fn, inputs)


def with_mode(mode: str, device: torch.device, fn):
    def run(**kw):
        dispatch.set_kernels(mode, device)
        return fn(**kw)

    return run


def systems_for(name: str, op: Op, device: torch.device, native: bool, compile: bool = True) -> dict[str, Callable]:
    systems = {"reference": with_mode("torch", device, op.ours)}
    if compile:
        systems["compiled ref"] = with_mode("torch", device, torch.compile(op.ours, dynamic=False))
    if native:
        systems["ours"] = with_mode("triton", device, op.ours)
        if op.peer and device.type == "cuda":
            systems[op.peer_name] = with_mode("torch", device, op.peer)
    return systems


def max_rel_err(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return max(((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item() for a, b in zip(got, ref))


def time_systems(op: Op, systems: dict, inputs: dict, device, warmup: int, repeats: int) -> dict[str, float]:
    for fn in systems.values():
        for _ in range(warmup):
            call(op, fn, inputs)
    times = {s: [] for s in systems}
    for _ in range(repeats):
        for s, fn in systems.items():  # interleaved: a load change hits every system alike
            sync(device)
            t = time.perf_counter()
            call(op, fn, inputs)
            sync(device)
            times[s].append(time.perf_counter() - t)
    return {s: statistics.median(ts) for s, ts in times.items()}


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    ap.add_argument("--ops", nargs="+", choices=list(OPS), default=list(OPS))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="seconds: toy shapes, one repeat, no torch.compile")
    a = ap.parse_args(argv)
    if a.smoke:
        a.warmup, a.repeats = 0, 1
    device = torch.device(a.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype or ("fp32" if device.type == "cpu" else "bf16")]
    native = device.type == "cuda" and dispatch.why_not_triton(device) is None
    where = "gpu" if device.type == "cuda" else "cpu"
    copy_bw = copy_bandwidth(device, 1 << (20 if a.smoke else 30 if where == "gpu" else 28))
    peers = {m: importlib.util.find_spec(m) is not None for m in ("fla", "liger_kernel")}
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), {dtype}, ")
    print(f"copy bandwidth {copy_bw / 1e9:.1f} GB/s; peers importable: {peers}")
    if not native:
        print(
            f"our Triton kernels not timed: {dispatch.why_not_triton(device) or 'not a CUDA device'} (the "
            "interpreter is for correctness: tests/kernels/); reference and torch.compile of it only"
        )
    results, failed = {}, []
    print(f"\n{'op':<14} {'shape':<22} {'system':<20} {'ms':>9} {'GB/s':>8} {'% copy':>7} {'TFLOP/s':>8} {'err':>9}")
    for name in a.ops:
        op = OPS[name]
        shape = SMOKE_SHAPES[name] if a.smoke else op.shapes[where]
        inputs = op.make(shape, device, dtype)
        systems = systems_for(name, op, device, native, compile=not a.smoke)
        ref = call(op, systems["reference"], inputs)
        errs = {s: max_rel_err(call(op, fn, inputs), ref) for s, fn in systems.items() if s != "reference"}
        if "ours" in errs and errs["ours"] > op.tol:
            failed.append(f"{name}: kernel vs reference {errs['ours']:.2e} > {op.tol:g}")
        times = time_systems(op, systems, inputs, device, a.warmup, a.repeats)
        nbytes, flops = op.ideal_bytes(inputs), op.flops(inputs) if op.flops else None
        results[name] = {}
        for s, t in times.items():
            gbs = nbytes / t
            tf = f"{flops / t / 1e12:8.2f}" if flops else f"{'-':>8}"
            err = f"{errs[s]:9.1e}" if s in errs else f"{'-':>9}"
            print(
                f"{name:<14} {str(shape):<22} {s:<20} {1e3 * t:9.3f} {gbs / 1e9:8.1f} {100 * gbs / copy_bw:6.1f}% "
                f"{tf} {err}"
            )
            results[name][s] = {"ms": 1e3 * t, "GBps": gbs / 1e9, "err": errs.get(s)}
        if "ours" in times:
            best_peer = min((t for s, t in times.items() if s not in ("ours",)), default=None)
            print(f"{'':<14} ours vs the fastest other: x{best_peer / times['ours']:.2f}")
    for f in failed:
        print(f"KERNEL MISMATCH {f}")
    print(
        json.dumps(
            {
                "bench": "kernels",
                "device": str(device),
                "dtype": str(dtype),
                "copy_GBps": copy_bw / 1e9,
                "native_kernels": native,
                "results": results,
                "failed": failed,
            }
        )
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
