"""The bad-input round of issue 13: saved reports, numeric bounds, user text on a terminal,
non-finite model outputs, out-of-range integers, diff sides and the diff spill file.

Every case is an exit code and one line naming the problem and a next step; none of them may
reach "internal error"."""

from __future__ import annotations

import copy
import csv
import errno
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from hookcli import bounds
from hookcli.cli import app
from hookcli.errors import UsageError
from hookcli.io import reportfile
from hookcli.text import csv_cell, escape, markdown
from tests.support.cli import assert_one_line_error
from tests.support.paths import CAT, ROOT

runner = CliRunner()
HEALTHY = "tests/support/models.py:Healthy"
TINY = ["-i", "randn:4x4"]
SAMPLES = str(ROOT / "sample_images")


def run(*args: str) -> Any:
    return runner.invoke(app, list(args))


@pytest.fixture(scope="module")
def good_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A real inspect report of the Healthy model (its JSON)."""
    path = tmp_path_factory.mktemp("good") / "healthy.json"
    r = run("inspect", HEALTHY, *TINY, "-f", "json", "-o", str(path))
    assert r.exit_code == 0, r.stderr
    return json.loads(path.read_text())  # type: ignore[no-any-return]


# ---------------------------------------------------------------- 1. one validated loader


def _drop_model(d: dict[str, Any]) -> None:
    del d["model"]


def _empty_layers(d: dict[str, Any]) -> None:
    d["layers"] = []


def _entries_without_keys(d: dict[str, Any]) -> None:
    d["layers"] = [{} for _ in d["layers"]]


def _layer_without_name(d: dict[str, Any]) -> None:
    del d["layers"][0]["name"]


def _null_outputs(d: dict[str, Any]) -> None:
    d["layers"][0]["outputs"] = None


def _string_number(d: dict[str, Any]) -> None:
    d["layers"][0]["outputs"][0]["mean"] = "0.5"


def _no_tensors(d: dict[str, Any]) -> None:
    for c in d["layers"]:
        c["inputs"], c["outputs"] = [], []


def _string_call(d: dict[str, Any]) -> None:
    d["layers"][1]["call"] = "0"


def _huge_int(d: dict[str, Any]) -> None:
    d["layers"][0]["outputs"][0]["norm"] = 10**400


def _infinite_number(d: dict[str, Any]) -> None:
    d["layers"][0]["outputs"][0]["std"] = float("inf")  # written out as 1e999 below


def _negative_call(d: dict[str, Any]) -> None:
    d["layers"][0]["call"] = -1


def _negative_size(d: dict[str, Any]) -> None:
    d["layers"][0]["outputs"][0]["shape"] = [4, -4]


def _negative_input_size(d: dict[str, Any]) -> None:
    d["input"]["shapes"] = [[4, -4]]


def _negative_params(d: dict[str, Any]) -> None:
    d["model"]["params"] = -3


def _no_outputs(d: dict[str, Any]) -> None:
    del d["layers"][0]["outputs"]


def _string_count(d: dict[str, Any]) -> None:
    d["layers"][0]["outputs"][0]["nan"] = "0"


@pytest.mark.parametrize(
    ("mutate", "what"),
    [
        (_drop_model, "the report has no 'model'"),
        (_empty_layers, '"layers" is empty'),
        (_entries_without_keys, "layers[0] has no 'name'"),
        (_layer_without_name, "layers[0] has no 'name'"),
        (_null_outputs, "layers[0].outputs is null, not a list"),
        (_string_number, "layers[0].outputs[0].mean is a string, not a number"),
        (_no_tensors, "no layer call records a tensor"),
        (_string_call, "layers[1].call is a string, not a count"),
        (_huge_int, "layers[0].outputs[0].norm is beyond the range of a float"),
        (_infinite_number, "layers[0].outputs[0].std is infinite, not a finite number or null"),
        (_negative_call, "layers[0].call is -1, not a count"),
        (_negative_size, "layers[0].outputs[0].shape is not a list of sizes"),
        (_negative_input_size, "input.shapes[0] is not a list of sizes"),
        (_negative_params, "model.params is -3, not a count"),
        (_no_outputs, "layers[0] has no 'outputs'"),
        (_string_count, "layers[0].outputs[0].nan is a string, not a count"),
    ],
)
def test_a_malformed_report_is_refused_by_check_and_diff(
    mutate: Any, what: str, good_report: dict[str, Any], tmp_path: Path
) -> None:
    """check --baseline and diff a.json b.json read reports through one loader: an empty or
    keyless baseline is no longer a gate that passes "0 tensors", and broken fields are no
    longer internal errors."""
    bad = copy.deepcopy(good_report)
    mutate(bad)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad).replace("Infinity", "1e999"))  # JSON's own infinity
    good = tmp_path / "good.json"
    good.write_text(json.dumps(good_report))
    r = run("check", HEALTHY, *TINY, "--baseline", str(path))
    assert_one_line_error(r, 2, f"baseline {path} is not a hookcli JSON report: {what}")
    assert "internal error" not in r.stderr
    r = run("diff", str(good), str(path))
    assert_one_line_error(r, 2, f"{path} is not a hookcli JSON report: {what}", "Hint: give two")
    r = run("diff", str(path), str(good))
    assert_one_line_error(r, 2, f"{path} is not a hookcli JSON report: {what}")


@pytest.mark.parametrize(
    ("content", "what"),
    [
        ('{"schema": 1, "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests too deeply"),
        ("[" * 100_000, "does not start with '{'"),
        ('{"schema": NaN}', "NaN is not a number in a report"),
        ("", "it is empty"),
        ("   \n ", "it is empty"),
        ("{not json", "not readable JSON"),
        ('{"schema": "1"}', "its schema is a string"),
        ('{"calls": [], "schema": 1}', "it is a diff report"),
    ],
)
def test_unreadable_json_is_refused(content: str, what: str, tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text(content)
    assert_one_line_error(
        run("check", HEALTHY, *TINY, "--baseline", str(path)), 2, "not a hookcli JSON report", what
    )
    assert_one_line_error(run("diff", str(path), str(path)), 2, what)


def test_non_utf8_report_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_bytes(b'{"schema": 1, "model": "\xff\xfe"}')
    assert_one_line_error(run("diff", str(path), str(path)), 2, "not UTF-8 text (byte 24)")


def test_a_huge_baseline_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """A 2 GB file (sparse: it costs no disk) is refused by its size, naming the bound,
    without reading it; a small one that does not start with `{` by its first bytes."""
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:
        f.write(b"garbage")
        f.truncate(2 * 2**30)
    r = run("check", HEALTHY, *TINY, "--baseline", str(huge))
    assert_one_line_error(r, 2, "it is 2048 MB", f"up to {reportfile.MAX_BYTES // 2**20} MB")
    r = run("diff", str(huge), str(huge))
    assert_one_line_error(r, 2, "it is 2048 MB")


def test_the_first_bytes_decide_before_parsing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not JSON: refused from its first bytes, the parser never runs."""
    path = tmp_path / "notjson.json"
    path.write_bytes(b"\n  PK\x03\x04" + b"x" * 100_000)

    def no_parse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("parsed")

    monkeypatch.setattr(reportfile.json, "loads", no_parse)
    with pytest.raises(UsageError, match="does not start with"):
        reportfile.load_report(path, "baseline", "record one")


