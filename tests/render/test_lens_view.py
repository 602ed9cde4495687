"""The logit lens where users look at it (issue 49's paper cuts): a notebook view (a grid per
sequence of blocks by positions, the top token and its probability in each cell, shaded by it,
token text escaped), probabilities readable however small they are (the table, Markdown and
HTML; JSON and CSV keep the whole float), and a PNG that draws every sequence with a colour
bar that says what its colour is.

Oracles: transformers' own run of tiny random models saved here (each block's output through
`model.model.norm` and `lm_head`, softmax, top-k), Python's html.parser and csv readers, and the
PNG read back with PIL."""

from __future__ import annotations

import csv
import dataclasses
import html.parser
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import hookcli
from hookcli.cli import app
from hookcli.records import LensCell, LensReport, LensToken

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

runner = CliRunner()
TEXTS = ["The cat sat on the mat.", "hello"]
Oracle = dict[tuple[str, int, int], tuple[list[int], list[float]]]


def run(*args: str) -> Any:
    return runner.invoke(app, list(args))


def _save(folder: Path, vocab: int) -> Path:
    from tests.support.llm import make_tokenizer

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).eval().save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """320 tokens: every top-1 probability near 1/320, all of them 0.00 with two decimals."""
    return _save(tmp_path_factory.mktemp("lens_llama"), 320)


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4096 tokens: every top-1 probability near 1/4096, below 1e-3."""
    return _save(tmp_path_factory.mktemp("lens_wide"), 4096)


def by_hand(folder: Path, texts: list[str], k: int) -> Oracle:
    """(block, sequence, position in its own text) → the top-k ids and probabilities of
    softmax(lm_head(norm(block output))), from transformers' own run."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    enc = tok(texts, return_tensors="pt", padding=len(texts) > 1)
    seen: list[torch.Tensor] = []
    handles = [
        b.register_forward_hook(lambda _m, _i, o: seen.append(o[0] if isinstance(o, tuple) else o))
        for b in model.model.layers
    ]
    with torch.no_grad():
        model(**enc)
        for h in handles:
            h.remove()
        tops = [
            torch.softmax(model.lm_head(model.model.norm(h)).double(), -1).topk(k) for h in seen
        ]
    out: Oracle = {}
    for i, top in enumerate(tops):
        for s in range(len(texts)):
            real = enc.attention_mask[s].nonzero().flatten().tolist()
            for own, p in enumerate(real):
                key = (f"model.layers.{i}", s, own)
                out[key] = (top.indices[s, p].tolist(), top.values[s, p].tolist())
    return out


