"""Ahead-of-time compile of every Triton kernel for sm_80 and sm_90, on CPU, no GPU needed.

The compile runs in a subprocess without TRITON_INTERPRET=1 (tests/conftest.py sets it here): the CI subset
of bench/compile_gpu.py (each kernel's default configuration and the shapes most at risk, through the real
launch wrappers as on a CUDA device). Per check and arch one test, whose failure names every failing
kernel, configuration and shape: it compiles; no register spills; shared memory under the target's limit;
pointer offsets that can pass 2^31 elements computed in 64 bits; grids within CUDA's limits. A kernel
that does not compile fails; nothing is skipped. The full sweep is `python -m bench.compile_gpu`.

The 64-bit offset checker (megatron_zpp/testing/triton_aot.int32_offsets) is itself checked both ways on a
known-bad and a known-good kernel pair below (compiled by the same subprocess route: `python -m
tests.kernels.test_compile_gpu`) and on a hand-written TTIR loop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARCHS = (80, 90)
CHECKS = ("compile", "spills", "shared", "int64", "grid")
# the CI subset takes about 2 minutes on 2 idle cores (printed); a loaded machine gets more than the default
pytestmark = pytest.mark.timeout(1800)


def _compile_process(*args: str, timeout: int) -> dict:
    """Run `python *args` from the repo root without the interpreter; its last stdout line is JSON."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the GPU default, stated (silences Triton's warning)
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"`python {' '.join(args)}` printed no JSON (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def ci_rows() -> list[dict]:
    t = time.perf_counter()
    out = _compile_process("-m", "bench.compile_gpu", "--ci", "--json", timeout=1700)
    print(
        f"\ncompile_gpu --ci: {len(out['rows'])} compiles in {out['seconds']:.1f} s ({time.perf_counter() - t:.1f} s)"
    )
    return out["rows"]


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("arch", ARCHS)
def test_ci_subset(ci_rows, arch, check):
    rows = [r for r in ci_rows if r["arch"] == arch]
    assert rows, f"no compiles for sm_{arch}"
    bad = [
        f"{r['kernel']} [{r['config']}; {r['dtypes']}] at {'; '.join(r['cases'])}:\n    {r['problems'][check]}"
        for r in rows
        if check in r["problems"]
    ]
    assert not bad, f"sm_{arch} {check}: {len(bad)} of {len(rows)} compiles fail:\n" + "\n".join(bad)


def test_every_kernel_is_compiled(ci_rows):
    from megatron_zpp.kernels import (
        cross_entropy,
        delta_rule,
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

    modules = (cross_entropy, delta_rule, gdn, gla, grouped_gemm, kda, moe_permute, norm, quantize, rope, swiglu)
    kernels = {name for m in modules for name in vars(m) if name.startswith("_") and name.endswith("_kernel")}
    for arch in ARCHS:
        compiled = {r["kernel"] for r in ci_rows if r["arch"] == arch}
        assert kernels <= compiled, f"sm_{arch}: not in the CI subset: {sorted(kernels - compiled)}"


def test_ci_subset_has_the_shapes_at_risk(ci_rows):
    """More than 2^31 GLA state elements and more than 65535 chunks (the grid check must see them)."""
    cases = {c for r in ci_rows for c in r["cases"]}
    assert any(">2^31 state elements" in c for c in cases) and any("65536 chunks" in c for c in cases)


# ---------------------------------------------------------------- the checker, checked


@triton.jit
def _bad_offsets_kernel(x_ptr, y_ptr, n_cols, n_tiles, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n_cols + cols)  # i32 program id x argument: flagged
    for i in range(n_tiles):
        x += tl.load(x_ptr + i * BLOCK + cols)  # i32 loop counter x constant: flagged
    tl.store(y_ptr + n_cols * n_tiles + cols, x)  # i32 argument x argument: flagged


@triton.jit
def _good_offsets_kernel(x_ptr, y_ptr, n_cols, n_tiles, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n_cols + cols)
    for i in range(n_tiles):
        x += tl.load(x_ptr + i.to(tl.int64) * BLOCK + cols)
    tile = tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :]  # ranges x constants: bounded
    strided = tl.arange(0, 16)[:, None] * n_cols + tl.arange(0, 16)[None, :]  # a range x one stride: bounded
    strided += (tl.program_id(0) % 4) * 16  # a program id modulo a constant: bounded
    tl.store(y_ptr + n_cols.to(tl.int64) * n_tiles + cols, x)
    tl.store(y_ptr + tile, tl.zeros([16, 16], dtype=tl.float32))
    tl.store(y_ptr + strided, tl.zeros([16, 16], dtype=tl.float32))


