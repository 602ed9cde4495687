"""check: rules, the first non-finite origin forward and backward, baselines, CI script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import hookcli
from hookcli.cli import app
from tests.support.cli import assert_one_line_error
from tests.support.paths import ROOT

runner = CliRunner()


def run(*args: str) -> object:
    return runner.invoke(app, list(args))


def test_forward_origin_log_of_a_negative() -> None:
    report = hookcli.inspect(
        "tests/support/models.py:NanForward", input_specs=["randn:16x4"], device="cpu"
    )
    (origin,) = report.nonfinite_origins
    assert (origin.direction, origin.layer, origin.path) == ("forward", "log", "out")
    assert origin.nan > 0
    # every layer after it is non-finite too, and none before
    names = [c.name for c in report.layers if any(t.nonfinite for t in c.outputs)]
    assert names == ["log", "fc2", "act"]


def test_forward_origin_division_by_a_zeroed_activation() -> None:
    report = hookcli.inspect(
        "tests/support/models.py:DivideByDead", input_specs=["randn:2x4"], device="cpu"
    )
    (origin,) = report.nonfinite_origins
    assert origin.layer == "div" and origin.inf + origin.nan == 8


def test_backward_origin_sqrt_at_zero() -> None:
    report = hookcli.grads(
        "tests/support/models.py:NanBackward",
        input_specs=["randn:16x4"],
        device="cpu",
        target="sum",
    )
    assert all(not t.nonfinite for c in report.layers for t in c.outputs), "forward is finite"
    (origin,) = report.nonfinite_origins
    assert (origin.direction, origin.layer) == ("backward", "sqrt")
    assert origin.inf + origin.nan > 0


def test_check_exit_codes_and_messages() -> None:
    r = run("check", "tests/support/models.py:NanForward", "--input", "randn:16x4")
    assert r.exit_code == 1, r.stderr
    assert "FAIL nonfinite" in r.stdout and "forward: first at log (Log) call 0" in r.stdout
    r = run(
        "check",
        "tests/support/models.py:NanBackward",
        "--input",
        "randn:16x4",
        "--backward",
        "--target",
        "sum",
        "--fail-on",
        "nonfinite",
    )
    assert r.exit_code == 1
    assert "backward: first at sqrt (Sqrt) call 0, gradient w.r.t. input in[0]" in r.stdout
    r = run(
        "check",
        "tests/support/models.py:Healthy",
        "--input",
        "randn:16x4",
        "--fail-on",
        "nonfinite",
        "--fail-on",
        "dead",
        "--backward",
        "--target",
        "sum",
    )
    assert r.exit_code == 0, r.stdout
    assert "2 passed, 0 failed" in r.stdout


def test_quiet_prints_only_failures() -> None:
    r = run("check", "tests/support/models.py:Healthy", "--input", "randn:4x4", "--quiet")
    assert r.exit_code == 0 and r.stdout == ""
    r = run("check", "tests/support/models.py:NanForward", "--input", "randn:16x4", "-q")
    assert r.exit_code == 1
    assert r.stdout.startswith("FAIL nonfinite") and "PASS" not in r.stdout


def test_dead_max_abs_expect_shape_rules() -> None:
    r = run(
        "check",
        "tests/support/models.py:DivideByDead",
        "--input",
        "randn:2x4",
        "--fail-on",
        "dead",
        "--expect-shape",
        "fc=2x4",
        "--expect-shape",
        "gate=2x5",
        "--max-abs",
        "1e9",
    )
    assert r.exit_code == 1
    assert "FAIL dead: 1 of 1 ReLU-family outputs all zeros" in r.stdout
    assert "PASS expect-shape fc: fc output is 2x4" in r.stdout
    assert "FAIL expect-shape gate: gate output is 2x4, expected 2x5" in r.stdout
    # div's output is Inf (x / 0): beyond any --max-abs
    assert "FAIL max-abs" in r.stdout and "div call 0 out: max |x| = inf" in r.stdout
    # a rule's layer is hooked even when -l selects others
    r = run("check", "resnet18", "-l", "fc", "--expect-shape", "layer1=1x64x56x56")
    assert r.exit_code == 0, r.stdout


def test_expect_shape_takes_a_glob_as_every_other_layer_option_does() -> None:
    """A glob (matched when the rule is read) is compared layer by layer, each matching
    layer's first call: it was compared as a literal name, and failed as 'never ran'."""
    model = ("tests/support/models.py:DivideByDead", "--input", "randn:2x4")
    r = run("check", *model, "--expect-shape", "f?=2x4", "--expect-shape", "*=2x4")
    assert r.exit_code == 0, r.stdout
    assert "PASS expect-shape f?: f? (1 layer) output is 2x4" in r.stdout
    r = run("check", *model, "--expect-shape", "[fg]*=2x5")
    assert r.exit_code == 1, r.stdout
    assert "FAIL expect-shape [fg]*: 2 of 2 layers matching [fg]* do not output 2x5" in r.stdout
    assert "gate output is 2x4, expected 2x5" in r.stdout


