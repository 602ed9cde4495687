"""The HTML report (`-f html`) in a real browser: headless Chromium driven by Playwright.

Each report is built once per module through the CLI, and each page is opened with every
request other than the file itself aborted and counted (there must be none), console errors
and page errors collected (there must be none), and `window.hookcliTiming.paint` awaited.
Every expectation comes from outside the page: the `-f json` output of the same command,
fnmatch for the layer glob, Python's sort for the column order.
"""

from __future__ import annotations

import fnmatch
import json
import math
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from hookcli.cli import app
from tests.support.paths import CAT, ROOT

sync_api = pytest.importorskip(
    "playwright.sync_api",
    reason="Playwright for Python is not installed: pip install playwright (README, top)",
)
CHROMIUM = shutil.which("chromium") or (
    "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None
)
if CHROMIUM is None:
    pytest.skip(
        reason="Debian's chromium is not installed: apt-get install -y chromium (README, top)",
        allow_module_level=True,
    )

runner = CliRunner()
NAN_FORWARD = f"{ROOT}/tests/support/models.py:NanForward"
LAYER1 = ["resnet18", str(CAT), "-l", "layer1.*"]
NUMBER = r"^-?\d+(\.\d+)?(e[+-]\d+)?%?$"


# ---------------------------------------------------------------- reports, built once


@dataclass(frozen=True)
class Built:
    """A report written by the CLI as HTML, and the same command's `-f json` output."""

    html: Path
    data: dict[str, Any]

    def records(self) -> list[dict[str, Any]]:
        """The rows of the per-call table, in order: layers, or a diff's calls then outputs."""
        if "layers" in self.data:
            return list(self.data["layers"])
        return [*self.data["calls"], *self.data["outputs"]]


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Where the reports go; the same isolation as conftest's per-test fixture (no network,
    an empty torch hub), held for the whole module."""
    home = tmp_path_factory.mktemp("torch_home_html")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCH_HOME", str(home))
        mp.setenv("HF_HUB_CACHE", str(home / "hf_hub"))
        mp.setenv("COLUMNS", "200")
        yield tmp_path_factory.mktemp("html_reports")


def build(out_dir: Path, name: str, args: list[str], *, json_too: bool = True) -> Built:
    html = out_dir / f"{name}.html"
    r = runner.invoke(app, [*args, "-o", str(html)])
    assert r.exit_code == 0, (r.exit_code, r.stdout, r.stderr)
    assert html.is_file()
    data: dict[str, Any] = {}
    if json_too:
        j = runner.invoke(app, [*args, "-f", "json"])
        assert j.exit_code == 0, (j.exit_code, j.stderr)
        data = json.loads(j.stdout)
    return Built(html, data)


@pytest.fixture(scope="module")
def inspect_report(out_dir: Path) -> Built:
    return build(out_dir, "inspect", ["inspect", *LAYER1, "--hist"])


@pytest.fixture(scope="module")
def grads_report(out_dir: Path) -> Built:
    return build(out_dir, "grads", ["grads", *LAYER1])


@pytest.fixture(scope="module")
def nan_report(out_dir: Path) -> Built:
    return build(out_dir, "nan", ["inspect", NAN_FORWARD, "--input", "randn:16x4"])


@pytest.fixture(scope="module")
def diff_report(out_dir: Path) -> Built:
    return build(out_dir, "diff", ["diff", *LAYER1, "--b", "float64"])


@pytest.fixture(scope="module")
def picture_report(out_dir: Path) -> Built:
    args = ["inspect", "resnet18", str(CAT), "-l", "conv1", "--picture", "maps:conv1"]
    return build(out_dir, "picture", args, json_too=False)


# ---------------------------------------------------------------- the browser


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        yield b
        b.close()


@dataclass
class Watch:
    """What a page did that it must not: requests other than its own file, errors."""

    requests: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@contextmanager
def watched(
    browser: Any, path: Path, fragment: str = "", *, js: bool = True, check: bool = True
) -> Iterator[tuple[Any, Watch]]:
    """The page of `path` (+ `fragment`) in a fresh context, every other request aborted and
    counted, console errors and page errors collected; with JavaScript, once the script has
    painted. On leaving: no request, no error (unless `check` is False)."""
    context = browser.new_context(java_script_enabled=js, viewport={"width": 1280, "height": 800})
    page = context.new_page()
    own = path.resolve().as_uri()
    watch = Watch()

    def route(r: Any) -> None:
        if r.request.url.split("#")[0] == own:
            r.continue_()
        else:
            watch.requests.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    page.on("console", lambda m: watch.errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: watch.errors.append(str(e)))
    try:
        page.goto(own + fragment)
        if js:
            page.wait_for_function("window.hookcliTiming && window.hookcliTiming.paint")
        yield page, watch
        if check:
            assert watch.requests == [], watch.requests
            assert watch.errors == [], watch.errors
    finally:
        context.close()


@contextmanager
def opened(browser: Any, path: Path, fragment: str = "", *, js: bool = True) -> Iterator[Any]:
    with watched(browser, path, fragment, js=js) as (page, _):
        yield page


def row_indices(page: Any, visible_only: bool = False) -> list[int]:
    sel = "#calls tbody tr:not([hidden])" if visible_only else "#calls tbody tr"
    return page.eval_on_selector_all(sel, "trs => trs.map(t => +t.getAttribute('data-i'))")


def value(rec: dict[str, Any], key: str) -> Any:
    """The JSON value a column key names (independent of report.js)."""
    if key in ("name", "type", "call"):
        return rec[key]
    side, attr = key.split(".", 1)
    lists = {"out": "outputs", "in": "inputs", "gout": "grad_outputs", "b": "b", "a": "a"}
    tensors = rec.get(lists[side]) or []
    return tensors[0].get(attr) if tensors else None


def expected_order(recs: list[dict[str, Any]], key: str, descending: bool) -> list[int]:
    """Indices sorted by the key's value (ties in record order), missing values last."""
    vals = [value(r, key) for r in recs]
    present = sorted(
        (i for i, v in enumerate(vals) if v is not None), key=lambda i: vals[i], reverse=descending
    )
    return present + [i for i, v in enumerate(vals) if v is None]


