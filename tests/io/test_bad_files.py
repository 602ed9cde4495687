"""Bad files and bad paths (issue 13's bad-input round): no run may destroy a file it reads or
another output, special outputs are written through, temp files cannot outlive the process,
and every unreadable, hostile or absurd input is one line and exit 2 — never "internal error"."""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from PIL import Image
from typer.testing import CliRunner, Result

from hookcli.cli import app
from hookcli.errors import UsageError
from hookcli.io import config, output
from hookcli.runtime import beacon
from tests.support.cli import assert_one_line_error
from tests.support.paths import CAT, ROOT

runner = CliRunner()
NET = ROOT / "examples" / "tiny" / "net.py"
TINY = ["examples/tiny/net.py:Net", "--input", "ones:2x2", "--no-config"]


def invoke(*args: str | Path) -> Result:
    """The CLI in-process; whatever the outcome, never the internal-error text."""
    result = runner.invoke(app, [str(a) for a in args])
    assert "internal error" not in result.stderr, result.stderr
    return result


def _net_copy(tmp_path: Path) -> Path:
    net = tmp_path / "net.py"
    shutil.copy(NET, net)
    return net


def _hookcli(*args: str | Path, **kwargs: object) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(  # type: ignore[call-overload, no-any-return]
        [sys.executable, "-m", "hookcli", *map(str, args)],
        cwd=ROOT,
        check=False,
        timeout=300,
        **kwargs,
    )


# ---------------------------------------------------------------- 1. inputs are never outputs


def test_the_model_source_is_not_overwritten(tmp_path: Path) -> None:
    net = _net_copy(tmp_path)
    before = net.read_bytes()
    r = invoke("inspect", f"{net}:Net", "--input", "ones:2x2", "--no-config", "-o", net)
    assert_one_line_error(r, 2, "also an input of this run", "choose another output path")
    assert net.read_bytes() == before


def test_a_loss_target_file_is_not_overwritten(tmp_path: Path) -> None:
    target = tmp_path / "t.pt"
    torch.save(torch.ones(2, 10), target)
    before = target.read_bytes()
    r = invoke("grads", *TINY, "--loss", f"mse:{target}", "--save-baseline", target)
    assert_one_line_error(r, 2, "--save-baseline", "also an input of this run")
    assert target.read_bytes() == before


def test_a_diff_sides_weights_file_is_not_overwritten(tmp_path: Path) -> None:
    from examples.tiny.net import Net

    weights = tmp_path / "w.pt"
    torch.save(Net().state_dict(), weights)
    before = weights.read_bytes()
    r = invoke("diff", *TINY, "--b", f"float64,weights={weights}", "-o", weights)
    assert_one_line_error(r, 2, "also an input of this run")
    assert weights.read_bytes() == before


def test_a_read_the_up_front_check_missed_still_stops_the_write(tmp_path: Path) -> None:
    """The registry is checked again just before the rename: a reader that registered its
    file during the run (here by hand) still cannot have it replaced."""
    output.begin()
    victim = tmp_path / "data.json"
    victim.write_text("precious")
    dest = output.claim(victim, "-o")
    assert dest is not None
    output.note_read(victim)  # as a reader does when it opens the file
    with pytest.raises(UsageError, match="also an input of this run"):
        output.write_text(dest, "report")
    assert victim.read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.json"], "no temp file left"


def test_an_image_inside_an_input_folder_is_not_overwritten(tmp_path: Path) -> None:
    folder = tmp_path / "imgs"
    folder.mkdir()
    image = folder / "a.png"
    Image.new("RGB", (8, 8), "red").save(image)
    before = image.read_bytes()
    r = invoke("maps", "resnet18", folder, "-l", "conv1", "--no-config", "-o", image)
    assert_one_line_error(r, 2, "also an input of this run", "imgs")
    assert image.read_bytes() == before


# ---------------------------------------------------------------- 2. /dev/stdout and friends

_JSON = ["inspect", *TINY, "-f", "json"]


