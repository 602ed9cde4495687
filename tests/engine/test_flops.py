"""--profile's FLOPs per layer call, against FlopCounterMode run on its own, torchinfo's
mult-adds, and products counted by hand on tiny models (issue 16, item 6)."""

from __future__ import annotations

import csv
import io
import json

import pytest
import torch
import torchvision
from torch import nn
from torch.nn.modules import module as module_globals
from torch.utils.flop_counter import FlopCounterMode
from torchinfo import summary
from typer.testing import CliRunner

import hookcli
from hookcli.cli import app
from hookcli.engine import flops as flops_module
from hookcli.records import SCHEMA_VERSION
from tests.support.oracles import hooks_left

runner = CliRunner()


def _resnet18() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet18().eval()


def test_resnet18_flops_equal_flopcountermode_and_torchinfo_mult_adds() -> None:
    """The whole forward's FLOPs are FlopCounterMode's total; each call's are what
    FlopCounterMode gives its module (each conv/linear runs once); MACs = FLOPs / 2 are
    torchinfo's mult-adds for every Conv2d and Linear, and for the model once torchinfo's
    extra multiply-adds — one per BatchNorm weight and bias and per Linear bias, per image,
    which FlopCounterMode does not count — are taken out."""
    model, batch = _resnet18(), 2
    x = torch.randn(batch, 3, 224, 224)
    report = hookcli.inspect(model, x, device="cpu", profile=True, topk=0)
    prof = report.profile
    assert prof is not None and prof.flops is not None and prof.flops_note is None
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(x)
    assert prof.flops == counter.get_total_flops() == 3_628_146_688 * batch
    per_module = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    by_name = {c.name: c for c in report.layers}
    for name, module in model.named_modules():
        if name in by_name and isinstance(module, nn.Conv2d | nn.Linear):
            p = by_name[name].profile
            assert p is not None and p.flops == per_module[f"ResNet.{name}"] > 0, name
    assert prof.layers_flops == prof.flops  # every leaf selected, no product outside modules

    info = summary(model, input_data=x, verbose=0)
    names = {id(m): n for n, m in model.named_modules()}
    checked = 0
    for layer in info.summary_list:
        module = layer.module
        if not isinstance(module, nn.Conv2d | nn.Linear):
            continue
        p = by_name[names[id(module)]].profile
        assert p is not None and p.flops is not None
        bias = module.bias.numel() * batch if module.bias is not None else 0
        assert layer.macs - bias == p.flops // 2, names[id(module)]
        checked += 1
    assert checked == 21  # 20 convolutions and fc
    extra = sum(
        p.numel() for m in model.modules() if isinstance(m, nn.BatchNorm2d) for p in m.parameters()
    )
    extra += model.fc.bias.numel()
    assert prof.flops % 2 == 0
    assert info.total_mult_adds == prof.flops // 2 + extra * batch
    assert hooks_left(model) == 0
    assert not module_globals._global_forward_hooks
    assert not module_globals._global_forward_pre_hooks


class Twice(nn.Module):
    """One Linear called twice on inputs of different sizes, a product outside any module."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.block = nn.Sequential(nn.Linear(16, 4), nn.ReLU())
        self.w = nn.Parameter(torch.randn(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.lin(x)  # (B, 16)
        b = self.lin(torch.cat([x, x, x]))  # (3B, 16)
        h = self.block(torch.cat([a, b]))  # (4B, 4)
        return h @ self.w  # (4B, 3): in the model's own code


def test_a_module_called_twice_has_one_count_per_call_and_containers_hold_children() -> None:
    """FlopCounterMode adds a module's calls up under its name; here each call has its own
    count (2·M·N·K per product, counted by hand), a container's is its children's, and the
    product in the model's own forward counts for the model, not for a selected call."""
    torch.manual_seed(0)
    model, b = Twice().eval(), 5
    x = torch.randn(b, 8)
    report = hookcli.inspect(
        model, x, device="cpu", profile=True, topk=0, layers=["lin", "block", "block.*"]
    )
    flops = {(c.name, c.call): c.profile.flops for c in report.layers if c.profile is not None}
    assert flops == {
        ("lin", 0): 2 * b * 8 * 16,
        ("lin", 1): 2 * 3 * b * 8 * 16,
        ("block", 0): 2 * 4 * b * 16 * 4,
        ("block.0", 0): 2 * 4 * b * 16 * 4,
        ("block.1", 0): 0,
    }
    outside = 2 * 4 * b * 4 * 3
    prof = report.profile
    assert prof is not None and prof.nested == 2 and prof.containers == 1
    assert prof.flops == sum(flops.values()) - flops[("block.0", 0)] + outside
    assert prof.layers_flops == prof.flops - outside  # block.0 counted once, in block
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(x)
    assert prof.flops == counter.get_total_flops()
    counts = counter.get_flop_counts()
    assert sum(counts["Twice.lin"].values()) == flops[("lin", 0)] + flops[("lin", 1)]


def test_backward_flops_equal_flopcountermode_over_the_same_backward() -> None:
    model = _resnet18()
    x = torch.randn(1, 3, 64, 64)
    report = hookcli.grads(model, x, device="cpu", profile=True, topk=0, layers=["fc"])
    prof = report.profile
    assert prof is not None and prof.flops is not None and prof.backward_flops is not None
    with FlopCounterMode(display=False) as counter:
        out = model(x)
        forward = counter.get_total_flops()
        out[0].max().backward()  # the gradient's FLOPs do not depend on which logit
    model.zero_grad(set_to_none=True)
    assert prof.flops == forward
    assert prof.backward_flops == counter.get_total_flops() - forward > prof.flops


