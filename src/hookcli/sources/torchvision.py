"""torchvision registry names (`resnet34`): the builder, torchvision's weights (hub cache or
download) or a local state dict, the weights' transforms and categories, and the task from the
package the builder lives in."""

from __future__ import annotations

import contextlib
import difflib
import inspect
import os
import sys
import urllib.error
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from torch import nn

from hookcli.errors import ModelError, UsageError, one_line
from hookcli.sources.base import Source, kwargs_text, quiet_warnings
from hookcli.sources.model import LoadedModel
from hookcli.sources.statedict import load_state_dict_file, weights_file
from hookcli.sources.tasks import Task, task_named


class TorchvisionSource(Source):
    """A name in torchvision's model registry."""

    name = "torchvision"

    def claims(self, spec: str) -> bool:
        return spec in registry_names()

    def load(
        self, spec: str, *, weights: str, seed: int, model_args: dict[str, Any]
    ) -> LoadedModel:
        return load_registry(spec, weights, seed, model_args)

    def names(self) -> list[str]:
        return registry_names()


def _tv_models() -> Any:
    import torchvision.models

    return torchvision.models


def task_of(name: str) -> str:
    """The task of a registry model, from the package its builder lives in."""
    module = _tv_models().get_model_builder(name).__module__
    for part, task in (
        (".detection.", "detection"),
        (".segmentation.", "segmentation"),
        (".video.", "video"),
        (".optical_flow.", "optical_flow"),
        (".quantization.", "quantized"),
    ):
        if part in module + ".":
            return task
    return "classification"


def registry_names() -> list[str]:
    return list(_tv_models().list_models())


def weights_enum(name: str) -> Any | None:
    try:
        return _tv_models().get_model_weights(name)
    except (ValueError, KeyError):
        return None


def cache_path(weights: Any) -> Path:
    """Where torch.hub keeps (or would keep) the file of a torchvision weights entry."""
    name = os.path.basename(urlparse(str(weights.url)).path)
    return Path(torch.hub.get_dir()) / "checkpoints" / name


def _builder_accepts(name: str, param: str) -> bool:
    builder = _tv_models().get_model_builder(name)
    return param in inspect.signature(builder).parameters


def kind_of(name: str) -> Task:
    return task_named(task_of(name))


def load_registry(name: str, weights: str, seed: int, kwargs: dict[str, Any]) -> LoadedModel:
    kwargs = dict(kwargs)
    kind = kind_of(name)
    kind.builder_kwargs(kwargs)
    enum = weights_enum(name)
    choice = _resolve_weights(name, weights, enum)
    tv = _tv_models()
    torch.manual_seed(seed)
    try:
        with quiet_warnings():
            if choice is None or isinstance(choice, Path):
                if _builder_accepts(name, "weights_backbone"):
                    kwargs.setdefault("weights_backbone", None)  # never fetch a backbone
                model = tv.get_model(name, weights=None, **kwargs)
            else:
                model = _build_pretrained(name, choice, kwargs)
    except (TypeError, ValueError) as exc:
        raise UsageError(
            f"cannot build {name}({kwargs_text(kwargs)}): {one_line(exc)}",
            "check --model-arg names against the torchvision builder's parameters.",
        ) from exc
    except (MemoryError, RuntimeError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        memory = "allocate" in str(exc) or isinstance(exc, MemoryError)
        if kwargs and not memory:  # (a size torch refuses: the argument's, not the model's)
            raise UsageError(
                f"cannot build {name}({kwargs_text(kwargs)}): {one_line(exc)}",
                "check --model-arg values against the torchvision builder's parameters.",
            ) from exc
        raise ModelError(
            f"building {name}({kwargs_text(kwargs)}) failed: {one_line(exc)}",
            "a --model-arg size asks for more memory than there is; check the arguments."
            if "allocate" in str(exc) or isinstance(exc, MemoryError)
            else "check --model-arg values against the torchvision builder's parameters.",
        ) from exc
    if isinstance(choice, Path):
        load_state_dict_file(model, choice, name)
        label = str(choice)
    elif choice is None:
        label = f"none (random init, seed {seed})"
    else:
        label = f"{type(choice).__name__}.{choice.name}"
    model.eval()
    # Labels and preprocessing: the chosen weights', else the model's DEFAULT weights' (their
    # meta and transforms work offline); DEFAULT's transforms carry the model's own input size.
    meta_source = choice if choice is not None and not isinstance(choice, Path) else None
    if meta_source is None and enum is not None:
        meta_source = enum.DEFAULT
    categories = None
    preprocess = None
    preprocess_label = "ImageNet: resize 256, center crop 224, ImageNet mean/std"
    input_size: tuple[int, int] | None = (224, 224)
    if meta_source is not None:
        cats = meta_source.meta.get("categories")
        n_out = _num_classes(model)
        if cats and (n_out is None or n_out == len(cats)):
            categories = list(cats)
        preprocess = meta_source.transforms()
        preprocess_label = (
            f"{type(meta_source).__name__}.{meta_source.name}.transforms(): "
            + _describe(preprocess)
        )
        input_size = _input_size(preprocess, kind)
    fixed = getattr(model, "image_size", None)  # ViT: the size the model was built for
    if isinstance(fixed, int) and input_size != (fixed, fixed):
        # e.g. vit_h_14 built without weights takes 224, its DEFAULT (SWAG) weights 518
        preprocess = None
        input_size = (fixed, fixed)
        preprocess_label = ""
    return LoadedModel(
        module=model,
        name=name,
        spec=name,
        kind=kind,
        weights_label=label,
        pretrained=choice is not None,
        categories=categories,
        preprocess=preprocess,
        preprocess_label=preprocess_label,
        input_size=input_size,
    )


def _num_classes(model: nn.Module) -> int | None:
    for attr in ("fc", "classifier", "heads", "head"):
        sub = getattr(model, attr, None)
        if sub is None:
            continue
        linears = (
            [m for m in sub.modules() if isinstance(m, nn.Linear)]
            if isinstance(sub, nn.Module)
            else []
        )
        if linears:
            return linears[-1].out_features
    return None


_IMAGENET_MEAN_STD = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])


