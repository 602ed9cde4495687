"""Crash isolation (issue 13): a worker that dies of a signal becomes exit 3 and one line naming
the signal and the layer call that was running; Ctrl-C and SIGTERM still stop it cleanly.

These run the real console entry (`python -m hookcli`) in a subprocess: CliRunner runs commands
in-process, where nothing survives a signal. The models kill themselves with os.kill, as a
segfaulting op or the OOM killer would (tests/support/crash_models.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hookcli.runtime import beacon
from hookcli.runtime.supervise import death_message, is_light
from tests.support.entry import argv, calling_main, child_env, run_hookcli
from tests.support.paths import ROOT

MODEL = "tests.support.crash_models:Net"
QUIET = ("inspect", MODEL, "-i", "randn:2x4", "--model-arg", "when=never")  # a run that lives


def one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr and "Fatal Python error" not in stderr, stderr
    return lines[0]


@pytest.mark.parametrize(
    ("how", "words"),
    [
        ("SIGSEGV", "segmentation fault"),
        ("SIGILL", "illegal instruction"),
        ("SIGBUS", "bus error"),
        ("SIGKILL", "out-of-memory killer"),
    ],
)
def test_a_layer_dying_of_a_signal_is_exit_3_naming_the_layer(
    how: str, words: str, tmp_path: Path
) -> None:
    out = tmp_path / "report.json"
    r = run_hookcli(
        "inspect", MODEL, "-i", "randn:2x4", "--model-arg", f"how={how}", "-o", str(out)
    )
    assert r.returncode == 3, (r.returncode, r.stderr)
    line = one_line(r.stderr)
    assert line.startswith(f"error: the run died of {how}"), line
    assert "in layer boom call 0 (forward)" in line and words in line and "Hint: " in line
    assert r.stdout == ""
    assert list(tmp_path.iterdir()) == [], "no output file, no temp file left"


def test_a_death_in_backward_names_the_layer_whose_backward_ran(tmp_path: Path) -> None:
    r = run_hookcli(
        "grads", MODEL, "-i", "randn:2x4", "--model-arg", "when=backward", "--target", "sum"
    )
    assert r.returncode == 3, r.stderr
    line = one_line(r.stderr)
    assert "SIGSEGV" in line and "in the backward of layer boom call 0" in line, line


def test_a_death_while_the_model_is_built_says_so() -> None:
    r = run_hookcli("inspect", "tests.support.crash_models:dies_while_built", "-i", "randn:2x4")
    assert r.returncode == 3, r.stderr
    line = one_line(r.stderr)
    assert (
        "SIGSEGV" in line and "while building tests.support.crash_models:dies_while_built" in line
    )


def test_a_normal_run_is_unchanged_by_the_supervisor(tmp_path: Path) -> None:
    """Same exit code and the same JSON with and without the supervising parent."""
    reports = []
    for env in ({}, {"HOOKCLI_NO_SUPERVISOR": "1"}):
        r = run_hookcli(*QUIET, "-f", "json", env=env)
        assert r.returncode == 0, r.stderr
        reports.append(json.loads(r.stdout)["layers"])
    assert reports[0] == reports[1]


def _started(marker: Path, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 240
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the model never started"
        time.sleep(0.1)


def _waiting_run(marker: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        argv("inspect", MODEL, "-i", "randn:2x4", "--model-arg", f"marker={marker}", *extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=child_env(),
        start_new_session=True,  # its own process group, as a shell job would be
    )


def test_sigterm_to_the_parent_stops_the_worker_and_exits_143(tmp_path: Path) -> None:
    marker = tmp_path / "started"
    out = tmp_path / "out" / "r.json"
    out.parent.mkdir()
    proc = _waiting_run(marker, "-o", str(out))
    _started(marker, proc)
    proc.send_signal(signal.SIGTERM)  # the parent only, as `kill PID` would
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM in layer boom call 0 (forward)" in one_line(err)
    assert list(out.parent.iterdir()) == []


def test_sigint_to_the_parent_alone_is_passed_on(tmp_path: Path) -> None:
    marker = tmp_path / "started"
    proc = _waiting_run(marker)
    _started(marker, proc)
    proc.send_signal(signal.SIGINT)  # `kill -INT PID`, a harness: not the terminal's Ctrl-C
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert one_line(err) == "interrupted"


def test_the_worker_dies_with_a_killed_parent(tmp_path: Path) -> None:
    marker = tmp_path / "started"
    proc = _waiting_run(marker)
    _started(marker, proc)
    worker = int(marker.read_text())
    assert worker != proc.pid
    proc.kill()  # SIGKILL: the parent cannot pass anything on
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 60
    while _alive(worker):
        assert time.monotonic() < deadline, "the worker outlived its parent"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status  # a zombie is dead, waiting to be reaped


def test_an_ignored_sigchld_from_the_launcher_changes_nothing() -> None:
    def ignore_sigchld() -> None:  # as some daemons and shells leave it for their children
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)

    r = subprocess.run(argv(*QUIET, "-f", "json"), capture_output=True, text=True, cwd=ROOT,
                       env=child_env(), check=False, preexec_fn=ignore_sigchld)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["layers"]


def test_a_death_after_the_run_finished_keeps_its_results(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    r = run_hookcli(
        "inspect", "tests.support.crash_models:dies_at_exit", "-i", "randn:2x4", "-o", str(out)
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["layers"]
    assert "warning: the worker died of SIGSEGV while exiting" in r.stderr


def test_ctrl_c_reaches_the_worker_and_exits_130(tmp_path: Path) -> None:
    marker = tmp_path / "started"
    proc = _waiting_run(marker)
    _started(marker, proc)
    os.killpg(proc.pid, signal.SIGINT)  # the terminal signals the whole foreground group
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert one_line(err) == "interrupted"


def test_death_message_places() -> None:
    words = beacon.LastWords("in layer fc call 2 (forward)", "diff side B (bfloat16)", ())
    line = death_message(signal.SIGILL, words)
    assert line.startswith("error: the run died of SIGILL (illegal instruction) in layer fc call 2")
    assert line.count("\n") == 0 and "diff side B (bfloat16)" in line
    assert "ONEDNN_MAX_CPU_ISA" in line
    assert "before any hooked layer ran" in death_message(
        signal.SIGSEGV, beacon.LastWords("", "", ())
    )
    assert death_message(signal.SIGINT, words) == "interrupted"


def test_the_beacon_follows_nested_calls_and_temp_files() -> None:
    light = beacon.Beacon()
    light.phase("building m")
    assert light.last_words() == beacon.LastWords("", "building m", ())
    light.enter("layer a call 0 (forward)")
    light.enter("layer a.b call 0 (forward)")
    assert light.last_words().where == "in layer a.b call 0 (forward)"
    light.leave()
    assert light.last_words().where == "in layer a call 0 (forward)"
    light.leave()
    assert light.last_words().where == "after layer a call 0 (forward) returned"
    light.track("/tmp/x")
    light.track("/tmp/y")
    light.untrack("/tmp/x")
    assert light.last_words().temps == ("/tmp/y",)
    light.at("é" * 5000)  # longer than its page: cut, never spilling into the next one
    assert light.last_words().phase == "building m"


def test_light_calls_are_not_forked() -> None:
    assert is_light([]) and is_light(["--help"]) and is_light(["inspect", "-h"])
    assert is_light(["models"]) and is_light(["--version"])
    assert not is_light(["inspect", "resnet18"])


def test_stdout_that_cannot_take_the_data_is_one_line_and_exit_2() -> None:
    with open("/dev/full", "w") as full:
        r = subprocess.run(argv(*QUIET), stdout=full, stderr=subprocess.PIPE, text=True,
                           cwd=ROOT, env=child_env(), check=False)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "cannot write to standard output: No space left on device" in one_line(r.stderr)


def test_closed_stdout_and_stderr() -> None:
    r = subprocess.run(argv(*QUIET), stderr=subprocess.PIPE, text=True, cwd=ROOT, env=child_env(),
                       check=False, preexec_fn=lambda: os.close(1))  # fmt: skip
    assert r.returncode == 2 and "standard output is closed" in one_line(r.stderr)
    # stderr closed: the usage error still has its exit code (2), not 1
    r = subprocess.run(argv(*QUIET, "--topk", "x"), stdout=subprocess.PIPE, cwd=ROOT,
                       env=child_env(), check=False, preexec_fn=lambda: os.close(2))  # fmt: skip
    assert r.returncode == 2


def test_an_ascii_terminal_gets_escapes_not_a_crash() -> None:
    r = run_hookcli(*QUIET, env={"PYTHONIOENCODING": "ascii"})
    assert r.returncode == 0, r.stderr
    assert "boom" in r.stdout and "internal error" not in r.stderr


@pytest.mark.parametrize(
    ("sides", "named"),
    [
        (["--b", "bfloat16"], "B (bfloat16)"),
        (["--a", "bfloat16", "--b", "float32"], "A (bfloat16)"),
    ],
)
def test_a_death_on_one_diff_side_names_the_side(sides: list[str], named: str) -> None:
    """The sides run side by side, two greenlets (or threads) taking turns: the side named is
    the one whose call was running, the reference's (A) or the compared one's (B)."""
    r = run_hookcli("diff", "tests.support.crash_models:DiesInBfloat16", "-i", "randn:2x4", *sides)
    assert r.returncode == 3, r.stderr
    line = one_line(r.stderr)
    assert "SIGILL" in line and f"in layer boom call 0 (forward), diff side {named}" in line


def _overcommits() -> bool:
    """vm.overcommit_memory=1: a 4 TB allocation succeeds and the OOM killer comes later."""
    try:
        return Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "1"
    except OSError:
        return False


@pytest.mark.skipif(_overcommits(), reason="the kernel grants any allocation (overcommit 1)")
def test_a_building_model_out_of_memory_is_one_line() -> None:
    r = run_hookcli("inspect", "resnet18", "--model-arg", "num_classes=2000000000", "-l", "fc")
    assert r.returncode == 3, r.stderr
    line = one_line(r.stderr)
    assert "building resnet18(num_classes=2000000000) failed" in line
    assert "more memory than there is" in line and "internal error" not in line


def test_seeds_near_the_top_wrap_for_each_input_spec() -> None:
    r = run_hookcli("inspect", "tests/support/models.py:Divide", "-i", "randn:4", "-i", "randn:4",
                "--seed", str(2**64 - 1), "-f", "json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["layers"]


def test_user_text_on_stderr_is_escaped(tmp_path: Path) -> None:
    bad = tmp_path / "cat\x1b[31m\n.jpeg"
    r = run_hookcli("inspect", "resnet18", str(bad))
    assert r.returncode == 2
    line = one_line(r.stderr)
    assert "\x1b" not in r.stderr and "\\x1b[31m\\n.jpeg" in line


def test_the_working_directory_is_importable_from_the_console_script() -> None:
    """docs/usage.md: pkg.mod:Name from the current directory, as with `python -m`."""
    script = Path(sys.executable).with_name("hookcli")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([str(script), "layers", "tests.support.crash_models:Net"],
                       capture_output=True, text=True, cwd=ROOT, env=env, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "boom" in r.stdout


ATEXIT_MODEL = """
import atexit, os
from torch import nn

