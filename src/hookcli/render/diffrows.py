"""hookcli diff's sections: the per-call comparison table, the run header, and the footer:
notes, prediction agreement, the layers with the largest own error and the verdict
(format-neutral, like render.rows; every text format lays them out)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hookcli.records import DiffCall, DiffReport, TensorDiff
from hookcli.render.fmt import DASH, count, num, pct, shape
from hookcli.render.rows import DROP, Line, Row, Section, Table, lines_section

DIFF_HEADERS = [
    "layer",
    "type",
    "call",
    "output",
    "max|Δ|",
    "rel L2",
    "own L2",
    "cosine",
    "SQNR dB",
    "norm Δ",
    "flag",
]
DIFF_REF_HEADERS = [
    "layer",
    "type",
    "call",
    "output",
    "rel L2 A",
    "rel L2 B",
    "own A",
    "own B",
    "SQNR A",
    "SQNR B",
    "worse",
    "flag",
]
OWN_HEADERS = ("own L2", "own A", "own B")
SORTED = {"error": "largest relative L2 first", "own": "largest own error first"}
SHOWN_FLIPS = 10  # flipped images listed in text; JSON carries them all


def db(v: float | None, rel: float | None) -> str:
    if v is None:
        return "inf" if rel == 0 else DASH  # identical: infinite signal-to-noise
    return f"{v:.1f}"


def signed(v: float | None) -> str:
    """A signed change: + when side B's is larger."""
    if v is None:
        return DASH
    return "0" if v == 0 else f"{v:+.4g}"


def type_label(c: DiffCall) -> str:
    """The reference side's type, and side B's when it differs."""
    return f"{c.type} / {c.type_b}" if c.type_b else c.type


def diff_flag(d: TensorDiff) -> str:
    if d.nonfinite:
        return f"{d.nonfinite} not finite" + (f": {d.note}" if d.note else "")
    if d.note:
        return d.note
    return "over tol" if d.over else ""


def diff_rows(report: DiffReport) -> Iterable[tuple[list[str], bool]]:
    with_ref = report.ref is not None
    for c in [*report.calls, *report.outputs]:
        a_by_path = {d.path: d for d in c.a or []}
        for i, d in enumerate(c.b):
            head = [c.name, type_label(c), str(c.call)] if i == 0 else ["", "", ""]
            label = f"{d.path.removeprefix('out')} {shape(d.shape)}".strip()
            if with_ref:
                a = a_by_path.get(d.path)
                worse = DASH
                if a is not None and a.rel_l2 is not None and d.rel_l2 is not None:
                    worse = "A" if a.rel_l2 > d.rel_l2 else "B" if d.rel_l2 > a.rel_l2 else "="
                cells = [
                    num(a.rel_l2) if a else DASH,
                    num(d.rel_l2),
                    num(a.own_rel_l2) if a else DASH,
                    num(d.own_rel_l2),
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
                    num(d.own_rel_l2),
                    DASH if d.cosine is None else f"{d.cosine:.6f}",
                    db(d.sqnr_db, d.rel_l2),
                    signed(d.norm_rel),
                    diff_flag(d) or DASH,
                ]
                over = d.over
            yield [*head, label, *cells], over


def diff_table(report: DiffReport) -> Table:
    headers = DIFF_REF_HEADERS if report.ref is not None else DIFF_HEADERS
    rel = "relative L2 = |B-A|/|A|" if report.ref is None else "relative L2 against the reference"
    order = f", {SORTED[report.sort]}" if report.sort in SORTED else ""
    default = report.tol_source.partition(":")[0]  # "default for bfloat16", or "--tol"
    why = f" ({default})" if default.startswith("default") else ""
    title = f"{len(report.calls)} layer calls ({rel}; tol {report.tol:g}{why}{order})"
    rows = [Row(cells, over) for cells, over in diff_rows(report)]
    hidden = OWN_HEADERS if report.isolate else ()  # --isolate: rel L2 is the own error
    return Table(title, list(headers), rows, DROP["diff"], hidden)


