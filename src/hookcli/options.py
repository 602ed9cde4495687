"""What a run is asked to do, as small frozen objects (no torch: the CLI builds them).

Every command — inspect, grads, check, layers, maps, cam and folder runs — describes its run
with these, and the engine (engine.py) turns them into a prepared model and hooked passes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class ModelOptions:
    """Which model, with which weights, on which device."""

    model: Any  # a registry name, file.py:Name, pkg.mod:Name, an nn.Module or a LoadedModel
    weights: str = "none"
    seed: int = 0
    device: str = "auto"
    model_args: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Selection:
    """Which modules to hook: patterns, types, depth; `also` is hooked whatever the rest says
    (--expect-shape's layers); `every` hooks every module (layers --shapes, CAM's search)."""

    layers: tuple[str, ...] = ()
    types: tuple[str, ...] = ()
    depth: int | None = None
    also: tuple[str, ...] = ()
    every: bool = False


@dataclass(frozen=True, slots=True)
class InputOptions:
    """Image files/folders (or, from Python, tensors), or tensor specs, or nothing (a random
    input of the right shape). `strict`: an unreadable image found in a folder is an error
    instead of being skipped."""

    items: tuple[Any, ...] = ()
    specs: tuple[str, ...] = ()
    strict: bool = False


@dataclass(frozen=True, slots=True)
class BackwardOptions:
    """What backward starts from (a target or a loss), and whether the input's gradient is
    reported too."""

    target: str | None = None
    loss: str | None = None
    input_grad: bool = False


@dataclass(frozen=True, slots=True)
class RunOptions:
    """Everything else one inspection does."""

    train: bool = False
    topk: int | None = None
    hist: int = 0  # histogram bins, 0: none
    profile: bool = False
    save: Any = None  # an output.Destination (the Python API: a path, claimed on use)
    ablate: tuple[str, ...] = ()
    deterministic: bool = False
    stats_backend: str = "auto"  # "torch" skips the fused CPU kernel; results agree
    config: str | None = None  # the project config file used, stated in the report


@dataclass(frozen=True, slots=True)
class FolderOptions:
    """A folder run: images in batches, statistics aggregated across them."""

    batch_size: int = 32
    limit: int | None = None
    workers: int = 0  # DataLoader processes decoding images
    per_image: int = 0  # each image's top-K predictions, 0: none


# The Python API's keyword arguments and where each one goes.
_API_KEYS: dict[str, tuple[str, str]] = {
    "weights": ("model", "weights"),
    "seed": ("model", "seed"),
    "device": ("model", "device"),
    "model_args": ("model", "model_args"),
    "layers": ("selection", "layers"),
    "types": ("selection", "types"),
    "depth": ("selection", "depth"),
    "also_layers": ("selection", "also"),
    "input_specs": ("inputs", "specs"),
    "strict": ("inputs", "strict"),
    "target": ("backward", "target"),
    "loss": ("backward", "loss"),
    "input_grad": ("backward", "input_grad"),
    "train": ("run", "train"),
    "topk": ("run", "topk"),
    "hist": ("run", "hist"),
    "profile": ("run", "profile"),
    "save": ("run", "save"),
    "ablate": ("run", "ablate"),
    "deterministic": ("run", "deterministic"),
    "stats_backend": ("run", "stats_backend"),
    "config": ("run", "config"),
}


@dataclass(frozen=True, slots=True)
class Invocation:
    """One inspection, whole: what `hookcli.inspect(...)` and the CLI commands ask for."""

    model: ModelOptions
    selection: Selection = Selection()
    inputs: InputOptions = InputOptions()
    run: RunOptions = RunOptions()
    backward: BackwardOptions | None = None

    @classmethod
    def from_api(
        cls, model: Any, inputs: Any, options: Mapping[str, Any], *, backward: bool
    ) -> Invocation:
        """The Python API's keyword arguments (hookcli.inspect/grads) → an Invocation."""
        parts: dict[str, dict[str, Any]] = {
            "model": {},
            "selection": {},
            "inputs": {},
            "run": {},
            "backward": {},
        }
        for key, value in options.items():
            if key not in _API_KEYS:
                allowed = ", ".join(sorted(_API_KEYS))
                raise TypeError(f"unexpected option {key!r}; options are: {allowed}")
            part, name = _API_KEYS[key]
            parts[part][name] = tuple(value) if isinstance(value, list) else value
        if not backward and parts["backward"]:
            raise TypeError(f"{', '.join(parts['backward'])}: options of grads, not inspect")
        if parts["run"].get("save") is not None:
            from hookcli.output import claim

            parts["run"]["save"] = claim(
                parts["run"]["save"], "save", suffix=".safetensors", stdout_ok=False
            )
        items = _input_items(inputs)
        return cls(
            model=ModelOptions(model, **parts["model"]),
            selection=Selection(**parts["selection"]),
            inputs=InputOptions(items, **parts["inputs"]),
            run=RunOptions(**parts["run"]),
            backward=BackwardOptions(**parts["backward"]) if backward else None,
        )


def _input_items(inputs: Any) -> tuple[Any, ...]:
    """Paths (str or Path), a tensor, or a sequence of tensors → a tuple of items."""
    if isinstance(inputs, str | Path):
        return (str(inputs),)
    if hasattr(inputs, "shape") and hasattr(inputs, "dtype"):  # one tensor
        return (inputs,)
    if isinstance(inputs, Sequence):
        return tuple(str(x) if isinstance(x, Path) else x for x in inputs)
    return tuple(inputs)
