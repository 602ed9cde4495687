"""Watch logs for reading back: a real run's rank logs emulated in one process (the model
DistributedDataParallel would train on each shard, gradients averaged), the comparison of
merged rank logs with one process's log, and hand-made log lines (a step, a layer call, a
parameter, a tensor's statistics)."""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

import hookcli
from hookcli.commands.watch import logread
from hookcli.records import StepLine, TensorStats
from tests.support.shardcmp import zeros_slack
from tests.support.watch import Tiny, tiny_batches

STATS = ("mean", "std", "min", "max", "norm")


# ---------------------------------------------------------------- building logs


def train_watched(
    model: torch.nn.Module, batches: Sequence[Any], log: Path, every: int = 1
) -> None:
    """SGD with momentum over the batches, watched into `log` (every `every` steps)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with hookcli.watch(model, optimizer=opt, every=every, log=log) as w:
        for x, y in batches:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            w.loss(loss)
            loss.backward()
            opt.step()


def _as_rank(log: Path, rank: int, world: int) -> None:
    """A log written in one process, marked as rank `rank` of `world` (as torchrun's are)."""
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    for d in lines:
        d.update(rank=rank, world_size=world)
    log.write_text("".join(json.dumps(d) + "\n" for d in lines))


def emulated_ddp(
    tmp_path: Path, steps: int = 3, world: int = 2, *, all_reduce: bool = True
) -> tuple[list[Path], Path]:
    """The same training twice from the same weights: one process over whole batches, and
    `world` models each on its shard of every batch with their parameter gradients averaged
    before the step, as DistributedDataParallel does (all_reduce=False: left local).
    Returns the rank logs and the single process's log."""
    torch.manual_seed(0)
    base = Tiny()
    batches = tiny_batches(steps)
    single = tmp_path / "single.jsonl"
    train_watched(copy.deepcopy(base), batches, single)
    models = [copy.deepcopy(base) for _ in range(world)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    logs = [tmp_path / f"run.rank{r}.jsonl" for r in range(world)]
    with contextlib.ExitStack() as stack:
        watches = [
            stack.enter_context(hookcli.watch(m, optimizer=o, log=p))
            for m, o, p in zip(models, opts, logs, strict=True)
        ]
        for x, y in batches:
            for m, o, w, xs, ys in zip(
                models, opts, watches, x.chunk(world), y.chunk(world), strict=True
            ):
                o.zero_grad()
                loss = F.cross_entropy(m(xs), ys)
                w.loss(loss)
                loss.backward()
            if all_reduce:
                for ps in zip(*(m.parameters() for m in models), strict=True):
                    mean = torch.stack([p.grad for p in ps]).mean(0)
                    for p in ps:
                        p.grad.copy_(mean)
            for o in opts:
                o.step()
    for r, log in enumerate(logs):
        _as_rank(log, r, world)
    return logs, single


def _close(a: float | None, b: float | None, scale: float, rtol: float) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return abs(a - b) <= rtol * (abs(b) + scale) + 1e-12


def _tensors_match(
    got: Iterable[TensorStats], want: Iterable[TensorStats], where: str, rtol: float
) -> None:
    got, want = list(got), list(want)
    assert [t.path for t in got] == [t.path for t in want], where
    for g, w in zip(got, want, strict=True):
        here = f"{where} {w.path}"
        assert (g.shape, g.numel, g.nan, g.inf) == (w.shape, w.numel, w.nan, w.inf), here
        slack = zeros_slack(where.rsplit(" ", 1)[-1], w.shape, w.numel)
        if slack and g.zeros is not None and w.zeros is not None:
            assert abs(g.zeros - w.zeros) <= slack + 1e-12, (here, g.zeros, w.zeros)
        else:
            assert _close(g.zeros, w.zeros, 0.0, 1e-9), (here, g.zeros, w.zeros)
        # a mean near 0 is judged against the spread (as tests/support/oracles.py judges statistics)
        scale = abs(w.std or 0.0)
        for k in STATS:
            a, b = getattr(g, k), getattr(w, k)
            assert _close(a, b, scale if k == "mean" else 0.0, rtol), (here, k, a, b)


def assert_same_run(
    merged: Sequence[StepLine], single: Sequence[StepLine], rtol: float = 1e-5
) -> None:
    """Step by step, the merged rank logs equal one process's log: every layer call's input,
    output and gradient statistics, every parameter's norms and update ratio, the loss."""
    assert [s.step for s in merged] == [s.step for s in single]
    for m, s in zip(merged, single, strict=True):
        step = f"step {s.step}"
        assert _close(m.loss, s.loss, 0.0, rtol), (step, m.loss, s.loss)
        assert [(c.name, c.call) for c in m.layers] == [(c.name, c.call) for c in s.layers]
        for mc, sc in zip(m.layers, s.layers, strict=True):
            for kind in logread.KINDS:
                got, want = getattr(mc, kind), getattr(sc, kind)
                if want is None:
                    assert got is None, (step, sc.name, kind)
                    continue
                _tensors_match(got, want, f"{step} {sc.name} {kind}", rtol)
        assert [p.name for p in m.params] == [p.name for p in s.params]
        for mp, sp in zip(m.params, s.params, strict=True):
            where = f"{step} {sp.name}"
            for k in ("norm", "update_norm", "update_ratio"):
                a, b = getattr(mp, k), getattr(sp, k)
                assert _close(a, b, 0.0, rtol), (where, k, a, b)
            assert mp.grad is not None and sp.grad is not None, where
            _tensors_match([mp.grad], [sp.grad], where, rtol)


def read_lines(path: Path) -> list[dict[str, Any]]:
    """A log's lines, as JSON."""
    return [json.loads(x) for x in path.read_text().splitlines()]


def read_steps(path: Path) -> list[StepLine]:
    """A log's step lines as records, each read by step_line (every field's type checked)."""
    return [logread.step_line(d) for d in read_lines(path) if d["kind"] == "step"]


# ---------------------------------------------------------------- hand-made lines


def tensor_dict(
    path: str = "out",
    *,
    mean: float = 0.0,
    std: float = 1.0,
    zeros: float = 0.0,
    norm: float = 8.0,
    nan: int = 0,
    inf: int = 0,
    numel: int = 64,
) -> dict[str, Any]:
    return {
        "path": path, "shape": [1, numel], "dtype": "float32", "numel": numel, "mean": mean,
        "std": std, "min": -1.0, "max": 1.0, "zeros": zeros, "nan": nan, "inf": inf,
        "norm": norm, "note": None, "layout": None,
    }  # fmt: skip


def call_dict(
    name: str,
    type_: str = "Linear",
    *,
    out: dict[str, Any] | None = None,
    grad: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "name": name, "type": type_, "call": 0, "inputs": [tensor_dict("in[0]")],
        "outputs": [out or tensor_dict()], "grad_outputs": [grad or tensor_dict(norm=1.0)],
        "grad_inputs": None, "error": None,
    }  # fmt: skip


def param_dict(
    name: str = "fc.weight",
    *,
    grad_norm: float = 1.0,
    ratio: float | None = 1e-3,
    grad: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "name": name, "norm": 10.0, "grad": grad or tensor_dict(f"{name}.grad", norm=grad_norm),
        "update_norm": None if ratio is None else ratio * 10.0, "update_ratio": ratio,
    }  # fmt: skip


def step_dict(
    step: int,
    layers: list[dict[str, Any]] | None = None,
    params: list[dict[str, Any]] | None = None,
    loss: float | None = 1.0,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "schema": 1, "kind": "step", "step": step, "rank": 0, "world_size": 1, "loss": loss,
        "layers": layers if layers is not None else [call_dict("fc"), call_dict("act", "ReLU")],
        "params": params if params is not None else [param_dict()], "nonfinite_origins": [],
        **extra,
    }  # fmt: skip


def write_log(tmp_path: Path, lines: Iterable[dict[str, Any]], name: str = "run.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(d) + "\n" for d in lines))
    return path
