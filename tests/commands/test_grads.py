"""Gradients against independent oracles: torch.autograd.grad on a copy of the model with
every in-place op disabled, and .grad after a plain backward."""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision
from torch import nn

import hookcli
from hookcli.errors import UsageError
from tests.support.oracles import assert_stats_match, hooks_left, oracle_grads


def plain_param_grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    twin = copy.deepcopy(model)
    twin(x).max(dim=1).values.sum().backward()
    return {n: p.grad for n, p in twin.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "name", ["resnet18", "mobilenet_v3_small", "densenet121", "efficientnet_b0"]
)
def test_grad_outputs_and_param_grads_match_autograd(name: str) -> None:
    torch.manual_seed(0)
    model = torchvision.models.get_model(name).eval()
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = hookcli.grads(model, x, device="cpu", topk=0)
    assert report.backward is not None and "top-1" in report.backward.source
    want = oracle_grads(model, x)
    checked = 0
    for call in report.layers:
        for g in call.grad_outputs or []:
            assert_stats_match(
                g, want[(call.name, call.call, g.path)], rtol=1e-5, same_tensor=False
            )
            checked += 1
    assert checked == len(want), (checked, len(want))
    # parameter gradients: the same as .grad after a plain backward
    ref = plain_param_grads(model, x)
    seen = 0
    for call in report.layers:
        for p in call.params or []:
            if p.grad is not None:
                assert_stats_match(
                    p.grad, ref[f"{call.name}.{p.name}"], rtol=1e-5, same_tensor=False
                )
                seen += 1
    assert seen == len(ref)
    # the image needs no grad: the first conv has no gradient w.r.t. its input
    first = report.layers[0]
    assert first.grad_inputs is None and first.grad_outputs is not None
    # model untouched: no hooks, no .grad, same state
    assert hooks_left(model) == 0
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_resnet18_in_place_relu_calls_each_get_their_gradient() -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    report = hookcli.grads(model, torch.randn(1, 3, 224, 224), device="cpu", layers=["layer1.0.*"])
    relu = [c for c in report.layers if c.name == "layer1.0.relu"]
    assert [c.call for c in relu] == [0, 1]
    assert all(c.grad_outputs and c.grad_inputs for c in relu)
    # ReLU(inplace) after bn1: its input gradient is bn1's output gradient
    bn1 = next(c for c in report.layers if c.name == "layer1.0.bn1")
    assert relu[0].grad_inputs[0].norm == pytest.approx(bn1.grad_outputs[0].norm, rel=1e-9)


class _RootHeld(nn.Module):
    """A ViT's habit: the model itself holds its class token and position term."""

    def __init__(self) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.randn(1, 1, 8))
        self.pos = nn.Parameter(torch.zeros(1, 5, 8))  # d sqrt(|p|)/dp at 0: not finite
        self.proj, self.head = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1)
        return self.head((self.proj(t) + self.pos.abs().sqrt())[:, 0])


def test_parameters_the_model_itself_holds_are_measured_and_checked() -> None:
    """The root's own parameters (timm's and torchvision's ViT class token and position
    embedding) get their gradients against torch.autograd.grad, and a NaN in one fails
    --fail-on nonfinite: by default the model is a selected module when it holds any."""
    torch.manual_seed(0)
    model = _RootHeld()
    x = torch.randn(2, 4, 8)
    report = hookcli.grads(model, x, target="sum", topk=0)
    params = {p.name: p for c in report.layers if c.name == "(model)" for p in c.params or []}
    assert set(params) == {"cls_token", "pos"}
    want = torch.autograd.grad(model(x).sum(), [model.cls_token, model.pos])
    got = params["cls_token"].grad
    assert got is not None
    assert_stats_match(got, want[0], rtol=1e-5, same_tensor=False)
    pos = params["pos"].grad
    assert pos is not None and pos.nan == int(want[1].isnan().sum()) > 0
    checked = hookcli.check(model, x, fail_on=["nonfinite"], backward=True, target="sum")
    assert not checked.checks[0].passed and "pos.grad" in checked.checks[0].failures[0].message


class _PlainGain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gain = torch.ones(4, requires_grad=True)  # trained by hand: no Parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.gain * SCALE


SCALE = torch.full((4,), 2.0, requires_grad=True)  # a global leaf the forward reads


