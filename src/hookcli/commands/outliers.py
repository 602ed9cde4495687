"""--channels on the command side: which tensors are measured per channel. The numbers are
taken by the statistics collector (engine.channels) and read across a report's calls by
engine.outliers (`summary`, re-exported here). No torch at import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hookcli.engine.outliers import summary
from hookcli.errors import UsageError

__all__ = ["channel_axis", "chooser", "summary"]

LayoutOf = Callable[[str, tuple[int, ...]], Any]


def channel_axis(shape: Sequence[int], layout: str | None) -> int | None:
    """The channel dimension of a tensor of `shape`: the last of a 2-D (batch, features) or
    3-D (batch, tokens, channels) tensor; of a 4-D one, 1 for NCHW and 3 for NHWC as the layout
    engine read it. None where it cannot be told (a 4-D tensor of unknown layout, such as
    attention scores; 1-D, 5-D and more)."""
    if len(shape) in (2, 3):
        return len(shape) - 1
    if len(shape) == 4:
        return {"NCHW": 1, "NHWC": 3}.get(layout or "")
    return None


def chooser(layout_of: LayoutOf) -> Callable[[Any, tuple[int, ...]], int | None]:
    """The collector's channel chooser: a layer call's inputs and outputs (not gradients, not
    the model's own output) by their shape; a 4-D one by the layout the layout engine reads
    (NCHW, NHWC), none where it cannot tell (attention scores)."""
    layouts: dict[tuple[str, tuple[int, ...]], str | None] = {}

    def choose(context: Any, shape: tuple[int, ...]) -> int | None:
        if not isinstance(context, tuple) or len(context) != 3:
            return None
        name, _, kind = context
        if kind not in ("in", "out") or name == "(model)":
            return None
        layout = None
        if len(shape) == 4:
            key = (name, shape)
            if key not in layouts:
                try:
                    layouts[key] = layout_of(name, shape).kind
                except UsageError:
                    layouts[key] = None
            layout = layouts[key]
        return channel_axis(shape, layout)

    return choose
