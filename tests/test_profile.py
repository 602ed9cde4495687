"""--profile: per-call time and output size; the leaf calls add up to an unhooked pass."""

from __future__ import annotations

import pytest
import torch
import torchvision
from typer.testing import CliRunner

import hookcli
from hookcli.cli import app

runner = CliRunner()


def test_profile_accounts_for_the_unhooked_pass() -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    x = torch.randn(2, 3, 224, 224)
    report = hookcli.inspect(model, x, device="cpu", profile=True, topk=0)
    prof = report.profile
    assert prof is not None and prof.runs == 3 and prof.unhooked_ms > 0
    for call in report.layers:
        p = call.profile
        assert p is not None and p.forward_ms > 0
        assert p.output_bytes == sum(t.numel * 4 for t in call.outputs)  # float32 outputs
    # the accounting, exactly: each share is the call's time over the unhooked pass, and the
    # leaf calls (every one is selected here) add up to layers_ms. How close layers_ms comes to
    # the unhooked pass is a timing figure, measured by benchmarks/overhead.py, not asserted
    # here (tests hold no timing thresholds; a busy machine moves them).
    total = 0.0
    for call in report.layers:
        assert call.profile is not None and call.profile.share is not None
        assert call.profile.share == call.profile.forward_ms / prof.unhooked_ms
        total += call.profile.forward_ms
    assert total == pytest.approx(prof.layers_ms)


def test_profile_backward_and_cli() -> None:
    report = hookcli.grads(
        "resnet18",
        input_specs=["randn:1x3x64x64"],
        device="cpu",
        profile=True,
        layers=["layer4.*"],
        topk=0,
    )
    assert report.profile is not None and report.profile.unhooked_backward_ms is not None
    assert all(c.profile is not None and c.profile.backward_ms is not None for c in report.layers)
    r = runner.invoke(app, ["inspect", "resnet18", "-l", "layer1.0.*", "--profile"])
    assert r.exit_code == 0, r.stderr
    assert "total ms" in r.stdout and "self ms" in r.stdout
    assert "of an unhooked forward" in r.stdout


def test_profile_self_time_of_a_container_excludes_its_children() -> None:
    """A block's self time is its total less its direct children's totals; a leaf's self
    time is its total (issue 9: containers say self vs total)."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    x = torch.randn(1, 3, 64, 64)
    report = hookcli.inspect(
        model, x, device="cpu", profile=True, topk=0, layers=["layer1.0", "layer1.0.*"]
    )
    block = next(c for c in report.layers if c.name == "layer1.0")
    children = [c for c in report.layers if c.name.startswith("layer1.0.")]
    assert len(children) == 6  # conv1, bn1, relu (twice), conv2, bn2
    assert block.profile is not None and block.profile.self_ms is not None
    inner = sum(c.profile.forward_ms for c in children if c.profile is not None)
    assert block.profile.self_ms == pytest.approx(max(block.profile.forward_ms - inner, 0.0))
    assert block.profile.forward_ms >= inner
    for c in children:
        assert c.profile is not None and c.profile.self_ms == c.profile.forward_ms