def check_sort(page: Any, recs: list[dict[str, Any]], key: str, first_descending: bool) -> None:
    th = page.locator(f'#calls th[data-key="{key}"]')
    assert "sortable" in (th.get_attribute("class") or "")
    assert th.get_attribute("aria-sort") is None
    for descending in (first_descending, not first_descending):
        th.click()
        assert th.get_attribute("aria-sort") == ("descending" if descending else "ascending")
        assert row_indices(page) == expected_order(recs, key, descending), (key, descending)
    # one sorted column at a time
    assert page.locator("#calls th[aria-sort]").count() == 1


# ---------------------------------------------------------------- the helper catches requests


def test_the_watch_counts_requests_and_errors(browser: Any, tmp_path: Path) -> None:
    """Without this, `requests == []` could pass by never seeing a request."""
    page_file = tmp_path / "leaky.html"
    page_file.write_text(
        '<!DOCTYPE html><html><body><img src="http://example.invalid/x.png">'
        "<script>window.hookcliTiming = {paint: 1}; null.x;</script></body></html>"
    )
    with watched(browser, page_file, check=False) as (page, watch):
        page.wait_for_load_state("load")
    assert watch.requests == ["http://example.invalid/x.png"]
    assert any("null" in e for e in watch.errors), watch.errors


# ---------------------------------------------------------------- inspect


def test_rows_and_embedded_json_match_the_json_report(browser: Any, inspect_report: Built) -> None:
    recs = inspect_report.records()
    with opened(browser, inspect_report.html) as page:
        assert page.locator("#calls tbody tr").count() == len(recs) == 14
        embedded = page.evaluate("JSON.parse(document.getElementById('hookcli-data').textContent)")
        assert embedded == inspect_report.data
        assert page.evaluate("window.hookcliData") == inspect_report.data
        rows = page.eval_on_selector_all(
            "#calls tbody tr",
            "trs => trs.map(t => [+t.dataset.i, t.dataset.layer, +t.dataset.call, t.dataset.type])",
        )
        assert rows == [[i, r["name"], r["call"], r["type"]] for i, r in enumerate(recs)]
        timing = page.evaluate("window.hookcliTiming")
        assert timing["script"] <= timing["ready"] <= timing["paint"]


