"""Tables at 80 columns and narrower (issue 9): no line wider than the terminal, no number
split across lines; columns are left out (and named) before that, then rows turn vertical."""

from __future__ import annotations

import io
import json
import re

import pytest
from typer.testing import CliRunner

from hookcli.cli import app
from hookcli.render.fmt import num
from tests.support.paths import CAT
from tests.support.render import grid_text

runner = CliRunner()
NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e[-+]?\d+)?%?(?![\w.])")
ARGS = {
    "inspect": ["inspect", "resnet18", str(CAT), "-l", "layer1.0.*", "--topk", "2"],
    "grads": ["grads", "resnet18", str(CAT), "-l", "layer4.1.*", "--topk", "0"],
}


def _tokens(text: str) -> set[str]:
    return set(NUMBER.findall(text))


@pytest.fixture(scope="module")
def wide() -> dict[str, tuple[str, dict[str, object]]]:
    out = {}
    for name, args in ARGS.items():
        table = runner.invoke(app, args, env={"COLUMNS": "250"})
        data = runner.invoke(app, [*args, "-f", "json"])
        assert table.exit_code == 0 and data.exit_code == 0, table.stderr + data.stderr
        out[name] = (table.stdout, json.loads(data.stdout))
    return out


@pytest.mark.parametrize("width", [80, 60, 40])
@pytest.mark.parametrize("command", list(ARGS))
def test_narrow_tables_fit_and_keep_numbers_whole(
    wide: dict[str, tuple[str, dict[str, object]]], command: str, width: int
) -> None:
    r = runner.invoke(app, ARGS[command], env={"COLUMNS": str(width)})
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert max(len(line) for line in lines) <= width
    wide_text, data = wide[command]
    fragments = _tokens(r.stdout) - _tokens(wide_text) - {str(width)}
    assert not fragments, f"numbers split or changed at {width} columns: {sorted(fragments)[:5]}"
    # the main statistic of every call is on screen, whole: inspect's mean, grads' gradient norm
    tokens = _tokens(r.stdout)
    kind, stat = ("outputs", "mean") if command == "inspect" else ("grad_outputs", "norm")
    for call in data["layers"]:  # type: ignore[attr-defined]
        for t in call[kind]:
            assert num(t[stat]) in tokens, (call["name"], t[stat])


def test_80_columns_keeps_a_table_and_says_what_it_left_out() -> None:
    r = runner.invoke(app, ARGS["inspect"], env={"COLUMNS": "80"})
    assert "| mean" in r.stdout or "mean |" in r.stdout  # still a table
    assert "columns left out at 80 characters: input, type, min" in r.stdout.replace("\n", " ")


def test_very_narrow_terminals_get_a_vertical_layout() -> None:
    r = runner.invoke(app, ARGS["inspect"], env={"COLUMNS": "40"})
    assert "layer1.0.conv1\n" in r.stdout
    assert re.search(r"^  .*mean -?\d", r.stdout, re.MULTILINE)


@pytest.mark.parametrize("width", [80, 40])
def test_profile_table_fits(width: int) -> None:
    args = ["inspect", "resnet18", "-l", "layer4", "-l", "layer4.1.*", "--topk", "0", "--profile"]
    r = runner.invoke(app, args, env={"COLUMNS": str(width)})
    assert r.exit_code == 0, r.stderr
    assert max(len(line) for line in r.stdout.splitlines()) <= width
    section = r.stdout[r.stdout.index("profile (total") : r.stdout.index("profile: the selected")]
    cells = re.findall(r"(?<![\w.])\d+(?:\.\d+)?%?(?![\w.])", section)
    # ms with 3 decimals, MB with 2, shares with 1 and %: a split number breaks the pattern
    whole = re.compile(r"\d+\.\d{3}|\d+\.\d{2}|\d+\.\d%|\d")
    assert cells and all(whole.fullmatch(c) for c in cells if c != str(width)), cells
    assert "self" in section


WORDS = [
    "conv1",
    "x y",
    " lead",
    "layer4.1.conv2",
    "8x64x56x56",
    "0.0002255",
    "-1.587",
    "—",
    "猫",
    "",
]


@pytest.mark.parametrize("seed", range(60))
def test_the_fast_layout_draws_what_richs_table_draws(seed: int) -> None:
    """Grid lays its lines out itself where no cell folds: the oracle is Rich's Table drawing
    the same grid (widths, justification, wrapped headers, multi-line cells, titles, flagged
    rows, wide characters), in colour and without."""
    import random

    from hookcli.render.rows import RIGHT
    from hookcli.render.table import Grid

    rng = random.Random(seed)
    right = sorted(RIGHT)
    headers = ["layer", *rng.sample([*right, "type", "input", "output"], rng.randint(1, 6))]
    title = rng.choice([None, "parameters", "a title that may well be wider than the table is"])
    color = rng.random() < 0.5
    width = rng.choice([40, 80, 120, 200])

    def cell() -> str:
        return "\n".join(rng.choice(WORDS) for _ in range(rng.choice([1, 1, 1, 2])))

    grids = []
    for _ in range(2):
        g = Grid(title, headers, color, drop=headers[2:4])
        rng2 = random.Random(seed)
        for _ in range(rng2.randint(0, 6)):
            g.add_row(*(cell() for _ in headers), style=rng.choice([None, "red"]))
        grids.append(g)
    grids[1].rows = list(grids[0].rows)
    fast = grid_text(grids[0], color, width, rich_only=False)
    slow = grid_text(grids[1], color, width, rich_only=True)
    assert fast == slow, f"\n{fast}\n---\n{slow}"


def test_the_fast_layout_is_used_and_gives_way_to_folding() -> None:
    from hookcli.render.table import Grid

    g = Grid(None, ["layer", "mean"], False)
    g.add_row("conv1", "0.5")
    assert g._laid_out(["layer", "mean"], [0, 1], [5, 4], 80, False) is not None
    g.add_row("a." * 60, "1")  # longer than the 80 columns leave: Rich folds it
    assert g._laid_out(["layer", "mean"], [0, 1], [120, 4], 80, False) is None


def test_the_fast_layout_keeps_the_colours() -> None:
    from rich.console import Console

    from hookcli.render.table import Grid

    g = Grid("parameters", ["layer", "type", "mean"], True)
    g.add_row("conv1", "Conv2d", "0.5")
    g.add_row("fc", "Linear", "nan", style="red")
    buf = io.StringIO()
    Console(file=buf, width=80, force_terminal=True, color_system="standard").print(g)
    lines = buf.getvalue().splitlines()
    assert lines[1] == "\x1b[1mlayer   type     mean\x1b[0m"  # the header bold
    assert lines[3] == "conv1   Conv2d    0.5"
    assert lines[4] == "\x1b[31mfc      Linear    nan\x1b[0m"  # a flagged row red
