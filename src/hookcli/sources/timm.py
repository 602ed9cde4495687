"""`timm:NAME` (optionally `timm:NAME.TAG`): a model from timm's registry, built offline with
`pretrained=False` unless weights are given; preprocessing from the model's own data config
(`resolve_model_data_config` + `create_transform`), ImageNet labels from timm's own tables.

Weights: `none` (random init under the seed), a pretrained tag or `DEFAULT` (the file found in
the local Hugging Face hub cache, never downloaded), or a local state dict file.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookcli.errors import ModelError, UsageError, one_line
from hookcli.sources.base import (
    Source,
    hf_cache_path,
    hf_cached,
    import_extra,
    kwargs_text,
    quiet_warnings,
)
from hookcli.sources.model import LoadedModel
from hookcli.sources.statedict import load_state_dict_file, weights_file
from hookcli.sources.tasks import task_named

HUB_FILES = ("model.safetensors", "pytorch_model.bin")


def _timm() -> Any:
    return import_extra("timm", "timm", "timm:NAME models")


class TimmSource(Source):
    """`timm:NAME` — timm's model registry."""

    name = "timm"
    prefix = "timm"

    def load(
        self, spec: str, *, weights: str, seed: int, model_args: dict[str, Any]
    ) -> LoadedModel:
        return load_timm(spec, spec.removeprefix("timm:").strip(), weights, seed, model_args)


def list_timm(pattern: str | None) -> list[str]:
    """timm's architectures matching a glob (all when None)."""
    return list(_timm().list_models(pattern or "*"))


def pretrained_tags() -> dict[str, tuple[list[str], str | None]]:
    """Architecture → (its pretrained tags, default first; the default's input size HxW)."""
    timm = _timm()
    out: dict[str, tuple[list[str], str | None]] = {}
    for full in timm.list_pretrained():
        arch, _, tag = full.partition(".")
        out.setdefault(arch, ([], None))[0].append(tag)
    for arch, (tags, _) in list(out.items()):
        cfg = timm.models.get_pretrained_cfg(arch)
        size = getattr(cfg, "input_size", None)
        out[arch] = (tags, f"{size[1]}x{size[2]}" if size else None)
    return out


def _check_name(timm: Any, name: str) -> str:
    """The architecture of NAME[.TAG], checked against timm's registry."""
    if not name:
        raise UsageError("timm: needs a model name.", "for example timm:resnet18 or timm:vit_*")
    arch, _tag = timm.models.split_model_name_tag(name)
    if not timm.is_model(arch):
        close = difflib.get_close_matches(arch, timm.list_models(), n=4, cutoff=0.6)
        near = f" Did you mean {', '.join(close)}?" if close else ""
        raise UsageError(
            f"timm has no model {arch!r}.{near}", "list them with `hookcli models --source timm`."
        )
    return str(arch)


def _pretrained_file(timm: Any, name: str, value: str) -> tuple[str, Path]:
    """(name.tag, file) for `--weights DEFAULT` or `--weights TAG`: the checkpoint in the local
    hub cache; refused with the expected path when it is not there."""
    arch, tag = timm.models.split_model_name_tag(name)
    if value.upper() != "DEFAULT":
        tag = value
    full = f"{arch}.{tag}" if tag else arch
    try:
        cfg = timm.models.get_pretrained_cfg(full, allow_unregistered=False)
    except RuntimeError:  # "Invalid pretrained tag"
        cfg = None
    if cfg is None:
        tags = [n.partition(".")[2] for n in timm.list_pretrained(f"{arch}.*")]
        have = f"; its tags: {', '.join(tags)}" if tags else "; timm has no weights for it"
        raise UsageError(
            f"unknown weights {value!r} for timm:{arch}{have}.",
            "use --weights DEFAULT, a tag, a local state dict file, or none.",
        )
    full = f"{arch}.{cfg.tag}" if cfg.tag else arch
    repo = cfg.hf_hub_id
    if not repo:
        raise UsageError(
            f"timm:{full}'s weights are not on the Hugging Face hub (url {cfg.url}), and "
            "hookcli reads weights offline only.",
            "download the file and give it with --weights FILE.",
        )
    found = hf_cached(repo, (cfg.hf_hub_filename,) if cfg.hf_hub_filename else HUB_FILES)
    if found is None:
        raise UsageError(
            f"weights for timm:{full} are not in the local Hugging Face cache (expected "
            f"{hf_cache_path(repo)}/<revision>/{HUB_FILES[0]}); hookcli does not download.",
            "fetch them once with `huggingface-cli download " + repo + "` (or set HF_HOME), "
            "or use --weights FILE / none.",
        )
    if found.suffix != ".safetensors":
        _only_weights(found, f"timm:{full}")
    return full, found


def _only_weights(path: Path, spec: str) -> None:
    """A cached pickled checkpoint (pytorch_model.bin) read once with weights_only=True before
    timm loads it (timm's own loader unpickles fully): a pickle that names anything beyond
    tensors and plain values is refused, never run (issue 32)."""
    import pickle

    import torch

    try:
        torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UsageError(
            f"{spec}'s cached weights {path} hold Python objects beyond tensors; hookcli does "
            "not unpickle them (a pickle can run code).",
            "use the model.safetensors of the same weights, or --weights none.",
        ) from exc
    except Exception as exc:
        raise UsageError(
            f"{spec}'s cached weights {path} cannot be read: {one_line(exc)}.",
            "fetch them again (huggingface-cli download), or use --weights none.",
        ) from exc


