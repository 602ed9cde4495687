"""hookcli.watch (issue 17, item 1): a watched optimizer step's statistics equal torch's on the
same batch and weights (outputs by independent hooks, gradients by torch.autograd.grad, update
ratios by hand from the weights before and after opt.step()); unwatched steps carry no hook;
gradient accumulation counts each forward; the log is one JSON line per watched step."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import hookcli
from hookcli.errors import UsageError

LEAVES = ["conv", "act", "fc"]


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.act = nn.ReLU()
        self.fc = nn.Linear(4 * 8 * 8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.act(self.conv(x)).flatten(1))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(6, 3, 8, 8, generator=g), torch.randint(0, 5, (6,), generator=g))
        for _ in range(n)
    ]


def _oracle(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, dict[str, float]]:
    """Each leaf's output statistics and output-gradient norm, and each parameter's gradient
    norm: independent forward hooks and torch.autograd.grad, in float64."""
    outs: dict[str, torch.Tensor] = {}
    handles = [
        getattr(model, n).register_forward_hook(lambda m, a, o, n=n: outs.setdefault(n, o))
        for n in LEAVES
    ]
    try:
        loss = F.cross_entropy(model(x), y)
    finally:
        for h in handles:
            h.remove()
    names = list(outs)
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(loss, [outs[n] for n in names] + list(params.values()))
    got: dict[str, dict[str, float]] = {}
    for n, g in zip(names, grads[: len(names)], strict=True):
        o = outs[n].detach().double()
        got[n] = {
            "mean": float(o.mean()),
            "std": float(o.std(correction=0)),
            "norm": float(o.norm()),
            "grad_norm": float(g.double().norm()),
        }
    for (n, _), g in zip(params.items(), grads[len(names) :], strict=True):
        got[n] = {"grad_norm": float(g.double().norm())}
    got["loss"] = {"value": float(loss.detach())}
    return got


def test_a_watched_step_equals_torch_on_the_same_batch_and_weights(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    log = tmp_path / "run.jsonl"
    before: dict[int, nn.Module] = {}
    weights: dict[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}
    with hookcli.watch(model, optimizer=opt, every=2, log=log) as w:
        for step, (x, y) in enumerate(_batches(4)):
            before[step] = copy.deepcopy(model)
            w_before = {n: p.detach().clone() for n, p in model.named_parameters()}
            loss = F.cross_entropy(model(x), y)
            w.loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
            weights[step] = (w_before, {n: p.detach().clone() for n, p in model.named_parameters()})
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 2] == [r["step"] for r in w.records]
    batches = _batches(4)
    for record in lines:
        step = record["step"]
        want = _oracle(before[step], *batches[step])
        assert record["loss"] == pytest.approx(want["loss"]["value"], rel=1e-6)
        calls = {c["name"]: c for c in record["layers"]}
        assert sorted(calls) == sorted(LEAVES)
        for name in LEAVES:
            out, grad = calls[name]["outputs"][0], calls[name]["grad_outputs"][0]
            for key in ("mean", "std", "norm"):
                assert out[key] == pytest.approx(want[name][key], rel=1e-5, abs=1e-7), (name, key)
            assert grad["norm"] == pytest.approx(want[name]["grad_norm"], rel=1e-5)
        w_before, w_after = weights[step]
        for p in record["params"]:
            assert p["grad"]["norm"] == pytest.approx(want[p["name"]]["grad_norm"], rel=1e-5)
            a, b = w_after[p["name"]].double(), w_before[p["name"]].double()
            ratio = float((a - b).norm() / b.norm())
            assert p["update_ratio"] == pytest.approx(ratio, rel=1e-6)


def test_unwatched_steps_carry_no_hook_and_everything_is_removed_after() -> None:
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    with hookcli.watch(model, optimizer=opt, every=3) as w:
        for x, y in _batches(5):
            below = [m for m in model.modules() if m is not model]
            hooked = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in below)
            # the model itself: the two root hooks that keep the step's batch, every step
            assert (len(model._forward_pre_hooks), len(model._forward_hooks)) == (1, 1)
            seen.append((w.watching, hooked))
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    assert [s[0] for s in seen] == [True, False, False, True, False]
    assert all((n > 0) == watched for watched, n in seen)
    assert all(
        not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks
        for m in model.modules()
    )
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert [r["step"] for r in w.records] == [0, 3]


def test_gradient_accumulation_is_one_step_with_every_forward() -> None:
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = _batches(4)
    with hookcli.watch(model, optimizer=opt, layers=["fc"]) as w:
        for i in range(0, 4, 2):  # two micro-batches per optimizer step
            opt.zero_grad()
            for x, y in batches[i : i + 2]:
                (F.cross_entropy(model(x), y) / 2).backward()
            opt.step()
    assert [r["step"] for r in w.records] == [0, 1]
    for r in w.records:
        assert [(c["name"], c["call"]) for c in r["layers"]] == [("fc", 0), ("fc", 1)]


def test_without_an_optimizer_step_marks_the_steps() -> None:
    torch.manual_seed(0)
    model = Tiny()
    with hookcli.watch(model, every=2, layers="fc") as w:
        for x, y in _batches(3):
            F.cross_entropy(model(x), y).backward()
            w.step()
    assert [r["step"] for r in w.records] == [0, 2]
    assert all(r["params"] == [] for r in w.records)


def test_bad_arguments_are_one_line_errors(tmp_path: Path) -> None:
    model = Tiny()
    with pytest.raises(UsageError, match="every must be 1 or more"):
        hookcli.watch(model, every=0)
    with pytest.raises(UsageError, match="no layer matches 'nope'"):
        hookcli.watch(model, layers=["nope"])
    with pytest.raises(UsageError, match=r"needs an nn\.Module"):
        hookcli.watch("resnet18")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hookcli.watch(model, optimizer=opt) as w, pytest.raises(UsageError, match="step hooks"):
        w.step()
    with (
        pytest.raises(UsageError, match="cannot write the watch log"),
        hookcli.watch(model, log=tmp_path / "missing" / "run.jsonl"),
    ):
        pass
