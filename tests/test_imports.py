"""The package's layering, read from the source with `ast`: every import statement counts,
function-local ones included, and importing a.b.c also runs the package a.b (its
__init__), so that edge counts too. The scripts (bench/, tools/, examples/, pretrain_gpt.py)
and the tests are read too: no file touches sys.path, and a script imports only the package,
the standard library and third-party packages (`python tools/x.py` puts tools/, not the
repository root, on sys.path: a sibling or `bench.x` would not be found)."""

import ast
import functools
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.join(REPO, "megatron_zpp")
TREE = ("megatron_zpp", "bench", "tools", "examples", "tests")  # and the .py files at the top
SCRIPT_DIRS = ("bench", "tools", "examples")


def _python_files(top: str):
    for folder, dirs, files in os.walk(top):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
        yield from (os.path.join(folder, f) for f in sorted(files) if f.endswith(".py"))


def _module_name(path: str) -> str:
    return os.path.relpath(path[:-3], REPO).replace(os.sep, ".").removesuffix(".__init__")


def package_sources() -> dict[str, tuple[str, bool]]:
    """'megatron_zpp.zero.engine' -> (its source, is it a package's __init__)."""
    mods = {}
    for path in _python_files(ROOT):
        with open(path) as fh:
            mods[_module_name(path)] = (fh.read(), path.endswith("__init__.py"))
    return mods


@functools.cache
def tree_sources() -> dict[str, tuple[str, bool]]:
    """package_sources() for every Python file of the repository: the package, the scripts and the tests
    ('tools.preprocess_data', 'examples.reproduce.cp_scan', 'pretrain_gpt', ...)."""
    paths = [os.path.join(REPO, f) for f in sorted(os.listdir(REPO)) if f.endswith(".py")]
    paths += [p for top in TREE for p in _python_files(os.path.join(REPO, top))]
    mods = {}
    for path in paths:
        with open(path) as fh:
            mods[_module_name(path)] = (fh.read(), path.endswith("__init__.py"))
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
                if is_script(mod, is_package) and not _is_relative(node) and name.split(".")[0] not in mods:
                    sibling = ".".join(mod.split(".")[:-1] + [name])  # `python dir/x.py` puts dir/ on sys.path
                    name = sibling if sibling in mods else name
                parts = name.split(".")
                if len(parts) == 1 and name in mods and not mods[name][1] and name != mod:
                    graph[mod].add(name)  # a top-level module (pretrain_gpt)
                for i in range(2, len(parts) + 1):  # the module and every package above it
                    target = ".".join(parts[:i])
                    if target in mods and target != mod and not mod.startswith(target + "."):
                        graph[mod].add(target)
    return graph


def _is_relative(node: ast.AST) -> bool:
    return isinstance(node, ast.ImportFrom) and node.level > 0


def is_script(mod: str, is_package: bool) -> bool:
    """A file run as `python path/to/it.py`: under bench/, tools/, examples/, or at the top (pretrain_gpt)."""
    return mod.split(".")[0] in SCRIPT_DIRS or ("." not in mod and not is_package)


PATH_EDIT = re.compile(r"sys\.path\s*(\.\s*(insert|append|extend)\s*\(|\+=|=(?!=)|\[[^\]]*\]\s*=)")


def path_edits(source: str) -> list[int]:
    """Lines that change sys.path, read as text so that a `python -c` program in a string counts too."""
    return [n for n, line in enumerate(source.splitlines(), 1) if PATH_EDIT.search(line)]


