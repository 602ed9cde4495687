"""The command line through Typer's CliRunner: exit codes, stdout vs stderr, formats,
atomic output files, one-line errors for every bad input, help for every command."""

from __future__ import annotations

import csv
import importlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.cli import assert_one_line_error, run
from tests.support.paths import CAT, COFFEE, ROOT

ANSI = re.compile(r"\x1b\[")


def test_inspect_table_on_the_cat() -> None:
    r = run("inspect", "resnet18", str(CAT), "-l", "layer1.0.*", "--topk", "3")
    assert r.exit_code == 0, r.stderr
    out = r.stdout
    assert "layer1.0.relu" in out and "layer1.0.conv1" in out
    assert re.search(r"layer1\.0\.relu\s*\|\s*ReLU\s*\|\s*1\s*\|", out), (
        "second call of the reused relu"
    )
    assert "predictions" in out and "meaningless" in out
    assert not ANSI.search(out), "no escape codes when stdout is not a terminal"
    assert r.stderr == ""


def test_inspect_json_parses_and_follows_schema_1() -> None:
    r = run(
        "inspect",
        "resnet18",
        str(CAT),
        str(COFFEE),
        "-l",
        "fc",
        "-l",
        "layer4.1.relu",
        "-f",
        "json",
    )
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["schema"] == 2
    for key in ("model", "input", "device", "layers", "never_called", "predictions", "checks"):
        assert key in data
    assert data["input"]["shapes"] == [[2, 3, 224, 224]]
    layer = data["layers"][0]
    for key in (
        "name",
        "type",
        "call",
        "inputs",
        "outputs",
        "grad_inputs",
        "grad_outputs",
        "params",
    ):
        assert key in layer
    assert layer["grad_inputs"] is None  # no backward in inspect: null, never 0
    entry = layer["outputs"][0]
    for key in (
        "path",
        "shape",
        "dtype",
        "numel",
        "mean",
        "std",
        "min",
        "max",
        "zeros",
        "nan",
        "inf",
        "norm",
    ):
        assert key in entry
    assert [c["call"] for c in data["layers"] if c["name"] == "layer4.1.relu"] == [0, 1]
    preds = data["predictions"]
    assert {p["image"] for p in preds} == {0, 1}
    assert set(preds[0]) >= {"rank", "index", "label", "prob"}


def test_csv_and_markdown() -> None:
    r = run("inspect", "resnet18", "-l", "layer1.0.conv1", "-f", "csv")
    assert r.exit_code == 0, r.stderr
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert [(row["layer"], row["kind"]) for row in rows][:2] == [
        ("layer1.0.conv1", "input"),
        ("layer1.0.conv1", "output"),
    ]
    assert float(rows[1]["std"]) > 0
    r = run("inspect", "resnet18", "-l", "fc", "-f", "markdown")
    assert r.exit_code == 0
    assert "| layer | type | call |" in r.stdout and "| fc | Linear | 0 |" in r.stdout


