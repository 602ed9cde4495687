"""The HTML report without a browser: the embedded JSON equals `-f json` for every command
that writes one, the static table holds the records' numbers, hostile names stay inert, no
reference leaves the file, pictures are embedded within their budget, and --picture's misuse
is a one-line error. tests/render/test_html_browser.py drives the same pages in Chromium."""

from __future__ import annotations

import base64
import io
import json
import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from typer.testing import CliRunner

from hookcli.cli import app
from hookcli.records import InputInfo, LayerCall, ModelInfo, Report, TensorStats
from hookcli.render import html as report_html
from hookcli.render.fmt import num, pct
from tests.support.cli import assert_one_line_error
from tests.support.paths import CAT

runner = CliRunner()
SMALL = ["resnet18", str(CAT), "-l", "layer1.0.*"]


class Page(HTMLParser):
    """What a page holds: its elements' tags and attributes, the data script's text, and the
    per-call table's rows as cell texts."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.data_text = ""
        self.rows: list[list[str]] = []
        self.row_attrs: list[dict[str, str | None]] = []
        self.headers: list[str] = []
        self._in_data = False
        self._table = 0  # depth inside #calls
        self._cell: list[str] | None = None
        self._th: list[str] | None = None
        self._body = False
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.tags.append((tag, a))
        if tag == "script" and a.get("id") == "hookcli-data":
            self._in_data = True
        if tag == "table" and a.get("id") == "calls":
            self._table = 1
        elif tag == "table" and self._table:
            self._table += 1
        if self._table == 1:
            if tag == "tbody":
                self._body = True
            elif tag == "tr" and self._body:
                self.rows.append([])
                self.row_attrs.append(a)
            elif tag == "td" and self._body:
                self._cell = []
            elif tag == "th":
                self._th = []
            elif tag == "div" and self._cell is not None and self._cell:
                self._cell.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_data = False
        if tag == "table" and self._table:
            self._table -= 1
        if self._table == 1 and tag == "td" and self._cell is not None:
            self.rows[-1].append("".join(self._cell))
            self._cell = None
        if tag == "th" and self._th is not None:
            self.headers.append("".join(self._th))
            self._th = None

    def handle_data(self, data: str) -> None:
        if self._in_data:
            self.data_text += data
        if self._cell is not None:
            self._cell.append(data)
        if self._th is not None:
            self._th.append(data)

    @property
    def data(self) -> Any:
        return json.loads(self.data_text)


def cli(*args: str) -> Any:
    return runner.invoke(app, list(args))


def html_and_json(tmp_path: Path, *args: str) -> tuple[Page, Any, Any]:
    out = tmp_path / "report.html"
    r = cli(*args, "-o", str(out))
    j = cli(*args, "-f", "json")
    assert j.exit_code == r.exit_code, (r.stderr, j.stderr)
    assert f"wrote {out}" in r.stderr
    return Page(out.read_text(encoding="utf-8")), json.loads(j.stdout), r


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (["inspect", *SMALL, "--hist"], "layers"),
        (["grads", *SMALL], "layers"),
        (["check", *SMALL, "--fail-on", "dead"], "layers"),
        (["diff", *SMALL, "--b", "float64"], "calls"),
    ],
    ids=["inspect", "grads", "check", "diff"],
)
def test_embedded_json_is_the_json_report(tmp_path: Path, args: list[str], key: str) -> None:
    page, data, _ = html_and_json(tmp_path, *args)
    assert page.data == data
    extra = len(data.get("outputs", [])) if key == "calls" else 0
    assert len(page.rows) == len(data[key]) + extra  # one row per layer call
    names = [a["data-layer"] for a in page.row_attrs]
    rows = data[key] + (data["outputs"] if key == "calls" else [])
    assert names == [c["name"] for c in rows]


def test_static_table_holds_the_records_numbers(tmp_path: Path) -> None:
    page, data, _ = html_and_json(tmp_path, "inspect", *SMALL)
    std, zeros = page.headers.index("std"), page.headers.index("zeros")
    assert page.headers[:3] == ["layer", "type", "call"]
    for row, call in zip(page.rows, data["layers"], strict=True):
        out = call["outputs"][0]
        assert row[0] == call["name"]
        assert row[std] == num(out["std"])
        assert row[zeros] == pct(out["zeros"])


def test_grads_table_has_the_gradient_columns(tmp_path: Path) -> None:
    page, data, _ = html_and_json(tmp_path, "grads", *SMALL)
    col = page.headers.index("grad_out norm")
    for row, call in zip(page.rows, data["layers"], strict=True):
        grad = next(g for g in call["grad_outputs"] if g["path"] == call["outputs"][0]["path"])
        assert row[col] == num(grad["norm"])


def test_format_from_suffix_and_to_stdout(tmp_path: Path) -> None:
    out = tmp_path / "r.htm"
    assert cli("inspect", *SMALL, "-o", str(out)).exit_code == 0
    assert out.read_text().startswith("<!DOCTYPE html>")
    r = cli("inspect", *SMALL, "-f", "html")
    assert r.exit_code == 0 and r.stdout.startswith("<!DOCTYPE html>")
    assert r.stdout.rstrip().endswith("</html>")


def test_saved_report_renders_the_same_page(tmp_path: Path) -> None:
    saved = tmp_path / "saved.json"
    assert cli("grads", *SMALL, "-o", str(saved)).exit_code == 0
    r = cli("report", str(saved), "-f", "html")
    assert r.exit_code == 0, r.stderr
    assert Page(r.stdout).data == json.loads(saved.read_text())
    fresh = cli("grads", *SMALL, "-f", "html").stdout
    assert Page(fresh).rows == Page(r.stdout).rows


def test_nan_report_marks_the_origin(tmp_path: Path) -> None:
    page, data, r = html_and_json(
        tmp_path, "check", "tests/support/models.py:NanForward", "--input", "randn:16x4"
    )
    assert r.exit_code == 1  # --fail-on nonfinite by default, and the page is written
    origin = data["nonfinite_origins"][0]
    marked = [a for a in page.row_attrs if "origin" in (a.get("class") or "").split()]
    assert [(a["data-layer"], a["data-call"]) for a in marked] == [
        (origin["layer"], str(origin["call"]))
    ]
    links = [a["href"] for t, a in page.tags if t == "a"]
    assert f"#layer={origin['layer']}&call={origin['call']}" in links
    assert any(t == "section" and a.get("id") == "banner" for t, a in page.tags)


def test_diff_marks_the_first_divergence(tmp_path: Path) -> None:
    page, data, r = html_and_json(tmp_path, "diff", *SMALL, "--b", "float16", "--tol", "1e-9")
    assert r.exit_code == 1 and data["first_over"]
    marked = [a["data-layer"] for a in page.row_attrs if "origin" in (a.get("class") or "")]
    assert len(marked) == 1 and data["first_over"].startswith(marked[0] + " (")


def test_run_log_page_embeds_its_series(tmp_path: Path) -> None:
    from tests.support.watchlogs import emulated_ddp

    _, single = emulated_ddp(tmp_path, steps=2)
    r = cli("report", str(single), "-f", "html")
    j = cli("report", str(single), "-f", "json")
    assert r.exit_code == 0 == j.exit_code, r.stderr
    assert Page(r.stdout).data == json.loads(j.stdout)


# ---------------------------------------------------------------- nothing leaves the file


def _report(names: list[str]) -> Report:
    calls = [
        LayerCall(
            name,
            "Linear",
            0,
            inputs=[TensorStats("in[0]", (1, 4), "float32", 4, 0.0, 1.0, -1.0, 1.0, 0.0)],
            outputs=[TensorStats("out", (1, 4), "float32", 4, 0.5, 2.0, -3.0, 3.0, 0.25)],
        )
        for name in names
    ]
    model = ModelInfo("m", "tests/support/models.py:M", "custom", "none", 10)
    return Report(model, InputInfo("randn", [(1, 4)]), "cpu", calls)


def test_hostile_names_stay_text() -> None:
    evil = '</script><script>alert(1)</script><img src=x onerror="alert(2)">\u2028\u202e'
    report = _report([evil, "ok"])
    text = report_html.report_html(report)
    page = Page(text)
    assert page.data == json.loads(json.dumps(report.to_dict()))  # the name unchanged
    assert page.row_attrs[0]["data-layer"] == evil.replace("\u2028", "\\u2028").replace(
        "\u202e", "\\u202e"
    )  # shown escaped, as every text format shows control characters
    assert [t for t, _ in page.tags].count("script") == 2  # the data and the page's script
    assert not any(t == "img" for t, _ in page.tags)
    assert "alert(1)</script>" not in text


def test_no_reference_leaves_the_file(tmp_path: Path) -> None:
    r = cli("inspect", *SMALL, "--picture", "maps:layer1.0.conv1", "-f", "html")
    assert r.exit_code == 0, r.stderr
    page = Page(r.stdout)
    urls = [
        v or ""
        for _, attrs in page.tags
        for k, v in attrs.items()
        if k in ("src", "href", "action", "srcset", "poster", "data")
    ]
    assert urls and all(u.startswith(("data:", "#")) for u in urls), urls
    csp = [a["content"] for t, a in page.tags if a.get("http-equiv") == "Content-Security-Policy"]
    assert csp and "default-src 'none'" in csp[0]


# ---------------------------------------------------------------- pictures and the size budget


def test_pictures_are_embedded(tmp_path: Path) -> None:
    out = tmp_path / "pics.html"
    r = cli("grads", *SMALL, "--picture", "maps:layer1.0.conv1", "--picture", "cam", "-o", str(out))
    assert r.exit_code == 0, r.stderr
    page = Page(out.read_text())
    imgs = [a for t, a in page.tags if t == "img"]
    assert len(imgs) == 2
    for a in imgs:
        head, _, b64 = (a["src"] or "").partition(",")
        image = Image.open(io.BytesIO(base64.b64decode(b64)))
        assert head.startswith(f"data:image/{image.format.lower()};base64")
        assert len(b64) <= report_html.PICTURE_BUDGET
    captions = out.read_text()
    assert "maps: layer layer1.0.conv1, call 0 (16 most active channels)" in captions
    assert "cam: layer layer1.0.conv2" not in captions or "cam: layer" in captions


def test_embed_image_keeps_small_pictures_exact_and_shrinks_large_ones() -> None:
    import numpy as np

    small = Image.fromarray(np.arange(64 * 64 * 3, dtype=np.uint8).reshape(64, 64, 3))
    data, mime, note = report_html.embed_image(small)
    assert mime == "image/png" and note is None
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(data))), np.asarray(small))
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 255, (1000, 1200, 3), np.uint8))
    data, mime, note = report_html.embed_image(noise)
    assert mime == "image/webp" and len(data) <= report_html.PICTURE_BYTES
    assert note is not None and "lossy" in note and "scaled" in note


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--picture", "maps:conv1"], "HTML report"),  # a table: no page to embed it in
        (["--picture", "maps:conv1", "-f", "json"], "this output is json"),
        (["--picture", "heat", "-f", "html"], "not a kind of picture"),
        (["--picture", "maps", "-f", "html"], "maps needs a layer"),
    ],
)
def test_picture_misuse_is_a_one_line_error(args: list[str], needle: str) -> None:
    r = cli("inspect", "resnet18", str(CAT), *args)
    assert_one_line_error(r, 2, needle)


def test_over_budget_is_a_note(tmp_path: Path) -> None:
    big = "x" * (report_html.budget(0) + 1)
    note = report_html.over_budget(big, 0, "2000 layer calls", "select fewer layers (-l)")
    assert note is not None and "1.00 MB, over its 1.00 MB budget (2000 layer calls)" in note
    assert note.endswith("heavy to share: select fewer layers (-l)")
    assert report_html.over_budget("x" * report_html.budget(2), 2, "", "") is None
    what, advice = report_html.report_budget(_report(["a"]), ())
    assert (what, advice) == ("1 layer calls", "select fewer layers (-l, --depth)")


@pytest.mark.slow
def test_resnet50_grads_with_hist_fits_one_megabyte(tmp_path: Path) -> None:
    out = tmp_path / "r50.html"
    r = cli("grads", "resnet50", str(CAT), "--hist", "-o", str(out))
    assert r.exit_code == 0 and "note:" not in r.stderr, r.stderr
    size = out.stat().st_size
    print(f"resnet50 grads --hist: {size / 1e6:.2f} MB")
    assert size <= 1_000_000
    assert len(Page(out.read_text()).rows) == len(
        json.loads(Page(out.read_text()).data_text)["layers"]
    )


@pytest.mark.slow
def test_sixteen_pictures_fit_four_megabytes(tmp_path: Path) -> None:
    layers = [
        "conv1", "layer1.0.conv1", "layer1.0.conv2", "layer1.1.conv1", "layer1.1.conv2",
        "layer2.0.conv1", "layer2.0.conv2", "layer2.1.conv1", "layer2.1.conv2", "layer3.0.conv1",
        "layer3.0.conv2", "layer4.0.conv1",
    ]  # fmt: skip
    pics = [f"maps:{x}" for x in layers] + ["cam", "cam:layer3", "cam:layer2", "cam:layer4.0"]
    out = tmp_path / "pics.html"
    args = [a for p in pics for a in ("--picture", p)]
    r = cli("grads", "resnet18", str(CAT), "--hist", *args, "-o", str(out))
    assert r.exit_code == 0 and "note: the HTML report" not in r.stderr, r.stderr
    size = out.stat().st_size
    print(f"resnet18 grads --hist with 16 pictures: {size / 1e6:.2f} MB")
    assert len(re.findall(r"<img ", out.read_text())) == 16
    assert size <= 4_000_000


def test_folder_run_page(tmp_path: Path) -> None:
    folder = tmp_path / "images"
    folder.mkdir()
    for name in ("a.jpeg", "b.jpeg", "c.jpeg"):
        (folder / name).write_bytes(CAT.read_bytes())
    args = ["inspect", "resnet18", str(folder), "-l", "layer4.*", "--batch-size", "2"]
    page, data, r = html_and_json(tmp_path, *args, "--per-image", "1", "--hist")
    assert r.exit_code == 0, r.stderr
    assert page.data == data and len(page.rows) == len(data["layers"])
    assert data["input"]["description"].startswith("3 images")
    text = (tmp_path / "report.html").read_text()
    for name in ("a.jpeg", "b.jpeg", "c.jpeg"):  # the per-image predictions, static
        assert f"<td>{name}</td>" in text


def test_api_writes_the_page_the_cli_writes(tmp_path: Path) -> None:
    import hookcli

    report = hookcli.inspect("resnet18", [str(CAT)], layers=["layer1.0.*"])
    page = Page(hookcli.html(report))
    cli_page = Page(cli("inspect", *SMALL, "-f", "html").stdout)
    assert page.rows == cli_page.rows and page.data == cli_page.data
    d = hookcli.diff("resnet18", [str(CAT)], layers=["layer1.0.*"], b="float64")
    assert Page(hookcli.html(d)).data == json.loads(json.dumps(d.to_dict()))


def test_the_api_renders_every_format_as_the_cli_writes_it() -> None:
    """hookcli.formatted is the CLI's one door: each format of a report is the text the CLI
    prints for it (the table at the width asked, without colour)."""
    import hookcli

    report = hookcli.inspect("resnet18", [str(CAT)], layers=["layer1.0.*"])
    for fmt in ("json", "csv", "markdown"):
        assert hookcli.formatted(report, fmt) == cli("inspect", *SMALL, "-f", fmt).stdout, fmt
    table = hookcli.formatted(report, width=200)
    assert "layer1.0.conv1" in table and "\x1b[" not in table
    with pytest.raises(ValueError, match="'pdf' is not a valid Format"):
        hookcli.formatted(report, "pdf")


def test_the_apis_html_embeds_pictures_as_the_cli_does() -> None:
    """hookcli.html(report, pictures=[...]) embeds what hookcli.cam/maps return, as
    `-f html --picture` does: each an <img> of the drawing's own pixels, with its title."""
    import numpy as np

    import hookcli

    report = hookcli.inspect("resnet18", [str(CAT)], layers=["layer4.*"])
    cam = hookcli.cam("resnet18", [str(CAT)], layer="layer4")
    maps = hookcli.maps("resnet18", [str(CAT)], layer="layer1.0.conv1", channels=4)
    page = Page(hookcli.html(report, pictures=[cam, maps]))
    images = [a for tag, a in page.tags if tag == "img"]
    assert len(images) == 2
    for drawing, img in zip((cam, maps), images, strict=True):
        src = str(img["src"])
        mime, _, b64 = src.removeprefix("data:").partition(";base64,")
        decoded = Image.open(io.BytesIO(base64.b64decode(b64)))
        embedded = drawing.embedded()
        assert mime == embedded.mime and base64.b64decode(b64) == embedded.data
        if mime == "image/png":  # lossless within its budget: the drawing's own pixels
            assert decoded.size == drawing.image.size
            pixels = np.asarray(decoded.convert("RGB"))
            assert np.array_equal(pixels, np.asarray(drawing.image.convert("RGB")))
        else:  # larger: WebP, and the picture's notes say so
            assert mime == "image/webp" and embedded.notes
    assert page.data == json.loads(json.dumps(report.to_dict()))