def test_dev_stdout_appended_to_a_log_keeps_the_log(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    log.write_text("earlier lines\n")
    with open(log, "ab") as out:  # the shell's `>> run.log`
        done = _hookcli(*_JSON, "-o", "/dev/stdout", stdout=out, stderr=subprocess.PIPE)
    assert done.returncode == 0, done.stderr.decode()
    text = log.read_text()
    assert text.startswith("earlier lines\n"), text[:200]
    assert '"schema": 2' in text


def test_dev_stdout_as_a_pipe_works() -> None:
    done = _hookcli(*_JSON, "-o", "/dev/stdout", capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    assert b'"schema": 2' in done.stdout


@pytest.mark.parametrize("form", ["/dev/fd/{fd}", "/proc/self/fd/{fd}"])
def test_an_open_descriptor_is_written_through(tmp_path: Path, form: str) -> None:
    log = tmp_path / "side.log"
    log.write_text("kept\n")
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    try:
        done = _hookcli(*_JSON, "-o", form.format(fd=fd), pass_fds=(fd,), capture_output=True)
    finally:
        os.close(fd)
    assert done.returncode == 0, done.stderr.decode()
    assert log.read_text().startswith("kept\n") and '"schema": 2' in log.read_text()
    assert log.is_file() and not log.is_symlink()


def test_dev_stdout_in_process_goes_to_stdout() -> None:
    r = invoke(*_JSON, "-o", "/dev/stdout")
    assert r.exit_code == 0, r.stderr
    assert '"schema": 2' in r.stdout


# ---------------------------------------------------------------- 3. two outputs on one path


@pytest.mark.parametrize(
    ("first", "second"),
    [("--save", "--save-baseline"), ("--save", "-o"), ("-o", "--save-baseline")],
)
def test_two_outputs_on_one_path_are_refused_before_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first: str, second: str
) -> None:
    import hookcli.commands.inspect

    def must_not_run(*a: object, **k: object) -> None:
        raise AssertionError("the model ran although two outputs share a path")

    monkeypatch.setattr(hookcli.commands.inspect, "report", must_not_run)
    out = tmp_path / "x.safetensors"
    out.write_bytes(b"old")
    r = invoke("inspect", *TINY, first, out, second, out)
    assert_one_line_error(r, 2, "one would destroy the other", "own path")
    assert out.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]


def test_two_outputs_through_a_symlink_are_refused(tmp_path: Path) -> None:
    real = tmp_path / "r.json"
    link = tmp_path / "l.json"
    link.symlink_to(real)
    r = invoke("inspect", *TINY, "-o", real, "--save-baseline", link)
    assert_one_line_error(r, 2, "one would destroy the other")
    assert not real.exists()


# ---------------------------------------------------------------- 4. permission bits


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o755])
def test_a_replaced_report_keeps_its_permission_bits(tmp_path: Path, mode: int) -> None:
    report = tmp_path / "r.json"
    report.write_text("old")
    report.chmod(mode)
    r = invoke("inspect", *TINY, "-o", report)
    assert r.exit_code == 0, r.stderr
    assert report.read_text() != "old"
    assert stat.S_IMODE(report.stat().st_mode) == mode


def test_a_new_report_gets_the_umask_mode(tmp_path: Path) -> None:
    umask = os.umask(0o027)
    try:
        r = invoke("inspect", *TINY, "-o", tmp_path / "new.json")
    finally:
        os.umask(umask)
    assert r.exit_code == 0, r.stderr
    assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == 0o640


# ---------------------------------------------------------------- 5. temp files

_KILLER = """
import os, signal
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(2, 5)
        self.l2 = nn.Linear(5, 3)

    def forward(self, x):
        h = self.l1(x)
        os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer, mid-run
        return self.l2(h)
"""


def test_a_killed_save_leaves_no_temp_file(tmp_path: Path) -> None:
    model = tmp_path / "killer.py"
    model.write_text(_KILLER)
    out = tmp_path / "out" / "s.safetensors"
    out.parent.mkdir()
    done = _hookcli(
        "inspect", f"{model}:Net", "--input", "ones:1x2", "--no-config", "--save", out,
        capture_output=True,
    )  # fmt: skip
    assert done.returncode != 0, done.stdout
    assert list(out.parent.iterdir()) == [], "a temp file outlived the process"


def test_the_save_data_file_has_no_name_while_the_run_goes(tmp_path: Path) -> None:
    from hookcli.io.saving import TensorSaver

    dest = output.claim(tmp_path / "s.safetensors", "--save", suffix=".safetensors")
    assert dest is not None
    saver = TensorSaver(dest, {"format": "pt"})
    saver.add("x", torch.arange(6.0).reshape(2, 3))
    assert list(tmp_path.iterdir()) == [], "a named temp file beside the target"
    saver.close()
    from safetensors.torch import load_file

    assert torch.equal(
        load_file(str(tmp_path / "s.safetensors"))["x"], torch.arange(6.0).reshape(2, 3)
    )
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]