def test_check_refuses_backward_options_when_no_backward_runs() -> None:
    model = ("tests/support/models.py:DivideByDead", "--input", "randn:2x4")
    r = run("check", *model, "--target", "2", "--loss", "mse:ones")
    assert_one_line_error(r, 2, "--target, --loss say how backward runs", "add --backward")
    r = run("check", *model, "--target", "sum", "--backward")
    assert r.exit_code in (0, 1), r.stderr  # (it runs: the rules decide)


def test_fail_on_works_on_inspect_and_grads(tmp_path: Path) -> None:
    r = run(
        "inspect",
        "tests/support/models.py:NanForward",
        "--input",
        "randn:16x4",
        "--fail-on",
        "nonfinite",
    )
    assert r.exit_code == 1 and "FAIL nonfinite" in r.stdout
    r = run(
        "grads",
        "tests/support/models.py:NanBackward",
        "--input",
        "randn:16x4",
        "--target",
        "sum",
        "--fail-on",
        "nonfinite",
        "-f",
        "json",
    )
    assert r.exit_code == 1
    data = json.loads(r.stdout)
    assert data["checks"][0]["rule"] == "nonfinite" and not data["checks"][0]["passed"]
    assert data["nonfinite_origins"][0]["layer"] == "sqrt"
    assert "check failed: nonfinite" in r.stderr
    r = run(
        "inspect",
        "tests/support/models.py:Healthy",
        "--input",
        "randn:4x4",
        "--fail-on",
        "nonfinite",
    )
    assert r.exit_code == 0


def test_baseline_round_trip(tmp_path: Path) -> None:
    base = tmp_path / "base.json"
    r = run("inspect", "resnet18", "--input", "randn:1x3x64x64", "-f", "json", "-o", str(base))
    assert r.exit_code == 0, r.stderr
    r = run("check", "resnet18", "--input", "randn:1x3x64x64", "--baseline", str(base))
    assert r.exit_code == 0, r.stdout
    assert "PASS baseline" in r.stdout
    r = run(
        "check", "resnet18", "--input", "randn:1x3x64x64", "--baseline", str(base), "--seed", "1"
    )
    assert r.exit_code == 1
    assert "FAIL baseline" in r.stdout and "more (all in --format json)" in r.stdout
    r = run(
        "check",
        "resnet18",
        "--input",
        "randn:1x3x64x64",
        "--baseline",
        str(base),
        "--seed",
        "1",
        "-f",
        "json",
    )
    (result,) = json.loads(r.stdout)["checks"]
    conv2 = [f for f in result["failures"] if f["layer"] == "layer4.1.conv2"]
    assert conv2 and conv2[0]["message"].startswith("layer4.1.conv2 call 0 output out")
    # the seed changed: the verdict says the drift may come from it, stderr says why
    assert "the baseline ran with --seed 0, this run with --seed 1" in result["message"]
    assert "check failed: baseline:" in r.stderr
    # a looser tolerance does not hide a layer that vanished
    r = run("check", "resnet18", "--input", "randn:1x3x64x64", "--baseline", str(base), "-l", "fc")
    assert r.exit_code == 1 and "vanished" in r.stdout
    # --save-baseline records the same thing
    again = tmp_path / "again.json"
    r = run("check", "resnet18", "--input", "randn:1x3x64x64", "--save-baseline", str(again))
    assert r.exit_code == 0 and json.loads(again.read_text())["schema"] == 2


