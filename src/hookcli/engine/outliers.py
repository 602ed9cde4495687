"""What stands out across a report's layer calls measured per channel (--channels): every
massive activation, and the outlier features of LLM.int8 (Dettmers et al. 2022). Read from
the records alone (no torch): a merged report (ranks, folders) is read the same way.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from hookcli.records import LayerCall, MassiveAt, OutlierFeature, Outliers, TensorStats

FEATURE_SHARE = 0.06  # LLM.int8: |x| >= 6 in at least 6% of a feature's values (tokens) …
FEATURE_LAYERS = 0.25  # … in at least 25% of the layers


def measured(calls: Sequence[LayerCall]) -> Iterator[tuple[LayerCall, TensorStats]]:
    """Every tensor of the calls measured per channel, inputs then outputs."""
    for c in calls:
        for t in (*c.inputs, *c.outputs):
            if t.channels is not None:
                yield c, t


def summary(calls: Sequence[LayerCall]) -> Outliers:
    """The report's outliers: every massive activation, largest |value| first; and the outlier
    features among the selected layers' outputs (a channel counted once per layer)."""
    massive = [
        MassiveAt(
            layer=c.name,
            call=c.call,
            path=t.path,
            channel=m.channel,
            index=list(m.index),
            value=m.value,
            ratio=m.ratio,
            position=m.position,
            sequence=m.sequence,
        )
        for c, t in measured(calls)
        for m in t.channels.massive  # type: ignore[union-attr]
    ]
    massive.sort(key=lambda m: -abs(m.value))
    # per width: the layers whose outputs have it, and each channel's largest share per layer
    layers: dict[int, set[str]] = {}
    share: dict[tuple[int, int], dict[str, float]] = {}
    for c in calls:
        for t in c.outputs:
            ch = t.channels
            if ch is None or ch.axis != len(t.shape) - 1:
                continue  # a feature dimension is the last (tokens, features)
            width = len(ch.count)
            layers.setdefault(width, set()).add(c.name)
            for k in [k for k, large in enumerate(ch.large) if large and ch.count[k]]:
                seen = share.setdefault((width, k), {})
                seen[c.name] = max(seen.get(c.name, 0.0), ch.large[k] / ch.count[k])
    features = []
    for (width, k), by_layer in share.items():
        hit = [v for v in by_layer.values() if v >= FEATURE_SHARE]
        total = len(layers[width])
        if hit and len(hit) >= FEATURE_LAYERS * total:
            features.append(OutlierFeature(k, width, len(hit), total, max(hit)))
    features.sort(key=lambda f: (f.width, -f.layers, -f.share, f.channel))
    return Outliers(massive=massive, features=features)
