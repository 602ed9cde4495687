"""Golden outputs: the table and JSON of a tiny deterministic model, at a fixed width with no
colour. Rewrite after an intended change with:
HOOKCLI_UPDATE_GOLDEN=1 pytest tests/render/test_golden.py

Structure is compared exactly, numbers within a stated tolerance: reductions round differently
on another CPU (another SIMD width, another BLAS), so the 8th digit of a float64 statistic is
not a property of hookcli. A number matches when it is within one unit of its last printed
digit or within 1e-5 relative (integers — counts, shapes, indices — exactly); everything
between numbers must be identical, except the amount of padding, which a number of another
printed length shifts.
"""

from __future__ import annotations

import json
import os
import re

import pytest
from typer.testing import CliRunner

from hookcli.cli import app
from tests.support.paths import TESTS

pytestmark = pytest.mark.kernels  # the second CI pass reruns these on generic x86-64

GOLDEN = TESTS / "golden"
runner = CliRunner()


_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w.])")
RTOL = 1e-5


def _split(text: str) -> tuple[list[str], list[str]]:
    """The text between numbers (padding collapsed) and the numbers, as printed."""
    numbers = _NUMBER.findall(text)
    skeleton = [re.sub(r"[ \t]+", " ", part) for part in _NUMBER.split(text)]
    return skeleton, numbers


def _last_digit_unit(token: str) -> float:
    """One unit in the last printed place: '0.1235' → 1e-4, '1.5e-07' → 1e-8, '12' → 1."""
    mantissa, _, exponent = token.lower().lstrip("-").partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 10.0 ** (int(exponent or 0) - decimals)


def numbers_match(got: str, want: str) -> bool:
    if want.lstrip("-").isdigit():  # counts, shapes, indices: exact
        return got == want
    g, w = float(got), float(want)
    allowed = max(_last_digit_unit(want), _last_digit_unit(got), RTOL * abs(w))
    return abs(g - w) <= allowed * (1 + 1e-9)  # the slack: 1.6e-07 - 1.5e-07 is not 1e-08


def assert_same(text: str, golden: str) -> None:
    got_skeleton, got_numbers = _split(text)
    want_skeleton, want_numbers = _split(golden)
    assert got_skeleton == want_skeleton, "the output's structure changed"
    for i, (got, want) in enumerate(zip(got_numbers, want_numbers, strict=True)):
        assert numbers_match(got, want), f"number {i}: {got} != {want} (golden)"


def _check(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("HOOKCLI_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing {path}; run with HOOKCLI_UPDATE_GOLDEN=1"
    assert_same(text, path.read_text())


def test_comparison_is_tolerant_of_rounding_only() -> None:
    golden = "| std 0.5352045570794193 | 1.235 | 12 | 1.5e-07 |"
    assert_same("| std 0.5352045125322297 | 1.236 | 12 | 1.5e-07 |", golden)
    assert_same("|  std 0.5352045570794193 | 1.235   | 12 | 1.6e-07 |", golden)
    with pytest.raises(AssertionError):
        assert_same("| std 0.5352 | 1.237 | 12 | 1.5e-07 |", golden)  # two units off
    with pytest.raises(AssertionError):
        assert_same("| std 0.5352045570794193 | 1.235 | 13 | 1.5e-07 |", golden)
    with pytest.raises(AssertionError):
        assert_same("| mean 0.5352045570794193 | 1.235 | 12 | 1.5e-07 |", golden)
    with pytest.raises(AssertionError):
        assert_same("| std 0.5352045570794193 | 1.235 | 12 |", golden)


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
