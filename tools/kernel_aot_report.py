"""Ahead-of-time compile report of the non-GLA Triton kernels at production shapes, on a machine with no GPU.

Drives the real launch wrappers on meta tensors (megatron_zpp/testing/triton_aot.py) for sm_80 and sm_90
and prints, per launch: registers, spill bytes, shared memory, num_warps, grid problems and the global
memory instructions of the PTX (count x vector width x type), or the compile error. Run without
TRITON_INTERPRET=1:

    env -u TRITON_INTERPRET PYTHONPATH=. .venv/bin/python tools/kernel_aot_report.py [--json out.json] [family ...]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import re
import sys
import traceback

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megatron_zpp.testing import triton_aot as aot

META = torch.device("meta")
_MEM = re.compile(r"^\s*(?:@%p\d+\s+)?(ld|st)\.global((?:\.\w+)*)\s", re.M)


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, device=META, dtype=dtype)


def _wire_bytes(m: int, block: int, bits: int) -> int:
    return 4 * (m // block) + (m if bits == 8 else m // 2)


def quantize_cases():
    from megatron_zpp.kernels import quantize as Q

    # qwZ: int8 weights in blocks of 2048; qgZ: int4 gradients in blocks of 64 (the config defaults)
    for bits, block, r, m in ((8, 2048, 8, 2048 * 2048), (4, 64, 8, 64 * 65536)):
        for dtype in (torch.float32, torch.bfloat16):
            tag = f"int{bits} b{block} {str(dtype)[6:]}"
            x = _meta(r, m, dtype=dtype)
            wire = _meta(r, _wire_bytes(m, block, bits), dtype=torch.uint8)
            yield f"quantize {tag} RN", lambda x=x, w=wire, b=block, n=bits: Q.quantize(x, m, 0, m, r, m, w, b, n, None)
            yield f"quantize {tag} SR", lambda x=x, w=wire, b=block, n=bits: Q.quantize(x, m, 0, m, r, m, w, b, n, 7)
            if bits == 4:  # qgZ's reorder read in place: x [r, G=4, C] with a gap between groups
                xs = _meta(r, 4, 2 * m // 4, dtype=dtype)[:, :, : m // 4]
                yield (
                    f"quantize {tag} strided",
                    lambda x=xs, w=wire, b=block, n=bits: Q.quantize(
                        x, x.stride(0), x.stride(1), m // 4, r, m, w, b, n, None
                    ),
                )
            out = _meta(r, m, dtype=dtype)
            yield f"dequantize {tag}", lambda w=wire, o=out, b=block, n=bits: Q.dequantize(w, o, m, b, n)
        wire = _meta(r, _wire_bytes(m, block, bits), dtype=torch.uint8)
        out = _meta(m)
        for acc in (False, True):
            yield (
                f"dequantize_sum int{bits} b{block} acc={acc}",
                lambda w=wire, o=out, b=block, n=bits, a=acc: Q.dequantize_sum(w, o, m, b, n, a),
            )
        rows = r
        wout = _meta(rows, _wire_bytes(m // rows, block, bits), dtype=torch.uint8)
        for seed in (None, 7):
            yield (
                f"dequantize_sum_quantize int{bits} b{block} {'SR' if seed is not None else 'RN'}",
                lambda w=wire, o=wout, b=block, n=bits, s=seed: Q.dequantize_sum_quantize(
                    w, o, m, rows, m // rows // 2, b, n, s
                ),
            )


def norm_cases():
    from megatron_zpp.kernels import norm as N

    rows = 32768
    for n in (4096, 8192, 16384, 32768):
        for dtype in (torch.bfloat16, torch.float32):
            for rms in (True, False):
                tag = f"{'rms' if rms else 'ln'} n{n} {str(dtype)[6:]}"
                x, w = _meta(rows, n, dtype=dtype), _meta(n, dtype=dtype)
                b = None if rms else _meta(n, dtype=dtype)
                yield f"norm_fwd {tag}", lambda x=x, w=w, b=b: N.norm_fwd(x, w, b, 1e-5)
                mean = None if rms else _meta(rows)
                yield f"norm_bwd {tag}", lambda x=x, w=w, mean=mean: N.norm_bwd(x, x, w, mean, _meta(rows))


def rope_cases():
    from megatron_zpp.kernels import rope as R

    B, T, H, D = 2, 8192, 32, 128
    for dtype in (torch.bfloat16, torch.float32):
        qkv = _meta(B, T, 3 * H, D, dtype=dtype)[:, :, :H]  # q of a fused QKV projection
        cos, sin = _meta(T, D), _meta(T, D)
        for tr in (False, True):
            yield (
                f"rope {str(dtype)[6:]} {'bwd' if tr else 'fwd'}",
                lambda x=qkv, c=cos, s=sin, t=tr: R.rope(x, c, s, x, transpose=t),
            )


def swiglu_cases():
    from megatron_zpp.kernels import swiglu as S

    rows, F = 8192, 14336
    for dtype in (torch.bfloat16, torch.float32):
        h = _meta(rows, 2 * F, dtype=dtype)
        yield f"swiglu_fwd {str(dtype)[6:]}", lambda h=h: S.swiglu_fwd(h)
        yield f"swiglu_bwd {str(dtype)[6:]}", lambda h=h: S.swiglu_bwd(_meta(rows, F, dtype=h.dtype), h)


def ce_cases():
    from megatron_zpp.kernels import cross_entropy as C

    rows = 8192
    for V in (50304, 131072, 262144):
        for dtype in (torch.bfloat16, torch.float32):
            x, labels = _meta(rows, V, dtype=dtype), _meta(rows, dtype=torch.int64)
            tag = f"V{V} {str(dtype)[6:]}"
            yield f"ce_fwd {tag}", lambda x=x, lab=labels: C.ce_fwd_stats(x, lab)
            yield f"ce_bwd {tag}", lambda x=x, lab=labels: C.ce_bwd(x, lab, _meta(rows), _meta(rows))


FAMILIES = {
    "quantize": quantize_cases,
    "norm": norm_cases,
    "rope": rope_cases,
    "swiglu": swiglu_cases,
    "ce": ce_cases,
}


def _mem_summary(ptx: str) -> str:
    counts = collections.Counter()
    for op, mods in _MEM.findall(ptx):
        parts = [p for p in mods.split(".") if p and p not in ("global", "L1", "L2", "nc", "relaxed", "gpu")]
        parts = [p for p in parts if not p.startswith(("L1::", "L2::", "evict"))]
        counts[f"{op}.{'.'.join(parts)}"] += 1
    return " ".join(f"{n}x{k}" for k, n in sorted(counts.items()))


def compile_one(launch: aot.Launch, arch: int) -> dict:
    src = ASTSource(launch.fn, launch.signature, launch.constexprs, launch.attrs)
    log = io.StringIO()
    with aot._ptxas_log(), contextlib.redirect_stdout(log):
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=launch.options)
    report = aot._PTXAS.search(log.getvalue())
    stores, loads, regs = (int(x) for x in report.groups())
    return {
        "registers": regs,
        "spills": stores + loads,
        "shared": compiled.metadata.shared,
        "num_warps": launch.options.get("num_warps"),
        "num_stages": launch.options.get("num_stages"),
        "mem": _mem_summary(compiled.asm["ptx"]),
        "ftz_div": len(re.findall(r"div\.\w+\.ftz\.f32", compiled.asm["ptx"])),  # flushing fp32 divisions
    }


def run(families, archs=(80, 90)):
    rows = []
    for fam in families:
        for name, call in FAMILIES[fam]():
            for arch in archs:
                row = {"case": name, "arch": arch}
                try:
                    with aot.recording(arch) as launches:
                        call()
                    results = []
                    for launch in launches:
                        r = {
                            "kernel": launch.kernel,
                            "grid": list(launch.grid),
                            "grid_problems": aot.grid_problems(launch),
                        }
                        try:
                            r.update(compile_one(launch, arch))
                            r["shared_ok"] = r["shared"] <= aot.MAX_SHARED[arch]
                        except Exception as e:  # noqa: BLE001 - reported, not raised
                            r["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:160]}"
                        results.append(r)
                    row["launches"] = results
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}"[:200]
                    traceback.print_exc(file=sys.stderr)
                rows.append(row)
                _print(row)
    return rows


def _print(row):
    head = f"sm_{row['arch']} {row['case']:<44}"
    if "error" in row:
        print(f"{head} WRAPPER ERROR {row['error']}", flush=True)
        return
    for r in row["launches"]:
        if "error" in r:
            print(f"{head} {r['kernel']}: {r['error']}", flush=True)
            continue
        flags = "" if r["shared_ok"] and not r["grid_problems"] else f" PROBLEM {r['grid_problems']}"
        flags += f" ftz_div={r['ftz_div']}" if r["ftz_div"] else ""
        print(
            f"{head} {r['kernel']:<32} regs={r['registers']:3d} spills={r['spills']} shared={r['shared']}"
            f" warps={r['num_warps']} | {r['mem']}{flags}",
            flush=True,
        )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("families", nargs="*", default=list(FAMILIES))
    p.add_argument("--json")
    p.add_argument("--arch", type=int, nargs="*", default=[80, 90])
    a = p.parse_args()
    rows = run(a.families, tuple(a.arch))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
