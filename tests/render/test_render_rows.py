"""Format-neutral sections (render/rows.py): the table and Markdown print the same sections,
and the rows are the cells the table shows."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from hookcli.cli import app
from hookcli.records import (
    Ablation,
    Backward,
    CallProfile,
    CheckResult,
    DiffCall,
    DiffReport,
    Failure,
    InputInfo,
    LayerCall,
    LayerChange,
    LayersReport,
    ModelInfo,
    ModuleRow,
    Origin,
    ParamStats,
    Prediction,
    Profile,
    Report,
    TensorDiff,
    TensorStats,
)
from hookcli.render import diffrows, listing, rows
from hookcli.render.markdown import diff_markdown, report_markdown, sections_markdown
from hookcli.render.table import checks_table, diff_table, layers_table, report_table
from hookcli.text import escape, markdown

WIDE = 400  # no column folds or is left out: every cell is printed whole on its row's line


def _stats(path: str = "out", *, nan: int = 0, hist: bool = False) -> TensorStats:
    return TensorStats(
        path=path,
        shape=(1, 4),
        dtype="float32",
        numel=4,
        mean=0.5,
        std=0.25,
        min=-1.0,
        max=2.0,
        zeros=0.25,
        nan=nan,
        norm=3.0,
        hist={"counts": [1.0, 0.0, 3.0], "edges": [0.0, 1.0, 2.0, 3.0]} if hist else None,
    )


def full_report(*, grads: bool = False) -> Report:
    """A report with every section: header, calls (and parameter gradients), summary, origins,
    input gradients, predictions of two images in class folders, notes, profile with backward,
    ablation with predictions and changed layers, checks with more failures than are shown."""
    timing = CallProfile(forward_ms=1.5, backward_ms=0.5, output_bytes=2**20, share=0.4, self_ms=1)
    layers = [
        LayerCall(
            name="features.0",
            type="Conv2d",
            call=1,
            inputs=[_stats("in[0]")],
            outputs=[_stats(hist=True)],
            grad_outputs=[_stats()],
            grad_inputs=[_stats("in[0]")],
            params=[
                ParamStats(
                    name="weight",
                    shape=(4, 2),
                    numel=8,
                    requires_grad=True,
                    norm=1.0,
                    grad_norm=0.1,
                    grad_mean=0.01,
                    grad_max_abs=0.3,
                    ratio=0.1,
                )
            ],
            profile=timing,
        ),
        LayerCall(
            name="head",
            type="Linear",
            call=1,
            inputs=[_stats("in[0]")],
            outputs=[_stats("out['logits']", nan=2), _stats("out['aux']")],
            profile=dataclasses.replace(timing, self_ms=None, share=None),
        ),
    ]
    preds = [
        Prediction(
            rank=1, index=3, label="tabby", prob=0.9, image=0, source="a.png", folder_class="cats"
        ),
        Prediction(
            rank=1, index=5, label="beagle", prob=None, image=1, source="b.png", folder_class="dogs"
        ),
    ]
    change = LayerChange(
        layer="head", call=1, path="out", norm_before=2.0, norm_after=1.0, relative=0.5,
        mean_before=None, mean_after=None,
    )  # fmt: skip
    return Report(
        model=ModelInfo("net", "net.py:Net", "classification", "none", 1234),
        input=InputInfo(description="images", shapes=[(2, 3, 8, 8)], preprocessing="resize 8"),
        device="cpu",
        layers=layers,
        never_called=["unused"],
        outputs=[_stats()],
        predictions=preds,
        prediction_note="softmax over 10 classes",
        checks=[
            CheckResult(
                "nonfinite", False, "NaN in 1 call", [Failure(f"call {i}") for i in range(25)]
            ),
            CheckResult("dead", True, "no dead layer"),
        ],
        notes=["first note", "second note"],
        nonfinite_origins=[Origin("forward", "head", "Linear", 1, "out['logits']", 2, 0)],
        backward=Backward("ce:3", 0.25) if grads else None,
        input_grads=[_stats("in")],
        ablation=Ablation(
            specs=["features.0=zero"],
            predictions_before=preds[:1],
            predictions_after=preds[1:],
            outputs_before=[],
            outputs_after=[],
            changed_layers=[change],
        ),
        profile=Profile(
            unhooked_ms=5.0, layers_ms=3.0, runs=3, unhooked_backward_ms=2.0, layers_backward_ms=1.0
        ),
        command="grads" if grads else "inspect",
    )  # fmt: skip


EVERY_SECTION = [
    "header",
    "calls",
    "summary",
    "origins",
    "input_grads",
    "predictions",
    "notes",
    "profile",
    "ablation",
    "checks",
]


def _flat(text: str) -> str:
    """Whitespace collapsed: a title Rich wrapped to its table's width reads as one line."""
    return " ".join(text.split())


