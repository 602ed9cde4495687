"""hookcli.watch (issue 17, item 1): a watched optimizer step's statistics equal torch's on the
same batch and weights (outputs by independent hooks, gradients by torch.autograd.grad, update
ratios by hand from the weights before and after opt.step()); unwatched steps carry no hook;
gradient accumulation counts each forward; the log is one JSON line per watched step."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import hookcli
from hookcli.commands.watch.logread import step_line
from hookcli.commands.watch.replay import replay
from hookcli.errors import UsageError
from hookcli.records import NonfiniteLine, log_line
from tests.support import models
from tests.support.watch import Tiny, tiny_batches

LEAVES = ["conv", "act", "fc"]


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
        for step, (x, y) in enumerate(tiny_batches(4)):
            before[step] = copy.deepcopy(model)
            w_before = {n: p.detach().clone() for n, p in model.named_parameters()}
            loss = F.cross_entropy(model(x), y)
            w.loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
            weights[step] = (w_before, {n: p.detach().clone() for n, p in model.named_parameters()})
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 2] == [r.step for r in w.records]
    # each record is its line: the same data, read back as the same record
    assert lines == [log_line(r) for r in w.records]
    assert [step_line(d) for d in lines] == list(w.records)
    batches = tiny_batches(4)
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
        for x, y in tiny_batches(5):
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
    assert [r.step for r in w.records] == [0, 3]


def test_gradient_accumulation_is_one_step_with_every_forward() -> None:
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = tiny_batches(4)
    with hookcli.watch(model, optimizer=opt, layers=["fc"]) as w:
        for i in range(0, 4, 2):  # two micro-batches per optimizer step
            opt.zero_grad()
            for x, y in batches[i : i + 2]:
                (F.cross_entropy(model(x), y) / 2).backward()
            opt.step()
    assert [r.step for r in w.records] == [0, 1]
    for r in w.records:
        assert [(c.name, c.call) for c in r.layers] == [("fc", 0), ("fc", 1)]


def test_without_an_optimizer_step_marks_the_steps() -> None:
    torch.manual_seed(0)
    model = Tiny()
    with hookcli.watch(model, every=2, layers="fc") as w:
        for x, y in tiny_batches(3):
            F.cross_entropy(model(x), y).backward()
            w.step()
    assert [r.step for r in w.records] == [0, 2]
    assert all(r.params == [] for r in w.records)


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


def test_a_watched_step_equals_hookcli_grads_on_the_same_batch_and_weights() -> None:
    """The recorder and `hookcli.grads` measure with the same engine: on the same weights and
    batch (loss ce:2 for every sample) every statistic agrees."""
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    before = {}
    data = tiny_batches(3)
    with hookcli.watch(model, optimizer=opt, every=2) as w:
        for step, (x, _) in enumerate(data):
            before[step] = copy.deepcopy(model)
            opt.zero_grad()
            F.cross_entropy(model(x), torch.full((len(x),), 2)).backward()
            opt.step()
    for record in w.records:
        step = record.step
        report = hookcli.grads(before[step], data[step][0], loss="ce:2", device="cpu")
        want = {c.name: c for c in report.layers}
        for call in record.layers:
            ref = want[call.name]
            for kind in ("inputs", "outputs", "grad_outputs"):
                for got, exp in zip(getattr(call, kind), getattr(ref, kind), strict=True):
                    for key in ("mean", "std", "min", "max", "norm", "zeros"):
                        want_v = getattr(exp, key)
                        assert getattr(got, key) == pytest.approx(want_v, rel=1e-6, abs=1e-9)
        grads = {f"{c.name}.{p.name}": p.grad_norm for c in report.layers for p in c.params or []}
        for p in record.params:
            assert p.grad.norm == pytest.approx(grads[p.name], rel=1e-6)


@pytest.mark.parametrize("how", ["torch.compile", "module.compile"])
def test_a_compiled_model_watched_steps_run_eager_and_nothing_recompiles(how: str) -> None:
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    records = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = Tiny()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        counter = CompileCounter()
        run: nn.Module = model
        if compiled and how == "torch.compile":
            run = torch.compile(model, backend=counter)  # type: ignore[assignment]
        elif compiled:
            model.compile(backend=counter)
        with hookcli.watch(run, optimizer=opt, every=3) as w:
            for x, y in tiny_batches(7):
                opt.zero_grad()
                loss = F.cross_entropy(run(x), y)
                w.loss(loss)
                loss.backward()
                opt.step()
        records.append(w.records)
        if compiled:
            # compiled once, on the first unwatched step; the watched ones (0, 3, 6) ran the
            # eager module, and going back to the compiled code recompiled nothing
            assert counter.frame_count == 1
            assert model._compiled_call_impl is None or how == "module.compile"
            assert not model._forward_hooks and not model._forward_pre_hooks
    plain, compiled_records = records
    assert [r.step for r in compiled_records] == [0, 3, 6]
    for a, b in zip(plain, compiled_records, strict=True):
        assert a.loss == pytest.approx(b.loss, rel=1e-5)
        for ca, cb in zip(a.layers, b.layers, strict=True):
            assert ca.outputs[0].norm == pytest.approx(cb.outputs[0].norm, rel=1e-5)


def test_gradscaler_skipped_steps_are_steps_and_not_faults() -> None:
    """Under fp16 autocast with a GradScaler whose first scale overflows the gradients, the
    scaler skips optimizer.step(): those steps are counted (scaler.update ends a step), logged
    as skipped, and not taken for a NaN/Inf fault."""
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, backoff_factor=2.0**-10)
    original_update = scaler.update
    with hookcli.watch(model, optimizer=opt, scaler=scaler) as w:
        for x, y in tiny_batches(5):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x).float(), y)
            w.loss(loss)
            scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
            scaler.step(opt)
            scaler.update()
    assert [r.step for r in w.records] == [0, 1, 2, 3, 4]
    skipped = [r.skipped for r in w.records]
    assert skipped[0] is True and skipped[-1] is False
    scales = [r.scale for r in w.records]
    assert scales == sorted(scales, reverse=True)
    assert w.nonfinite == []
    # a skipped step has no parameter update; the update() override is gone after
    assert all(r.params == [] for r in w.records if r.skipped)
    assert "update" not in vars(scaler) and scaler.update == original_update


def test_a_copy_of_a_watched_model_is_not_watched() -> None:
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = tiny_batches(1)[0]
    with hookcli.watch(model, optimizer=opt) as w:
        ema = copy.deepcopy(model)  # the EMA idiom
        ema(x)
        import io

        buf = io.BytesIO()
        torch.save(model, buf)  # a checkpoint of the whole module
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert len(w.records) == 1
    # the copy's calls were not recorded: one call per layer, the watched model's
    assert [(c.name, c.call) for c in w.records[0].layers] == [(n, 0) for n in LEAVES]
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.equal(loaded(x), ema(x))  # the checkpoint loads and runs; its hooks are inert


def test_evaluation_between_steps_is_not_the_steps() -> None:
    """Forwards under no_grad (evaluation) and inside w.paused() are not captured, hooked or
    checked — a NaN in them is not the training step's — and a forward-only loop inside a
    watch keeps at most MAX_FORWARDS forwards per step."""
    from hookcli.commands.watch.nonfinite import MAX_FORWARDS

    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (x, y), (bad, _) = tiny_batches(2)
    bad = bad.clone()
    bad[0, 0, 0, 0] = float("nan")
    with hookcli.watch(model, optimizer=opt) as w:
        with torch.no_grad():
            assert not torch.isfinite(model(bad)).all()
        with w.paused():
            model(bad)  # with autograd, but paused
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        assert w.nonfinite == []
        assert [(c.name, c.call) for c in w.records[0].layers] == [(n, 0) for n in LEAVES]
        for _ in range(MAX_FORWARDS + 5):  # forward-only, no step ends
            model(x)
        assert len(w._step.forwards) == MAX_FORWARDS and w._step.dropped == 5
    assert w._step.forwards == []


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2)])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        out: torch.Tensor = self.head(x)
        return out


def test_regional_compilation_compiles_as_often_watched_or_not() -> None:
    from torch._dynamo.testing import CompileCounter

    frames = []
    for watched in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _Blocks()
        counter = CompileCounter()
        for b in model.blocks:
            b.compile(backend=counter)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        w = hookcli.watch(model, optimizer=opt, every=2 if watched else 10**9)
        with w:
            for _ in range(6):
                opt.zero_grad()
                F.cross_entropy(
                    model(torch.randn(4, 8)), torch.zeros(4, dtype=torch.long)
                ).backward()
                opt.step()
        frames.append(counter.frame_count)
        if watched:
            assert [r.step for r in w.records] == [0, 2, 4]
            assert [c.name for c in w.records[0].layers][-1] == "head"
    assert frames[0] == frames[1]


def test_bundle_replaces_only_a_bundle_and_a_failed_write_does_not_stop_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = Tiny()
    keep = tmp_path / "ckpt"
    keep.mkdir()
    (keep / "model_epoch10.pt").write_text("precious")
    with pytest.raises(UsageError, match="is not a repro bundle"):
        hookcli.watch(model, bundle=keep).__enter__()
    assert (keep / "model_epoch10.pt").read_text() == "precious"
    # a path that cannot be written at NaN time (its folder became a file): noted, training
    # goes on
    blocked = tmp_path / "blocked"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = tiny_batches(1)[0]
    with hookcli.watch(model, optimizer=opt, bundle=blocked / "run.bundle") as w:
        blocked.write_text("a file now")
        opt.zero_grad()
        F.cross_entropy(model(x * float("nan")), y).backward()
        opt.step()
    assert len(w.nonfinite) == 1
    assert w.nonfinite[0].bundle is None
    assert any("no bundle written" in n for n in w.nonfinite[0].notes)
    assert w.nonfinite[0].origins[0].where == "before"
    err = capsys.readouterr().err
    assert len([line for line in err.splitlines() if line.startswith("hookcli.watch")]) == 1


def test_rerun_stops_at_the_models_inputs_and_leaves_their_grad(tmp_path: Path) -> None:
    """An input with a graph of its own (a backbone outside the watched module) and an input
    that requires grad (saliency, adversarial training): the re-run neither backpropagates into
    the outside graph nor adds to the input's .grad."""
    torch.manual_seed(0)
    backbone = nn.Linear(3 * 8 * 8, 3 * 8 * 8)
    model = Tiny()
    opt = torch.optim.SGD([*model.parameters(), *backbone.parameters()], lr=0.1)
    x, y = tiny_batches(1)[0]
    leaf = x.clone().requires_grad_(True)
    with hookcli.watch(model, optimizer=opt, bundle=tmp_path / "b") as w:
        opt.zero_grad()
        feats = backbone(leaf.flatten(1)).view_as(x)
        out = model(feats)
        with torch.no_grad():
            model.fc.bias[0] = float("nan")  # after the forward: NaN in no output … yet
        loss = F.cross_entropy(out * model.fc.bias.sum(), y)
        loss.backward()
        grad_before = leaf.grad.clone()  # type: ignore[union-attr]
        opt.step()
    assert len(w.nonfinite) == 1
    assert not any("raised" in n for n in w.nonfinite[0].notes), w.nonfinite[0].notes
    assert leaf.grad is not None
    assert torch.allclose(leaf.grad.nan_to_num(), grad_before.nan_to_num())


