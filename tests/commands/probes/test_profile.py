"""--profile: per-call time, FLOPs and output size; the selected calls, each counted once, set
against an unhooked pass; folder runs profile every batch and add them up."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision
from torch.utils.flop_counter import FlopCounterMode
from typer.testing import CliRunner

import hookcli
from hookcli.cli import app
from hookcli.commands.probes import profile as profile_probe
from hookcli.commands.profile import CallTree, profile_calls
from hookcli.engine.hooks import PendingCall
from hookcli.records import CallProfile, LayerCall, Profile
from hookcli.render.rows import profile_section
from tests.support.images import make_folder

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


# ---------------------------------------------------------------- containers and the footer


def _call(name: str, start_ms: float, end_ms: float, parent: PendingCall | None) -> PendingCall:
    p = PendingCall(LayerCall(name, "M", 0), parent=parent)
    p.t_forward = [int(start_ms * 1e6), int(end_ms * 1e6)]
    return p


def test_call_tree_splits_the_forward_without_counting_any_time_twice() -> None:
    """(model) 0-100 ms runs a 10-50 (selected, and its child a.x 15-45 selected too) and
    b 55-95 (not selected; its child b.y 57-92). Selected: a once = 40; outside modules:
    the model's own 100 - 40 - 40 = 20 and b's own 40 - 35 = 5; not selected: b.y = 35."""
    root = _call("(model)", 0, 100, None)
    a = _call("a", 10, 50, root)
    ax = _call("a.x", 15, 45, a)
    b = _call("b", 55, 95, root)
    by = _call("b.y", 57, 92, b)
    tree = CallTree([root, a, ax, b, by], {"a", "a.x"})
    assert tree.outermost == [a] and tree.selected == [a, ax]
    assert tree.layers_ms == pytest.approx(40)
    assert tree.outside_ms == pytest.approx(25)
    assert tree.unselected_ms == pytest.approx(35)
    assert tree.model_ms == pytest.approx(100)
    assert tree.own[a] == pytest.approx(10) and tree.own[ax] == pytest.approx(30)


def _outermost(report: hookcli.Report) -> list[str]:
    """The selected calls not inside another selected one, told from the dotted names alone
    (in resnet18 a module runs only inside its parents)."""
    names = {c.name for c in report.layers}
    return [
        c.name
        for c in report.layers
        if not any(c.name.startswith(f"{other}.") for other in names if other != c.name)
    ]


@pytest.mark.parametrize(
    "selection",
    [{"depth": 1}, {"layers": ["layer1", "layer1.*", "layer2", "fc"]}],
    ids=["depth 1", "nested containers"],
)
def test_footer_counts_selected_containers_once(selection: dict[str, Any]) -> None:
    """Issue 16: with containers selected the footer said 77% of the time ran outside modules,
    because only the selected leaf calls were added up. Now the selected calls are, each once
    (a call inside another selected one is part of it), and what is left of the model's
    forward is the forward's own code plus the modules not selected."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    report = hookcli.inspect(
        model, torch.randn(1, 3, 64, 64), device="cpu", profile=True, topk=0, **selection
    )
    prof = report.profile
    assert prof is not None and prof.model_ms is not None
    assert prof.outside_ms is not None and prof.unselected_ms is not None
    by_name = {c.name: c.profile for c in report.layers if c.profile is not None}
    outer = _outermost(report)
    assert prof.layers_ms == pytest.approx(sum(by_name[n].forward_ms for n in outer))
    assert prof.nested == len(report.layers) - len(outer)
    assert prof.containers == sum(n.startswith("layer") and n.count(".") < 2 for n in by_name)
    total = prof.layers_ms + prof.outside_ms + prof.unselected_ms
    assert total == pytest.approx(prof.model_ms)
    if "depth" in selection:  # the top level covers every module: only the model's own code
        assert prof.unselected_ms == 0 and prof.nested == 0
    else:
        assert prof.nested == 6 * 2 + 2  # layer1's two blocks and their six calls each
    assert prof.flops is not None and prof.layers_flops is not None
    flops = {n: p.flops for n, p in by_name.items()}
    assert prof.layers_flops == sum(flops[n] or 0 for n in outer)
    for block in ("layer1.0", "layer1.1"):
        if block in flops:  # a container's FLOPs are its children's (no product of its own)
            inner = [v or 0 for n, v in flops.items() if n.startswith(f"{block}.")]
            assert flops[block] == sum(inner)
    lines = [line.text for line in profile_section(report).lines()]
    assert lines[0].startswith(
        f"profile: the selected calls take {prof.layers_ms:.1f} ms = "
        f"{prof.layers_ms / prof.unhooked_ms:.0%} of an unhooked forward"
    )
    assert (
        f"outside any module (a forward's own code: additions, reshapes) {prof.outside_ms:.1f} ms "
        f"= {prof.outside_ms / prof.unhooked_ms:.0%}; in modules not selected "
        f"{prof.unselected_ms:.1f} ms" in lines[1]
    )