def test_the_output_temp_file_is_tracked_until_renamed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = beacon.Beacon()
    monkeypatch.setattr(beacon, "_beacon", shared)
    dest = output.claim(tmp_path / "r.txt", "-o")
    assert dest is not None
    seen: list[tuple[str, ...]] = []

    def fill(tmp: str) -> None:
        seen.append(shared.last_words().temps)
        assert tmp in shared.last_words().temps
        Path(tmp).write_text("data")

    output.write_with(dest, fill)
    assert seen and len(seen[0]) == 1
    assert shared.last_words().temps == (), "untracked once renamed"
    assert (tmp_path / "r.txt").read_text() == "data"


# ---------------------------------------------------------------- 6. raster formats only

_EPS = b"""%!PS-Adobe-3.0 EPSF-3.0
%%BoundingBox: 0 0 8 8
%%EndComments
newpath 0 0 moveto 8 0 lineto 8 8 lineto closepath fill
showpage
%%EOF
"""


def test_an_eps_input_never_runs_ghostscript(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from PIL import EpsImagePlugin

    def no_ghostscript(*a: object, **k: object) -> None:
        raise AssertionError("Ghostscript ran on a user's file")

    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", no_ghostscript)
    eps = tmp_path / "logo.eps"
    eps.write_bytes(_EPS)
    r = invoke("inspect", "examples/tiny/net.py:Net", eps, "--no-config")
    assert_one_line_error(r, 2, "logo.eps is EPS", "convert it to PNG or JPEG")
    assert eps.read_bytes() == _EPS


# ---------------------------------------------------------------- 7. pickled tensor files

UNPICKLED: list[str] = []


class Payload:
    """What a hostile .pt might carry: unpickling it would run __setstate__."""

    def __setstate__(self, state: object) -> None:
        UNPICKLED.append("ran")


@pytest.mark.parametrize("where", ["input", "loss"])
def test_a_pickled_tensor_file_is_one_line_and_never_unpickled(tmp_path: Path, where: str) -> None:
    bad = tmp_path / "x.pt"
    torch.save({"t": torch.ones(2, 10), "obj": Payload()}, bad)
    if where == "input":
        r = invoke("inspect", "examples/tiny/net.py:Net", "--input", bad, "--no-config")
    else:
        r = invoke("grads", *TINY, "--loss", f"mse:{bad}")
    assert_one_line_error(r, 2, "x.pt", "pickled Python objects", "torch.save(tensor")
    assert "weights_only=False" not in r.stderr
    assert UNPICKLED == []


# ---------------------------------------------------------------- 8. config files


def test_a_pyproject_only_mentioning_the_table_is_not_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\n# hookcli reads [tool.hookcli] if present; we have none\n'
    )
    monkeypatch.chdir(tmp_path)
    r = invoke("inspect", f"{NET}:Net", "--input", "ones:2x2", "-f", "json")
    assert r.exit_code == 0, r.stderr
    assert "config" not in r.stderr


def test_a_pyproject_with_the_table_is_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "pyproject.toml").write_text(
        f'[project]\nname = "x"\n\n[tool.hookcli]\nmodel = "{NET}:Net"\ninput = "ones:2x2"\n'
    )
    monkeypatch.chdir(tmp_path)
    r = invoke("inspect", "-f", "json")
    assert r.exit_code == 0, r.stderr
    assert "pyproject.toml" in r.stderr


def test_a_non_utf8_config_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "hookcli.toml").write_bytes(b'model = "caf\xe9"\n')
    monkeypatch.chdir(tmp_path)
    r = invoke("inspect", "--input", "ones:2x2")
    assert_one_line_error(r, 2, "hookcli.toml is not UTF-8", "0xe9", "save it as UTF-8")