def agreement_lines(report: DiffReport) -> list[Line]:
    """Top-1 flips and top-k overlap of each compared side's predictions."""
    lines: list[Line] = []
    for side, g in (report.agreement or {}).items():
        n, k = g["images"], g["topk"]
        noun = "image" if n == 1 else "images"
        top1 = (
            f"top-1 flipped on {g['top1_flips']} of {n} {noun}"
            if g["top1_flips"]
            else f"top-1 the same on all {n} {noun}"
            if n > 1
            else "top-1 the same"
        )
        overlap = pct(g["topk_overlap"]) if g["topk_overlap"] is not None else DASH
        mean = " (mean over images)" if n > 1 else ""
        lines.append(
            Line(
                f"predictions, {side} against {g['against']}: {top1}; top-{k} overlap "
                f"{overlap}{mean}",
                "bad" if g["top1_flips"] else "plain",
            )
        )
        for f in g["flipped"][:SHOWN_FLIPS]:
            lines.append(Line(f"  flipped: {_image(f)}: {_cls(f, 'ref')} -> {_cls(f, 'side')}"))
        if len(g["flipped"]) > SHOWN_FLIPS:
            more = len(g["flipped"]) - SHOWN_FLIPS
            lines.append(Line(f"  flipped: … and {more} more (all in -f json)"))
    return lines


def _image(f: dict[str, Any]) -> str:
    return str(f["image"]) if f.get("image") else f"image {f['index']}"


def _cls(f: dict[str, Any], which: str) -> str:
    index, label = f.get(which), f.get(f"{which}_label")
    if index is None:
        return "not finite"
    return f"{index} ({label})" if label else str(index)


def largest_lines(report: DiffReport) -> list[Line]:
    """The layers with the largest own error."""
    if not report.largest_own:
        return []
    fed = "A's" if report.ref is None else "the reference's"
    lines = [Line(f"largest own error (relative L2, each layer fed {fed} input):")]
    for i, e in enumerate(report.largest_own, 1):
        side = f", side {e['side']}" if report.ref is not None else ""
        path = "" if e["path"] == "out" else f" {e['path'].removeprefix('out')}"
        acc = ""
        if not report.isolate:
            acc = (
                f" (accumulated {num(e['rel_l2'])})"
                if e["rel_l2"] is not None
                else (" (accumulated: values not finite)")
            )
        lines.append(
            Line(
                f"  {i}. {e['name']} ({e['type']}) call {e['call']}{path}{side}: "
                f"{num(e['own_rel_l2'])}{acc}"
            )
        )
    return lines


def diff_header_lines(report: DiffReport) -> list[str]:
    m = report.model
    lines = [
        f"diff: {m.spec} ({m.task}, {count(m.params)} params) on {report.device}",
        f"weights: {m.weights}",
        f"input: {report.input.description}",
    ]
    a, b = report.side("A"), report.side("B")
    if report.ref is not None:
        lines.append(f"A: {a}   B: {b}   both against --ref {report.side('ref')}")
    else:
        lines.append(f"A (reference): {a}   B: {b}")
    return lines


def diff_footer(report: DiffReport) -> list[str]:
    lines = [f"note: {n}" for n in report.notes]
    lines += [f"missing: {m}" for m in report.missing[:10]]
    if len(report.missing) > 10:
        lines.append(f"missing: … and {len(report.missing) - 10} more (all in -f json)")
    return lines


POSITIONS_LISTED = 3  # a (batch, tokens, vocab) output's worst positions named under the table


def position_lines(report: DiffReport) -> list[Line]:
    """The model's (batch, tokens, vocab) output: its worst positions by relative L2, each
    named by its token."""
    texts = report.input.texts or []
    lines = []
    for call in report.outputs:
        for side, diffs in (("B", call.b), ("A", call.a or [])):
            for d in diffs:
                if not d.per_position:
                    continue
                padded = {  # a padded sequence's positions include its padding: left out
                    b
                    for b, row in enumerate(d.per_position)
                    if b < len(texts) and len(texts[b].tokens) != len(row)
                }
                cells = [
                    (e, b, p)
                    for b, row in enumerate(d.per_position)
                    if b not in padded
                    for p, e in enumerate(row)
                    if e is not None
                ]
                worst = sorted(cells, reverse=True)[:POSITIONS_LISTED]
                if not worst:
                    continue
                shown = ", ".join(
                    f"sequence {b} position {p}{_token_at(texts, b, p, len(d.per_position[b]))} "
                    f"{num(e)}"
                    for e, b, p in worst
                )
                path = d.path.removeprefix("out") or "output"
                left = f" (padded sequences {sorted(padded)} left out)" if padded else ""
                lines.append(
                    Line(f"worst positions of {path}, side {side} (relative L2){left}: {shown}")
                )
    return lines


