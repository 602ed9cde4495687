"""A model class read from a script without running the script (issue 32).

`hookcli replay run.bundle --model train.py:Net` names a class defined in the training script
itself, the common case. Importing that script would run it: the whole training again, its log
and the bundle being replayed rewritten. So a model file is executed as its *definitions* only:

- imports, classes and functions (their decorators and default values run, as at any import);
- assignments whose value runs nothing: literals, names, attributes, subscripts, operators and
  lambdas (`HIDDEN = 64`, `Act = nn.GELU`, `__all__ = [...]`), and the one statement that binds
  the name the user asked for (`resnet = partial(ResNet, ...)` for `file.py:resnet`);
- `if` and `try` statements made only of the above (`try: import apex except ImportError: ...`).

Everything else at the top level (calls such as `main()` or `torch.manual_seed(0)`, loops,
`with` blocks, `if __name__ == "__main__":`, assignments that call something) is not run. A file
that is a module of definitions runs exactly as an import would; a script runs no further than
its definitions. What was left out is returned, so a missing name can be explained.

This keeps a script from running; it is no sandbox: the definitions kept run as at any import
(decorators, base classes, default values, class bodies), as they must for the class to exist.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field


@dataclass(slots=True)
class Skipped:
    """A top-level statement not run: its line, its first line of source and the names it
    would have bound."""

    line: int
    text: str
    names: set[str] = field(default_factory=set)


@dataclass(slots=True)
class Definitions:
    module: ast.Module  # the statements to run
    skipped: list[Skipped]

    def binder(self, name: str) -> Skipped | None:
        """The skipped statement that would have bound `name`, if one would have."""
        return next((s for s in self.skipped if name in s.names), None)

    def summary(self) -> str:
        """ "lines 40-41, 44" of the statements not run."""
        lines = sorted({s.line for s in self.skipped})
        shown = ", ".join(map(str, lines[:8])) + (
            f" (+{len(lines) - 8} more)" if len(lines) > 8 else ""
        )
        return f"line{'s' if len(lines) > 1 else ''} {shown}"


def definitions(source: str, filename: str, wanted: str) -> Definitions:
    """The statements of `source` to run for `wanted` (see the module docstring). SyntaxError
    propagates, with the file's line numbers."""
    tree = ast.parse(source, filename)
    lines = source.splitlines()
    kept: list[ast.stmt] = []
    skipped: list[Skipped] = []
    for i, stmt in enumerate(tree.body):
        asked = isinstance(stmt, ast.Assign | ast.AnnAssign) and wanted in _bound(stmt)
        if _defines(stmt) or (i == 0 and _is_docstring(stmt)) or asked:
            kept.append(stmt)
        else:
            text = lines[stmt.lineno - 1].strip() if stmt.lineno <= len(lines) else ""
            skipped.append(Skipped(stmt.lineno, text[:80], _bound(stmt)))
    module = ast.Module(body=kept, type_ignores=tree.type_ignores)
    return Definitions(module, skipped)


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)


def _defines(stmt: ast.stmt) -> bool:  # noqa: PLR0911 — one return per kind of statement
    """A statement that only defines: run when the script's definitions are read."""
    if isinstance(
        stmt, ast.Import | ast.ImportFrom | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
    ):
        return True
    if isinstance(stmt, ast.Pass):
        return True
    if isinstance(stmt, ast.Assign):
        return _static(stmt.value) and all(_static_target(t) for t in stmt.targets)
    if isinstance(stmt, ast.AnnAssign):
        return (
            _static_target(stmt.target)
            and _static(stmt.annotation)  # module-level annotations are evaluated
            and (stmt.value is None or _static(stmt.value))
        )
    if isinstance(stmt, ast.If):
        return _static(stmt.test) and all(_defines(s) for s in [*stmt.body, *stmt.orelse])
    if isinstance(stmt, ast.Try):
        parts = [*stmt.body, *stmt.orelse, *stmt.finalbody]
        for handler in stmt.handlers:
            if handler.type is not None and not _static(handler.type):
                return False
            parts += handler.body
        return all(_defines(s) for s in parts)
    return False


def _static_target(target: ast.expr) -> bool:
    """An assignment target that binds names and runs nothing (no attribute or item set)."""
    if isinstance(target, ast.Name):
        return True
    if isinstance(target, ast.Tuple | ast.List):
        return all(_static_target(t) for t in target.elts)
    return False


def _static(node: ast.AST) -> bool:
    """An expression that calls nothing when evaluated: no call, await, yield or walrus outside
    a lambda's body (a lambda's body runs only when it is called)."""
    if isinstance(node, ast.Lambda):
        return all(_static(d) for d in [*node.args.defaults, *node.args.kw_defaults] if d)
    if isinstance(node, ast.Call | ast.Await | ast.Yield | ast.YieldFrom | ast.NamedExpr):
        return False
    return all(_static(child) for child in ast.iter_child_nodes(node))


def _bound(stmt: ast.stmt) -> set[str]:
    """The top-level names a statement binds."""
    names: set[str] = set()
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {stmt.name}
    if isinstance(stmt, ast.Import | ast.ImportFrom):
        return {(a.asname or a.name).partition(".")[0] for a in stmt.names}
    targets: list[ast.expr] = []
    if isinstance(stmt, ast.Assign):
        targets = list(stmt.targets)
    elif isinstance(stmt, ast.AnnAssign | ast.AugAssign | ast.For | ast.AsyncFor):
        targets = [stmt.target]
    elif isinstance(stmt, ast.With | ast.AsyncWith):
        targets = [i.optional_vars for i in stmt.items if i.optional_vars is not None]
    for t in targets:
        for n in ast.walk(t):
            if isinstance(n, ast.Name):
                names.add(n.id)
    if isinstance(stmt, ast.If | ast.Try | ast.For | ast.While | ast.With):
        for child in ast.iter_child_nodes(stmt):
            if isinstance(child, ast.stmt):
                names |= _bound(child)
        if isinstance(stmt, ast.Try):
            for h in stmt.handlers:
                for s in h.body:
                    names |= _bound(s)
    return names