def test_a_valid_report_still_loads_and_compares(
    good_report: dict[str, Any], tmp_path: Path
) -> None:
    path = tmp_path / "base.json"
    path.write_text(json.dumps(good_report))
    r = run("check", HEALTHY, *TINY, "--baseline", str(path))
    assert r.exit_code == 0, r.stderr
    assert "PASS baseline: 6 tensors" in r.stdout
    r = run("check", HEALTHY, *TINY, "--baseline", str(path), "--seed", "1")
    assert r.exit_code == 1 and "FAIL baseline" in r.stdout
    r = run("diff", str(path), str(path))
    assert r.exit_code == 0, r.stderr


def test_what_older_reports_leave_out_still_reads(
    good_report: dict[str, Any], tmp_path: Path
) -> None:
    """A report without `device` and with null NaN/Inf counts (both allowed before the typed
    reader) still reads, compares and renders; the counts read as 0."""
    old = copy.deepcopy(good_report)
    del old["device"]
    for c in old["layers"]:
        for t in c["outputs"]:
            t["nan"] = t["inf"] = None
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    report = reportfile.load_report(path, "baseline", "record one")
    assert report.device == "unknown"
    assert all(t.nan == 0 == t.inf for c in report.layers for t in c.outputs)
    r = run("check", HEALTHY, *TINY, "--baseline", str(path))
    assert r.exit_code == 0, r.stderr
    assert "PASS baseline: 6 tensors" in r.stdout
    r = run("diff", str(path), str(path))
    assert r.exit_code == 0, r.stderr


