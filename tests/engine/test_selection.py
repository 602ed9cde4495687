"""Layer selection: names, globs, types, depth, aliases, suggestions."""

from __future__ import annotations

import pytest
import torch
import torchvision

from hookcli.engine.selection import (
    count_params,
    dtype_of,
    dtypes_held,
    held,
    module_entries,
    params_and_dtype,
    select,
)
from hookcli.errors import UsageError
from tests.support.models import Aliased


@pytest.fixture(scope="module")
def resnet18_entries():  # type: ignore[no-untyped-def]
    return module_entries(torchvision.models.resnet18())


def names(targets) -> list[str]:  # type: ignore[no-untyped-def]
    return [t.name for t in targets]


def test_default_is_every_leaf(resnet18_entries) -> None:  # type: ignore[no-untyped-def]
    got = names(select(resnet18_entries))
    assert "conv1" in got and "layer1.0.relu" in got and "fc" in got
    assert "layer1" not in got and "layer1.0" not in got


def test_exact_name_selects_a_container(resnet18_entries) -> None:  # type: ignore[no-untyped-def]
    assert names(select(resnet18_entries, layers=["layer4"])) == ["layer4"]


def test_glob_on_dotted_names(resnet18_entries) -> None:  # type: ignore[no-untyped-def]
    got = names(select(resnet18_entries, layers=["layer2.*.conv*"]))
    assert got == ["layer2.0.conv1", "layer2.0.conv2", "layer2.1.conv1", "layer2.1.conv2"]


def test_kinds_of_filters_intersect_and_repeats_unite(resnet18_entries) -> None:  # type: ignore[no-untyped-def]
    got = names(select(resnet18_entries, layers=["layer4.*", "layer3.*"], types=["conv2d"]))
    assert all(n.startswith(("layer3.", "layer4.")) for n in got)
    assert "layer4.0.downsample.0" in got and len(got) == 10


def test_depth_covers_the_network(resnet18_entries) -> None:  # type: ignore[no-untyped-def]
    assert names(select(resnet18_entries, depth=1)) == [
        "conv1",
        "bn1",
        "relu",
        "maxpool",
        "layer1",
        "layer2",
        "layer3",
        "layer4",
        "avgpool",
        "fc",
    ]


def test_unknown_layer_suggests_the_nearest_names(resnet18_entries) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UsageError) as err:
        select(resnet18_entries, layers=["layer4.1.conv3"], model_label="resnet18")
    assert "layer4.1.conv1" in str(err.value) and "hookcli layers resnet18" in str(err.value)


def test_unknown_type_suggests(resnet18_entries) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UsageError, match="Conv2d"):
        select(resnet18_entries, types=["Conv2"])


def test_filters_that_select_nothing_together(resnet18_entries) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UsageError, match="select no layer"):
        select(resnet18_entries, layers=["fc"], types=["Conv2d"])


def test_names_and_globs_together_select_in_the_models_order(resnet18_entries) -> None:  # type: ignore[no-untyped-def]
    # plain names are looked up in one set, globs matched: the same targets, model order
    got = names(select(resnet18_entries, layers=["fc", "layer1.*.conv1", "conv1"]))
    assert got == ["conv1", "layer1.0.conv1", "layer1.1.conv1", "fc"]
    both = select(resnet18_entries, layers=["conv1"], always=["fc", "layer4.1.bn*"])
    assert names(both) == ["conv1", "layer4.1.bn1", "layer4.1.bn2", "fc"]
    for missing in (["fc", "layer9.*"], ["fc", "layer9"]):
        with pytest.raises(UsageError, match="layer9"):
            select(resnet18_entries, layers=missing)


def test_aliases_are_one_target_with_every_name() -> None:
    (target,) = select(module_entries(Aliased()))
    assert target.name == "a" and target.aliases == ["b"]
    assert names(select(module_entries(Aliased()), layers=["b"])) == ["a"]


def test_bad_depth() -> None:
    with pytest.raises(UsageError, match="depth"):
        select(module_entries(Aliased()), depth=0)


