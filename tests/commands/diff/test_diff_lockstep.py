"""diff's sides side by side (commands/diff/lockstep.py): the reference side's tensors handed
straight to the compared passes give the very report the spill gives, never touch the spill
when the sides keep step, and fall back to it — with the same report — when they do not."""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hookcli.commands.diff import diff_report, lockstep, parse_side
from hookcli.commands.diff.measure import Spill
from hookcli.commands.diff.sides import prepare_side
from hookcli.errors import ModelError
from hookcli.options import InputOptions, ModelOptions, Selection
from hookcli.records import DiffReport
from tests.support.images import make_folder
from tests.support.models import Chain

pytestmark = pytest.mark.kernels  # the second CI pass reruns these on generic x86-64

CHAIN = "tests/support/models.py:Chain"


@pytest.fixture(autouse=True, params=[True, False], ids=["greenlets", "threads"])
def passes_as(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Every test twice: the passes as greenlets of one thread, and as threads."""
    monkeypatch.setattr(lockstep, "GREENLETS", request.param)
    return bool(request.param)


@pytest.fixture
def spilled(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, str]]:
    """The keys written to the spill, as the diffs of a test write them."""
    keys: list[tuple[str, int, str]] = []
    write = Spill.write

    def counting(self: Spill, key: tuple[str, int, str], t: torch.Tensor) -> None:
        keys.append(key)
        write(self, key, t)

    monkeypatch.setattr(Spill, "write", counting)
    return keys


def _both(
    monkeypatch: pytest.MonkeyPatch, run: Any, spilled: list[Any], *, in_step: bool = True
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The report side by side (in_step: with nothing spilled), and through the spill."""
    side_by_side = run().to_dict()
    assert (spilled == []) is in_step
    monkeypatch.setattr(lockstep, "ENABLED", False)
    through_spill = run().to_dict()
    monkeypatch.setattr(lockstep, "ENABLED", True)
    return side_by_side, through_spill


def _report(model: Any, b: str = "bfloat16", **kw: Any) -> DiffReport:
    specs = kw.pop("specs", ("randn:8x16",))
    return diff_report(
        ModelOptions(model, device="cpu"),
        kw.pop("selection", Selection()),
        kw.pop("inputs", InputOptions(specs=specs)),
        parse_side(kw.pop("a", "float32"), "--a"),
        parse_side(b, "--b"),
        **kw,
    )


@pytest.mark.parametrize(
    "kw",
    [
        {},  # accumulated and own error: two rounds, each with its own reference pass
        {"own": False},
        {"isolate": True},
        {"b": "float16", "ref": parse_side("float64", "--ref")},  # two compared sides at once
    ],
    ids=["own", "no-own", "isolate", "ref"],
)
def test_side_by_side_equals_the_spill_and_spills_nothing(
    kw: dict[str, Any], monkeypatch: pytest.MonkeyPatch, spilled: list[Any]
) -> None:
    threads = threading.active_count()
    a, b = _both(monkeypatch, lambda: _report(CHAIN, **kw), spilled)
    assert a == b
    assert {k[0] for k in spilled} == {"l1", "l2", "l3", "l4", "act", "(model)"}
    assert threading.active_count() == threads  # every pass's thread joined


def test_a_real_network_with_a_folder_in_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spilled: list[Any]
) -> None:
    folder = make_folder(tmp_path / "data", 5, size=64)
    a, b = _both(
        monkeypatch,
        lambda: diff_report(
            ModelOptions("resnet18", device="cpu"),
            Selection(layers=("layer1", "layer1.*", "fc")),  # containers and their children
            InputOptions((str(folder),)),
            parse_side("float32", "--a"),
            parse_side("channels_last", "--b"),
            batch_size=2,
        ),
        spilled,
    )
    assert a == b
    assert a["agreement"]["B"]["images"] == 5
    assert {k[0] for k in spilled} >= {"layer1.0.relu", "fc", "(model)"}  # the spill's run only
    spilled.clear()
    diff_report(  # a twin (int8) side runs side by side too
        ModelOptions("resnet18", device="cpu"),
        Selection(layers=("layer1.0.conv1",)),
        InputOptions(specs=("randn:1x3x64x64",)),
        parse_side("float32", "--a"),
        parse_side("quantized", "--b"),
    )
    assert spilled == []


