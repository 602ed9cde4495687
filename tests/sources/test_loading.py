"""Model and weights loading, offline: random init, the hub cache, local state dicts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torchvision

from hookcli.errors import UsageError
from hookcli.sources import load_model, parse_model_args
from hookcli.sources.torchvision import cache_path, weights_enum


def test_unknown_model_suggests_close_names() -> None:
    with pytest.raises(UsageError, match="resnet18"):
        load_model("resnet19")


def test_random_init_is_seeded() -> None:
    a = load_model("resnet18", seed=3).module.fc.weight
    b = load_model("resnet18", seed=3).module.fc.weight
    c = load_model("resnet18", seed=4).module.fc.weight
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_default_weights_are_read_from_the_torch_hub_cache() -> None:
    """Offline: a file named as torchvision's cache expects is what DEFAULT loads."""
    home = Path(os.environ["TORCH_HOME"])
    torch.manual_seed(42)
    reference = torchvision.models.resnet18()
    target = cache_path(weights_enum("resnet18").DEFAULT)
    assert str(target).startswith(str(home))
    target.parent.mkdir(parents=True)
    torch.save(reference.state_dict(), target)
    loaded = load_model("resnet18", weights="DEFAULT")
    assert torch.equal(loaded.module.conv1.weight, reference.conv1.weight)
    assert loaded.pretrained and loaded.weights_label == "ResNet18_Weights.IMAGENET1K_V1"
    by_name = load_model("resnet18", weights="IMAGENET1K_V1")
    assert torch.equal(by_name.module.fc.bias, reference.fc.bias)


def test_offline_without_cache_names_the_expected_path(monkeypatch: pytest.MonkeyPatch) -> None:
    import urllib.error

    def no_network(*args: object, **kwargs: object) -> None:
        raise urllib.error.URLError("network unreachable (test)")

    monkeypatch.setattr(torch.hub, "download_url_to_file", no_network)
    with pytest.raises(UsageError) as err:
        load_model("resnet18", weights="DEFAULT")
    expected = cache_path(weights_enum("resnet18").DEFAULT)
    assert str(expected) in str(err.value) and "network unreachable" in str(err.value)
    assert not expected.exists()


def test_unknown_weights_enum_lists_the_real_ones() -> None:
    with pytest.raises(UsageError, match="IMAGENET1K_V1"):
        load_model("resnet18", weights="IMAGENET2K")


def test_local_state_dict(tmp_path: Path) -> None:
    torch.manual_seed(7)
    ref = torchvision.models.resnet18()
    path = tmp_path / "w.pth"
    torch.save({"state_dict": {f"module.{k}": v for k, v in ref.state_dict().items()}}, path)
    loaded = load_model("resnet18", weights=str(path))
    assert torch.equal(loaded.module.layer4[1].conv2.weight, ref.layer4[1].conv2.weight)


def test_safetensors_state_dict(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    ref = torchvision.models.resnet18()
    path = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    assert torch.equal(load_model("resnet18", weights=str(path)).module.fc.weight, ref.fc.weight)


def test_state_dict_with_wrong_keys_and_shapes_is_reported(tmp_path: Path) -> None:
    sd = torchvision.models.resnet18(num_classes=10).state_dict()
    sd["extra.weight"] = torch.zeros(1)
    del sd["layer1.0.bn1.running_mean"]
    path = tmp_path / "w.pth"
    torch.save(sd, path)
    with pytest.raises(UsageError) as err:
        load_model("resnet18", weights=str(path))
    text = str(err.value)
    assert "1 missing: layer1.0.bn1.running_mean" in text
    assert "1 unexpected: extra.weight" in text
    assert "fc.weight (file 10x512, model 1000x512)" in text
    # the class count is a builder argument
    sd = torchvision.models.resnet18(num_classes=10).state_dict()
    torch.save(sd, path)
    assert (
        load_model(
            "resnet18", weights=str(path), model_args={"num_classes": 10}
        ).module.fc.out_features
        == 10
    )


class NotTensors:
    pass


def test_pickle_needing_full_unpickling_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "evil.pth"
    torch.save({"obj": NotTensors()}, path)
    with pytest.raises(UsageError, match="weights_only"):
        load_model("resnet18", weights=str(path))


def test_missing_or_garbage_weight_files(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not found"):
        load_model("resnet18", weights=str(tmp_path / "nope.pth"))
    junk = tmp_path / "junk.pth"
    junk.write_bytes(os.urandom(64))
    with pytest.raises(UsageError, match="not a readable"):
        load_model("resnet18", weights=str(junk))


def test_model_args() -> None:
    assert parse_model_args(["num_classes=10", "name=abc", "flag=True"]) == {
        "num_classes": 10,
        "name": "abc",
        "flag": True,
    }
    with pytest.raises(UsageError):
        parse_model_args(["=3"])
    with pytest.raises(UsageError, match="cannot build"):
        load_model("resnet18", model_args={"no_such_arg": 1})


def test_custom_model_from_file() -> None:
    loaded = load_model("examples/tiny/net.py:Net")
    assert loaded.task == "custom" and loaded.name == "Net"
    with pytest.raises(UsageError, match=r"has no 'Nett'\. It defines: Net"):
        load_model("examples/tiny/net.py:Nett")


def test_a_model_built_for_a_fixed_size_gets_that_size() -> None:
    """vit_h_14 without weights is built for 224 px while its DEFAULT weights' transforms
    make 518: the model's own image_size wins (here vit_b_16 built for 160)."""
    from hookcli.inputs import default_input, from_images
    from tests.support.paths import CAT

    loaded = load_model("vit_b_16", model_args={"image_size": 160})
    assert loaded.input_size == (160, 160)
    assert default_input(loaded, 0).shapes() == [(1, 3, 160, 160)]
    assert from_images([str(CAT)], loaded).shapes() == [(1, 3, 160, 160)]