def test_a_model_returning_a_parameter_keeps_no_hook_on_it() -> None:
    class WithVar(Tiny):
        def __init__(self) -> None:
            super().__init__()
            self.log_var = nn.Parameter(torch.zeros(()))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
            return super().forward(x), self.log_var

    model = WithVar()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hookcli.watch(model, optimizer=opt, every=2):
        for x, y in tiny_batches(4):
            opt.zero_grad()
            out, log_var = model(x)
            (F.cross_entropy(out, y) + log_var).backward()
            opt.step()
    assert not model.log_var._backward_hooks


def test_without_an_optimizer_a_backward_only_nan_is_caught() -> None:
    from tests.support.fault_models import Fault

    model = nn.Sequential(nn.Linear(4, 4), Fault(), nn.Linear(4, 2))
    with hookcli.watch(model, every=10) as w:
        for step in range(3):
            model[1].mode = "bwd_nan" if step == 1 else ""
            model(torch.randn(3, 4)).sum().backward()
            w.step()
            model.zero_grad()
    assert len(w.nonfinite) == 1 and w.nonfinite[0].step == 1
    assert (w.nonfinite[0].origins[0].direction, w.nonfinite[0].origins[0].layer) == (
        "backward",
        "1",
    )
    assert w.nonfinite[0].nonfinite_grads == ["0.weight", "0.bias"]


