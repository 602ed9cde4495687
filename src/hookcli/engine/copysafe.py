"""What hookcli's hooks put into a user's model for one pass, made so that copying or pickling
the model meanwhile carries nothing of the session along (engine/hooks.py uses them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


class ScriptedCall(nn.Module):
    """Stands in for a scripted module (torch.jit.script refuses Python hooks) in its eager
    parents for one pass: the parent calls it as it called the scripted module, the hooks on
    it see that call's inputs and outputs, and it calls the scripted module (docs/traps.md §15).
    The scripted module is held as a plain attribute, not a child: the model's own module
    tree is put back exactly as it was when the pass ends."""

    def __init__(self, scripted: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "scripted", scripted)
        self.training = scripted.training

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.scripted(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # the parent may read the module's attributes
        try:
            return super().__getattr__(name)
        except AttributeError:
            scripted = self.__dict__.get("scripted")  # absent while copied or unpickled
            if scripted is None:
                raise
            return getattr(scripted, name)


class CopySafeHook:
    """A module hook that a copy of the module does not carry along: `copy.deepcopy(model)`
    (an EMA's copy, made while hooks are on) and pickling (`torch.save(model)`) give an
    InertHook, not a second reference to the session, its collector and its tensors (a
    plain closure would be shared by the copy, or refuse to pickle)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __deepcopy__(self, memo: dict[int, Any]) -> InertHook:
        return InertHook()

    def __reduce__(self) -> tuple[type[InertHook], tuple[()]]:
        return InertHook, ()


class InertHook:
    """What a copied module holds where the original has a CopySafeHook: nothing happens."""

    def __call__(self, *args: Any) -> None:
        return None