def load_timm(spec: str, name: str, weights: str, seed: int, kwargs: dict[str, Any]) -> LoadedModel:
    timm = _timm()
    _check_name(timm, name)
    raw = weights.strip()
    file: Path | None = None
    hub: Path | None = None
    if raw.lower() in ("", "none"):
        label = f"none (random init, seed {seed})"
    elif (file := weights_file(raw)) is not None:
        label = str(file)
    else:
        name, hub = _pretrained_file(timm, name, raw)
        label = f"timm {name} ({hub})"
    torch.manual_seed(seed)
    try:
        with quiet_warnings():
            if hub is not None:
                model = timm.create_model(
                    name, pretrained=True, pretrained_cfg_overlay={"file": str(hub)}, **kwargs
                )
            else:
                model = timm.create_model(name, pretrained=False, **kwargs)
    except TypeError as exc:
        raise UsageError(
            f"cannot build timm:{name}({kwargs_text(kwargs)}): {one_line(exc)}",
            "check --model-arg names against timm.create_model's arguments for this model.",
        ) from exc
    except ValueError as exc:
        if not kwargs:
            raise ModelError(
                f"building timm:{name} failed: {one_line(exc)}",
                "this timm model cannot be built offline as it is.",
            ) from exc
        raise UsageError(  # a --model-arg value the model refuses (img_size=-1): the input's
            f"cannot build timm:{name}({kwargs_text(kwargs)}): {one_line(exc)}",
            "check the --model-arg values.",
        ) from exc
    except Exception as exc:
        raise ModelError(
            f"building timm:{name}({kwargs_text(kwargs)}) failed: {one_line(exc)}",
            "check the --model-arg values and the weights file."
            if hub is not None or kwargs
            else "this timm model cannot be built offline as it is.",
        ) from exc
    if file is not None:
        load_state_dict_file(model, file, spec)
    model.eval()
    preprocess, preprocess_label, size = data_config(timm, model)
    return LoadedModel(
        module=model,
        name=name,
        spec=spec,
        kind=task_named("classification"),
        weights_label=label,
        pretrained=file is not None or hub is not None,
        categories=_categories(timm, model),
        preprocess=preprocess,
        preprocess_label=preprocess_label,
        input_size=size,
    )


def data_config(timm: Any, model: nn.Module) -> tuple[Any, str, tuple[int, int]]:
    """The model's own eval transform, how it is described, and its (H, W)."""
    cfg = timm.data.resolve_model_data_config(model)
    built = _built_size(model)
    said = tuple(cfg["input_size"][1:])
    if built is not None and built != said:  # (img_size=… given: its pretrained_cfg still says)
        cfg = timm.data.resolve_model_data_config(
            model, args={"input_size": (cfg["input_size"][0], *built)}
        )
    transform = timm.data.create_transform(**cfg, is_training=False)
    _, h, w = cfg["input_size"]
    resize = next((t for t in transform.transforms if type(t).__name__ == "Resize"), None)
    parts = ["timm data config:"]
    if built is not None and built != said:
        parts.append(
            f"input size {built[0]}x{built[1]} (the model's patch_embed.img_size; its config "
            f"says {'x'.join(map(str, said))}),"
        )
    if resize is not None:
        size = resize.size
        shown = size if isinstance(size, int) else "x".join(map(str, size))
        parts.append(f"resize {shown} ({cfg['interpolation']}),")
    parts.append(f"{cfg.get('crop_mode', 'center')} crop {h}x{w} (crop_pct {cfg['crop_pct']:g}),")
    mean = ", ".join(f"{v:g}" for v in cfg["mean"])
    std = ", ".join(f"{v:g}" for v in cfg["std"])
    parts.append(f"mean ({mean}), std ({std})")
    return transform, " ".join(parts), (int(h), int(w))


def _built_size(model: nn.Module) -> tuple[int, int] | None:
    """The (H, W) a patch-embedding model was built for (`img_size=`), where it has one fixed
    size; None for any other model (its data config's size is its own)."""
    size = getattr(getattr(model, "patch_embed", None), "img_size", None)
    if getattr(getattr(model, "patch_embed", None), "dynamic_img_size", False):
        return None
    if isinstance(size, tuple | list) and len(size) == 2 and all(type(v) is int for v in size):
        return (size[0], size[1])
    return None


def _categories(timm: Any, model: nn.Module) -> list[str] | None:
    """ImageNet class names when the model's classifier has the subset's number of classes."""
    subset = timm.data.infer_imagenet_subset(model)
    if subset is None:
        return None
    info = timm.data.ImageNetInfo(subset)
    names = [d.split(",")[0] for d in info.label_descriptions()]  # "tabby, tabby cat" → tabby
    return names if len(names) == getattr(model, "num_classes", None) else None
