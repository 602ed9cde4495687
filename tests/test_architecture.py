"""Imports flow one way: the CLI entry and the renderers never import torch, no module imports
another that imports it back, and none imports another module's private names."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize(
    "module",
    [
        "hookcli",
        "hookcli.cli",
        "hookcli.records",
        "hookcli.errors",
        "hookcli.options",
        "hookcli.io.output",
        "hookcli.render.rows",
        "hookcli.render.table",
        "hookcli.render.markdown",
        "hookcli.render.json",
        "hookcli.render.csv",
        "hookcli.render.fmt",
    ],
)
def test_module_does_not_import_torch(module: str) -> None:
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch imported'"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr


# ---------------------------------------------------------------- the import graph

SRC = Path(__file__).resolve().parent.parent / "src"


def _sources() -> dict[str, str]:
    """Every module of the package by dotted name (a package by its own name): its source."""
    found = {}
    for path in (SRC / "hookcli").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path.read_text(encoding="utf-8")
    return found


def _imports(modules: dict[str, str]) -> tuple[dict[str, set[str]], list[str]]:
    """Who imports whom (module-level and inside functions alike: a lazy import is still an
    arrow), and every `from x import _name` of another module's private name."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    private = []
    for name, source_text in modules.items():
        for node in ast.walk(ast.parse(source_text)):
            if isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hookcli"):
                source = str(node.module)
                for alias in node.names:
                    if f"{source}.{alias.name}" in modules:  # `from hookcli import beacon`
                        graph[name].add(f"{source}.{alias.name}")
                        continue
                    graph[name].add(source)
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        private.append(f"{name}:{node.lineno} imports {source}.{alias.name}")
        graph[name].discard(name)
    return graph, private


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)) is not None:
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)) is not None:
            return found
    return None


def test_no_import_cycle_and_no_private_name_across_modules() -> None:
    graph, private = _imports(_sources())
    assert graph["hookcli.commands.diff"], "the graph was read"
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])
    assert private == [], private


def test_the_graph_check_finds_a_cycle_and_a_private_import() -> None:
    """The checker itself can fail: a made-up package with both faults is caught."""
    graph, private = _imports(
        {
            "hookcli.a": "def f():\n    from hookcli.b import _hidden, shown\n",
            "hookcli.b": "import hookcli.c\n",
            "hookcli.c": "from hookcli import a\n",
        }
    )
    assert _cycle(graph) == ["hookcli.a", "hookcli.b", "hookcli.c", "hookcli.a"]
    assert private == ["hookcli.a:2 imports hookcli.b._hidden"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


# the layers, lowest last: a module may import its own layer and the layers below it
LAYERS = {
    "hookcli.cli": 4,
    "hookcli.commands": 3,
    "hookcli.engine": 2,
    "hookcli.sources": 2,
    "hookcli.inputs": 2,
    "hookcli.render": 1,
    "hookcli.io": 1,
    "hookcli.runtime": 1,
}


def _layer(module: str) -> int:
    """A module's layer: its package's, or 0 for the shared base (records, options, errors,
    tree, text, bounds, _version)."""
    for prefix, layer in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return 0


def test_imports_point_down_the_layers() -> None:
    """cli parses → commands compute → engine runs passes, sources and inputs supply → io,
    render and runtime write and guard; never the other way (the public API, hookcli
    itself, and `python -m hookcli` sit on top)."""
    graph, _ = _imports(_sources())
    upward = [
        f"{module} -> {target}"
        for module, targets in graph.items()
        if module not in ("hookcli", "hookcli.__main__")
        for target in targets
        if target != "hookcli" and _layer(target) > _layer(module)
    ]
    assert not upward, upward


def test_the_layer_test_sees_an_upward_arrow() -> None:
    graph, _ = _imports(
        {
            "hookcli.engine.x": "from hookcli.commands import run_command\n",
            "hookcli.commands": "",
        }
    )
    assert _layer("hookcli.commands") > _layer("hookcli.engine.x")
    assert "hookcli.commands" in graph["hookcli.engine.x"]


MODULE_LINES = 800  # a module past this is doing more than one job (issue 50): split it


def test_no_module_is_longer_than_800_lines() -> None:
    lines = {
        str(p.relative_to(SRC)): len(p.read_text(encoding="utf-8").splitlines())
        for p in sorted(SRC.rglob("*.py"))
    }
    long = {name: n for name, n in lines.items() if n > MODULE_LINES}
    assert lines, "the package was read"
    assert long == {}, f"split these by job: {long}"
