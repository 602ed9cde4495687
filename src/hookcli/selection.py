"""Layer selection: dotted names, globs, types and depth → the module objects to hook.

`named_modules()` hides aliases (`self.b = self.a` lists only `a`), so modules are gathered
with `remove_duplicate=False` and grouped by object: one Target per module, all its names.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from hookcli.errors import UsageError
from hookcli.hooks import Target

ROOT_LABEL = "(model)"


@dataclass(slots=True)
class ModuleEntry:
    module: nn.Module
    names: list[str]
    type: str
    depth: int
    leaf: bool
    own_params: int
    params: int

    @property
    def name(self) -> str:
        return self.names[0]


def depth_of(name: str) -> int:
    return 0 if name == "" else name.count(".") + 1


def module_entries(model: nn.Module) -> list[ModuleEntry]:
    """Every distinct module in registration order, with all the names it is reachable by."""
    by_id: dict[int, ModuleEntry] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        entry = by_id.get(id(module))
        if entry is not None:
            entry.names.append(name)
            continue
        by_id[id(module)] = ModuleEntry(
            module=module,
            names=[name],
            type=type(module).__name__,
            depth=depth_of(name),
            leaf=next(iter(module.children()), None) is None,
            own_params=sum(p.numel() for p in module._parameters.values() if p is not None),
            params=0,
        )
    # Subtree totals, counting a shared parameter once per subtree (as module.parameters()).
    for entry in by_id.values():
        if entry.own_params == 0 and entry.leaf:
            continue
        entry.params = (
            sum(p.numel() for p in entry.module.parameters())
            if not entry.leaf
            else entry.own_params
        )
    return list(by_id.values())


def _default(entry: ModuleEntry) -> bool:
    """Every leaf, plus non-root modules that own parameters directly (their own compute).

    MultiheadAttention holds `in_proj_weight` itself and never calls its `out_proj` as a
    module; without this rule the attention itself would go unseen.
    """
    return entry.leaf or (entry.own_params > 0 and entry.depth > 0)


def _suggest(word: str, candidates: Sequence[str]) -> list[str]:
    plain = word.replace("*", "").replace("?", "")
    close = difflib.get_close_matches(plain, candidates, n=3, cutoff=0.5)
    if not close and plain:
        close = [c for c in candidates if c.startswith(plain.split(".")[0])][:3]
    return close


def select(
    entries: list[ModuleEntry],
    *,
    layers: Sequence[str] = (),
    types: Sequence[str] = (),
    depth: int | None = None,
    model_label: str = "MODEL",
    also: Sequence[str] = (),
) -> list[Target]:
    """The modules to hook. Kinds of filter intersect; repeated filters of one kind unite.

    No filter: every leaf module (see `_default`). `--depth N`: modules at depth N plus
    leaves above it, so the whole network is still covered.
    """
    names = [n for e in entries for n in e.names if n]
    if depth is not None and depth < 1:
        raise UsageError(
            f"--depth must be 1 or more, got {depth}.", "use --depth 1 for top-level blocks."
        )
    for pattern in (*layers, *also):
        if not any(_match(pattern, e) for e in entries):
            close = _suggest(pattern, names)
            near = f" Nearest: {', '.join(close)}." if close else ""
            raise UsageError(
                f"no layer matches {pattern!r}.{near}",
                f"run `hookcli layers {model_label}` to list layer names.",
            )
    type_names = sorted({e.type for e in entries})
    lowered = {t.lower(): t for t in type_names}
    wanted_types: set[str] = set()
    for t in types:
        if t.lower() not in lowered:
            close = _suggest(t, type_names)
            near = f" Nearest: {', '.join(close)}." if close else ""
            raise UsageError(
                f"no layer has type {t!r}.{near}",
                f"run `hookcli layers {model_label}` to see the types in this model.",
            )
        wanted_types.add(lowered[t.lower()])

    chosen: list[ModuleEntry] = []
    for e in entries:
        if any(_match(p, e) for p in also):  # needed by a rule (--expect-shape), whatever else
            chosen.append(e)
            continue
        if layers and not any(_match(p, e) for p in layers):
            continue
        if wanted_types and e.type not in wanted_types:
            continue
        if depth is not None:
            if not (e.depth == depth or (e.leaf and 0 < e.depth < depth)):
                continue
        elif not layers and not _default(e):
            continue
        chosen.append(e)
    if not chosen:
        raise UsageError(
            "the layer filters together select no layer.",
            f"loosen -l/-t/--depth; run `hookcli layers {model_label}` to see what exists.",
        )
    return [Target(e.module, e.name or ROOT_LABEL, e.names[1:], e.type) for e in chosen]


def _match(pattern: str, entry: ModuleEntry) -> bool:
    if any(ch in pattern for ch in "*?["):
        return any(fnmatch.fnmatchcase(n, pattern) for n in entry.names if n)
    return pattern in entry.names
