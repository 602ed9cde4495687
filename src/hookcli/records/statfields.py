"""A tensor's statistics, declared once: each statistic field of TensorStats (records/core.py)
carries a `Stat` saying how it merges, how --baseline sizes its drift and how a table shows it.
Everything that handles the statistics as a set iterates `TENSOR_STATS` (core.py) instead of
naming them: the engine's fill (engine/stats.py), folder and rank merges (engine/aggregate.py),
the layers table and HTML (render/rows.py, render/html.py), CSV/Parquet/DataFrame
(render/tabular.py), the saved-report and run-log readers (io/reportfile.py,
commands/watch/logread.py), --baseline (commands/baseline.py) and the log writer
(records/runlog.py writes every field). A statistic's name is its field's: the JSON key and the
CSV/Parquet column.

`merge` says what the statistic is, as far as merging cares:

- "mean", "std": the mean and population std of the finite elements; parts merge by Chan's
  parallel update of (count, mean, M2);
- "min", "max": over the finite elements; the parts' least / greatest;
- "norm": the L2 norm of the finite elements; the root of the parts' summed squares;
- "fraction": a fraction of all the elements (a count ÷ numel, in [0, 1]); the parts' counts
  summed, over the summed numel;
- "count": a number of elements (an int, 0 when none); the parts' summed.

A value statistic (mean, std, min, max, norm) is None when no element is finite; a fraction is
None for an empty tensor; a count is never None.

`compare` says how --baseline sizes a drift (what ranks its failures), None: not compared:

- "rms": the change in units of the baseline tensor's rms;
- "relative": the change ÷ the baseline's value;
- "points": the change itself (a fraction's: percentage points of the elements);
- "count": any change is infinite (a NaN/Inf count that moved).

No torch, no renderer: `format` names a formatter ("num", "pct") the renderers map.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from hookcli.records.meta import NULL_IS_ABSENT

Merge = Literal["mean", "std", "min", "max", "norm", "fraction", "count"]
Compare = Literal["rms", "relative", "points", "count"]
Format = Literal["num", "pct", "int"]

STAT = "hookcli.stat"  # the field metadata key that holds a field's Stat

# the statistics that scale with their tensor: a tensor multiplied by k has them multiplied by k
# (|k| for std and norm, whose sign never changes; runmerge scales gradients by 1/W > 0)
_SCALING = frozenset({"mean", "std", "min", "max", "norm"})


@dataclass(frozen=True, slots=True)
class Stat:
    """One statistic's metadata (see the module docstring)."""

    name: str  # the field's name: its JSON key and CSV/Parquet column
    merge: Merge
    compare: Compare | None
    header: str | None = None  # its column in the layers table (text, Markdown, HTML); None: none
    format: Format = "num"  # how it is shown: a number, a percentage, a whole number
    drop: int | None = None  # a narrow table gives its column up in this order (None: kept)
    label: str | None = None  # its name where it is shown alone (HTML's details; None: `name`)

    @property
    def count(self) -> bool:
        """A count of elements: an int, 0 when none (never None)."""
        return self.merge == "count"

    @property
    def fraction(self) -> bool:
        """A fraction of all the elements (a count ÷ numel)."""
        return self.merge == "fraction"

    @property
    def scales(self) -> bool:
        """Whether it scales with its tensor (a gradient scaled by 1/W has it scaled too)."""
        return self.merge in _SCALING


def stat(
    merge: Merge,
    compare: Compare | None,
    *,
    header: str | None = None,
    format: Format | None = None,
    drop: int | None = None,
    label: str | None = None,
) -> Any:
    """A TensorStats statistic field: its default (0 for a count, else None) and its Stat (a
    count shown as a whole number unless `format` says otherwise)."""
    shown = format or ("int" if merge == "count" else "num")
    declared = Stat("", merge, compare, header, shown, drop, label)
    if merge == "count":  # null as if absent: 0 (older files wrote it)
        return dataclasses.field(default=0, metadata={STAT: declared, NULL_IS_ABSENT: True})
    return dataclasses.field(default=None, metadata={STAT: declared})


def stats_of(cls: type[Any]) -> tuple[Stat, ...]:
    """The statistics a record class declares (its `stat(...)` fields), in field order."""
    return tuple(
        dataclasses.replace(f.metadata[STAT], name=f.name)
        for f in dataclasses.fields(cls)
        if STAT in f.metadata
    )
