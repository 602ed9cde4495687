"""GPU paths. Skipped on machines without CUDA (this project's CI has none); run them where
a GPU exists: the hooked pass must not synchronise with the host (HOOK_PITFALLS 8)."""

from __future__ import annotations

import pytest
import torch
import torchvision

import hookcli
from tests.conftest import assert_stats_match

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_hooked_pass_never_synchronises_and_matches_the_oracle() -> None:
    from hookcli.engine.stats import StatsCollector

    model = torchvision.models.resnet18().eval().cuda()
    x = torch.randn(2, 3, 224, 224, device="cuda")
    c = StatsCollector()
    t = torch.randn(1000, device="cuda")
    t[::7] = float("nan")
    torch.cuda.set_sync_debug_mode("error")
    try:
        entry = c.add(t, "x")
        report = hookcli.inspect(model, x, device="cuda", topk=0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    c.finalize()
    assert_stats_match(entry, t.cpu())
    assert report.device.startswith("cuda") and report.layers


def test_profile_on_cuda_uses_events() -> None:
    model = torchvision.models.resnet18().eval().cuda()
    x = torch.randn(2, 3, 224, 224, device="cuda")
    report = hookcli.inspect(model, x, device="cuda", topk=0, profile=True)
    assert report.profile is not None
    assert all(c.profile is not None and c.profile.forward_ms > 0 for c in report.layers)
