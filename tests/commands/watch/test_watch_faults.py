"""hookcli.watch's flight recorder under injected faults (issue 17): NaN/Inf in the data, in a
forward activation, in a backward gradient only, fp16 overflow under autocast (with and without
a GradScaler), a learning-rate blow-up, NaN weights, log(0) in the loss, code between modules,
gradient accumulation, a closure optimizer, RNG- and buffer-dependent faults, dict outputs and
keyword inputs, an all-masked attention row — each at a step drawn at random. In every one
the recorder names the step, the first layer call and the direction, and `replay` of the bundle
it wrote finds the same origin. The expected origin is known by construction (the fault is
put into one module or one line of code); the learning-rate blow-up's, which depends on the
weights, comes from an independent run with plain forward hooks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from typer.testing import CliRunner

from hookcli.cli.app import app
from hookcli.commands.watch.replay import origin_key, replay
from tests.support.faults import FWD, SCENARIOS, Scenario, fault_batches, train


class _Oracle:
    """An independent record of the first non-finite forward output (plain forward hooks on
    every leaf), for the fault whose place is not known in advance (the blow-up)."""

    def __init__(self, model: nn.Module, seen: dict[str, Any]) -> None:
        self.model, self.seen = model, seen
        self.handles: list[Any] = []

    def __enter__(self) -> _Oracle:
        for name, m in self.model.named_modules():
            if name and not list(m.children()):
                self.handles.append(m.register_forward_hook(self._hook(name)))
        return self

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            finite = not isinstance(out, torch.Tensor) or bool(torch.isfinite(out).all())
            if self.seen["layer"] is None and not finite:
                self.seen["layer"] = name

        return hook

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("s", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_the_recorder_names_step_layer_call_and_direction_and_replay_agrees(
    s: Scenario, tmp_path: Path
) -> None:
    direction, where, layer, call = s.expect
    step = s.step + s.delay
    if layer == "?":  # the blow-up: which layer overflows first, from an independent run
        oracle = _oracle_first(s)
        step, layer = oracle
    w = train(s, tmp_path / "run.jsonl")
    assert len(w.nonfinite) == 1, f"{s.name}: no NaN/Inf seen (fault at step {s.step})"
    event = w.nonfinite[0]
    assert event.step == step
    first = event.origins[0]
    assert (first.direction, first.where, first.layer, first.call) == (
        direction,
        where,
        layer,
        call,
    ), event.origins
    # the log holds the event line; the bundle holds the step and the last watched records
    lines = (tmp_path / "run.jsonl").read_text().splitlines()
    assert any('"kind": "nonfinite"' in line for line in lines)
    bundle = tmp_path / "run.bundle"
    assert event.bundle == str(bundle)
    report = replay(bundle, unpickle=True)
    assert report.checks[0].passed, report.checks[0].message
    # replay does not run the loss (backward starts from the gradients it gave)
    recorded = [o for o in event.origins if o.where != "loss"]
    assert [origin_key(o) for o in report.nonfinite_origins] == [origin_key(o) for o in recorded]
    # the same counts: the same batch, RNG and buffers, not merely the same place
    assert [(o.nan, o.inf) for o in report.nonfinite_origins] == [(o.nan, o.inf) for o in recorded]
    if s.loss == "log0":  # the loss first, then the gradient it gave
        assert [(o.direction, o.where, o.layer) for o in event.origins[1:]] == [
            ("backward", "before", "fc2")
        ]


def _oracle_first(s: Scenario) -> tuple[int, str]:
    """The first step and leaf whose forward output is non-finite, by plain hooks."""
    torch.manual_seed(0)
    model = s.model()
    model.train()
    opt = torch.optim.SGD(model.parameters(), 0.05)
    seen: dict[str, Any] = {"layer": None}
    batches = fault_batches(s)
    with _Oracle(model, seen):
        for step, micro in enumerate(batches):
            s.arm(model, opt, step == s.step)
            opt.zero_grad()
            for batch in micro:
                loss = F.cross_entropy(model(batch["x"]), batch["y"])
                if seen["layer"] is not None:
                    return step, seen["layer"]
                loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
    raise AssertionError("the blow-up never made NaN/Inf")


def test_no_fault_no_bundle_and_the_check_costs_no_hook(tmp_path: Path) -> None:
    s = Scenario("clean", (FWD, "layer", "", 0), every=3)
    s.step = -1
    w = train(s, tmp_path / "run.jsonl")
    assert w.nonfinite == []
    assert not (tmp_path / "run.bundle").exists()
    assert [r.step for r in w.records] == [0, 3, 6]


def test_replay_cli_exit_codes_and_json(tmp_path: Path) -> None:
    s = next(x for x in SCENARIOS if x.name == "nan-weight")  # a fault the state dict holds
    train(s, tmp_path / "run.jsonl")
    runner = CliRunner()
    res = runner.invoke(app, ["replay", str(tmp_path / "run.bundle"), "--unpickle", "-f", "json"])
    assert res.exit_code == 0, res.output
    import json

    data = json.loads(res.stdout)
    assert data["command"] == "replay"
    assert data["nonfinite_origins"][0]["layer"] == "fc1"
    assert data["checks"][0]["passed"] is True
    # --model: the class built by hookcli, the bundle's state loaded into it
    res = runner.invoke(
        app,
        ["replay", str(tmp_path / "run.bundle"), "--model", "tests.support.fault_models:FaultNet",
         "-f", "json", "-l", "fc*", "-l", "conv*"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert {c["name"] for c in data["layers"]} == {"conv1", "conv2", "fc1", "fc2"}
    # a bundle whose recorded origin differs: exit 1, stderr says why
    meta = tmp_path / "run.bundle" / "bundle.json"
    text = meta.read_text().replace('"fc1"', '"conv2"')
    meta.write_text(text)
    res = runner.invoke(app, ["replay", str(tmp_path / "run.bundle"), "--unpickle", "-f", "json"])
    assert res.exit_code == 1
    assert "check failed: replay: not the recorded origin" in res.stderr
    # the log of that run fails `hookcli check` at the step, naming where it began
    res = runner.invoke(app, ["check", str(tmp_path / "run.jsonl"), "-f", "json"])
    assert res.exit_code == 1, res.output
    assert f"step {s.step}" in res.stderr and "fc1" in res.stderr
    # not a bundle: exit 2, one line
    res = runner.invoke(app, ["replay", str(tmp_path), "--unpickle"])
    assert res.exit_code == 2
    assert "missing" in res.stderr and len(res.stderr.strip().splitlines()) == 1