def test_default_selection_keeps_the_leaf_wording() -> None:
    report = hookcli.inspect(
        "resnet18", input_specs=["randn:1x3x32x32"], device="cpu", profile=True, topk=0
    )
    prof = report.profile
    assert prof is not None and prof.containers == 0 and prof.nested == 0
    times = [c.profile.forward_ms for c in report.layers if c.profile is not None]
    assert len(times) == len(report.layers)
    assert prof.layers_ms == pytest.approx(sum(times))
    assert profile_section(report).lines()[0].text.startswith("profile: the selected leaf calls")


# ---------------------------------------------------------------- folders


def test_profile_on_a_folder_adds_up_the_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each batch is profiled (its unhooked reference passes timed too) and the report holds
    the sums: every call's time, self time, output size and FLOPs, the unhooked passes, the
    selected calls; the number of batches is stated. FLOPs: 5 images, 5 times one image's
    (FlopCounterMode on its own)."""
    seen: list[tuple[Profile, dict[tuple[str, int], CallProfile], bool]] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        got = profile_calls(*args, **kwargs)
        seen.append((*got, kwargs["warm_up"]))
        return got

    monkeypatch.setattr(profile_probe, "profile_calls", spy)
    images = make_folder(tmp_path / "data", 5)
    layers = ["layer1", "layer1.0.*", "fc"]
    report = hookcli.inspect(
        "resnet18", [str(images)], batch_size=2, layers=layers, device="cpu", profile=True
    )
    prof = report.profile
    assert prof is not None and prof.batches == 3 == len(seen)
    assert "in 3 batches of up to 2" in report.input.description
    assert [warm for _, _, warm in seen] == [True, False, False]  # one warm-up, first batch
    parts = [p for p, _, _ in seen]
    for field in ("unhooked_ms", "layers_ms", "model_ms", "outside_ms", "unselected_ms"):
        assert getattr(prof, field) == pytest.approx(sum(getattr(p, field) for p in parts))
    assert prof.runs == 3 and prof.nested == 6
    for call in report.layers:
        p = call.profile
        key = (call.name, call.call)
        assert p is not None
        assert p.forward_ms == pytest.approx(sum(b[key].forward_ms for _, b, _ in seen))
        assert p.self_ms == pytest.approx(sum(b[key].self_ms or 0 for _, b, _ in seen))
        assert p.output_bytes == sum(b[key].output_bytes for _, b, _ in seen)
        assert p.flops == sum(b[key].flops or 0 for _, b, _ in seen)
        assert p.share == p.forward_ms / prof.unhooked_ms
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randn(1, 3, 224, 224))
    assert prof.flops == 5 * counter.get_total_flops()
    lines = [line.text for line in profile_section(report).lines()]
    assert "median of 3 per batch, added up over 3 batches" in lines[0]
    assert any("over 3 batches" in text and text.startswith("FLOPs:") for text in lines)


def test_cli_profile_on_a_folder(tmp_path: Path) -> None:
    images = make_folder(tmp_path / "data", 3)
    args = ["inspect", "resnet18", str(images), "--batch-size", "2", "-l", "fc", "--profile"]
    r = runner.invoke(app, [*args, "-f", "json"])
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["profile"]["batches"] == 2
    assert data["layers"][0]["profile"]["flops"] == 3 * 2 * 512 * 1000
