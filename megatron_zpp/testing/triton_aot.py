"""Ahead-of-time compile of our Triton kernels for real GPU targets, on a machine with no GPU.

The real launch wrappers run on meta tensors of the real shapes inside `kernels.target.tuned_for(arch)`
(so they pick the block sizes, warps and stages of a CUDA launch); `JITFunction.run` is replaced by a
recorder that binds the arguments as Triton's launcher does (its binder: the same signature, constexprs
and specialization attributes), and each recorded launch is compiled with
`triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))` down to a cubin by the ptxas of
Triton's wheel, whose `-v` report gives registers and spills.

`int32_offsets(ttir)` reads a compiled kernel's TTIR for pointer offsets computed in 32 bits from an
unbounded product (a program id, a kernel argument or a loop counter times anything), the offsets that
overflow once a tensor passes 2^31 elements.

Run in a process without TRITON_INTERPRET=1: under the interpreter `triton.jit` builds no JITFunction.
The sweep over every kernel and shape is bench/compile_gpu.py; tests/kernels/test_compile_gpu.py runs
its CI subset in a subprocess.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from megatron_zpp.kernels import target

# Shared memory a block may use (opt-in maximum) and the grid limits of axes 1 and 2 (CUDA programming guide).
MAX_SHARED = {80: 166912, 90: 232448}
MAX_GRID = (2**31 - 1, 65535, 65535)
_PTXAS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads.*?Used (\d+) registers", re.S)


@dataclass
class Launch:
    """One launch as the launcher would specialize it."""

    kernel: str
    grid: tuple[int, ...]
    fn: JITFunction
    signature: dict[str, str]
    constexprs: dict[Any, Any]
    attrs: dict[Any, Any]
    options: dict[str, Any]


@dataclass
class Compiled:
    """What ptxas and the compiler report of one launch."""

    launch: Launch
    registers: int
    spill_stores: int
    spill_loads: int
    shared: int
    ttir: str = field(repr=False)

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


@contextlib.contextmanager
def recording(arch: int) -> Iterator[list[Launch]]:
    """Within the block, kernel launches are recorded (not run), tuned and specialized for sm_<arch>."""
    backend = make_backend(GPUTarget("cuda", arch, 32))
    launches: list[Launch] = []
    binders: dict[int, Callable] = {}

    def record(fn: JITFunction, *args, grid, warmup, **kwargs):
        binder = binders.setdefault(id(fn), create_function_from_signature(fn.signature, fn.params, backend))
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        grid = grid(bound) if callable(grid) else grid
        launches.append(Launch(fn.__name__, tuple(grid), fn, signature, constexprs, attrs, options.__dict__))

    saved = JITFunction.run
    JITFunction.run = record
    try:
        with target.tuned_for(arch):
            yield launches
    finally:
        JITFunction.run = saved


def launch_key(launch: Launch) -> str:
    """What makes two launches one compile: kernel, signature, constexprs, specialization and options."""
    parts = (launch.kernel, launch.signature, launch.constexprs, launch.attrs, launch.options)
    return repr(tuple(sorted(p.items(), key=repr) if isinstance(p, dict) else p for p in parts))


def compile_launch(launch: Launch, arch: int) -> Compiled:
    """Compile to a cubin for sm_<arch>; raises what the compiler raises (a kernel that does not compile)."""
    src = ASTSource(launch.fn, launch.signature, launch.constexprs, launch.attrs)
    log = io.StringIO()
    with _ptxas_log(), _always_compile(), contextlib.redirect_stdout(log):
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=launch.options)
    report = _PTXAS.search(log.getvalue())
    if report is None:
        raise RuntimeError(f"{launch.kernel}: no ptxas -v report in the compile log:\n{log.getvalue()[-2000:]}")
    stores, loads, registers = (int(x) for x in report.groups())
    return Compiled(launch, registers, stores, loads, compiled.metadata.shared, compiled.asm["ttir"])


@contextlib.contextmanager
def _ptxas_log() -> Iterator[None]:
    """ptxas' -v report printed by Triton after each cubin (its TRITON_DUMP_PTXAS_LOG knob)."""
    knobs = triton.knobs.nvidia
    saved, knobs.dump_ptxas_log = knobs.dump_ptxas_log, True
    try:
        yield
    finally:
        knobs.dump_ptxas_log = saved


@contextlib.contextmanager
def _always_compile() -> Iterator[None]:
    """A cache hit would skip ptxas and so its report: compile every time (TRITON_ALWAYS_COMPILE)."""
    knobs = triton.knobs.compilation
    saved, knobs.always_compile = knobs.always_compile, True
    try:
        yield
    finally:
        knobs.always_compile = saved


