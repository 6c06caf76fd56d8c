"""checkpoint/ knows the data-parallel engines only through zero's public interface (what
`megatron_zpp.zero` exports): what a rank holds is asked of the engine, never re-derived."""

import ast
import pathlib

import megatron_zpp.checkpoint
import megatron_zpp.zero


def test_checkpoint_imports_nothing_of_zero_but_its_package():
    root = pathlib.Path(megatron_zpp.checkpoint.__file__).parent
    used = {}
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 2 and (node.module or "").startswith("zero"):
                used.setdefault(node.module, set()).update(a.name for a in node.names)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron_zpp.zero"):
                used.setdefault(node.module.removeprefix("megatron_zpp."), set()).update(a.name for a in node.names)
    assert set(used) <= {"zero"}, used
    assert used.get("zero", set()) <= set(megatron_zpp.zero.__all__), used