class Grids(html.parser.HTMLParser):
    """Each <table>'s header cells and rows, a cell as its text pieces (a <br> or a <span>
    starts a piece) with its attributes; and every tag seen."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[dict[str, Any]] = []
        self.tags: list[str] = []
        self.styles: list[str] = []
        self.cell: dict[str, Any] | None = None
        self.in_style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        if tag == "style":
            self.in_style = True
        elif tag == "table":
            self.tables.append({"head": [], "rows": []})
        elif tag == "tr" and self.tables:
            self.tables[-1]["rows"].append([])
        elif tag in ("td", "th") and self.tables:
            self.cell = {"tag": tag, "attrs": dict(attrs), "pieces": [""]}
            self.tables[-1]["rows"][-1].append(self.cell)
        elif tag in ("br", "span") and self.cell is not None:
            self.cell["pieces"].append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "style":
            self.in_style = False
        elif tag in ("td", "th"):
            self.cell = None

    def handle_data(self, data: str) -> None:
        if self.in_style:
            self.styles.append(data)
        elif self.cell is not None:
            self.cell["pieces"][-1] += data


def parse(fragment: str) -> Grids:
    grids = Grids()
    grids.feed(fragment)
    grids.close()
    return grids


def _luminance(rgb: tuple[int, ...]) -> float:
    r, g, b = rgb[:3]
    return 0.299 * r + 0.587 * g + 0.114 * b


def _background(cell: dict[str, Any]) -> tuple[int, int, int]:
    found = re.search(r"background:rgb\((\d+),(\d+),(\d+)\)", cell["attrs"]["style"])
    assert found, cell
    r, g, b = (int(v) for v in found.groups())
    return r, g, b


# ---------------------------------------------------------------- the notebook view


def test_the_notebook_view_is_a_grid_per_sequence_of_top_tokens_and_probabilities(
    llama: Path,
) -> None:
    report = hookcli.lens(f"hf:{llama}", text=TEXTS, device="cpu", topk=3)
    oracle = by_hand(llama, TEXTS, 3)
    tok = transformers.AutoTokenizer.from_pretrained(llama)
    fragment = report._repr_html_()
    grids = parse(fragment)
    assert len(grids.tables) == len(TEXTS)  # one grid per sequence
    assert report.tokens is not None and len(report.tokens) == len(TEXTS)
    for s, (text, table) in enumerate(zip(TEXTS, grids.tables, strict=True)):
        head, *rows = table["rows"]
        ids = tok(text)["input_ids"]
        words = report.tokens[s]
        assert len(words) == len(ids)  # every token of the sequence, no padding
        assert [c["pieces"] for c in head] == [["block"]] + [
            [str(p), repr(w)] for p, w in enumerate(words)
        ]
        assert [r[0]["pieces"][0] for r in rows] == ["layers.0", "layers.1"]
        for block, row in zip(report.blocks, rows, strict=True):
            assert len(row) == 1 + len(ids)
            for p, cell in enumerate(row[1:]):
                want_ids, want_probs = oracle[(block, s, p)]
                got = next(
                    c for c in report.lens if (c.layer, c.sequence, c.position) == (block, s, p)
                )
                assert [t.index for t in got.top] == want_ids
                shown_token, shown_prob = cell["pieces"]
                assert shown_token == repr(got.top[0].token)
                assert shown_prob != "0.00"
                assert float(shown_prob) == pytest.approx(want_probs[0], rel=5e-3)  # 3 digits
                assert cell["attrs"]["style"].startswith("background:rgb(")
                assert len(cell["attrs"]["title"].split(", ")) == 3  # the top-3, on hover
    # a fragment that asks for nothing and styles only itself
    assert "script" not in grids.tags and "img" not in grids.tags and "link" not in grids.tags
    assert not re.search(r"src=|href=|url\(|@import", fragment)
    for rule in re.findall(r"([^{}]+)\{", "".join(grids.styles)):
        for selector in rule.split(","):
            assert selector.strip().startswith(".hookcli-lens"), selector
    # the plain views: a one-line repr, and the CLI's table
    text = repr(report)
    assert "\n" not in text and len(text) <= 2000
    assert text.startswith(f"<LensReport hf:{llama} on cpu: 2 blocks, 2 sequences")
    cli = runner.invoke(app, ["lens", f"hf:{llama}", *_texts()], env={"COLUMNS": "200"})
    assert str(report) == report.table() == cli.stdout
    assert "sequence 1" in str(report) and "0.00 " not in str(report)
    assert isinstance(report, LensReport)
    as_json = run("lens", f"hf:{llama}", *_texts(), "-k", "3", "-f", "json").stdout
    assert json.loads(json.dumps(report.to_dict())) == json.loads(as_json)  # the same record


def _texts() -> list[str]:
    return [a for t in TEXTS for a in ("--text", t)]


def test_token_text_in_the_notebook_view_is_text_not_markup(llama: Path) -> None:
    """Tokens are data: a token that reads `<script>` shows as those characters, in the column
    heads, the cells and their hover text, and the shade follows the probability."""
    report = hookcli.lens(f"hf:{llama}", text=TEXTS[0], device="cpu", topk=2)
    evil = "<script>alert(1)</script>"
    cell_text = '"></td><img src=x onerror=alert(1)>'
    tokens = [[evil, *(report.tokens or [[]])[0][1:]]]
    cells = [
        LensCell(
            c.layer,
            c.sequence,
            c.position,
            [LensToken(c.top[0].index, cell_text, 0.95 if c.position == 0 else 0.05), *c.top[1:]],
        )
        for c in report.lens
    ]
    shown = dataclasses.replace(report, tokens=tokens, lens=cells)
    fragment = shown._repr_html_()
    assert "<script" not in fragment and "<img" not in fragment
    assert "&lt;script&gt;" in fragment
    grids = parse(fragment)
    assert grids.tags.count("table") == 1 and "script" not in grids.tags and "img" not in grids.tags
    head, *rows = grids.tables[0]["rows"]
    # a long token is cut to 16 characters in its cell, whole in its hover text
    assert head[1]["pieces"] == ["0", repr(evil)[:15] + "…"]
    assert head[1]["attrs"]["title"] == f"position 0: {evil!r}"
    for row in rows:
        first, second = row[1], row[2]
        assert first["pieces"] == [repr(cell_text)[:15] + "…", "0.950"]
        assert first["attrs"]["title"].startswith(repr(cell_text) + " 0.950, ")
        assert second["pieces"] == [repr(cell_text)[:15] + "…", "0.0500"]
        # a likelier token is a lighter shade (dark → yellow)
        assert _luminance(_background(first)) > _luminance(_background(second)) + 50
    assert evil in shown.table()  # the terminal's table shows the characters too


# ---------------------------------------------------------------- small probabilities


@pytest.mark.parametrize(
    ("p", "text"),
    [
        (1.0, "1.00"),
        (0.5, "0.500"),
        (0.123456, "0.123"),
        (0.0213, "0.0213"),
        (0.0034567, "0.00346"),
        (0.001, "0.00100"),
        (0.00099949, "9.99e-04"),
        (4.2e-5, "4.20e-05"),
        (0.0, "0"),
        (None, "nan"),
        (float("nan"), "nan"),
    ],
)
def test_a_probability_is_shown_with_three_significant_digits(p: float | None, text: str) -> None:
    from hookcli.render.lens import prob_text

    assert prob_text(p) == text


def _shown_numbers(text: str) -> list[list[str]]:
    """The cells of a table's or Markdown's block rows (layers.N | tok p | …)."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and re.fullmatch(r"layers\.\d+", cells[0]):
            rows.append([c.rsplit(" ", 1)[1] for c in cells[1:]])
    return rows


