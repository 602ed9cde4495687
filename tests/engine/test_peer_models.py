"""Other projects' kinds of test models (torchinfo's, TorchLens's) through inspect and grads,
each against an independent oracle: lazy parameters, a scripted child, an LSTM whose
sequence output gets no gradient, layers that rewrite their own buffers, autograd inside
forward, a constant tensor, BaseException in forward, a raising train(), a module cycle.

The models are defined here and loaded by the CLI as tests/engine/test_peer_models.py:Name."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import hookcli
from hookcli.cli import app
from hookcli.engine.stats import StatsCollector
from hookcli.errors import ModelError
from tests.support.cli import assert_one_line_error
from tests.support.oracles import assert_stats_match, captured_outputs, hooks_left

runner = CliRunner()
HERE = "tests/engine/test_peer_models.py"


def run(*args: str) -> Any:
    return runner.invoke(app, list(args))


# ---------------------------------------------------------------- models


class LazyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.LazyLinear(5)
        self.b = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class ScriptedChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.jit.script is deprecated: still in use
            self.mid = torch.jit.script(Inner())
        self.post = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.mid(self.pre(x)))


class ScriptedNorm(nn.Module):
    """A scripted BatchNorm child: in train mode TorchScript updates its running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.bn = torch.jit.script(nn.BatchNorm1d(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.pre(x))  # type: ignore[no-any-return]


class LSTMClassifier(nn.Module):
    """Classifies from the last hidden state; the sequence output only feeds a custom op
    that gives it no gradient (a masking step), so autograd hands its hook None."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 8, batch_first=True)
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq, (h, _) = self.lstm(x)
        return self.fc(MaskedBy.apply(h[-1], seq))  # type: ignore[no-untyped-call]


class MaskedBy(torch.autograd.Function):
    """last, zeroed for sequences that are all zero; no gradient for the sequence."""

    @staticmethod
    def forward(ctx: Any, last: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
        keep = (seq != 0).flatten(1).any(dim=1, keepdim=True)
        ctx.save_for_backward(keep)
        return last * keep

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (keep,) = ctx.saved_tensors
        return grad * keep, None


class Rewrites(nn.Module):
    """Rewrites its buffers in eval mode: in place, by reassignment, and adds one."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("running", torch.zeros(4))
        self.register_buffer("replaced", torch.zeros(4))
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        self.running.mul_(0.9).add_(0.1 * x.detach().mean(0))
        self.replaced = self.replaced + 1
        self.register_buffer("cache", x.detach().sum(0))
        return self.bn(self.lin(x))


class Maml(nn.Module):
    """One inner gradient step inside forward (MAML): torch.autograd.grad in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.lin.weight
        inner = self.lin(x).pow(2).sum()
        (g,) = torch.autograd.grad(inner, w, create_graph=True)
        return self.head(nn.functional.linear(x, w - 0.1 * g, self.lin.bias))


class FrozenMaml(Maml):
    """Differentiates w.r.t. a weight that does not require grad: fails in any mode."""

    def __init__(self) -> None:
        super().__init__()
        self.lin.requires_grad_(False)


class ImageMaml(nn.Module):
    """An image model with a scripted child, a counting buffer and an inner gradient step."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 16, stride=16)
        self.pool = nn.AdaptiveAvgPool2d(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.mid = torch.jit.script(Inner())
        self.head = nn.Linear(4, 3)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x.shape[0]
        h = self.mid(self.pool(self.conv(x)).flatten(1))
        w = self.head.weight
        (g,) = torch.autograd.grad(self.head(h).pow(2).sum(), w, create_graph=True)
        return nn.functional.linear(h, w - 0.1 * g, self.head.bias)


class Constant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fill = Fill()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fill(x)


class Fill(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.full_like(x, 0.1)


class Boom(BaseException):
    pass


class RaisesBase(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ok = nn.Linear(4, 4)
        self.bad = BaseRaiser()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bad(self.ok(x))


class BaseRaiser(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise Boom("boom")


class GenExit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ok = nn.Linear(4, 4)
        self.gen = GenRaiser()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gen(self.ok(x))


class GenRaiser(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise GeneratorExit("closed")


class CtrlC(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ok = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise KeyboardInterrupt


def boom_factory() -> nn.Module:
    raise Boom("factory")


class BadTrain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def train(self, mode: bool = True) -> BadTrain:
        raise RuntimeError("train() refuses")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Cycle(nn.Module):
    """A child holds its parent as a registered submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.child = nn.Sequential(nn.Linear(4, 4))
        self.child.add_module("parent", self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child[0](self.lin(x))


# ---------------------------------------------------------------- helpers


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def no_internal_notes(report: Any) -> None:
    for note in report.notes:
        assert "could not measure" not in note and "NoneType" not in note, note
    for call in report.layers:
        assert call.error is None, (call.name, call.error)


# ---------------------------------------------------------------- 1. lazy parameters


def test_lazy_linear_inspect_and_grads_count_parameters_after_materialisation() -> None:
    x = torch.randn(2, 7)

    def built() -> LazyNet:
        torch.manual_seed(1)  # `b` is initialised on construction, `a` in the first forward
        return LazyNet()

    twin = built()  # the oracle: materialised by a plain forward under the run's seed (0)
    torch.manual_seed(0)
    twin(x).sum().backward()
    materialised = sum(p.numel() for p in twin.parameters())
    assert materialised == 7 * 5 + 5 + 5 * 3 + 3

    report = hookcli.inspect(built(), x, device="cpu", topk=0)
    assert report.model.params == materialised
    assert [c.name for c in report.layers] == ["a", "b"]
    assert report.layers[0].outputs[0].shape == (2, 5)

    report = hookcli.grads(built(), x, device="cpu", topk=0, target="sum")
    assert report.model.params == materialised
    params = {p.name: p for p in report.layers[0].params or []}
    assert params["weight"].numel == 35 and params["bias"].numel == 5
    assert twin.a.weight.grad is not None
    assert params["weight"].grad_norm == pytest.approx(float(twin.a.weight.grad.norm()), 1e-6)
    no_internal_notes(report)


def test_layers_of_a_lazy_model_counts_after_a_forward() -> None:
    import json

    r = run("layers", f"{HERE}:LazyNet", "-i", "randn:2x7", "-f", "json")
    assert r.exit_code == 0, r.stderr
    rows = {m["name"]: m for m in json.loads(r.stdout)["modules"]}
    assert rows["a"]["params"] == 40 and rows["(model)"]["params"] == 58
    r = run("layers", f"{HERE}:LazyNet", "-i", "randn:2x7", "--shapes", "-f", "json")
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    rows = {m["name"]: m for m in data["modules"]}
    assert rows["a"]["params"] == 40 and data["model"]["params"] == 58
    assert rows["a"]["output_shapes"] == ["2x5"]


# ---------------------------------------------------------------- 2. a scripted child


def test_a_scripted_child_is_measured_at_its_call_and_its_insides_listed() -> None:
    """torch.jit.script refuses hooks; in an eager parent a stand-in takes its place for the
    pass, so its call is measured (issue 32), its insides are listed as not hookable, and the
    model's module tree is as it was afterwards."""
    model = ScriptedChild().eval()
    x = torch.randn(2, 4)
    want = captured_outputs(model, x, ["pre", "post"])
    with torch.no_grad():  # the oracle for the scripted call: the same module called by hand
        mid_in = model.pre(x)
        want["mid"] = model.mid(mid_in)
    scripted = model.mid
    report = hookcli.inspect(model, x, device="cpu", topk=0)
    assert [c.name for c in report.layers] == ["pre", "mid", "post"]
    for call in report.layers:
        assert_stats_match(call.outputs[0], want[call.name])
    assert_stats_match(report.layers[1].inputs[0], mid_in)
    assert report.layers[1].type == "Inner"
    assert "mid.lin" not in report.never_called
    (note,) = [n for n in report.notes if "not hookable" in n]
    assert "mid.lin" in note and "inside a scripted TorchScript module" in note
    assert model.mid is scripted and model._modules["mid"] is scripted, "put back as found"
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == 0

    grads = hookcli.grads(model, x, device="cpu", topk=0, target="sum")
    assert [c.name for c in grads.layers] == ["pre", "mid", "post"]
    # the oracle: torch's own gradients of the scripted child's parameters
    model.zero_grad()
    model(x).sum().backward()  # type: ignore[no-untyped-call]
    params = {p.name: p for p in grads.layers[1].params or []}
    assert params["lin.weight"].grad_norm == pytest.approx(float(model.mid.lin.weight.grad.norm()))
    assert grads.layers[0].grad_outputs is not None  # the gradient flows through the script


def test_layers_lists_the_scripted_child_and_what_is_inside_it() -> None:
    r = run("layers", f"{HERE}:ScriptedChild")
    assert r.exit_code == 0, r.stderr
    assert "mid " in r.stdout and "mid.lin" in r.stdout and "not hookable" in r.stdout
    rows = {
        m["name"]: m
        for m in json.loads(run("layers", f"{HERE}:ScriptedChild", "-f", "json").stdout)["modules"]
    }
    assert rows["mid"]["type"] == "Inner" and rows["mid"]["hookable"] is True
    assert rows["mid.lin"]["hookable"] is False
    assert rows["pre"]["hookable"] is True, "JSON keeps type names; a field says hookable"
    r = run("inspect", f"{HERE}:ScriptedChild", "-i", "randn:2x4", "-l", "mid", "-f", "json")
    assert r.exit_code == 0, r.stderr
    assert [c["name"] for c in json.loads(r.stdout)["layers"]] == ["mid"]
    r = run("inspect", f"{HERE}:ScriptedChild", "-i", "randn:2x4", "-l", "mid.lin")
    assert_one_line_error(r, 2, "mid.lin", "TorchScript")


# ---------------------------------------------------------------- 3. LSTM, unused output


def test_lstm_sequence_output_without_gradient_is_null_not_an_error() -> None:
    torch.manual_seed(0)
    model = LSTMClassifier().eval()
    x = torch.randn(2, 5, 4)
    report = hookcli.grads(model, x, device="cpu", topk=0, target="sum")
    no_internal_notes(report)
    lstm = next(c for c in report.layers if c.name == "lstm")
    # oracle: autograd on a copy, with the LSTM's outputs kept by a plain forward hook
    twin = copy.deepcopy(model)
    kept: dict[str, Any] = {}
    twin.lstm.register_forward_hook(lambda m, a, out: kept.__setitem__("out", out))
    y = twin(x).sum()
    seq, (h, c) = kept["out"]
    g_seq, g_h, g_c = torch.autograd.grad(y, [seq, h, c], allow_unused=True)
    assert g_seq is None and g_c is None and g_h is not None
    assert lstm.grad_outputs is not None
    assert [g.path for g in lstm.grad_outputs] == ["out[1][0]"]
    assert_stats_match(lstm.grad_outputs[0], g_h)


# ---------------------------------------------------------------- 4. buffers


@pytest.mark.parametrize("command", ["inspect", "grads"])
@pytest.mark.parametrize("train", [False, True])
def test_buffers_rewritten_in_forward_are_restored_after_every_run(
    command: str, train: bool
) -> None:
    torch.manual_seed(0)
    model = Rewrites().eval()
    x = torch.randn(3, 4)
    before = state(model)
    objects = dict(model.named_buffers())
    # the oracle that this test can fail: a plain forward changes the state dict
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.train(train)(x)
    assert not same_state(before, state(changed))

    if command == "grads":
        report = hookcli.grads(model, x, device="cpu", topk=0, train=train, target="sum")
    else:
        report = hookcli.inspect(model, x, device="cpu", topk=0, train=train)
    assert report.layers, "the run measured something"
    assert same_state(before, state(model))
    assert dict(model.named_buffers()).keys() == objects.keys()
    assert all(b is objects[n] for n, b in model.named_buffers()), "the same tensor objects"
    assert model.training is False and hooks_left(model) == 0


def test_a_scripted_childs_buffers_are_restored_after_train_mode() -> None:
    torch.manual_seed(0)
    model = ScriptedNorm().eval()
    x = torch.randn(8, 4)
    before = state(model)
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.train()(x)
    assert not same_state(before, state(changed)), "the oracle: train mode moves the statistics"
    hookcli.inspect(model, x, device="cpu", topk=0, train=True)
    assert same_state(before, state(model))


# ---------------------------------------------------------------- 5. autograd in forward


def test_a_model_differentiating_in_forward_runs_under_inspect() -> None:
    torch.manual_seed(0)
    model = Maml().eval()
    x = torch.randn(2, 4)
    with torch.enable_grad():
        want = model(x).detach()
    heads = captured_outputs_with_grad(model, x, "head")
    report = hookcli.inspect(model, x, device="cpu", topk=0)
    assert any("differentiates inside its forward" in n for n in report.notes), report.notes
    assert_stats_match(report.outputs[0], want)
    head = [c for c in report.layers if c.name == "head"]
    assert len(head) == 1, "one call: the failed first try is not reported"
    assert_stats_match(head[0].outputs[0], heads)
    assert all(p.grad is None for p in model.parameters()) and hooks_left(model) == 0
    # folder runs: the second pass starts with gradients and says so again
    again = hookcli.inspect(model, x, device="cpu", topk=0)
    assert any("differentiates inside its forward" in n for n in again.notes)
    grads = hookcli.grads(model, x, device="cpu", topk=0, target="sum")
    assert not any("differentiates" in n for n in grads.notes)


def captured_outputs_with_grad(model: nn.Module, x: torch.Tensor, name: str) -> torch.Tensor:
    got: list[torch.Tensor] = []
    h = dict(model.named_modules())[name].register_forward_hook(
        lambda m, a, out: got.append(out.detach().clone())
    )
    try:
        with torch.enable_grad():
            model(x)
    finally:
        h.remove()
    return got[0]


def test_a_folder_run_says_once_how_its_passes_ran_and_leaves_the_model_as_found(
    tmp_path: Path,
) -> None:
    from tests.support.paths import CAT, COFFEE

    for src in (CAT, COFFEE):
        (tmp_path / src.name).write_bytes(src.read_bytes())
    torch.manual_seed(0)
    model = ImageMaml().eval()
    before = state(model)
    report = hookcli.inspect(model, [str(tmp_path)], batch_size=1, device="cpu")
    assert report.input.shapes == [(2, 3, 224, 224)]
    assert [c.name for c in report.layers] == ["conv", "pool", "mid", "head"]
    assert "mid.lin" not in report.never_called
    assert sum("differentiates inside its forward" in n for n in report.notes) == 1
    assert sum("not hookable" in n and "mid.lin" in n for n in report.notes) == 1
    assert same_state(before, state(model))


def test_a_forward_that_cannot_differentiate_names_the_cause() -> None:
    with pytest.raises(ModelError) as err:
        hookcli.inspect(FrozenMaml(), torch.randn(2, 4), device="cpu", topk=0)
    assert "differentiates inside its forward" in str(err.value)
    assert "input shape" not in str(err.value)


# ---------------------------------------------------------------- 6. constants


@pytest.mark.parametrize("backend", ["kernel", "auto", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [3, 1000, 100_000])
@pytest.mark.parametrize("nan", [False, True])
def test_a_constant_tensor_has_exactly_zero_std(
    backend: str, dtype: torch.dtype, n: int, nan: bool
) -> None:
    x = torch.full((n,), 0.1, dtype=dtype)
    if nan:  # NaN/Inf elements are left out of the moments: the rest is still a constant
        x[: n // 3] = float("nan")
        x[-1] = float("inf")
    collector = StatsCollector(backend=backend)
    stats = collector.add(x, "x")
    collector.finalize()
    finite = x.double()[torch.isfinite(x.double())]
    value = finite[0].item()
    assert stats.std == 0.0
    assert stats.min == stats.max == stats.mean == value
    assert stats.norm == pytest.approx(finite.norm().item(), rel=1e-12)
    if dtype is torch.float32:  # the float64 oracle is exactly 0 here too
        assert stats.std == finite.std(correction=0).item()


def test_a_constant_layer_output_reports_zero_std_through_inspect() -> None:
    report = hookcli.inspect(Constant(), torch.randn(3, 50), device="cpu", topk=0)
    out = report.layers[0].outputs[0]
    assert out.std == 0.0 and out.mean == out.min == out.max == torch.tensor(0.1).item()


# ---------------------------------------------------------------- 7. BaseException


@pytest.mark.parametrize(
    ("model", "layer", "kind"), [("RaisesBase", "bad", "Boom"), ("GenExit", "gen", "GeneratorExit")]
)
def test_a_base_exception_in_forward_is_a_model_error(model: str, layer: str, kind: str) -> None:
    for command in ("inspect", "grads"):
        r = run(command, f"{HERE}:{model}", "-i", "randn:2x4")
        assert_one_line_error(r, 3, f"failed in layer {layer}", kind)
    with pytest.raises(ModelError):
        hookcli.inspect(RaisesBase(), torch.randn(2, 4), device="cpu")


def test_a_base_exception_in_the_factory_is_a_model_error() -> None:
    r = run("inspect", f"{HERE}:boom_factory", "-i", "randn:2x4")
    assert_one_line_error(r, 3, "boom_factory", "Boom")


def test_ctrl_c_in_forward_still_exits_130() -> None:
    r = run("inspect", f"{HERE}:CtrlC", "-i", "randn:2x4")
    assert r.exit_code == 130 and r.stderr.strip() == "interrupted", r.stderr
    with pytest.raises(KeyboardInterrupt):
        hookcli.inspect(CtrlC(), torch.randn(2, 4), device="cpu")


# ---------------------------------------------------------------- 8. train() raises, cycles


def test_a_raising_train_method_is_blamed_on_the_model() -> None:
    r = run("inspect", f"{HERE}:BadTrain", "-i", "randn:2x4")
    assert_one_line_error(r, 3, "BadTrain's eval() raised", "train() refuses")
    # the engine sets modes itself (never calls train()): the API runs such a model
    report = hookcli.inspect(BadTrain(), torch.randn(2, 4), device="cpu", topk=0)
    assert [c.name for c in report.layers] == ["lin"]


def test_a_module_cycle_is_named_not_an_internal_error() -> None:
    r = run("inspect", f"{HERE}:Cycle", "-i", "randn:2x4")
    assert_one_line_error(r, 3, "cycle", "child.parent")
    with pytest.raises(ModelError, match=r"cycle: child\.parent is the model itself"):
        hookcli.inspect(Cycle(), torch.randn(2, 4), device="cpu")


def test_a_lazy_first_layer_needs_an_input_and_says_so() -> None:
    r = run("inspect", f"{HERE}:LazyNet")
    assert_one_line_error(r, 2, "first layer is lazy", "--input")


def test_diff_of_a_lazy_model_counts_its_parameters_after_the_passes() -> None:
    report = hookcli.diff(LazyNet(), torch.randn(2, 7), b="float64", device="cpu")
    assert report.model.params == 7 * 5 + 5 + 5 * 3 + 3
    assert [c.name for c in report.calls] == ["a", "b"]


def test_buffer_snapshot_restores_every_kind_of_change() -> None:
    """A write that moves no version counter (as batch_norm's kernel does), a buffer given
    another shape through `.data`, one replaced and one added: all come back, the same
    objects, and an unchanged buffer is not written."""
    from hookcli.engine.passes import BufferSnapshot

    mods = [torch.nn.Module() for _ in range(3)]
    for i, m in enumerate(mods):
        m.register_buffer("a", torch.full((4,), float(i)))
        m.register_buffer("n", torch.tensor(i, dtype=torch.long))
        m.register_buffer("flag", torch.tensor([True, False]))
    objects = [dict(m._buffers) for m in mods]
    before = [{k: v.clone() for k, v in m._buffers.items()} for m in mods]
    snap = BufferSnapshot(mods)
    v_untouched = mods[2].a._version
    mods[0].a.data.add_(1.0)  # through .data: the buffer's own version does not move
    assert mods[0].a._version == objects[0]["a"]._version
    mods[1].n.data = torch.zeros(3, dtype=torch.long)  # another shape, the same object
    mods[1].flag = torch.tensor([False, False])  # replaced
    mods[2].register_buffer("extra", torch.ones(1))  # added
    snap.restore()
    for m, objs, want in zip(mods, objects, before, strict=True):
        assert dict(m._buffers).keys() == want.keys()
        for k, b in m._buffers.items():
            assert b is objs[k] and b.shape == want[k].shape and torch.equal(b, want[k]), k
    assert mods[2].a._version == v_untouched, "an unchanged buffer is not written"
