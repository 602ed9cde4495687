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
import logging
import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from hookcli.errors import UsageError, one_line
from hookcli.sources.model import LoadedModel


class Source:
    """One kind of MODEL spec. A source with a `prefix` claims `PREFIX:REST` specs (checked
    before the shape-based sources); one without overrides `claims`."""

    name = "source"
    prefix: str | None = None  # e.g. "timm" claims "timm:NAME"
    # the ways of building a model without its weights in memory (sources/skeleton.py) that
    # this source handles itself: its load() is then told which by `building=` ("meta",
    # "offload"). Any source's model is built for --meta on the meta device without its
    # knowing; --offload (each block's weights read from the checkpoint as it runs) only by a
    # source that declares it.
    builds: frozenset[str] = frozenset()

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


# environment switches that turn third-party progress bars off (tqdm's, huggingface_hub's,
# transformers' "Loading checkpoint shards"): their carriage returns and escape codes would
# reach the terminal raw, in the middle of hookcli's one-line messages (issue 32)
_NO_PROGRESS = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """Third-party progress bars off while a model is built (the environment as it was after;
    transformers' own switch is turned off where it is imported, sources/hf.py)."""
    import sys

    saved = {k: os.environ.get(k) for k in _NO_PROGRESS}
    os.environ.update(_NO_PROGRESS)
    tf_logging = getattr(
        sys.modules.get("transformers.utils.logging"), "disable_progress_bar", None
    )
    if tf_logging is not None:
        tf_logging()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def quiet_warnings() -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def kwargs_text(kwargs: Mapping[str, Any]) -> str:
    """`a=1, b='x'`: constructor arguments as messages show them."""
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def _enum_notice(record: logging.LogRecord) -> bool:
    """False for torch's notice that an Enum registered as a pytree constant no longer needs
    it: torchao registers several on import (transformers imports torchao wherever it is
    installed), a deprecation inside those libraries, not the user's to act on."""
    return "is an Enum subclass and is now natively supported" not in record.getMessage()


def import_extra(module: str, extra: str, what: str) -> Any:
    """The optional package `module`, or a one-line error naming the extra that installs it."""
    import importlib

    pytree = logging.getLogger("torch.utils._pytree")
    if _enum_notice not in pytree.filters:
        pytree.addFilter(_enum_notice)

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise UsageError(
            f"{what} need the {module} package, which is not installed ({one_line(exc)}).",
            f"pip install 'hookcli[{extra}]'",
        ) from exc


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache as huggingface_hub finds it: HF_HUB_CACHE, else
    HF_HOME/hub, else ~/.cache/huggingface/hub (read now, not at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def hf_cached(repo: str, filenames: tuple[str, ...]) -> Path | None:
    """The first of filenames in the local hub cache's snapshot of repo (never downloads)."""
    from huggingface_hub import try_to_load_from_cache

    for filename in filenames:
        found = try_to_load_from_cache(repo, filename, cache_dir=str(hf_cache_dir()))
        if isinstance(found, str):
            return Path(found)
    return None


def hf_cache_path(repo: str) -> Path:
    """Where the hub cache keeps (or would keep) repo's snapshots."""
    return hf_cache_dir() / ("models--" + repo.replace("/", "--")) / "snapshots"