def test_small_probabilities_are_readable_and_json_and_csv_keep_the_whole_float(
    wide: Path,
) -> None:
    """A model of 4096 tokens, each top-1 probability below 1e-3: the table, Markdown, the
    HTML page and the notebook show each in scientific notation to 3 digits; JSON and CSV
    hold the whole float."""
    oracle = by_hand(wide, [TEXTS[0]], 5)
    assert all(probs[0] < 1e-3 for _, probs in oracle.values())  # the premise
    args = ("lens", f"hf:{wide}", "--text", TEXTS[0])
    as_json = json.loads(run(*args, "-f", "json").stdout)
    by_key = {(c["layer"], c["sequence"], c["position"]): c for c in as_json["lens"]}
    assert set(by_key) == set(oracle)
    for key, (ids, probs) in oracle.items():
        top = by_key[key]["top"]
        assert [t["index"] for t in top] == ids
        assert [t["prob"] for t in top] == pytest.approx(probs, rel=1e-9)  # unrounded
    positions = sorted({k[2] for k in oracle})
    for fmt in ("table", "markdown"):
        out = run(*args, "-f", fmt)
        assert out.exit_code == 0, out.stderr
        shown = _shown_numbers(out.stdout)
        assert len(shown) == 2, (fmt, out.stdout)
        for i, row in enumerate(shown):
            assert len(row) == len(positions)
            for p, number in zip(positions, row, strict=True):
                assert re.fullmatch(r"\d\.\d\de-0\d", number), (fmt, number)
                want = oracle[(f"model.layers.{i}", 0, p)][1][0]
                assert float(number) == pytest.approx(want, rel=6e-3)
    page = run(*args, "-f", "html").stdout
    cells = [c for t in parse(page).tables for r in t["rows"] for c in r if c["tag"] == "td"]
    texts = [c["pieces"][0] for c in cells if " " in c["pieces"][0]]  # 'token' p
    assert len(texts) == len(oracle)
    assert all(re.fullmatch(r"\d\.\d\de-0\d", t.rsplit(" ", 1)[1]) for t in texts), texts
    notebook = hookcli.lens(f"hf:{wide}", text=TEXTS[0], device="cpu")._repr_html_()
    shown_nb = [c["pieces"][1] for r in parse(notebook).tables[0]["rows"][1:] for c in r[1:]]
    assert len(shown_nb) == len(oracle)
    assert all(re.fullmatch(r"\d\.\d\de-0\d", n) for n in shown_nb), shown_nb
    records = list(csv.DictReader(io.StringIO(run(*args, "-f", "csv").stdout)))
    assert len(records) == 5 * len(oracle)
    for record in records:
        key = (record["layer"], int(record["sequence"]), int(record["position"]))
        assert float(record["prob"]) == by_key[key]["top"][int(record["rank"]) - 1]["prob"]


