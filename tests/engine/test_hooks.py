"""The hook session never raises into the user's forward (issue 14, item 7): whatever its own
callbacks or the arguments it walks do, the module runs on its own arguments and the failure is
a note on the call."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
from torch import nn

from hookcli.engine import hooks as hooks_mod
from hookcli.engine.hookbits import holds_compiled
from hookcli.engine.hooks import HookSession, PendingCall, Target
from hookcli.engine.stats import StatsCollector
from tests.support.oracles import hooks_left


class Hostile(Mapping[str, torch.Tensor]):
    """A mapping argument whose walk fails (a user type hookcli cannot see into)."""

    def __getitem__(self, key: str) -> torch.Tensor:
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        raise RuntimeError("not iterable today")

    def __len__(self) -> int:
        return 1


class TakesAnything(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, extra: Any = None) -> torch.Tensor:
        return self.fc(x)  # type: ignore[no-any-return]


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = TakesAnything()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x, Hostile())  # type: ignore[no-any-return]


def _session(model: Outer, **kw: Any) -> HookSession:
    return HookSession([Target(model.inner, "inner", [], "TakesAnything")], **kw)


@pytest.mark.parametrize("collector", [None, "stats"], ids=["shapes only", "statistics"])
@pytest.mark.parametrize("profile", [False, True])
def test_an_argument_that_cannot_be_walked_is_a_note_not_a_failure(
    collector: str | None, profile: bool
) -> None:
    torch.manual_seed(0)
    model = Outer().eval()
    x = torch.randn(2, 4)
    with torch.no_grad():
        expected = model(x)
    session = _session(model, collector=StatsCollector() if collector else None, profile=profile)
    with torch.no_grad(), session:
        got = model(x)
    assert torch.equal(got, expected)
    (call,) = [p.call for p in session.calls]
    assert call.error is not None and "not iterable today" in call.error
    assert hooks_left(model) == 0


def test_an_input_callback_that_raises_leaves_the_arguments_alone() -> None:
    torch.manual_seed(0)
    model = Outer().eval()
    x = torch.randn(2, 4)
    with torch.no_grad():
        expected = model(x)

    def feed(pending: PendingCall, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise ValueError("no reference input for this call")

    session = _session(model, collector=None, on_input=feed)
    with torch.no_grad(), session:
        got = model(x)
    assert torch.equal(got, expected), "the module ran on its own arguments"
    (call,) = [p.call for p in session.calls]
    assert call.error == "could not replace the inputs: no reference input for this call"


class Reuses(nn.Module):
    """A module called twice, a tensor given by keyword only, a module with a pre-hook of the
    user's that changes its input, and a module of another model called inside the forward."""

    def __init__(self, other: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.inner = TakesAnything()
        self.scaled = nn.Linear(4, 4)
        self.scaled.register_forward_pre_hook(lambda m, args: (args[0] * 10,))
        self.copied = nn.Linear(4, 4)
        object.__setattr__(self, "other", other)  # not a child: another model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.fc(x))
        y = self.act(y - 0.1)
        y = self.scaled(y)
        y = copy.copy(self.copied)(y)  # a shallow copy (DataParallel's replicas): its hooks too
        self.other(y)
        return self.inner(y, extra=y * 2)  # type: ignore[no-any-return]


def _calls(model: Reuses, dense: bool) -> list[tuple[object, ...]]:
    targets = [
        Target(m, name, [name], type(m).__name__)
        for name, m in model.named_modules()
        if name and name != "inner"  # the container's child inner.fc stays, inner does not
    ] + [Target(model.inner, "inner", ["inner"], "TakesAnything")]
    collector = StatsCollector(backend="torch")
    session = HookSession(targets, collector, dense=dense)
    with torch.no_grad(), session:
        # every target but the one with the user's hook goes through the process-wide pair
        assert len(session._dispatched) == (len(targets) - 1 if dense else 0)
        model(torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))
    collector.finalize()
    return [
        (
            p.call.name,
            p.call.call,
            p.finished,
            [(t.path, t.shape, t.mean, t.max) for t in p.call.inputs],
            [(t.path, t.shape, t.mean, t.max) for t in p.call.outputs],
        )
        for p in session.calls
    ]


