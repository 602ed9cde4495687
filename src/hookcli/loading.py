"""MODEL specs and weights → a ready nn.Module, its preprocessing and its class labels.

MODEL is a torchvision registry name (`resnet34`), `path/to/file.py:Name` or
`package.module:Name` (Name an nn.Module subclass or a factory returning one).
`--weights none|DEFAULT|<ENUM>|PATH`: none is random initialisation under the seed;
DEFAULT/enum names are torchvision's weights, read from the torch hub cache or downloaded;
PATH is a local state dict, loaded with `weights_only=True`.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import importlib
import importlib.util
import inspect
import io
import os
import pickle
import sys
import urllib.error
import warnings
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from torch import nn

from hookcli.errors import ModelError, UsageError, one_line
from hookcli.output import note_read, user_path

TASKS = ("classification", "segmentation", "detection", "video", "optical_flow", "quantized")
CLIP_FRAMES = 16  # a still image repeated as a clip this long (MViT needs exactly 16)
_WEIGHT_SUFFIXES = (".pth", ".pt", ".safetensors", ".bin", ".ckpt")


@dataclass(slots=True)
class LoadedModel:
    module: nn.Module
    name: str
    spec: str
    task: str
    weights_label: str
    pretrained: bool
    categories: list[str] | None = None
    preprocess: Callable[[Any], torch.Tensor] | None = None
    preprocess_label: str = ""
    input_size: tuple[int, int] | None = None  # H, W the model wants for a random input


# ---------------------------------------------------------------- registry


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


def _unknown_model(spec: str) -> UsageError:
    close = difflib.get_close_matches(spec, registry_names(), n=4, cutoff=0.6)
    near = f" Did you mean {', '.join(close)}?" if close else ""
    return UsageError(
        f"unknown model {spec!r}.{near}",
        "run `hookcli models` for torchvision names, or give path/to/file.py:ClassName.",
    )


def parse_model_args(pairs: list[str]) -> dict[str, Any]:
    """`key=value` pairs; values are Python literals where they parse, else strings."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip().isidentifier():
            raise UsageError(
                f"malformed --model-arg {pair!r}: expected key=value.",
                "for example --model-arg num_classes=10",
            )
        try:
            value: Any = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        out[key.strip()] = value
    return out


@contextlib.contextmanager
def quiet_warnings() -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def load_model(
    spec: str | nn.Module | LoadedModel,
    *,
    weights: str = "none",
    seed: int = 0,
    model_args: Mapping[str, Any] | None = None,
) -> LoadedModel:
    """Build the model named by spec with the given weights, in eval mode, on the CPU.
    A model already loaded (LoadedModel) is returned as it is."""
    if isinstance(spec, LoadedModel):
        return spec
    if isinstance(spec, nn.Module):  # the Python API may pass a module directly
        return _wrap_module(spec, weights)
    spec = spec.strip()
    if not spec:
        raise UsageError(
            "no model given.", "name a torchvision model, e.g. `hookcli inspect resnet18`."
        )
    kwargs = dict(model_args or {})
    if spec in registry_names():
        return _load_registry(spec, weights, seed, kwargs)
    if ":" in spec:
        return _load_custom(spec, weights, seed, kwargs)
    raise _unknown_model(spec)


def _builder_accepts(name: str, param: str) -> bool:
    builder = _tv_models().get_model_builder(name)
    return param in inspect.signature(builder).parameters


