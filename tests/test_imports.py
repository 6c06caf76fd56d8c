"""The package's layering, read from the source with `ast`: every import statement counts,
function-local ones included, and importing a.b.c also runs the package a.b (its
__init__), so that edge counts too."""

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron_zpp")


def package_sources() -> dict[str, tuple[str, bool]]:
    """'megatron_zpp.zero.engine' -> (its source, is it a package's __init__)."""
    mods = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path[:-3], os.path.dirname(ROOT)).replace(os.sep, ".")
                with open(path) as fh:
                    mods[name.removesuffix(".__init__")] = (fh.read(), f == "__init__.py")
    return mods


def _imported(node: ast.AST, importer: str, is_package: bool) -> list[str]:
    """Dotted names an import statement asks for (`from x import y` asks for x.y and x)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:  # relative: from the importer's package, one level up per extra dot
        base = importer.split(".") if is_package else importer.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module
    return [target] + [f"{target}.{a.name}" for a in node.names]


def import_graph(mods: dict[str, tuple[str, bool]] | None = None) -> dict[str, set[str]]:
    """Module -> the modules of `mods` (default: the package) it imports."""
    mods = package_sources() if mods is None else mods
    graph = {m: set() for m in mods}
    for mod, (source, is_package) in mods.items():
        for node in ast.walk(ast.parse(source, mod)):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _imported(node, mod, is_package):
                parts = name.split(".")
                for i in range(2, len(parts) + 1):  # the module and every package above it
                    target = ".".join(parts[:i])
                    if target in mods and target != mod and not mod.startswith(target + "."):
                        graph[mod].add(target)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for n in graph[todo.pop()] - seen:
            seen.add(n)
            todo.append(n)
    return seen


def test_the_reader_sees_local_relative_absolute_and_package_imports():
    mods = {
        "p": ("", True),
        "p.a": ("def f():\n    from .b import g\n", False),
        "p.b": ("import p.c.d\n", False),
        "p.c": ("from . import d\n", True),
        "p.c.d": ("from ..a import f\n", False),
    }
    graph = import_graph(mods)
    assert graph["p.a"] == {"p.b"}  # function-local, relative
    assert graph["p.b"] == {"p.c", "p.c.d"}  # absolute; the package p.c runs first
    assert graph["p.c"] == {"p.c.d"} and graph["p.c.d"] == {"p.a"}
    assert _cycle(graph) == ["p.a", "p.b", "p.c", "p.c.d", "p.a"]


def test_no_import_cycles():
    assert _cycle(import_graph()) is None


def test_config_is_a_leaf():
    # config.py re-exports its sections' modules; batch_schedule holds TrainConfig's batch rules; all are leaves
    graph = import_graph()
    leaves = {f"megatron_zpp.{m}" for m in ("config_fields", "config_model", "config_train", "batch_schedule")}
    assert _reachable(graph, "megatron_zpp.config") == leaves
    assert graph["megatron_zpp.config_fields"] == set() and graph["megatron_zpp.batch_schedule"] == set()


def test_model_and_ops_know_nothing_above_them():
    graph = import_graph()
    above = ("megatron_zpp.zero", "megatron_zpp.pipeline_parallel", "megatron_zpp.checkpoint", "megatron_zpp.training")
    for start in [m for m in graph if m.startswith(("megatron_zpp.model", "megatron_zpp.ops"))]:
        bad = sorted(m for m in _reachable(graph, start) if m.startswith(above))
        assert not bad, f"{start} imports (directly or through others) {bad}"


def test_kernels_are_reached_only_through_the_ops_dispatch():
    graph = import_graph()
    for module, imports in graph.items():
        kernel_imports = {m for m in imports if m.startswith("megatron_zpp.kernels")}
        if module.startswith("megatron_zpp.kernels"):
            assert not {m for m in imports if not m.startswith("megatron_zpp.kernels")}, f"{module}: {imports}"
        elif kernel_imports:  # and the ahead-of-time compile check, which tunes the wrappers for a named GPU
            assert module.startswith(("megatron_zpp.ops", "megatron_zpp.testing")), (
                f"{module} imports {sorted(kernel_imports)}"
            )