def test_process_wide_dispatch_records_what_hooks_on_each_module_record() -> None:
    """Issue 52: a dense selection hooked through one process-wide pair of hooks records every
    call as hooks on each module do (reused modules, keyword-only tensors, the order calls
    return); a module with a hook of the user's keeps hooks of its own, so the input hookcli
    measures is still the one the user's hook made; another model's modules called meanwhile
    are not recorded; nothing is left behind."""
    other = nn.Linear(4, 2)
    model = Reuses(other)
    dense, each = _calls(model, True), _calls(model, False)
    assert dense == each
    names = [c[0] for c in dense]
    assert names.count("act") == 2 and {"scaled", "inner", "copied"} <= set(names)
    scaled = next(c for c in dense if c[0] == "scaled")
    relu_out = next(c for c in dense if c[0] == "act" and c[1] == 1)[4][0]
    assert scaled[3][0][3] == pytest.approx(relu_out[3] * 10)  # the user's hook ran first
    inner = next(c for c in dense if c[0] == "inner")
    assert [t[0] for t in inner[3]] == ["in[0]", 'in["extra"]']  # the keyword-only tensor too
    assert hooks_left(model) == 1 and hooks_left(other) == 0  # the user's own hook alone


def test_a_compiled_module_keeps_hooks_on_each_module() -> None:
    """dynamo guards on process-wide hooks: a model with a compiled part is not dispatched."""
    plain, compiled, wrapped = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    compiled.compile()
    assert not holds_compiled([plain])
    assert holds_compiled([plain, compiled])
    assert holds_compiled([torch.compile(wrapped)])


class Handover(nn.Module):
    """a's output is b's input; between the two calls the parent may change it in place, or
    hook a gradient-changing function of its own on it."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.a, self.b, self.mode = nn.Linear(4, 4), nn.Linear(4, 4), mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.a(x)
        if self.mode == "in place":
            t.mul_(2.0)
        elif self.mode == "user hook":
            t.register_hook(lambda g: 3.0 * g)
        return self.b(t)  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["plain", "in place", "user hook"])
def test_one_tensor_handed_from_call_to_call_gets_each_calls_own_gradient(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensor that is one call's output and the next call's input carries one hook for
    both (issue 52) only while that changes nothing: after an in-place op b's input is
    another value, and a hook of the user's between the two changes what b's input gets."""
    import hookcli

    torch.manual_seed(0)
    model, x = Handover(mode), torch.randn(3, 4)
    registered = []
    register = torch.Tensor.register_hook

    def counted(t: torch.Tensor, hook: Any) -> Any:
        registered.append(t)
        return register(t, hook)

    monkeypatch.setattr(torch.Tensor, "register_hook", counted)
    put_into = hooks_mod._hook_into  # hookcli's own way in, for plain tensors

    def counted_into(t: torch.Tensor, hook: Any) -> Any:
        registered.append(t)
        return put_into(t, hook)

    monkeypatch.setattr(hooks_mod, "_hook_into", counted_into)
    report = hookcli.grads(model, x, device="cpu", target="sum", topk=0, layers=["a", "b"])
    monkeypatch.undo()
    # a's output and b's input: one hook in the plain case; b's output: one; the user's: one
    assert len(registered) == {"plain": 2, "in place": 3, "user hook": 4}[mode]
    t0 = model.a(x)
    t1 = t0 * 2.0 if mode == "in place" else t0 * 1.0
    g0, g1 = torch.autograd.grad(model.b(t1).sum(), [t0, t1])
    want_a = g0 if mode == "in place" else g1
    want_b = 3.0 * g1 if mode == "user hook" else g1
    a = next(c for c in report.layers if c.name == "a")
    b = next(c for c in report.layers if c.name == "b")
    assert a.grad_outputs and b.grad_inputs
    assert a.grad_outputs[0].norm == pytest.approx(want_a.double().norm().item(), rel=1e-6)
    assert b.grad_inputs[0].norm == pytest.approx(want_b.double().norm().item(), rel=1e-6)
    assert hooks_left(model) == 0