def _describe(transform: Any) -> str:
    """`resize 256 (bilinear), center crop 224, ImageNet mean/std` from a transforms preset."""
    parts = []
    resize = getattr(transform, "resize_size", None)
    interpolation = getattr(transform, "interpolation", None)
    how = f" ({interpolation.value})" if interpolation is not None else ""
    if resize:
        parts.append(f"resize {resize[0] if len(resize) == 1 else resize}{how}")
    crop = getattr(transform, "crop_size", None)
    if crop:
        parts.append(f"center crop {crop[0] if len(crop) == 1 else crop}")
    mean, std = getattr(transform, "mean", None), getattr(transform, "std", None)
    if mean is not None and std is not None:
        same = (list(mean), list(std)) == _IMAGENET_MEAN_STD
        parts.append("ImageNet mean/std" if same else f"mean {list(mean)}, std {list(std)}")
    if not parts:
        parts.append(
            "to float in [0, 1]"
            if type(transform).__name__ == "ObjectDetection"
            else " ".join(repr(transform).split())[:120]
        )
    return ", ".join(parts)


def _input_size(transform: Any, kind: Task) -> tuple[int, int] | None:
    crop = getattr(transform, "crop_size", None)
    if crop:
        return (crop[0], crop[0]) if len(crop) == 1 else (crop[0], crop[1])
    resize = getattr(transform, "resize_size", None)
    if resize:
        return (resize[0], resize[0])
    return kind.fallback_size


def _resolve_weights(name: str, value: str, enum: Any | None) -> Any:
    """None for random init, a Path for a local file, else a torchvision weights entry."""
    raw = value.strip()
    if raw.lower() in ("none", ""):
        return None
    path = weights_file(raw)
    if path is not None:
        return path
    if enum is None:
        raise UsageError(
            f"{name} has no torchvision weights named {raw!r}.",
            "use --weights none or a local state dict file.",
        )
    member = raw.split(".")[-1]
    if member.upper() == "DEFAULT":
        return enum.DEFAULT
    names = [w.name for w in enum]
    if member in names:
        return enum[member]
    close = difflib.get_close_matches(member, names, n=3, cutoff=0.3) or names
    raise UsageError(
        f"unknown weights {raw!r} for {name}; {enum.__name__} has {', '.join(names)}.",
        f"try --weights {close[0]} or --weights DEFAULT.",
    )


def _build_pretrained(name: str, weights: Any, kwargs: dict[str, Any]) -> nn.Module:
    target = cache_path(weights)
    tv = _tv_models()
    try:
        # torch.hub announces downloads on stdout; stdout carries data (JSON), so divert it.
        if _builder_accepts(name, "progress"):  # no raw progress bar on the terminal
            kwargs = {"progress": False, **kwargs}
        with contextlib.redirect_stdout(sys.stderr):
            return tv.get_model(name, weights=weights, **kwargs)  # type: ignore[no-any-return]
    except (urllib.error.URLError, OSError, ConnectionError, TimeoutError) as exc:
        if target.exists():
            raise UsageError(
                f"could not read cached weights {target}: {exc}",
                "delete the file so it is downloaded again, or use --weights FILE.",
            ) from exc
        reason = getattr(exc, "reason", exc)
        raise UsageError(
            f"weights {type(weights).__name__}.{weights.name} are not in the torch hub cache "
            f"(expected {target}) and could not be downloaded ({reason}).",
            f"copy the file to {target} (or set TORCH_HOME), or use --weights none.",
        ) from exc
    except RuntimeError as exc:
        raise UsageError(
            f"cached weights {target} do not fit {name}: {exc}",
            "delete the file so it is downloaded again.",
        ) from exc
