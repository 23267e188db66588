"""The folders of ``pulse/`` form layers: no folder imports one that imports it back.

Each sub-package (``schedule``, ``sim``, ``synth``, ...) is one node and each top-level
module (``plan.py``, ``spec.py``, ...) another; an edge is any import between two nodes,
lazy ones inside functions included (a lazy import still ties the two together).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pulse

CORE = Path(pulse.__file__).parent


def node_of(module: str) -> str | None:
    """``pulse.schedule.ir`` -> ``schedule``; ``pulse.plan`` -> ``plan``; not pulse -> None."""
    parts = module.split(".")
    if parts[0] != "pulse" or len(parts) < 2:
        return None
    return parts[1]


def imported_modules(tree: ast.AST, where: str = "") -> list[str]:
    """Every module an import in ``tree`` names, lazy ones included: ``import a.b`` -> ``a.b``;
    ``from a import b`` -> ``a`` and ``a.b`` (b may be a module: ``from pulse import plan``);
    ``importlib.import_module("a.b")`` and ``__import__("a.b")`` with a literal name -> ``a.b``."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{where}: relative import; the layer checks read absolute ones"
            names += [node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", ""))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            names.append(node.args[0].value)
    return names


def import_graph(root: Path = CORE) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        here = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        if here == "__init__":
            continue
        targets = graph.setdefault(here, set())
        names = imported_modules(ast.parse(path.read_text(), filename=str(path)), str(rel))
        targets.update(n for n in map(node_of, names) if n is not None and n != here)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path ``[a, b, ..., a]``, or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_folders_of_pulse_import_each_other_without_a_cycle():
    graph = import_graph()
    assert {"schedule", "sim", "synth", "runtime", "plan"} <= graph.keys()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between folders: " + " -> ".join(cycle or [])


def test_the_synthesizer_sits_above_schedule_and_sim():
    graph = import_graph()
    assert {"schedule", "sim"} <= graph["synth"]
    assert "synth" not in graph["schedule"] and "synth" not in graph["sim"]
    assert "sim" not in graph["schedule"]


def test_the_cycle_finder_finds_a_cycle_and_accepts_layers():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"synth": {"sim", "schedule"}, "sim": {"schedule"}, "schedule": set()}) is None


def test_a_lazy_import_counts(tmp_path: Path):
    (tmp_path / "sim").mkdir()
    (tmp_path / "schedule").mkdir()
    (tmp_path / "sim" / "engine.py").write_text("from pulse.schedule.ir import Action\n")
    (tmp_path / "schedule" / "synth.py").write_text("def f():\n    from pulse.sim.engine import simulate\n")
    graph = import_graph(tmp_path)
    assert find_cycle(graph) in (["schedule", "sim", "schedule"], ["sim", "schedule", "sim"])


@pytest.mark.parametrize("line", ["from pulse import schedule", "from pulse import schedule as s, plan",
                                  "import importlib\nimportlib.import_module('pulse.schedule.ir')",
                                  "__import__('pulse.schedule')"])
def test_every_form_of_import_counts(tmp_path: Path, line: str):
    """``from pulse import <module>`` and a literal ``import_module`` tie two folders as ``import pulse.x`` does."""
    (tmp_path / "sim").mkdir()
    (tmp_path / "schedule").mkdir()
    (tmp_path / "sim" / "engine.py").write_text("def f():\n    " + line.replace("\n", "\n    ") + "\n")
    (tmp_path / "schedule" / "ir.py").write_text("from pulse.sim.engine import simulate\n")
    assert find_cycle(import_graph(tmp_path)) is not None


def cli_importers(roots: list[Path]) -> list[str]:
    """Files under ``roots`` that import ``pulse.cli`` (lazily or not), except pulse/cli's own."""
    found = []
    for root in roots:
        for path in root.rglob("*.py"):
            if CORE / "cli" in path.parents:
                continue
            names = imported_modules(ast.parse(path.read_text(), filename=str(path)), str(path))
            if any(n == "pulse.cli" or n.startswith("pulse.cli.") for n in names):
                found.append(str(path.relative_to(root.parent)))
    return sorted(found)


def test_nothing_below_the_cli_imports_it():
    """The CLI is the composition root: the core and the backends' entries take what they need from
    ``pulse.args``, ``pulse.planner`` and ``pulse.backend_traits``, never from ``pulse.cli``."""
    assert cli_importers([CORE, CORE.parent / "backends"]) == []


def test_the_cli_import_check_sees_a_lazy_import(tmp_path):
    room = tmp_path / "room"
    room.mkdir()
    (room / "a.py").write_text("def f():\n    from pulse.cli.common import load_setup\n")
    (room / "b.py").write_text("import pulse.client_side_thing\n")
    (room / "c.py").write_text("from pulse import cli\n")
    (room / "d.py").write_text("import importlib\nimportlib.import_module('pulse.cli.main')\n")
    (room / "e.py").write_text("from pulse import client_side_thing\n")
    assert cli_importers([room]) == ["room/a.py", "room/c.py", "room/d.py"]