def grid_problems(launch: Launch) -> list[str]:
    """The grid axes past CUDA's limits."""
    return [
        f"grid axis {axis} = {size} > {limit}"
        for axis, (size, limit) in enumerate(zip(launch.grid, MAX_GRID))
        if size > limit
    ]


# ---------------------------------------------------------------- 32-bit offsets in the TTIR

_NAME = re.compile(r"%([\w$.-]+)(?:#\d+)?")
_DEF = re.compile(r"^\s*%([\w$.-]+)(?::\d+)?\s*=\s*(.*)$")
_LOC_DEF = re.compile(r"^#(loc\d*)\s*=\s*loc\((.*)\)\s*$")
_TRAILING_LOC = re.compile(r"\s+loc\(((?:[^()]|\([^()]*(?:\([^()]*\))*[^()]*\))*)\)\s*(\{|\})?\s*$")
_I32 = re.compile(r"(?:^i32|xi32>)$")


def _type_is_i32(text: str) -> bool:
    return bool(_I32.search(text.strip()))


def _resolve_loc(body: str, locs: dict[str, str], depth: int = 0) -> str:
    """A location as file:line, a call site chain innermost first ("gla.py:58 <- gla.py:101")."""
    body = body.strip()
    if depth > 20:
        return "?"
    if body.startswith("#loc"):
        return _resolve_loc(locs.get(body[1:], "unknown"), locs, depth + 1)
    m = re.match(r'^"([^"]*)":(\d+):\d+$', body)
    if m:
        return f"{m.group(1).rsplit('/', 1)[-1]}:{m.group(2)}"
    m = re.match(r"^callsite\((\S+) at (\S+)\)$", body)
    if m:
        return f"{_resolve_loc(m.group(1), locs, depth + 1)} <- {_resolve_loc(m.group(2), locs, depth + 1)}"
    m = re.match(r'^"[^"]*"\((.*)\)$', body)  # a named location: "name"(#locN)
    if m:
        return _resolve_loc(m.group(1), locs, depth + 1)
    m = re.match(r"^fused\[([^,\]]+)", body)
    if m:
        return _resolve_loc(m.group(1), locs, depth + 1)
    return "?"


def _closure(seeds: set[str], deps: dict[str, set[str]]) -> set[str]:
    """The values derived from `seeds`, to a fixed point (loop-carried values feed back through their yields)."""
    derived, changed = set(seeds), True
    while changed:
        changed = False
        for name, on in deps.items():
            if name not in derived and on & derived:
                derived.add(name)
                changed = True
    return derived


def int32_offsets(ttir: str) -> list[str]:
    """The `tt.addptr`s whose offset is i32 (scalar or tensor) and computed from an i32 `arith.muli` that can
    outgrow 32 bits: one with an operand derived from a program id or the counter of an `scf.for` whose bounds
    derive from one or from an argument (a position in the problem, unbounded at compile time), or one of two
    kernel arguments (sizes, strides). A
    tile-local range times one argument (a stride) is bounded by the tile's span of one stride, which the
    launcher passes as i64 once it passes 2^31 and the wrappers keep within 32 bits (kernels/gla.py copies
    a tensor whose chunk would span more); products of ranges, constants and remainders by a constant only
    are bounded. Each as "file:line (offset type)", the source line of the addptr with its call sites.
    Empty: every offset that can outgrow 32 bits is 64-bit."""
    scan = _TtirScan()
    for raw in ttir.splitlines():
        scan.line(raw)
    return scan.risky_offsets()


