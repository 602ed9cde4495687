"""The one walker over nested model inputs and outputs (hookcli.tree)."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple
from typing import Any

import torch

from hookcli.tree import MAX_DEPTH, iter_tensors, map_tensors

Pair = namedtuple("Pair", ["logits", "aux"])


class ModelOutputLike(OrderedDict[str, Any]):
    """Like Hugging Face's ModelOutput: a dict whose keys are also attributes."""

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        object.__setattr__(self, key, value)


def _nested() -> Any:
    a, b, c, d = (torch.full((2,), float(i)) for i in range(4))
    out = ModelOutputLike()
    out["logits"] = a
    out["hidden"] = (b, [c, "text", None])
    return {"pair": Pair(d, 7), "model": out, 3: torch.arange(3)}


def test_paths_name_every_kind_of_container() -> None:
    paths = [p for p, _ in iter_tensors(_nested(), "out")]
    assert paths == [
        'out["pair"].logits',
        'out["model"]["logits"]',
        'out["model"]["hidden"][0]',
        'out["model"]["hidden"][1][0]',
        "out[3]",
    ]


def test_map_keeps_structure_and_types_and_names_paths_alike() -> None:
    original = _nested()
    seen: list[str] = []

    def double(path: str, t: torch.Tensor) -> torch.Tensor:
        seen.append(path)
        return t * 2 if t.is_floating_point() else t

    mapped = map_tensors(original, double, "out")
    assert seen == [p for p, _ in iter_tensors(original, "out")]
    assert type(mapped["pair"]) is Pair and mapped["pair"].aux == 7
    assert type(mapped["model"]) is ModelOutputLike
    assert torch.equal(mapped["model"].logits, original["model"]["logits"] * 2), "attribute too"
    assert type(mapped["model"]["hidden"]) is tuple
    assert mapped["model"]["hidden"][1][1:] == ["text", None]
    assert torch.equal(mapped[3], torch.arange(3)), "an integer tensor left as it was"
    assert torch.equal(original["model"]["logits"], torch.zeros(2)), "the original untouched"


@dataclasses.dataclass
class _EncOut:
    hidden: torch.Tensor
    pooled: torch.Tensor
    extra: object = None


def test_a_dataclass_output_is_walked_and_rebuilt_by_its_fields() -> None:
    """A model returning a plain dataclass (not a ModelOutput): every tensor field is found,
    named `.field` (it was skipped, so a NaN in it passed --fail-on nonfinite), and map
    rebuilds it, the original untouched."""
    out = _EncOut(torch.ones(2), torch.zeros(1), extra=[torch.full((3,), 2.0)])
    assert [p for p, _ in iter_tensors(out, "out")] == ["out.hidden", "out.pooled", "out.extra[0]"]
    mapped = map_tensors(out, lambda _p, t: t * 3, "out")
    assert type(mapped) is _EncOut and torch.equal(mapped.hidden, torch.full((2,), 3.0))
    assert torch.equal(mapped.extra[0], torch.full((3,), 6.0)) and torch.equal(
        out.hidden, torch.ones(2)
    )


def test_depth_is_bounded_both_ways() -> None:
    deep: Any = torch.ones(1)
    for _ in range(MAX_DEPTH + 3):
        deep = [deep]
    assert list(iter_tensors(deep, "x")) == []
    assert map_tensors(deep, lambda p, t: t * 0) is not None
    shallow: Any = torch.ones(1)
    for _ in range(MAX_DEPTH - 1):
        shallow = [shallow]
    ((path, _),) = list(iter_tensors(shallow, "x"))
    assert path == "x" + "[0]" * (MAX_DEPTH - 1)
