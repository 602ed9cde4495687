"""Which module calls two sides compare when their module trees differ.

torchvision's quantizable twin fuses conv+bn+relu on every side, but the sides still differ
below the fused module: the float twin's `conv1` is a ConvReLU2d container holding `conv1.0`
(Conv2d) and `conv1.1` (ReLU), the int8 twin's `conv1` is one QuantizedConvReLU2d; the float
`fc` is a leaf, the int8 `fc` holds a `_packed_params` module that is never called. Selecting
leaves on each side would compare none of them. So a selected module that the other side does
not have, inside a module that is a leaf there, is replaced by that module on both sides: the
fused unit is compared as one (A's container `conv1` with B's `conv1`; `fc` with `fc`).

Fusion leaves an Identity where each absorbed module was (`bn1`, `relu` after `conv1`): their
rows compare nothing of their own, so they are marked with the module they were fused into.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

from hookcli.engine.hooks import Target
from hookcli.engine.prepare import Prepared
from hookcli.engine.selection import ROOT_LABEL, ModuleEntry

_QUANTIZED = ("torch.ao.nn.quantized", "torch.ao.nn.intrinsic.quantized", "torch.nn.quantized")


def fused_into(before: Mapping[str, nn.Module], model: nn.Module) -> dict[str, str]:
    """Each Identity fusion left (a module replaced by nn.Identity) → the module it was fused
    into: the last module replaced by a non-Identity before it under the same parent."""
    into: dict[str, str] = {}
    last: dict[str, str] = {}  # parent → its last module replaced by a fused one
    for name, module in model.named_modules():
        if name not in before or before[name] is module:
            continue
        parent = name.rpartition(".")[0]
        if isinstance(module, nn.Identity):
            if parent in last:
                into[name] = last[parent]
        else:
            last[parent] = name
    return into


def type_label(module: nn.Module, selected: str) -> str:
    """The type a row shows: an int8 module by its own name (QuantizedConvReLU2d, not the
    ConvReLU2d its class is called), any other as selection named it."""
    if type(module).__module__.startswith(_QUANTIZED):
        return str(module._get_name())  # type: ignore[no-untyped-call]
    return selected


def _unit(name: str, other: Mapping[str, ModuleEntry]) -> str | None:
    """The module of the other side that holds `name` as a single unit: the nearest enclosing
    module it has, if that is a leaf there."""
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        found = other.get(".".join(parts[:end]))
        if found is not None:
            return ".".join(parts[:end]) if found.leaf else None
    return None


def align(sides: Sequence[Prepared]) -> None:
    """Every side's targets changed so that fused units are compared as one; types labelled."""
    names = [{n: e for e in p.entries for n in e.names if n} for p in sides]
    chosen = [[t.name for t in p.targets] for p in sides]
    changed = [False] * len(sides)
    moved = True
    while moved:
        moved = False
        for x, y in ((x, y) for x in range(len(sides)) for y in range(len(sides)) if x != y):
            for name in list(chosen[x]):
                if name == ROOT_LABEL or name in names[y]:
                    continue
                unit = _unit(name, names[y])
                if unit is None or unit not in names[x]:
                    continue
                if names[x][unit].unhookable or names[y][unit].unhookable:
                    continue
                chosen[x].remove(name)
                for i, side in ((x, chosen[x]), (y, chosen[y])):
                    if unit not in side:
                        side.append(unit)
                        changed[i] = True
                changed[x] = moved = True
    for p, keep, redo, by_name in zip(sides, chosen, changed, names, strict=True):
        if redo:
            wanted = {id(by_name[n].module) for n in keep if n in by_name}
            roots = {n for n in keep if n == ROOT_LABEL}
            p.targets = [
                Target(e.module, e.name or ROOT_LABEL, e.names[1:], e.type)
                for e in p.entries
                if id(e.module) in wanted or (not e.name and roots)
            ]
        for t in p.targets:
            t.type = type_label(t.module, t.type)
