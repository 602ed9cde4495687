"""hookcli.watch split by job (issue 50, item 6): the step clock on its own — which step, when
its gradients are complete and when it ends, told by a real optimizer's step hooks, a closure
optimizer and a scaler's update() — and the first NaN/Inf's pieces that need no training run
(where the bundle goes, the stderr line); and the step probes the recorder hands each watched
step to."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hookcli
from hookcli.commands.watch.clock import StepClock
from hookcli.commands.watch.nonfinite import bundle_dir, stderr_line
from hookcli.engine.probes import StepArmed, StepProbe
from hookcli.errors import UsageError
from hookcli.records import NonfiniteLine, Origin, StepLine


class _Events:
    """A clock whose callbacks note what they saw: (event, step index, whether a gradient was
    there), advancing the clock when a step ends as the watch does."""

    def __init__(self, every: int, optimizer: Any = None, scaler: Any = None) -> None:
        self.seen: list[tuple[str, int, Any]] = []
        self.params: list[nn.Parameter] = []
        self.clock = StepClock(
            every, optimizer=optimizer, scaler=scaler, grads=self.grads, ended=self.ended
        )

    def grads(self, optimizer: Any, skipped: bool) -> None:
        has_grad = all(p.grad is not None for p in self.params) if self.params else None
        self.seen.append(("grads", self.clock.index, (optimizer is not None, skipped, has_grad)))

    def ended(self) -> None:
        self.seen.append(("end", self.clock.index, self.clock.watched))
        self.clock.advance()


def _model() -> tuple[nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(3, 2), torch.randn(4, 3)


def test_the_clock_counts_optimizer_steps_and_says_which_are_watched() -> None:
    model, x = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ev = _Events(3, optimizer=opt)
    ev.params = list(model.parameters())
    ev.clock.attach()
    for _ in range(5):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    ev.clock.detach()
    # each step: gradients ready (from the optimizer, not skipped, all there), then its end;
    # steps 0 and 3 of every=3 are watched
    assert ev.seen == [
        e for i in range(5) for e in (("grads", i, (True, False, True)), ("end", i, i in (0, 3)))
    ]
    opt.step()  # detached: no hook left on the optimizer
    assert len(ev.seen) == 10 and ev.clock.index == 5
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_a_closure_optimizer_reads_the_gradients_once_after_the_first_call() -> None:
    """LBFGS calls its closure several times inside step(): the gradients are complete when
    the first call returns (not before: the closure runs backward), and read once."""
    model, x = _model()
    opt = torch.optim.LBFGS(model.parameters(), max_iter=4)
    ev = _Events(1, optimizer=opt)
    ev.params = list(model.parameters())
    calls = []

    def closure() -> torch.Tensor:
        calls.append(ev.seen.copy())
        opt.zero_grad()
        loss = (model(x) ** 2).sum()
        loss.backward()
        return loss

    ev.clock.attach()
    opt.step(closure)
    opt.step(closure=closure)  # by keyword too
    ev.clock.detach()
    assert len(calls) > 2  # the closure ran again: its later calls are not a new step
    assert calls[0] == []  # nothing read before the first call
    assert ev.seen == [
        ("grads", 0, (True, False, True)),
        ("end", 0, True),
        ("grads", 1, (True, False, True)),
        ("end", 1, True),
    ]


class _Scaler:
    """What the clock asks of a GradScaler: an update() that ends each step."""

    def __init__(self) -> None:
        self.updates = 0

    def update(self) -> None:
        self.updates += 1


def test_a_scalers_update_ends_every_step_the_skipped_ones_too() -> None:
    model, x = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = _Scaler()
    ev = _Events(2, optimizer=opt, scaler=scaler)
    ev.clock.attach()
    assert "update" in vars(scaler)
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()  # a step the scaler let through: its end is the update, not the step
    assert ev.seen == [("grads", 0, (True, False, None))]
    scaler.update()
    scaler.update()  # the next step was skipped: no optimizer step ran before this update
    ev.clock.detach()
    assert ev.seen == [
        ("grads", 0, (True, False, None)),
        ("end", 0, True),
        ("grads", 1, (False, True, None)),
        ("end", 1, False),
    ]
    assert scaler.updates == 2 and "update" not in vars(scaler)  # the class's method again


def test_a_scalers_own_update_comes_back_and_w_step_marks_steps() -> None:
    scaler = _Scaler()
    own: list[int] = []
    scaler.update = lambda: own.append(1)  # type: ignore[method-assign]
    ev = _Events(1, scaler=scaler)
    ev.clock.attach()
    scaler.update()
    ev.clock.detach()
    assert own == [1] and ev.seen[-1] == ("end", 0, True)
    assert scaler.update() is None and own == [1, 1]  # the instance's own, not ours
    ev.clock.step()  # Watch.step() without an optimizer
    assert ev.seen[-2:] == [("grads", 1, (False, False, None)), ("end", 1, True)]


def test_where_the_bundle_goes(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    assert bundle_dir(None, log, 0, 1) == tmp_path / "run.bundle"
    assert bundle_dir(True, log, 1, 2) == tmp_path / "run.bundle"  # next to the rank's log
    assert bundle_dir(None, None, 0, 1) is None
    assert bundle_dir(False, log, 0, 1) is None
    assert bundle_dir(tmp_path / "b", log, 1, 2) == tmp_path / "b.rank1"
    assert bundle_dir(str(tmp_path / "b{rank}"), None, 3, 4) == tmp_path / "b3"
    with pytest.raises(UsageError, match="bundle=True needs a log= path"):
        bundle_dir(True, None, 0, 1)


def test_the_stderr_line_of_the_first_nonfinite() -> None:
    origin = Origin("forward", "fc", "Linear", 0, "out", 2, 0)
    line = NonfiniteLine(
        step=7, rank=0, world_size=1, found=["loss", "grad"], origins=[origin], bundle="b"
    )
    assert stderr_line(line) == (
        "hookcli.watch: NaN/Inf in the loss, grad at step 7: forward: first at fc (Linear) "
        "call 0, output out: 2 NaN. Bundle: b (hookcli replay)."
    )
    line = NonfiniteLine(step=0, rank=0, world_size=1, found=["output"])
    assert stderr_line(line) == (
        "hookcli.watch: NaN/Inf in the output at step 0: no layer call held it on the re-run."
    )


class _Noted(StepProbe):
    """A step probe that notes when the recorder tells it what (and the line it is given)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def arm(self, armed: StepArmed) -> None:
        self.seen.append(f"arm {armed.device}")

    def forward_began(self) -> None:
        self.seen.append("forward")

    def forward_ended(self) -> None:
        self.seen.append("returned")

    def ended(self) -> None:
        self.seen.append("ended")

    def finish(self, record: StepLine, optimizer: Any) -> None:
        self.seen.append(f"finish {record.step} {optimizer is not None}")

    def disarm(self) -> None:
        self.seen.append("disarm")


def test_the_recorder_hands_each_watched_step_to_its_step_probes() -> None:
    """A step probe (engine/probes.StepProbe, as watch(memory=True)'s StepMemory) is armed
    when a watched step begins, told of each forward (two here: gradient accumulation),
    closed before the step's calls complete, given the step's line and disarmed; the steps
    between watched ones never reach it, and the watch closing lets go of it again."""
    model, x = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    noted = _Noted()
    w = hookcli.watch(model, optimizer=opt, every=2)
    w._capture.probes = (noted,)
    with w:
        for _ in range(3):
            opt.zero_grad()
            for half in x.chunk(2):
                model(half).sum().backward()
            opt.step()
    step = ["arm cpu", "forward", "returned", "forward", "returned", "ended"]
    watched = [*step, "finish 0 True", "disarm", *step, "finish 2 True", "disarm"]
    assert noted.seen == [*watched, "disarm"]  # the watch closing disarms once more
    assert [r.step for r in w.records] == [0, 2]
