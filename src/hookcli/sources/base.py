"""The Source interface, and helpers every source shares (--model-arg parsing, quiet builds).

A source turns one kind of MODEL spec into a LoadedModel: the module with its weights, its
preprocessing, its class labels, the size of its default input and its Task (how the forward
takes a batch, which default input it gets, how predictions and the default backward target
are read from its output). Sources are registered in hookcli.sources.registry; the built-in
ones (torchvision names, file.py:Name, pkg.mod:Name) through the same `register` a plug-in
uses (timm:NAME, hf:TYPE next).
"""

from __future__ import annotations

import ast
import contextlib
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from hookcli.errors import UsageError
from hookcli.sources.model import LoadedModel


class Source:
    """One kind of MODEL spec. A source with a `prefix` claims `PREFIX:REST` specs (checked
    before the shape-based sources); one without overrides `claims`."""

    name = "source"
    prefix: str | None = None  # e.g. "timm" claims "timm:NAME"

    def claims(self, spec: str) -> bool:
        """Whether this source loads spec (a stripped, non-empty string)."""
        return self.prefix is not None and spec.startswith(self.prefix + ":")

    def load(
        self, spec: str, *, weights: str, seed: int, model_args: dict[str, Any]
    ) -> LoadedModel:
        """The model named by spec in eval mode on the CPU, with the given weights
        (`none`: initialised under the seed)."""
        raise NotImplementedError

    def names(self) -> list[str]:
        """Names this source knows (for `did you mean` hints); empty when it cannot list."""
        return []


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


def kwargs_text(kwargs: Mapping[str, Any]) -> str:
    """`a=1, b='x'`: constructor arguments as messages show them."""
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
