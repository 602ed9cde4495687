"""A measured tensor's *row*, and the TensorStats it fills.

A row is the tensor's count of finite elements, then one number per statistic TensorStats
declares (records.TENSOR_STATS), in their order. The one pass (engine/stats.py: the numba
kernels, `cpu_row`, `torch_row`: engine/cpurow.py) measures the first nine

    count (finite elements), mean, var (population), min, max, zeros, nan, inf, norm

(std's place holds the variance; a fraction's, its count of elements); `AFTER_PASS` the rest,
given the pass's mean and std. `fill` completes a TensorStats from its row as each statistic's
kind says. A statistic declared and not measured here, or measured and not declared, stops
the import with both lists named.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hookcli.records import TENSOR_STATS, TensorStats

ROW = 9  # the one pass's row (count, then the statistics it measures)
COUNT, MEAN, VAR, MIN, MAX, ZEROS, NAN, INF, NORM = range(ROW)
# what the one pass measures after the count, in its row's order (the kernels', torch_row's)
PASS_STATS = ("mean", "std", "min", "max", "zeros", "nan", "inf", "norm")
# Statistics a second look at the tensor measures, given the pass's mean and std (population,
# over the finite elements): each a function of (the tensor, real-valued and strided, on its
# device; mean; std) to its row value, a 0-d tensor on that device (no host sync): a count of
# elements for a "fraction" or "count" statistic, else the value. The mean and std are floats
# for a CPU row, 0-d tensors for a device row; NaN when no element is finite. Torch ops only,
# so each is written once for every path (the kernels', the CPU torch path, a GPU's).
AFTER_PASS: dict[str, Callable[[torch.Tensor, Any, Any], torch.Tensor]] = {}

Row = tuple[float, ...]  # ROW numbers, then one per AFTER_PASS statistic

# an empty tensor's (or a meta tensor's): nothing finite, nothing counted
EMPTY_ROW: Row = (0.0, math.nan, math.nan, math.nan, math.nan, 0.0, 0.0, 0.0, math.nan) + (
    0.0,
) * len(AFTER_PASS)
# each declared statistic's place in a row
_SLOTS = tuple((s, i) for i, s in enumerate(TENSOR_STATS, 1))


def after_pass(row: Row | torch.Tensor, x: torch.Tensor) -> Row | torch.Tensor:
    """The row with AFTER_PASS's statistics of x after it (x non-empty, real-valued)."""
    if isinstance(row, torch.Tensor):  # on x's device: 0-d tensors, no sync
        sd = row[VAR].clamp_min(0).sqrt()
        more = [f(x, row[MEAN], sd).to(row.dtype).reshape(1) for f in AFTER_PASS.values()]
        return torch.cat([row, *more])
    std = math.sqrt(max(row[VAR], 0.0)) if row[COUNT] else math.nan
    return row + tuple(float(f(x, row[MEAN], std)) for f in AFTER_PASS.values())


def _compile_fill() -> Callable[[TensorStats, Sequence[float]], TensorStats]:
    """`fill`, written out from the declared statistics once (a loop over them costs a
    hooked tensor 5 µs more): each statistic from its place in the row, as its kind says — a
    count an int, a fraction its count over numel, std the root of the variance, a value only
    when some element is finite."""
    measured = PASS_STATS + tuple(AFTER_PASS)
    declared = tuple(s.name for s, _ in _SLOTS)
    if measured != declared:  # a statistic declared and not measured, or the reverse
        raise RuntimeError(
            f"engine/statrow.py measures {measured}, records.TensorStats declares {declared}"
        )
    lines = ["def fill(stats, row):", "    numel = stats.numel"]
    values = []
    for s, i in _SLOTS:
        if s.count:
            lines.append(f"    stats.{s.name} = int(row[{i}])")
        elif s.fraction:
            lines.append(f"    stats.{s.name} = float(row[{i}] / numel) if numel else None")
        else:
            v = f"sqrt(max(row[{i}], 0.0))" if s.merge == "std" else f"row[{i}]"
            # finite_or_none, written out (a call per statistic costs a tensor 2 µs here)
            values.append(f"        v = {v}")
            values.append(f"        stats.{s.name} = float(v) if isfinite(v) else None")
    lines += ["    if row[0] > 0:", *values, "    return stats"]
    scope: dict[str, Any] = {"isfinite": math.isfinite, "sqrt": math.sqrt}
    exec("\n".join(lines), scope)  # names: the dataclass's own fields
    compiled: Callable[[TensorStats, Sequence[float]], TensorStats] = scope["fill"]
    compiled.__doc__ = "Complete a TensorStats from its finalized row."
    return compiled


fill = _compile_fill()