def test_a_nan_gradient_of_an_input_read_outside_the_layer_too_is_not_blamed_on_it(
    tmp_path: Path,
) -> None:
    """h feeds lin and inline code: the NaN in h's gradient is the readers' sum, so the
    recorder (which re-runs the step from its bundle) and replay say so, as grads does."""
    torch.manual_seed(0)
    model = models.SharedSquare().train()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    # the oracle: lin's own contribution to h's gradient is finite, the sum is not
    h = model.fc1(x)
    out = model.lin(h)
    loss = model.head(out + torch.sqrt(h * h)).sum()
    (g_out,) = torch.autograd.grad(loss, out, retain_graph=True)
    assert torch.isfinite(g_out @ model.lin.weight).all()
    (g_h,) = torch.autograd.grad(loss, h)
    assert not torch.isfinite(g_h).all()
    want = ("backward", "shared", "lin", "in[0]")
    (origin,) = hookcli.grads(model, x, device="cpu", target="sum").nonfinite_origins
    assert (origin.direction, origin.where, origin.layer, origin.path) == want
    event = _one_watched_step(models.SharedSquare, [x], tmp_path / "b")
    first = event.origins[0]
    assert (first.direction, first.where, first.layer, first.path) == want
    assert first.nan == int(g_h.isnan().sum())
    (again,) = replay(event.bundle, unpickle=True).nonfinite_origins
    assert (again.direction, again.where, again.layer, again.path) == want
    # two micro-batches a step: the re-run's second backward comes before the first's origin
    # is looked for, and each forward's walk is its own
    first = _one_watched_step(models.SharedSquare, list(x.split(2)), tmp_path / "c").origins[0]
    assert (first.direction, first.where, first.layer, first.path) == want