# ---------------------------------------------------------------- the PNG


def _png(path: Path) -> tuple[Any, dict[str, Any]]:
    from PIL import Image

    with Image.open(path) as image:
        image.load()
        return image.convert("RGB"), json.loads(image.text["hookcli"])


def test_the_png_draws_every_sequence_and_a_colour_bar(llama: Path, tmp_path: Path) -> None:
    one, two = tmp_path / "one.png", tmp_path / "two.png"
    drawn_one = run("lens", f"hf:{llama}", "--text", TEXTS[0], "-o", str(one))
    drawn_two = run("lens", f"hf:{llama}", *_texts(), "-o", str(two))
    assert drawn_one.exit_code == 0 and drawn_two.exit_code == 0, drawn_two.stderr
    assert "note:" not in drawn_two.stderr
    image_one, meta_one = _png(one)
    image, meta = _png(two)
    assert len(meta_one["panels"]) == 1 and meta_one["sequences"] == [0]
    assert [p["sequence"] for p in meta["panels"]] == meta["sequences"] == [0, 1]
    assert image.height > image_one.height  # a second panel under the first
    report = json.loads(run("lens", f"hf:{llama}", *_texts(), "-f", "json").stdout)
    assert len(meta["cells"]) == len(report["lens"])  # every cell of every sequence
    panel = {p["sequence"]: p["box"] for p in meta["panels"]}
    assert panel[0][3] <= panel[1][1]  # stacked, not overlapping
    bar = meta["colorbar"]
    assert bar["label"] == "probability of the top-1 token" and bar["range"] == [0.0, 1.0]
    x0, y0, x1, y1 = bar["box"]
    assert y0 >= panel[1][3]  # under the panels
    middle = (y0 + y1) // 2
    ramp = [image.getpixel((x, middle)) for x in range(x0, x1)]
    assert len(set(ramp)) > 100  # a gradient, not a blank
    assert _luminance(ramp[-1]) > _luminance(ramp[0]) + 100  # dark (0) → light (1)
    probs = {
        (c["layer"], c["sequence"], c["position"]): c["top"][0]["prob"] for c in report["lens"]
    }
    for cell in meta["cells"]:
        _, cy0, cx1, cy1 = cell["box"]
        top, bottom = panel[cell["sequence"]][1], panel[cell["sequence"]][3]
        assert top <= cy0 < cy1 <= bottom  # in its own sequence's panel
        fill = image.getpixel((cx1 - 6, cy1 - 5))  # a corner no text reaches
        p = probs[(cell["layer"], cell["sequence"], cell["position"])]
        on_bar = ramp[round(p * (len(ramp) - 1))]  # the bar's colour of that probability
        assert max(abs(a - b) for a, b in zip(fill, on_bar, strict=True)) <= 3, (fill, on_bar)


def test_the_png_draws_at_most_eight_sequences_and_says_so(llama: Path, tmp_path: Path) -> None:
    from hookcli.render.lens import lens_png

    texts = [TEXTS[i % 2] for i in range(10)]
    out = tmp_path / "ten.png"
    drawn = run("lens", f"hf:{llama}", *[a for t in texts for a in ("--text", t)], "-o", str(out))
    assert drawn.exit_code == 0, drawn.stderr
    assert "note: the first 8 of 10 sequences drawn; -f json or csv has all" in drawn.stderr
    _, meta = _png(out)
    assert meta["sequences"] == list(range(8)) and meta["sequence_count"] == 10
    assert meta["notes"] == ["the first 8 of 10 sequences drawn; -f json or csv has all"]
    report = hookcli.lens(f"hf:{llama}", text=texts, device="cpu", topk=1)
    _, chosen = lens_png(report, sequences=[9])  # the Python API draws the ones asked for
    assert chosen["sequences"] == [9] and chosen["notes"] == []
    assert {c["sequence"] for c in chosen["cells"]} == {9}
