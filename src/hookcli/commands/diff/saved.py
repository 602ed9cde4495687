"""`hookcli diff a.json b.json`: two saved reports of one model (inspect/grads -f json).
Only their statistics are known, so each tensor is compared by the relative change of its norm
(signed: below 0 when the second report's tensor is smaller), and a classifier's saved top-k
predictions by their top-1 flips and top-k overlap. The default tolerance is the precision's of
the dtypes the reports hold (tolerance.py).
"""

from __future__ import annotations

from typing import Any

from hookcli import bounds
from hookcli._version import __version__
from hookcli.commands.diff.measure import TOPK, describe_over, shape_label
from hookcli.commands.diff.report import check_sort
from hookcli.commands.diff.tolerance import DTYPE_PRECISION, default_tol
from hookcli.errors import UsageError
from hookcli.records import (
    DiffCall,
    DiffReport,
    InputInfo,
    ModelInfo,
    Prediction,
    Report,
    TensorDiff,
    TensorStats,
)

# the tasks whose saved predictions are classes (top-k by softmax)
CLASSIFIERS = frozenset({"classification", "quantized", "video", "text-classification"})


def diff_saved(
    path_a: str, path_b: str, tol: float | None = None, sort: str = "order"
) -> DiffReport:
    """Two JSON reports of one model (inspect/grads -f json): only their statistics are
    known, so each tensor is compared by the relative change of its norm (`norm_rel`,
    signed); the mean and std changes are noted. tol None: the default of the coarsest
    precision among the reports' output dtypes. sort: order, or error (largest |norm_rel|
    first); own error needs the model."""
    from hookcli.io.reportfile import load_report

    if tol is not None:
        tol, tol_source = bounds.tolerance(tol, "--tol", "--tol 1e-3"), "--tol"
    sort = check_sort(sort)
    if sort == "own":
        raise UsageError(
            "--sort own needs each layer's own error, which two saved reports do not hold.",
            "use --sort error (largest change of norm first), or run hookcli diff MODEL.",
        )
    record = "give two reports written by hookcli inspect/grads/check -f json -o FILE."
    reports = [load_report(p, "", record) for p in (path_a, path_b)]
    a, b = reports
    if tol is None:
        tol, tol_source = default_tol(
            DTYPE_PRECISION.get(t.dtype, "float32")
            for r in reports
            for c in r.layers
            for t in c.outputs
        )
    if a.model.spec != b.model.spec:
        raise UsageError(
            f"the reports are of different models ({a.model.spec} vs {b.model.spec}).",
            "compare two reports of one model.",
        )
    before = {(c.name, c.call): c for c in a.layers}
    calls: list[DiffCall] = []
    first = None
    for c in b.layers:
        old = before.pop((c.name, c.call), None)
        if old is None:
            continue
        by_path = {t.path: t for t in old.outputs}
        diffs = [_stat_diff(by_path.get(t.path), t, tol) for t in c.outputs]
        calls.append(DiffCall(c.name, c.type, c.call, diffs))
        over = next((d for d in diffs if d.over), None)
        if over is not None and first is None:
            first = describe_over(calls[-1], over, tol)
    matched = {(c.name, c.call) for c in calls}
    missing = [f"{n} call {k}: only in {path_a}" for n, k in before]
    missing += [
        f"{c.name} call {c.call}: only in {path_b}"
        for c in b.layers
        if (c.name, c.call) not in matched
    ]
    if sort == "error":
        calls.sort(key=_sort_key)
    m = b.model
    notes = [
        "two saved reports: only statistics are known, so tensors are compared by the "
        "relative change of their norm (norm Δ, signed: (|B|-|A|)/|A|); run "
        "`hookcli diff MODEL …` for max|Δ|, relative L2, cosine and SQNR"
    ]
    if tol_source != "--tol":
        notes.append(f"tol {tol:g}: {tol_source}")
    agreement = _agreement(a, b) if m.task in CLASSIFIERS else None
    return DiffReport(
        model=ModelInfo(m.name, m.spec, m.task, m.weights, m.params),
        input=InputInfo(f"{a.input.description} | {b.input.description}", []),
        device=f"{a.device} | {b.device}",
        a=path_a,
        b=path_b,
        ref=None,
        isolate=False,
        tol=tol,
        tol_source=tol_source,
        sort=sort,
        calls=calls,
        first_over=first,
        agreement=agreement,
        missing=missing,
        notes=notes,
        hookcli_version=__version__,
    )


def _sort_key(call: DiffCall) -> tuple[int, float]:
    """Largest |norm_rel| first; non-finite values before any number, none last."""
    if any(d.nonfinite for d in call.b):
        return (0, 0.0)
    values = [abs(d.norm_rel) for d in call.b if d.norm_rel is not None]
    return (1, -max(values)) if values else (2, 0.0)


def _agreement(a: Report, b: Report) -> dict[str, dict[str, Any]] | None:
    """Top-1 flips and top-k overlap of the two reports' saved predictions, per image (each
    report's top-k, k as many as both hold, at most 5); None without predictions in both."""

    def tops(r: Report) -> dict[int, tuple[str | None, list[tuple[int, str | None]]]]:
        found: dict[int, tuple[str | None, list[tuple[int, int, str | None]]]] = {}
        p: Prediction
        for p in r.predictions or []:
            _, ranked = found.setdefault(p.image, (p.source, []))
            ranked.append((p.rank, p.index, p.label))
        return {i: (s, [(k, lab) for _, k, lab in sorted(ps)]) for i, (s, ps) in found.items()}

    ta, tb = tops(a), tops(b)
    images = sorted(set(ta) & set(tb))
    if not images or any(ta[i][0] != tb[i][0] for i in images):
        return None  # no predictions, or not the same images
    k = min(TOPK, *(len(ta[i][1]) for i in images), *(len(tb[i][1]) for i in images))
    flipped, overlap = [], 0.0
    for i in images:
        (source, pa), (_, pb) = ta[i], tb[i]
        if pa[0][0] != pb[0][0]:
            flipped.append(
                {
                    "index": i,
                    "image": source,
                    "ref": pa[0][0],
                    "side": pb[0][0],
                    "ref_label": pa[0][1],
                    "side_label": pb[0][1],
                }
            )
        overlap += len({c for c, _ in pa[:k]} & {c for c, _ in pb[:k]}) / k
    return {
        "B": {
            "side": "B",
            "against": "A",
            "images": len(images),
            "top1_same": len(images) - len(flipped),
            "top1_flips": len(flipped),
            "flipped": flipped,
            "topk": k,
            "topk_overlap": overlap / len(images),
        }
    }


def _stat_diff(old: TensorStats | None, new: TensorStats, tol: float) -> TensorDiff:
    d = TensorDiff(new.path, tuple(new.shape), new.numel)
    if old is None:
        d.note, d.over = "only in the second report", True
        return d
    if old.shape != new.shape:
        d.note = f"shapes differ: {shape_label(old.shape)} vs {shape_label(new.shape)}"
        d.over = True
        return d
    d.nonfinite = new.nan + new.inf
    na, nb = old.norm, new.norm
    if na is not None and nb is not None:
        d.norm_rel = (nb - na) / na if na else (0.0 if nb == 0 else None)
    changes = [
        f"{k} {x:.4g} -> {y:.4g}"
        for k, x, y in (("mean", old.mean, new.mean), ("std", old.std, new.std))
        if x is not None and y is not None and x != y
    ]
    d.note = "; ".join(changes) or None
    d.over = d.nonfinite > 0 or d.norm_rel is None or abs(d.norm_rel) > tol
    return d