@pytest.fixture
def passes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The passes the diffs of a test run side by side, as they start: "reference",
    "accumulated" (a compared pass on its own input), "own" (fed the reference's inputs);
    each round's passes sorted."""
    ran: list[str] = []
    reference, compared = lockstep.reference_pass, lockstep.compared_pass

    def reference_spy(*args: Any, **kw: Any) -> None:
        ran.append("reference")
        reference(*args, **kw)
        n = len(ran) - 1 - ran[::-1].index("reference")
        ran[n:] = ["reference", *sorted(ran[n + 1 :])]

    def compared_spy(*args: Any, **kw: Any) -> None:
        ran.append("own" if args[3] else "accumulated")
        compared(*args, **kw)

    monkeypatch.setattr(lockstep, "reference_pass", reference_spy)
    monkeypatch.setattr(lockstep, "compared_pass", compared_spy)
    return ran


def test_a_sides_two_passes_run_at_once_beside_one_reference_pass(
    monkeypatch: pytest.MonkeyPatch, spilled: list[Any], passes: list[str]
) -> None:
    """The accumulated and the own-error pass of side B run on one model at the same time,
    fed by one reference pass: the report is the one they give in rounds (each with a
    reference pass of its own), and the spill's; the model is left as found."""
    model = Chain().eval()
    model.l2.train()  # a module's own mode comes back
    state = {k: v.clone() for k, v in model.state_dict().items()}
    at_once = _report(model, b="bfloat16").to_dict()  # (a side of its own: a copy)
    assert passes == ["reference", "accumulated", "own"]
    passes.clear()
    monkeypatch.setattr(lockstep, "SHARED", False)
    in_rounds = _report(model, b="bfloat16").to_dict()
    assert passes == ["reference", "accumulated", "reference", "own"]
    assert at_once == in_rounds and spilled == []
    assert all(c["b"][0]["own_rel_l2"] is not None for c in at_once["calls"])
    monkeypatch.setattr(lockstep, "ENABLED", False)
    assert _report(model, b="bfloat16").to_dict() == at_once
    shared = Chain().eval()  # side B the user's own module (autocast changes no weight)
    shared.load_state_dict(state)
    shared.l2.train()  # its own mode, a buffer and a .grad of the user's: all come back
    shared.register_buffer("scale", torch.tensor(2.0))
    scale, grad = shared.scale, torch.ones_like(shared.l1.weight)
    shared.l1.weight.grad = grad
    monkeypatch.setattr(lockstep, "ENABLED", True)
    monkeypatch.setattr(lockstep, "SHARED", True)
    passes.clear()
    got = _report(shared, b="autocast").to_dict()
    assert passes == ["reference", "accumulated", "own"]
    monkeypatch.setattr(lockstep, "ENABLED", False)
    assert _report(shared, b="autocast").to_dict() == got
    assert shared.l2.training and not shared.training and not shared.l1.training
    assert shared.scale is scale and float(scale) == 2.0 and shared.l1.weight.grad is grad
    assert all(torch.equal(v, state[k]) for k, v in shared.state_dict().items() if k in state)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in shared.modules())


def test_a_loaded_model_of_the_python_api_is_never_changed_by_a_side(
    passes: list[str],
) -> None:
    """A LoadedModel passed in: a side that changes its module (bfloat16) works on a copy,
    and each side keeps its own record of it."""
    from hookcli.sources.custom import wrap_module

    torch.manual_seed(0)
    loaded = wrap_module(Chain().eval(), "")
    module = loaded.module
    report = _report(loaded, b="bfloat16").to_dict()
    assert passes == ["reference", "accumulated", "own"]
    assert loaded.module is module and module.l1.weight.dtype == torch.float32
    assert all(c["b"][0]["rel_l2"] > 0 for c in report["calls"])  # B really was bfloat16


