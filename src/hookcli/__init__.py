"""hookcli: hook any torchvision or custom PyTorch model and see what every layer does.

The public Python API mirrors the command line and returns the same `Report` the CLI renders:

    >>> import hookcli
    >>> report = hookcli.inspect("resnet18", ["sample_images/cat.jpeg"], layers=["layer4.*"])
    >>> report.layers[0].outputs[0].mean

Importing this package never imports torch; it is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hookcli._version import __version__

if TYPE_CHECKING:
    from hookcli.records import DiffReport, Report

__all__ = ["__version__", "diff", "grads", "inspect"]


def _new_run() -> None:
    """Each call is a run of its own: files an earlier call read may be written by this one."""
    from hookcli import output

    output.begin()


def inspect(model: Any, inputs: Any = (), **options: Any) -> Report:
    """Run one hooked forward pass and return its Report (see `hookcli.run.inspect`)."""
    from hookcli.run import inspect as _inspect

    _new_run()

    return _inspect(model, inputs, **options)


def grads(model: Any, inputs: Any = (), **options: Any) -> Report:
    """Forward and backward with gradient hooks; return its Report (see `hookcli.run.grads`)."""
    from hookcli.run import grads as _grads

    _new_run()

    return _grads(model, inputs, **options)


def diff(
    model: Any,
    inputs: Any = (),
    *,
    b: str,
    a: str = "float32",
    ref: str | None = None,
    isolate: bool = False,
    tol: float = 1e-3,
    batch_size: int | None = None,
    **options: Any,
) -> DiffReport:
    """Two sides of one model (e.g. a="float32", b="bfloat16,channels_last") on the same input,
    compared layer call by layer call (see `hookcli.compare.diff_report`). Options as inspect's:
    layers, types, depth, input_specs, weights, seed, device, model_args."""
    from hookcli.compare import diff_report, parse_side
    from hookcli.options import Invocation

    _new_run()
    inv = Invocation.from_api(model, inputs, options, backward=False)
    return diff_report(
        inv.model,
        inv.selection,
        inv.inputs,
        parse_side(a, "a"),
        parse_side(b, "b"),
        ref=parse_side(ref, "ref") if ref is not None else None,
        isolate=isolate,
        tol=tol,
        batch_size=batch_size,
    )
