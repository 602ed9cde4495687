"""hookcli diff's sections: the per-call comparison table, the run header and the verdict
(format-neutral, like render.rows; every text format lays them out)."""

from __future__ import annotations

from collections.abc import Iterable

from hookcli.records import DiffReport, TensorDiff
from hookcli.render.fmt import DASH, count, num, shape
from hookcli.render.rows import DROP, Line, Row, Section, Style, Table, lines_section

DIFF_HEADERS = [
    "layer",
    "call",
    "output",
    "max|Δ|",
    "rel L2",
    "cosine",
    "SQNR dB",
    "norm Δ",
    "flag",
]
DIFF_REF_HEADERS = [
    "layer",
    "call",
    "output",
    "rel L2 A",
    "rel L2 B",
    "SQNR A",
    "SQNR B",
    "worse",
    "flag",
]


def db(v: float | None, rel: float | None) -> str:
    if v is None:
        return "inf" if rel == 0 else DASH  # identical: infinite signal-to-noise
    return f"{v:.1f}"


def diff_flag(d: TensorDiff) -> str:
    if d.nonfinite:
        return f"{d.nonfinite} not finite"
    if d.note:
        return d.note
    return "over tol" if d.over else ""


def diff_rows(report: DiffReport) -> Iterable[tuple[list[str], bool]]:
    with_ref = report.ref is not None
    for c in [*report.calls, *report.outputs]:
        a_by_path = {d.path: d for d in c.a or []}
        for i, d in enumerate(c.b):
            head = [c.name, str(c.call)] if i == 0 else ["", ""]
            label = f"{d.path.removeprefix('out')} {shape(d.shape)}".strip()
            if with_ref:
                a = a_by_path.get(d.path)
                worse = DASH
                if a is not None and a.rel_l2 is not None and d.rel_l2 is not None:
                    worse = "A" if a.rel_l2 > d.rel_l2 else "B" if d.rel_l2 > a.rel_l2 else "="
                cells = [
                    num(a.rel_l2) if a else DASH,
                    num(d.rel_l2),
                    db(a.sqnr_db, a.rel_l2) if a else DASH,
                    db(d.sqnr_db, d.rel_l2),
                    worse,
                    "; ".join(f for f in (diff_flag(a) if a else "", diff_flag(d)) if f) or DASH,
                ]
                over = d.over or (a is not None and a.over)
            else:
                cells = [
                    num(d.max_abs),
                    num(d.rel_l2),
                    DASH if d.cosine is None else f"{d.cosine:.6f}",
                    db(d.sqnr_db, d.rel_l2),
                    num(d.norm_rel),
                    diff_flag(d) or DASH,
                ]
                over = d.over
            yield [*head, label, *cells], over


def diff_table(report: DiffReport) -> Table:
    headers = DIFF_REF_HEADERS if report.ref is not None else DIFF_HEADERS
    rel = "relative L2 = |B-A|/|A|" if report.ref is None else "relative L2 against the reference"
    title = f"{len(report.calls)} layer calls ({rel}; tol {report.tol:g})"
    rows = [Row(cells, over) for cells, over in diff_rows(report)]
    return Table(title, list(headers), rows, DROP["diff"])


def diff_header_lines(report: DiffReport) -> list[str]:
    m = report.model
    lines = [
        f"diff: {m.spec} ({m.task}, {count(m.params)} params) on {report.device}",
        f"weights: {m.weights}",
        f"input: {report.input.description}",
    ]
    if report.ref is not None:
        lines.append(f"A: {report.a}   B: {report.b}   both against --ref {report.ref}")
    else:
        lines.append(f"A (reference): {report.a}   B: {report.b}")
    return lines


def diff_footer(report: DiffReport) -> list[str]:
    lines = [f"note: {n}" for n in report.notes]
    lines += [f"missing: {m}" for m in report.missing[:10]]
    if len(report.missing) > 10:
        lines.append(f"missing: … and {len(report.missing) - 10} more (all in -f json)")
    if report.first_over is not None:
        lines.append(f"first past tolerance: {report.first_over}")
    else:
        lines.append(f"no call past tolerance ({report.tol:g})")
    return lines


def diff_sections(report: DiffReport) -> list[Section]:
    verdict: Style = "bad" if report.failed else "good"
    footer = [
        Line(line, verdict if line.startswith(("first", "no call")) else "plain")
        for line in diff_footer(report)
    ]
    return [
        lines_section("header", "run", diff_header_lines(report), "dim"),
        Section("calls", "layer calls", [diff_table(report)]),
        Section("footer", "verdict", list(footer)),
    ]