# ---------------------------------------------------------------- 2. one bound parser


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["diff", HEALTHY, *TINY, "--b", "seed=1", "--tol", "nan"], ["--tol cannot be NaN"]),
        (["diff", HEALTHY, *TINY, "--b", "seed=1", "--tol", "inf"], ["--tol must be finite"]),
        (["diff", HEALTHY, *TINY, "--b", "seed=1", "--tol", "-1"], ["--tol must be 0 or more"]),
        (["check", HEALTHY, *TINY, "--max-abs", "nan"], ["--max-abs cannot be NaN"]),
        (["check", HEALTHY, *TINY, "--max-abs", "inf"], ["--max-abs must be finite"]),
        (["check", HEALTHY, *TINY, "--dead-frac", "nan"], ["--dead-frac cannot be NaN"]),
        (["check", HEALTHY, *TINY, "--grad-norm", "nan:1e9"], ["--grad-norm MIN cannot be NaN"]),
        (["check", HEALTHY, *TINY, "--grad-norm", "1e-8:nan"], ["--grad-norm MAX cannot be NaN"]),
        (["check", HEALTHY, *TINY, "--grad-norm", "-1:5"], ["--grad-norm MIN must be 0 or more"]),
        (["check", HEALTHY, *TINY, "--grad-norm", "inf:"], ["--grad-norm MIN must be finite"]),
        (["inspect", HEALTHY, *TINY, "--ablate", "fc1=scale:nan"], ["scale cannot be NaN"]),
        (["inspect", HEALTHY, *TINY, "--ablate", "fc1=scale:inf"], ["scale must be finite"]),
        (["inspect", HEALTHY, *TINY, "--ablate", "fc1=noise:nan"], ["noise std cannot be NaN"]),
        (["inspect", HEALTHY, *TINY, "--ablate", "fc1=clamp:nan:1"], ["clamp cannot be NaN"]),
        (["inspect", HEALTHY, *TINY, "--ablate", "fc1=clamp:0:nan"], ["clamp cannot be NaN"]),
    ],
)
def test_nan_and_meaningless_bounds_are_refused(args: list[str], needles: list[str]) -> None:
    assert_one_line_error(run(*args), 2, *needles)


@pytest.mark.parametrize("option", ["--rtol", "--atol"])
@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_baseline_tolerances_are_finite_and_not_negative(
    option: str, value: str, good_report: dict[str, Any], tmp_path: Path
) -> None:
    path = tmp_path / "base.json"
    path.write_text(json.dumps(good_report))
    r = run("check", HEALTHY, *TINY, "--baseline", str(path), option, value)
    assert_one_line_error(r, 2, option)