class CountsInABuffer(Chain):
    """Counts its calls in a buffer and scales its input by the count: as every pass sees it
    alone, 1; two passes on the model at the same time would see 1 and 2."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return super().forward(x * self.count)


class CountsInAnAttribute(Chain):
    """Counts its calls in a Python attribute (which no pass puts back)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return super().forward(x)


class CountsThroughData(CountsInABuffer):
    """Counts in its buffer through .data (which moves no version counter)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.data.add_(1)
        return Chain.forward(self, x * self.count)


@pytest.mark.parametrize("model", [CountsInABuffer, CountsInAnAttribute, CountsThroughData])
def test_a_model_whose_state_moves_runs_its_passes_in_rounds(
    model: type[Chain], monkeypatch: pytest.MonkeyPatch, spilled: list[Any], passes: list[str]
) -> None:
    """Passes at once would see each other's moves: the batch runs again in rounds, and so do
    the model's later ones (side B autocast: the user's module itself, diff after diff); the
    report is the spill's."""
    torch.manual_seed(0)
    counting = model().eval()
    report = _report(counting, b="autocast").to_dict()
    rounds = ["reference", "accumulated", "reference", "own"]
    assert passes == ["reference", "accumulated", "own", *rounds]
    passes.clear()
    assert _report(counting, b="autocast").to_dict() == report
    assert passes == rounds and spilled == []
    monkeypatch.setattr(lockstep, "ENABLED", False)
    assert _report(counting, b="autocast").to_dict() == report
    if model is not CountsInAnAttribute:  # put back after every pass: each saw a count of 1
        assert float(counting.count) == 0
        torch.manual_seed(0)
        plain = Chain().eval()
        plain.load_state_dict(counting.state_dict(), strict=False)
        assert _report(plain, b="autocast").to_dict()["calls"] == report["calls"]


class CallsMoreInHalf(nn.Module):
    """Calls l2 a second time when it runs in bfloat16: the sides' calls part ways."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l2(self.l1(x))
        if x.dtype == torch.bfloat16:
            h = self.l2(h)
        return self.l3(h)


class CallsLessInHalf(CallsMoreInHalf):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        return self.l3(h if x.dtype == torch.bfloat16 else self.l2(h))


class SwapsInHalf(CallsMoreInHalf):
    """As many calls on each side, in another order: l2 before l1 in bfloat16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16:
            return self.l3(self.l1(self.l2(x)))
        return self.l3(self.l2(self.l1(x)))


class Noisy(Chain):
    """Draws random numbers in its forward (eval mode too): the sides share torch's generator,
    so side by side each would draw the other's numbers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        h = h + torch.randn_like(h)
        return self.l4(self.act(self.l3(self.act(self.l2(h)))))


@pytest.mark.parametrize("model", [CallsMoreInHalf, CallsLessInHalf, SwapsInHalf, Noisy])
@pytest.mark.parametrize("own", [True, False])
def test_passes_that_part_ways_fall_back_to_the_spill(
    model: type[nn.Module], own: bool, monkeypatch: pytest.MonkeyPatch, spilled: list[Any]
) -> None:
    def run() -> DiffReport:
        torch.manual_seed(0)
        return _report(model().eval(), own=own)

    a, b = _both(monkeypatch, run, spilled, in_step=False)
    assert a == b  # the batch ran again through the spill: the same report
    n = len(spilled)
    assert n % 2 == 0 and spilled[: n // 2] == spilled[n // 2 :]  # spilled in both runs
    if model is Noisy:  # both sides drew the same noise: bfloat16 rounding only
        assert all(c["b"][0]["rel_l2"] < 0.05 for c in a["calls"])
    elif model is SwapsInHalf:  # each call against its own: the same layer, other inputs
        assert sorted(c["name"] for c in a["calls"]) == ["l1", "l2", "l3"]
    else:
        assert a["missing"] or any(c["b"][0]["note"] for c in a["calls"])


class Probes(nn.Module):
    """A hooked module that raises, caught by the forward (on both sides): its pre-hook has no
    post-hook, so two pre-hooks follow each other with no output handed over between them."""

    def __init__(self) -> None:
        super().__init__()
        self.probe, self.l1, self.l2 = nn.Identity(), nn.Linear(16, 16), nn.Linear(16, 4)
        self.probe.register_forward_pre_hook(self._refuse)

    @staticmethod
    def _refuse(module: nn.Module, args: Any) -> None:
        raise RuntimeError("fast path unavailable")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            return self.probe(x)  # type: ignore[no-any-return]
        except RuntimeError:
            return self.l2(torch.relu(self.l1(x)))  # type: ignore[no-any-return]


class ScalesItsInput(Chain):
    """Changes its input in place: each pass must get an input of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(0.5)
        return super().forward(x)


