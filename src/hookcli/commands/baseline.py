"""`--baseline FILE`: every statistic a run recorded against a saved report's — drift beyond
rtol/atol, layers that appeared or vanished, inputs that differ — the first change named in the
order the hooks saw the calls (where a change began), the rest largest first. Numbers only."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path, PureWindowsPath

from hookcli.errors import UsageError
from hookcli.records import TENSOR_STATS, CheckResult, Failure, LayerCall, Report, Stat, TensorStats

# the statistics compared (records.TensorStats declares how), counts last: of equally large
# drifts in one tensor, the first named is a statistic's
_COMPARED = sorted((s for s in TENSOR_STATS if s.compare is not None), key=lambda s: s.count)
STATS = tuple(s.name for s in _COMPARED)
_HOW: dict[str, Stat] = {s.name: s for s in _COMPARED}


def load_baseline(path: Path) -> Report:
    """The saved report at path (reportfile.load_report: the one loader of saved reports)."""
    from hookcli.io.reportfile import load_report

    where = path if not os.path.lexists(path) else "BASE.json"  # (never over what is there)
    return load_report(path, "baseline", f"record one: hookcli inspect MODEL … -f json -o {where}")


# what an appeared entry may mean: a baseline recorded by an older hookcli, which recorded less
_OLDER = "; from an older hookcli, which recorded less? re-record it with --save-baseline"
_GRADIENTS = {"grad_inputs", "grad_outputs", "param_grads"}


def _same_model(before: str, now: str) -> bool:
    """Whether two runs' model specs name one model: the same text, or a model file spelled
    another way (./net.py:Net, an absolute path, or from another folder: the same file name
    and object; its weights and shapes are compared anyway)."""
    if before == now:
        return True
    files = [spec.rsplit(":", 1) for spec in (before, now)]
    if not all(len(f) == 2 and f[0].endswith(".py") for f in files):
        return False
    (a_file, a_name), (b_file, b_name) = files
    # (PureWindowsPath splits on / and \\ alike: a baseline recorded on Windows reads here)
    return a_name == b_name and PureWindowsPath(a_file).name == PureWindowsPath(b_file).name


def _entries(layers: list[LayerCall]) -> dict[tuple[str, int, str, str], TensorStats]:
    out = {}
    for c in layers:
        for kind in ("inputs", "outputs", "grad_inputs", "grad_outputs"):
            for t in getattr(c, kind) or []:
                out[(c.name, c.call, kind, t.path)] = t
        for p in c.params or []:
            if p.grad is not None:
                out[(c.name, c.call, "param_grads", p.name)] = p.grad
    return out


def _drifted(a: float | None, b: float | None, rtol: float, atol: float) -> bool:
    """Whether a statistic moved from baseline b to a beyond rtol/atol (None on one side only:
    it appeared or vanished)."""
    if a is None or b is None:
        return (a is None) != (b is None)
    if a == b:
        return False
    return not abs(a - b) <= atol + rtol * abs(b)  # a NaN or Inf that moved is a drift


def _scale(entry: TensorStats) -> float | None:
    """A tensor's own size to measure its statistics' changes against: its root mean square
    (norm / sqrt(numel)), else the larger of |mean| and std. A change of a mean near zero is
    not large because the mean was small: measured against the tensor's rms it is the same
    change whatever the mean was (issue 32: a weight scaled by 1.5 lost behind a 354% change of a
    near-zero mean)."""
    norm, numel = entry.norm, entry.numel
    if norm is not None and numel > 0 and norm > 0:
        return float(norm) / math.sqrt(numel)
    parts = [abs(v) for v in (entry.mean, entry.std) if v is not None]
    return max(parts) if parts and max(parts) > 0 else None


def _size_of_change(stat: str, a: float | None, b: float | None, scale: float | None) -> float:
    """How large a drift is, on a scale that does not explode near zero, as the statistic
    declares (`compare`): NaN/Inf counts that moved and statistics that appeared or vanished
    are infinite; a fraction's change is itself (points); the norm's is relative; every other
    statistic's is the change in units of the baseline tensor's rms."""
    how = _HOW[stat].compare
    if a is None or b is None or how == "count":
        return math.inf
    if how == "points":
        return abs(a - b)
    if how == "relative":
        return abs(a - b) / b if b > 0 else math.inf
    return abs(a - b) / scale if scale else math.inf


def compare_baseline(
    report: Report, baseline: Report, rtol: float, atol: float, label: str
) -> CheckResult:
    """Every recorded statistic against the baseline's. The first failure (`first`, listed
    first) is the first call that drifted in the order the hooks saw them (forward, then
    gradients nearest the loss first): where a change began. The rest follow largest first,
    measured by _size_of_change."""
    base_model = baseline.model.spec
    if not _same_model(base_model, report.model.spec):
        raise UsageError(
            f"baseline {label} is from model {base_model!r}; this run is {report.model.spec!r}.",
            "compare runs of the same model, or record a new baseline.",
        )
    base_shapes = [list(s) for s in baseline.input.shapes]
    run_shapes = [list(s) for s in report.input.shapes]
    if base_shapes != run_shapes:
        raise UsageError(
            f"baseline {label} ran on input {base_shapes}; this run on {run_shapes}.",
            "use the same input shape, or record a new baseline.",
        )
    now = _entries(report.layers)
    before = _entries(baseline.layers)
    kinds = {k[2] for k in before}
    if kinds & _GRADIENTS and report.backward is None:  # (never left out silently)
        source = baseline.backward.source if baseline.backward is not None else "a loss"
        raise UsageError(
            f"baseline {label} holds gradients (its run's backward started from {source}); "
            "this run has no backward, so they would go unchecked.",
            "add --backward (with the baseline's --target or --loss), or record a baseline "
            "without gradients.",
        )
    now = {k: v for k, v in now.items() if k[2] in kinds}  # compare what the baseline recorded
    calls_now = {(k[0], k[1]) for k in now}
    calls_before = {(k[0], k[1]) for k in before}
    order = _call_order(report)
    # (size, where the hooks saw it, failure)
    failures: list[tuple[float, tuple[int, int], Failure]] = []
    for name, call in sorted(calls_now - calls_before):
        text = f"{name} call {call}: appeared (not in the baseline{_OLDER})"
        failures.append(
            (
                math.inf,
                order(name, call, "outputs"),
                Failure(text, name, call, None, "present", "absent"),
            )
        )
    for name, call in sorted(calls_before - calls_now):
        text = f"{name} call {call}: vanished (in the baseline, not in this run)"
        failures.append(
            (math.inf, (2, 1 << 30), Failure(text, name, call, None, "absent", "present"))
        )
    both = calls_now & calls_before
    for side, other, how, got in (
        (now, before, f"appeared (not in the baseline{_OLDER})", ("present", "absent")),
        (before, now, "vanished (in the baseline, not in this run)", ("absent", "present")),
    ):  # (a gradient that now arrives, a new output; one that no longer does: a cut graph)
        for name, call, kind, path in sorted(
            k for k in side.keys() - other.keys() if k[:2] in both
        ):
            where = f"{kind[:-1]} {path}"
            failure = Failure(f"{name} call {call} {where}: {how}", name, call, where, *got)
            failures.append((math.inf, order(name, call, kind), failure))
    compared = 0
    for key in sorted(now.keys() & before.keys()):
        compared += 1
        a, b = now[key], before[key]
        scale = _scale(b)
        worst: tuple[float, str] | None = None
        for stat in STATS:
            va, vb = getattr(a, stat), getattr(b, stat)
            if not _drifted(va, vb, rtol, atol):
                continue
            size = _size_of_change(stat, va, vb, scale)
            if worst is None or size > worst[0]:
                worst = (size, stat)
        if worst is not None:
            size, stat = worst
            name, call, kind, path = key
            va, vb = getattr(a, stat), getattr(b, stat)
            where = f"{kind[:-1]} {path} {stat}"
            how = _how_much(stat, va, vb, size)
            text = f"{name} call {call} {where}: {number_text(vb)} -> {number_text(va)}{how}"
            failures.append(
                (size, order(name, call, kind), Failure(text, name, call, where, va, vb))
            )
    mismatch = _inputs_differ(report, baseline)
    if not failures:
        message = f"{compared} tensors within rtol {rtol:g}, atol {atol:g} of {label}"
        return CheckResult("baseline", True, message + (f" ({mismatch})" if mismatch else ""))
    first = min(failures, key=lambda f: f[1])
    rest = sorted((f for f in failures if f is not first), key=lambda f: -f[0])
    ranked = [first[2]] + [f for _, _, f in rest]
    message = (
        f"{len(failures)} entries differ from {label} (rtol {rtol:g}, atol {atol:g}); "
        f"first in the order the hooks saw them: {first[2].message}"
    )
    if rest and rest[0][0] > first[0]:
        message += f"; largest: {rest[0][2].message}"
    if mismatch:
        message += f" — but {mismatch}: the drift may come from that, not from the model"
    return CheckResult("baseline", False, message, ranked, first[2])


def _call_order(report: Report) -> Callable[[str, int, str], tuple[int, int]]:
    """(name, call, kind) -> a sort key in the order the hooks saw the calls: forward
    entries by the order calls returned, then gradients in the order they arrived."""
    forward = {(c.name, c.call): c.forward_order for c in report.layers}
    backward = {(c.name, c.call): c.backward_order for c in report.layers}

    def key(name: str, call: int, kind: str) -> tuple[int, int]:
        if kind in ("inputs", "outputs"):
            n = forward.get((name, call))
            return (0, n if n is not None else 1 << 30)
        n = backward.get((name, call))
        return (1, n if n is not None else 1 << 30)

    return key


def _how_much(stat: str, a: float | None, b: float | None, size: float) -> str:
    """The change in words: a fraction's in points of the elements; others relative to the
    value (when it is not near zero) and, sized against the tensor's rms, against that."""
    if a is None or b is None or math.isinf(size):
        return ""
    how = _HOW[stat].compare
    if how == "points":
        return f" ({a - b:+.2%} of the elements)"
    rel = f"{(a - b) / abs(b):+.2%}, " if b != 0 else ""
    if how == "relative":
        return f" ({rel.rstrip(', ')})" if rel else ""
    return f" ({rel}{size:.3g}× the tensor's rms)"


def _inputs_differ(report: Report, baseline: Report) -> str | None:
    """What differs between the baseline's run and this one besides the model: the input
    (its description and files), the seed, the weights. None when nothing does."""
    said = []
    base_input = baseline.input
    base_seed = baseline.model.seed
    if base_seed is not None and base_seed != report.model.seed:
        said.append(
            f"the baseline ran with --seed {base_seed}, this run with --seed {report.model.seed} "
            "(random weights and random inputs follow it)"
        )
    if base_input.description != report.input.description:
        said.append(
            f"the baseline's input was {base_input.description!r}, "
            f"this run's is {report.input.description!r}"
        )
    elif list(base_input.sources) != list(report.input.sources):
        said.append("the baseline read other image files")
    base_weights = baseline.model.weights
    if base_weights != report.model.weights and not (
        base_seed is not None and base_seed != report.model.seed
    ):
        said.append(
            f"the baseline's weights were {base_weights!r}, this run's {report.model.weights!r}"
        )
    return "; ".join(said) or None


def number_text(v: float | None) -> str:
    return "null" if v is None else f"{v:.4g}"