def _load_registry(name: str, weights: str, seed: int, kwargs: dict[str, Any]) -> LoadedModel:
    task = task_of(name)
    if task == "quantized":
        # torchvision quantizes (fuse, calibrate on its own random input, convert) offline
        kwargs.setdefault("quantize", True)
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
            f"cannot build {name}({_kw(kwargs)}): {one_line(exc)}",
            "check --model-arg names against the torchvision builder's parameters.",
        ) from exc
    except (MemoryError, RuntimeError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        raise ModelError(
            f"building {name}({_kw(kwargs)}) failed: {one_line(exc)}",
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
        input_size = _input_size(preprocess, task)
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
        task=task,
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


def _input_size(transform: Any, task: str) -> tuple[int, int] | None:
    crop = getattr(transform, "crop_size", None)
    if crop:
        return (crop[0], crop[0]) if len(crop) == 1 else (crop[0], crop[1])
    resize = getattr(transform, "resize_size", None)
    if resize:
        return (resize[0], resize[0])
    return (320, 320) if task == "detection" else (224, 224)


def _resolve_weights(name: str, value: str, enum: Any | None) -> Any:
    """None for random init, a Path for a local file, else a torchvision weights entry."""
    raw = value.strip()
    if raw.lower() in ("none", ""):
        return None
    path = user_path(raw, "--weights")
    if path.suffix.lower() in _WEIGHT_SUFFIXES or os.sep in raw or path.exists():
        if not path.is_file():
            raise UsageError(
                f"weights file {raw} not found.",
                "give an existing .pth/.pt/.safetensors file, or --weights DEFAULT / none.",
            )
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


# ---------------------------------------------------------------- state dict files


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A state dict from .pth/.pt (weights_only) or .safetensors, unwrapped and de-prefixed."""
    note_read(path)
    if path.suffix.lower() == ".safetensors":
        try:
            from safetensors.torch import load_file

            data: Any = load_file(str(path), device="cpu")
        except Exception as exc:
            raise UsageError(
                f"{path} is not a readable safetensors file: {one_line(exc)}",
                "check the file, or re-save it.",
            ) from exc
    else:
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            if not zipfile.is_zipfile(path):  # not torch.save's format: just not a checkpoint
                raise UsageError(
                    f"{path} is not a readable PyTorch file: {one_line(exc)}",
                    "check the file; hookcli reads state dicts saved by torch.save.",
                ) from exc
            raise UsageError(
                f"{path} needs full unpickling (it stores Python objects, not only tensors) "
                "and hookcli loads weights with weights_only=True for safety.",
                "re-save it as a state dict: torch.save(model.state_dict(), 'weights.pth').",
            ) from exc
        except Exception as exc:
            raise UsageError(
                f"{path} is not a readable PyTorch file: {one_line(exc)}",
                "check the file; hookcli reads state dicts saved by torch.save.",
            ) from exc
    if isinstance(data, Mapping):
        for key in ("state_dict", "model_state_dict", "model", "module"):
            inner = data.get(key)
            if (
                isinstance(inner, Mapping)
                and inner
                and all(isinstance(v, torch.Tensor) for v in inner.values())
            ):
                data = inner
                break
    if not isinstance(data, Mapping) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise UsageError(
            f"{path} holds a {type(data).__name__}, not a state dict of tensors.",
            "save weights with torch.save(model.state_dict(), 'weights.pth').",
        )
    sd = {str(k): v for k, v in data.items()}
    for prefix in ("module.", "_orig_mod."):  # DataParallel / torch.compile wrappers
        if sd and all(k.startswith(prefix) for k in sd):
            sd = {k[len(prefix) :]: v for k, v in sd.items()}
    return sd


def _few(items: list[str], n: int = 3) -> str:
    shown = ", ".join(items[:n])
    return shown + (f" (+{len(items) - n} more)" if len(items) > n else "")


def load_state_dict_file(model: nn.Module, path: Path, label: str) -> None:
    sd = read_state_dict(path)
    expected = model.state_dict()
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    mismatched = [
        f"{k} (file {'x'.join(map(str, sd[k].shape))}, model {'x'.join(map(str, v.shape))})"
        for k, v in expected.items()
        if k in sd and sd[k].shape != v.shape
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing: {_few(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected: {_few(unexpected)}")
    if mismatched:
        problems.append(f"{len(mismatched)} of another shape: {_few(mismatched, 2)}")
    if problems:
        raise UsageError(
            f"{path} does not fit {label}: " + "; ".join(problems) + ".",
            "check the file belongs to this model "
            "(for another class count: --model-arg num_classes=N).",
        )
    model.load_state_dict(sd, strict=True)


# ---------------------------------------------------------------- custom models


def _read_model_file(source: str) -> Path:
    """The model's source file, checked readable: a file hookcli cannot read is an input
    problem (exit 2); what the file does when imported is the model's (exit 3)."""
    path = user_path(source, "model file")
    if path.is_dir():
        raise UsageError(
            f"model file {source} is a folder.", "give the .py file (path/to/file.py:Name)."
        )
    if not path.exists():
        raise UsageError(
            f"model file {source} not found.", "check the path in MODEL (path/to/file.py:Name)."
        )
    try:
        with io.open_code(str(path)) as f:  # as the import will read it
            f.read(1)
    except OSError as exc:
        raise UsageError(
            f"cannot read model file {source}: {exc.strerror or exc}.",
            "check the file's permissions (ls -l), or copy it somewhere readable.",
        ) from exc
    note_read(path)
    return path


def _load_custom(spec: str, weights: str, seed: int, kwargs: dict[str, Any]) -> LoadedModel:
    source, _, attr = spec.rpartition(":")
    if not source or not attr.isidentifier():
        raise _unknown_model(spec)
    if source.endswith(".py"):
        path = _read_model_file(source)
        module_name = f"_hookcli_user_{path.stem}"
        mod_spec = importlib.util.spec_from_file_location(module_name, path)
        if mod_spec is None or mod_spec.loader is None:
            raise UsageError(f"cannot import {source}.", "give a Python source file.")
        module = importlib.util.module_from_spec(mod_spec)
        sys.path.insert(0, str(path.resolve().parent))
        try:
            mod_spec.loader.exec_module(module)
        except SyntaxError as exc:
            raise UsageError(
                f"{source} line {exc.lineno}: syntax error: {exc.msg}.", "fix the model file."
            ) from exc
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # SystemExit, GeneratorExit, a model's own BaseException
            raise ModelError(
                f"importing {source} failed: {one_line(exc)}",
                "fix the model file; run it with python to see the traceback.",
            ) from exc
        finally:
            sys.path.remove(str(path.resolve().parent))
    else:
        try:
            module = importlib.import_module(source)
        except ModuleNotFoundError as exc:
            raise UsageError(
                f"cannot import module {source!r}: {exc}.",
                "install the package, or give path/to/file.py:Name.",
            ) from exc
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            raise ModelError(
                f"importing {source} failed: {one_line(exc)}",
                f"fix the module; python -c 'import {source}' shows the traceback.",
            ) from exc
    obj = getattr(module, attr, None)
    if obj is None:
        names = [
            n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, nn.Module)
        ]
        near = f" It defines: {', '.join(names)}." if names else ""
        raise UsageError(
            f"{source} has no {attr!r}.{near}", "name a class or factory defined in that file."
        )
    if not callable(obj):
        raise UsageError(
            f"{source}:{attr} is a {type(obj).__name__}, not a class or factory.",
            "name an nn.Module subclass or a function returning one.",
        )
    torch.manual_seed(seed)
    try:
        model = obj(**kwargs)
    except TypeError as exc:
        raise UsageError(
            f"{source}:{attr}({_kw(kwargs)}) failed: {exc}",
            "pass constructor arguments with --model-arg key=value.",
        ) from exc
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SystemExit, GeneratorExit, a model's own BaseException
        raise ModelError(
            f"{source}:{attr}({_kw(kwargs)}) raised {one_line(exc)}",
            "fix the model's constructor.",
        ) from exc
    if not isinstance(model, nn.Module):
        raise UsageError(
            f"{source}:{attr} gave a {type(model).__name__}, not an nn.Module.",
            "name an nn.Module subclass or a function returning one.",
        )
    from hookcli.selection import walk

    for _ in walk(model):  # a module cycle is named here, not hit as a RecursionError in eval()
        pass
    try:
        model.eval()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # the model's own train()/eval() override
        raise ModelError(
            f"{source}:{attr}'s eval() raised {one_line(exc)}",
            "fix the model's train()/eval() method.",
        ) from exc
    loaded = _wrap_module(model, "none")
    loaded.spec = spec
    loaded.name = attr
    if weights.strip().lower() not in ("none", ""):
        path = user_path(weights.strip(), "--weights")
        if not path.is_file():
            raise UsageError(
                f"weights file {weights} not found.",
                "custom models take --weights PATH to a state dict, or none.",
            )
        load_state_dict_file(model, path, spec)
        loaded.weights_label = str(path)
        loaded.pretrained = True
    else:
        loaded.weights_label = f"none (as constructed, seed {seed})"
    return loaded


def _kw(kwargs: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def _wrap_module(model: nn.Module, weights: str) -> LoadedModel:
    if isinstance(model, torch.jit.ScriptModule):
        raise UsageError(
            "TorchScript modules do not run Python hooks (scripted ones refuse them, traced ones "
            "never fire them).",
            "inspect the original nn.Module instead of the scripted/traced one.",
        )
    # No eval() here: the run sets eval for the pass and restores every module's mode after.
    return LoadedModel(
        module=model,
        name=type(model).__name__,
        spec=type(model).__name__,
        task="custom",
        weights_label="as given",
        pretrained=weights != "none",
        preprocess=None,
        preprocess_label="ImageNet: resize 256, center crop 224, ImageNet mean/std",
        input_size=None,
    )


# ---------------------------------------------------------------- devices


def resolve_device(spec: str) -> torch.device:
    """auto → a GPU when present (CUDA, then MPS), else the CPU."""
    raw = spec.strip().lower()
    mps = getattr(torch.backends, "mps", None)
    mps_ok = bool(mps is not None and mps.is_available())
    if raw == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps") if mps_ok else torch.device("cpu")
    try:
        device = torch.device(raw)
    except RuntimeError as exc:
        raise UsageError(
            f"unknown device {spec!r}.", "use auto, cpu, cuda, cuda:N or mps."
        ) from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(
                "CUDA is not available on this machine.", "use --device cpu (or auto)."
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(
                f"no GPU {device} (this machine has {torch.cuda.device_count()}).",
                "use --device cuda:0.",
            )
    elif device.type == "mps" and not mps_ok:
        raise UsageError("MPS is not available on this machine.", "use --device cpu (or auto).")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise UsageError(f"unsupported device {spec!r}.", "use auto, cpu, cuda, cuda:N or mps.")
    return device
