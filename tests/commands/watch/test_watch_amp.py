"""hookcli.watch with a GradScaler, half-precision weights and gradient accumulation: the
numbers logged are the loss's own (the layers' gradients with the loss scale divided out, as
the parameters' are once the scaler has unscaled them), the scale is the one each step ran at,
a bfloat16 weight's norms and update ratio are float64's, and the losses given per micro-batch
add up. Oracles: the same model in float64 without a scaler, torch.autograd by retain_grad, the
weights before and after the step by hand, the scaler's own scale read before update()."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import hookcli


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def test_layer_gradients_under_a_gradscaler_are_the_losss_own() -> None:
    model = _model()
    x, y = torch.randn(5, 4), torch.randn(5, 3)
    ref = copy.deepcopy(model).double()
    hidden = ref[1](ref[0](x.double()))
    hidden.retain_grad()
    out = ref[2](hidden)
    out.retain_grad()
    F.mse_loss(out, y.double()).backward()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with hookcli.watch(model, optimizer=opt, scaler=scaler) as w:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
        scaler.step(opt)
        scaler.update()
    (record,) = w.records
    assert record.scale == 1024.0 and record.skipped is False
    calls = {c.name: c for c in record.layers}
    for name, want in (("2", out.grad), ("1", hidden.grad)):
        assert want is not None
        (g,) = calls[name].grad_outputs or []
        assert g.norm == pytest.approx(float(want.norm()), rel=1e-5), name
        assert g.max == pytest.approx(float(want.max()), rel=1e-5), name
    grads = {p.name: p.grad for p in record.params}
    weight = grads["2.weight"]
    assert weight is not None and ref[2].weight.grad is not None
    assert weight.norm == pytest.approx(float(ref[2].weight.grad.norm()), rel=1e-5)


def test_the_scale_logged_is_the_one_each_step_ran_at() -> None:
    """growth_interval=1 doubles the scale after every good step; an inf planted in one step's
    gradient makes the scaler skip it and halve the scale. The scale logged is the step's own,
    read before update() changes it."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    ran_at, skipped = [], []
    x, y = torch.randn(5, 4), torch.randn(5, 3)
    with hookcli.watch(model, optimizer=opt, scaler=scaler) as w:
        for step in range(3):
            opt.zero_grad()
            scaler.scale(F.mse_loss(model(x), y)).backward()  # type: ignore[no-untyped-call]
            if step == 1:
                model[0].bias.grad[0] = float("inf")  # type: ignore[index]
            ran_at.append(scaler.get_scale())
            scaler.step(opt)
            scaler.update()
            skipped.append(scaler.get_scale() < ran_at[-1])
    assert ran_at == [1024.0, 2048.0, 1024.0] and skipped == [False, True, False]
    assert [r.scale for r in w.records] == ran_at
    assert [r.skipped for r in w.records] == skipped


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_weights_norms_and_update_ratios_are_float64s(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(16, 64, dtype=dtype), torch.randn(16, 8)
    before = [p.detach().clone() for p in model.parameters()]
    with hookcli.watch(model, optimizer=opt) as w:
        opt.zero_grad()
        F.mse_loss(model(x).float(), y).backward()
        opt.step()
    (record,) = w.records
    for p, b, logged in zip(model.parameters(), before, record.params, strict=True):
        norm = float(b.double().norm())
        update = float((p.detach().double() - b.double()).norm())
        assert logged.norm == pytest.approx(norm, rel=1e-12), logged.name
        assert logged.update_norm == pytest.approx(update, rel=1e-12), logged.name
        assert logged.update_ratio == pytest.approx(update / norm, rel=1e-12), logged.name


def test_losses_given_per_micro_batch_add_up_to_the_steps() -> None:
    """Gradient accumulation: each micro-batch's loss (÷ the count, as backpropagated) given to
    w.loss; the step's logged loss is their sum — what the step backpropagated, and what the
    Lightning callback logs. It was the last micro-batch's alone."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    given = []
    with hookcli.watch(model, optimizer=opt) as w:
        opt.zero_grad()
        for _ in range(4):
            x, y = torch.randn(5, 4), torch.randn(5, 3)
            loss = F.mse_loss(model(x), y) / 4
            w.loss(loss)
            given.append(float(loss.detach()))
            loss.backward()
        opt.step()
    (record,) = w.records
    assert record.loss == pytest.approx(sum(given), rel=1e-6)