def test_sort_by_std_then_name(browser: Any, inspect_report: Built) -> None:
    recs = inspect_report.records()
    with opened(browser, inspect_report.html) as page:
        check_sort(page, recs, "out.std", first_descending=True)  # numbers: largest first
        check_sort(page, recs, "name", first_descending=False)  # text: A to Z first
        # the keyboard sorts too
        th = page.locator('#calls th[data-key="out.max"]')
        th.focus()
        page.keyboard.press("Enter")
        assert th.get_attribute("aria-sort") == "descending"
        assert row_indices(page) == expected_order(recs, "out.max", True)


def test_filter_by_glob_substring_type_and_flag(browser: Any, inspect_report: Built) -> None:
    recs = inspect_report.records()
    names = [r["name"] for r in recs]
    types = sorted({r["type"] for r in recs})

    def shown(page: Any, expected: list[int]) -> None:
        assert row_indices(page, visible_only=True) == expected
        assert page.locator("#shown").inner_text() == f"{len(expected)} of {len(recs)} calls"

    with opened(browser, inspect_report.html) as page:
        shown(page, list(range(len(recs))))
        options = page.eval_on_selector_all("#f-type option", "os => os.map(o => o.value)")
        assert options == ["", *types]
        for glob in ("layer1.?.conv*", "*.bn[12]", "layer1.1.*", "layer1.[!0]*", "layer1.[^0]*"):
            page.fill("#f-layer", glob)
            shown(page, [i for i, n in enumerate(names) if fnmatch.fnmatchcase(n, glob)])
        page.fill("#f-layer", "relu")  # no glob character: a substring
        shown(page, [i for i, n in enumerate(names) if "relu" in n])
        page.fill("#f-layer", "")
        page.select_option("#f-type", "BatchNorm2d")
        shown(page, [i for i, r in enumerate(recs) if r["type"] == "BatchNorm2d"])
        page.fill("#f-layer", "layer1.0*")  # both filters at once
        shown(
            page,
            [
                i
                for i, r in enumerate(recs)
                if r["type"] == "BatchNorm2d" and fnmatch.fnmatchcase(r["name"], "layer1.0*")
            ],
        )
        page.select_option("#f-type", "")
        page.fill("#f-layer", "")
        page.check("#f-bad")  # a healthy run: nothing flagged
        shown(page, [])
        page.uncheck("#f-bad")
        shown(page, list(range(len(recs))))


def _std_cell(page: Any, tr: Any) -> str:
    col = page.eval_on_selector_all(
        "#calls thead th", "ths => ths.findIndex(t => t.dataset.key === 'out.std')"
    )
    return tr.locator("td").nth(col).inner_text()


def test_deep_link_selects_the_call_and_shows_its_detail(
    browser: Any, inspect_report: Built
) -> None:
    recs = inspect_report.records()
    i = next(k for k, r in enumerate(recs) if r["name"] == "layer1.0.conv1")
    with opened(browser, inspect_report.html, "#layer=layer1.0.conv1&call=0") as page:
        targets = page.locator("#calls tbody tr.target")
        assert targets.count() == 1
        assert targets.get_attribute("data-i") == str(i)
        detail = page.locator("#detail")
        assert detail.is_visible()
        assert detail.locator("h3").inner_text() == "layer1.0.conv1"
        assert page.locator("#link-status").is_hidden()
        # the detail's numbers come from the JSON (report.js) and match the table's (Python)
        dd = detail.locator("section:has(h4:text-is('outputs')) dt:text-is('std') + dd")
        assert dd.inner_text() == _std_cell(page, targets)
        # the histogram (--hist) of each output, as SVG
        hists = [t for t in recs[i]["outputs"] if t.get("hist")]
        assert hists
        assert detail.locator("section:has(h4:text-is('outputs')) svg.hist").count() == len(hists)

        # the second call of a layer called twice, by a hash change
        j = next(k for k, r in enumerate(recs) if r["name"] == "layer1.0.relu" and r["call"] == 1)
        page.evaluate("location.hash = '#layer=layer1.0.relu&call=1'")
        page.wait_for_function(f"document.querySelector('tr.target').dataset.i === '{j}'")
        assert page.locator("#calls tbody tr.target").count() == 1
        assert detail.locator("h3").inner_text() == "layer1.0.relu"

        # a click selects a row and links to it
        k = next(k for k, r in enumerate(recs) if r["name"] == "layer1.1.bn1")
        page.click(f'#calls tbody tr[data-i="{k}"] td >> nth=0')
        assert page.locator("#calls tbody tr.target").get_attribute("data-i") == str(k)
        assert page.evaluate("location.hash") == "#layer=layer1.1.bn1&call=0"
        assert detail.locator("h3").inner_text() == "layer1.1.bn1"

        # a link to a row the filter hides clears the filter and shows it
        page.fill("#f-layer", "bn")
        assert page.locator(f'#calls tbody tr[data-i="{i}"]').is_hidden()
        page.evaluate("location.hash = '#layer=layer1.0.conv1&call=0'")
        page.wait_for_function(f"document.querySelector('tr.target').dataset.i === '{i}'")
        assert page.locator(f'#calls tbody tr[data-i="{i}"]').is_visible()
        assert page.input_value("#f-layer") == ""
        assert row_indices(page, visible_only=True) == list(range(len(recs)))