def test_tol_of_saved_reports_is_checked_too(good_report: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_text(json.dumps(good_report))
    assert_one_line_error(run("diff", str(path), str(path), "--tol", "nan"), 2, "--tol")


def test_a_one_sided_clamp_and_gradient_bound_still_work() -> None:
    """Infinity where it means something: clamp:-inf:0 and --grad-norm 0:inf are accepted."""
    r = run("inspect", HEALTHY, *TINY, "--ablate", "fc1=clamp:-inf:0")
    assert r.exit_code == 0, r.stderr
    assert "ablation: fc1=clamp:-inf:0" in r.stdout
    r = run("check", HEALTHY, *TINY, "--grad-norm", "0:inf", "--target", "sum")
    assert r.exit_code == 0, r.stderr


def test_bound_parser_units() -> None:
    assert bounds.number("1e-3", "--x", low=0, example="1") == 1e-3
    assert bounds.number(float("-inf"), "--x", infinite=True, example="1") == float("-inf")
    for bad in ("nan", float("nan"), "NaN", "-nan"):
        with pytest.raises(UsageError, match="cannot be NaN"):
            bounds.number(bad, "--x", example="1")
    with pytest.raises(UsageError, match=r"--x must be in \(0, 1\], got 0"):
        bounds.number(0, "--x", low=0, high=1, low_open=True, example="1")
    with pytest.raises(UsageError, match="must be a number"):
        bounds.number("abc", "--x", example="1")
    assert bounds.integer(bounds.SEED_MAX, "--seed", low=0, high=bounds.SEED_MAX, example="0")
    import numpy as np  # the Python API may pass numpy scalars

    assert bounds.integer(np.int64(3), "--topk", low=0, high=9, example="1") == 3
    assert bounds.number(np.float32(0.5), "--x", example="1") == 0.5
    with pytest.raises(UsageError, match=r"must be an integer, got 1\.5"):
        bounds.integer(1.5, "--topk", low=0, high=9, example="1")
    with pytest.raises(UsageError, match="a 101-digit number"):
        bounds.integer(10**100, "--seed", low=0, high=bounds.SEED_MAX, example="0")


# ---------------------------------------------------------------- 3. one escaping function

EVIL_MODEL = '''
import torch
from torch import nn


class Evil(nn.Module):
    """Layer names a user (or a checkpoint) can make: escapes, newlines, markup, formulas."""

    def __init__(self) -> None:
        super().__init__()
        self.add_module("\\x1b[31mred\\x1b[0m", nn.Linear(4, 4))
        self.add_module("two\\nlines", nn.Tanh())
        self.add_module("[bold]x[/bold]", nn.Identity())
        self.add_module("=cmd|' /C calc'!A0", nn.Linear(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.children():
            x = m(x)
        return x


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).mean(dim=(2, 3))


class InfOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + float("inf")
'''
RED = "\x1b[31mred\x1b[0m"
FORMULA = "=cmd|' /C calc'!A0"


@pytest.fixture
def evil(tmp_path: Path) -> str:
    (tmp_path / "evil.py").write_text(EVIL_MODEL)
    return str(tmp_path / "evil.py")


def _no_raw_controls(text: str) -> None:
    assert "\x1b" not in text and "\x07" not in text, repr(text[:400])


def test_layer_names_are_escaped_in_tables(evil: str) -> None:
    r = run("inspect", f"{evil}:Evil", "-i", "randn:2x4")
    assert r.exit_code == 0, r.stderr
    out = r.stdout
    _no_raw_controls(out)
    assert "\\x1b[31mred\\x1b[0m" in out
    assert "two\\nlines" in out and not any(ln.startswith("lines") for ln in out.splitlines())
    assert "[bold]x[/bold]" in out, "markup in a name is printed literally"
    r = run("grads", f"{evil}:Evil", "-i", "randn:2x4", "--target", "sum")
    assert r.exit_code == 0, r.stderr
    _no_raw_controls(r.stdout)
    assert "[bold]x[/bold]" in r.stdout and "two\\nlines" in r.stdout


def test_layer_names_in_markdown_csv_and_json(evil: str) -> None:
    base = ["inspect", f"{evil}:Evil", "-i", "randn:2x4"]
    md = run(*base, "-f", "markdown")
    assert md.exit_code == 0, md.stderr
    _no_raw_controls(md.stdout)
    assert "=cmd\\|' /C calc'!A0" in md.stdout and "two\\nlines" in md.stdout
    table_rows = [ln for ln in md.stdout.splitlines() if ln.startswith("|")]
    assert all(ln.endswith("|") for ln in table_rows), "no row split by a newline or a pipe"

    r = run(*base, "-f", "csv")
    assert r.exit_code == 0, r.stderr
    _no_raw_controls(r.stdout)
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    layers = {row["layer"] for row in rows}
    assert "'" + FORMULA in layers and FORMULA not in layers, "a formula is neutralised"
    assert "two\\nlines" in layers
    means = [row["mean"] for row in rows if row["mean"].startswith("-")]
    assert means and all(float(m) < 0 for m in means), "negative numbers stay numbers"

    r = run(*base, "-f", "json")
    names = {c["name"] for c in json.loads(r.stdout)["layers"]}
    assert RED in names and "two\nlines" in names, "JSON stays raw: it is data"


def test_saved_report_diff_escapes_names(evil: str, tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path, seed in ((a, "0"), (b, "1")):
        r = run("inspect", f"{evil}:Evil", "-i", "randn:2x4", "--seed", seed, "-o", str(path))
        assert r.exit_code == 0, r.stderr
    for fmt in ("table", "markdown", "csv"):
        r = run("diff", str(a), str(b), "-f", fmt)
        assert r.exit_code == 1, r.stderr  # the seeds differ
        _no_raw_controls(r.stdout + r.stderr)
        assert "\\x1b[31mred" in r.stdout


def test_show_escapes_safetensors_metadata(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "x.safetensors"
    save_file(
        {"\x1b[2Jkey": torch.ones(2)},
        str(path),
        metadata={"note": "\x1b]0;owned\x07\x1b[2J[red]hi[/red]", "a\nb": "c"},
    )
    r = run("show", str(path))
    assert r.exit_code == 0, r.stderr
    _no_raw_controls(r.stdout)
    assert "note: \\x1b]0;owned\\x07\\x1b[2J[red]hi[/red]" in r.stdout
    assert "a\\nb: c" in r.stdout and "\\x1b[2Jkey" in r.stdout
    r = run("show", str(path), "-f", "json")
    assert "\\u001b]0;owned" in r.stdout, "JSON keeps the data (escaped the JSON way)"


def test_a_baseline_name_is_escaped_in_errors(tmp_path: Path) -> None:
    path = tmp_path / "x\x1b[2J.json"
    r = run("check", HEALTHY, *TINY, "--baseline", str(path))
    assert_one_line_error(r, 2, "x\\x1b[2J.json not found", "-o " + escape(str(path)))
    _no_raw_controls(r.stderr)


def test_newlines_in_file_names_do_not_split_rows(evil: str, tmp_path: Path) -> None:
    from PIL import Image

    img = tmp_path / "a\nb\x1b[2J.png"
    Image.open(CAT).convert("RGB").resize((32, 32)).save(img)
    r = run("inspect", f"{evil}:Conv", str(img))
    assert r.exit_code == 0, r.stderr
    _no_raw_controls(r.stdout)
    assert "a\\nb\\x1b[2J.png" in r.stdout
    assert not any(ln.startswith("b") for ln in r.stdout.splitlines())
    r = run("inspect", f"{evil}:Conv", str(img), "-f", "markdown")
    assert "a\\nb\\x1b[2J.png" in r.stdout


def test_escape_units() -> None:
    assert escape("layer1.0.conv1") == "layer1.0.conv1"
    assert escape("a\x1b[31mb\nc\td\re\x7f\x85") == "a\\x1b[31mb\\nc\\td\\re\\x7f\\x85"
    assert escape("rtl\u202eevil\u2028x") == "rtl\\u202eevil\\u2028x"
    assert escape("bad\udcffname") == "bad\\udcffname"  # an undecodable file name byte
    assert escape("тензор ✓ 猫") == "тензор ✓ 猫"
    assert escape(escape("a\x1b")) == escape("a\x1b")
    assert markdown("a|b\nc") == "a\\|b\\nc"
    assert [csv_cell(s) for s in ("=1+2", "+x", "-x", "@SUM(A1)", "-1.5", "x=1", "")] == [
        "'=1+2",
        "'+x",
        "'-x",
        "'@SUM(A1)",
        "-1.5",
        "x=1",
        "",
    ]


# ---------------------------------------------------------------- 4. non-finite model output


def test_a_model_output_full_of_inf_is_counted(evil: str) -> None:
    for fmt, needle in (("table", "model output: 2x10 (20 Inf)"), ("markdown", "2x10 (20 Inf)")):
        r = run("inspect", f"{evil}:InfOut", "-i", "randn:2x4", "-f", fmt)
        assert r.exit_code == 0, r.stderr
        assert needle in r.stdout, r.stdout


# ---------------------------------------------------------------- 5. integers out of range


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["inspect", HEALTHY, *TINY, "--seed", str(10**23)], ["--seed", "18446744073709551615"]),
        (["inspect", HEALTHY, *TINY, "--seed", "-1"], ["--seed must be 0 or more"]),
        (["check", HEALTHY, *TINY, "--seed", str(2**64)], ["--seed must be at most"]),
        (["inspect", HEALTHY, *TINY, "--topk", str(10**23)], ["--topk must be at most"]),
        (["inspect", HEALTHY, *TINY, "--topk", "-1"], ["--topk must be 0 or more"]),
        (
            ["inspect", HEALTHY, SAMPLES, "--batch-size", str(10**30)],
            ["--batch-size must be at most 65536"],
        ),
        (
            ["inspect", HEALTHY, SAMPLES, "--batch-size", "1", "--per-image", "-2"],
            ["--per-image must be 0 or more"],
        ),
        (
            ["inspect", HEALTHY, SAMPLES, "--limit", str(10**30)],
            ["--limit must be at most"],
        ),
        (
            ["diff", HEALTHY, SAMPLES, "--b", "seed=1", "--batch-size", str(10**30)],
            ["--batch-size must be at most 65536"],
        ),
        (["diff", HEALTHY, *TINY, "--b", f"seed={10**23}"], ["--b seed must be at most"]),
        (
            ["inspect", HEALTHY, *TINY, "--model-arg", "x=" + "[" * 100_000],
            ["--model-arg x=… is 100002 characters long", "at most 1000"],
        ),
        (
            [
                "inspect",
                "resnet18",
                "-i",
                "randn:1x3x32x32",
                "--model-arg",
                f"num_classes={10**30}",
            ],
            ["cannot build resnet18(num_classes=", "Overflow when unpacking"],
        ),
        (["layers", "resnet18", "--seed", str(10**23)], ["--seed"]),
    ],
)
def test_integers_out_of_range_are_refused(args: list[str], needles: list[str]) -> None:
    r = run(*args)
    assert_one_line_error(r, 2, *needles)
    assert len(r.stderr) < 400, "a huge value is not echoed back"


