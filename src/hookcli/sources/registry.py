"""Sources by prefix or by the shape of the spec: `register` adds one, `resolve` picks one."""

from __future__ import annotations

import difflib

from hookcli.errors import UsageError
from hookcli.sources.base import Source

_SOURCES: list[Source] = []


def register(source: Source) -> Source:
    """Adds a source; a source with the same name (or prefix) replaces the old one."""
    for i, old in enumerate(_SOURCES):
        if old.name == source.name or (source.prefix and old.prefix == source.prefix):
            _SOURCES[i] = source
            return source
    _SOURCES.append(source)
    return source


def unregister(name: str) -> None:
    """Removes the source of that name (tests, plug-ins replaced at run time)."""
    _SOURCES[:] = [s for s in _SOURCES if s.name != name]


def sources() -> list[Source]:
    """The registered sources, in the order `resolve` asks them."""
    prefixed = [s for s in _SOURCES if s.prefix is not None]
    return prefixed + [s for s in _SOURCES if s.prefix is None]


def resolve(spec: str) -> Source:
    """The source that loads spec: a prefix source for `PREFIX:…`, else the first
    shape-based source (in registration order) that claims it."""
    spec = spec.strip()
    for source in sources():
        if source.claims(spec):
            return source
    raise unknown_model(spec)


def unknown_model(spec: str) -> UsageError:
    known = [name for s in _SOURCES for name in s.names()]
    close = difflib.get_close_matches(spec, known, n=4, cutoff=0.6)
    near = f" Did you mean {', '.join(close)}?" if close else ""
    return UsageError(
        f"unknown model {spec!r}.{near}",
        "run `hookcli models` for torchvision names, or give path/to/file.py:ClassName.",
    )
