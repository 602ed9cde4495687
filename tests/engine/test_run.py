"""The engine on real models: one record per call, statistics equal the float64 oracle on
tensors retained by an independent hook, structured outputs by path, never-called modules,
bitwise-identical outputs, hooks removed and modes restored whatever happens."""

from __future__ import annotations

import pytest
import torch
import torchvision

import hookcli
from hookcli.errors import ModelError, UsageError
from hookcli.records import Report
from hookcli.tree import iter_tensors
from tests.support.models import Aliased, Fails, Kinds, KwargOnly
from tests.support.oracles import assert_stats_match, hooks_left, retained_outputs
from tests.support.paths import CAT


def check_against_oracle(
    report: Report, store: dict[tuple[str, int], dict[str, torch.Tensor]]
) -> int:
    checked = 0
    for call in report.layers:
        tensors = store[(call.name, call.call)]
        for s in call.inputs + call.outputs:
            assert_stats_match(s, tensors[s.path])
            checked += 1
    return checked


def test_resnet18_every_leaf_matches_the_oracle_and_reused_relu_gives_two_calls() -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    x = torch.randn(2, 3, 224, 224)
    report = hookcli.inspect(model, x, device="cpu")
    relu_calls = [c.call for c in report.layers if c.name == "layer1.0.relu"]
    assert relu_calls == [0, 1]
    leaves = [n for n, m in model.named_modules() if next(m.children(), None) is None]
    assert {c.name for c in report.layers} == set(leaves)
    checked = check_against_oracle(report, retained_outputs(model, (x,)))
    assert checked > 2 * len(leaves)
    # the in-place ReLU: input measured before it ran, output after
    first = next(c for c in report.layers if c.name == "relu")
    assert first.inputs[0].min < 0 and first.outputs[0].min == 0  # type: ignore[operator]
    assert hooks_left(model) == 0


def test_outputs_are_bitwise_identical_with_and_without_hookcli() -> None:
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v3_small().eval()
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        plain = model(x)
    seen: list[torch.Tensor] = []
    user_hook = model.register_forward_hook(lambda m, a, out: seen.append(out.clone()))
    try:
        hookcli.inspect(model, x, device="cpu")
    finally:
        user_hook.remove()
    assert len(seen) == 1, "the user's own hook still fires under hookcli"
    assert torch.equal(plain, seen[0])
    with torch.no_grad():
        assert torch.equal(plain, model(x))
    assert hooks_left(model) == 0


def test_modes_restored_and_hooks_removed_after_a_forward_error() -> None:
    model = Fails()
    model.train()
    model.ok.eval()  # mixed modes must come back exactly
    with pytest.raises(ModelError) as err:
        hookcli.inspect(model, torch.randn(1, 2), device="cpu")
    assert "bad" in err.value.message and "boom inside the model" in err.value.message
    assert err.value.exit_code == 3
    assert hooks_left(model) == 0
    assert model.training and model.bad.training and not model.ok.training


def test_an_aliased_module_is_hooked_once_and_records_each_call() -> None:
    model = Aliased()
    report = hookcli.inspect(model, torch.randn(2, 3), device="cpu")
    assert [(c.name, c.call, c.aliases) for c in report.layers] == [
        ("a", 0, ["b"]),
        ("a", 1, ["b"]),
    ]


def test_keyword_only_inputs_are_seen() -> None:
    report = hookcli.inspect(KwargOnly(), torch.randn(2, 3), device="cpu")
    (call,) = report.layers
    assert [s.path for s in call.inputs] == ["in[0]", 'in["factor"]']
    assert call.inputs[1].mean == 2.0


def test_structured_output_of_every_kind_is_reported_by_path() -> None:
    torch.manual_seed(0)
    model = Kinds()
    x = torch.randn(3, 4)
    report = hookcli.inspect(model, x, device="cpu", layers=["kinds"])
    (call,) = report.layers
    paths = {s.path: s for s in call.outputs}
    assert set(paths) == {
        'out["half"]',
        'out["pair"][0]',
        'out["pair"][1]',
        'out["empty"]',
        'out["nan"]',
    }
    assert paths['out["half"]'].dtype == "float16"
    assert paths['out["pair"][0]'].dtype == "int64"
    assert paths['out["pair"][1]'].dtype == "bool"
    assert paths['out["empty"]'].numel == 0 and paths['out["empty"]'].mean is None
    assert paths['out["nan"]'].nan > 0
    with torch.no_grad():
        out = model(x)
    flat = dict(iter_tensors(out, "out"))
    for path, s in paths.items():
        assert_stats_match(s, flat[path], rtol=1e-3)


def test_vit_lists_the_attention_out_proj_as_never_called() -> None:
    torch.manual_seed(0)
    model = torchvision.models.vit_b_16().eval()
    report = hookcli.inspect(model, torch.randn(1, 3, 224, 224), device="cpu", topk=0)
    assert "encoder.layers.encoder_layer_0.self_attention.out_proj" in report.never_called
    # MultiheadAttention owns parameters itself, so it is selected and returns (Tensor, None)
    attn = [c for c in report.layers if c.name == "encoder.layers.encoder_layer_0.self_attention"]
    assert [s.path for s in attn[0].outputs] == ["out[0]"]