def test_leaves_that_are_no_parameters_keep_their_grad() -> None:
    """A tensor attribute that requires grad but is no Parameter, and a global one the forward
    reads: the backward reaches them as leaves, and grads leaves their .grad as it found it
    (None stays None; the user's own gradient is not added to), run after run."""
    model = _PlainGain()
    x = torch.randn(2, 4)
    mine = torch.full((4,), 7.0)
    SCALE.grad = mine
    for _ in range(2):
        report = hookcli.grads(model, x, target="sum", topk=0)
        assert model.gain.grad is None and SCALE.grad is mine and bool((mine == 7).all())
    [call] = [c for c in report.layers if c.name == "lin"]
    want = torch.autograd.grad(model(x).sum(), [model.lin.weight])[0]
    weight = next(p for p in call.params or [] if p.name == "weight").grad
    assert weight is not None
    assert_stats_match(weight, want, rtol=1e-5, same_tensor=False)
    SCALE.grad = None


class _TokenMLP(nn.Module):
    """A Linear on (batch, tokens, C) returns a view of its matmul's result; an in-place ReLU
    and an in-place residual after it rebase the view, and torch calls no hook on it."""

    def __init__(self, inplace: bool = True) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.ReLU(inplace=inplace), nn.Linear(16, 8)
        self.head = nn.Linear(8, 3)
        self.inplace = inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(self.act(self.fc1(x)))
        if self.inplace:
            h += x
        else:
            h = h + x
        return self.head(h.mean(1))


def test_views_modified_in_place_after_the_layer_get_their_gradient() -> None:
    """fc1's and fc2's outputs (views) each get the gradient of their value before the
    in-place op, as torch.autograd.grad gives it on the same model without in-place ops; and
    the ReLU's input gradient too (they were null: no gradient)."""
    torch.manual_seed(0)
    model = _TokenMLP()
    x = torch.randn(2, 5, 8)
    report = hookcli.grads(model, x, target="sum", topk=0)
    got = {(c.name, "out", g.path): g for c in report.layers for g in c.grad_outputs or []}
    got |= {(c.name, "in", g.path): g for c in report.layers for g in c.grad_inputs or []}
    twin = copy.deepcopy(model)
    twin.act.inplace, twin.inplace = False, False
    z1 = twin.fc1(x)
    z2 = twin.fc2(twin.act(z1))
    y = twin.head((z2 + x).mean(1))
    want = torch.autograd.grad(y.sum(), [z1, z2])
    assert_stats_match(got[("fc1", "out", "out")], want[0], rtol=1e-5, same_tensor=False)
    assert_stats_match(got[("act", "in", "in[0]")], want[0], rtol=1e-5, same_tensor=False)
    assert_stats_match(got[("fc2", "out", "out")], want[1], rtol=1e-5, same_tensor=False)
    assert hooks_left(model) == 0


class _ViewOfAView(nn.Module):
    """A Flatten whose input is a view of the conv's output (its _base is that output, not
    the input it was given): no gradient reaches the Flatten's output, though one reaches
    the conv's through the head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.flat, self.fc = nn.Conv2d(3, 4, 3), nn.Flatten(2), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.conv(x)
        self.kept = self.flat(c.view(c.shape)).argmax(-1)
        return self.fc(c.mean((2, 3)))


def test_a_view_of_a_tensor_others_read_gets_no_gradient_of_theirs() -> None:
    """The view's base is read elsewhere (the conv's output goes on to the head): its
    gradient is not the view's, and the view, which no gradient reaches, stays null."""
    report = hookcli.grads(_ViewOfAView(), torch.randn(1, 3, 8, 8), target="sum", topk=0)
    calls = {c.name: c for c in report.layers}
    assert calls["conv"].grad_outputs and not calls["flat"].grad_outputs


def test_input_grad_and_the_users_grads_are_restored() -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    x = torch.randn(1, 3, 224, 224)
    sentinel = torch.full_like(model.fc.weight, 7.0)
    model.fc.weight.grad = sentinel
    report = hookcli.grads(model, x, device="cpu", input_grad=True, layers=["conv1"])
    assert model.fc.weight.grad is sentinel
    assert not x.requires_grad and x.grad is None
    assert report.layers[0].grad_inputs is not None
    assert report.input_grads is not None
    x2 = x.clone().requires_grad_(True)
    copy.deepcopy(model)(x2).max(dim=1).values.sum().backward()
    assert_stats_match(report.input_grads[0], x2.grad, rtol=1e-5, same_tensor=False)
    assert report.layers[0].grad_inputs[0].norm == pytest.approx(report.input_grads[0].norm)