class DifferentiatesInside(Chain):
    """Calls torch.autograd.grad in its forward: the pass fails without gradients and runs
    again with them; the first try's calls must not count."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        g = torch.autograd.grad((h.float() ** 2).sum(), self.l1.weight)[0]
        return self.l4(self.act(self.l3(self.act(self.l2(h))))) + g.sum().to(h.dtype) * 0


@pytest.mark.parametrize("kw", [{}, {"isolate": True}, {"b": "autocast"}])
def test_models_with_habits_give_the_spills_report(
    kw: dict[str, Any], monkeypatch: pytest.MonkeyPatch, spilled: list[Any]
) -> None:
    torch.manual_seed(0)
    probes = Probes().eval()  # containers of nothing: hangs if a pre-hook takes a turn twice
    a, b = _both(monkeypatch, lambda: _report(probes, **kw), spilled)
    assert a == b and {c["name"] for c in a["calls"]} == {"l1", "l2"}

    spilled.clear()
    torch.manual_seed(0)
    scales = ScalesItsInput().eval()
    a, b = _both(monkeypatch, lambda: _report(scales, **kw), spilled)
    assert a == b  # every pass halved its own copy of the input, once
    if "b" in kw:  # autocast: the same input values on both sides, l1 in bfloat16
        assert a["calls"][0]["b"][0]["rel_l2"] < 0.02

    torch.manual_seed(0)
    model = DifferentiatesInside().eval()
    report = _report(model, **kw)
    monkeypatch.setattr(lockstep, "ENABLED", False)
    torch.manual_seed(0)
    fresh = DifferentiatesInside().eval()  # a model not yet known to need gradients
    assert _report(fresh, **kw).to_dict() == report.to_dict()
    l1 = next(c for c in report.calls if c.name == "l1")
    assert l1.b is not None and l1.b[0].numel == 8 * 16  # counted once, not for each try


class FailsInHalf(Chain):
    """Raises (or is interrupted) in l3, on one side only."""

    def __init__(self, dtype: torch.dtype, error: type[BaseException]) -> None:
        super().__init__()
        self.dtype, self.error = dtype, error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.l2(self.act(self.l1(x))))
        if x.dtype == self.dtype:
            raise self.error("boom in half precision")
        return self.l4(self.act(self.l3(h)))


@pytest.mark.parametrize("side", [torch.float32, torch.bfloat16])  # reference, compared
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_side_that_fails_raises_as_the_spill_would(
    side: torch.dtype, error: type[BaseException], monkeypatch: pytest.MonkeyPatch
) -> None:
    threads = threading.active_count()
    model = FailsInHalf(side, error).eval()
    raised = []
    for enabled in (True, False):
        monkeypatch.setattr(lockstep, "ENABLED", enabled)
        with pytest.raises(ModelError if error is RuntimeError else error) as info:
            _report(model)
        raised.append(str(info.value))
        assert threading.active_count() == threads
    assert raised[0] == raised[1]
    if error is RuntimeError:
        assert "boom in half precision" in raised[0]
    for m in model.modules():  # hooks gone from the user's module (each side a copy of it)
        assert not m._forward_hooks and not m._forward_pre_hooks


def test_sides_that_cannot_run_at_once_do_not_try() -> None:
    model = Chain().eval()
    options = ModelOptions(model, device="cpu")

    def side(spec: str) -> Any:
        return prepare_side(options, Selection(), parse_side(spec, "--a"), with_input=None)

    shared = [side("autocast"), side("autocast")]  # neither changes the module: the user's
    assert shared[0].prepared.loaded.module is shared[1].prepared.loaded.module
    assert not lockstep.fits(shared)
    assert lockstep.fits([side("float32"), side("bfloat16")])  # each a copy
    assert not lockstep.fits([side("float32"), side("compile")])
    assert not lockstep.fits([side("float32"), side("bfloat16, seed=1")])
    lazy = ModelOptions(nn.Sequential(nn.LazyLinear(4)), device="cpu")
    lazy_sides = [
        prepare_side(lazy, Selection(), parse_side(spec, "--a"), with_input=None)
        for spec in ("float32", "bfloat16")
    ]
    assert not lockstep.fits(lazy_sides)  # its first call draws its weights
    with_onnx = [side("float32"), side("onnx")]
    assert not lockstep.fits(with_onnx)


SEEN: list[tuple[int, torch.dtype, bool, bool]] = []


class Spy(nn.Module):
    """A leaf that writes down, at each call, its thread, the input's dtype, and what torch
    keeps per thread: autocast on the CPU and grad mode."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        SEEN.append((threading.get_ident(), x.dtype, torch.is_autocast_enabled("cpu"),
                     torch.is_grad_enabled()))  # fmt: skip
        return x