def _mark():
    with open(os.environ["HOOKCLI_TEST_MARK"], "w") as f:
        f.write("ran")

atexit.register(_mark)

class Deep(nn.Sequential):
    def __init__(self):
        super().__init__(*[nn.Linear(4, 4) for _ in range(300)])
"""


@pytest.mark.parametrize("supervised", [True, False], ids=["worker", "in-process"])
def test_the_quick_exit_still_flushes_and_runs_atexit(tmp_path: Path, supervised: bool) -> None:
    """The CLI ends a torch process with os._exit (no ~0.7 s teardown): a piped output far
    larger than the pipe's buffer still arrives whole, the exit code is the command's, and the
    atexit handlers still run (logging, multiprocessing, a model's own)."""
    (tmp_path / "atexit_model.py").write_text(ATEXIT_MODEL)
    mark = tmp_path / "mark"
    env = {"HOOKCLI_TEST_MARK": str(mark)}
    if not supervised:
        env["HOOKCLI_NO_SUPERVISOR"] = "1"
    r = run_hookcli("inspect", "atexit_model:Deep", "-i", "randn:2x4", "-f", "json", cwd=tmp_path,
                env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert len(r.stdout) > 1 << 17
    assert len(json.loads(r.stdout)["layers"]) == 300
    assert mark.read_text() == "ran"
    failing = run_hookcli("check", "atexit_model:Deep", "-i", "randn:2x4", "--max-abs", "1e-9",
                      cwd=tmp_path, env=env)  # fmt: skip
    assert failing.returncode == 1, failing.stderr


def test_a_program_calling_main_itself_gets_control_back(tmp_path: Path) -> None:
    """The quick exit is for hookcli's own process only: a program that imported torch and
    calls hookcli.cli.main() catches its SystemExit and goes on."""
    code = (
        "import sys, torch\n"
        "from hookcli.cli import main\n"
        "sys.argv = ['hookcli', 'inspect', 'tests.support.crash_models:Net', '-i', 'randn:2x4',\n"
        "            '--model-arg', 'when=never', '-f', 'json']\n"
        "try:\n    main()\nexcept SystemExit as exc:\n    print('caught', exc.code)\n"
    )
    r = calling_main(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip().endswith("caught 0")


# ---------------------------------------------------------------- issue 32: gates that cannot fail


@pytest.mark.parametrize("how", ["exec", "exit"])
def test_a_model_that_ends_or_replaces_the_process_fails_the_gate(how: str) -> None:
    """A model that exec()s a program exiting 0, or leaves with os._exit(0): the run never
    finished, so check is not a pass on nothing."""
    r = run_hookcli(
        "check", "tests.support.crash_models:Ends", "--model-arg", f"how={how}", "-i", "randn:2x4",
        "--fail-on", "nonfinite", "--no-config",
    )  # fmt: skip
    assert r.returncode == 3, (r.stdout, r.stderr)
    line = one_line(r.stderr)
    assert "before it finished" in line and "nothing was checked" in line, line
    assert "PASS" not in r.stdout


def test_a_model_whose_forked_child_comes_back_gives_one_report() -> None:
    r = run_hookcli(
        "inspect", "tests.support.crash_models:Ends", "--model-arg", "how=fork", "-i", "randn:2x4",
        "-f", "json", "--no-config",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    json.loads(r.stdout)  # one document: a second report would make this fail
    assert r.stdout.count('"schema"') == 1


def test_a_model_ignoring_sigterm_is_still_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "started"
    proc = subprocess.Popen(
        argv("check", "tests.support.crash_models:Ends", "--model-arg", "how=term",
             "--model-arg", f"marker={marker}", "-i", "randn:2x4", "--fail-on", "nonfinite"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**child_env(), "HOOKCLI_STOP_GRACE_S": "2"}, start_new_session=True,
    )  # fmt: skip
    _started(marker, proc)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, (out, err)
    assert "stopped by SIGTERM" in one_line(err)
    assert "PASS" not in out
    assert time.monotonic() - t0 < 25  # killed after the grace, not after the model's 30 s
