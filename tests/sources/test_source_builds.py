"""How a source builds a model without its weights in memory is declared on the source
(`Source.builds`) and passed to its load() as an argument (`building=`), never read from
ambient state: a plug-in that declares "offload" is handed it; one that declares nothing is
built for --meta on the meta device without being told, never handed the argument, and
refused --offload in one line."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from hookcli.errors import UsageError
from hookcli.sources import LoadedModel, Source, Task, load_model, register, unregister


class _Recording(Source):
    """A source that records the keyword arguments its load() is given."""

    prefix = "rec"
    name = "rec"

    def __init__(self, builds: frozenset[str]) -> None:
        self.builds = builds
        self.given: list[dict[str, Any]] = []

    def load(
        self, spec: str, *, weights: str, seed: int, model_args: dict[str, Any], **kw: Any
    ) -> LoadedModel:
        self.given.append(kw)
        module = nn.Linear(3, 2)
        return LoadedModel(module, "rec", spec, Task(), "none", False)


@pytest.fixture
def recording() -> Iterator[_Recording]:
    source = _Recording(frozenset({"meta", "offload"}))
    register(source)
    try:
        yield source
    finally:
        unregister("rec")


def test_a_source_declaring_offload_is_handed_it_as_an_argument(recording: _Recording) -> None:
    load_model("rec:x", building="offload")
    load_model("rec:x", building="meta")
    loaded = load_model("rec:x")
    assert recording.given == [{"building": "offload"}, {"building": "meta"}, {}]
    assert isinstance(loaded.module.weight, torch.nn.Parameter)
    assert not loaded.module.weight.is_meta


def test_meta_moves_what_the_source_built_outside_the_meta_device(
    recording: _Recording,
) -> None:
    loaded = load_model("rec:x", building="meta")
    assert loaded.module.weight.is_meta  # built under torch.device("meta") by load_model


def test_a_source_that_declares_nothing_builds_meta_unaware_and_is_refused_offload(
    recording: _Recording,
) -> None:
    recording.builds = frozenset()
    loaded = load_model("rec:x", building="meta")
    assert loaded.module.weight.is_meta
    assert recording.given == [{}]  # never handed an argument its load() need not take
    with pytest.raises(UsageError) as offload:
        load_model("rec:x", building="offload")
    assert offload.value.message.startswith("--offload reads a Hugging Face checkpoint")
    assert offload.value.message.endswith("rec:x is not one.")
    assert recording.given == [{}]


def test_the_built_in_sources_declare_what_they_can() -> None:
    from hookcli.sources import sources

    declared = {s.name: s.builds for s in sources()}
    assert declared["hf"] == {"meta", "offload", "tp"}
    assert declared["torchvision"] == declared["timm"] == declared["file"] == frozenset()