def test_each_pass_keeps_its_own_autocast_and_grad_mode(passes_as: bool) -> None:
    """float64 against autocast: the passes take turns at every call, and each call runs under
    its own side's autocast and grad mode; as greenlets, all in the calling thread."""
    SEEN.clear()
    model = nn.Sequential(Spy(), nn.Linear(16, 16), Spy(), nn.Linear(16, 16), Spy()).eval()
    torch.set_grad_enabled(True)
    report = _report(model, a="float64", b="autocast", own=False)
    assert report.calls and torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
    reference = [dtype == torch.float64 for _, dtype, _, _ in SEEN]
    assert reference == [True, False] * 3  # in turns, call by call
    assert [autocast for _, _, autocast, _ in SEEN] == [False, True] * 3  # each side its own
    assert not any(grad for *_, grad in SEEN)  # both passes under no_grad, whatever was around
    threads = {ident for ident, *_ in SEEN}
    if passes_as:
        assert threads == {threading.get_ident()}
    else:
        assert len(threads) == 2


class InferenceOnOneSide(nn.Module):
    """The reference side (float64) runs its first layers under inference mode, which torch
    keeps per thread and which cannot be put back when a pass waits."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.spy, self.b = nn.Linear(16, 16), Spy(), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float64:
            with torch.inference_mode():
                x = self.spy(self.a(x))
        else:
            x = self.spy(self.a(x))
        return self.b(x)  # type: ignore[no-any-return]


def test_a_pass_that_waits_in_inference_mode_falls_back_to_the_spill(
    passes_as: bool, monkeypatch: pytest.MonkeyPatch, spilled: list[Any]
) -> None:
    """As greenlets, the other pass would run in the waiting pass's inference mode: the batch
    runs through the spill instead (as threads, each pass has its own and keeps step)."""
    SEEN.clear()
    model = InferenceOnOneSide().eval()
    a, b = _both(
        monkeypatch, lambda: _report(model, a="float64", b="float32", own=False), spilled,
        in_step=not passes_as,
    )  # fmt: skip
    assert a == b and not torch.is_inference_mode_enabled()


def test_a_round_that_moves_nothing_breaks_the_exchange() -> None:
    """Passes waiting for what never comes: the greenlets' scheduler breaks the exchange
    instead of resuming them forever, and every pass ends."""
    greenlet = pytest.importorskip("greenlet")
    cv = lockstep._Cooperative(greenlet.getcurrent())
    exchange = lockstep.Exchange([False, False], lambda: True, cv)
    ended = []

    def stuck(i: int) -> None:
        with exchange._cv:
            exchange._wait(i, lambda: False)  # never ready
        ended.append(i)

    lockstep._as_greenlets(greenlet, [lambda: stuck(0), lambda: stuck(1)], cv, exchange)
    assert exchange.broken == "the passes could not take turns" and sorted(ended) == [0, 1]


class Overflows(nn.Module):
    """Each layer multiplies by 100: float16 overflows from the third on (65504), and the
    second layer's NaN (a log of a negative, on both sides) is the reference's too."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        for lin in self.layers:
            nn.init.eye_(lin.weight)
            lin.weight.data *= 100.0
            nn.init.zeros_(lin.bias)
        self.log = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers[0](x)
        h = self.log(torch.log(h - 150.0))  # NaN where h < 150: the same on both sides
        for lin in self.layers[1:]:
            h = lin(torch.nan_to_num(h, nan=1.0))
        return h


