"""The CLI's start-up runs without the cyclic collector, and every pass holds it off
(runtime/gcpause.py); the Python API leaves the collector as it found it."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest
import torch

import hookcli
from hookcli.runtime import gcpause
from hookcli.sources import load_model
from tests.support.entry import calling_main, run_hookcli
from tests.support.paths import CAT


@pytest.fixture
def collector_restored() -> Iterator[None]:
    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    yield
    holds = gcpause.holds.count, gcpause.holds.turned_off
    gcpause.holds.count, gcpause.holds.turned_off = 0, False
    gcpause._paused[0] = False
    if gc.get_freeze_count() > frozen:
        gc.unfreeze()
    (gc.enable if enabled else gc.disable)()
    assert holds == (0, False), "every hold was given back"


@pytest.mark.usefixtures("collector_restored")
def test_pause_turns_the_collector_off_until_a_model_is_built() -> None:
    gc.enable()
    gc.unfreeze()
    gcpause.pause()
    assert not gc.isenabled()
    load_model("resnet18")
    assert gc.isenabled(), "building the model ends start-up"
    assert gc.get_freeze_count() > 0, "what start-up made is frozen"
    gc.unfreeze()
    gcpause.resume()
    assert gc.get_freeze_count() == 0, "a second resume does nothing"


@pytest.mark.usefixtures("collector_restored")
def test_pause_leaves_a_collector_the_user_turned_off_alone() -> None:
    gc.disable()
    gcpause.pause()
    gcpause.resume()
    assert not gc.isenabled() and gc.get_freeze_count() == 0


class Probe(torch.nn.Module):
    """Records whether the collector was on during each forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(gc.isenabled())
        return self.lin(x)


@pytest.mark.usefixtures("collector_restored")
@pytest.mark.parametrize("enabled", [True, False])
def test_the_api_holds_the_collector_off_for_a_pass_and_leaves_it_as_found(enabled: bool) -> None:
    (gc.enable if enabled else gc.disable)()
    frozen = gc.get_freeze_count()
    model = Probe()
    hookcli.inspect(model, torch.randn(2, 4), device="cpu", topk=0)
    hookcli.grads(model, torch.randn(2, 4), device="cpu", topk=0)
    hookcli.inspect("resnet18", str(CAT), device="cpu", topk=0)
    assert model.seen == [False, False], "off while the passes ran"
    assert gc.isenabled() is enabled and gc.get_freeze_count() == frozen


@pytest.mark.usefixtures("collector_restored")
def test_held_passes_overlap_and_the_collector_is_back_when_the_last_ends() -> None:
    """diff runs two passes at once, in two threads: the first to end leaves it off."""
    gc.enable()
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    states: list[bool] = []

    def first() -> None:
        with gcpause.held():
            first_in.set()
            second_in.wait(10)
        first_out.set()

    thread = threading.Thread(target=first)
    thread.start()
    first_in.wait(10)
    with gcpause.held():
        second_in.set()
        first_out.wait(10)
        states.append(gc.isenabled())  # the first pass has ended, this one runs
    thread.join(10)
    assert states == [False] and gc.isenabled()


@pytest.mark.usefixtures("collector_restored")
def test_a_failing_pass_gives_the_collector_back() -> None:
    gc.enable()
    with pytest.raises(RuntimeError), gcpause.held():
        raise RuntimeError("the model failed")
    assert gc.isenabled()
    gc.disable()
    with gcpause.held():
        pass
    assert not gc.isenabled(), "off stays off"


def test_the_cli_worker_runs_its_passes_after_start_up(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Through the console entry (fork, worker): a model whose forward checks that start-up is
    over (its objects frozen, the collector given back) and the pass holds the collector off."""
    (tmp_path / "gcprobe.py").write_text(
        "import gc, torch\n"
        "from hookcli.runtime import gcpause\n"
        "class Probe(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(4, 2)\n"
        "    def forward(self, x):\n"
        "        assert gc.get_freeze_count() > 0 and not gcpause._paused[0]\n"
        "        assert not gc.isenabled() and gcpause.holds.turned_off, 'held off by the pass'\n"
        "        return self.lin(x)\n"
    )
    r = run_hookcli("inspect", "gcprobe:Probe", "-i", "randn:2x4", cwd=tmp_path)  # cwd importable
    assert r.returncode == 0, r.stderr
    assert "lin" in r.stdout


@pytest.mark.usefixtures("collector_restored")
def test_a_command_that_builds_no_model_ends_with_the_collector_back_on() -> None:
    gc.enable()
    frozen = gc.get_freeze_count()
    gcpause.pause()
    gcpause.end()
    assert gc.isenabled() and gc.get_freeze_count() == frozen, "on again, nothing frozen"


@pytest.mark.parametrize("argv", [["--help"], ["layers", "resnet18"]])
def test_a_program_calling_main_keeps_its_collector(argv: list[str]) -> None:
    """main() called by another program (not hookcli's own process) leaves gc as it was."""
    code = (
        "import gc, sys\n"
        "from hookcli.cli import main\n"
        f"sys.argv = ['hookcli', *{argv!r}]\n"
        "try:\n    main()\nexcept SystemExit as exc:\n    code = exc.code\n"
        "print('state', code, gc.isenabled(), gc.get_freeze_count(), file=sys.stderr)\n"
    )
    r = calling_main(code)
    assert r.returncode == 0, r.stderr
    assert "state 0 True 0" in r.stderr, r.stderr


@pytest.mark.usefixtures("collector_restored")
def test_start_up_ending_inside_a_hold_leaves_the_collector_off_until_the_hold_ends() -> None:
    """A one-pass run holds the collector from before its model is built (commands/run.py);
    the CLI's start-up ends while the model is built, inside that hold: the collector must stay
    off for the pass, and be on once the hold ends."""
    gc.enable()
    gcpause.pause()
    with gcpause.held():
        gcpause.resume()  # what load_model does when the model is built
        assert not gc.isenabled(), "still held"
        with gcpause.held():  # the pass's own hold
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled(), "on again once the last hold ended"
