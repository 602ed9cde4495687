"""Model sources: a MODEL spec → a LoadedModel (module, weights, preprocessing, labels, default
input size, and the Task that reads its batches and outputs).

`resolve(spec)` picks the source by prefix (`timm:NAME`) or by the shape of the spec; the
built-in ones register below through the same `register` a plug-in calls:

    torchvision   resnet34                  (TorchvisionSource)
    timm          timm:NAME                 (TimmSource, the hookcli[timm] extra)
    hf            hf:TYPE, hf:PATH, hf:ORG/NAME  (HFSource, the hookcli[hf] extra)
    file          path/to/file.py:Name      (FileSource)
    module        package.module:Name       (ModuleSource, also every other spec with a colon)

A new source subclasses Source (base.py), returns a LoadedModel whose `kind` is a Task
(tasks.py, or its own subclass), and calls `register(MySource())`; no command changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from hookcli.errors import UsageError
from hookcli.runtime import gcpause
from hookcli.sources.base import Source, no_progress_bars, parse_model_args, quiet_warnings
from hookcli.sources.custom import FileSource, ModuleSource, wrap_module
from hookcli.sources.device import resolve_device
from hookcli.sources.hf import HFSource
from hookcli.sources.model import LoadedModel
from hookcli.sources.registry import register, resolve, sources, unknown_model, unregister
from hookcli.sources.skeleton import empty
from hookcli.sources.tasks import CLIP_FRAMES, TASKS, Task
from hookcli.sources.timm import TimmSource
from hookcli.sources.torchvision import TorchvisionSource

register(TorchvisionSource())
register(TimmSource())
register(HFSource())
register(FileSource())
register(ModuleSource())

__all__ = [
    "CLIP_FRAMES",
    "TASKS",
    "LoadedModel",
    "Source",
    "Task",
    "load_model",
    "parse_model_args",
    "quiet_warnings",
    "register",
    "resolve",
    "resolve_device",
    "sources",
    "unknown_model",
    "unregister",
]


def load_model(
    spec: str | nn.Module | LoadedModel,
    *,
    weights: str = "none",
    seed: int = 0,
    model_args: Mapping[str, Any] | None = None,
    head: str | None = None,
    building: str = "",
    tokenizer: Any = None,
    text: bool = False,
) -> LoadedModel:
    """Build the model named by spec with the given weights, in eval mode, on the CPU.
    A model already loaded (LoadedModel) is returned as it is. `head` (hf: models only):
    which head to build; None: the one the checkpoint was saved with. `building` "meta":
    on the meta device, no weight read; "offload": an hf: checkpoint whose weights are read
    block by block as it runs (sources/skeleton.py). A language model comes back with its
    tokenizer (`tokenizer`: --tokenizer, else the checkpoint's; `text`: text will be given, so
    a model that takes none, or a missing tokenizer, is an error) and its tokens as labels."""
    from hookcli.sources.lm import with_tokenizer

    return with_tokenizer(
        _built(
            spec, weights=weights, seed=seed, model_args=model_args, head=head, building=building
        ),
        tokenizer,
        needed=text,
    )


def _built(
    spec: str | nn.Module | LoadedModel,
    *,
    weights: str,
    seed: int,
    model_args: Mapping[str, Any] | None,
    head: str | None,
    building: str,
) -> LoadedModel:
    """The model as its source builds it (see load_model)."""
    if head is not None and not (isinstance(spec, str) and spec.strip().startswith("hf:")):
        raise UsageError(
            f"--head {head} applies to hf: models only.",
            "drop --head, or load the model as hf:PATH, hf:ORG/NAME or hf:TYPE.",
        )
    if building and not isinstance(spec, str):
        raise UsageError(
            f"--{building} builds the model itself; a model passed in is already built.",
            "pass its name (hf:FOLDER, a registry name or file.py:Name) instead.",
        )
    if isinstance(spec, LoadedModel):
        return spec
    if isinstance(spec, nn.Module):  # the Python API may pass a module directly
        return wrap_module(spec, weights)
    spec = spec.strip()
    if building == "meta" and weights.strip().lower() not in ("", "none"):
        raise UsageError(
            "--meta builds the model without weights, so --weights would never be read.",
            "drop --weights (shapes, parameter counts and FLOPs do not depend on them).",
        )
    if not spec:
        raise UsageError(
            "no model given.", "name a torchvision model, e.g. `hookcli inspect resnet18`."
        )
    source = resolve(spec)
    if building == "offload" and "offload" not in source.builds:  # as the source declares
        raise UsageError(
            f"--offload reads a Hugging Face checkpoint's safetensors block by block; {spec} "
            "is not one.",
            "give hf:FOLDER (written by save_pretrained) or hf:ORG/NAME from the cache.",
        )
    if building == "tp" and "tp" not in source.builds:
        raise UsageError(
            f"--tp loads a Hugging Face checkpoint with its tensor-parallel plan; {spec} is "
            "not one.",
            "give hf:FOLDER or hf:ORG/NAME; a model of your own: shard it with "
            "parallelize_module and call hookcli from Python under torchrun.",
        )
    extra: dict[str, Any] = {"head": head} if head is not None else {}
    if building in source.builds:  # told only what it declares it handles itself
        extra["building"] = building
    try:
        with no_progress_bars(), empty(building):
            loaded = source.load(
                spec, weights=weights, seed=seed, model_args=dict(model_args or {}), **extra
            )
        if building == "meta" and any(
            not t.is_meta for t in (*loaded.module.parameters(), *loaded.module.buffers())
        ):
            loaded.module.to("meta")  # tensors a source made outside the meta device
        return loaded
    finally:
        gcpause.resume()  # the CLI: start-up is over (runtime/gcpause.py)
