"""hookcli.integrations.lightning: hookcli.watch around a real Lightning `trainer.fit`.

Each test trains a tiny LightningModule for a few steps on CPU and compares the recorder's
lines with what Lightning itself computed (the losses training_step returned, its global step),
with the NaN injected by a flag at a known step, and with every hook gone after fit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("pytorch_lightning")  # the test extra installs it: a guard, not a skip

from hookcli.errors import UsageError
from hookcli.integrations.lightning import (
    LOG_NAME,
    HookcliWatch,
    lightning_package,
)
from hookcli.records import log_line

pl = lightning_package()  # the package HookcliWatch subclasses the Callback of

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated"),
    pytest.mark.filterwarnings("ignore:.*but have no `val_dataloader`"),
]

LAYERS = ["net.0", "net.1", "net.2", "net.3"]


class Poison(nn.Module):
    """The identity, or NaN times its input when switched on: a layer the origin can name."""

    on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float("nan") if self.on else x


class Tiny(pl.LightningModule):
    """Linear-ReLU-Poison-Linear regression; the loss of every training batch is kept with the
    global step it belongs to. `nan_at`: the step whose forward makes NaN. `call_self=False`:
    training_step calls `self.net` directly, as many LightningModules do."""

    def __init__(self, nan_at: int | None = None, call_self: bool = True) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Poison(), nn.Linear(16, 1))
        self.nan_at = nan_at
        self.call_self = call_self
        self.losses: list[tuple[int, float]] = []
        self.val_batches = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.net[2].on = self.trainer.global_step == self.nan_at
        out = self(x) if self.call_self else self.net(x)
        loss = F.mse_loss(out, y)
        self.losses.append((self.trainer.global_step, float(loss.detach())))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.val_batches += 1
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1)), 8)


def _trainer(root: Path, callback: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("max_steps", 6)
    return pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[callback],
        **kwargs,
    )


def _step_losses(model: Tiny) -> dict[int, list[float]]:
    by_step: dict[int, list[float]] = {}
    for step, loss in model.losses:
        by_step.setdefault(step, []).append(loss)
    return by_step


def _assert_unhooked(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    for name, m in model.named_modules():
        hooks = (
            m._forward_hooks,
            m._forward_pre_hooks,
            m._backward_hooks,
            m._backward_pre_hooks,
        )
        assert not any(hooks), f"a hook left on {name or 'the model'}"
    assert not optimizer._optimizer_step_pre_hooks
    assert not optimizer._optimizer_step_post_hooks


def test_fit_logs_the_watched_steps_with_lightnings_losses(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, callback = Tiny(), HookcliWatch(every=2)
    # validation inside fit (the sanity check, then after every second batch) is no step's
    trainer = _trainer(tmp_path, callback, val_check_interval=2, limit_val_batches=2)
    trainer.fit(model, _data(), _data())
    w = callback.watch
    assert model.val_batches == 2 + 3 * 2, "the sanity check and three validation runs ran"

    assert [r.step for r in w.records] == [0, 2, 4]
    losses = _step_losses(model)
    assert sorted(losses) == list(range(6))
    for record in w.records:
        assert record.loss == pytest.approx(losses[record.step][0], rel=1e-6)
        # one call per layer: the validation forwards are not in the step
        assert [(c.name, c.call) for c in record.layers] == [(n, 0) for n in LAYERS]
        for call in record.layers:
            assert call.outputs[0].mean is not None
            assert call.grad_outputs[0].norm > 0
        names = [p.name for p in record.params]
        assert names == [n for n, _ in model.named_parameters()]
        assert all(p.grad.norm > 0 and p.update_ratio > 0 for p in record.params)
    assert w.nonfinite == []
    assert w.step_index == trainer.global_step == 6

    # the default log: the Trainer's log_dir (default_root_dir without a logger)
    assert callback.log_path == tmp_path / LOG_NAME
    lines = callback.log_path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == [log_line(r) for r in w.records]
    _assert_unhooked(model, trainer.optimizers[0])


@pytest.mark.parametrize(
    ("call_self", "module", "layer"), [(True, None, "net.2"), (False, "net", "2")]
)
def test_a_nan_at_step_3_names_the_layer(
    tmp_path: Path, call_self: bool, module: str | None, layer: str
) -> None:
    torch.manual_seed(0)
    model = Tiny(nan_at=3, call_self=call_self)
    callback = HookcliWatch(every=2, module=module)
    trainer = _trainer(tmp_path, callback)
    trainer.fit(model, _data())
    w = callback.watch
    assert len(w.nonfinite) == 1
    assert w.nonfinite[0].step == 3
    first = w.nonfinite[0].origins[0]
    assert (first.layer, first.type, first.direction) == (layer, "Poison", "forward")
    bundle = tmp_path / "hookcli-watch.bundle"
    assert w.nonfinite[0].bundle == str(bundle)
    assert (bundle / "bundle.json").is_file()
    assert [r.step for r in w.records] == [0, 2, 4]
    # the log in the recorder's order: the NaN's line inside its step, before step 4's
    lines = [json.loads(x) for x in callback.log_path.read_text(encoding="utf-8").splitlines()]
    assert [(x["kind"], x["step"]) for x in lines] == [
        ("step", 0),
        ("step", 2),
        ("nonfinite", 3),
        ("step", 4),
    ]
    _assert_unhooked(model, trainer.optimizers[0])


def test_accumulated_batches_make_one_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, callback = Tiny(), HookcliWatch(every=2, log=False)
    trainer = _trainer(tmp_path, callback, accumulate_grad_batches=2)
    trainer.fit(model, _data())
    w = callback.watch
    assert w.step_index == trainer.global_step == 6
    assert len(model.losses) == 12
    assert [r.step for r in w.records] == [0, 2, 4]
    losses = _step_losses(model)
    for record in w.records:
        # the loss backpropagated: each micro-batch's divided by accumulate_grad_batches
        micro = losses[record.step]
        assert len(micro) == 2
        assert record.loss == pytest.approx(sum(micro) / 2, rel=1e-6)
        calls = [(c.name, c.call) for c in record.layers]
        assert sorted(calls) == sorted((n, k) for n in LAYERS for k in (0, 1))
    assert not (tmp_path / LOG_NAME).exists(), "log=False writes no file"
    _assert_unhooked(model, trainer.optimizers[0])


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before")
def test_a_resumed_fit_numbers_steps_as_lightning(tmp_path: Path) -> None:
    """Steps are trainer.global_step: a fit resumed from step 3 logs steps 3, 4, 5 (every=2:
    the watched ones are 4 only), in a log of its own."""
    torch.manual_seed(0)
    model, first = Tiny(), HookcliWatch(every=2)
    trainer = _trainer(tmp_path, first, max_steps=3)
    trainer.fit(model, _data())
    trainer.save_checkpoint(tmp_path / "step3.ckpt")
    assert [r.step for r in first.watch.records] == [0, 2]

    again = HookcliWatch(every=2)
    trainer = _trainer(tmp_path, again, max_steps=6)
    trainer.fit(model, _data(), ckpt_path=tmp_path / "step3.ckpt")
    assert [r.step for r in again.watch.records] == [4]
    assert again.watch.step_index == trainer.global_step == 6
    lines = again.log_path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(x)["step"] for x in lines] == [4]


def test_a_grad_scaler_loss_is_unscaled_and_its_skipped_steps_are_steps(tmp_path: Path) -> None:
    """fp16 autocast with a scale of 2^40: the fp16 gradients overflow, so the scaler skips
    steps and halves the scale — expected, not a NaN fault. The loss logged is the true one."""
    torch.manual_seed(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    precision = pl.plugins.precision.MixedPrecision("16-mixed", "cpu", scaler=scaler)
    model, callback = Tiny(), HookcliWatch(log=False)
    trainer = _trainer(tmp_path, callback, plugins=[precision], max_steps=4)
    trainer.fit(model, _data())
    w = callback.watch
    assert w.nonfinite == []
    assert [r.step for r in w.records] == [0, 1, 2, 3]
    # each line has the scale its step ran at (halved after every skipped step)
    assert [(r.skipped, r.scale) for r in w.records] == [(True, 2.0 ** (40 - i)) for i in range(4)]
    losses = _step_losses(model)
    for record in w.records:
        assert record.loss == pytest.approx(losses[record.step][0], rel=1e-3)
    assert "update" not in scaler.__dict__, "the scaler is left as found"
    _assert_unhooked(model, trainer.optimizers[0])


class TwoOptimizers(Tiny):
    """Manual optimization with one optimizer per Linear layer, as a GAN has two."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        for opt in self.optimizers():
            opt.zero_grad()
            loss = F.mse_loss(self(x), y)
            self.manual_backward(loss)
            opt.step()
            self.losses.append((self.trainer.global_step, float(loss.detach())))

    def configure_optimizers(self) -> Any:
        return [
            torch.optim.SGD(self.net[0].parameters(), lr=0.05),
            torch.optim.SGD(self.net[3].parameters(), lr=0.05),
        ]