class _TtirScan:
    """One pass over a kernel's TTIR: which values depend on which, the program ids, loop counters, kernel
    arguments and constants, the i32 products and the addptrs' offsets."""

    def __init__(self):
        self.locs: dict[str, str] = {}
        self.deps: dict[str, set[str]] = {}
        self.positions: set[str] = set()  # program ids, loop counters
        self.arguments: set[str] = set()
        self.constants: set[str] = set()
        self.loops: list[tuple[str, list[str]]] = []  # (induction variable, its lower and upper bounds)
        self.i32_products: dict[str, list[str]] = {}  # result -> its operands
        self.addptrs: list[tuple[str, str, str]] = []  # (offset name, offset type, location)
        self.stack: list[tuple[list[str], list[str]]] = []  # open regions: (results, loop-carried arguments)
        self.scopes: list[dict[str, str]] = [{}]  # MLIR names are scoped by region: sibling regions reuse them

    def define(self, name: str) -> str:
        unique = f"{name}@{sum(len(x) for x in self.scopes)}.{len(self.scopes)}.{len(self.deps)}"
        self.scopes[-1][name] = unique
        self.deps.setdefault(unique, set())
        return unique

    def use(self, names) -> list[str]:
        return [next((sc[n] for sc in reversed(self.scopes) if n in sc), n) for n in names]

    def depend(self, name: str, on) -> None:
        self.deps.setdefault(name, set()).update(on)

    def open_region(self, results: list[str], carried: list[str]) -> None:
        self.stack.append((results, carried))
        self.scopes.append({})

    def line(self, raw: str) -> None:
        m = _LOC_DEF.match(raw)
        if m:
            self.locs[m.group(1)] = m.group(2)
            return
        line, loc = raw.strip(), "unknown"
        t = _TRAILING_LOC.search(line)
        if t:
            loc = t.group(1)
            line = line[: t.start()] + (" " + t.group(2) if t.group(2) else "")
        if not self._structure(line):
            self._definition(line, loc)

    def _structure(self, line: str) -> bool:
        """Region ends, function and block headers, yields: True when `line` was one."""
        opens = line.endswith("{")
        if line.startswith("}") and self.stack:
            frame = self.stack.pop()
            self.scopes.pop()
            if opens:  # "} else {": the same op's next region
                self.open_region(*frame)
            return True
        if line.startswith("tt.func"):
            self.scopes.append({})
            self.arguments.update(self.define(n) for n in re.findall(r"%([\w$.-]+):", line))
            self.stack.append(([], []))
            return True
        if line.startswith("^bb"):  # a block's arguments (tt.reduce's combine region)
            for n in re.findall(r"%([\w$.-]+):", line):
                self.define(n)
            return True
        if line.startswith("scf.yield") and self.stack:
            results, carried = self.stack[-1]
            yielded = set(self.use(_NAME.findall(line.split(":", 1)[0])))
            for name in results + carried:
                self.depend(name, yielded)
            return True
        return False

    def _definition(self, line: str, loc: str) -> None:
        d = _DEF.match(line)
        if d is None and line.startswith("scf.for"):  # a loop with no results
            d = re.match(r"()(.*)$", line)
        if d is None:
            if line.endswith("{"):
                self.open_region([], [])
            return
        name, rhs = d.group(1), d.group(2)
        if rhs.startswith("scf.for"):
            self._loop(name, rhs)
            return
        operands = self.use(_NAME.findall(rhs.split(" : ", 1)[0] if " : " in rhs else rhs))
        result = self.define(name)
        if line.endswith("{"):  # scf.if, scf.while, tt.reduce ...: results from its operands and its yields
            self.open_region([result], [])
        op = rhs.split(None, 1)[0].strip('"')
        if op in ("arith.remsi", "arith.remui") and operands[-1] in self.constants:
            operands = []  # x % constant: bounded by the constant, whatever x (a tile index decoded from a flat grid)
        self.depend(result, set(operands))
        if op == "arith.constant":
            self.constants.add(result)
        elif op == "tt.get_program_id":
            self.positions.add(result)
        elif op == "arith.muli" and _type_is_i32(rhs.rsplit(":", 1)[-1]):
            self.i32_products[result] = operands
        elif op == "tt.addptr":
            offset_type = rhs.split(" : ", 1)[-1].rsplit(",", 1)[-1].strip()
            if len(operands) == 2 and _type_is_i32(offset_type):
                self.addptrs.append((operands[1], offset_type, loc))

    def _loop(self, name: str, rhs: str) -> None:
        f = re.match(r"scf\.for %([\w$.-]+) = (.*?)(?: iter_args\((.*?)\))? (?:->|:)", rhs)
        bounds = self.use(_NAME.findall(f.group(2).split(" step ")[0])) if f else []
        inits = re.findall(r"%([\w$.-]+) = %([\w$.-]+)", (f.group(3) or "") if f else "")
        inits = [(arg, self.use([init])[0]) for arg, init in inits]
        result = self.define(name) if name else ""
        self.scopes.append({})
        carried = []
        if f:
            self.loops.append((self.define(f.group(1)), bounds))
            for arg, init in inits:
                carried.append(self.define(arg))
                self.depend(carried[-1], {init})
        self.stack.append(([result] if result else [], carried))

    def risky_offsets(self) -> list[str]:
        sized = _closure(self.arguments, self.deps)
        position: set[str] = set()
        while True:  # a loop counter is a position unless its bounds are constants or remainders by one
            seeds = self.positions | {
                iv for iv, bounds in self.loops if any(b in sized or b in position for b in bounds)
            }
            grown = _closure(seeds, self.deps)
            if grown == position:
                break
            position = grown

        def outgrows(operands: list[str]) -> bool:
            return any(o in position for o in operands) or sum(o in sized for o in operands) >= 2

        risky = _closure({name for name, operands in self.i32_products.items() if outgrows(operands)}, self.deps)
        found: dict[str, None] = {}
        for offset, offset_type, loc in self.addptrs:
            if offset in risky:
                found[f"{_resolve_loc(loc, self.locs)} ({offset_type})"] = None
        return list(found)
