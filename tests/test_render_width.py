"""Tables at 80 columns and narrower (issue 9): no line wider than the terminal, no number
split across lines; columns are left out (and named) before that, then rows turn vertical."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from hookcli.cli import app
from hookcli.render.fmt import num
from tests.conftest import CAT

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
