"""`hookcli diff a.json b.json`: two saved reports of one model (inspect/grads -f json).
Only their statistics are known, so each tensor is compared by the relative change of its norm.
"""

from __future__ import annotations

from typing import Any

from hookcli import bounds
from hookcli._version import __version__
from hookcli.commands.diff.measure import describe_over, shape_label
from hookcli.errors import UsageError
from hookcli.records import DiffCall, DiffReport, InputInfo, ModelInfo, TensorDiff


def diff_saved(path_a: str, path_b: str, tol: float = 1e-3) -> DiffReport:
    """Two JSON reports of one model (inspect/grads -f json): only their statistics are
    known, so each tensor is compared by the relative change of its norm (`norm_rel`); the
    mean and std changes are noted."""
    from hookcli.io.reportfile import load_report

    tol = bounds.tolerance(tol, "--tol", "--tol 1e-3")
    record = "give two reports written by hookcli inspect/grads/check -f json -o FILE."
    reports = [load_report(p, "", record) for p in (path_a, path_b)]
    a, b = reports
    if a["model"].get("spec") != b["model"].get("spec"):
        raise UsageError(
            f"the reports are of different models ({a['model'].get('spec')} vs "
            f"{b['model'].get('spec')}).",
            "compare two reports of one model.",
        )
    before = {(c["name"], c["call"]): c for c in a["layers"]}
    calls: list[DiffCall] = []
    first = None
    for c in b["layers"]:
        old = before.pop((c["name"], c["call"]), None)
        if old is None:
            continue
        by_path = {t["path"]: t for t in old["outputs"]}
        diffs = [_stat_diff(by_path.get(t["path"]), t, tol) for t in c["outputs"]]
        calls.append(DiffCall(c["name"], c["type"], c["call"], diffs))
        over = next((d for d in diffs if d.over), None)
        if over is not None and first is None:
            first = describe_over(calls[-1], over, tol)
    matched = {(c.name, c.call) for c in calls}
    missing = [f"{n} call {k}: only in {path_a}" for n, k in before]
    missing += [
        f"{c['name']} call {c['call']}: only in {path_b}"
        for c in b["layers"]
        if (c["name"], c["call"]) not in matched
    ]
    m = b["model"]
    return DiffReport(
        model=ModelInfo(m["name"], m["spec"], m["task"], m["weights"], m["params"]),
        input=InputInfo(f"{a['input']['description']} | {b['input']['description']}", []),
        device=f"{a.get('device')} | {b.get('device')}",
        a=path_a,
        b=path_b,
        ref=None,
        isolate=False,
        tol=tol,
        calls=calls,
        first_over=first,
        missing=missing,
        notes=[
            "two saved reports: only statistics are known, so tensors are compared by the "
            "relative change of their norm (norm Δ); run `hookcli diff MODEL …` for max|Δ|, "
            "relative L2, cosine and SQNR"
        ],
        hookcli_version=__version__,
    )


def _stat_diff(old: dict[str, Any] | None, new: dict[str, Any], tol: float) -> TensorDiff:
    d = TensorDiff(new["path"], tuple(new["shape"]), new["numel"])
    if old is None:
        d.note, d.over = "only in the second report", True
        return d
    if old["shape"] != new["shape"]:
        d.note, d.over = (
            f"shapes differ: {shape_label(old['shape'])} vs {shape_label(new['shape'])}",
            True,
        )
        return d
    d.nonfinite = int((new.get("nan") or 0) + (new.get("inf") or 0))
    na, nb = old.get("norm"), new.get("norm")
    if na is not None and nb is not None:
        d.norm_rel = abs(nb - na) / na if na else (0.0 if nb == 0 else None)
    changes = [
        f"{k} {old[k]:.4g} -> {new[k]:.4g}"
        for k in ("mean", "std")
        if old.get(k) is not None and new.get(k) is not None and old[k] != new[k]
    ]
    d.note = "; ".join(changes) or None
    d.over = d.nonfinite > 0 or d.norm_rel is None or d.norm_rel > tol
    return d