def _first(section: rows.Section) -> str:
    """A section's first line, or its first table's title."""
    part = section.parts[0]
    return part.text if isinstance(part, rows.Line) else str(part.title)


def _row_pattern(cells: list[str]) -> re.Pattern[str]:
    """A table line holding exactly these cells, in order, between ` | ` separators."""
    return re.compile(
        r"^\s*" + r"\s*\|\s*".join(re.escape(escape(c)) for c in cells) + r"\s*$", re.MULTILINE
    )


def _md_rows(section: rows.Section, t: rows.Table) -> list[str]:
    if section.name == "predictions":  # Markdown's own layout: the image with its folder
        out = []
        for r in t.rows:
            image, folder, rank, label, index, p = r.cells
            where = markdown(image) + ("" if folder == rows.DASH else f" ({markdown(folder)})")
            out.append(f"| {where} | {rank} | {markdown(label)} | {index} | {p} |")
        return out
    return ["| " + " | ".join(markdown(c) for c in t.shown_cells(r)) + " |" for r in t.rows]


def missing_from(sections: list[rows.Section], table: str, md: str) -> list[str]:
    """What of the sections the table output or the Markdown does not show: every line's
    text, every table's title (the per-call table's in the table only) and every row's cells."""
    md_lines = md.splitlines()
    missing = []
    for s in sections:
        for part in s.parts:
            if isinstance(part, rows.Line):
                if escape(part.text) not in table:
                    missing.append(f"table: {s.name}: {part.text}")
                if markdown(part.text) not in md:
                    missing.append(f"markdown: {s.name}: {part.text}")
                continue
            titled_in_md = not (s.name == "calls" and part is s.parts[0])
            if part.title and s.name != "predictions":
                if _flat(escape(part.title)) not in _flat(table):
                    missing.append(f"table: {s.name}: title {part.title}")
                if titled_in_md and f"{markdown(part.title)}:" not in md_lines:
                    missing.append(f"markdown: {s.name}: title {part.title}")
            for r in part.rows:
                if not _row_pattern(part.shown_cells(r)).search(table):
                    missing.append(f"table: {s.name}: row {r.cells}")
            missing += [
                f"markdown: {s.name}: row {line}"
                for line in _md_rows(s, part)
                if line not in md_lines
            ]
    return missing


@pytest.mark.parametrize("grads", [False, True])
def test_every_section_is_built_in_the_order_the_table_prints(grads: bool) -> None:
    report = full_report(grads=grads)
    sections = rows.report_sections(report)
    assert [s.name for s in sections] == EVERY_SECTION
    calls = sections[1].tables()
    assert [t.title for t in calls] == (
        ["2 layer calls", "parameter gradients"] if grads else ["2 layer calls"]
    )
    assert calls[0].drop == rows.DROP["grads" if grads else "layers"]
    assert calls[0].headers == (rows.GRAD_HEADERS if grads else [*rows.HEADERS, "hist"])
    text = report_table(report, color=False, width=WIDE)
    flat = _flat(text)
    positions = [flat.index(_flat(escape(_first(s)))) for s in sections]
    assert positions == sorted(positions)


@pytest.mark.parametrize("grads", [False, True])
def test_markdown_carries_every_section_the_table_has(grads: bool) -> None:
    report = full_report(grads=grads)
    sections = rows.report_sections(report)
    table = report_table(report, color=False, width=WIDE)
    md = report_markdown(report)
    assert missing_from(sections, table, md) == []
    for needle in ("profile (total:", "ablation: features.0=zero", "FAIL", "PASS", "first note"):
        assert needle in table and needle in md
    assert "**FAIL** nonfinite: NaN in 1 call  " in md.splitlines()
    assert "- call 19" in md.splitlines() and "- call 20" not in md.splitlines()
    assert "- … and 5 more (all in --format json)" in md.splitlines()