@pytest.mark.parametrize(
    "fragment", ["#layer=no.such.layer&call=0", "#layer=layer1.0.conv1&call=7"]
)
def test_a_link_to_a_call_not_in_the_report_says_so(
    browser: Any, inspect_report: Built, fragment: str
) -> None:
    with opened(browser, inspect_report.html, fragment) as page:
        status = page.locator("#link-status")
        assert status.is_visible()
        assert "no call" in status.inner_text()
        assert page.locator("#calls tbody tr.target").count() == 0
        assert page.locator("#detail").is_hidden()


def test_module_tree_opens_and_selects(browser: Any, inspect_report: Built) -> None:
    recs = inspect_report.records()
    with opened(browser, inspect_report.html) as page:
        assert page.evaluate("document.getElementById('tree').open") is False
        page.click("#tree > summary")
        assert page.evaluate("document.getElementById('tree').open") is True
        # the rows are built on the details' toggle event, which the browser fires as a task
        # after the click returns (asserting at once raced it: 3 runs in 5 on one machine)
        page.wait_for_selector(".tree-row[data-name]")
        names = set(
            page.eval_on_selector_all(".tree-row[data-name]", "rs => rs.map(r => r.dataset.name)")
        )
        assert {r["name"] for r in recs} <= names
        assert page.locator("#tree-metric option").count() >= 1
        page.click('.tree-row[data-name="layer1.1.conv2"]')
        target = page.locator("#calls tbody tr.target")
        assert target.get_attribute("data-layer") == "layer1.1.conv2"


def test_without_javascript_the_table_is_all_there(browser: Any, inspect_report: Built) -> None:
    recs = inspect_report.records()
    with opened(browser, inspect_report.html, js=False) as page:
        rows = page.locator("#calls tbody tr")
        assert rows.count() == len(recs)
        assert rows.first.is_visible()
        assert page.locator("#controls").count() == 0
        assert page.locator("#detail").count() == 0
        keys = page.eval_on_selector_all("#calls thead th", "ths => ths.map(t => t.dataset.key)")
        col = keys.index("out.std")
        for i, r in enumerate(recs):
            text = rows.nth(i).locator("td").nth(col).inner_text()
            assert text, (i, r["name"])
            assert math.isclose(float(text), r["outputs"][0]["std"], rel_tol=1e-3), (text, r)
            assert rows.nth(i).locator("td").first.inner_text() == r["name"]


def test_print_hides_the_controls_and_keeps_the_table(browser: Any, inspect_report: Built) -> None:
    with opened(browser, inspect_report.html, "#layer=layer1.0.conv1&call=0") as page:
        assert page.locator("#controls").is_visible()
        page.emulate_media(media="print")
        assert page.locator("#controls").is_hidden()
        assert page.locator("#detail").is_hidden()
        assert page.locator("#calls").is_visible()
        assert page.locator("#calls tbody tr").first.is_visible()
        pdf = page.pdf()
        assert pdf.startswith(b"%PDF")


def test_a_saved_json_report_renders_the_same(
    browser: Any, inspect_report: Built, out_dir: Path
) -> None:
    saved = out_dir / "saved.json"
    saved.write_text(json.dumps(inspect_report.data))
    html = out_dir / "saved.html"
    r = runner.invoke(app, ["report", str(saved), "-o", str(html)])
    assert r.exit_code == 0, r.stderr
    with opened(browser, html) as page:
        assert page.evaluate("window.hookcliData") == inspect_report.data
        assert page.locator("#calls tbody tr").count() == len(inspect_report.records())