def test_undecodable_file_names_and_folder_pictures(tmp_path: Path) -> None:
    """A file name that is not UTF-8 (a lone surrogate in Python) is data like any other;
    a folder run's pictures are of its first image, said in the caption."""
    import os

    folder = tmp_path / "imgs"
    folder.mkdir()
    (folder / "a.jpeg").write_bytes(CAT.read_bytes())
    (Path(os.fsdecode(bytes(folder) + b"/caf\xe9.jpeg"))).write_bytes(CAT.read_bytes())
    out = tmp_path / "f.html"
    args = ["inspect", "resnet18", str(folder), "-l", "fc", "--per-image", "1"]
    r = cli(*args, "--picture", "maps:layer1.0.conv1", "-o", str(out))
    assert r.exit_code == 0, r.stderr
    text = out.read_text(encoding="utf-8")
    assert text.isascii() or "caf\\udce9.jpeg" in text  # the name, escaped
    page = Page(text)
    assert page.data == json.loads(cli(*args, "-f", "json").stdout)
    assert "drawn on the first image it could use, a.jpeg" in text


def test_picture_errors_point_somewhere_useful(tmp_path: Path) -> None:
    model = tmp_path / "dictnet.py"
    model.write_text(
        "import torch\nfrom torch import nn\n\n"
        "class DictNet(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n"
        "        self.conv = nn.Conv2d(3, 3, 1)\n\n"
        "    def forward(self, x):\n        return {'a': self.conv(x), 'b': self.conv(x) * 2}\n"
    )
    r = cli("inspect", f"{model}:DictNet", "--input", "randn:1x3x8x8", "--picture", "cam",
            "-f", "html")  # fmt: skip
    # not class scores, and inspect has no --target to follow the usual hint with
    assert_one_line_error(r, 2, "--picture cam", "grads or check")
    from tests.support.watchlogs import step_dict as _step
    from tests.support.watchlogs import write_log as _log

    log = _log(tmp_path, [_step(0)])
    assert_one_line_error(cli("check", str(log), "--picture", "cam"), 2, "--picture")