class Keeps(nn.Module):
    """Keeps its intermediate tensor, as a user's model may (a cache, a debug attribute)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.kept: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.a(x)
        self.kept.append(t)
        return self.b(t.tanh())  # type: ignore[no-any-return]


def test_gradient_hooks_put_into_tensors_are_gone_after_the_pass() -> None:
    """The gradient hooks hookcli puts straight into a plain tensor's hook dict (a leaf input
    that requires grad, an intermediate the model keeps) are taken out when the pass ends,
    and each gradient they saw is autograd's."""
    import hookcli

    torch.manual_seed(0)
    model, x = Keeps(), torch.randn(3, 4, requires_grad=True)
    report = hookcli.grads(model, x, device="cpu", target="sum", topk=0, layers=["a", "b"])
    kept = model.kept[-1]
    assert x._backward_hooks is not None and kept._backward_hooks is not None  # (hooked)
    assert not x._backward_hooks and not kept._backward_hooks
    t = model.a(x)
    gx, gt = torch.autograd.grad(model.b(t.tanh()).sum(), [x, t])
    a = next(c for c in report.layers if c.name == "a")
    assert a.grad_inputs and a.grad_outputs
    assert a.grad_inputs[0].norm == pytest.approx(gx.double().norm().item(), rel=1e-6)
    assert a.grad_outputs[0].norm == pytest.approx(gt.double().norm().item(), rel=1e-6)
    assert hooks_left(model) == 0


class Chunked(nn.Module):
    """Its intermediate carries a hook of the user's before hookcli's (a second output of
    chunk: output_nr 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(4, 4)
        self.kept: list[torch.Tensor] = []
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, t = self.a(x).chunk(2, dim=-1)
        t.register_hook(lambda g: self.seen.append(g.clone()))
        self.kept.append(t)
        return self.b(t)  # type: ignore[no-any-return]


@pytest.mark.parametrize("direct", [True, False])
def test_a_users_own_gradient_hook_stays_and_still_runs(
    direct: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensor that already holds a hook of the user's gets hookcli's in the same dict (put
    there directly, or through register_hook where the direct way is not available): both
    run, the user's sees autograd's gradient, and only the user's is left after the pass."""
    import hookcli

    if not direct:
        monkeypatch.setattr(hooks_mod, "_LEAN_HOOKS", [False])
    torch.manual_seed(0)
    model, x = Chunked(), torch.randn(3, 4)
    report = hookcli.grads(model, x, device="cpu", target="sum", topk=0, layers=["b"])
    kept = model.kept[-1]
    assert kept._backward_hooks is not None and len(kept._backward_hooks) == 1
    _, t = model.a(x).chunk(2, dim=-1)
    (want,) = torch.autograd.grad(model.b(t).sum(), [t])
    assert torch.equal(model.seen[-1], want)
    b = next(c for c in report.layers if c.name == "b")
    assert b.grad_inputs
    assert b.grad_inputs[0].norm == pytest.approx(want.double().norm().item(), rel=1e-6)
    assert hooks_left(model) == 0


def test_a_pass_inside_the_users_inference_mode_is_measured_as_outside() -> None:
    """Called inside the user's `torch.inference_mode()`, every tensor the hooks see is an
    inference tensor, which has no version counter: each is measured at each sight (an
    in-place ReLU changes its input unseen), and the report is the one outside it, each
    statistic the float64 oracle's of the tensor as the hook saw it."""
    import hookcli
    from tests.support.oracles import assert_stats_match

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 4)).eval()
    x = torch.randn(2, 8)
    outside = hookcli.inspect(model, x, topk=0)
    with torch.inference_mode():
        inside = hookcli.inspect(model, x, topk=0)
        hidden = model[0](x)
        want = {"0": (x, hidden.clone()), "1": (hidden.clone(), hidden.relu()), "2": None}
    assert [c.error for c in inside.layers] == [None, None, None]
    for a, b in zip(inside.layers, outside.layers, strict=True):
        assert [(s.mean, s.std, s.min, s.max) for s in a.inputs + a.outputs] == [
            (s.mean, s.std, s.min, s.max) for s in b.inputs + b.outputs
        ]
        pair = want[a.name]
        if pair is not None:
            assert_stats_match(a.inputs[0], pair[0])
            assert_stats_match(a.outputs[0], pair[1])


def test_a_model_pickled_while_hooked_by_an_earlier_version_still_loads() -> None:
    """A model saved (torch.save, pickle) while hookcli's hooks were on holds an InertHook,
    named by the module that defined it then (hookcli.engine.hooks): it still loads."""
    import pickle

    from hookcli.engine.copysafe import CopySafeHook, InertHook

    old = b"chookcli.engine.hooks\nInertHook\np0\n(tRp1\n."  # (protocol 0: the path spelled)
    assert isinstance(pickle.loads(old), InertHook)
    now = pickle.loads(pickle.dumps(CopySafeHook(print)))
    assert isinstance(now, InertHook) and now() is None
