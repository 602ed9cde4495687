"""The hook session never raises into the user's forward (issue 14, item 7): whatever its own
callbacks or the arguments it walks do, the module runs on its own arguments and the failure is
a note on the call."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
from torch import nn

from hookcli.engine.hooks import HookSession, PendingCall, Target
from hookcli.engine.stats import StatsCollector
from tests.support.oracles import hooks_left


class Hostile(Mapping[str, torch.Tensor]):
    """A mapping argument whose walk fails (a user type hookcli cannot see into)."""

    def __getitem__(self, key: str) -> torch.Tensor:
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        raise RuntimeError("not iterable today")

    def __len__(self) -> int:
        return 1


class TakesAnything(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, extra: Any = None) -> torch.Tensor:
        return self.fc(x)  # type: ignore[no-any-return]


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = TakesAnything()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x, Hostile())  # type: ignore[no-any-return]


def _session(model: Outer, **kw: Any) -> HookSession:
    return HookSession([Target(model.inner, "inner", [], "TakesAnything")], **kw)


@pytest.mark.parametrize("collector", [None, "stats"], ids=["shapes only", "statistics"])
@pytest.mark.parametrize("profile", [False, True])
def test_an_argument_that_cannot_be_walked_is_a_note_not_a_failure(
    collector: str | None, profile: bool
) -> None:
    torch.manual_seed(0)
    model = Outer().eval()
    x = torch.randn(2, 4)
    with torch.no_grad():
        expected = model(x)
    session = _session(model, collector=StatsCollector() if collector else None, profile=profile)
    with torch.no_grad(), session:
        got = model(x)
    assert torch.equal(got, expected)
    (call,) = [p.call for p in session.calls]
    assert call.error is not None and "not iterable today" in call.error
    assert hooks_left(model) == 0


def test_an_input_callback_that_raises_leaves_the_arguments_alone() -> None:
    torch.manual_seed(0)
    model = Outer().eval()
    x = torch.randn(2, 4)
    with torch.no_grad():
        expected = model(x)

    def feed(pending: PendingCall, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise ValueError("no reference input for this call")

    session = _session(model, collector=None, on_input=feed)
    with torch.no_grad(), session:
        got = model(x)
    assert torch.equal(got, expected), "the module ran on its own arguments"
    (call,) = [p.call for p in session.calls]
    assert call.error == "could not replace the inputs: no reference input for this call"
