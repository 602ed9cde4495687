"""The CLI's start-up runs without the cyclic collector (runtime/gcpause.py); the Python API
leaves the collector as it found it."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch

import hookcli
from hookcli.runtime import gcpause
from hookcli.sources import load_model
from tests.conftest import CAT
from tests.test_supervise import calling_main
from tests.test_supervise import hookcli as run_hookcli


@pytest.fixture
def collector_restored() -> Iterator[None]:
    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    yield
    gcpause._paused[0] = False
    if gc.get_freeze_count() > frozen:
        gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


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


@pytest.mark.usefixtures("collector_restored")
def test_the_api_never_touches_the_collector() -> None:
    gc.enable()
    frozen = gc.get_freeze_count()
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    hookcli.inspect(model, torch.randn(2, 4), device="cpu", topk=0)
    hookcli.inspect("resnet18", str(CAT), device="cpu", topk=0)
    assert gc.isenabled() and gc.get_freeze_count() == frozen


def test_the_cli_worker_runs_its_passes_with_the_collector_on(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Through the console entry (fork, worker): a model whose forward checks the collector."""
    (tmp_path / "gcprobe.py").write_text(
        "import gc, torch\n"
        "class Probe(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(4, 2)\n"
        "    def forward(self, x):\n"
        "        assert gc.isenabled() and gc.get_freeze_count() > 0\n"
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
