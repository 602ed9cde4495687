"""LoadedModel: what a source hands to the rest of hookcli."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from hookcli.sources.tasks import Task


@dataclass(slots=True)
class LoadedModel:
    """A ready nn.Module and what its source knows about it: weights, preprocessing, labels,
    the size of a default input, and its Task (batching, default input, predictions, scores)."""

    module: nn.Module
    name: str
    spec: str
    kind: Task
    weights_label: str
    pretrained: bool
    categories: list[str] | None = None
    preprocess: Callable[..., torch.Tensor] | None = None
    preprocess_label: str = ""
    input_size: tuple[int, int] | None = None  # H, W the model wants for a random input
    notes: list[str] = field(default_factory=list)  # what the report should say of the loading

    @property
    def task(self) -> str:
        """The task's name, as reports show it (classification, detection, custom …)."""
        return self.kind.name