def _one_watched_step(
    make: Callable[[], nn.Module], batches: list[torch.Tensor], bundle: Path
) -> NonfiniteLine:
    """The one NaN/Inf event of a watched training step over `batches` (gradients
    accumulated), on a fresh model (SGD's step, even at lr 0, makes NaN gradients NaN
    weights)."""
    torch.manual_seed(0)
    model = make().train()
    opt = torch.optim.SGD(model.parameters(), 0.0)
    with hookcli.watch(model, optimizer=opt, bundle=bundle) as w:
        opt.zero_grad()
        for batch in batches:
            loss = model(batch).sum()
            w.loss(loss)
            loss.backward()
        opt.step()
    (event,) = w.nonfinite
    return event


def test_a_batch_that_cannot_be_saved_gives_a_bundle_replay_refuses(tmp_path: Path) -> None:
    class Hooked(Tiny):
        def forward(self, x: torch.Tensor, hook: object = None) -> torch.Tensor:  # type: ignore[override]
            return super().forward(x)

    model = Hooked()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = tiny_batches(1)[0]
    with hookcli.watch(model, optimizer=opt, bundle=tmp_path / "b") as w:
        opt.zero_grad()
        F.cross_entropy(model(x * float("nan"), hook=lambda t: t), y).backward()
        opt.step()
    assert len(w.nonfinite) == 1 and w.nonfinite[0].origins[0].layer == "conv"
    assert any("the batch could not be saved" in n for n in w.nonfinite[0].notes)
    from hookcli.commands.watch.replay import replay

    with pytest.raises(UsageError, match="holds no batch"):
        replay(tmp_path / "b", unpickle=True)


# ---------------------------------------------------------------- issue 32: never hurt training


def _loop(model: nn.Module, log: str | Path, steps: int = 3) -> object:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hookcli.watch(model, optimizer=opt, log=log) as w:
        for x, y in tiny_batches(steps):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
            opt.step()
    return w


def test_a_log_that_cannot_be_written_stops_logging_not_training(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """/dev/full: every write fails with ENOSPC, as on a full disk."""
    torch.manual_seed(0)
    model = Tiny()
    before = [p.detach().clone() for p in model.parameters()]
    w = _loop(model, "/dev/full")
    assert len(w.records) == 3  # type: ignore[attr-defined]
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    err = capsys.readouterr().err
    assert err.count("could not be written") == 1, err
    assert "logging stopped, training goes on" in err


def test_two_runs_watching_one_log_are_told_apart(tmp_path: Path) -> None:
    from hookcli.commands.watch.runmerge import load_run

    log = tmp_path / "run.jsonl"
    torch.manual_seed(0)
    a, b = Tiny(), Tiny()
    opt = torch.optim.SGD(a.parameters(), lr=0.1)
    # a second run into the same log while the first runs: refused when it starts
    with (
        hookcli.watch(a, optimizer=opt, log=log),
        pytest.raises(UsageError, match="another run is watching into"),
    ):
        hookcli.watch(b, log=log).__enter__()
    # a log two runs wrote anyway (where locks do not hold): the reader refuses it
    _loop(Tiny(), log, steps=2)
    lines = log.read_text().splitlines()
    other = json.loads(lines[0]) | {"run": "another", "step": 7}
    log.write_text("\n".join([*lines, json.dumps(other)]) + "\n")
    with pytest.raises(UsageError, match="from another run than line 1: two runs wrote one log"):
        load_run([log])


def test_a_log_on_dev_stdout_keeps_the_jobs_earlier_output(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.support.paths import ROOT

    out = tmp_path / "job.out"
    code = (
        "import torch, hookcli\n"
        "print('earlier output of the job', flush=True)\n"
        "model = torch.nn.Linear(4, 2)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "with hookcli.watch(model, optimizer=opt, log='/dev/stdout'):\n"
        "    for _ in range(2):\n"
        "        opt.zero_grad()\n"
        "        model(torch.randn(3, 4)).sum().backward()\n"
        "        opt.step()\n"
        "print('later output', flush=True)\n"
    )
    with out.open("w") as f:
        done = subprocess.run(
            [sys.executable, "-c", code], stdout=f, stderr=subprocess.PIPE, text=True,
            cwd=ROOT, check=False,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = out.read_text().splitlines()
    assert lines[0] == "earlier output of the job" and lines[-1] == "later output"
    assert [json.loads(x)["step"] for x in lines[1:-1]] == [0, 1]
