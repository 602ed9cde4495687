"""Output safety (issue 9): one policy for every file written, non-finite numbers as null,
a model's print() and sys.exit kept out of hookcli's data and exit code."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from hookcli.cli import app
from tests.support.cli import assert_one_line_error
from tests.support.paths import CAT

runner = CliRunner()
TINY = ["inspect", "examples/tiny/net.py:Net", "--input", "ones:2x2", "--no-config"]


def _strict(constant: str) -> None:
    raise AssertionError(f"{constant} is not JSON")


def _json_ok(text: str) -> dict[str, object]:
    """Strict JSON: Python's json.loads accepts NaN/Infinity unless told otherwise."""
    return json.loads(text, parse_constant=_strict)  # type: ignore[no-any-return]


def test_dash_is_stdout() -> None:
    r = runner.invoke(app, [*TINY, "-f", "json", "-o", "-"])
    assert r.exit_code == 0, r.stderr
    assert _json_ok(r.stdout)["model"]["name"] == "Net"  # type: ignore[index]
    assert "wrote" not in r.stderr


def test_dev_null_is_written_through_never_replaced() -> None:
    before = os.stat("/dev/null")
    r = runner.invoke(app, [*TINY, "-f", "json", "-o", "/dev/null"])
    assert r.exit_code == 0, r.stderr
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev
    assert r.stdout == ""


