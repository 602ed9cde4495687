"""Diff by hand: each leaf's tensors kept by hooks of the test's own, the differences diff
reports computed from them, the tests' Chain model, and the quantized twins of resnet18."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hookcli.records import TensorDiff
from tests.support.models import Chain

CHAIN = "tests/support/models.py:Chain"


def leaf_outputs(
    model: nn.Module, x: torch.Tensor, feed: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Each leaf's first output (with feed: each leaf run on the given input instead).
    The hooks return None: a forward hook that returns a value replaces the output."""
    out: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Any:
        def hook(mod: nn.Module, args: Any, o: torch.Tensor) -> None:
            out.setdefault(name, o.detach().clone())

        return hook

    def give(name: str) -> Any:
        def hook(mod: nn.Module, args: Any) -> Any:
            return (feed[name],) if feed is not None and name in feed else None

        return hook

    handles = []
    for name, m in model.named_modules():
        if name and not list(m.children()):
            handles.append(m.register_forward_pre_hook(give(name)))
            handles.append(m.register_forward_hook(keep(name)))
    try:
        with torch.no_grad():
            out["(model)"] = model(x).detach()
    finally:
        for h in handles:
            h.remove()
    return out


def leaf_inputs(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each leaf's first input."""
    got: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Any:
        def hook(mod: nn.Module, args: Any) -> None:
            got.setdefault(name, args[0].detach().clone())

        return hook

    handles = [
        m.register_forward_pre_hook(keep(name))
        for name, m in model.named_modules()
        if name and not list(m.children())
    ]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return got


def differences_by_hand(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    a64, b64 = a.double().reshape(-1), b.double().reshape(-1)
    d = b64 - a64
    return {
        "max_abs": float(d.abs().max()),
        "rel_l2": float(d.norm() / a64.norm()),
        "cosine": float(a64 @ b64 / (a64.norm() * b64.norm())),
        "sqnr_db": float(10 * torch.log10(a64.square().sum() / d.square().sum())),
    }


def assert_differences(d: TensorDiff, want: dict[str, float]) -> None:
    for key, value in want.items():
        assert getattr(d, key) == pytest.approx(value, rel=1e-9, abs=1e-15), key


def chain_model(dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)  # as hookcli builds a custom model: seed, then construct
    model = Chain().eval().to(dtype)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    return model, x


def quantized_twins(x: torch.Tensor) -> tuple[nn.Module, nn.Module]:
    """torchvision's quantizable resnet18 with hookcli's seed-0 weights, fused, and its int8
    version calibrated on x: what `diff resnet18 --a float32 --b quantized` compares, by hand."""
    import copy

    import torchvision
    from torch.ao import quantization as tq

    from hookcli.sources import load_model

    twin = torchvision.models.get_model("quantized_resnet18", weights=None, quantize=False)
    twin.load_state_dict(load_model("resnet18", seed=0).module.state_dict())
    twin.eval()
    twin.fuse_model()
    int8 = copy.deepcopy(twin)
    int8.qconfig = tq.get_default_qconfig("x86")
    tq.prepare(int8, inplace=True)
    with torch.no_grad():
        int8(x)
    tq.convert(int8, inplace=True)
    return twin, int8
