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

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from typer.testing import CliRunner

import hookcli
from hookcli.cli.app import app
from hookcli.commands.watch.replay import origin_key, replay
from tests.fault_models import AttnNet, DictNet, FaultNet

STEPS = 7
PICK = random.Random(17)  # the fault's step, drawn once per scenario


@dataclass
class Scenario:
    name: str
    expect: tuple[str, str, str, int]  # direction, where, layer, call
    arm: Callable[[Any, Any, bool], None] = lambda m, opt, on: None
    every: int = 1
    model: Callable[[], nn.Module] = FaultNet
    optimizer: str = "sgd"
    data: Callable[[torch.Tensor, bool], torch.Tensor] = lambda x, on: x
    loss: str = "ce"
    autocast: bool = False
    scaler: bool = False
    micro: int = 1  # forwards per optimizer step
    closure: bool = False
    no_optimizer: bool = False
    step: int = field(default=-1)
    delay: int = 0  # the NaN shows this many steps after the fault (the blow-up)


def _set(attr: str, value: Any, off: Any = "") -> Callable[[Any, Any, bool], None]:
    def arm(model: Any, opt: Any, on: bool) -> None:
        obj = model
        *path, last = attr.split(".")
        for p in path:
            obj = getattr(obj, p)
        setattr(obj, last, value if on else off)

    return arm


def _nan_data(x: torch.Tensor, on: bool) -> torch.Tensor:
    if on:
        x = x.clone()
        x[1, 0, 2, 3] = float("nan")
    return x


def _inf_data(x: torch.Tensor, on: bool) -> torch.Tensor:
    if on:
        x = x.clone()
        x[0, 2, 0, 0] = float("inf")
    return x


def _nan_weight(model: Any, opt: Any, on: bool) -> None:
    if on:
        with torch.no_grad():
            model.fc1.weight[3, 4] = float("nan")


def _lr(model: Any, opt: Any, on: bool) -> None:
    if on:
        for g in opt.param_groups:
            g["lr"] = 1e25


def _counter(model: Any, opt: Any, on: bool) -> None:
    if on:  # the counter's next call (this step's first forward) makes NaN
        model.counter.at = int(model.counter.calls) + 1


def _big_fc1(model: Any, opt: Any, on: bool) -> None:
    if on:  # fc1's output leaves float16's range (65504) under autocast
        with torch.no_grad():
            model.fc1.bias += 1e6


FWD = "forward"
BWD = "backward"
SCENARIOS = [
    Scenario("nan-in-data", (FWD, "before", "conv1", 0), data=_nan_data),
    Scenario("inf-in-data", (FWD, "before", "conv1", 0), data=_inf_data, every=3),
    Scenario("nan-activation", (FWD, "layer", "fault_a", 0), _set("fault_a.mode", "nan")),
    Scenario("inf-activation", (FWD, "layer", "fault_b", 0), _set("fault_b.mode", "inf"), every=4),
    Scenario("exp-overflow", (FWD, "layer", "fault_a", 0), _set("fault_a.mode", "exp")),
    Scenario("division-by-zero", (FWD, "layer", "fault_b", 0), _set("fault_b.mode", "div0")),
    Scenario("nan-gradient-only", (BWD, "layer", "fault_b", 0), _set("fault_b.mode", "bwd_nan")),
    Scenario(
        "inf-gradient-only", (BWD, "layer", "fault_a", 0), _set("fault_a.mode", "bwd_inf"), every=5
    ),
    Scenario("sqrt-between-modules", (FWD, "between", "fault_b", 0), _set("sqrt_gap", True, False)),
    Scenario("log0-in-loss", (FWD, "loss", "", 0), loss="log0"),
    Scenario("loss-only-nonfinite", (FWD, "loss", "", 0), loss="log-relu", every=2),
    Scenario("lr-blow-up", (FWD, "layer", "?", 0), _lr, delay=1),
    Scenario("nan-weight", (FWD, "layer", "fc1", 0), _nan_weight, every=2),
    Scenario("fp16-overflow-autocast", (FWD, "layer", "fc1", 0), _big_fc1, autocast=True),
    Scenario(
        "fp16-overflow-gradscaler", (FWD, "layer", "fc1", 0), _big_fc1, autocast=True, scaler=True
    ),
    Scenario(
        "accumulation-second-micro-batch", (FWD, "before", "conv1", 1), data=_nan_data, micro=2
    ),
    Scenario(
        "closure-optimizer", (FWD, "layer", "fault_a", 0), _set("fault_a.mode", "nan"), closure=True
    ),
    Scenario("rng-dependent", (FWD, "layer", "fault_b", 0), _set("fault_b.mode", "rng")),
    Scenario("buffer-dependent", (FWD, "layer", "counter", 0), _counter, every=3),
    Scenario(
        "dict-output",
        (FWD, "layer", "body.fault_a", 0),
        _set("body.fault_a.mode", "nan"),
        model=DictNet,
    ),
    # default selection, every leaf: the NaN is made between attn.qkv and attn.proj
    Scenario("all-masked-attention", (FWD, "between", "attn.proj", 0), model=AttnNet),
    Scenario(
        "adamw-every-10",
        (FWD, "layer", "fault_a", 0),
        _set("fault_a.mode", "nan"),
        optimizer="adamw",
        every=10,
    ),
    Scenario(
        "no-optimizer-step-marks",
        (FWD, "layer", "fault_b", 0),
        _set("fault_b.mode", "nan"),
        no_optimizer=True,
    ),
]
for _s in SCENARIOS:
    _s.step = PICK.randrange(0, STEPS - 1 - _s.delay)