_NET = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.act, self.head = nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.act(self.body(x)){cut})
"""


def test_baseline_fails_when_gradients_vanish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model whose graph was cut (a `.detach()` before the head: the body no longer learns)
    runs the same calls as its baseline, with the same forward numbers; every gradient the
    cut removed is a failure that names it, never left out of the comparison."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.py").write_text(_NET.format(cut=""))
    args = ["net.py:Net", "--input", "randn:2x8", "--target", "sum"]
    r = run("grads", *args, "--save-baseline", "base.json", "-o", "r.json")
    assert r.exit_code == 0, r.stderr
    r = run("check", *args, "--backward", "--baseline", "base.json")
    assert r.exit_code == 0 and "PASS baseline" in r.stdout, r.stdout
    (tmp_path / "net.py").write_text(_NET.format(cut=".detach()"))
    r = run("check", *args, "--backward", "--baseline", "base.json", "-f", "json")
    assert r.exit_code == 1, r.stdout
    (result,) = json.loads(r.stdout)["checks"]
    lost = {f["message"] for f in result["failures"]}
    for where in (
        "body call 0 param_grad weight",
        "body call 0 grad_output out",
        "act call 0 grad_input in[0]",
    ):
        assert f"{where}: vanished (in the baseline, not in this run)" in lost, lost
    # the gradient-norm rule names the parameters no gradient reached (a cut graph, or one
    # only training mode reads: not a failure of its own)
    r = run("check", *args, "--grad-norm", "1e-8:1e3")
    assert r.exit_code == 0, r.stdout
    assert "2 trainable parameters got no gradient (none reached them): body.weight" in r.stdout


@pytest.fixture
def baselines(tmp_path: Path) -> dict[str, str]:
    other_schema = {"schema": 99, "model": {"spec": "resnet18"}, "layers": []}
    (tmp_path / "schema.json").write_text(json.dumps(other_schema))
    (tmp_path / "corrupt.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"hello": 1}))
    r = run(
        "inspect",
        "tests/support/models.py:Healthy",
        "--input",
        "randn:4x4",
        "-f",
        "json",
        "-o",
        str(tmp_path / "healthy.json"),
    )
    assert r.exit_code == 0
    r = run(
        "inspect",
        "resnet18",
        "--input",
        "randn:1x3x64x64",
        "-f",
        "json",
        "-o",
        str(tmp_path / "r64.json"),
    )
    assert r.exit_code == 0
    return {
        k: str(tmp_path / f"{k}.json") for k in ("schema", "corrupt", "other", "healthy", "r64")
    }


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--grad-norm", "5"], ["malformed --grad-norm '5'"]),
        (["--grad-norm", "3:1"], ["empty range"]),
        (["--expect-shape", "conv1"], ["malformed --expect-shape"]),
        (["--expect-shape", "nope=1x2"], ["no layer matches 'nope'"]),
        (["--fail-on", "slow"], ["unknown --fail-on rule 'slow'"]),
        (["--baseline", "missing.json"], ["baseline missing.json not found"]),
        (["--baseline", "{corrupt}"], ["not readable JSON"]),
        (["--baseline", "{other}"], ["not a hookcli JSON report"]),
        (["--baseline", "{schema}"], ["schema 99"]),
        (["--baseline", "{healthy}"], ["from model 'tests/support/models.py:Healthy'"]),
        (["--baseline", "{r64}", "--input", "randn:1x3x32x32"], ["ran on input [[1, 3, 64, 64]]"]),
        (["--baseline", "{r64}", "--rtol", "-1"], ["--rtol and --atol must be 0 or more"]),
        (["--dead-frac", "0"], ["--dead-frac must be in (0, 1]"]),
        # a tolerance with no baseline to apply it to (it was accepted, and did nothing)
        (["--rtol", "0.1"], ["--rtol is the tolerance of --baseline", "add --baseline"]),
        (["--atol", "1", "--rtol", "0"], ["--rtol is the tolerance of --baseline", "--atol"]),
    ],
)
def test_check_bad_input(args: list[str], needles: list[str], baselines: dict[str, str]) -> None:
    args = [a.format(**baselines) for a in args]
    if "--input" not in args:
        args += ["--input", "randn:1x3x64x64"]
    assert_one_line_error(run("check", "resnet18", *args), 2, *needles)


def test_ci_example_script(tmp_path: Path) -> None:
    script = ROOT / "examples" / "ci" / "check.sh"
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "BASELINE": str(tmp_path / "baseline.json"),
        "MODEL": "tests/support/models.py:Healthy",
        "INPUT": "randn:8x4",
    }

    def step(**extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(script)],
            env={**env, **extra},
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )

    first = step()
    assert first.returncode == 0, first.stderr
    assert "recording" in first.stdout and (tmp_path / "baseline.json").exists()
    again = step()
    assert again.returncode == 0, again.stdout + again.stderr
    drifted = step(SEED="1")
    assert drifted.returncode == 1
    assert "FAIL baseline" in drifted.stdout and "FAILED" in drifted.stderr
    broken = step(
        MODEL="tests/support/models.py:NanForward",
        INPUT="randn:16x4",
        BASELINE=str(tmp_path / "nan.json"),
    )
    assert broken.returncode == 1 and "FAIL nonfinite" in broken.stdout
    missing = step(MODEL="no_such_model")
    assert missing.returncode == 2 and "could not run" in missing.stderr


def test_check_is_deterministic() -> None:
    a = run("check", "resnet18", "--input", "randn:1x3x64x64", "-f", "json")
    b = run("check", "resnet18", "--input", "randn:1x3x64x64", "-f", "json")
    assert json.loads(a.stdout)["layers"] == json.loads(b.stdout)["layers"]
    assert not torch.are_deterministic_algorithms_enabled(), "the global setting is restored"


def test_check_markdown_has_the_lines_of_its_table() -> None:
    """check -f markdown shows what check's table shows (header, each check, the tally), not
    inspect's layer statistics."""
    net = str(ROOT / "examples" / "tiny" / "net.py") + ":Net"
    args = ("check", net, "-i", "ones:2x2", "--fail-on", "dead", "--no-config")
    table = runner.invoke(app, [*args]).stdout
    markdown = runner.invoke(app, [*args, "-f", "markdown"]).stdout
    lines = [ln.strip() for ln in table.splitlines() if ln.strip()]
    assert any(ln.startswith(("PASS", "FAIL")) for ln in lines)
    for line in lines:
        words = line.split()
        assert all(w in markdown for w in words[1:]), (line, markdown)
    assert "| layer" not in markdown and "mean" not in markdown


def test_dead_frac_alone_turns_the_dead_rule_on(tmp_path: Path) -> None:
    """--dead-frac is the dead rule's threshold: given alone it checks (as --dead-after does
    for a log); it was accepted and only the default nonfinite rule ran (exit 0 on a ReLU
    whose every output is 0: ReLU of -|x|)."""
    (tmp_path / "net.py").write_text(
        "from torch import nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc, self.act = nn.Linear(4, 4), nn.ReLU()\n"
        "    def forward(self, x):\n"
        "        return self.act(-self.fc(x).abs())\n"
    )
    r = run("check", f"{tmp_path}/net.py:Net", "--input", "randn:8x4", "--dead-frac", "0.5",
            "-f", "json")  # fmt: skip
    assert r.exit_code == 1, r.stderr
    (check,) = json.loads(r.stdout)["checks"]
    assert check["rule"] == "dead" and not check["passed"]
    assert [f["layer"] for f in check["failures"]] == ["act"]
    assert "100.0% zeros" in check["failures"][0]["message"]