def test_the_comparison_notices_a_missing_section() -> None:
    report = full_report()
    sections = rows.report_sections(report)
    table = report_table(report, color=False, width=WIDE)
    for name in ("profile", "ablation", "checks", "predictions", "origins"):
        md = sections_markdown([s for s in sections if s.name != name])
        assert any(m.startswith(f"markdown: {name}:") for m in missing_from(sections, table, md))
    changed = dataclasses.replace(report, notes=["another note"])
    assert missing_from(sections, report_table(changed, color=False, width=WIDE), "")


def test_rows_are_the_cells_the_table_shows() -> None:
    report = full_report()
    calls = rows.calls_table(report)
    assert calls.rows[0].cells == [
        "features.0", "Conv2d", "1", "1x4", "1x4", "0.5", "0.25", "-1", "2", "25.0%", "—", "▃ █",
    ]  # fmt: skip
    assert [r.cells[4] for r in calls.rows] == ["1x4", "['logits'] 1x4", "['aux'] 1x4"]
    assert [r.flagged for r in calls.rows] == [False, True, False]
    text = report_table(report, color=False, width=WIDE)
    for r in calls.rows:
        assert _row_pattern(r.cells).search(text), r.cells
    colored = report_table(report, color=True, width=WIDE)
    assert "\x1b[31m" in colored  # the flagged row (and the flagged prediction) in red


def test_predictions_of_one_image_hide_the_image_and_folder_columns() -> None:
    report = full_report()
    one = [dataclasses.replace(p, image=0, folder_class=None) for p in report.predictions or []]
    t = rows.predictions_table(one)
    assert t.hidden == ("image", "folder")
    assert t.shown_headers() == ["#", "class", "index", "prob"]
    text = report_table(dataclasses.replace(report, predictions=one), color=False, width=WIDE)
    assert re.search(r"^#\s+\|\s+class\s+\|\s+index\s+\|\s+prob$", text, re.MULTILINE)
    none = dataclasses.replace(report, predictions=[])
    assert "predictions: none (nothing detected)" in report_table(none, color=False, width=WIDE)
    assert "predictions: none (nothing detected)" in report_markdown(none)


def test_the_table_drops_columns_in_the_sections_order() -> None:
    report = full_report()
    drop = rows.calls_table(report).drop
    text = report_table(report, color=False, width=90)
    left_out = re.search(r"columns left out at 90 characters: ([^;]+);", text)
    assert left_out is not None, text
    names = left_out.group(1).split(", ")
    assert tuple(names) == drop[: len(names)]


def test_checks_sections_quiet_and_verdict() -> None:
    report = full_report()
    loud = rows.checks_sections(report, quiet=False)
    assert [s.name for s in loud] == ["header", "checks", "origins", "verdict"]
    assert loud[-1].parts == [rows.Line("1 passed, 1 failed", "bad")]
    quiet = rows.checks_sections(report, quiet=True)
    assert [s.name for s in quiet] == ["checks", "origins"]
    assert [p.mark for p in quiet[0].lines() if p.mark] == ["FAIL"]
    passing = dataclasses.replace(report, checks=[report.checks[1]])
    assert rows.checks_sections(passing, quiet=True) == []
    assert checks_table(passing, color=False, width=WIDE, quiet=True) == ""
    text = checks_table(report, color=False, width=WIDE, quiet=False)
    assert missing_from(loud, text, sections_markdown(loud)) == []


def _diff(ref: str | None) -> DiffReport:
    d = TensorDiff(path="out", shape=(1, 4), numel=4, max_abs=0.1, rel_l2=0.01, cosine=0.99,
                   sqnr_db=40.0, norm_rel=0.001)  # fmt: skip
    over = dataclasses.replace(d, rel_l2=0.5, over=True)
    return DiffReport(
        model=ModelInfo(name="net", spec="net", task="classification", weights="w", params=10),
        input=InputInfo(description="ones", shapes=[(1, 4)]),
        device="cpu",
        a="float32",
        b="float16",
        ref=ref,
        isolate=False,
        tol=1e-3,
        calls=[DiffCall("fc1", "Linear", 1, [d], [d]), DiffCall("fc2", "Linear", 1, [over], [d])],
        outputs=[DiffCall("(model)", "output", 0, [d], [d])],
        first_over="fc2#1",
        notes=["a diff note"],
    )