def checker_pair() -> dict:
    """Compile the pair for sm_90 (this must run without the interpreter) and check their TTIR."""
    import inspect

    import torch

    from megatron_zpp.testing import triton_aot

    x = torch.empty(1 << 20, device="meta")
    with triton_aot.recording(90) as launches:
        _bad_offsets_kernel[(64,)](x, x, 4096, 8, BLOCK=256)
        _good_offsets_kernel[(64,)](x, x, 4096, 8, BLOCK=256)
    out = {}
    for launch in launches:
        lines = inspect.getsourcelines(launch.fn.fn)
        flagged = triton_aot.int32_offsets(triton_aot.compile_launch(launch, 90).ttir)
        out[launch.kernel] = {"first_line": lines[1], "source": lines[0], "flagged": flagged}
    return out


def test_int32_checker_on_known_pair():
    out = _compile_process("-m", "tests.kernels.test_compile_gpu", timeout=300)
    bad, good = out["_bad_offsets_kernel"], out["_good_offsets_kernel"]
    assert good["flagged"] == [], good["flagged"]
    here = os.path.basename(__file__)
    expected = {
        f"{here}:{bad['first_line'] + i}" for i, line in enumerate(bad["source"]) if line.rstrip().endswith("flagged")
    }
    assert len(expected) == 3
    found = {f.split(" ")[0] for f in bad["flagged"]}
    assert found == expected, (bad["flagged"], expected)


def test_int32_checker_follows_loop_carried_offsets():
    """An offset accumulated over an scf.for (iter_args and scf.yield) from a product of the loop counter."""
    from megatron_zpp.testing.triton_aot import int32_offsets

    ttir = """
#loc3 = loc("k.py":7:1)
module {
  tt.func public @k(%x_ptr: !tt.ptr<f32> loc(#loc3), %n: i32 loc(#loc3)) attributes {noinline = false} {
    %c0_i32 = arith.constant 0 : i32 loc(#loc3)
    %c1_i32 = arith.constant 1 : i32 loc(#loc3)
    %c64_i32 = arith.constant 64 : i32 loc(#loc3)
    %off = scf.for %i = %c0_i32 to %n step %c1_i32 iter_args(%acc = %c0_i32) -> (i32)  : i32 {
      %p = arith.muli %i, %c64_i32 : i32 loc(#loc3)
      %s = arith.addi %acc, %p : i32 loc(#loc3)
      scf.yield %s : i32 loc(#loc3)
    } loc(#loc3)
    %bounded = arith.muli %c64_i32, %c64_i32 : i32 loc(#loc4)
    %q = tt.addptr %x_ptr, %bounded : !tt.ptr<f32>, i32 loc(#loc4)
    %r = tt.addptr %x_ptr, %off : !tt.ptr<f32>, i32 loc(#loc5)
    tt.return loc(#loc3)
  } loc(#loc3)
} loc(#loc3)
#loc4 = loc("k.py":11:2)
#loc5 = loc("k.py":12:2)
"""
    assert int32_offsets(ttir) == ["k.py:12 (i32)"]


if __name__ == "__main__":  # the subprocess of test_int32_checker_on_known_pair
    print(json.dumps(checker_pair()))


def test_gpu_check_cases_fit_one_80gb_gpu():
    """bench/gpu_shapes.py runs the CI subset on one GPU (bench/gpu_check.sh): every case's upper bound
    stays under 64 GiB (an H100's 80 GB with margin), and each at-risk case keeps its risk."""
    from megatron_zpp.testing.kernel_cases import all_cases

    ci = [c for c in all_cases() if c.ci]
    too_big = {c.name: round(c.device_bytes() / 2**30, 1) for c in ci if c.device_bytes() > 64 * 2**30}
    assert not too_big, f"over 64 GiB on the GPU: {too_big}"
    # the risks themselves: > 2^31 elements in one tensor, > 65535 chunks in one sequence
    gla = [c.params for c in ci if c.family == "gla"]
    assert any(p["B"] * p["H"] * -(-p["T"] // p["C"]) * p["D"] ** 2 > 2**31 for p in gla)
    assert any(-(-p["T"] // p["C"]) > 65535 for p in gla)
    widest = {"norm": lambda p: p["rows"] * p["n"], "rope": lambda p: p["B"] * p["T"] * p["H"] * p["D"]}
    widest |= {"swiglu": lambda p: p["rows"] * 2 * p["F"], "cross_entropy": lambda p: p["rows"] * p["V"]}
    for family, numel in widest.items():
        assert any(numel(c.params) > 2**31 for c in ci if c.family == family), family