# ---------------------------------------------------------------- grads


def test_grads_report_rows_json_and_gradient_sort(browser: Any, grads_report: Built) -> None:
    recs = grads_report.records()
    with opened(browser, grads_report.html) as page:
        assert page.locator("#calls tbody tr").count() == len(recs)
        assert page.evaluate("window.hookcliData") == grads_report.data
        check_sort(page, recs, "gout.norm", first_descending=True)


# ---------------------------------------------------------------- NaN


def test_nan_report_banner_links_to_the_origin(browser: Any, nan_report: Built) -> None:
    recs = nan_report.records()
    origin = nan_report.data["nonfinite_origins"][0]
    o = next(
        i for i, r in enumerate(recs) if (r["name"], r["call"]) == (origin["layer"], origin["call"])
    )
    flagged = [
        i
        for i, r in enumerate(recs)
        if r.get("error") or any(t["nan"] or t["inf"] for t in [*r["inputs"], *r["outputs"]])
    ]
    assert o in flagged
    with opened(browser, nan_report.html) as page:
        assert page.locator("#calls tbody tr").count() == len(recs)
        assert page.evaluate("window.hookcliData") == nan_report.data
        assert row_indices(page)[o] == o
        origins = page.locator("#calls tbody tr.origin")
        assert origins.count() == 1
        assert origins.get_attribute("data-i") == str(o)
        bad = page.eval_on_selector_all("#calls tbody tr.bad", "trs => trs.map(t => +t.dataset.i)")
        assert bad == flagged
        assert page.locator("#calls tbody tr.target").count() == 0

        banner = page.locator("#banner")
        assert banner.is_visible()
        link = banner.locator("a").first
        assert link.get_attribute("href") == f"#layer={origin['layer']}&call={origin['call']}"
        link.click()
        page.wait_for_selector("#calls tbody tr.target")
        assert page.locator("#calls tbody tr.target").get_attribute("data-i") == str(o)
        assert page.locator("#detail h3").inner_text() == origin["layer"]

        page.check("#f-bad")
        assert row_indices(page, visible_only=True) == flagged
        page.uncheck("#f-bad")
        # missing values (no finite std) sort last, either way
        check_sort(page, recs, "out.std", first_descending=True)


# ---------------------------------------------------------------- diff


def test_diff_report_rows_json_and_sort(browser: Any, diff_report: Built) -> None:
    data = diff_report.data
    recs = diff_report.records()
    assert len(recs) == len(data["calls"]) + len(data["outputs"])
    with opened(browser, diff_report.html) as page:
        assert page.locator("#calls tbody tr").count() == len(recs)
        assert page.evaluate("window.hookcliData") == data
        layers = page.eval_on_selector_all(
            "#calls tbody tr", "trs => trs.map(t => t.dataset.layer)"
        )
        assert layers == [r["name"] for r in recs]
        check_sort(page, recs, "b.rel_l2", first_descending=True)


# ---------------------------------------------------------------- pictures


def test_embedded_picture_decodes_without_a_request(browser: Any, picture_report: Built) -> None:
    with opened(browser, picture_report.html) as page:
        imgs = page.locator("#pictures figure img")
        assert imgs.count() >= 1
        srcs = page.eval_on_selector_all("#pictures img", "is => is.map(i => i.src)")
        assert all(s.startswith("data:image/") for s in srcs), [s[:40] for s in srcs]
        imgs.first.scroll_into_view_if_needed()
        page.wait_for_function(
            "Array.from(document.querySelectorAll('#pictures img')).every(i => i.complete)"
        )
        widths = page.eval_on_selector_all("#pictures img", "is => is.map(i => i.naturalWidth)")
        assert all(w > 0 for w in widths), widths


# ---------------------------------------------------------------- 1,000 rows