def test_another_users_config_in_a_parent_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    planted = tmp_path / "hookcli.toml"
    victim = tmp_path / "project" / "notes.txt"
    victim.parent.mkdir()
    victim.write_text("mine")
    planted.write_text(f'output = "{victim}"\n')
    real_owner = config._owner
    monkeypatch.setattr(config, "_owner", lambda p: 4242 if p == planted else real_owner(p))
    monkeypatch.chdir(victim.parent)
    r = invoke("inspect", f"{NET}:Net", "--input", "ones:2x2")
    assert_one_line_error(r, 2, "belongs to another user (uid 4242)", "--no-config")
    assert victim.read_text() == "mine"
    # named explicitly, the user has said they trust it
    r = invoke("inspect", f"{NET}:Net", "--input", "ones:2x2", "--config", planted, "-f", "json")
    assert r.exit_code == 0, r.stderr
    assert victim.read_text().lstrip().startswith("{")


def test_own_and_root_configs_are_applied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "hookcli.toml").write_text(f'model = "{NET}:Net"\ninput = "ones:2x2"\n')
    monkeypatch.chdir(tmp_path)
    for owner in (0, os.getuid()):
        monkeypatch.setattr(config, "_owner", lambda p, o=owner: o)
        r = invoke("inspect", "-f", "json")
        assert r.exit_code == 0, r.stderr


# ---------------------------------------------------------------- 9. pipes as inputs


def _pipe(data: bytes) -> tuple[int, threading.Thread]:
    """A `<(…)` argument: the read end's number, and the thread feeding it."""
    read, write = os.pipe()

    def feed() -> None:
        with open(write, "wb") as w:
            w.write(data)

    thread = threading.Thread(target=feed, daemon=True)
    thread.start()
    return read, thread


def test_an_image_from_a_pipe_is_read(tmp_path: Path) -> None:
    fd, feeder = _pipe(CAT.read_bytes())
    try:
        piped = invoke("inspect", "resnet18", f"/dev/fd/{fd}", "-l", "conv1", "--no-config",
                       "-f", "json")  # fmt: skip
    finally:
        feeder.join(timeout=10)
        os.close(fd)
    assert piped.exit_code == 0, piped.stderr
    direct = invoke("inspect", "resnet18", CAT, "-l", "conv1", "--no-config", "-f", "json")
    import json

    a, b = json.loads(piped.stdout), json.loads(direct.stdout)
    assert a["layers"][0]["outputs"] == b["layers"][0]["outputs"]


def test_an_endless_device_is_refused_not_read_to_the_end() -> None:
    r = invoke("inspect", "resnet18", "/dev/zero", "-l", "conv1", "--no-config")
    assert_one_line_error(r, 2, "/dev/zero gives more than 256 MiB")


def test_pipe_bytes_are_kept_for_one_run_only(tmp_path: Path) -> None:
    from hookcli.inputs.images import _image_source

    fifo = tmp_path / "img"
    os.mkfifo(fifo)
    feeder = threading.Thread(target=fifo.write_bytes, args=(CAT.read_bytes(),))
    feeder.start()
    output.begin()
    first = _image_source(fifo)
    feeder.join(timeout=10)
    assert isinstance(first, io.BytesIO) and first.getvalue() == CAT.read_bytes()
    assert _image_source(fifo).getvalue() == CAT.read_bytes(), "read once in a run"  # type: ignore[union-attr]
    output.begin()  # a new run reads the pipe anew: nothing of the last run's bytes
    assert str(fifo) not in output.registry().piped


def test_a_config_from_a_pipe_is_read() -> None:
    fd, feeder = _pipe(f'model = "{NET}:Net"\ninput = "ones:2x2"\nformat = "json"\n'.encode())
    try:
        r = invoke("inspect", "--config", f"/dev/fd/{fd}")
    finally:
        feeder.join(timeout=10)
        os.close(fd)
    assert r.exit_code == 0, r.stderr
    assert '"schema": 2' in r.stdout


# ---------------------------------------------------------------- 10. long output names


def test_a_250_character_output_name_is_written(tmp_path: Path) -> None:
    out = tmp_path / ("r" * 245 + ".json")
    assert len(out.name) == 250
    r = invoke("inspect", *TINY, "-o", out)
    assert r.exit_code == 0, r.stderr
    assert out.is_file()
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


# ---------------------------------------------------------------- 11. unreadable model files


def test_a_model_file_that_is_a_folder_is_exit_2(tmp_path: Path) -> None:
    (tmp_path / "net.py").mkdir()
    r = invoke("inspect", f"{tmp_path}/net.py:Net", "--input", "ones:2x2", "--no-config")
    assert_one_line_error(r, 2, "net.py is a folder", "give the .py file")