def test_train_mode_leaves_the_state_dict_unchanged() -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18()
    model.eval()
    before = copy.deepcopy(model.state_dict())
    report = hookcli.grads(
        model, torch.randn(2, 3, 64, 64), device="cpu", train=True, layers=["bn1"]
    )
    assert report.model.mode == "train"
    assert not model.training
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # and train mode really ran: batch statistics, so bn1's output is normalised per batch
    out = report.layers[0].outputs[0]
    assert abs(out.mean) < 1e-3 and out.std == pytest.approx(1.0, rel=1e-2)


def test_gradient_that_does_not_reach_the_target_is_null() -> None:
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(3, 4)
            self.unused = nn.Linear(3, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.unused(x)
            return self.used(x)

    report = hookcli.grads(TwoHeads(), torch.randn(2, 3), device="cpu", target="sum")
    by_name = {c.name: c for c in report.layers}
    assert by_name["used"].grad_outputs is not None
    assert by_name["unused"].grad_outputs is None
    assert [p.grad for p in by_name["unused"].params or []] == [None, None]


def test_frozen_model_without_input_grad_is_refused() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(UsageError, match="requires grad"):
        hookcli.grads(model, torch.randn(1, 2), device="cpu", target="sum")
    report = hookcli.grads(model, torch.randn(1, 2), device="cpu", target="sum", input_grad=True)
    assert report.input_grads is not None


def test_targets_and_losses() -> None:
    from hookcli.sources import load_model

    model = load_model("resnet18", seed=0).module  # the same weights the runs below build
    x = torch.randn(1, 3, 64, 64)
    by_label = hookcli.grads("resnet18", x, device="cpu", target="tabby cat", layers=["fc"])
    by_index = hookcli.grads("resnet18", x, device="cpu", target="281", layers=["fc"])
    assert by_label.backward.value == by_index.backward.value  # type: ignore[union-attr]
    with torch.no_grad():
        assert by_index.backward.value == pytest.approx(float(model(x)[0, 281]))  # type: ignore[union-attr]
    ce = hookcli.grads("resnet18", x, device="cpu", loss="ce:281", layers=["fc"])
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(model(x), torch.tensor([281]))
    assert ce.backward.value == pytest.approx(float(want))  # type: ignore[union-attr]
    with pytest.raises(UsageError, match="tabby"):
        hookcli.grads("resnet18", x, device="cpu", target="taby cat")
    with pytest.raises(UsageError, match="out of range"):
        hookcli.grads("resnet18", x, device="cpu", target="1000")
    with pytest.raises(UsageError, match="shape 1x1000"):
        hookcli.grads("resnet18", x, device="cpu", loss="mse:ones:10")


class MixedWeights(nn.Module):
    """Weights measured each way: small float32 ones together, one past TOGETHER elements
    alone, float64 ones by the careful path."""

    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Linear(4, 6)
        self.wide = nn.Linear(6, 3000)  # 18,000 weights
        self.wide64 = nn.Linear(3000, 2).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wide64(self.wide(self.small(x)).double()).float()  # type: ignore[no-any-return]


def test_each_weights_norm_and_gradient_whatever_its_size_or_dtype() -> None:
    """Every parameter's norm, its gradient's statistics, norm, mean, largest magnitude and
    the ratio of the two norms equal float64 torch on the parameter and on .grad after a
    plain backward, whichever way each was measured."""
    torch.manual_seed(0)
    model, x = MixedWeights(), torch.randn(5, 4)
    report = hookcli.grads(model, x, device="cpu", target="sum", topk=0)
    twin = copy.deepcopy(model)
    twin(x).sum().backward()
    params, ref = dict(model.named_parameters()), dict(twin.named_parameters())
    seen = 0
    for call in report.layers:
        for p in call.params or []:
            weight, grad = params[f"{call.name}.{p.name}"], ref[f"{call.name}.{p.name}"].grad
            assert grad is not None and p.grad is not None
            norm, grad_norm = weight.double().norm().item(), grad.double().norm().item()
            assert p.norm == pytest.approx(norm, rel=1e-9), (call.name, p.name)
            assert_stats_match(p.grad, grad, rtol=1e-5, same_tensor=False)
            assert p.grad_norm == pytest.approx(grad_norm, rel=1e-5)
            assert p.grad_mean == pytest.approx(grad.double().mean().item(), rel=1e-4, abs=1e-9)
            assert p.grad_max_abs == pytest.approx(grad.abs().max().item(), rel=1e-5)
            assert p.ratio == pytest.approx(grad_norm / norm, rel=1e-5)
            seen += 1
    assert seen == 6


class ScalesItsWeight(nn.Module):
    """Hands its weight to a hooked module as an input, then changes it through .data (no
    version bump): the weight the pass ends with is not the one the call saw."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))
        self.seen = nn.Identity()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.seen(self.weight)
        out = self.lin(x @ w.t() @ w)
        self.weight.data.mul_(2.0)
        return out  # type: ignore[no-any-return]


def test_a_weight_seen_as_an_input_is_measured_as_the_pass_left_it() -> None:
    """A parameter's norm is its norm when the parameters are measured, after the pass (as
    its gradient is), not the row of the call that saw it as an input earlier."""
    torch.manual_seed(0)
    model, x = ScalesItsWeight(), torch.randn(5, 4)
    before = model.weight.detach().clone()
    report = hookcli.grads(model, x, device="cpu", target="sum", topk=0, layers=["seen", ""])
    seen = next(c for c in report.layers if c.name == "seen")
    assert seen.inputs[0].norm == pytest.approx(before.double().norm().item(), rel=1e-9)
    root = next(c for c in report.layers if c.name == "(model)")
    [weight] = [p for p in root.params or [] if p.name == "weight"]
    assert weight.norm == pytest.approx(2.0 * before.double().norm().item(), rel=1e-9)


class _Compiled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.head = nn.Linear(6, 6), nn.Linear(6, 2)
        block = nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 6))
        self.block = torch.compile(block, backend="eager")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.stem(x)))


def test_layers_a_warm_compiled_cache_skips_are_said_never_silent() -> None:
    """A compiled block the model ran once before (its graph traced with no hooks) calls
    none of its layers as modules in grads: the report says why and what to do, and after
    torch._dynamo.reset() they are seen, their gradients against torch.autograd.grad."""
    torch.manual_seed(0)
    model = _Compiled()
    x = torch.randn(3, 6)
    model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    report = hookcli.grads(model, x, target="sum", topk=0)
    inside = ["block._orig_mod.0", "block._orig_mod.1", "block._orig_mod.2"]
    assert report.never_called == inside
    assert any("a warm cache" in n and "torch._dynamo.reset()" in n for n in report.notes)
    torch._dynamo.reset()
    report = hookcli.grads(model, x, target="sum", topk=0)
    assert report.never_called == [] and not any("a warm cache" in n for n in report.notes)
    [call] = [c for c in report.layers if c.name == "block._orig_mod.0"]
    first = model.block._orig_mod[0]
    out = first(model.stem(x))
    want = torch.autograd.grad(
        model.head(model.block._orig_mod[2](model.block._orig_mod[1](out))).sum(), out
    )[0]
    assert call.grad_outputs is not None
    assert_stats_match(call.grad_outputs[0], want, rtol=1e-5, same_tensor=False)
    torch._dynamo.reset()


class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.pre, self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        inner = checkpoint(lambda h: self.b(self.a(h)), self.pre(x), use_reentrant=self.reentrant)
        assert isinstance(inner, torch.Tensor)
        return inner


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_reentrant_checkpoints_layers_are_said_to_have_no_gradient(reentrant: bool) -> None:
    """Layers inside a reentrant torch.utils.checkpoint run under no_grad in the forward (and
    again, unhooked, in backward): their gradients are absent and the report says why; a
    non-reentrant checkpoint's get theirs (against torch.autograd.grad) and nothing is said."""
    torch.manual_seed(0)
    model = _Checkpointed(reentrant)
    x = torch.randn(2, 4)
    report = hookcli.grads(model, x, target="sum", topk=0)
    said = [n for n in report.notes if "ran under torch.no_grad inside the model: a, b" in n]
    calls = {c.name: c for c in report.layers}
    if reentrant:
        assert said and not calls["a"].grad_outputs
        return
    assert not said
    h = model.a(model.pre(x))
    want = torch.autograd.grad(model.b(h).sum(), h)[0]
    assert calls["a"].grad_outputs
    assert_stats_match(calls["a"].grad_outputs[0], want, rtol=1e-5, same_tensor=False)
