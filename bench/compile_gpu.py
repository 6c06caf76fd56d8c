"""Ahead-of-time compile of every Triton kernel for sm_80 and sm_90 on a machine with no GPU.

    .venv/bin/python -m bench.compile_gpu                 (the full sweep: every kernel x shape x dtype)
    .venv/bin/python -m bench.compile_gpu --ci --json     (the CI subset: tests/kernels/test_compile_gpu.py)
    .venv/bin/python -m bench.compile_gpu --markdown bench/results/compile_gpu.md

Under another Triton (NVIDIA's PyTorch image ships 3.6 with torch 2.11): the compile needs only triton and
our kernel sources, so put that version first on the path (torch 2.13 imports beside it):

    .venv/bin/python -m pip install --no-deps --target /tmp/triton36 triton==3.6.0
    PYTHONPATH=/tmp/triton36 .venv/bin/python -m bench.compile_gpu --ci \
        --markdown bench/results/compile_gpu_ci_triton36.md

Each case calls the real launch wrappers (megatron_zpp/kernels/*.py) on meta tensors of the real shapes
inside kernels.target.tuned_for(arch), so the block sizes, warps, stages and dtype choices are those of a
CUDA launch; each distinct launch (kernel, signature, constexprs, specialization, options) is compiled once
to a cubin by the ptxas of Triton's wheel (megatron_zpp/testing/triton_aot.py). Per compile: registers,
spill bytes (ptxas -v), shared memory against the target's limit, the 32-bit pointer offsets built from
unbounded products (triton_aot.int32_offsets on the TTIR), and per case the grid axes past CUDA's limits.

The checks (`problems`): it compiles; no spills where the case is a kernel's default configuration or a
shape at risk (the CI subset is exactly those; the full sweep reports spills everywhere); shared memory
under the limit; no 32-bit unbounded offsets; the grid within limits. Exit status 1 if any check fails.

Run without TRITON_INTERPRET=1 (under the interpreter `triton.jit` builds no compilable function).
The last stdout line with --json is one JSON object.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import sys
import time

import triton

from megatron_zpp.testing import triton_aot
from megatron_zpp.testing.kernel_cases import Case, all_cases

ARCHS = (80, 90)
# ---------------------------------------------------------------- record, compile, check

_LAUNCHES: list = []  # (arch, Launch) for the forked workers


def _param(launch, key) -> str:
    return launch.fn.arg_names[key[0]] if isinstance(key, tuple) else str(key)


def describe(launch) -> dict:
    """A launch's configuration in words: constexprs by name, warps, stages, the pointers' dtypes."""
    consts = " ".join(f"{_param(launch, k)}={v}" for k, v in launch.constexprs.items())
    dtypes = sorted({t[1:] for t in launch.signature.values() if t.startswith("*")})
    opts = launch.options
    return {"config": f"{consts} w{opts.get('num_warps')} s{opts.get('num_stages')}", "dtypes": "/".join(dtypes)}


def _compile(index: int) -> dict:
    arch, launch = _LAUNCHES[index]
    t = time.perf_counter()
    try:
        c = triton_aot.compile_launch(launch, arch)
    except Exception as e:  # noqa: BLE001 (a kernel that does not compile is a result)
        return {"error": _short_error(e), "seconds": time.perf_counter() - t}
    return {
        "registers": c.registers,
        "spill_stores": c.spill_stores,
        "spill_loads": c.spill_loads,
        "shared": c.shared,
        "int32_offsets": triton_aot.int32_offsets(c.ttir),
        "seconds": time.perf_counter() - t,
    }


def _short_error(e: BaseException) -> str:
    """The innermost cause's first line (Triton chains a CompilationError per call level)."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip().splitlines()
    msg = next((line for line in reversed(text) if line.strip() and not line.startswith(" ")), "")
    return f"{type(e).__name__}: {msg or (text[0] if text else '')}"[:300]


