"""Local state dict files (.pth/.pt with weights_only=True, .safetensors): read, unwrap,
check against a model and load — the same for every source."""

from __future__ import annotations

import pickle
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookcli.errors import UsageError, not_a_file, one_line
from hookcli.io.output import note_read
from hookcli.text import few

WEIGHT_SUFFIXES = (".pth", ".pt", ".safetensors", ".bin", ".ckpt")


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
            with warnings.catch_warnings():  # (torch's note on a plain pickle's protocol)
                warnings.simplefilter("ignore")
                data = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            if not zipfile.is_zipfile(path):  # not torch.save's format: just not a checkpoint
                raise UsageError(  # (torch's own text advises unpickling it: never done here)
                    f"{path} is not a readable PyTorch file (a plain pickle, or other bytes; "
                    "hookcli never unpickles).",
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
        problems.append(f"{len(missing)} missing: {few(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected: {few(unexpected)}")
    if mismatched:
        problems.append(f"{len(mismatched)} of another shape: {few(mismatched, 2)}")
    if problems:
        raise UsageError(
            f"{path} does not fit {label}: " + "; ".join(problems) + ".",
            "check the file belongs to this model "
            "(for another class count: --model-arg num_classes=N).",
        )
    model.load_state_dict(sd, strict=True)


def weights_file(raw: str) -> Path | None:
    """The state dict file a --weights value names — it has a weights suffix, a path separator,
    or exists — checked to be a file; None when the value names no file (DEFAULT, an enum name
    or a tag, for the source to read)."""
    import os

    from hookcli.io.output import user_path

    path = user_path(raw, "--weights")
    if not (path.suffix.lower() in WEIGHT_SUFFIXES or os.sep in raw or path.exists()):
        return None
    if not path.is_file():
        raise UsageError(
            f"weights file {raw} {not_a_file(path)}.",
            "give an existing .pth/.pt/.safetensors file, or --weights DEFAULT / none.",
        )
    return path