@pytest.mark.parametrize("ref", [None, "float64"])
def test_diff_markdown_and_table_share_the_rows(ref: str | None) -> None:
    report = _diff(ref)
    sections = diffrows.diff_sections(report)
    assert [s.name for s in sections] == ["header", "calls", "footer"]
    t = sections[1].tables()[0]
    assert t.headers == (diffrows.DIFF_HEADERS if ref is None else diffrows.DIFF_REF_HEADERS)
    assert [r.flagged for r in t.rows] == [False, True, False]
    table = diff_table(report, color=False, width=WIDE)
    md = diff_markdown(report)
    for r in t.rows:
        assert _row_pattern(r.cells).search(table)
        assert "| " + " | ".join(markdown(c) for c in r.cells) + " |" in md.splitlines()
    # the header row has as many cells as a row: `max|Δ|`'s bars are escaped
    header = next(line for line in md.splitlines() if line.startswith("| layer"))
    assert header == "| " + " | ".join(markdown(h) for h in t.headers) + " |"
    for line in sections[2].lines():
        assert line.text in table and f"{markdown(line.text)}  " in md.splitlines()
    assert sections[2].lines()[-1] == rows.Line("first past tolerance: fc2#1", "bad")


def test_layers_rows_are_the_listing() -> None:
    report = LayersReport(
        model=ModelInfo(name="net", spec="net", task="classification", weights="w", params=10),
        modules=[
            ModuleRow("block", "Sequential", depth=1, params=10, own_params=0, leaf=False),
            ModuleRow(name="block.fc", type="Linear", depth=2, params=10, own_params=10, leaf=True,
                      aliases=["fc"], output_shapes=["1x4"], calls=1),
        ],
        input=InputInfo(description="ones", shapes=[(1, 4)]),
    )  # fmt: skip
    t = listing.layers_sections(report)[1].tables()[0]
    assert t.rows[1].cells == ["  block.fc", "Linear", "10", "yes", "fc", "1", "1x4"]
    text = layers_table(report, color=False, width=WIDE)
    for r in t.rows:
        assert _row_pattern(r.cells).search(text), r.cells


@pytest.mark.parametrize("module", ["hookcli.render.rows", "hookcli.render.markdown"])
def test_rows_and_markdown_import_no_torch(module: str) -> None:
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch imported'"
    if module.endswith("rows"):  # plain data: no Rich either
        code += "; assert 'rich' not in sys.modules, 'rich imported'"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr


def test_a_real_run_has_every_section_in_both_formats() -> None:
    """Through the Python API: profile, ablation and predictions from inspect, checks and the
    NaN origin from check, put in one report."""
    torch = pytest.importorskip("torch")
    import hookcli
    from tests.support.models import NanForward

    ran = hookcli.inspect(
        "examples/tiny/net.py:Net", [torch.ones(2, 2)], profile=True, ablate=["l1=zero"], topk=2
    )
    checked = hookcli.check(NanForward(), [torch.ones(1, 4)])
    assert ran.profile and ran.ablation and ran.predictions
    assert checked.checks and checked.nonfinite_origins
    report = dataclasses.replace(
        ran, checks=checked.checks, nonfinite_origins=checked.nonfinite_origins, notes=["n"]
    )
    sections = rows.report_sections(report)
    names = {s.name for s in sections}
    assert {"profile", "ablation", "checks", "origins", "predictions", "notes"} <= names
    table = report_table(report, color=False, width=WIDE)
    assert missing_from(sections, table, report_markdown(report)) == []


def test_cli_markdown_has_the_profile_and_ablation_sections() -> None:
    args = ["inspect", "examples/tiny/net.py:Net", "--input", "ones:2x2", "--no-config"]
    args += ["--profile", "--ablate", "l1=zero"]
    table = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    md = CliRunner().invoke(app, [*args, "-f", "markdown"])
    assert table.exit_code == 0 and md.exit_code == 0, table.stderr + md.stderr
    for needle in ("profile (total:", "profile: the selected leaf calls", "ablation: l1=zero"):
        assert needle in table.stdout and needle in md.stdout
    assert "layer outputs that changed" in md.stdout or "no selected layer's output" in md.stdout