def _close(a: Any, b: Any, where: str = "") -> None:
    """Two reports' JSON alike: every number to rounding, everything else exactly."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and not isinstance(a, bool):
        assert b == pytest.approx(a, rel=1e-9, abs=1e-12), (where, a, b)
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize(
    ("model", "kw"),
    [
        (CHAIN, {}),
        (CHAIN, {"isolate": True}),
        (CHAIN, {"b": "float16", "ref": parse_side("float64", "--ref")}),
        (f"{__file__}:Overflows", {"b": "float16", "specs": ("ones:2x8",)}),
    ],
    ids=["own", "isolate", "ref", "not finite"],
)
def test_sums_read_where_the_tensors_are_equal_the_host_arrays(
    model: str, kw: dict[str, Any], monkeypatch: pytest.MonkeyPatch, spilled: list[Any]
) -> None:
    """Issue 52 item 3: on CUDA the compared side reads the reference's tensor where it is
    and keeps the sums there until the pass ends (commands/diff/ondevice.py). Forced here on
    the CPU, that path gives the host arrays' report: every figure to rounding, the notes on
    NaN/Inf and overflow word for word, the model output's per-position errors."""
    from hookcli.commands.diff import ondevice

    host = _report(model, **dict(kw)).to_dict()
    measured: list[int] = []
    original = ondevice.sums
    monkeypatch.setattr(ondevice, "on_device", lambda t: True)
    monkeypatch.setattr(ondevice, "sums", lambda a, b: measured.append(1) or original(a, b))
    there = _report(model, **dict(kw)).to_dict()
    assert measured and spilled == []  # side by side, read where the tensors were
    _close(host, there)
    if model != CHAIN:
        notes = {c["name"]: c["b"][0]["note"] for c in there["calls"]}
        overflow = "overflow: the reference's max |x| 1e+06 exceeds float16's 65504"
        assert notes["layers.3"] == overflow


@pytest.mark.parametrize("chunk", [7, 1 << 22])
def test_the_device_sums_equal_the_kernels_chunk_by_chunk(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ondevice.sums against the CPU's (numba) sums, in chunks of a few elements or one: the
    chunks' sums added and their maxima taken, NaN/Inf on either side left out and counted."""
    from hookcli.commands.diff import measure, ondevice

    monkeypatch.setattr(ondevice, "CHUNK", chunk)
    g = torch.Generator().manual_seed(5)
    a = torch.randn(4, 25, generator=g)
    b = a + 1e-3 * torch.randn(4, 25, generator=g)
    a[0, 3], b[1, 4], b[2, 5], a[3, 6] = math.nan, math.inf, math.nan, -math.inf
    got = ondevice.sums(a, b).tolist()
    want = measure.sums(measure.as_array(a), b).tolist()
    assert got[:6] == pytest.approx(want, rel=1e-12)
    assert got[6:] == [2, 2, float(a[torch.isfinite(a)].abs().max())]
