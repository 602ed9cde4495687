"""grads and project config through the CLI: the seed example, examples/tiny, config files,
and every bad input of the command with its exit code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from hookcli.cli import app
from tests.support.cli import assert_one_line_error
from tests.support.paths import ROOT

runner = CliRunner()


def run(*args: str) -> object:
    return runner.invoke(app, list(args))


def test_the_seed_example_through_the_cli(tmp_path: Path) -> None:
    torch.save(torch.tensor([[1.0], [2.0]]), tmp_path / "x.pt")
    torch.save(torch.tensor([[1.0], [1.0]]), tmp_path / "t.pt")
    r = run(
        "grads",
        "tests/support/models.py:SeedLinear",
        "--input",
        str(tmp_path / "x.pt"),
        "--loss",
        f"mse:{tmp_path / 't.pt'}",
        "--input-grad",
        "-f",
        "json",
    )
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["backward"]["value"] == pytest.approx(5.0)
    (lin,) = data["layers"]
    assert lin["name"] == "lin"
    assert lin["outputs"][0]["values"] == [2.0, 4.0]
    assert lin["grad_outputs"][0]["values"] == [1.0, 3.0]  # dL/dy
    assert lin["grad_inputs"][0]["values"] == [2.0, 6.0]  # dL/dx
    (weight,) = lin["params"]
    assert weight["name"] == "weight" and weight["grad"]["values"] == [7.0]  # dL/dw
    assert data["input_grads"][0]["values"] == [2.0, 6.0]


def test_examples_tiny_runs_bare(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT / "examples" / "tiny")
    r = run("grads", "--layer", "l2")
    assert r.exit_code == 0, r.stderr
    assert "l2" in r.stdout and "l1 loss against ones" in r.stdout
    assert "config: " in r.stdout and "hookcli.toml" in r.stdout
    r = run("grads", "--layer", "l2", "-f", "json")
    assert r.exit_code == 0
    data = json.loads(r.stdout)
    assert data["config"].endswith("examples/tiny/hookcli.toml")
    assert r.stderr.startswith("config: ")  # stated on stderr when the table does not show it
    grad = data["layers"][0]["grad_outputs"][0]["values"]
    assert grad == pytest.approx([-0.1] * 10)  # d(mean |y - 1|)/dy with every y < 1


def test_flags_override_the_config_and_no_config_ignores_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(ROOT / "examples" / "tiny")
    r = run("grads", "--layer", "l2", "--loss", "mse:zeros", "-f", "json")
    assert json.loads(r.stdout)["backward"]["source"] == "mse loss against zeros"
    r = run("inspect", "--layer", "l1", "--input", "zeros:3x2", "-f", "json")
    assert json.loads(r.stdout)["input"]["shapes"] == [[3, 2]]
    assert_one_line_error(run("grads", "--no-config"), 2, "no model given")


def test_pyproject_table_found_from_a_subfolder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\n\n[tool.hookcli]\nmodel = "m.py:Net"\ninput = ["randn:4x2"]\n'
    )
    (tmp_path / "m.py").write_text((ROOT / "examples" / "tiny" / "net.py").read_text())
    sub = tmp_path / "deep" / "er"
    sub.mkdir(parents=True)
    monkeypatch.chdir(sub)
    r = run("inspect", "-f", "json")
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["input"]["shapes"] == [[4, 2]] and data["config"] == str(
        tmp_path / "pyproject.toml"
    )
    other = tmp_path / "other.toml"
    other.write_text('model = "m.py:Net"\ninput = "ones:1x2"\n')
    r = run("inspect", "--config", str(other), "-f", "json")
    assert json.loads(r.stdout)["input"]["shapes"] == [[1, 2]]


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ('model = "m.py:Net"\nseed = = 3\n', ["hookcli.toml", "line 2"]),
        (
            'model = "m.py:Net"\nlayers = "l1"\n',
            ["hookcli.toml:2", "unknown key 'layers'", "layer"],
        ),
        ('model = "m.py:Net"\nseed = "zero"\n', ["hookcli.toml:2", "seed must be an integer"]),
        ('model = "m.py:Net"\n[chekc]\nx = 1\n', ["unknown table [chekc]"]),
    ],
)
def test_malformed_config_names_file_and_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, needles: list[str]
) -> None:
    (tmp_path / "hookcli.toml").write_text(text)
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(run("grads"), 2, *needles)


def test_every_command_that_reads_the_config_may_have_a_table() -> None:
    """A [calib] table (calib takes --config) was "unknown table [calib]" for every command:
    the tables are the commands that take --config, as the app registers them."""
    import typer

    from hookcli.io.config import COMMANDS

    group: Any = typer.main.get_command(app)
    reading = {
        name for name, cmd in group.commands.items() if any(p.name == "config" for p in cmd.params)
    }
    assert reading == set(COMMANDS)


@pytest.fixture
def model_files(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "syntax.py").write_text("import torch\nclass Net(torch.nn.Module:\n    pass\n")
    return {"syntax": str(tmp_path / "syntax.py"), "tmp": str(tmp_path)}


@pytest.mark.parametrize(
    ("args", "code", "needles"),
    [
        (["grads", "nowhere/model.py:Net"], 2, ["model file nowhere/model.py not found"]),
        (["grads", "{syntax}:Net"], 2, ["line 2", "syntax error"]),
        (
            ["grads", "tests/support/models.py:Missing"],
            2,
            ["has no 'Missing'", "It defines: Kinds"],
        ),
        (["grads", "tests/support/models.py:NOT_A_MODEL"], 2, ["not a class or factory"]),
        (["grads", "tests/support/models.py:not_a_module"], 2, ["gave a int, not an nn.Module"]),
        (["grads", "tests/support/models.py:broken_factory"], 3, ["factory exploded"]),
        (["grads", "resnet18", "--target", "taby cat"], 2, ["not a class of this model", "tabby"]),
        (["grads", "resnet18", "--target", "1000"], 2, ["out of range", "0 to 999"]),
        (["grads", "resnet18", "--loss", "mse:ones:5"], 2, ["shape 5", "1x1000"]),
        (["grads", "resnet18", "--loss", "hinge:1"], 2, ["malformed --loss"]),
        (
            ["grads", "examples/tiny/net.py:Net", "--input", "ones:2", "--loss", "bce:ones"],
            2,
            ["bcelogits"],
        ),
        (["grads", "quantized_resnet18"], 2, ["no autograd"]),
        (["grads", "examples/tiny/net.py:Net", "--input", "ones:3"], 3, ["failed in layer l1"]),
    ],
)
def test_grads_bad_input(
    args: list[str], code: int, needles: list[str], model_files: dict[str, str]
) -> None:
    assert_one_line_error(run(*[a.format(**model_files) for a in args]), code, *needles)


def test_frozen_model_is_refused(tmp_path: Path) -> None:
    frozen = tmp_path / "frozen.py"
    frozen.write_text(
        "import torch\n\ndef build():\n    m = torch.nn.Linear(2, 2)\n"
        "    m.requires_grad_(False)\n    return m\n"
    )
    r = run("grads", f"{frozen}:build", "--input", "ones:1x2", "--target", "sum")
    assert_one_line_error(r, 2, "requires grad", "--input-grad")


def test_grads_help_and_table() -> None:
    h = run("grads", "--help")
    assert h.exit_code == 0 and "Example: hookcli grads" in h.stdout
    r = run("grads", "resnet18", "-l", "layer4.1.*", "--target", "tabby cat", "--topk", "0")
    assert r.exit_code == 0, r.stderr
    assert "backward from: score (logit) of class 281 ('tabby')" in r.stdout
    assert "grad_out norm" in r.stdout and "parameter gradients" in r.stdout
