"""diff's copy of the Python API's own module for a side that changes it (sides.side_copy):
the module `copy.deepcopy` and the side's `.to(dtype)` give, made without deepcopy's walk
through every empty hook table and without a copy in the original dtype."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hookcli.commands.diff.sides import side_copy


class _Odd(nn.Module):
    """Tied weights, BatchNorm's integer buffer, a buffer with an attribute of its own, one
    that requires grad, a user's hook, a cache dict, and an empty dict the module shares."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.b.weight = self.a.weight  # tied
        self.norm = nn.BatchNorm1d(6)
        marked = torch.randn(6)
        marked.note = "mine"  # type: ignore[attr-defined]
        self.register_buffer("marked", marked)
        self.register_buffer("learned", torch.randn(6).requires_grad_())
        # held elsewhere too: `.to` converts the module's buffer and leaves these as they were
        self.register_buffer("plain", torch.randn(6))
        self.alias = self.plain
        self.kept = [self.plain, self.a.bias]
        self.a.register_forward_hook(lambda m, i, o: None)
        self.cache = {"k": torch.ones(2)}
        self.shared: dict[str, int] = {}
        self.b.shared = self.shared  # the same empty dict in two modules

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.b(self.a(x)) + self.marked + self.learned + self.alias.to(x.dtype))


def _tensors(m: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(m.named_parameters(remove_duplicate=False)), **dict(m.named_buffers())}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, None])
def test_a_side_copy_is_what_deepcopy_and_the_sides_to_give(dtype: torch.dtype | None) -> None:
    torch.manual_seed(0)
    model = _Odd()
    before = {k: v.detach().clone() for k, v in _tensors(model).items()}
    want = copy.deepcopy(model)
    got = side_copy(model, dtype)
    if dtype is not None:
        want.to(dtype)
        got.to(dtype)  # (what the side's prepare does next)
    w, g = _tensors(want), _tensors(got)
    assert list(w) == list(g)
    for name in w:
        assert g[name].dtype == w[name].dtype, name
        assert torch.equal(g[name], w[name]), name
        assert g[name].requires_grad == w[name].requires_grad, name
        assert type(g[name]) is type(w[name]), name
    assert got.b.weight is got.a.weight  # still tied
    assert got.alias.dtype == want.alias.dtype and got.kept[0].dtype == want.kept[0].dtype
    assert got.kept[1] is got.a.bias  # a parameter held elsewhere follows it
    assert got.b.shared is got.shared and got.shared is not model.shared
    assert getattr(got.marked, "note", None) == getattr(want.marked, "note", None)
    assert len(got.a._forward_hooks) == 1 and got.a._forward_hooks is not model.a._forward_hooks
    assert torch.equal(got.cache["k"], model.cache["k"]) and got.cache is not model.cache
    # nothing of the original is shared or changed
    originals = {t.data_ptr() for t in _tensors(model).values()}
    assert not originals & {t.data_ptr() for t in g.values()}
    for name, t in _tensors(model).items():
        assert t.dtype == before[name].dtype and torch.equal(t, before[name]), name
    handle = got.b.register_forward_pre_hook(lambda m, i: None)
    assert not model.b._forward_pre_hooks
    handle.remove()
    x = torch.randn(4, 6)
    if dtype is not None:
        x = x.to(dtype)
    assert torch.equal(got.eval()(x), want.eval()(x))


def test_a_side_in_the_models_own_dtype_still_gets_its_own_tensors() -> None:
    """A bfloat16 model diffed against a bfloat16 side: `.to` would hand back the same tensor,
    so the copy is made all the same (the sides never share a weight)."""
    model = nn.Linear(4, 4).to(torch.bfloat16)
    got = side_copy(model, torch.bfloat16)
    assert got.weight.data_ptr() != model.weight.data_ptr()
    assert torch.equal(got.weight, model.weight) and got.weight.dtype == torch.bfloat16
