"""Models built without their weights in memory: `--meta` (every parameter and buffer on the meta
device: shapes, counts and FLOPs with nothing allocated or read) and `--offload` (parameters on
the meta device, buffers real, each block's weights read from the checkpoint when it runs:
sources/offload.py). A source declares which it can do (`Source.builds`) and is told which by
its load()'s `building` argument; `empty` makes what is built inside hold no weights."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

META = "meta"
OFFLOAD = "offload"
TP = "tp"  # not empty: a checkpoint loaded spread over the processes (sources/hf.py)


@contextmanager
def empty(mode: str) -> Iterator[None]:
    """Models built inside hold no weights: with "meta" every tensor they make is on the meta
    device; with "offload" their parameters are (each made on the CPU uninitialised, then
    replaced, before any initialiser writes it), their buffers are real."""
    if mode == META:
        with torch.device("meta"):
            yield
    elif mode == OFFLOAD:
        with _parameters_on_meta():
            yield
    else:
        yield


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            cls = type(param)
            kw = vars(param)  # a Parameter subclass's own attributes come along
            meta = cls(param.to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(kw)
            module._parameters[name] = meta

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
