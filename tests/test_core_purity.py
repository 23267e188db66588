"""The planning core must never import a framework: backends are adapters."""
import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pulse

FORBIDDEN = {"torch", "torch_npu", "mindspore", "pulse_torch", "pulse_mindspore"}
CORE = Path(pulse.__file__).parent


def _imported_roots(tree: ast.AST) -> set[str]:
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                roots.add(node.args[0].value.split(".")[0])
    return roots


def test_no_core_file_imports_a_framework():
    offenders = []
    for path in CORE.rglob("*.py"):
        roots = _imported_roots(ast.parse(path.read_text(), filename=str(path)))
        if roots & FORBIDDEN:
            offenders.append(f"{path.relative_to(CORE.parent)}: {sorted(roots & FORBIDDEN)}")
    assert offenders == []


def test_the_checker_catches_an_import_inside_a_function():
    tree = ast.parse("def f():\n    import torch.nn as nn\n    from mindspore import ops\n")
    assert _imported_roots(tree) >= {"torch", "mindspore"}


def test_importing_every_core_module_loads_no_framework():
    names = [m.name for m in pkgutil.walk_packages([str(CORE)], prefix="pulse.")]
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(sorted(set(m.split('.')[0] for m in sys.modules) & set({sorted(FORBIDDEN)!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert len(names) > 5
