"""Golden outputs: the table and JSON of a tiny deterministic model, at a fixed width with no
colour. Rewrite after an intended change with: HOOKCLI_UPDATE_GOLDEN=1 pytest tests/test_golden.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hookcli.cli import app

GOLDEN = Path(__file__).parent / "golden"
runner = CliRunner()


def _check(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("HOOKCLI_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing {path}; run with HOOKCLI_UPDATE_GOLDEN=1"
    assert text == path.read_text()


@pytest.mark.parametrize(
    ("fmt", "name"), [("table", "net_table.txt"), ("markdown", "net.md"), ("csv", "net.csv")]
)
def test_golden_text_formats(fmt: str, name: str) -> None:
    r = runner.invoke(
        app,
        ["inspect", "examples/tiny/net.py:Net", "--input", "ones:2x2", "-f", fmt],
        env={"COLUMNS": "120"},
    )
    assert r.exit_code == 0, r.stderr
    _check(name, r.stdout)


def test_golden_json() -> None:
    r = runner.invoke(
        app, ["inspect", "examples/tiny/net.py:Net", "--input", "ones:2x2", "-f", "json"]
    )
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    data.pop("hookcli_version")
    _check("net.json", json.dumps(data, indent=1, sort_keys=True) + "\n")


def test_golden_grads_table() -> None:
    r = runner.invoke(
        app,
        [
            "grads",
            "examples/tiny/net.py:Net",
            "--input",
            "ones:2x2",
            "--loss",
            "mse:zeros",
            "--no-config",
        ],
        env={"COLUMNS": "160"},
    )
    assert r.exit_code == 0, r.stderr
    _check("net_grads.txt", r.stdout)
