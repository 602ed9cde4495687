"""Layer names in tables fold at their dots (issue 49): at 100-160 columns a long dotted name
(`model.layers.0.self_attn.q_proj`) was cut mid-word (`model.layers.0.self_at` / `tn.q_proj`).
Real reports (a tiny Llama's `inspect` and `layers --meta`, resnet18's `inspect` and `grads`)
are drawn at each width; the name column's pieces, read back line by line, must rebuild every
name in order, whole, each break right after a `.`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import hookcli
from hookcli.commands.listing import layers_report
from hookcli.options import ModelOptions
from hookcli.render.table import Grid, fold_name, layers_table
from tests.support.paths import CAT
from tests.support.render import grid_text

pytest.importorskip("transformers")

WIDTHS = [100, 120, 140, 160]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.llm import save

    return save(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="module")
def drawn(llama: Path) -> dict[str, tuple[list[list[str]], Any]]:
    """Each report's names in the order of its tables' rows (a list for each table whose
    first column is `layer`), and a function drawing it at a width."""
    from hookcli.render.rows import param_rows

    text = hookcli.inspect(f"hf:{llama}", text=["The cat sat on the mat."], topk=0)
    listing = layers_report(ModelOptions(f"hf:{llama}", meta=True))
    resnet = hookcli.inspect("resnet18", [str(CAT)], layers=["layer3.*", "layer4.*"], topk=0)
    grads = hookcli.grads("resnet18", [str(CAT)], layers=["layer4.*"], topk=0)
    return {
        "llm inspect": ([[c.name for c in text.layers]], text.table),
        "llm layers --meta": (
            [[m.name for m in listing.modules]],
            lambda width: layers_table(listing, color=False, width=width),
        ),
        "resnet inspect": ([[c.name for c in resnet.layers]], resnet.table),
        "resnet grads": (  # the calls, then the parameters' gradients
            [[c.name for c in grads.layers], [r[0] for r in param_rows(grads)]],
            grads.table,
        ),
    }


def _name_pieces(text: str) -> Iterator[list[str]]:
    """Each table whose first column is `layer`: its name column's text, line by line (the
    column's width read from the rule under the headers), blank lines left out."""
    lines = text.splitlines()
    for k, rule in enumerate(lines):
        if k == 0 or not (set(rule) <= {"-", "+"} and "-+-" in rule):
            continue
        width = rule.index("-+-")
        if lines[k - 1][:width].strip() != "layer":
            continue
        pieces = []
        for line in lines[k + 1 :]:
            if " |" not in line:
                break
            pieces.append(line[:width].strip())
        yield [p for p in pieces if p]


def _rebuild(names: list[str], pieces: list[str]) -> int:
    """Every name from the pieces, in order and whole, each break right after a dot; how
    many names took more than one line."""
    rest = iter(pieces)
    broken = 0
    for name in (n for n in names if n):
        got, lines = next(rest, None), 1
        assert got is not None, f"{name!r} is missing"
        while got != name:
            assert got.endswith("."), f"{name!r} broken after {got!r}, not after a dot"
            more = next(rest, None)
            assert more is not None, f"{name!r} ends as {got!r}"
            got, lines = got + more, lines + 1
            assert name.startswith(got), (name, got)
        broken += lines > 1
    assert not list(rest), "pieces left over"
    return broken


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("report", ["llm inspect", "llm layers --meta", "resnet inspect",
                                    "resnet grads"])  # fmt: skip
def test_names_break_only_after_a_dot_and_stay_whole(
    drawn: dict[str, tuple[list[list[str]], Any]], report: str, width: int
) -> None:
    names, draw = drawn[report]
    text = str(draw(width=width))
    assert max(len(line) for line in text.splitlines()) <= width
    tables = list(_name_pieces(text))
    assert len(tables) == len(names), text
    for pieces, table_names in zip(tables, names, strict=True):
        _rebuild(table_names, pieces)


def test_the_widths_tested_do_fold_names(drawn: dict[str, tuple[list[list[str]], Any]]) -> None:
    """Not vacuous: at 100 columns the Llama's names take more than one line, more of them
    than at 160."""
    folded = {}
    for report in ("llm inspect", "llm layers --meta"):
        (names,), draw = drawn[report]
        for width in (100, 160):
            (pieces,) = _name_pieces(str(draw(width=width)))
            folded[report, width] = _rebuild(names, pieces)
    assert folded["llm inspect", 100] > folded["llm inspect", 160]
    assert folded["llm layers --meta", 100] > folded["llm layers --meta", 160]
    assert folded["llm layers --meta", 100] >= 10


def test_fold_name_breaks_at_dots_keeps_the_indent_and_cuts_only_as_a_last_resort() -> None:
    name = "model.layers.10.self_attn.q_proj"
    assert fold_name(name, 40) == name
    assert fold_name(name, 20).split("\n") == ["model.layers.10.", "self_attn.q_proj"]
    assert fold_name("    " + name, 20).split("\n") == [
        "    model.layers.10.", "    self_attn.q_proj"
    ]  # fmt: skip
    # a piece longer than the width, and only it, is cut inside
    assert fold_name("a." + "b" * 20 + ".c", 8).split("\n") == ["a.", "bbbbbbbb", "bbbbbbbb",
                                                               "bbbb.c"]  # fmt: skip
    # wide characters are two cells; a deep indent leaves the name 8 cells at least
    assert fold_name("x.猫猫猫猫猫.y", 6).split("\n") == ["x.", "猫猫猫", "猫猫.y"]
    assert fold_name(" " * 30 + "model.layers.1", 10).split("\n") == ["  model.", "  layers.1"]
    # folding again at the same width changes nothing
    for width in (8, 12, 20):
        once = fold_name("  " + name, width)
        assert fold_name(once, width) == once


@pytest.mark.parametrize("width", WIDTHS)
def test_richs_table_and_the_fast_layout_fold_names_alike(width: int) -> None:
    """A title too wide for the table sends it to Rich's Table; names there fold at the same
    dots as in the fast layout."""
    title = "a title wider than any table here " * 6
    name = "model.language_model.layers.{}.self_attention.rotary_embedding.inverse_frequency"
    name += ".cached_table.of_every_position.in_float32"
    grids = []
    for _ in range(2):
        g = Grid(title, ["layer", "type", "mean", "std", "min", "max", "output"], False)
        for i in range(3):
            g.add_row(
                name.format(i),
                "LlamaRotaryEmbedding", "0.5", "1", "-1", "1", "1x128x64x64x64",
            )  # fmt: skip
        grids.append(g)
    fast = grid_text(grids[0], False, width, rich_only=False)
    slow = grid_text(grids[1], False, width, rich_only=True)
    assert fast == slow, f"\n{fast}\n---\n{slow}"
    pieces = [p for t in _name_pieces(fast) for p in t]
    assert _rebuild([name.format(i) for i in range(3)], pieces) == 3