def test_the_largest_seed_torch_takes_is_accepted() -> None:
    r = run("inspect", HEALTHY, *TINY, "--seed", str(2**64 - 1))
    assert r.exit_code == 0, r.stderr


# ---------------------------------------------------------------- 6. diff sides


def test_autocast_with_an_unknown_dtype_lists_the_valid_ones() -> None:
    r = run("diff", HEALTHY, *TINY, "--b", "autocast:int8")
    assert_one_line_error(r, 2, "autocast has no dtype 'int8'", "bfloat16 and float16")


# ---------------------------------------------------------------- 7. the diff spill file


@pytest.mark.parametrize("side_by_side", [True, False])
def test_a_full_tmpdir_stops_diff(side_by_side: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A spill write failing with ENOSPC stops the run (exit 2) instead of reporting the
    layers it could not keep as "only on this side". Side by side, nothing is spilled."""
    from hookcli.commands.diff import lockstep

    def full(fd: int, data: Any, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)
    monkeypatch.setattr(lockstep, "ENABLED", side_by_side)
    r = run("diff", HEALTHY, *TINY, "--b", "float64")
    if side_by_side:
        assert r.exit_code == 0, r.output
        assert "no call past tolerance" in r.stdout
    else:
        assert_one_line_error(r, 2, "no space left in TMPDIR", "set TMPDIR to a larger disk")
    assert "only on this side" not in r.stdout + r.stderr


def test_the_spill_file_has_no_name_in_tmpdir(tmp_path: Path) -> None:
    """Unlinked once opened: SIGKILL cannot leave it behind."""
    script = (
        "import os, signal, torch\n"
        "from hookcli.commands.diff.measure import Spill\n"
        "s = Spill()\n"
        "s.write(('l', 0, 'out'), torch.randn(300, 1000))\n"
        "s.write(('m', 0, 'out'), torch.randn(10))\n"
        "assert s.read(('l', 0, 'out')).shape == (300, 1000)\n"
        "assert s.read(('m', 0, 'out')).shape == (10,)\n"
        "print(len(os.listdir(os.environ['TMPDIR'])), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
        timeout=120,
    )
    assert res.returncode == -9, res.stderr
    assert res.stdout.strip() == "0", "no name in TMPDIR even while the spill is in use"
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- 8. check's own parsing


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--expect-shape", " =1x2"], ["malformed --expect-shape"]),
        (["--expect-shape", "fc1=4x"], ["malformed --expect-shape"]),
        (["--expect-shape", "fc1=4x8x"], ["malformed --expect-shape"]),
        (["--grad-norm", "1:2:3"], ["malformed --grad-norm '1:2:3'"]),
        (["--grad-norm", ":"], ["empty range"]),
        (["--grad-norm", "a:b"], ["--grad-norm MIN must be a number"]),
        (["--fail-on", ""], ["unknown --fail-on rule ''"]),
        (["--baseline", str(ROOT)], ["it is a folder"]),
        (["--baseline", "/dev/null"], ["it is empty"]),
    ],
)
def test_check_rule_values(args: list[str], needles: list[str]) -> None:
    assert_one_line_error(run("check", HEALTHY, *TINY, *args), 2, *needles)


def test_report_renders_a_report_of_layers_that_never_ran(tmp_path: Path) -> None:
    """A selected layer the forward never calls: the report hookcli wrote (no layer calls,
    never_called naming it) renders; only a comparison against it (a baseline, diff) refuses
    it, and no hint offers to write over the user's file."""
    saved = tmp_path / "unused.json"
    model = ["tests/support/models.py:Unused"]
    res = CliRunner().invoke(
        app, ["inspect", *model, "--input", "randn:2x4", "-l", "never", "-o", str(saved)]
    )
    assert res.exit_code == 0, res.output
    data = json.loads(saved.read_text())
    assert data["layers"] == [] and data["never_called"] == ["never"]
    shown = CliRunner().invoke(app, ["report", str(saved), "-f", "json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)["never_called"] == ["never"]
    refused = CliRunner().invoke(app, ["diff", str(saved), str(saved)])
    assert_one_line_error(refused, 2, "nothing to compare against")
    assert str(saved) not in refused.stderr.split("Hint:")[1]
