"""The layouts a tensor-parallel plan gives the plain tensors its modules take and hand on.

transformers' `tp_plan` (`from_pretrained(..., tp_plan="auto")`, or hookcli's `--tp`) shards
a module's weights as DTensors and wraps its forward: a `colwise` Linear takes the whole
(replicated) input and hands on its shard of the output's last dimension as a plain tensor, a
`rowwise` one takes such a shard and hands on the whole, summed output. Hooks around the module
see those plain tensors, never a DTensor, so nothing in a tensor says it is one rank's part:
the style applied to the module does. Each style is read here, once per pass, into what each
of its module's first input and output is (`Declared`: a shard over the group, its dimension
and its whole size; `WHOLE`; `UNKNOWN` for a style whose layout is not known here, whose
tensors then say they are this rank's part only). engine/sharded.ShardBook merges the
declared shards as it merges a DTensor's.

The style is the object the plan applied (found in the wrapped forward it installed), not the
plan's names matched again, so a plan the user changed is read as it ran. Nothing here imports
transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True, slots=True)
class Declared:
    """A plain tensor that is this rank's shard of a whole tensor: split over `group` along
    `dim` (negative: from the end), whose whole size there is `size` (None: the shards are
    the same size, the whole is this rank's times the group's)."""

    group: Any
    dim: int
    size: int | None = None


WHOLE = "whole"  # every rank holds the same, whole tensor
UNKNOWN = "unknown"  # a style whose layout is not known here

Layout = Declared | str


@dataclass(slots=True)
class Layouts:
    """A model's tensor-parallel layouts: by module name, its first input's ("in") and its
    output's ("out"); the names of the modules without children, and of those among them that
    work element by element (activations, dropout). A leaf fed a shard and handing on a tensor
    of the same shape hands on the same layout when it works element by element, or when the
    shard splits a dimension before the last (a norm over the last dimension of whole heads)."""

    sides: dict[str, dict[str, Layout]]
    leaves: frozenset[str]
    elementwise: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.sides)


NONE = Layouts({}, frozenset())
# where element-by-element modules are defined (torch's activations less those that mix a
# dimension, dropout, identity; transformers' activations)
_ELEMENTWISE = (
    "torch.nn.modules.activation",
    "torch.nn.modules.dropout",
    "transformers.activations",
)
_MIXING = ("Softmax", "Softmin", "LogSoftmax", "Softmax2d", "GLU", "MultiheadAttention")


def tp_layouts(model: nn.Module) -> Layouts:
    """The layouts transformers' tensor-parallel plan gave `model`'s modules; NONE for a model
    it did not shard (torch's own `parallelize_module` hands DTensors on: nothing to read)."""
    sides: dict[str, dict[str, Layout]] = {}
    leaves: list[str] = []
    elementwise: list[str] = []
    for name, module in model.named_modules():
        if not module._modules:
            leaves.append(name)
            kind = type(module)
            if kind.__name__ == "Identity" or (
                kind.__module__ in _ELEMENTWISE and kind.__name__ not in _MIXING
            ):
                elementwise.append(name)
        if not getattr(module, "_is_hooked", False):
            continue
        style, mesh = _style_of(module)
        if style is None:
            continue
        sides[name] = _sides(style, mesh, module)
    return Layouts(sides, frozenset(leaves), frozenset(elementwise)) if sides else NONE


def _style_of(module: nn.Module) -> tuple[Any, Any]:
    """The style object and mesh a plan's wrapped forward holds (None: not such a forward)."""
    forward = module.__dict__.get("forward")
    code = getattr(forward, "__code__", None)
    cells = getattr(forward, "__closure__", None)
    if code is None or cells is None:
        return None, None
    try:
        held = {n: c.cell_contents for n, c in zip(code.co_freevars, cells, strict=True)}
    except ValueError:  # an empty cell
        return None, None
    style, mesh = held.get("self"), held.get("mesh")
    if style is None or mesh is None or not hasattr(mesh, "get_group"):
        return None, None
    return style, mesh


def _sides(style: Any, mesh: Any, module: nn.Module) -> dict[str, Layout]:
    """What a style makes of its module's first input and output."""
    kind = type(style).__name__
    if getattr(mesh, "ndim", 0) != 1:
        return {"in": UNKNOWN, "out": UNKNOWN}
    group = mesh.get_group()
    if kind in ("ColwiseParallel", "RowwiseParallel") and hasattr(style, "output_layouts"):
        return {
            "in": _placed(style.input_layouts, group, getattr(module, "in_features", None)),
            "out": _placed(style.output_layouts, group, getattr(module, "out_features", None)),
        }
    seq = Declared(group, int(getattr(style, "sequence_dim", 1)))
    known: dict[str, tuple[Layout, Layout]] = {
        # ids in whole; each shard's lookup summed or gathered into the whole
        "EmbeddingParallel": (WHOLE, WHOLE),
        "SequenceParallel": (seq, seq),
        # each rank's parts of the packed gate and up features, side by side
        "PackedColwiseParallel": (WHOLE, Declared(group, -1)),
    }
    if kind in _PARAMETERS_ONLY:
        return {}
    took, gave = known.get(kind, (UNKNOWN, UNKNOWN))
    return {"in": took, "out": gave}


# styles that say how a module's weights are kept (whole, their gradients summed), nothing of
# its tensors: those are what flows in (a per-head norm takes this rank's heads)
_PARAMETERS_ONLY = ("TensorParallelLayer", "ReplicatedWithGradAllReduce", "LocalParamsParallel")


def _placed(placement: Any, group: Any, size: Any) -> Layout:
    """A torch placement as a layout: Shard(d) a shard of d (the last dimension's whole size
    `size`, a Linear's features), Replicate whole, anything else unknown."""
    placements = placement if isinstance(placement, tuple) else (placement,)
    if len(placements) != 1:
        return UNKNOWN
    (p,) = placements
    if p.is_replicate():
        return WHOLE
    if p.is_shard():
        dim = int(p.dim)
        last = dim == -1
        return Declared(group, dim, int(size) if last and isinstance(size, int) else None)
    return UNKNOWN
