"""LoadedModel: what a source hands to the rest of hookcli."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

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
    categories: Sequence[str] | None = None  # a language model's: its tokens, decoded
    preprocess: Callable[..., torch.Tensor] | None = None
    preprocess_label: str = ""
    input_size: tuple[int, int] | None = None  # H, W the model wants for a random input
    notes: list[str] = field(default_factory=list)  # what the report should say of the loading
    # a text model: where its tokenizer is looked for (a folder, or ORG/NAME in the local hub
    # cache; None: nowhere), the tokenizer once loaded, and the most tokens it takes
    tokenizer_from: str | None = None
    tokenizer: Any = None
    tokenizer_label: str = ""  # its class and where it came from
    max_tokens: int | None = None

    @property
    def task(self) -> str:
        """The task's name, as reports show it (classification, detection, custom …)."""
        return self.kind.name
