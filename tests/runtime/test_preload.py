"""runtime.preload (issue 37): the statistics' kernels load in a background thread, so a
fresh process's first call measures as its later ones do. Each case runs in a fresh process:
what a process has loaded is the subject."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from hookcli.engine import stats as stats_mod
from hookcli.engine.stats import StatsCollector
from hookcli.runtime import preload

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("numba") is None, reason="numba unavailable"
)


def _fresh(code: str, *, argv0: str = "-c", env: dict[str, str] | None = None) -> dict[str, object]:
    """Run `code` in a fresh Python (sys.argv[0] set first, as the process would have it), and
    return the JSON it prints last."""
    prelude = f"import sys; sys.argv[0] = {argv0!r}\n"
    out = subprocess.run(
        [sys.executable, "-c", prelude + code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


_STATE = """
import json, threading, time
import hookcli
from hookcli.runtime import preload
names = [t.name for t in threading.enumerate()]
loading = preload.started()
preload.wait()
torch_loaded = "torch" in sys.modules
print(json.dumps({"threads": names, "started": loading, "numba": "numba" in sys.modules,
                  "torch": torch_loaded, "finished": preload.finished()}))
"""


def test_import_hookcli_loads_the_kernels_in_the_background_without_torch() -> None:
    got = _fresh(_STATE)
    assert got["started"] and "hookcli-kernels" in got["threads"]  # type: ignore[operator]
    assert got["finished"] and got["numba"]
    assert got["torch"] is False  # the thread never imports torch


@pytest.mark.parametrize(
    ("argv0", "env"),
    [
        ("/usr/bin/hookcli", {}),  # the command: it forks first, and --help loads nothing
        ("-m", {}),  # python -m hookcli, while the package is found
        ("-c", {"HOOKCLI_STATS": "torch"}),  # the statistics on torch ops: nothing to load
    ],
    ids=["the command", "python -m", "HOOKCLI_STATS=torch"],
)
def test_no_load_where_nothing_wants_it(argv0: str, env: dict[str, str]) -> None:
    got = _fresh(_STATE, argv0=argv0, env=env)
    assert got == {**got, "started": False, "numba": False, "torch": False}
    assert "hookcli-kernels" not in got["threads"]  # type: ignore[operator]


@pytest.mark.kernels
def test_the_first_call_finds_the_kernels_loaded_and_its_figures_are_the_oracles() -> None:
    """A fresh process: import hookcli, build a model, then the first inspect (once the load
    has ended) measures with the kernels, and its statistics are float64 torch's."""
    got = _fresh(
        """
import json, torch
import hookcli
from hookcli.engine import stats
from hookcli.runtime import preload
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()).eval()
x = torch.randn(512, 64)
preload.wait()
used = []
original = stats.kernel_row
stats.kernel_row = lambda *a: used.append(1) or original(*a)
report = hookcli.inspect(model, x, device="cpu", layers=["0"])
out = model[0](x).double()
s = report.layers[0].outputs[0]
print(json.dumps({"kernel": len(used), "mean": [s.mean, out.mean().item()],
                  "std": [s.std, out.std(correction=0).item()]}))
"""
    )
    assert got["kernel"]
    for key in ("mean", "std"):
        a, b = got[key]  # type: ignore[misc]
        assert a == pytest.approx(b, rel=1e-12)