def _token_at(texts: list[Any], b: int, p: int, length: int) -> str:
    """The token at a position, when the sequence is unpadded (its tokens are its positions)."""
    if b < len(texts) and len(texts[b].tokens) == length:
        return f" ({texts[b].tokens[p]!r})"
    return ""


def diff_verdict(report: DiffReport) -> Line:
    if report.first_over is not None:
        return Line(f"first past tolerance: {report.first_over}", "bad")
    if report.token_failures:
        return Line(f"failed: {'; '.join(report.token_failures)}", "bad")
    return Line(f"no call past tolerance ({report.tol:g})", "good")


def token_lines(report: DiffReport) -> list[Line]:
    """A causal LM's text: side B's next-token distributions against the reference's."""
    t = report.tokens
    if t is None:
        return []
    ref = "ref" if report.ref is not None else "A"
    against = "the reference" if report.ref is not None else "A"
    kld, rev, dp = t.kld, t.kld_reverse, t.delta_p
    lines = [
        Line(
            f"next tokens, B against {against}, over {t.count} positions: mean KL({ref}||B) "
            f"{num(kld['mean'])} ± {num(kld['stderr'])}, p99 {num(kld['p99'])}, max "
            f"{num(kld['max'])}; KL(B||{ref}) {num(rev['mean'])}",
            "bad" if "mean KL" in " ".join(report.token_failures) else "plain",
        ),
        Line(
            f"same top-1 {pct(t.same_top1) if t.same_top1 is not None else DASH}; Δp of the "
            f"next token rms {num(dp['rms'])}, p1 {num(dp['p1'])}, p99 {num(dp['p99'])}",
            "bad" if "same top-1" in " ".join(report.token_failures) else "plain",
        ),
        Line(
            f"perplexity {ref} {num(t.ppl_a)}, B {num(t.ppl_b)} (B/{ref} {num(t.ppl_ratio)}; "
            f"correlation of ln p {num(t.ln_ppl_corr)})"
        ),
    ]
    worst = [
        f"{w['text']!r} (text {w['sequence']}, position {w['position']}: {num(w['kld'])})"
        if w.get("text") is not None
        else f"token {w['token']} (text {w['sequence']}, position {w['position']}: {num(w['kld'])})"
        for w in t.worst[:3]
    ]
    if worst:
        lines.append(Line(f"largest KL({ref}||B) predicting {', '.join(worst)}", "dim"))
    return lines


def weight_lines(report: DiffReport) -> list[Line]:
    """The layers whose weights differ most between the sides (lowest SQNR first)."""
    w = report.weights
    if not w:
        return []
    ref = "the reference" if report.ref is not None else "A"
    shown = ", ".join(
        f"{d.layer} {num(d.sqnr_db)} dB"
        if d.sqnr_db is not None
        else f"{d.layer} (no SQNR: NaN/Inf, or A all zero)"
        for d in w[:3]
    )
    more = f"; {len(w)} layers' weights differ" if len(w) > 3 else ""
    return [Line(f"weights of B against {ref}, lowest SQNR first: {shown}{more}", "dim")]


def diff_sections(report: DiffReport) -> list[Section]:
    footer = [
        *(Line(line) for line in diff_footer(report)),
        *agreement_lines(report),
        *token_lines(report),
        *weight_lines(report),
        *largest_lines(report),
        *position_lines(report),
        diff_verdict(report),
    ]
    return [
        lines_section("header", "run", diff_header_lines(report), "dim"),
        Section("calls", "layer calls", [diff_table(report)]),
        Section("footer", "verdict", list(footer)),
    ]
