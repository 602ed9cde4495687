"""engine/tplayout: what each of transformers' tensor-parallel styles makes of its module's first
input and output, read from the wrapped forward the style installs — without a process group
(a stand-in mesh), against the styles' own definitions."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from hookcli.engine.tplayout import NONE, UNKNOWN, WHOLE, Declared, tp_layouts

tp = pytest.importorskip("transformers.distributed.tensor_parallel")


class Mesh:
    """A 1-D mesh's stand-in: its group, a sentinel."""

    ndim = 1
    group = object()

    def get_group(self, *_: Any) -> object:
        return self.group


def _styled(style_name: str, module: nn.Module) -> nn.Module:
    """The module wrapped as transformers' plan wraps it (install_forward), marked as it marks
    it; a model holding it."""
    tp.ALL_PARALLEL_STYLES[style_name].install_forward(module, Mesh())
    module._is_hooked = True
    return nn.Sequential(module, nn.SiLU(), nn.LayerNorm(8))


@pytest.mark.parametrize(
    ("style", "took", "gave"),
    [
        ("colwise", WHOLE, Declared(Mesh.group, -1, 24)),
        ("rowwise", Declared(Mesh.group, -1, 16), WHOLE),
        ("colwise_gather_output", WHOLE, WHOLE),
        ("rowwise_split_input", WHOLE, WHOLE),
        ("sequence_parallel", Declared(Mesh.group, 1), Declared(Mesh.group, 1)),
        ("packed_colwise", WHOLE, Declared(Mesh.group, -1)),
        ("mla_kv_a_proj", UNKNOWN, UNKNOWN),
    ],
)
def test_a_styles_layouts_are_read_from_its_wrapped_forward(
    style: str, took: Any, gave: Any
) -> None:
    # (sequence parallel makes its module's own weights DTensors: a module without them)
    module = nn.Identity() if style == "sequence_parallel" else nn.Linear(16, 24)
    layouts = tp_layouts(_styled(style, module))
    assert layouts.sides["0"] == {"in": took, "out": gave}
    # the SiLU works element by element; the LayerNorm mixes its last dimension
    assert "1" in layouts.elementwise and "2" not in layouts.elementwise
    assert {"0", "1", "2"} <= layouts.leaves


def test_embeddings_are_whole_and_weights_only_styles_declare_nothing() -> None:
    assert tp_layouts(_styled("embedding_rowwise", nn.Embedding(10, 8))).sides["0"] == {
        "in": WHOLE,
        "out": WHOLE,
    }
    for style in ("replicate", "local_params"):
        assert tp_layouts(_styled(style, nn.LayerNorm(8))).sides["0"] == {}


def test_a_model_no_plan_wrapped_has_no_layouts() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    model[0]._is_hooked = True  # marked, but its forward is the class's own
    assert tp_layouts(model) is NONE
