"""Imports flow one way: the CLI entry and the renderers never import torch, no module imports
another that imports it back, and none imports another module's private names. The tests mirror
the package: each package has its tests' folder, and no test imports another test module (what
tests share is in tests/support)."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from tests.support.paths import ROOT


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

SRC = ROOT / "src"


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


# ---------------------------------------------------------------- the tests mirror the package

TESTS = ROOT / "tests"
# Temporary (issue 50): tests still at tests/ root, still importing tests.conftest and other
# test modules; each goes from this list when it moves to its package's folder.
# packages whose tests live elsewhere, each with the reason (none today)
NO_TEST_FOLDER: dict[str, str] = {}


def _imported(source_text: str) -> list[tuple[int, str]]:
    """Every module a source imports (with `from a import b`, also a.b: b may be a module),
    and every importlib.import_module("name") of a constant name, with its line."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source_text)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def _test_module_imports(sources: dict[str, str]) -> list[str]:
    """Each import of a test module (tests.….test_*) or of tests.conftest (its fixtures reach
    the tests by name, never by import), by the file making it."""
    bad = []
    for name, source_text in sorted(sources.items()):
        for line, module in _imported(source_text):
            parts = module.split(".")
            if parts[0] == "tests" and any(
                p.startswith("test_") or p == "conftest" for p in parts[1:]
            ):
                bad.append(f"{name}:{line} imports {module}")
    return bad


def test_no_test_imports_another_test_module() -> None:
    """What tests share is in tests/support: a test module imports none of the others (nor
    does support, or a benchmark), so each can move, split or go on its own."""
    sources = {
        str(path.relative_to(ROOT)): path.read_text(encoding="utf-8")
        for folder in (TESTS, ROOT / "benchmarks")
        for path in sorted(folder.rglob("*.py"))
    }
    assert "tests/support/llm.py" in sources and "benchmarks/memory.py" in sources
    assert _test_module_imports(sources) == []


def test_the_import_rule_sees_every_way_of_importing_a_test_module() -> None:
    sources = {
        "a.py": "from tests.commands.test_dataset import make_folder\n",
        "b.py": "import tests.test_llm\n",
        "c.py": "from tests.engine import test_hooks\n",
        "d.py": "def f():\n    from tests.conftest import ROOT\n",
        "e.py": "import importlib\nllm = importlib.import_module('tests.sources.test_llm')\n",
        "ok.py": "from tests.support.llm import save\nfrom tests.support import models\n"
        "from test_x import y\n",
    }
    assert _test_module_imports(sources) == [
        "a.py:1 imports tests.commands.test_dataset",
        "a.py:1 imports tests.commands.test_dataset.make_folder",
        "b.py:1 imports tests.test_llm",
        "c.py:1 imports tests.engine.test_hooks",
        "d.py:2 imports tests.conftest",
        "d.py:2 imports tests.conftest.ROOT",
        "e.py:2 imports tests.sources.test_llm",
    ]


def _mirror_faults(packages: set[str], test_folders: dict[str, bool]) -> list[str]:
    """Packages (paths under src/hookcli, "" for hookcli itself) without their tests' folder,
    and test folders (paths under tests/ holding test modules: whether it is a package) that
    mirror no package or are no package themselves."""
    faults = [
        f"{package or 'hookcli'}: no tests/{package}"
        for package in sorted(packages)
        if package not in test_folders and package not in NO_TEST_FOLDER
    ]
    for folder, is_package in sorted(test_folders.items()):
        if folder not in packages:
            faults.append(f"tests/{folder}: mirrors no package of src/hookcli")
        elif not is_package:
            faults.append(f"tests/{folder}: no __init__.py")
    return faults


def test_every_package_has_its_tests_folder() -> None:
    """tests/ mirrors src/hookcli: the tests of engine/ are in tests/engine/, of
    commands/diff/ in tests/commands/diff/, and so on; no other folder holds tests."""
    package = SRC / "hookcli"
    packages = {
        init.parent.relative_to(package).as_posix().removeprefix(".")
        for init in package.rglob("__init__.py")
    }
    test_folders = {
        test.parent.relative_to(TESTS).as_posix().removeprefix("."): (
            test.parent / "__init__.py"
        ).exists()
        for test in TESTS.rglob("test_*.py")
    }
    assert {"", "engine", "commands/watch"} <= packages, packages
    assert NO_TEST_FOLDER.keys() <= packages, "an exemption for a package that is gone"
    assert _mirror_faults(packages, test_folders) == []


def test_the_mirror_rule_sees_a_missing_folder_and_a_stray_one() -> None:
    faults = _mirror_faults(
        {"", "engine", "commands", "commands/diff"},
        {"": True, "engine": True, "commands": False, "enigne": True},
    )
    assert faults == [
        "commands/diff: no tests/commands/diff",
        "tests/commands: no __init__.py",
        "tests/enigne: mirrors no package of src/hookcli",
    ]
