"""The command line in-process (Typer's CliRunner), and what a one-line error must look like."""

from __future__ import annotations

from typing import Any

from typer.testing import CliRunner

from hookcli.cli import app

runner = CliRunner()


def run(*args: str) -> Any:
    return runner.invoke(app, list(args))


def assert_one_line_error(result: object, code: int, *needles: str) -> None:
    """Exit `code`, nothing on stdout, and one `error: … Hint: …` line holding each needle."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)  # type: ignore[attr-defined]
    err = result.stderr.strip()  # type: ignore[attr-defined]
    assert result.stdout == "", result.stdout  # type: ignore[attr-defined]
    lines = [ln for ln in err.splitlines() if not ln.startswith("Downloading:")]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "Hint: " in lines[0], err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def one_line_error(result: Any, code: int, *needles: str) -> str:
    """Exit `code` and one `error: …` line on stderr holding each needle: that line."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return str(lines[0])