def test_an_unreadable_model_file_is_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    net = _net_copy(tmp_path)
    real_open_code = io.open_code

    def refuse(path: str) -> object:  # chmod 000 as seen by a user who is not root
        if Path(path) == net:
            raise PermissionError(13, "Permission denied", path)
        return real_open_code(path)

    monkeypatch.setattr(io, "open_code", refuse)
    r = invoke("inspect", f"{net}:Net", "--input", "ones:2x2", "--no-config")
    assert_one_line_error(r, 2, "cannot read model file", "Permission denied", "permissions")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a chmod 000 file")
def test_a_chmod_000_model_file_is_exit_2(tmp_path: Path) -> None:
    net = _net_copy(tmp_path)
    net.chmod(0)
    r = invoke("inspect", f"{net}:Net", "--input", "ones:2x2", "--no-config")
    assert_one_line_error(r, 2, "cannot read model file")


def test_a_model_file_failing_on_import_stays_exit_3(tmp_path: Path) -> None:
    # a definition that fails (issue 32: top-level calls are not run, definitions are)
    bad = tmp_path / "bad.py"
    bad.write_text("class Net:\n    data = open('/nonexistent/data.bin')\n")
    r = invoke("inspect", f"{bad}:Net", "--input", "ones:2x2", "--no-config")
    assert_one_line_error(r, 3, "importing", "FileNotFoundError")


# ---------------------------------------------------------------- 12. unknown users, meta tensors

NOUSER = "~hookcli_no_such_user_13"


@pytest.mark.parametrize(
    "args",
    [
        ["inspect", "resnet18", f"{NOUSER}/x.jpg"],
        ["inspect", *TINY[:1], "--input", f"{NOUSER}/x.pt"],
        ["inspect", *TINY, "-o", f"{NOUSER}/r.json"],
        ["inspect", "resnet18", "--weights", f"{NOUSER}/w.pt"],
        ["inspect", f"{NOUSER}/net.py:Net", "--input", "ones:2x2"],
    ],
    ids=["image", "tensor file", "output", "weights", "model file"],
)
def test_tilde_of_an_unknown_user_is_one_line(args: list[str]) -> None:
    r = invoke(*args) if "--no-config" in args else invoke(*args, "--no-config")
    assert_one_line_error(r, 2, "no user 'hookcli_no_such_user_13'", "in full")


def test_a_meta_tensor_input_is_one_line(tmp_path: Path) -> None:
    meta = tmp_path / "m.pt"
    torch.save(torch.empty(2, 2, device="meta"), meta)
    r = invoke("inspect", "examples/tiny/net.py:Net", "--input", meta, "--no-config")
    assert_one_line_error(r, 2, "m.pt holds a meta tensor", "torch.save")


# ---------------------------------------------------------------- 13. absurd images


def test_a_1x5000_strip_is_refused_naming_its_size(tmp_path: Path) -> None:
    strip = tmp_path / "strip.png"
    Image.new("RGB", (1, 5000), "white").save(strip)
    r = invoke("inspect", "examples/tiny/net.py:Net", strip, "--no-config")
    assert_one_line_error(r, 2, "strip.png is 1x5000", "256x1280000", "megapixels", "crop it")


def _strip_and_photo(tmp_path: Path) -> Path:
    """A folder of a 1x5000 strip (its resize would make gigabytes) and an ordinary image."""
    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.new("RGB", (1, 5000), "white").save(folder / "strip.png")
    Image.new("RGB", (64, 48), "gray").save(folder / "ok.png")
    return folder


def test_a_folder_run_skips_a_strip_naming_its_size(tmp_path: Path) -> None:
    folder = _strip_and_photo(tmp_path)
    r = invoke("inspect", "resnet18", folder, "-l", "fc", "--batch-size", "1", "--no-config")
    assert r.exit_code == 0, r.stderr
    assert "strip.png (1x5000" in r.stdout and "256x1280000" in r.stdout
    r = invoke("inspect", "resnet18", folder, "-l", "fc", "--batch-size", "1", "--strict")
    assert_one_line_error(r, 2, "strip.png is 1x5000")