def sweep(cases: list[Case], archs=ARCHS, jobs: int = 1) -> list[dict]:
    """One row per (arch, distinct launch): its cases, configuration, the compile's figures and problems."""
    rows: dict[tuple[int, str], dict] = {}
    for arch in archs:
        for case in cases:
            with triton_aot.recording(arch) as launches:
                try:
                    case.run()
                    error = None
                except Exception as e:  # noqa: BLE001 (a wrapper that fails on these shapes is a result)
                    error = _short_error(e)
            if error is not None:
                key = (arch, f"wrapper:{case.name}")
                rows[key] = {"arch": arch, "kernel": f"{case.family} wrapper", "config": "", "dtypes": ""}
                rows[key] |= {"cases": [case.name], "strict": case.strict, "grid_problems": [], "error": error}
            for launch in launches:
                key = (arch, triton_aot.launch_key(launch))
                row = rows.get(key)
                if row is None:
                    row = rows[key] = {"arch": arch, "kernel": launch.kernel, **describe(launch), "cases": [],
                                       "strict": False, "grid_problems": [], "_launch": launch}  # fmt: skip
                if case.name not in row["cases"]:
                    row["cases"].append(case.name)
                row["strict"] |= case.strict
                row["grid_problems"] += [f"{case.name}: {p}" for p in triton_aot.grid_problems(launch)]
    todo = [row for row in rows.values() if "_launch" in row]
    _LAUNCHES[:] = [(row["arch"], row.pop("_launch")) for row in todo]
    results = []
    with contextlib.ExitStack() as stack:
        if jobs > 1:
            ctx = multiprocessing.get_context("fork")
            pool = stack.enter_context(concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx))
            done = pool.map(_compile, range(len(todo)))
        else:
            done = map(_compile, range(len(todo)))
        for i, result in enumerate(done):  # progress on stderr: a slow machine still shows where it is
            arch, launch = _LAUNCHES[i]
            print(f"[{i + 1}/{len(todo)}] sm_{arch} {launch.kernel} {result['seconds']:.1f} s", file=sys.stderr)
            results.append(result)
    for row, result in zip(todo, results):
        row.update(result)
    out = list(rows.values())
    for row in out:
        row["shared_limit"] = triton_aot.MAX_SHARED[row["arch"]]
        row["problems"] = problems(row)
    return out


def problems(row: dict) -> dict[str, str]:
    """The checks a row fails, by check: compile, spills, shared, int64, grid."""
    found = {}
    if row.get("error"):
        found["compile"] = row["error"]
        return found | ({"grid": "; ".join(row["grid_problems"])} if row["grid_problems"] else {})
    spills = row["spill_stores"] + row["spill_loads"]
    if spills and row["strict"]:
        found["spills"] = f"{row['spill_stores']} B spill stores, {row['spill_loads']} B spill loads"
    if row["shared"] > row["shared_limit"]:
        found["shared"] = f"{row['shared']} B shared > {row['shared_limit']} B"
    if row["int32_offsets"]:
        found["int64"] = f"{len(row['int32_offsets'])} 32-bit offsets: " + ", ".join(row["int32_offsets"][:6])
    if row["grid_problems"]:
        found["grid"] = "; ".join(row["grid_problems"])
    return found