def _synthetic_report(n: int) -> Any:
    from hookcli.records import InputInfo, LayerCall, ModelInfo, Report, TensorStats

    layers = []
    for i in range(n):
        std = None if i % 97 == 0 else 1.0 + (i * 7919 % n) / n
        out = TensorStats(
            path="out",
            shape=(1, 64, 8, 8),
            dtype="float32",
            numel=4096,
            mean=(i % 13) / 13 - 0.5,
            std=std,
            min=-3.0,
            max=3.0 + i / n,
            zeros=0.0,
            nan=4096 if std is None else 0,
            norm=64.0,
        )
        inp = TensorStats(path="in", shape=(1, 64, 8, 8), dtype="float32", numel=4096)
        layers.append(
            LayerCall(
                name=f"blocks.{i // 10}.op{i % 10}",
                type="Conv2d" if i % 2 else "ReLU",
                call=0,
                inputs=[inp],
                outputs=[out],
            )
        )
    return Report(
        model=ModelInfo(
            name="synthetic", spec="synthetic", task="custom", weights="none", params=0
        ),
        input=InputInfo(description="randn:1x64x8x8", shapes=[(1, 64, 8, 8)]),
        device="cpu",
        layers=layers,
    )


def test_first_paint_of_1000_rows(
    browser: Any, tmp_path: Path, record_property: pytest.RecordProperty
) -> None:
    from hookcli.render.html import report_html

    report = _synthetic_report(1000)
    path = tmp_path / "big.html"
    path.write_text(report_html(report), encoding="utf-8")
    recs = report.to_dict()["layers"]
    with opened(browser, path, "#layer=blocks.90.op3&call=0") as page:
        paint = page.evaluate("window.hookcliTiming.paint")
        print(f"\nfirst table paint for 1000 rows: {paint:.0f} ms")
        record_property("first_paint_1000_rows_ms", round(paint, 1))
        assert page.locator("#calls tbody tr").count() == 1000
        # the deep-linked row far down was scrolled into view
        target = page.locator("#calls tbody tr.target")
        assert target.get_attribute("data-layer") == "blocks.90.op3"
        box = target.bounding_box()
        assert box is not None and 0 <= box["y"] < 800
        check_sort(page, recs, "out.std", first_descending=True)


def test_names_the_text_escaper_rewrites_still_link(browser: Any, tmp_path: Path) -> None:
    """A name with a line separator, a bidi mark and markup: shown escaped, yet the banner's
    link, a row click and the tree find its call (the script matches the JSON's names)."""
    from hookcli.records import Origin
    from hookcli.render.html import report_html

    report = _synthetic_report(4)
    odd = 'bad\u2028log</script>\u202e"&#'
    report.layers[2].name = odd
    report.nonfinite_origins = [Origin("forward", odd, "Conv2d", 0, "out", 4, 0)]
    path = tmp_path / "odd.html"
    path.write_text(report_html(report), encoding="utf-8")
    with opened(browser, path) as page:
        page.click("#banner a")
        page.wait_for_selector("#calls tr.target")  # (marked by the click's handler: a task)
        assert page.eval_on_selector("#calls tr.target", "t => +t.dataset.i") == 2
        assert page.eval_on_selector("#detail h3", "h => h.textContent") == (
            'bad\\u2028log</script>\\u202e"&#'
        )
        page.fill("#f-layer", "bad*")  # the glob on the name itself
        assert row_indices(page, visible_only=True) == [2]


def test_an_origin_after_the_last_call_has_no_dead_link(browser: Any, tmp_path: Path) -> None:
    path = tmp_path / "after.html"
    r = CliRunner().invoke(
        app,
        ["inspect", "tests/support/models.py:LogAfter", "--input", "randn:4x8", "-o", str(path)],
    )
    assert r.exit_code == 0, r.stderr
    with opened(browser, path) as page:
        assert "made after fc" in page.inner_text("#banner")
        assert page.locator("#banner a").count() == 0  # "(model)" is no row to go to


def test_numbers_the_script_shows_are_the_tables_digits(browser: Any, tmp_path: Path) -> None:
    """report.js formats as render/fmt.py and diffrows do, ties (exact in binary) included:
    Python rounds them to even, JavaScript's toPrecision up."""
    from hookcli.render.diffrows import db, signed
    from hookcli.render.fmt import num, pct

    values = [9999.5, 9698.5, 9.9996e-05, 0.0625, -0.0625, 2.5e-7, 1234.5, 1235.5, 0.99995]
    values += [1.0 / 16, 0.0005, 123456.0, -3.4e10, 1e-300, 5e-324, 0.1, 12.345, 2.675]
    path = tmp_path / "fmt.html"
    path.write_text(report_html_of(_synthetic_report(1)), encoding="utf-8")
    with opened(browser, path) as page:
        got = page.evaluate(
            """vs => vs.map(v => { const f = window.hookcliFormat;
                return [f.fmt(v), f.pct(Math.abs(v) % 1), f.signed(v), f.fixed(v, 3),
                        f.fixed(v, 6), f.db(v, 1)]; })""",
            values,
        )
    want = [[num(v), pct(abs(v) % 1), signed(v), f"{v:.3f}", f"{v:.6f}", db(v, 1)] for v in values]
    assert got == want


