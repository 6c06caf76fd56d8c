"""Which implementation an op runs: one of our Triton kernels (megatron_zpp/kernels/) or its PyTorch
reference (megatron_zpp/ops/). One process-wide mode, set once at start-up from --kernels:

    torch    always the reference
    triton   always the kernel; refused at start-up when Triton cannot run here (not importable, or a
             CPU device without TRITON_INTERPRET=1, the interpreter the CPU tests use)
    auto     the kernel on a CUDA device when Triton is importable, else the reference

An op asks `use_triton(op, tensor)`; an op whose kernel does not apply to a call (a dtype or shape it
does not take) falls back to its reference for that call and says why through `register(op, ...)`.
`describe(device)` is the one start-up log line naming the path of every registered op.

Every kernel launch an op makes goes through a custom op, `kernel_op(name)` (torch.library, namespace
megatron_zpp), with a fake implementation stating its outputs' shapes, dtypes and devices: torch.compile
(--torch-compile) keeps it as one opaque node of the graph, and FakeTensorMode runs it as shapes only.
"""

from __future__ import annotations

import importlib.util
import os

import torch

LIBRARY = "megatron_zpp"  # the namespace of our custom ops: torch.ops.megatron_zpp.<name>
MODES = ("auto", "triton", "torch")
_mode = "auto"
_ops: dict[str, str] = {}  # op name -> what its kernel covers (shown in the log line)
KERNEL_OPS: dict[str, torch.library.CustomOpDef] = {}  # every kernel_op, by name (the tests check each)


class KernelUnavailable(RuntimeError):
    """--kernels triton where Triton cannot run; the message is one line for the user."""


_import_checked: list[str | None] = []  # triton_importable's answer once known (a plain global, not
# functools.cache: torch.compile traces this on every kernel dispatch and reads a global as a guarded constant)


def triton_importable() -> str | None:
    """None when `import triton` works, else the reason (checked once)."""
    if not _import_checked:
        _import_checked.append(_import_triton())
    return _import_checked[0]


def _import_triton() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001  (a broken install: say so, fall back)
        return f"import triton failed: {e}"
    return None


def interpreter() -> bool:
    """True when Triton kernels run in its CPU interpreter (set before triton is imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def why_not_triton(device: torch.device) -> str | None:
    """None when Triton kernels can run on `device`, else the reason."""
    missing = triton_importable()
    if missing:
        return missing
    if device.type == "cuda" or interpreter():
        return None
    return f"device {device.type} (Triton runs on CUDA, or on CPU under TRITON_INTERPRET=1)"


def set_kernels(mode: str, device: torch.device) -> None:
    """Set the process-wide mode; --kernels triton where Triton cannot run is refused here."""
    global _mode
    if mode not in MODES:
        raise KernelUnavailable(f"--kernels {mode}: expected one of {', '.join(MODES)}")
    reason = why_not_triton(device)
    if mode == "triton" and reason:
        raise KernelUnavailable(f"--kernels triton: {reason}")
    _mode = mode


def use_triton(x: torch.Tensor) -> bool:
    """Whether an op on tensor `x` runs its Triton kernel under the current mode."""
    if _mode == "torch":
        return False
    if _mode == "triton":
        return why_not_triton(x.device) is None
    return x.device.type == "cuda" and triton_importable() is None


def kernel_op(name: str, mutates_args: tuple[str, ...] = ()):
    """Decorator: the function (a Triton launch) becomes the custom op megatron_zpp::<name>; give it a
    fake with `.register_fake`. The ops are the launches only: the gradients stay in the ops'
    autograd.Functions (which torch.compile traces), as GLA's pieces are also chained by context
    parallelism's own Functions, and an in-place op (RoPE) cannot take `.register_autograd`.

    torch.library.custom_op, not triton_op: triton_op lets inductor look inside, but only at launches
    written `wrap_triton(kernel)[grid](...)` (ours, in kernels/, launch `kernel[grid]`), and under the
    CPU interpreter (TRITON_INTERPRET=1) it fails to trace at all (checked with torch 2.13, Triton 3.9).
    A custom op is opaque: inductor calls it as it is, on CUDA and in the interpreter alike, and fuses
    the torch code around it; our kernels are already the fused unit of their op."""

    def register(fn):
        KERNEL_OPS[name] = torch.library.custom_op(f"{LIBRARY}::{name}", fn, mutates_args=mutates_args)
        return KERNEL_OPS[name]

    return register


def fake_fp32(like: torch.Tensor, *shape: int) -> torch.Tensor:
    """A fake's fp32 output of `shape` on `like`'s device (the kernels write fp32 whatever their inputs)."""
    return like.new_empty(shape, dtype=torch.float32)


def register(op: str, covers: str) -> None:
    """Declare an op with a Triton kernel; `covers` says what it takes (e.g. "fp32/bf16, any width")."""
    _ops[op] = covers


def describe(device: torch.device) -> str:
    """One line: the mode and, per registered op, which path runs on `device`."""
    reason = why_not_triton(device)
    on = _mode == "triton" or (_mode == "auto" and device.type == "cuda" and reason is None)
    where = "Triton interpreter" if on and device.type != "cuda" else "Triton"
    if not on:
        reason = "--kernels torch" if _mode == "torch" else reason or "auto takes Triton on CUDA only"
    ops_note = f"each a {LIBRARY}:: custom op, an opaque node under --torch-compile"
    path = f"{where} kernels ({ops_note})" if on else f"torch references ({reason})"
    ops = ", ".join(f"{op} [{covers}]" for op, covers in sorted(_ops.items())) or "none registered"
    return f"kernels (--kernels {_mode}): {path} for {ops}"