def test_output_file_is_written_atomically_with_format_from_suffix(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    r = run("inspect", "resnet18", str(CAT), "-l", "fc", "-o", str(out))
    assert r.exit_code == 0, r.stderr
    assert r.stdout == ""
    assert json.loads(out.read_text())["model"]["name"] == "resnet18"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_failed_run_leaves_no_partial_output(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    r = run("inspect", "tests/support/models.py:Fails", "--input", "randn:1x2", "-o", str(out))
    assert_one_line_error(r, 3, "in layer bad", "boom inside the model")
    assert list(tmp_path.iterdir()) == []


def test_unwritable_output_is_refused_before_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hookcli.commands.inspect

    def must_not_run(*a: object, **k: object) -> None:
        raise AssertionError("the model ran although -o cannot be written")

    monkeypatch.setattr(hookcli.commands.inspect, "report", must_not_run)
    r = run("inspect", "resnet18", "-o", str(tmp_path / "no" / "such" / "dir.json"))
    assert_one_line_error(r, 2, "does not exist")
    # /proc accepts no new files, whoever we are (permission bits would not stop root)
    assert_one_line_error(run("inspect", "resnet18", "-o", "/proc/hookcli.json"), 2, "not writable")
    assert_one_line_error(run("inspect", "resnet18", "-o", str(tmp_path)), 2, "is a directory")


def test_ctrl_c_exits_130_without_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    import hookcli.commands.inspect

    def interrupted(*a: object, **k: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(hookcli.commands.inspect, "report", interrupted)
    r = run("inspect", "resnet18")
    assert r.exit_code == 130
    assert r.stderr.strip() == "interrupted" and r.stdout == ""


def test_the_readme_main_job() -> None:
    r = run("inspect", "resnet34", "sample_images/cat.jpeg")
    assert r.exit_code == 0, r.stderr
    assert "layer4.2.relu" in r.stdout and "predictions" in r.stdout


class Opaque:
    """A Python object: loading it needs full unpickling."""


@pytest.fixture
def bad_files(tmp_path: Path) -> dict[str, Path]:
    files = {
        "empty": tmp_path / "empty.jpg",
        "corrupt": tmp_path / "corrupt.png",
        "truncated": tmp_path / "truncated.jpg",
        "text": tmp_path / "notes.txt",
        "folder": tmp_path / "no_images",
        "needs_unpickling": tmp_path / "obj.pth",
        "wrong_keys": tmp_path / "other.pth",
    }
    files["empty"].write_bytes(b"")
    files["corrupt"].write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(200))
    files["truncated"].write_bytes(CAT.read_bytes()[:4000])
    files["text"].write_text("just text")
    files["folder"].mkdir()
    (files["folder"] / "readme.txt").write_text("no images here")
    torch.save({"w": torch.ones(1), "config": Opaque()}, files["needs_unpickling"])
    torch.save({"head.weight": torch.zeros(2, 2)}, files["wrong_keys"])
    return files


@pytest.mark.parametrize(
    ("args", "code", "needles"),
    [
        (["inspect", "resnet19"], 2, ["unknown model 'resnet19'", "resnet18"]),
        (["inspect", "resnet18", "missing.jpg"], 2, ["missing.jpg not found"]),
        (["inspect", "resnet18", "{empty}"], 2, ["empty (0 bytes)"]),
        (["inspect", "resnet18", "{corrupt}"], 2, ["not an image format"]),
        (["inspect", "resnet18", "{truncated}"], 2, ["corrupt or truncated"]),
        (["inspect", "resnet18", "{text}"], 2, ["not an image format"]),
        (["inspect", "resnet18", "{folder}"], 2, ["holds no image files"]),
        (
            ["inspect", "resnet18", "-l", "layer9"],
            2,
            ["no layer matches 'layer9'", "hookcli layers resnet18"],
        ),
        (["inspect", "resnet18", "-t", "Conv3d"], 2, ["no layer has type 'Conv3d'", "Conv2d"]),
        (["inspect", "resnet18", "--input", "randn:3xq"], 2, ["malformed --input"]),
        (
            ["inspect", "resnet18", "--weights", "IMAGENET9K"],
            2,
            ["unknown weights", "IMAGENET1K_V1"],
        ),
        (
            ["inspect", "resnet18", "--weights", "{needs_unpickling}"],
            2,
            ["needs full unpickling", "weights_only"],
        ),
        (
            ["inspect", "resnet18", "--weights", "{wrong_keys}"],
            2,
            ["does not fit resnet18", "missing"],
        ),
        (["inspect", "resnet18", "--input", "randn:1x10"], 3, ["resnet18 failed in layer conv1"]),
        (["inspect", "resnet18", "--device", "cuda"], 2, ["CUDA is not available"]),
        (["inspect", "resnet18", "--device", "tpu"], 2, ["device"]),
        (["inspect", "resnet18", "--topk", "-1"], 2, ["--topk"]),
        (["inspect", "raft_small", str(CAT)], 2, ["two images"]),
        (["grads", "quantized_resnet18"], 2, ["no autograd"]),
        (["inspect", "resnet18", "--model-arg", "nonsense"], 2, ["malformed --model-arg"]),
        (["layers", "nosuchnet"], 2, ["unknown model"]),
        (["models", "zzz*"], 2, ["no registry model"]),
    ],
)
def test_bad_input_gives_one_line_and_its_exit_code(
    args: list[str], code: int, needles: list[str], bad_files: dict[str, Path]
) -> None:
    args = [a.format(**{k: str(v) for k, v in bad_files.items()}) for a in args]
    assert_one_line_error(run(*args), code, *needles)


def test_offline_without_cached_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    import urllib.error

    def no_network(*a: object, **k: object) -> None:
        raise urllib.error.URLError("offline (test)")

    monkeypatch.setattr(torch.hub, "download_url_to_file", no_network)
    r = run("inspect", "resnet18", "--weights", "DEFAULT")
    assert_one_line_error(r, 2, "not in the torch hub cache", "resnet18-f37072fd.pth")


def test_models_and_layers() -> None:
    r = run("models", "resnet*", "--task", "classification")
    assert r.exit_code == 0, r.stderr
    assert "resnet18" in r.stdout and "IMAGENET1K_V1" in r.stdout and "wide_resnet" not in r.stdout
    r = run("models", "--task", "detection", "-f", "json")
    names = {m["name"] for m in json.loads(r.stdout)}
    assert "fasterrcnn_resnet50_fpn" in names and all(
        m["task"] == "detection" for m in json.loads(r.stdout)
    )
    r = run("layers", "tests/support/models.py:Aliased")
    assert r.exit_code == 0, r.stderr
    assert re.search(r"^a\s*\|\s*Linear\s*\|\s*12\s*\|\s*yes\s*\|\s*b", r.stdout, re.M)
    r = run("layers", "resnet18", "--shapes", "--depth", "2", "-f", "json")
    data = json.loads(r.stdout)
    rows = {m["name"]: m for m in data["modules"]}
    assert rows["layer1.0"]["output_shapes"] == ["1x64x56x56"]
    assert rows["relu"]["calls"] == 1 and rows["layer1"]["calls"] == 1


def test_every_command_has_help_with_an_example() -> None:
    r = run("--help")
    assert r.exit_code == 0
    for command in ("models", "layers", "inspect", "grads", "check"):
        assert command in r.stdout
        h = run(command, "--help")
        assert h.exit_code == 0 and "Example: hookcli" in h.stdout, h.stdout
    assert run("inspect", "-h").exit_code == 0


def test_a_run_builds_only_the_command_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Typer builds a command from its whole signature: `hookcli --help` lists the commands
    without building any, a command builds itself alone; the list is the same as Typer's."""
    app_module = importlib.import_module("hookcli.cli.app")  # hookcli.cli.app is the Typer app
    built: list[str] = []
    real = app_module.build

    def counting(function: object, config: bool) -> object:
        built.append(getattr(function, "__name__", ""))
        return real(function, config)  # type: ignore[arg-type]

    monkeypatch.setattr(app_module, "build", counting)
    listed = run("--help")
    assert listed.exit_code == 0 and built == []
    names = re.findall(r"^  (\w+)  ", listed.stdout.split("Commands:")[1], re.M)
    assert names == list(app_module.registered()) and len(names) == 14
    assert run("layers", "--help").exit_code == 0 and built == ["layers"]
    assert run("inspec").exit_code == 2 and built == ["layers"]  # a typo: a suggestion, no build


def test_version() -> None:
    r = run("--version")
    assert r.exit_code == 0 and r.stdout.startswith("hookcli 0.")


def test_help_never_imports_torch() -> None:
    """As the console script runs it: argv[0] is `hookcli` before anything is imported (so no
    background load of the kernels starts either: it would import numpy)."""
    code = (
        "import sys; sys.argv = ['hookcli', '--help']; from hookcli.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'heavy import'\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert "Usage" in res.stdout


def test_python_dash_m_works() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "hookcli", "--version"],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert res.returncode == 0 and res.stdout.startswith("hookcli ")


def test_no_color_env_and_pipes_get_plain_text() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "hookcli", "inspect", "resnet18", "-l", "fc"],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        env={**os.environ, "NO_COLOR": "1"},
    )
    assert res.returncode == 0, res.stderr
    assert not ANSI.search(res.stdout) and "fc" in res.stdout