def foreign_imports(mod: str, mods: dict[str, tuple[str, bool]]) -> list[str]:
    """What a script or a package module imports besides the package, the standard library and third-party
    packages: bench/, tools/, examples/, tests/ or pretrain_gpt; for a script also a sibling file of its
    folder or a relative import (neither resolves both as `python dir/x.py` and as `python -m dir.x`)."""
    source, is_package = mods[mod]
    ours = {m.split(".")[0] for m in mods} - {"megatron_zpp"}
    folder = mod.split(".")[:-1] if not is_package else mod.split(".")
    siblings = {m.split(".")[-1] for m in mods if m.split(".")[:-1] == folder} - {"megatron_zpp"}
    found = []
    for node in ast.walk(ast.parse(source, mod)):
        if _is_relative(node) and is_script(mod, is_package):
            found.append("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and not node.level):
            for name in [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]:
                top = name.split(".")[0]
                if top in ours or (is_script(mod, is_package) and top in siblings):
                    found.append(top)
    return found


def _path_of(mod: str, is_package: bool) -> str:
    return mod.replace(".", "/") + ("/__init__.py" if is_package else ".py")


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
    # the config package re-exports its sections' modules; batch_schedule holds TrainConfig's batch rules; all are
    # leaves (the command line, config/arguments.py and megatron_flags.py, sits above them and is not re-exported)
    graph = import_graph()
    leaves = {
        f"megatron_zpp.config.{m}"
        for m in ("fields", "model", "moe", "shapes", "parallel", "optim", "data", "train", "batch_schedule")
    }
    assert _reachable(graph, "megatron_zpp.config") == leaves
    assert graph["megatron_zpp.config.fields"] == set() and graph["megatron_zpp.config.batch_schedule"] == set()


def test_what_the_wheel_ships_imports_nothing_it_leaves_out():
    """pyproject's packages.find exclude keeps the bench harnesses out of the wheel: no shipped module may need them."""
    with open("pyproject.toml") as f:  # (tomllib is Python 3.11+)
        block = re.search(r"\[tool\.setuptools\.packages\.find\].*?\nexclude = \[(.*?)\]", f.read(), re.S)
    left_out = [e.rstrip("*") for e in re.findall(r'"([^"]+)"', block.group(1))]
    assert "megatron_zpp.testing.peers" in left_out

    def out(module: str) -> bool:
        return any(
            module == e or module.startswith(e + ".") or (e.endswith(".") and module.startswith(e)) for e in left_out
        )

    graph = import_graph()
    for module, imports in graph.items():
        if module.startswith("megatron_zpp") and not out(module):
            assert not [m for m in imports if out(m)], f"{module} (shipped) imports {[m for m in imports if out(m)]}"


def test_the_package_root_holds_at_most_nine_modules():
    """What is not comm, topology or a small shared helper lives in a subpackage (config/, planning/, ...)."""
    root = sorted(f for f in os.listdir("megatron_zpp") if f.endswith(".py"))
    assert len(root) <= 9, root


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


def _mixer(module: str) -> str | None:
    """The linear-attention mixer a package module belongs to by its name (gla*, linear_attention: GLA; gdn*,
    gated_deltanet: GDN; kda*: KDA), else None (the shared files: chunking, delta_rule, scans, ...; and hf_remote's
    one model file that runs them all)."""
    name = module.split(".")[-1]
    if module.startswith("megatron_zpp.hf_remote"):
        return None
    if name.startswith("gla") or name == "linear_attention":
        return "gla"
    if name.startswith("gdn") or name == "gated_deltanet":
        return "gdn"
    if name.startswith("kda"):
        return "kda"
    return None


def test_no_mixer_imports_another_mixers_module():
    # the linear-attention family shares neutral files (ops/chunking, kernels/chunk_common, context_parallel/scans,
    # ...), fla's ops/common model: a GDN module imports no GLA or KDA module, and so on for each
    graph = import_graph()
    mixers = {m: _mixer(m) for m in graph}
    assert {"gla", "gdn", "kda"} <= set(mixers.values())
    for module, imports in graph.items():
        own = mixers[module]
        bad = sorted(m for m in imports if own and mixers.get(m) not in (None, own))
        assert not bad, f"{module} ({own}) imports {bad}"


def test_no_import_cycles_across_the_tree():
    assert _cycle(import_graph(tree_sources())) is None


def test_no_file_changes_sys_path():
    mods = tree_sources()
    found = {_path_of(m, pkg): path_edits(src) for m, (src, pkg) in mods.items() if path_edits(src)}
    assert not found, f"sys.path changed at (file: lines) {found}"


def test_scripts_and_the_package_import_no_script():
    mods = tree_sources()
    found = set()
    for mod, (_, is_package) in mods.items():
        if mod.split(".")[0] != "tests":  # the tests may import scripts (tests/tools/ tests tools/)
            found |= {(_path_of(mod, is_package), name) for name in foreign_imports(mod, mods)}
    assert not found, f"import these from megatron_zpp instead (move what they share): {sorted(found)}"


def test_the_tree_checks_catch_planted_violations():
    path = "sys" + ".path"  # split, so that this file itself changes no sys.path, even as text
    insert, append, assign = f"{path}.insert(0, '..')", f"{path}.append(x)", f"{path} = []"
    mods = {
        "megatron_zpp": ("", True),
        "megatron_zpp.a": ("import bench.b\n", False),
        "bench": ("", True),
        "bench.b": (f"import sys\n{insert}\nimport c\nfrom megatron_zpp import a\n", False),
        "bench.c": ("def f():\n    import bench.b\n", False),
        "tools": ("", True),
        "tools.t": ("from tools import u\nimport json, torch\nfrom . import u\n", False),
        "tools.u": (f"PROGRAM = 'import sys; {append}'\n{assign}\nok = {path} == []\n", False),
        "tests": ("", True),
        "tests.x": ("from tools import t\nfrom . import y\n", False),
    }
    assert path_edits(mods["bench.b"][0]) == [2]
    assert path_edits(mods["tools.u"][0]) == [1, 2]  # a `python -c` program in a string counts; `==` does not
    assert foreign_imports("bench.b", mods) == ["c"]  # the sibling bench/c.py
    assert foreign_imports("tools.t", mods) == ["tools", "."]
    assert foreign_imports("megatron_zpp.a", mods) == ["bench"]  # the package imports a script
    assert foreign_imports("bench.c", mods) == ["bench"]
    assert _cycle(import_graph(mods)) == ["bench.b", "bench.c", "bench.b"]  # through the sibling import
