"""hookcli: hook any torchvision or custom PyTorch model and see what every layer does.

The public Python API mirrors the command line and returns the same `Report` the CLI renders:

    >>> import hookcli
    >>> report = hookcli.inspect("resnet18", ["sample_images/cat.jpeg"], layers=["layer4.*"])
    >>> report.layers[0].outputs[0].mean

Importing this package never imports torch; it is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from hookcli.records import Report

__all__ = ["__version__", "grads", "inspect"]


def inspect(model: Any, inputs: Any = (), **options: Any) -> Report:
    """Run one hooked forward pass and return its Report (see `hookcli.run.inspect`)."""
    from hookcli.run import inspect as _inspect

    return _inspect(model, inputs, **options)


def grads(model: Any, inputs: Any = (), **options: Any) -> Report:
    """Forward and backward with gradient hooks; return its Report (see `hookcli.run.grads`)."""
    from hookcli.run import grads as _grads

    return _grads(model, inputs, **options)
