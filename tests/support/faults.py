"""Watched training runs with a fault put in at one step, drawn at random once per scenario:
each scenario's model, optimizer, data and loss, and where its first NaN/Inf must be found
(tests/commands/watch/test_watch_faults.py runs them all); `train` is the training loop."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import hookcli
from tests.support.fault_models import AttnNet, DictNet, FaultNet

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


def fault_batches(s: Scenario) -> list[list[dict[str, Any]]]:
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


def train(s: Scenario, log: Path | None) -> Any:
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
    batches = fault_batches(s)
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