def test_a_load_in_flight_is_waited_for_past_the_mark(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the load started but not done, small tensors are measured by torch ops; once the
    process has measured _WAIT_AFTER bytes, the next waits for the load and uses the kernels."""
    release = threading.Event()
    thread = threading.Thread(target=release.wait, daemon=True)
    done = threading.Event()
    monkeypatch.setattr(preload, "_thread", [thread])
    monkeypatch.setattr(preload, "_done", done)
    monkeypatch.setattr(stats_mod, "kernels", _fresh_kernels(done))
    monkeypatch.setattr(stats_mod, "_without_kernels", [0])
    t = torch.randn((1 << 14) + 1)  # (past what the kernels measure later, together)
    monkeypatch.setattr(stats_mod, "_WAIT_AFTER", 3 * t.numel() * 4)
    used: list[str] = []
    for name in ("cpu_row", "kernel_row"):
        original = getattr(stats_mod, name)
        monkeypatch.setattr(
            stats_mod, name, lambda *a, _o=original, _n=name: used.append(_n) or _o(*a)
        )
    collector = StatsCollector()
    for i in range(3):
        collector.add(t + i, f"x{i}")
    assert used == ["cpu_row"] * 3
    threading.Timer(0.2, done.set).start()  # the load ends while the next tensor waits
    collector.add(t + 3, "x3")
    collector.finalize()
    assert used == ["cpu_row"] * 3 + ["kernel_row"] and done.is_set()


def _fresh_kernels(done: threading.Event) -> object:
    """stats.kernels as in a process whose background load is in flight: waits for `done`."""
    import functools

    @functools.cache
    def kernels() -> object:
        done.wait()
        return stats_mod._load_kernels()

    return kernels


def test_loading_the_kernels_leaves_torchs_thread_count_as_the_user_set_it() -> None:
    """numba's OpenMP pool, started when the kernels load, shares the process's OpenMP runtime
    with torch and set its thread count to numba's: a user's torch.set_num_threads(1) became
    numba's count (every logical CPU) from the first pass on, inside the pass and after it.
    The count stays the user's (numba's own stays what it was given: at most torch's)."""
    got = _fresh(
        """
import json, torch
torch.set_num_threads(1)
import hookcli
inside = []
model = torch.nn.Sequential(torch.nn.Linear(4, 4))
model[0].register_forward_hook(lambda m, a, o: inside.append(torch.get_num_threads()))
hookcli.inspect(model, torch.randn(2, 4), device="cpu", stats_backend="kernel")
import numba
print(json.dumps({"inside": inside, "after": torch.get_num_threads(),
                  "numba": numba.get_num_threads(), "most": numba.config.NUMBA_NUM_THREADS,
                  "layer": numba.threading_layer()}))
"""
    )
    if got["most"] == 1 or got["layer"] != "omp":
        pytest.skip("one CPU, or numba's pool not on OpenMP: the user's count cannot move")
    assert got["inside"] == [1] and got["after"] == 1
    assert got["numba"] == 1


def test_a_process_that_ends_during_the_load_waits_for_it(tmp_path: Path) -> None:
    """`python -c "import hookcli"` ends while the thread loads: the process waits for the load
    to finish before it ends (a daemon thread left inside LLVM's C++ as the process's
    destructors run crashed one such process in CI). A slow stand-in load, started as the
    package starts the real one, writes a file when it is done: it is there after the process
    has exited, and the process exited cleanly."""
    done = tmp_path / "done"
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            f"""import sys; sys.argv[0] = "/usr/bin/hookcli"
import pathlib, time
from hookcli.runtime import preload
def load():
    time.sleep(1.0)
    pathlib.Path({str(done)!r}).write_text("loaded")
preload.start(load)
""",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert done.read_text() == "loaded"


def test_what_the_load_imports_while_the_exit_waits_still_shuts_down_first() -> None:
    """The exit waits before the interpreter's exit handlers run: llvmlite, imported by the
    real load during that wait, registers its own handler (it tells llvmlite's finalizers the
    process is ending), and that handler runs. A probe registered before `import hookcli`
    runs after it and sees its flag set."""
    env = {k: v for k, v in os.environ.items() if k != "HOOKCLI_STATS"}
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            """import atexit, sys
def probe():
    common = sys.modules.get("llvmlite.binding.common")
    print("shut down:", None if common is None else common._shutting_down[0])
atexit.register(probe)
import hookcli
""",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "shut down: True"


def test_the_exit_wait_is_bounded_and_nothing_is_waited_for_without_a_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A load stuck elsewhere holds the exit up for the bound, not for ever; with no thread (a
    forked child's list is emptied, or nothing was started) or one that never started, there
    is nothing to wait for."""
    stuck = threading.Event()
    alive = threading.Thread(target=stuck.wait, daemon=True)
    alive.start()
    monkeypatch.setattr(preload, "_thread", [alive])
    monkeypatch.setattr(preload, "_done", threading.Event())
    monkeypatch.setattr(preload, "_EXIT_WAIT", 0.05)
    waited = []
    real_wait = preload._done.wait

    def wait(timeout: float | None = None) -> bool:
        waited.append(timeout)
        return real_wait(timeout)

    monkeypatch.setattr(preload._done, "wait", wait)
    preload._before_exit()
    assert waited == [0.05]
    stuck.set()
    monkeypatch.setattr(preload, "_thread", [])
    preload._before_exit()
    monkeypatch.setattr(preload, "_thread", [threading.Thread(target=lambda: None)])  # unstarted
    preload._before_exit()
    assert waited == [0.05]


def test_a_fork_during_the_load_leaves_a_child_that_runs() -> None:
    """multiprocessing's fork right after `import hookcli`: the fork waits for the load to end
    (no module left half imported in the child), and the child's calls do not wait for a
    thread it does not have."""
    got = _fresh(
        """
import json, os, signal, torch
import hookcli
pid = os.fork()
if pid == 0:
    signal.alarm(120)  # a hang fails the test instead of the run
    report = hookcli.inspect(torch.nn.Linear(4, 4), torch.randn(2, 4), device="cpu")
    os._exit(0 if len(report.layers) == 1 else 1)
_, status = os.waitpid(pid, 0)
print(json.dumps({"status": status}))
"""
    )
    assert got == {"status": 0}


def test_a_fork_the_load_outlasted_leaves_a_child_on_torch_ops() -> None:
    """A fork whose wait for the load ran out (a loaded machine compiling the kernels): the
    child, whose copy of numba's modules may be half imported with their locks held, keeps off
    the kernels and measures with torch ops, exactly, instead of hanging on those locks."""
    got = _fresh(
        """
import json, os, signal, threading, torch
import hookcli
from hookcli.runtime import preload
preload.wait()
stuck = threading.Event()
preload._thread.append(threading.Thread(target=stuck.wait, daemon=True))  # a load in flight
preload._done.clear()
preload._FORK_WAIT = 0.01
pid = os.fork()
if pid == 0:
    signal.alarm(120)  # a hang fails the test instead of the run
    x = torch.randn(2, 4)
    report = hookcli.inspect(torch.nn.Linear(4, 4), x, device="cpu", stats_backend="kernel")
    kept = preload.kept_off()
    os._exit(0 if kept and len(report.layers) == 1 else 1)
_, status = os.waitpid(pid, 0)
print(json.dumps({"status": status, "parent_off": preload.kept_off()}))
"""
    )
    assert got == {"status": 0, "parent_off": False}


def test_a_load_whose_import_was_cut_short_leaves_the_process_on_torch_ops() -> None:
    """The thread's import of numba fails halfway (in CI, once: most likely another thread's
    concurrent import): numba's package is left half built, and importing it again in the
    caller's thread 'works' but the first kernel's compile then fails with "module 'numba' has
    no attribute 'core'" — an internal error. The process measures with torch ops instead,
    exactly, and the load's error is printed under HOOKCLI_DEBUG."""
    got = _fresh(
        """
import json, threading
class _Cut:  # numba.core.decorators fails to import, in the loading thread only
    def find_spec(self, name, path=None, target=None):
        if name == "numba.core.decorators" and threading.current_thread().name == "hookcli-kernels":
            raise ImportError("cut short")
        return None
sys.meta_path.insert(0, _Cut())
import torch
import hookcli
from hookcli.engine import stats
from hookcli.runtime import preload
preload.wait()
model, x = torch.nn.Linear(8, 8), torch.randn(64, 8)
report = hookcli.inspect(model, x, device="cpu", stats_backend="kernel")
s, out = report.layers[0].outputs[0], model(x).double()
print(json.dumps({"failed": preload.failed(), "kernels": stats.kernels() is not None,
                  "mean": [s.mean, out.mean().item()]}))
""",
        env={"HOOKCLI_DEBUG": "1"},
    )
    assert got["failed"] is True and got["kernels"] is False
    a, b = got["mean"]  # type: ignore[misc]
    assert a == pytest.approx(b, rel=1e-12)


def test_hookcli_stats_torch_is_read_at_the_edge_and_no_command_loads_the_kernels() -> None:
    """HOOKCLI_STATS=torch, read once by the package's edge (options.stats_backend_default),
    keeps the kernels off in the whole process: a diff and an inspect (which measure with
    `statistics()` and `kernels()` underneath) run with numba never imported; the engine
    itself reads no environment for it."""
    got = _fresh(
        """
import json, torch
import hookcli
from hookcli.engine import stats
from hookcli.runtime import preload
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
report = hookcli.inspect(model, torch.randn(64, 8), device="cpu", stats_backend="auto")
print(json.dumps({"off": preload.kept_off(), "kernels": stats.kernels() is not None,
                  "numba": "numba" in sys.modules, "layers": len(report.layers)}))
""",
        env={"HOOKCLI_STATS": "torch"},
    )
    assert got == {"off": True, "kernels": False, "numba": False, "layers": 2}
    engine = Path(__file__).resolve().parents[2] / "src" / "hookcli" / "engine"
    assert not [p.name for p in engine.glob("*.py") if "environ" in p.read_text()]
