"""Ahead-of-time compile of our Triton kernels for real GPU targets, on a machine with no GPU.

The real launch wrappers run on meta tensors of the real shapes inside `kernels.target.tuned_for(arch)`
(so they pick the block sizes, warps and stages of a CUDA launch); `JITFunction.run` is replaced by a
recorder that binds the arguments as Triton's launcher does (its binder: the same signature, constexprs
and specialization attributes), and each recorded launch is compiled with
`triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))` down to a cubin by the ptxas of
Triton's wheel, whose `-v` report gives registers and spills.

Run in a process without TRITON_INTERPRET=1: under the interpreter `triton.jit` builds no JITFunction.
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


def compile_launch(launch: Launch, arch: int) -> Compiled:
    """Compile to a cubin for sm_<arch>; raises what the compiler raises (a kernel that does not compile)."""
    src = ASTSource(launch.fn, launch.signature, launch.constexprs, launch.attrs)
    log = io.StringIO()
    with _ptxas_log(), contextlib.redirect_stdout(log):
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


def grid_problems(launch: Launch) -> list[str]:
    """The grid axes past CUDA's limits."""
    return [
        f"grid axis {axis} = {size} > {limit}"
        for axis, (size, limit) in enumerate(zip(launch.grid, MAX_GRID))
        if size > limit
    ]
