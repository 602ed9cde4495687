"""What --channels, --heads and a MoE model's routing add to a report: per-channel statistics,
massive activations, outlier features, attention heads, expert routing. Plain dataclasses,
re-exported by hookcli.records. And the logit lens report's views (LensViewed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hookcli._views import views  # the renderers, installed by hookcli/__init__.py


@dataclass(slots=True)
class Massive:
    """--channels: one massive activation (|x| > 100 and > 1000 x its tensor's median |x|):
    where it sits (`index` in the tensor's own dimensions; for a (batch, tokens, channels)
    tensor also its `sequence` and token `position`), its value, and |value| / the median."""

    channel: int
    index: list[int]
    value: float
    ratio: float | None
    position: int | None = None
    sequence: int | None = None


@dataclass(slots=True)
class ChannelStats:
    """--channels: one tensor's statistics per channel (dimension `axis`), each list indexed by
    channel: how many values (masked and non-finite ones left out), their mean, population std,
    min, max and max|x|, how many are zero and how many reach |x| >= 6 (LLM.int8's outlier
    magnitude). For the whole tensor: values masked apart (an attention mask's lowest value or
    -inf), Pearson's kurtosis (3: a normal distribution), the median |x| (only where some |x|
    exceeds 100: else none can be massive), and its massive
    activations (at most engine.channels.TOP per tensor, largest first)."""

    axis: int
    count: list[int]
    mean: list[float | None]
    std: list[float | None]
    min: list[float | None]
    max: list[float | None]
    absmax: list[float | None]
    zeros: list[int]
    large: list[int]
    masked: int = 0
    kurtosis: float | None = None
    median_abs: float | None = None
    massive: list[Massive] = field(default_factory=list)
    # calib: counts of |x| in engine.channels' log-spaced bins (None elsewhere)
    abs_hist: list[int] | None = None

    @property
    def median_absmax(self) -> float | None:
        """The median of the channels' max|x| (of an even count, the mean of the middle two)."""
        peaks = [a for a in self.absmax if a is not None]
        import statistics  # with fractions and decimal, 25 ms: not on --help's path

        return statistics.median(peaks) if peaks else None

    @property
    def outlier_ratio(self) -> float | None:
        """How far the worst channel stands out: the largest channel max|x| over the median
        channel's (what one per-tensor int8 scale loses to it). None where the median channel
        is all zero."""
        median = self.median_absmax
        peak = max((a for a in self.absmax if a is not None), default=None)
        return peak / median if peak is not None and median else None


@dataclass(slots=True)
class MassiveAt:
    """A massive activation in the report: which layer call's tensor holds it, and where."""

    layer: str
    call: int
    path: str
    channel: int
    index: list[int]
    value: float
    ratio: float | None
    position: int | None = None
    sequence: int | None = None


@dataclass(slots=True)
class OutlierFeature:
    """An outlier feature (LLM.int8): a channel of width `width` whose |x| reaches 6 in at least
    6% of the values of its channel (`share`: the largest share seen) in `layers` of the `of`
    selected layers whose outputs have that width (at least a quarter of them)."""

    channel: int
    width: int
    layers: int
    of: int
    share: float


@dataclass(slots=True)
class Outliers:
    """--channels: what stands out across the report's layer calls (engine.channels)."""

    massive: list[MassiveAt] = field(default_factory=list)
    features: list[OutlierFeature] = field(default_factory=list)


@dataclass(slots=True)
class HeadStats:
    """--heads: one head of one attention call over one sequence of the batch (engine.heads),
    its own numbers as if it ran alone: the mean probability its queries put on the first
    token (`sink`), their mean entropy in nats, the key position (from the first real token)
    they attend most and that mean probability; `queries` counted (the sequence's real
    queries after its first)."""

    layer: str  # the block, as attn -l names it
    module: str  # the attention module
    call: int
    # the sequence of the batch (its image, for a vision model); None in a report saved
    # before heads were per sequence, whose numbers pool the batch's sequences
    sequence: int | None = field(default=None, kw_only=True)
    head: int
    sink: float | None
    entropy: float | None
    top_key: int | None
    top_share: float | None
    queries: int


@dataclass(slots=True)
class ExpertStats:
    """One MoE router's routing over the run (engine.experts): tokens routed to each expert
    (k per token), the experts no token reached, the load imbalance (the busiest expert's
    count ÷ the mean count) and the load's entropy in nats (log(experts): perfectly even)."""

    layer: str  # the router module
    experts: int
    top_k: int | None
    tokens: int
    counts: list[int]
    dead: list[int]
    imbalance: float | None
    entropy: float | None
    max_entropy: float


class Rendered(str):
    """Text a report rendered (`report.table()`): prints as itself, and a prompt or a notebook
    shows it as itself rather than as a quoted string."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


class LensViewed:
    """What a lens report does in a notebook or at a prompt: a one-line repr, the CLI's table
    (`table()`, and `print(report)`) and an HTML view (`_repr_html_`: a grid per sequence of
    blocks by positions, each cell the top-1 token and its probability, shaded by it). The
    base of records.LensReport; the renderers are imported when asked for (records imports
    none)."""

    __slots__ = ()

    def _report(self) -> Any:  # (a records.LensReport: records imports this module)
        return self

    def __repr__(self) -> str:
        return str(views().lens_summary(self._report()))[:2000]

    def __str__(self) -> str:
        return self.table()

    def table(self, *, color: bool = False, width: int | None = None) -> Rendered:
        """The table the CLI prints (`width`: characters; None: 200)."""
        return Rendered(views().lens_table(self._report(), color=color, width=width))

    def _repr_html_(self) -> str:
        return str(views().lens_html(self._report()))
