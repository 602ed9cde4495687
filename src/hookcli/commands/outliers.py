"""--channels on the command side: which tensors are measured per channel. The numbers are
taken by the statistics collector (engine.channels) and read across a report's calls by
engine.outliers (`summary`, re-exported here). No torch at import.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hookcli.engine.outliers import summary
from hookcli.errors import UsageError
from hookcli.records import LayerCall

__all__ = ["channel_axis", "chooser", "expert_rows", "summary"]

LayoutOf = Callable[[str, tuple[int, ...]], Any]


# modules whose 3-D inputs and outputs are (N, C, L): the channel is dim 1, not the last
CHANNELS_FIRST = ("Conv1d", "ConvTranspose1d", "BatchNorm1d", "InstanceNorm1d", "MaxPool1d",
                  "AvgPool1d", "AdaptiveAvgPool1d", "AdaptiveMaxPool1d", "LazyConv1d")  # fmt: skip


def channel_axis(shape: Sequence[int], layout: str | None, *, first: bool = False) -> int | None:
    """The channel dimension of a tensor of `shape`: the last of a 2-D (batch, features) or
    3-D (batch, tokens, channels) tensor — dim 1 of a 3-D one where `first` (a Conv1d's
    (N, C, L)); of a 4-D one, 1 for NCHW and 3 for NHWC as the layout engine read it. None
    where it cannot be told (a 4-D tensor of unknown layout, such as attention scores; 1-D,
    5-D and more)."""
    if len(shape) == 3 and first:
        return 1
    if len(shape) in (2, 3):
        return len(shape) - 1
    if len(shape) == 4:
        return {"NCHW": 1, "NHWC": 3}.get(layout or "")
    return None


def expert_rows(
    layers: list[LayerCall], measured: Sequence[tuple[str, str, int, Any]], types: Mapping[str, str]
) -> list[LayerCall]:
    """--channels on a fused MoE block: each routed expert's projection inputs (engine.
    fused_experts: EXPERTS.E.PROJECTION, over the tokens routed to it) as calls of their own,
    placed after the last call of their experts module's subtree (else at the end)."""
    if not measured:
        return layers
    by_owner: dict[str, list[LayerCall]] = {}
    for owner, name, call, stats in measured:
        row = LayerCall(name, types.get(owner, "experts"), call, inputs=[stats])
        by_owner.setdefault(owner, []).append(row)
    last: dict[str, int] = {}
    for i, c in enumerate(layers):
        for owner in by_owner:
            if c.name == owner or c.name.startswith(f"{owner}."):
                last[owner] = i
    out: list[LayerCall] = []
    for i, c in enumerate(layers):
        out.append(c)
        for owner, rows in by_owner.items():
            if last.get(owner) == i:
                out += sorted(rows, key=_expert_order)
    for owner, rows in by_owner.items():
        if owner not in last:
            out += sorted(rows, key=_expert_order)
    return out


def _expert_order(row: LayerCall) -> tuple[int, int, int]:
    _, e, projection = row.name.rsplit(".", 2)
    return row.call, int(e) if e.isdigit() else 0, int(projection == "down_proj")


def chooser(
    layout_of: LayoutOf, types: Mapping[str, str] | None = None
) -> Callable[[Any, tuple[int, ...]], int | None]:
    """The collector's channel chooser: a layer call's inputs and outputs (not gradients, not
    the model's own output) by their shape; a 4-D one by the layout the layout engine reads
    (NCHW, NHWC), none where it cannot tell (attention scores); a 3-D one of a module in
    CHANNELS_FIRST (`types`: each module's type by name) at dim 1."""
    first = {name for name, t in (types or {}).items() if t in CHANNELS_FIRST}
    layouts: dict[tuple[str, tuple[int, ...]], str | None] = {}

    def choose(context: Any, shape: tuple[int, ...]) -> int | None:
        if not isinstance(context, tuple) or len(context) != 3:
            return None
        name, _, kind = context
        if kind not in ("in", "out") or name == "(model)":
            return None
        layout = None
        if len(shape) == 4:
            # an input's layout is its producer's, not this layer's output's (a Permute's input
            # is NCHW, its output NHWC): read from its shape alone, under a name no module has
            # (no hint of the model's applies to it)
            key = (name if kind == "out" else f"{name}#in", shape)
            if key not in layouts:
                try:
                    layouts[key] = layout_of(key[0], shape).kind
                except UsageError:
                    layouts[key] = None
            layout = layouts[key]
        return channel_axis(shape, layout, first=name in first)

    return choose