def markdown(rows: list[dict], title: str) -> str:
    lines = [
        f"# {title}",
        "",
        "Per compile (arch x distinct launch): registers per thread, spill bytes (stores/loads, ptxas -v), shared",
        "memory, compile seconds, and the checks it fails. strict: a default configuration or a shape at risk",
        "(spills fail there). int64: the 32-bit offsets from unbounded products (file:line of the addptr).",
        "",
        "| arch | kernel | config | dtypes | regs | spills st/ld B | shared KB | s | strict | problems | cases |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in sorted(rows, key=lambda r: (r["arch"], r["kernel"], r["config"])):
        ok = "error" not in r or not r["error"]
        probs = "; ".join(f"**{k}**: {v}" for k, v in r["problems"].items()).replace("|", "/") or "ok"
        cases = ", ".join(r["cases"][:3]) + (f" (+{len(r['cases']) - 3})" if len(r["cases"]) > 3 else "")
        regs = r["registers"] if ok else "-"
        spills = f"{r['spill_stores']}/{r['spill_loads']}" if ok else "-"
        shared = f"{r['shared'] / 1024:.1f}" if ok else "-"
        strict = "yes" if r["strict"] else ""
        lines.append(
            f"| sm_{r['arch']} | {r['kernel']} | {r['config']} | {r['dtypes']} | {regs} | {spills} | {shared} | "
            f"{r.get('seconds', 0):.1f} | {strict} | {probs} | {cases} |"
        )
    return "\n".join(lines) + "\n"


def summary(rows: list[dict]) -> str:
    """Per kernel and arch: compiles, max registers, spilling compiles, failures by check."""
    by: dict[tuple[str, int], dict] = {}
    for r in rows:
        s = by.setdefault((r["kernel"], r["arch"]), {"n": 0, "regs": 0, "spilling": 0, "fails": {}})
        s["n"] += 1
        if not r.get("error"):
            s["regs"] = max(s["regs"], r["registers"])
            s["spilling"] += bool(r["spill_stores"] + r["spill_loads"])
        for check in r["problems"]:
            s["fails"][check] = s["fails"].get(check, 0) + 1
    lines = ["| kernel | arch | compiles | max regs | spilling | failing checks (compiles) |"]
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for (kernel, arch), s in sorted(by.items()):
        fails = ", ".join(f"{k} {v}" for k, v in sorted(s["fails"].items())) or "none"
        lines.append(f"| {kernel} | sm_{arch} | {s['n']} | {s['regs']} | {s['spilling']} | {fails} |")
    return "\n".join(lines) + "\n"


def by_kernel(rows: list[dict]) -> str:
    """One line per kernel, sm_80 then sm_90: compiles, max registers, spilling compiles, failing checks."""
    kernels = sorted({r["kernel"] for r in rows})
    archs = sorted({r["arch"] for r in rows})
    head = " | ".join(f"sm_{a}: regs (max), spilling, failing checks" for a in archs)
    lines = [f"| kernel | compiles | {head} |", "| --- | --- |" + " --- |" * len(archs)]
    for kernel in kernels:
        cells = []
        for arch in archs:
            rs = [r for r in rows if r["kernel"] == kernel and r["arch"] == arch]
            ok = [r for r in rs if not r.get("error")]
            fails: dict[str, int] = {}
            for r in rs:
                for check in r["problems"]:
                    fails[check] = fails.get(check, 0) + 1
            regs = max((r["registers"] for r in ok), default="-")
            spilling = sum(bool(r["spill_stores"] + r["spill_loads"]) for r in ok)
            cells.append(f"{regs}, {spilling}, " + (", ".join(f"{k} {v}" for k, v in sorted(fails.items())) or "none"))
        n = sum(r["kernel"] == kernel for r in rows) // max(1, len(archs))
        lines.append(f"| `{kernel}` | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ci", action="store_true", help="the CI subset (defaults and shapes at risk)")
    ap.add_argument("--arch", type=int, nargs="+", choices=ARCHS, default=list(ARCHS))
    ap.add_argument("--family", nargs="+", default=None, help="only these kernel families (gla, quantize, ...)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="compile processes")
    ap.add_argument("--json", action="store_true", help="print the rows as one JSON object (last line)")
    ap.add_argument("--markdown", default=None, help="write the table (and a per-kernel summary) here")
    ap.add_argument("--from-json", default=None, help="render the rows of an earlier --json run (no compile)")
    a = ap.parse_args(argv)
    if a.from_json:
        with open(a.from_json) as f:
            saved = json.loads([line for line in f if line.startswith("{")][-1])
        title = f"Ahead-of-time compile, {'CI subset' if saved['ci'] else 'full sweep'} ({len(saved['rows'])} compiles)"
        text = markdown(saved["rows"], title) + "\n## Per kernel\n\n" + by_kernel(saved["rows"])
        if a.markdown:
            with open(a.markdown, "w") as f:
                f.write(text)
        print(by_kernel(saved["rows"]))
        return 0
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("bench/compile_gpu.py: run it without TRITON_INTERPRET=1 (the interpreter compiles nothing)")
    cases = [c for c in all_cases() if (c.ci or not a.ci) and (a.family is None or c.family in a.family)]
    t = time.perf_counter()
    rows = sweep(cases, a.arch, a.jobs)
    seconds = time.perf_counter() - t
    failing = [r for r in rows if r["problems"]]
    what = f"{'CI subset' if a.ci else 'full sweep'} ({len(rows)} compiles, {seconds:.0f} s)"
    title = f"Ahead-of-time compile with Triton {triton.__version__}, {what}"
    print(f"Triton {triton.__version__}: "
          f"{len(cases)} cases, {len(rows)} compiles for sm_{'/sm_'.join(map(str, a.arch))} in {seconds:.1f} s "
          f"({a.jobs} jobs); {len(failing)} failing checks")  # fmt: skip
    print(summary(rows))
    for r in failing:
        for check, msg in r["problems"].items():
            print(f"FAIL [{check}] sm_{r['arch']} {r['kernel']} ({r['config']}; {r['cases'][0]}): {msg}")
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(markdown(rows, title) + "\n## Per kernel\n\n" + by_kernel(rows))
    if a.json:
        print(
            json.dumps(
                {
                    "bench": "compile_gpu",
                    "triton": triton.__version__,
                    "ci": a.ci,
                    "seconds": seconds,
                    "jobs": a.jobs,
                    "rows": rows,
                }
            )
        )
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