def test_fifo_is_written_through(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    r = runner.invoke(app, [*TINY, "-f", "json", "-o", str(fifo)])
    reader.join(timeout=60)
    assert r.exit_code == 0, r.stderr
    assert stat.S_ISFIFO(os.stat(fifo).st_mode), "still a FIFO"
    assert _json_ok(got[0].decode())["schema"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_symlink_target_is_replaced_and_the_link_kept(tmp_path: Path) -> None:
    real = tmp_path / "reports" / "r.json"
    real.parent.mkdir()
    real.write_text("old")
    link = tmp_path / "latest.json"
    link.symlink_to(real)
    r = runner.invoke(app, [*TINY, "-o", str(link)])  # format from the link's suffix: json
    assert r.exit_code == 0, r.stderr
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert _json_ok(real.read_text())["schema"] == 2
    dangling = tmp_path / "new.json"
    dangling.symlink_to(tmp_path / "reports" / "fresh.json")
    assert runner.invoke(app, [*TINY, "-o", str(dangling)]).exit_code == 0
    assert dangling.is_symlink() and (tmp_path / "reports" / "fresh.json").is_file()


def test_a_loop_of_symlinks_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    """`-o a.json` where a.json -> b.json -> a.json: the shell's `>` fails (too many levels of
    symbolic links); hookcli refused nothing and replaced the link with its report."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.symlink_to(b)
    b.symlink_to(a)
    r = runner.invoke(app, [*TINY, "-o", str(a)])
    assert_one_line_error(r, 2, "loop of symbolic links", "ls -l")
    assert a.is_symlink() and b.is_symlink() and os.readlink(a) == str(b)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json"]


def test_an_output_folder_removed_while_the_model_ran_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """-o gone/r.json, gone/ removed during the pass: an internal error (exit 3, "this is a
    hookcli bug"); it is an unwritable -o (exit 2, one line)."""
    net = tmp_path / "remover.py"
    net.write_text(
        "import os, shutil\nimport torch\n\n\nclass Net(torch.nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n"
        "        self.l = torch.nn.Linear(2, 2)\n\n"
        "    def forward(self, x):\n"
        "        shutil.rmtree(os.environ['HOOKCLI_TEST_GONE'], ignore_errors=True)\n"
        "        return self.l(x)\n"
    )
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.setenv("HOOKCLI_TEST_GONE", str(gone))
    args = ["inspect", f"{net}:Net", "--input", "randn:1x2", "--no-config"]
    r = runner.invoke(app, [*args, "-o", str(gone / "r.json")])
    assert_one_line_error(r, 2, "cannot write", "folder still exists")
    assert not gone.exists()


@pytest.mark.parametrize("option", ["-o", "--save-baseline"])
def test_an_output_that_is_an_input_is_refused(tmp_path: Path, option: str) -> None:
    spec = tmp_path / "x.npy"
    np.save(spec, np.ones((2, 2), dtype=np.float32))
    before = spec.read_bytes()
    args = ["inspect", "examples/tiny/net.py:Net", "--input", str(spec), "--no-config"]
    r = runner.invoke(app, [*args, option, str(spec)])
    assert_one_line_error(r, 2, "also an input of this run")
    assert spec.read_bytes() == before


def test_every_output_kind_replaces_a_regular_file(tmp_path: Path) -> None:
    """One policy: -o, --save-baseline, --save and --save-raw all replace an existing file."""
    files = {n: tmp_path / n for n in ("r.json", "b.json", "s.safetensors", "c.png", "c.npy")}
    for f in files.values():
        f.write_bytes(b"old")
    r = runner.invoke(
        app,
        [
            *TINY,
            *("-o", str(files["r.json"]), "--save-baseline", str(files["b.json"])),
            *("--save", str(files["s.safetensors"])),
        ],
    )
    assert r.exit_code == 0, r.stderr
    cam = ["cam", "resnet18", str(CAT), "-o", str(files["c.png"])]
    r = runner.invoke(app, [*cam, "--save-raw", str(files["c.npy"])])
    assert r.exit_code == 0, r.stderr
    assert all(f.read_bytes() != b"old" for f in files.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files), "no temp files left"


def test_ci_recipe_writes_the_report_and_exits_1(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    args = ["inspect", "tests/support/models.py:NanForward", "--input", "randn:2x4", "--topk", "3"]
    r = runner.invoke(app, [*args, "--fail-on", "nonfinite", "-f", "json", "-o", str(out)])
    assert r.exit_code == 1, r.stderr
    data = _json_ok(out.read_text())
    assert [c["passed"] for c in data["checks"]] == [False]  # type: ignore[index]
    assert "check failed: nonfinite" in r.stderr


def test_nan_predictions_are_null_and_flagged() -> None:
    args = ["inspect", "tests/support/models.py:NanForward", "--input", "randn:2x4", "--topk", "2"]
    r = runner.invoke(app, [*args, "-f", "json"])
    assert r.exit_code == 0, r.stderr
    preds = _json_ok(r.stdout)["predictions"]
    assert preds and all(p["prob"] is None for p in preds)  # type: ignore[union-attr]
    table = runner.invoke(app, args, env={"COLUMNS": "120"})
    assert table.exit_code == 0 and "not finite" in table.stdout


@pytest.mark.parametrize(
    "extra",
    [
        ["grads", "--target", "sum"],
        ["grads", "--loss", "mse:zeros"],
        ["inspect", "--ablate", "fc1=scale:2", "--topk", "3"],
        ["inspect", "--hist", "--profile"],
    ],
    ids=["backward value", "loss value", "ablation", "hist+profile"],
)
def test_nan_anywhere_is_json_null_never_an_internal_error(extra: list[str]) -> None:
    command, *rest = extra
    args = [
        command,
        "tests/support/models.py:NanForward",
        "--input",
        "randn:2x4",
        *rest,
        "-f",
        "json",
    ]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.stderr
    data = _json_ok(r.stdout)
    if command == "grads":
        assert data["backward"]["value"] is None  # type: ignore[index]
    table = runner.invoke(app, args[:-2])
    assert table.exit_code == 0, table.stderr


def test_cam_of_non_finite_activations_draws_and_says_so(tmp_path: Path) -> None:
    out, raw = tmp_path / "c.png", tmp_path / "c.npy"
    args = ["cam", "tests/support/models.py:NanConv", "--input", "randn:1x3x8x8", "-l", "log"]
    r = runner.invoke(app, [*args, "-o", str(out), "--save-raw", str(raw)])
    assert r.exit_code == 0, r.stderr
    assert "64 of 64 map values are NaN/Inf" in r.stderr
    assert out.read_bytes()[:4] == b"\x89PNG" and np.isnan(np.load(raw)).all()


def test_model_prints_go_to_stderr_not_into_json() -> None:
    args = ["inspect", "tests/support/models.py:Talks", "--input", "randn:1x4", "-f", "json"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.stderr
    _json_ok(r.stdout)
    assert "building Talks" in r.stderr and "forward of Talks" in r.stderr
    for command in (["layers", "tests/support/models.py:Talks", "--shapes", "-f", "json"],):
        r = runner.invoke(app, [*command, "--input", "randn:1x4"])
        assert r.exit_code == 0, r.stderr
        _json_ok(r.stdout)


def test_a_model_calling_sys_exit_is_exit_3() -> None:
    r = runner.invoke(app, ["inspect", "tests/support/models.py:Exits", "--input", "randn:1x4"])
    assert_one_line_error(r, 3, "called sys.exit(0)", "remove the sys.exit call")
    r = runner.invoke(
        app, ["inspect", "tests/support/models.py:exits_on_build", "--input", "randn:1x4"]
    )
    assert_one_line_error(r, 3, "exits_on_build()", "SystemExit")


@pytest.mark.parametrize(
    "args",
    [
        ["cam", "tests/support/models.py:Fails", "--input", "randn:1x2", "-o", "{tmp}/c.png"],
        ["inspect", "tests/support/models.py:Fails", "--input", "randn:1x2", "--profile"],
        ["grads", "tests/support/models.py:Fails", "--input", "randn:1x2", "--profile"],
        ["layers", "tests/support/models.py:Fails", "--input", "randn:1x2", "--shapes"],
        [
            "maps",
            "tests/support/models.py:Fails",
            "--input",
            "randn:1x2",
            "-l",
            "ok",
            "-o",
            "{tmp}/m.png",
        ],
    ],
    ids=["cam default-layer search", "inspect --profile", "grads --profile", "layers", "maps"],
)
def test_a_model_failing_in_any_pass_is_exit_3_naming_the_layer(
    tmp_path: Path, args: list[str]
) -> None:
    r = runner.invoke(app, [a.format(tmp=tmp_path) for a in args])
    assert_one_line_error(r, 3, "Fails failed in layer bad", "RuntimeError: boom")
    assert list(tmp_path.iterdir()) == []


def test_a_model_raising_in_its_own_forward_is_not_said_to_fail_in_a_layer(tmp_path: Path) -> None:
    """The model's forward code raises after its layers ran (a check of its own): the message
    said 'failed in layer (model)' and hinted at the input shape, which fit."""
    (tmp_path / "own.py").write_text(
        "from torch import nn\n"
        "class Own(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        self.fc(x)\n"
        "        raise ValueError('its own check failed')\n"
    )
    r = runner.invoke(app, ["inspect", f"{tmp_path}/own.py:Own", "-i", "randn:2x4"])
    assert_one_line_error(r, 3, "Own failed in its own forward (outside its layers)",
                          "ValueError: its own check failed", "HOOKCLI_DEBUG=1")  # fmt: skip
    assert "layer (model)" not in r.stderr and "check the input shape" not in r.stderr