def test_a_one_batch_folder_skips_a_strip_as_a_run_in_batches_does(tmp_path: Path) -> None:
    """Two images (one batch): the strip ended the whole run with exit 2, while --batch-size
    skipped and named it; skipped and named alike now (--strict: refused)."""
    folder = _strip_and_photo(tmp_path)
    r = invoke("inspect", "resnet18", folder, "-l", "fc", "--no-config", "-f", "json")
    assert r.exit_code == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["input"]["shapes"] == [[1, 3, 224, 224]]
    (note,) = [n for n in report["notes"] if n.startswith("skipped")]
    assert "strip.png (1x5000" in note and "256x1280000" in note
    r = invoke("inspect", "resnet18", folder, "-l", "fc", "--strict", "--no-config")
    assert_one_line_error(r, 2, "strip.png is 1x5000")


def test_a_folder_run_of_a_custom_model_skips_a_strip_too(tmp_path: Path) -> None:
    """hookcli's own ImageNet preprocessing (custom models) resizes too: same guard."""
    folder = _strip_and_photo(tmp_path)
    r = invoke("inspect", f"{ROOT}/tests/support/models.py:TwoBranches", folder,
               "--batch-size", "1", "--no-config")  # fmt: skip
    assert r.exit_code == 0, r.stderr
    assert "strip.png (1x5000" in r.stdout and "256x1280000" in r.stdout


def test_an_ordinary_wide_image_still_runs(tmp_path: Path) -> None:
    wide = tmp_path / "wide.png"
    Image.new("RGB", (900, 200), "white").save(wide)
    r = invoke("inspect", "resnet18", wide, "-l", "conv1", "--no-config")
    assert r.exit_code == 0, r.stderr


# ---------------------------------------------------------------- 14. absurd spec sizes


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("randn:4294967296x4294967296", "18,446,744,073,709,551,616 elements"),
        ("randn:2147483648", "2,147,483,648 elements (8.0 GiB"),
        ("zeros:65536x65536", "4,294,967,296 elements"),
        ("ones:" + "9" * 5000, "thousands of digits"),
    ],
    ids=["wraps in int64", "off by one", "zeros", "too many digits"],
)
def test_an_absurd_spec_size_is_refused_naming_the_limit(spec: str, needle: str) -> None:
    r = invoke("inspect", "examples/tiny/net.py:Net", "--input", spec, "--no-config")
    hint = [] if "digits" in needle else ["the limit is 2,147,483,647"]
    assert_one_line_error(r, 2, needle, *hint)


def test_a_spec_just_under_the_limit_is_not_refused_by_the_check() -> None:
    from hookcli.inputs.specs import spec_shape

    assert spec_shape("zeros:2147483647", "2147483647") == (2147483647,)
    with pytest.raises(UsageError):
        spec_shape("zeros:2147483648", "2147483648")


# ---------------------------------------------------------------- 15. BaseException in a factory

_FACTORIES = """
from torch import nn


class Boom(BaseException):
    pass


def boom():
    raise Boom("the factory blew up")


def generator_exit():
    raise GeneratorExit("closed early")


def interrupted():
    raise KeyboardInterrupt
"""


@pytest.mark.parametrize(
    ("factory", "needle"),
    [("boom", "raised Boom: the factory blew up"), ("generator_exit", "raised GeneratorExit")],
)
def test_a_factory_raising_a_base_exception_is_exit_3(
    tmp_path: Path, factory: str, needle: str
) -> None:
    model = tmp_path / "factories.py"
    model.write_text(_FACTORIES)
    r = invoke("inspect", f"{model}:{factory}", "--input", "ones:2x2", "--no-config")
    assert_one_line_error(r, 3, f"factories.py:{factory}()", needle, "constructor")


def test_a_module_raising_a_base_exception_on_import_is_exit_3(tmp_path: Path) -> None:
    model = tmp_path / "explodes.py"
    model.write_text(
        "class Boom(BaseException):\n    pass\n\n"
        "class Net:\n    def later(self):\n        pass\n\n    raise Boom('at import')\n"
    )
    r = invoke("inspect", f"{model}:Net", "--input", "ones:2x2", "--no-config")
    assert_one_line_error(r, 3, "importing", "Boom: at import")


def test_a_factory_interrupted_is_still_130(tmp_path: Path) -> None:
    model = tmp_path / "factories.py"
    model.write_text(_FACTORIES)
    r = invoke("inspect", f"{model}:interrupted", "--input", "ones:2x2", "--no-config")
    assert r.exit_code == 130, r.stderr