def test_hist_adds_a_sparkline_and_json_bins() -> None:
    r = run("inspect", "resnet18", "-l", "layer1.0.relu", "--hist")
    assert r.exit_code == 0, r.stderr
    assert "| hist" in r.stdout and "█" in r.stdout
    r = run("inspect", "resnet18", "-l", "layer1.0.relu", "--hist", "-f", "json")
    out = json.loads(r.stdout)["layers"][0]["outputs"][0]
    assert len(out["hist"]["counts"]) == 12 and len(out["hist"]["edges"]) == 13
    assert sum(out["hist"]["counts"]) == out["numel"]
    assert out["hist"]["counts"][0] >= out["zeros"] * out["numel"]  # the ReLU's zeros


def test_a_failed_run_s_stderr_is_its_one_error_line_whatever_the_libraries_warned() -> None:
    """torch warns while the model is built (zero-element weights): on bad input (exit 2) the
    command's stderr is its one error line; where the model then fails (exit 3) the error
    line comes first and the warnings after it (they may say why); a run that succeeds shows
    them after its output."""

    def hookcli_run(*more: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable, "-m", "hookcli", "inspect", "tests/support/models.py:WideConv",
                "--input", "randn:1x3x8x8", "--model-arg", "width=0", *more,
            ],
            capture_output=True, text=True, check=False, cwd=ROOT,
            env={k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"},
        )  # fmt: skip

    bad = hookcli_run("-l", "nope")
    assert bad.returncode == 2, bad.stderr
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), bad.stderr
    failed = hookcli_run()
    assert failed.returncode == 3, failed.stderr
    lines = failed.stderr.strip().splitlines()
    assert lines[0].startswith("error: ") and "zero-element" in failed.stderr, failed.stderr
    for shown in (True, False):
        ran = subprocess.run(
            [
                sys.executable, "-c",
                "import warnings; from hookcli.cli.app import _Held\n"
                "held = _Held(); warnings.warn('held back'); print('out', flush=True)\n"
                f"held.end(shown={shown})",
            ],
            capture_output=True, text=True, check=False, cwd=ROOT,
            env={k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"},
        )  # fmt: skip
        assert ran.returncode == 0 and ran.stdout == "out\n", ran.stderr
        assert ("held back" in ran.stderr) is shown