def test_flops_in_json_csv_and_the_table() -> None:
    args = ["inspect", "resnet18", "-l", "layer1", "-l", "fc", "--profile", "--topk", "0"]
    args += ["--input", "randn:1x3x64x64"]
    js = runner.invoke(app, [*args, "-f", "json"])
    assert js.exit_code == 0, js.stderr
    data = json.loads(js.stdout)
    assert data["schema"] == SCHEMA_VERSION  # FLOPs are additive: no schema change of theirs
    flops = {(c["name"], c["call"]): c["profile"]["flops"] for c in data["layers"]}
    assert flops[("fc", 0)] == 2 * 512 * 1000
    assert data["profile"]["layers_flops"] == sum(flops.values())
    assert data["profile"]["batches"] == 1
    table = runner.invoke(app, args)
    assert table.exit_code == 0, table.stderr
    assert "FLOPs" in table.stdout and "1.02M" in table.stdout  # fc: 1,024,000
    share = data["profile"]["layers_flops"] / data["profile"]["flops"]
    assert f"({share:.1%} of the model's)" in table.stdout
    out = runner.invoke(app, [*args, "-f", "csv"])
    assert out.exit_code == 0, out.stderr
    rows = list(csv.DictReader(io.StringIO(out.stdout)))
    assert {(r["layer"], int(r["call"])): int(r["flops"]) for r in rows if r["flops"]} == flops
    plain = runner.invoke(app, ["inspect", "resnet18", "-l", "fc", "-f", "csv", "--topk", "0"])
    assert "flops" not in plain.stdout.splitlines()[0]  # the columns come with --profile


def test_a_model_the_counter_cannot_run_keeps_its_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """The counting pass failing (an operator the counting mode refuses) costs the FLOPs
    only: the times, statistics and exit code stand, and the footer says why."""

    class Refuses(FlopCounterMode):
        def __enter__(self) -> FlopCounterMode:
            raise RuntimeError("no formula for mylib::op")

    monkeypatch.setattr(flops_module, "FlopCounterMode", Refuses)
    model = _resnet18()
    report = hookcli.inspect(
        model, torch.randn(1, 3, 32, 32), device="cpu", profile=True, topk=0, layers=["fc"]
    )
    prof = report.profile
    assert prof is not None and prof.flops is None and prof.layers_flops is None
    assert prof.flops_note is not None and "no formula for mylib::op" in prof.flops_note
    assert all(c.profile is not None and c.profile.flops is None for c in report.layers)
    assert hooks_left(model) == 0
    r = runner.invoke(
        app, ["inspect", "resnet18", "-l", "fc", "--profile", "--input", "randn:1x3x32x32"]
    )
    assert r.exit_code == 0, r.stderr
    assert "FLOPs not counted: RuntimeError: no formula for mylib::op" in r.stdout


class Quantish(nn.Module):
    """Only operators FlopCounterMode has no formula for (elementwise, pooling)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.avg_pool2d(x.relu() * 2, 2)


def test_a_model_with_no_counted_operator_says_so_rather_than_zero_work() -> None:
    report = hookcli.inspect(Quantish(), torch.randn(1, 2, 4, 4), device="cpu", profile=True)
    prof = report.profile
    assert prof is not None and prof.flops == 0
    assert prof.flops_note is not None and "counted no FLOPs" in prof.flops_note


def test_attention_on_the_cpu_counts_as_the_math_kernels_products() -> None:
    """F.scaled_dot_product_attention runs a CPU kernel torch's registry has no formula for:
    its forward FLOPs are those of the same attention computed by the math backend's matmuls
    (which the registry counts), its backward the registry's formula for the fused kernels'
    backward (which recomputes QK^T), as on a GPU."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import sdpa_backward_flop_count

    class Attend(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(16, 48)
            self.attend = Attend()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).view(2, 7, 3, 4, 4).permute(2, 0, 3, 1, 4)
            return self.attend(q, k, v)

    torch.manual_seed(0)
    report = hookcli.grads(Net(), torch.randn(2, 7, 16), device="cpu", profile=True,
                           layers=["attend"])  # fmt: skip
    (call,) = [c for c in report.layers if c.name == "attend"]
    q, k, v = (torch.randn(2, 4, 7, 4) for _ in range(3))
    with FlopCounterMode(display=False) as alone:
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert alone.get_total_flops() == 0  # torch alone: the CPU kernel counts nothing
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as math:
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert call.profile is not None
    assert call.profile.flops == math.get_total_flops() == 2 * 2 * 4 * 7 * 7 * 4 * 2
    prof = report.profile
    assert prof is not None and prof.flops is not None and prof.backward_flops is not None
    linear = 2 * 2 * 7 * 16 * 48
    assert prof.flops == linear + call.profile.flops
    shape = (2, 4, 7, 4)
    # the Linear's weight gradient (its input needs none), then attention's backward
    assert prof.backward_flops == linear + sdpa_backward_flop_count(shape, shape, shape, shape)