assert len(SCENARIOS) >= 20


def _batches(s: Scenario) -> list[list[dict[str, Any]]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        micro = []
        for _ in range(s.micro):
            y = torch.randint(0, 5, (4,), generator=g)
            if s.model is AttnNet:
                micro.append({"tokens": torch.randn(4, 5, 6, generator=g), "y": y})
            else:
                micro.append({"x": torch.randn(4, 3, 8, 8, generator=g), "y": y})
        out.append(micro)
    return out


def _forward(s: Scenario, model: nn.Module, batch: dict[str, Any], on: bool, i: int) -> Any:
    if s.model is AttnNet:
        mask = torch.zeros(4, 5, dtype=torch.bool)
        if on:
            mask[2] = True  # every key of sample 2 masked
        return model(batch["tokens"], mask=mask)
    x = s.data(batch["x"], on and i == s.micro - 1)  # the last micro-batch
    return model(pixel_values=x) if s.model is DictNet else model(x)


def _loss(s: Scenario, out: Any, y: torch.Tensor, on: bool) -> torch.Tensor:
    logits = (out["logits"] if isinstance(out, dict) else out).float()
    if s.loss == "log0" and on:  # the log of a softmax that underflowed to 0: inf, NaN grads
        return -torch.log(logits.softmax(-1)[torch.arange(len(y)), y]).mean()
    if s.loss == "log-relu" and on:  # log(0) = -inf in the loss; ReLU's backward masks it
        return torch.log(torch.relu(logits)).mean() + F.cross_entropy(logits, y)
    return F.cross_entropy(logits, y)


def _train(s: Scenario, log: Path | None) -> Any:
    torch.manual_seed(0)
    model = s.model()
    model.train()
    params = model.parameters()
    opt = (
        torch.optim.AdamW(params, lr=1e-3)
        if s.optimizer == "adamw"
        else torch.optim.SGD(params, 0.05)
    )
    scaler = torch.amp.GradScaler("cpu") if s.scaler else None
    kw: dict[str, Any] = {"every": s.every, "log": log}
    if not s.no_optimizer:
        kw["optimizer"] = opt
    if scaler is not None:
        kw["scaler"] = scaler
    batches = _batches(s)
    with hookcli.watch(model, **kw) as w:
        for step, micro in enumerate(batches):
            on = step == s.step
            s.arm(model, opt, on)
            opt.zero_grad()

            def closure(micro: list[dict[str, Any]] = micro, on: bool = on) -> torch.Tensor:
                total = torch.zeros(())
                for i, batch in enumerate(micro):
                    with torch.autocast("cpu", dtype=torch.float16, enabled=s.autocast):
                        out = _forward(s, model, batch, on, i)
                        loss = _loss(s, out, batch["y"], on) / len(micro)
                    w.loss(loss)
                    scaled = scaler.scale(loss) if scaler is not None else loss
                    scaled.backward()  # type: ignore[no-untyped-call]
                    total = total + loss.detach()
                return total

            if s.loss == "log0" and on:
                with torch.no_grad():  # softmax: 1 for class 0, exactly 0 for the others
                    fc2 = model.get_submodule("fc2")
                    assert isinstance(fc2, nn.Linear)
                    fc2.bias[1:] = -1e4
            if s.closure:
                opt.step(closure)
            else:
                closure()
                if s.no_optimizer:
                    w.step()  # the step's end: after backward, before the update
                    opt.step()
                elif scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
            if s.loss == "log0" and on:
                break  # the bias stays broken: one fault is enough
    return w


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
    w = _train(s, tmp_path / "run.jsonl")
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
    batches = _batches(s)
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
    w = _train(s, tmp_path / "run.jsonl")
    assert w.nonfinite == []
    assert not (tmp_path / "run.bundle").exists()
    assert [r.step for r in w.records] == [0, 3, 6]


def test_replay_cli_exit_codes_and_json(tmp_path: Path) -> None:
    s = next(x for x in SCENARIOS if x.name == "nan-weight")  # a fault the state dict holds
    _train(s, tmp_path / "run.jsonl")
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
        ["replay", str(tmp_path / "run.bundle"), "--model", "tests.fault_models:FaultNet",
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