def test_several_optimizers_need_one_named(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="marks steps by one optimizer, and there are 2"):
        _trainer(tmp_path, HookcliWatch(log=False)).fit(TwoOptimizers(), _data())

    model, callback = TwoOptimizers(), HookcliWatch(log=False, optimizer=1)
    trainer = _trainer(tmp_path, callback, max_steps=4)  # global_step: both optimizers' steps
    trainer.fit(model, _data())
    w = callback.watch
    assert w.step_index == 2
    assert [r.step for r in w.records] == [0, 1]
    for record in w.records:
        assert [p.name for p in record.params] == ["net.3.weight", "net.3.bias"]
        # both forwards and backwards of the batch: the first optimizer's belong to the step
        assert [c.call for c in record.layers if c.name == "net.3"] == [0, 1]
    _assert_unhooked(model, trainer.optimizers[1])


def test_without_lightning_the_import_says_what_to_install() -> None:
    code = (
        "import sys\n"
        "sys.modules['lightning'] = sys.modules['pytorch_lightning'] = None\n"
        "import hookcli.integrations.lightning\n"  # the module itself imports no Lightning
        "from hookcli.integrations.lightning import HookcliWatch\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines()[-1] == (
        "ImportError: hookcli.integrations.lightning needs PyTorch Lightning, and neither "
        "lightning.pytorch nor pytorch_lightning can be imported: pip install pytorch-lightning"
    )
