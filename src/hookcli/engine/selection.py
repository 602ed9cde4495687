"""Layer selection: dotted names, globs, types and depth → the module objects to hook.

`named_modules()` hides aliases (`self.b = self.a` lists only `a`), so modules are gathered
path by path (aliases included) and grouped by object: one Target per module, all its names.
A module graph with a cycle (a child holding its parent) is refused here, by name, instead
of recursing without end.

Parameters that do not exist yet (`nn.LazyLinear`'s UninitializedParameter) count 0 until
the forward that materialises them; counts are taken again after it (`recount`). TorchScript
modules refuse Python hooks (scripted) or never fire them inside (traced): they stay in the
list, marked not hookable, and are never selected (docs/traps.md §15).
"""

from __future__ import annotations

import difflib
import fnmatch
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.jit import TracedModule  # type: ignore[attr-defined]
from torch.nn.parameter import is_lazy

from hookcli.engine.hooks import Target
from hookcli.engine.tensorbits import PLAIN
from hookcli.errors import ModelError, UsageError

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
    # why Python hooks cannot see this module (TorchScript), None when they can
    unhookable: str | None = None
    # a scripted module inside eager parents: (parent, attribute) where it sits, so that a
    # stand-in can take its place for a pass (hooks.ScriptedCall); empty for any other module
    places: list[tuple[nn.Module, str]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.names[0]


def depth_of(name: str) -> int:
    return 0 if name == "" else name.count(".") + 1


def numel(p: torch.Tensor | None) -> int:
    """Elements of a parameter; 0 for one that does not exist yet (lazy modules)."""
    if type(p) in PLAIN:
        return p.numel()  # type: ignore[union-attr]
    return 0 if p is None or is_lazy(p) else p.numel()


def held(
    model: nn.Module, modules: Sequence[nn.Module] | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A model's parameters and buffers, each shared one once (a tensor that is both, a
    parameter), in one walk of the module dicts (what parameters() and buffers() give,
    without their generators' cost per module). `modules`: `all_modules(model)`, where the
    caller has just made it."""
    modules = all_modules(model) if modules is None else modules
    params = {id(t): t for m in modules for t in m._parameters.values() if t is not None}
    buffers = {
        id(b): b
        for m in modules
        if m._buffers
        for b in m._buffers.values()
        if b is not None and id(b) not in params
    }
    return list(params.values()), list(buffers.values())


def all_modules(model: nn.Module) -> list[nn.Module]:
    """model.modules() as a list — each module once, in its order — without its generators'
    cost per module."""
    out: list[nn.Module] = []
    seen: set[int] = set()
    stack = [model]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        out.append(module)
        children = module._modules
        if children:
            stack += reversed([m for m in children.values() if m is not None])
    return out


def count_params(model: nn.Module) -> int:
    """Parameters of a model, each shared one once; lazy ones not yet materialised count 0."""
    return _sizes(held(model))[0]


def dtypes_held(
    model: nn.Module, tensors: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
) -> tuple[str, list[str]]:
    """The floating-point dtype the model's parameters and buffers hold most of (by elements),
    and the others some of them keep (a checkpoint's keep-in-float32 modules); float32 for a
    model with none. `tensors`: what `held(model)` gave, when the caller has it."""
    return _sizes(held(model) if tensors is None else tensors)[1]


def _sizes(
    tensors: tuple[list[torch.Tensor], list[torch.Tensor]],
) -> tuple[int, tuple[str, list[str]]]:
    """The parameters' elements (lazy ones not yet materialised: 0) and `dtypes_held`, from
    one look at each tensor."""
    params, buffers = tensors
    total = 0
    counts: dict[torch.dtype, int] = {}
    for group in (params, buffers):
        for t in group:
            if type(t) not in PLAIN and is_lazy(t):
                continue
            n = t.numel()
            if group is params:
                total += n
            if t.is_floating_point():
                counts[t.dtype] = counts.get(t.dtype, 0) + n
    if not counts:
        return total, ("float32", [])
    main = max(counts, key=lambda k: counts[k])
    return total, (_dtype_name(main), sorted(_dtype_name(k) for k in counts if k != main))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(
    model: nn.Module, tensors: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
) -> str:
    """dtypes_held in words: `bfloat16 (float32 in some tensors)`."""
    main, others = dtypes_held(model, tensors)
    return main + (f" ({', '.join(others)} in some tensors)" if others else "")


def params_and_dtype(
    model: nn.Module, tensors: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
) -> tuple[int, str]:
    """count_params and dtype_of from one walk of the model (`tensors`: what `held(model)`
    gave, when the caller has it)."""
    total, (main, others) = _sizes(held(model) if tensors is None else tensors)
    return total, main + (f" ({', '.join(others)} in some tensors)" if others else "")


def has_lazy(model: nn.Module) -> bool:
    """Whether parameters or buffers wait for a first forward to get their shapes."""
    return any(is_lazy(t) for t in (*model.parameters(), *model.buffers()))


def walk(model: nn.Module) -> Iterator[tuple[str, nn.Module, nn.Module | None]]:
    """(path, module, enclosing module) for every path to every module, aliases included, in
    `named_modules(remove_duplicate=False)` order — without its recursion, and refusing a
    cycle (a module that holds one of its own ancestors) with a ModelError naming it."""
    stack: list[tuple[str, nn.Module, nn.Module | None, tuple[int, ...]]] = [("", model, None, ())]
    while stack:
        name, module, parent, above = stack.pop()
        yield name, module, parent
        ancestors = (*above, id(module))
        children = [(n, m) for n, m in module._modules.items() if m is not None]
        for child_name, child in reversed(children):
            path = f"{name}.{child_name}" if name else child_name
            if id(child) in ancestors:
                raise ModelError(
                    f"the module graph of {type(model).__name__} has a cycle: {path} is "
                    f"{_cycle_name(model, child)}, which contains it, so the module tree has "
                    "no end (named_modules, .to(), state_dict would recurse forever).",
                    "hold the enclosing module in a plain attribute (not a registered "
                    "submodule), e.g. via object.__setattr__ or a weakref.",
                )
            stack.append((path, child, module, ancestors))


def _cycle_name(model: nn.Module, target: nn.Module) -> str:
    if target is model:
        return "the model itself"
    for name, m in model.named_modules():  # memoised: finite even with a cycle
        if m is target:
            return str(name)
    return type(target).__name__


def _type_of(module: nn.Module) -> str:
    """The class name; a TorchScript module's original class (not RecursiveScriptModule)."""
    if isinstance(module, torch.jit.ScriptModule):
        return str(getattr(module, "original_name", None) or type(module).__name__)
    return type(module).__name__


_SCRIPTED = "TorchScript (torch.jit.script) refuses Python hooks"
_TRACED_INSIDE = "inside a traced TorchScript module, hooks never run"
_SCRIPTED_INSIDE = "inside a scripted TorchScript module, hooks never run"


def is_scripted(module: nn.Module) -> bool:
    """A torch.jit.script module (it refuses hooks; a traced one accepts them)."""
    return isinstance(module, torch.jit.ScriptModule) and not isinstance(module, TracedModule)


def _unhookable(module: nn.Module, parent: ModuleEntry | None) -> str | None:
    """Why Python hooks cannot see a module, or None. A scripted module inside an eager parent
    is seen: measured at its call through a stand-in in the parent (hooks.ScriptedCall); what
    is inside any TorchScript module is not."""
    if parent is not None and parent.unhookable is not None:
        return parent.unhookable
    if parent is not None and isinstance(parent.module, torch.jit.ScriptModule):
        # a traced or stood-in scripted module fires hooks at its own call, not inside
        return _SCRIPTED_INSIDE if is_scripted(parent.module) else _TRACED_INSIDE
    if is_scripted(module) and parent is None:
        return _SCRIPTED
    return None


def module_entries(model: nn.Module) -> list[ModuleEntry]:
    """Every distinct module in registration order, with all the names it is reachable by.
    Remembered for a model whose modules, their names and their parameters' shapes are as
    they were (`_fingerprint`): a warm loop calling the API pays a cheap walk, not the table.
    What is remembered holds no module: the model is freed as if it had never been seen."""
    print_, walked = _fingerprint(model)
    kept = _KEPT.get(model)
    if kept is not None and kept[0] == print_:
        return [
            ModuleEntry(
                walked[k],
                list(names),
                kind,
                depth,
                leaf,
                own,
                params,
                unhookable,
                [(walked[j], attr) for j, attr in places],
            )
            for k, names, (kind, depth, leaf, own, params, unhookable), places in kept[1]
        ]
    entries = _entries(model)
    at = {id(m): k for k, m in enumerate(walked)}
    rows = [
        (
            at[id(e.module)],
            tuple(e.names),
            (e.type, e.depth, e.leaf, e.own_params, e.params, e.unhookable),
            tuple((at[id(parent)], attr) for parent, attr in e.places),
        )
        for e in entries
    ]
    _KEPT[model] = (print_, rows)
    return entries


_Fields = tuple[str, int, bool, int, int, str | None]  # ModuleEntry's, from type to unhookable
_Row = tuple[int, tuple[str, ...], _Fields, tuple[tuple[int, str], ...]]
# each model's last module table, as the fingerprint it was made for and each entry's fields
# with its module (and the parents of its places) as places in the fingerprint's walk
_KEPT: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[Any, ...], list[_Row]]] = (
    weakref.WeakKeyDictionary()
)


def _fingerprint(model: nn.Module) -> tuple[tuple[Any, ...], list[nn.Module]]:
    """What the module table is made of — each module's class and identity, its children's
    names, its parameters' names, identities and shapes (a lazy one's shape changes when it
    is materialised), in walk order — and each distinct module in that order. The modules
    are alive while the caller holds the list, so no identity in it is reused meanwhile."""
    out: list[Any] = []
    walked: list[nn.Module] = []
    stack, seen = [model], set()
    plain = PLAIN
    while stack:
        module = stack.pop()
        key = id(module)
        out.append((type(module), key))
        if key in seen:  # an alias (or a cycle, which the table's walk refuses)
            continue
        seen.add(key)
        walked.append(module)
        children = module._modules
        if children:
            out.append(tuple(children.keys()))  # (TorchScript's dict: keys() only)
            kids = [child for child in children.values() if child is not None]
            if len(kids) < len(children):
                out.append(tuple(child is None for child in children.values()))
            stack += kids
        params = module._parameters
        if params:
            out.append(tuple(params.keys()))
            out += [
                None if p is None else (id(p), p.shape if type(p) in plain or not is_lazy(p) else 0)
                for p in params.values()
            ]
    return tuple(out), walked


def _entries(model: nn.Module) -> list[ModuleEntry]:
    by_id: dict[int, ModuleEntry] = {}
    for name, module, parent in walk(model):
        entry = by_id.get(id(module))
        if entry is not None:
            entry.names.append(name)
        else:
            by_id[id(module)] = entry = ModuleEntry(
                module=module,
                names=[name],
                type=_type_of(module),
                depth=depth_of(name),
                leaf=all(m is None for m in module._modules.values()),  # (children())
                own_params=0,
                params=0,
                unhookable=_unhookable(module, by_id.get(id(parent))),
            )
        if is_scripted(module) and parent is not None and entry.unhookable is None:
            entry.places.append((parent, name.rpartition(".")[2]))  # every place it sits
    entries = list(by_id.values())
    recount(entries)
    return entries


def recount(entries: Sequence[ModuleEntry]) -> None:
    """Parameter counts, again after a forward has materialised lazy parameters. Subtree
    totals count a shared parameter once per subtree (as module.parameters())."""
    # each module's subtree parameters by identity, built from its children's: entries come
    # parents first, so in reverse a module's children are counted before it (an alias met
    # later is counted the long way)
    below: dict[int, dict[int, int]] = {}
    for entry in reversed(entries):
        module = entry.module
        own = {id(p): numel(p) for p in module._parameters.values() if p is not None}
        entry.own_params = sum(numel(p) for p in module._parameters.values())
        subtree = own
        for child in module._modules.values():
            if child is None:
                continue
            counted = below.get(id(child))
            if counted is None:
                subtree = {id(p): numel(p) for p in module.parameters()}
                break
            subtree.update(counted)  # `own` is this module's alone: filled in place
        below[id(module)] = subtree
        entry.params = entry.own_params if entry.leaf else sum(subtree.values())


def _default(entry: ModuleEntry) -> bool:
    """Every leaf, plus modules that own parameters directly (their own compute; the root
    too: a ViT's class token and position embedding, whose gradients are the model's).

    MultiheadAttention holds `in_proj_weight` itself and never calls its `out_proj` as a
    module; without this rule the attention itself would go unseen.
    """
    if entry.leaf:
        return True
    if isinstance(entry.module, torch.jit.ScriptModule) and entry.unhookable is None:
        return True  # a TorchScript module is seen at its call only: its insides are not
    return entry.own_params > 0


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
    always: Sequence[str] = (),
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
    every_name = {n for e in entries for n in e.names}
    for pattern in (*layers, *always):
        if _is_glob(pattern):
            found = any(map(_matcher([pattern]), entries))
        else:
            found = pattern in every_name
        if not found:
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

    needed, named = _matcher(always), _matcher(layers)
    chosen: list[ModuleEntry] = []
    for e in entries:
        if always and needed(e):  # needed by a rule (--expect-shape)
            chosen.append(e)
            continue
        if layers and not named(e):
            continue
        if wanted_types and e.type not in wanted_types:
            continue
        if depth is not None:
            if not (e.depth == depth or (e.leaf and 0 < e.depth < depth)):
                continue
        elif not layers and not _default(e):
            continue
        chosen.append(e)
    hookable = [e for e in chosen if e.unhookable is None]
    if chosen and not hookable:
        shown = ", ".join(e.name or ROOT_LABEL for e in chosen[:3])
        raise UsageError(
            f"{shown}{'…' if len(chosen) > 3 else ''} cannot be hooked: {chosen[0].unhookable}.",
            "pick a layer outside the TorchScript module, or inspect the eager nn.Module "
            "it was scripted from.",
        )
    if not hookable:
        raise UsageError(
            "the layer filters together select no layer.",
            f"loosen -l/-t/--depth; run `hookcli layers {model_label}` to see what exists.",
        )
    return [target_of(e) for e in hookable]


def target_of(entry: ModuleEntry) -> Target:
    """The Target hooks attach to for a module entry (a scripted one with its places)."""
    return Target(
        entry.module, entry.name or ROOT_LABEL, entry.names[1:], entry.type, list(entry.places)
    )


def unhookable_note(entries: Sequence[ModuleEntry]) -> str | None:
    """A report note naming the modules Python hooks cannot see, or None when there are none."""
    unh = [e for e in entries if e.unhookable is not None]
    if not unh:
        return None
    roots = [
        e
        for e in unh
        if not any(o is not e and o.name and e.name.startswith(o.name + ".") for o in unh)
    ]
    inside = len(unh) - len(roots)
    names = ", ".join(e.name or ROOT_LABEL for e in roots[:5]) + ("…" if len(roots) > 5 else "")
    more = f" and {inside} module{'s' if inside != 1 else ''} inside" if inside else ""
    return (
        f"not hookable, so not measured: {names}{more} ({roots[0].unhookable}); the rest "
        "of the model is hooked"
    )


def _is_glob(pattern: str) -> bool:
    return any(ch in pattern for ch in "*?[")


def _matcher(patterns: Sequence[str]) -> Callable[[ModuleEntry], bool]:
    """Whether an entry matches any of `patterns`: a glob any of its names (the root's empty
    name aside), a plain name one of them, looked up in one set (a list of every block's name
    compared with each module's cost milliseconds a pass)."""
    exact = frozenset(p for p in patterns if not _is_glob(p))
    globs = [p for p in patterns if _is_glob(p)]

    def matches(entry: ModuleEntry) -> bool:
        if not exact.isdisjoint(entry.names):
            return True
        return any(fnmatch.fnmatchcase(n, p) for p in globs for n in entry.names if n)

    return matches
