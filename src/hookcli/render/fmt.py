"""Number and shape formatting shared by the text renderers."""

from __future__ import annotations

from hookcli.records import TensorStats

DASH = "—"


def num(v: float | None) -> str:
    if v is None:
        return DASH
    if v == 0:
        return "0"
    return f"{v:.4g}"


def prob(v: float | None) -> str:
    """A probability; None is a non-finite score (NaN/Inf logits), flagged as such."""
    return "not finite" if v is None else f"{v:.4f}"


def pct(v: float | None) -> str:
    if v is None:
        return DASH
    if v == 0:
        return "0%"
    if v < 0.001:
        return "<0.1%"
    return f"{v * 100:.1f}%"


def shape(s: tuple[int, ...]) -> str:
    return "x".join(map(str, s)) if s else "scalar"


def tensor_label(t: TensorStats, root: str) -> str:
    """`1x64x112x112`, or `["boxes"] 0x4` for a tensor inside a structured value."""
    rest = t.path.removeprefix(root)
    return f"{rest} {shape(t.shape)}" if rest else shape(t.shape)


def nonfinite(t: TensorStats) -> str:
    parts = []
    if t.nan:
        parts.append(f"{t.nan} NaN")
    if t.inf:
        parts.append(f"{t.inf} Inf")
    return ", ".join(parts) if parts else ""


def count(n: int) -> str:
    if n >= 1_000_000_000:
        return f"{n / 1e9:.2f}B"
    if n >= 1_000_000:
        return f"{n / 1e6:.1f}M"
    if n >= 10_000:
        return f"{n / 1e3:.1f}K"
    return str(n)


SPARKS = "▁▂▃▄▅▆▇█"


def spark(hist: dict[str, list[float]] | None) -> str:
    """A histogram as one line of block characters (an empty bin is a space)."""
    if not hist or not hist.get("counts"):
        return DASH
    counts = hist["counts"]
    top = max(counts) or 1
    return "".join(
        " " if c == 0 else SPARKS[min(len(SPARKS) - 1, int(c / top * (len(SPARKS) - 1) + 0.5))]
        for c in counts
    )
