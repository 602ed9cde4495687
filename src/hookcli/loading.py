"""MODEL specs and weights → a ready nn.Module, its preprocessing and its class labels.

The work lives in hookcli.sources (one module per source, a registry by prefix); this module
keeps the names other code and users import.

MODEL is a torchvision registry name (`resnet34`), `path/to/file.py:Name` or
`package.module:Name` (Name an nn.Module subclass or a factory returning one).
`--weights none|DEFAULT|<ENUM>|PATH`: none is random initialisation under the seed;
DEFAULT/enum names are torchvision's weights, read from the torch hub cache or downloaded;
PATH is a local state dict, loaded with `weights_only=True`.
"""

from __future__ import annotations

from hookcli.sources import (
    CLIP_FRAMES,
    TASKS,
    LoadedModel,
    load_model,
    parse_model_args,
    quiet_warnings,
    resolve_device,
)
from hookcli.sources.statedict import load_state_dict_file, read_state_dict
from hookcli.sources.torchvision import cache_path, registry_names, task_of, weights_enum

__all__ = [
    "CLIP_FRAMES",
    "TASKS",
    "LoadedModel",
    "cache_path",
    "load_model",
    "load_state_dict_file",
    "parse_model_args",
    "quiet_warnings",
    "read_state_dict",
    "registry_names",
    "resolve_device",
    "task_of",
    "weights_enum",
]
