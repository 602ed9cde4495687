"""How hookcli.watch reaches a wrapped or compiled model: the module under DataParallel or
torch.compile's wrappers that holds the layers, the root call of a model compiled in place,
and the switch to eager code for the steps hooks must see (a watched step, a re-run)."""

from __future__ import annotations

from typing import Any

from torch import nn


def _wrapped(model: nn.Module) -> nn.Module | None:
    """The module a wrapper holds: a torch.compile'd module's `_orig_mod`, (Distributed)
    DataParallel's `.module` (its subclasses too: mmengine's, Lightning's) — all share their
    weights with it; None for any other module."""
    inner = getattr(model, "_orig_mod", None)
    if isinstance(inner, nn.Module):
        return inner
    if isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
        held = model.module
        return held if isinstance(held, nn.Module) else None
    return None


def inner_module(model: nn.Module) -> nn.Module:
    """The module that holds the layers, under any wrappers (see _wrapped)."""
    for _ in range(8):
        inner = _wrapped(model)
        if inner is None:
            break
        model = inner
    return model


class RootCall:
    """For a model compiled in place (`model.compile()`): the recorder's root work around its
    compiled call, where hooks on the model would run inside the compiled code (and split its
    graph). `eager`: call the module's own eager call instead (watched steps, re-runs)."""

    def __init__(self, model: nn.Module, pre: Any, post: Any) -> None:
        self.model, self.pre, self.post = model, pre, post
        self.compiled = model._compiled_call_impl
        self.eager = False
        model._compiled_call_impl = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.pre(self.model, args, kwargs)
        call: Any = self.model._call_impl if self.eager else self.compiled
        assert call is not None
        out = call(*args, **kwargs)
        self.post(self.model, args, out)
        return out

    def remove(self) -> None:
        if self.model._compiled_call_impl is self:
            self.model._compiled_call_impl = self.compiled

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None  # a copy of the model is not watched: it runs eagerly

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return type(None), ()


class EagerSwitch:
    """A torch.compile'd model's eager module, for the steps hooks must see: the hooks of a
    watched step and a re-run are Python code the compiled graph does not run, so those steps
    call the module the compiled one wraps (the same weights) — `torch.compile(model)`'s
    OptimizedModule through its `forward`, `model.compile()` by its compiled call. Switched
    back, the compiled code is called again as it was: no recompilation (no hook is left on a
    module it traced)."""

    def __init__(self, model: nn.Module) -> None:
        # every compiled module, the root's wrappers and compiled blocks inside alike
        # (regional compilation: a hook in a compiled block would be traced into it)
        self.compiled: list[nn.Module] = []
        self.in_place: list[nn.Module] = []
        for m in model.modules():
            if isinstance(getattr(m, "_orig_mod", None), nn.Module) and "forward" in vars(m):
                self.compiled.append(m)
            if getattr(m, "_compiled_call_impl", None) is not None:
                self.in_place.append(m)
        self._saved: list[tuple[nn.Module, str, Any]] = []

    def on(self) -> None:
        if self._saved:
            return
        for m in self.compiled:
            self._saved.append((m, "forward", m.__dict__.get("forward")))
            m.__dict__["forward"] = m._orig_mod.__call__  # type: ignore[operator]
        for m in self.in_place:
            impl = m._compiled_call_impl
            self._saved.append((m, "_compiled_call_impl", impl))
            if isinstance(impl, RootCall):
                impl.eager = True
            else:
                m._compiled_call_impl = None

    def off(self) -> None:
        for m, name, value in reversed(self._saved):
            if name == "forward":
                m.__dict__["forward"] = value
            elif isinstance(value, RootCall):
                value.eager = False
            else:
                m._compiled_call_impl = value
        self._saved.clear()