def test_parameter_counts_equal_each_modules_own_parameters() -> None:
    """Subtree counts are built from the children's; the oracle is module.parameters() (each
    shared parameter once per subtree) on a model with a module reachable by two paths, one
    of them met after its second parent, and a weight tied across two layers."""
    from torch import nn

    from hookcli.engine.selection import count_params

    shared = nn.Linear(3, 3)
    tied = nn.Linear(3, 3)
    head = nn.Linear(3, 3, bias=False)
    head.weight = tied.weight
    model = nn.Sequential(
        nn.Sequential(nn.Linear(3, 4), shared),
        nn.Sequential(nn.Sequential(shared, tied), head),
        nn.ModuleDict({"again": nn.Sequential(shared), "norm": nn.LayerNorm(3)}),
    )
    model.extra = nn.Parameter(nn.init.zeros_(nn.Linear(2, 2).weight.detach().clone()))
    entries = module_entries(model)
    assert len(entries) == len({id(m) for m in model.modules()})
    for e in entries:
        assert e.params == count_params(e.module), e.names
        assert e.own_params == sum(p.numel() for p in e.module.parameters(recurse=False))
    assert entries[0].params == (12 + 4) + 12 + 12 + 6 + 4, "tied and shared once"
    resnet = torchvision.models.resnet18()
    assert [e.params for e in module_entries(resnet)] == [
        count_params(m) for m in dict.fromkeys(resnet.modules())
    ]


def _fields(entries) -> list[tuple[object, ...]]:  # type: ignore[no-untyped-def]
    return [
        (id(e.module), e.names, e.type, e.depth, e.leaf, e.own_params, e.params, e.unhookable)
        for e in entries
    ]


def test_a_models_table_is_remembered_until_its_modules_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A warm loop pays a walk, not the table; any change to the modules, their names or
    their parameters' shapes makes a new one, equal to one made from scratch."""
    from hookcli.engine import selection

    made: list[int] = []
    original = selection._entries
    monkeypatch.setattr(selection, "_entries", lambda m: made.append(1) or original(m))
    model = torchvision.models.resnet18()
    first = module_entries(model)
    again = module_entries(model)
    assert len(made) == 1 and _fields(again) == _fields(first)
    assert again is not first and again[0] is not first[0]  # each caller's own entries

    def changed() -> None:
        got = module_entries(model)
        assert _fields(got) == _fields(original(model))

    model.fc = torch.nn.Linear(512, 7)  # a module replaced
    changed()
    model.layer1[0].conv1.weight = torch.nn.Parameter(torch.zeros(64, 64, 1, 1))  # a shape
    changed()
    model.extra = torch.nn.ReLU()  # a module added, then removed
    changed()
    del model.extra
    changed()
    model.register_module("gap", None)  # an empty place …
    changed()
    model.gap, model.fc = model.fc, None  # … the module moved there, its own place emptied
    changed()
    assert [e.names for e in module_entries(model) if e.type == "Linear"] == [["gap"]]
    assert len(made) == 7
    lazy = torch.nn.Sequential(torch.nn.LazyLinear(3))
    assert module_entries(lazy)[1].params == 0
    lazy(torch.zeros(2, 5))  # materialised: 5 * 3 + 3 parameters
    assert module_entries(lazy)[1].params == 18


def test_a_remembered_table_does_not_keep_its_model_alive() -> None:
    import gc
    import weakref

    model = torchvision.models.resnet18()
    module_entries(model)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_what_a_model_holds_each_tensor_once_and_its_dtypes() -> None:
    """held(): every parameter and buffer once, in registration order, a tensor that is both
    (a module's buffer that is another's parameter) a parameter; the count and dtypes from
    it equal parameters()/buffers() by hand; a lazy parameter counts 0 and no dtype."""
    main, pre = torch.nn.Linear(3, 3), torch.nn.Module()
    pre.register_buffer("shared", main.weight)  # (before main in the walk)
    pre.register_buffer("scale", torch.ones(4, dtype=torch.float64))
    model = torch.nn.Sequential(pre, main, torch.nn.LazyLinear(2), torch.nn.BatchNorm1d(2))
    params, buffers = held(model)
    assert [id(p) for p in params] == [id(p) for p in model.parameters()]
    assert all(id(b) not in {id(p) for p in params} for b in buffers)
    assert [id(b) for b in buffers] == [id(b) for b in model.buffers() if id(b) != id(main.weight)]
    want = sum(p.numel() for p in (main.weight, main.bias, *model[3].parameters()))
    assert count_params(model) == want
    total, dtype = params_and_dtype(model)
    assert total == want
    assert dtype == "float32 (float64 in some tensors)" == dtype_of(model)
    assert dtypes_held(model) == ("float32", ["float64"])