def test_deeplab_dict_output() -> None:
    report = hookcli.inspect(
        "deeplabv3_mobilenet_v3_large",
        input_specs=["randn:1x3x96x96"],
        device="cpu",
        layers=["classifier"],
        topk=3,
    )
    assert [s.path for s in report.outputs] == ['out["out"]']
    assert report.outputs[0].shape == (1, 21, 96, 96)
    assert report.predictions is not None and len(report.predictions) == 3
    assert (
        report.predictions[0].label == "__background__" or report.predictions[0].label is not None
    )


def test_fasterrcnn_list_of_dicts_with_empty_boxes() -> None:
    report = hookcli.inspect(
        "fasterrcnn_mobilenet_v3_large_320_fpn", [str(CAT)], device="cpu", layers=["roi_heads"]
    )
    paths = {s.path: s for s in report.outputs}
    assert {'out[0]["boxes"]', 'out[0]["labels"]', 'out[0]["scores"]'} <= set(paths)
    boxes = paths['out[0]["boxes"]']
    assert boxes.shape[1:] == (4,)
    if boxes.numel == 0:  # random weights usually detect nothing
        assert boxes.mean is None and boxes.zeros is None
    assert paths['out[0]["labels"]'].dtype == "int64"


def test_inception_v3_runs_at_299() -> None:
    report = hookcli.inspect("inception_v3", [str(CAT)], device="cpu", layers=["Conv2d_1a_3x3"])
    assert report.input.shapes == [(1, 3, 299, 299)]
    assert report.layers[0].outputs[0].shape == (1, 32, 149, 149)
    assert report.predictions is not None and report.predictions[0].label is not None


def test_default_input_is_deterministic_and_stated() -> None:
    a = hookcli.inspect("resnet18", device="cpu", layers=["fc"])
    b = hookcli.inspect("resnet18", device="cpu", layers=["fc"])
    assert "randn 1x3x224x224" in a.input.description
    assert a.layers[0].outputs[0].mean == b.layers[0].outputs[0].mean


def test_predictions_on_the_cat_carry_imagenet_labels_and_a_random_weights_note() -> None:
    report = hookcli.inspect("resnet18", [str(CAT)], device="cpu", layers=["fc"], topk=3)
    assert report.predictions is not None
    assert [p.rank for p in report.predictions] == [1, 2, 3]
    assert all(p.label for p in report.predictions)
    assert abs(sum(p.prob for p in report.predictions)) <= 1.0 + 1e-9
    assert "meaningless" in (report.prediction_note or "")


def test_video_model_on_a_still_image_repeated_as_a_clip() -> None:
    report = hookcli.inspect("r3d_18", [str(CAT)], device="cpu", layers=["stem"], topk=2)
    assert report.input.shapes == [(1, 3, 16, 112, 112)]
    assert "repeated as a clip of 16 frames" in report.input.description
    assert report.layers[0].outputs[0].shape == (1, 64, 16, 56, 56)
    assert report.predictions is not None and report.predictions[0].label


def test_video_model_on_a_folder_in_batches_equals_the_one_batch_run() -> None:
    """A folder run of a video model (--batch-size: the DataLoader's batches) makes each
    image a clip as the one-batch run does (it crashed on the image), and its statistics
    merge to the one-batch run's; an optical-flow model's folder run is refused, exit 2."""
    from tests.support.paths import COFFEE

    images = [str(CAT), str(COFFEE)]
    one = hookcli.inspect("r3d_18", images, device="cpu", layers=["stem"], topk=0)
    batched = hookcli.inspect("r3d_18", images, device="cpu", layers=["stem"], topk=0, batch_size=1)
    a, b = one.layers[0].outputs[0], batched.layers[0].outputs[0]
    assert (a.shape[1:], b.numel) == ((64, 16, 56, 56), a.numel)
    assert b.mean == pytest.approx(a.mean, rel=1e-6) and b.max == a.max
    with pytest.raises(UsageError, match="not a folder's images one by one"):
        hookcli.inspect("raft_small", images, device="cpu", batch_size=2)


def test_optical_flow_takes_two_images_and_reports_every_iteration() -> None:
    from tests.support.paths import COFFEE

    report = hookcli.inspect(
        "raft_small", [str(CAT), str(COFFEE)], device="cpu", layers=["update_block"], topk=0
    )
    assert [c.call for c in report.layers] == list(range(12))  # RAFT's 12 refinement steps
    assert report.input.shapes == [(1, 3, 296, 448), (1, 3, 296, 448)]
    assert len(report.outputs) == 12 and report.outputs[0].shape == (1, 2, 296, 448)
    with pytest.raises(UsageError, match="two images"):
        hookcli.inspect("raft_small", [str(CAT)], device="cpu")


def test_quantized_model_runs_int8_on_the_cpu_and_has_no_gradients() -> None:
    report = hookcli.inspect(
        "quantized_resnet18", [str(CAT)], device="cpu", layers=["layer1.0.conv1"]
    )
    (call,) = report.layers
    assert call.type == "ConvReLU2d"  # fused by quantization; its output is int8
    assert call.outputs[0].dtype == "quint8" and "dequantized" in (call.outputs[0].note or "")
    assert call.outputs[0].std is not None and call.outputs[0].std > 0
    with pytest.raises(UsageError, match="no autograd"):
        hookcli.grads("quantized_resnet18", device="cpu")


def test_repeated_runs_do_not_grow_memory_or_leave_hooks() -> None:
    import tracemalloc

    model = Aliased()
    x = torch.randn(4, 3)
    for _ in range(5):
        hookcli.inspect(model, x, device="cpu")
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for _ in range(100):
        hookcli.inspect(model, x, device="cpu")
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert grown < 200_000, grown
    assert hooks_left(model) == 0