def report_html_of(report: Any) -> str:
    from hookcli.render.html import report_html

    return str(report_html(report))


# ---------------------------------------------------------------- language models (issue 34)


def test_a_language_models_report_shows_its_tokens_per_token_rows_and_lens(
    browser: Any, tmp_path: Path
) -> None:
    """An LLM's HTML report in the browser: the tokens in the header, the per-token table
    with a row per real position (padding left out), the next tokens; and the lens page."""
    from tests.support.llm import LINES, save

    folder = save(tmp_path / "tiny", "llama")
    texts = ["--text", LINES[0], "--text", "hello"]
    page_file = tmp_path / "llm.html"
    result = runner.invoke(
        app,
        ["inspect", f"hf:{folder}", *texts, "-l", "model.layers.1", "--per-token",
         "-o", str(page_file)],
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    data = json.loads(
        runner.invoke(
            app, ["inspect", f"hf:{folder}", *texts, "-l", "model.layers.1", "--per-token",
                  "-f", "json"],
        ).stdout
    )  # fmt: skip
    real = sum(len(t["ids"]) for t in data["input"]["texts"])
    with opened(browser, page_file) as page:
        rows = page.locator("#s-per_token tbody tr")
        assert rows.count() == real  # one row per real token of the one call
        first = rows.nth(0).locator("td").all_inner_texts()
        assert repr(data["input"]["texts"][0]["tokens"][0]) in first
        header = page.locator("header").inner_text()
        assert "tokens of sequence 1" in header and "padding:" in header
        assert page.locator("#s-predictions tbody tr").count() == 10  # top-5 of 2 sequences
    lens_file = tmp_path / "lens.html"
    lensed = runner.invoke(app, ["lens", f"hf:{folder}", "--text", LINES[0], "-o", str(lens_file)])
    assert lensed.exit_code == 0, lensed.stderr
    with opened(browser, lens_file, js=False) as page:
        assert page.locator("#s-lens_0 tbody tr").count() == 2  # one row per block


# ---------------------------------------------------------------- a notebook's HTML view


def test_a_reports_notebook_view_styles_only_itself(browser: Any, tmp_path: Path) -> None:
    """`Report._repr_html_()` as a notebook shows it: inside a page of its own elements. The
    page's own heading and table look the same with the fragment as without it; the
    fragment's banner and table are shown; it asks for nothing."""
    import torch

    import hookcli
    from tests.support.models import NanForward

    torch.manual_seed(0)
    report = hookcli.inspect(NanForward(), torch.randn(2, 4))
    own = '<h1 id="own">notebook</h1><table id="own-t"><tr><td id="own-td">cell</td></tr></table>'
    props = ["font-family", "font-size", "color", "padding-left", "border-bottom-width", "margin"]
    seen = {}
    for name, fragment in (("without", ""), ("with", report._repr_html_())):
        path = tmp_path / f"{name}.html"
        path.write_text(f"<!DOCTYPE html><html><body>{own}{fragment}{own}</body></html>")
        with watched(browser, path, js=False) as (page, _):
            seen[name] = page.evaluate(
                """(props) => [...document.querySelectorAll('#own, #own-t, #own-td')].map(
                    e => props.map(p => getComputedStyle(e).getPropertyValue(p)))""",
                props,
            )
            if fragment:
                banner = page.locator(".hookcli-nb .hk-banner")
                assert banner.is_visible() and "NaN/Inf first appeared" in banner.inner_text()
                rows = page.locator(".hookcli-nb tbody tr, .hookcli-nb table tr:has(td)")
                assert rows.count() >= len(report.layers)
                names = page.locator(".hookcli-nb td").all_inner_texts()
                assert {c.name for c in report.layers} <= set(names)
    assert seen["with"] == seen["without"]
