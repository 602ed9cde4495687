"""--channels and --heads in text: per measured tensor its channels that stand out, then the
report's massive activations and outlier features (records.Outliers), then every attention
head's sink, entropy and most-attended key. JSON carries every array."""

from __future__ import annotations

from hookcli.records import Report, TensorStats
from hookcli.render.fmt import DASH, num
from hookcli.render.parts import Line, Row, Section, Table

TOP_CHANNELS = 3  # channels named per tensor, largest max|x| first
SHOWN = 10  # massive activations and outlier features listed in text
DROP = ("dead", "kurtosis", "tensor")


def _top(t: TensorStats) -> str:
    ch = t.channels
    assert ch is not None
    ranked = sorted(
        (k for k, a in enumerate(ch.absmax) if a is not None), key=lambda k: -(ch.absmax[k] or 0)
    )
    median = ch.median_absmax
    parts = []
    for k in ranked[:TOP_CHANNELS]:
        a = ch.absmax[k] or 0.0
        times = f" ×{a / median:.3g}" if median else ""
        parts.append(f"{k}: {num(a)}{times}")
    return ", ".join(parts) or DASH


def _dead(t: TensorStats) -> int:
    """Channels whose every value is zero (or that held no value at all)."""
    ch = t.channels
    assert ch is not None
    return sum(1 for n, z in zip(ch.count, ch.zeros, strict=True) if z >= n)


def channels_section(report: Report) -> Section:
    """Each tensor measured per channel: its width, outlier ratio, kurtosis, dead channels
    and the channels with the largest max|x| (times the median channel's)."""
    s = Section("channels", "channels")
    rows = []
    for c in report.layers:
        for t in (*c.inputs, *c.outputs):
            ch = t.channels
            if ch is None:
                continue
            ratio = ch.outlier_ratio
            rows.append(
                Row(
                    [
                        c.name,
                        str(c.call),
                        t.path,
                        str(len(ch.count)),
                        num(ratio),
                        num(ch.kurtosis),
                        str(_dead(t)),
                        _top(t),
                    ]
                )
            )
    if rows:
        headers = ["layer", "call", "tensor", "channels", "outlier ratio", "kurtosis", "dead"]
        headers.append("largest max|x| (channel: value ×median)")
        s.parts.append(Table("channels", headers, rows, DROP))
    return s


def outliers_section(report: Report) -> Section:
    """The massive activations (largest first) and the outlier features."""
    s = Section("outliers", "outliers")
    found = report.outliers
    if found is None:
        return s
    if not found.massive:
        s.parts.append(Line("no massive activation (|x| > 100 and > 1000× its tensor's median)"))
    else:
        s.parts.append(Line(f"{len(found.massive)} massive activations (largest first):"))
        for m in found.massive[:SHOWN]:
            where = (
                f"sequence {m.sequence} position {m.position}"
                if m.position is not None
                else "index " + "x".join(str(i) for i in m.index)
            )
            times = f", {m.ratio:.3g}× the median |x|" if m.ratio is not None else ""
            s.parts.append(
                Line(
                    f"{m.layer} call {m.call} {m.path}: {num(m.value)} at channel {m.channel}, "
                    f"{where}{times}",
                    "item",
                )
            )
    if found.features:
        s.parts.append(Line(f"{len(found.features)} outlier features (LLM.int8: |x| >= 6):"))
        for f in found.features[:SHOWN]:
            s.parts.append(
                Line(
                    f"channel {f.channel} of {f.width}: in {f.layers} of {f.of} layers, up to "
                    f"{f.share:.1%} of its values",
                    "item",
                )
            )
    return s


def heads_section(report: Report) -> Section:
    """--heads: one row per head of every attention call and sequence (each sequence's own
    numbers), in the order the calls ran."""
    s = Section("heads", "attention heads")
    heads = report.heads
    if heads is None:
        return s
    if not heads:
        s.parts.append(Line("no attention call over the input's sequences was read"))
        return s
    rows = [
        Row(
            [
                h.layer,
                str(h.call),
                "all" if h.sequence is None else str(h.sequence),
                str(h.head),
                num(h.sink),
                num(h.entropy),
                DASH if h.top_key is None else str(h.top_key),
                num(h.top_share),
            ]
        )
        for h in heads
    ]
    headers = ["block", "call", "seq", "head", "sink", "entropy (nats)", "top key", "its share"]
    s.parts.append(Table("attention heads", headers, rows, ("call", "its share")))
    return s


def experts_section(report: Report) -> Section:
    """A MoE model's routing: one row per router."""
    s = Section("experts", "experts")
    rows = [
        Row(
            [
                e.layer,
                str(e.experts),
                DASH if e.top_k is None else str(e.top_k),
                str(e.tokens),
                " ".join(str(c) for c in e.counts),
                ", ".join(str(d) for d in e.dead) or DASH,
                num(e.imbalance),
                f"{num(e.entropy)} of {num(e.max_entropy)}",
            ]
        )
        for e in report.experts or ()
    ]
    if rows:
        headers = ["router", "experts", "k", "tokens", "tokens per expert", "dead"]
        headers += ["imbalance", "load entropy"]
        s.parts.append(Table("experts", headers, rows, ("k", "tokens per expert")))
    return s
