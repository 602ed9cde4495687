"""diff's side kinds (issue 14, item 4): a new kind is one class and `register`, and each
built-in kind's class alone gives the diff its spec gives, with the expected numbers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from hookcli.commands.diff import Side, SideKind, diff_report, parse_side, register
from hookcli.commands.diff.sides import (
    KINDS,
    Autocast,
    ChannelsLast,
    Compile,
    DType,
    Onnx,
    Quantized,
    Setting,
    side_help,
)
from hookcli.errors import UsageError
from hookcli.options import InputOptions, ModelOptions, Selection
from hookcli.records import DiffReport
from tests.support.diff import (
    CHAIN,
    assert_differences,
    chain_model,
    differences_by_hand,
    leaf_outputs,
)
from tests.support.models import Chain

pytestmark = pytest.mark.kernels  # the second CI pass reruns these on generic x86-64


@dataclass(frozen=True, slots=True)
class Scaled(SideKind):
    """A made-up kind: the input times K."""

    k: float
    help: ClassVar[str] = "scale=K"

    @classmethod
    def parse(cls, key: str, value: str | None, raw: str, option: str) -> SideKind | None:
        return cls(float(value)) if key == "scale" and value else None

    def cast(self, t: torch.Tensor) -> torch.Tensor:
        return t * self.k


@pytest.fixture
def scaled() -> Iterator[None]:
    register(Scaled)
    try:
        yield
    finally:
        KINDS.remove(Scaled)


def _report(side: Side, *, model: str = CHAIN, given: str = "randn:8x16", **kw: Any) -> DiffReport:
    return diff_report(
        ModelOptions(model, device="cpu"),
        Selection(layers=kw.pop("layers", ())),
        InputOptions(specs=(given,)),
        parse_side(kw.pop("a", "float32"), "--a"),
        side,
        **kw,
    )


def test_a_new_side_kind_is_one_class_and_register(scaled: None) -> None:
    side = parse_side("scale=2,float64", "--b")
    assert side.parts == (DType(torch.float64), Scaled(2.0))  # in registration order
    assert side_help().endswith("bnb:nf4|int8, hf:FOLDER, scale=K; joined with commas")
    report = _report(parse_side("scale=2", "--b"))
    model, x = chain_model(torch.float32)
    ref, got = leaf_outputs(model, x), leaf_outputs(model, 2 * x)
    rows = {c.name: c.b[0] for c in report.calls}
    assert_differences(rows["l1"], differences_by_hand(ref["l1"], got["l1"]))
    assert_differences(report.outputs[0].b[0], differences_by_hand(ref["(model)"], got["(model)"]))
    assert report.b == "scale=2" and report.first_over is not None


def test_an_unregistered_kind_is_not_a_side() -> None:
    with pytest.raises(UsageError, match="'scale=2' is not a side") as caught:
        parse_side("scale=2", "--b")
    assert "scale=K" not in str(caught.value.hint)


def _as_parsed(spec: str, kind: SideKind, check: Callable[[DiffReport], None], **kw: Any) -> None:
    """The kind's class alone gives the report its spec gives, and that report is right."""
    parsed = parse_side(spec, "--b")
    assert parsed.parts == (kind,)
    by_class = _report(Side(spec, (kind,)), **kw)
    assert by_class.to_dict() == _report(parsed, **kw).to_dict()
    check(by_class)


def _rows(report: DiffReport) -> dict[str, Any]:
    return {c.name: c.b[0] for c in report.calls if c.call == 0}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtype(dtype: torch.dtype) -> None:
    name = str(dtype).removeprefix("torch.")

    def check(report: DiffReport) -> None:
        ref = leaf_outputs(*chain_model(torch.float32))
        got = leaf_outputs(*chain_model(dtype))
        for layer in ("l1", "l4"):
            assert_differences(
                _rows(report)[layer], differences_by_hand(ref[layer], got[layer].double())
            )

    _as_parsed(name, DType(dtype), check)


def test_autocast() -> None:
    def check(report: DiffReport) -> None:
        model, x = chain_model(torch.float32)
        ref = leaf_outputs(model, x)
        with torch.autocast("cpu", dtype=torch.float16):
            got = leaf_outputs(model, x)
        assert_differences(_rows(report)["l1"], differences_by_hand(ref["l1"], got["l1"].float()))
        assert got["l1"].dtype == torch.float16

    _as_parsed("autocast:float16", Autocast(torch.float16), check)


def test_channels_last() -> None:
    def check(report: DiffReport) -> None:  # the same math in another layout: rounding only
        assert report.calls and all((_rows(report)[n].rel_l2 or 0) < 1e-5 for n in _rows(report))

    _as_parsed(
        "channels_last",
        ChannelsLast(),
        check,
        model="resnet18",
        given="randn:1x3x32x32",
        layers=("conv1", "layer1.0.conv1"),
    )


def test_quantized() -> None:
    def check(report: DiffReport) -> None:
        rows = _rows(report)
        assert set(rows) == {"layer1.0.conv1", "fc"}
        assert all(0.001 < (d.rel_l2 or 0) < 0.2 for d in rows.values())  # int8: ~1-3 %

    _as_parsed(
        "quantized",
        Quantized(),
        check,
        model="resnet18",
        given="randn:1x3x64x64",
        layers=("layer1.0.conv1", "fc"),
    )


def test_compile() -> None:
    def check(report: DiffReport) -> None:
        (row,) = _rows(report).values()
        assert row.numel == 128 and row.note is None
        assert row.rel_l2 is not None and row.rel_l2 < 1e-5

    _as_parsed("compile", Compile(), check, layers=("l2",))


def test_onnx() -> None:
    def check(report: DiffReport) -> None:
        assert [(c.name, c.call) for c in report.calls] == [
            ("l1", 0), ("act", 0), ("l2", 0), ("act", 1), ("l3", 0), ("act", 2), ("l4", 0)
        ]  # fmt: skip
        assert all(c.b[0].rel_l2 is not None and c.b[0].rel_l2 < 1e-5 for c in report.calls)

    _as_parsed("onnx", Onnx(), check)
    with pytest.raises(UsageError, match="cannot be the reference"):
        _report(parse_side("float32", "--b"), a="onnx")


def test_seed_device_and_weights(tmp_path: Path) -> None:
    def other_seed(report: DiffReport) -> None:
        torch.manual_seed(1)  # as hookcli builds a custom model: seed, then construct
        model1 = Chain().eval()
        model0, x = chain_model(torch.float32)
        with torch.no_grad():
            want = differences_by_hand(leaf_outputs(model0, x)["(model)"], model1(x))
        assert_differences(report.outputs[0].b[0], want)

    _as_parsed("seed=1", Setting("seed", 1), other_seed)

    def same(report: DiffReport) -> None:
        assert all(d.rel_l2 == 0 and d.max_abs == 0 for c in report.calls for d in c.b)

    _as_parsed("device=cpu", Setting("device", "cpu"), same)

    model, _ = chain_model(torch.float32)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["l3.weight"] += 0.05 * torch.randn_like(state["l3.weight"])
    path = tmp_path / "b.pt"
    torch.save(state, path)

    def from_l3(report: DiffReport) -> None:
        rows = _rows(report)
        assert rows["l1"].rel_l2 == 0 and rows["l2"].rel_l2 == 0 and rows["l3"].over
        assert report.first_over is not None and report.first_over.startswith("l3 (Linear)")

    _as_parsed(f"weights={path}", Setting("weights", str(path)), from_l3)
