"""hookcli diff (issue 10): per-layer differences against a hand computation on captured
tensors, the first divergence named, isolated vs accumulated error, CLI contract."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from hookcli.cli import app
from hookcli.commands.diff import diff_report, parse_side
from hookcli.errors import UsageError
from hookcli.options import InputOptions, ModelOptions, Selection
from hookcli.records import DiffReport
from tests.support.cli import assert_one_line_error
from tests.support.diff import (
    CHAIN,
    assert_differences,
    chain_model,
    differences_by_hand,
    leaf_inputs,
    leaf_outputs,
    quantized_twins,
)
from tests.support.images import make_folder
from tests.support.paths import CAT

pytestmark = pytest.mark.kernels  # the second CI pass reruns these on generic x86-64

runner = CliRunner()


def _chain_report(**kw: Any) -> DiffReport:
    return diff_report(
        ModelOptions(CHAIN, device="cpu"),
        Selection(),
        InputOptions(specs=("randn:8x16",)),
        parse_side("float32", "--a"),
        parse_side(kw.pop("b", "bfloat16"), "--b"),
        **kw,
    )


def test_accumulated_differences_equal_a_hand_computation() -> None:
    report = _chain_report()
    a_model, xa = chain_model(torch.float32)
    b_model, xb = chain_model(torch.bfloat16)
    ref, got = leaf_outputs(a_model, xa), leaf_outputs(b_model, xb)
    rows = {c.name: c.b[0] for c in report.calls}
    assert [(c.name, c.call) for c in report.calls] == [
        ("l1", 0), ("act", 0), ("l2", 0), ("act", 1), ("l3", 0), ("act", 2), ("l4", 0)
    ]  # fmt: skip
    for name in ("l1", "l2", "l3", "l4"):
        assert_differences(rows[name], differences_by_hand(ref[name], got[name].float()))
    assert_differences(
        report.outputs[0].b[0], differences_by_hand(ref["(model)"], got["(model)"].float())
    )


def test_isolated_differences_equal_each_layer_fed_the_reference_input() -> None:
    report = _chain_report(isolate=True)
    a_model, xa = chain_model(torch.float32)
    b_model, _ = chain_model(torch.bfloat16)
    ins = leaf_inputs(a_model, xa)
    ref = leaf_outputs(a_model, xa)
    fed = {n: t.to(torch.bfloat16) for n, t in ins.items()}
    got = leaf_outputs(b_model, xa.to(torch.bfloat16), feed=fed)
    for c in report.calls:
        if c.name.startswith("l"):
            assert_differences(c.b[0], differences_by_hand(ref[c.name], got[c.name].float()))


def test_isolate_separates_own_error_from_accumulated_error() -> None:
    acc = {c.name: c.b[0].rel_l2 for c in _chain_report().calls if c.name.startswith("l")}
    own = {
        c.name: c.b[0].rel_l2 for c in _chain_report(isolate=True).calls if c.name.startswith("l")
    }
    assert acc["l1"] == pytest.approx(own["l1"])  # the first layer inherits nothing
    for name in ("l2", "l3", "l4"):
        assert own[name] is not None and acc[name] is not None
        assert own[name] < acc[name], (name, own, acc)
    assert all(0 < v < 0.02 for v in own.values())  # bfloat16's own rounding, ~2^-9


def test_one_lossy_layer_is_named_as_the_first_divergence(tmp_path: Path) -> None:
    """Side B's weights differ from A's in layer l3 only (a fine-tuned or corrupted layer)."""
    model, _ = chain_model(torch.float32)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["l3.weight"] += 0.05 * torch.randn_like(state["l3.weight"])
    path = tmp_path / "b.pt"
    torch.save(state, path)
    report = _chain_report(b=f"weights={path}")
    rows = {c.name: c.b[0] for c in report.calls}
    assert rows["l1"].rel_l2 == 0 and rows["l2"].rel_l2 == 0 and not rows["l2"].over
    assert rows["l3"].over and rows["l4"].over
    assert report.first_over is not None and report.first_over.startswith("l3 (Linear) call 0")


def test_ref_float64_says_which_side_is_wrong() -> None:
    report = diff_report(
        ModelOptions(CHAIN, device="cpu"),
        Selection(layers=("l*",)),
        InputOptions(specs=("randn:8x16",)),
        parse_side("float32", "--a"),
        parse_side("bfloat16", "--b"),
        ref=parse_side("float64", "--ref"),
    )
    assert report.ref == "float64"
    for c in report.calls:
        assert c.a is not None
        a, b = c.a[0].rel_l2, c.b[0].rel_l2
        assert a is not None and b is not None and a < 1e-5 < b  # float32 is right, bf16 is off


def test_identical_sides_show_no_difference_and_exit_0() -> None:
    r = runner.invoke(app, ["diff", CHAIN, "--input", "randn:4x16", "--b", "float32", "-f", "json"])
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["first_over"] is None
    for c in data["calls"]:
        d = c["b"][0]
        assert d["rel_l2"] == 0 and d["max_abs"] == 0 and d["sqnr_db"] is None


def test_cli_exit_1_past_tol_and_every_format(tmp_path: Path) -> None:
    args = ["diff", CHAIN, "--input", "randn:4x16", "--b", "bfloat16", "--tol", "1e-3"]
    r = runner.invoke(app, [*args, "-f", "json"])
    assert r.exit_code == 1  # an explicit --tol wins over bfloat16's default
    data = json.loads(r.stdout)
    assert data["first_over"].startswith("l1 (Linear)")
    assert (data["tol"], data["tol_source"]) == (1e-3, "--tol")
    assert "first past tolerance: l1" in r.stderr
    assert runner.invoke(app, [*args, "--tol", "0.5"]).exit_code == 0
    table = runner.invoke(app, args, env={"COLUMNS": "120"})
    assert table.exit_code == 1 and "first past tolerance: l1 (Linear)" in table.stdout
    csv_out = runner.invoke(app, [*args, "-f", "csv"])
    assert csv_out.stdout.splitlines()[0].startswith("layer,type,call,side,path")
    md = runner.invoke(app, [*args, "-f", "markdown"])
    assert "| layer |" in md.stdout


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["diff", CHAIN, "--input", "randn:4x16"], ["needs side B", "--b"]),
        (["diff", CHAIN, "--input", "randn:4x16", "--b", "float13"], ["'float13' is not a side"]),
        (["diff", CHAIN, "--input", "randn:4x16", "--b", "bfloat16", "--tol", "-1"], ["--tol"]),
        (["diff", "a.json"], ["exactly two JSON files"]),
    ],
)
def test_cli_bad_input(args: list[str], needles: list[str]) -> None:
    assert_one_line_error(runner.invoke(app, args), 2, *needles)


def test_two_saved_reports(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    base = ["inspect", CHAIN, "--input", "randn:4x16", "-f", "json"]
    assert runner.invoke(app, [*base, "-o", str(a)]).exit_code == 0
    assert runner.invoke(app, [*base, "--seed", "1", "-o", str(b)]).exit_code == 0
    r = runner.invoke(app, ["diff", str(a), str(b), "-f", "json"])
    assert r.exit_code == 1, r.stderr
    data = json.loads(r.stdout)

    def norms(path: Path) -> dict[tuple[str, int], float]:
        layers = json.loads(path.read_text())["layers"]
        return {(c["name"], c["call"]): c["outputs"][0]["norm"] for c in layers}

    old, new = norms(a), norms(b)
    assert len(data["calls"]) == len(old) == 7
    for c in data["calls"]:
        key = (c["name"], c["call"])
        want = (new[key] - old[key]) / old[key]  # signed: below 0 when B's norm is smaller
        assert c["b"][0]["norm_rel"] == pytest.approx(want)
    assert {c["b"][0]["norm_rel"] > 0 for c in data["calls"]} == {True, False}  # both signs
    same = runner.invoke(app, ["diff", str(a), str(a)])
    assert same.exit_code == 0 and "no call past tolerance" in same.stdout
    kept = a.read_bytes()
    r = runner.invoke(app, ["diff", str(a), str(b), "-o", str(a)])
    assert_one_line_error(r, 2, "also an input of this run")
    assert a.read_bytes() == kept
    # an option that runs a model would be ignored: refused, named
    r = runner.invoke(app, ["diff", str(a), str(b), "--b", "float64", "-l", "nope", "--seed", "5"])
    assert_one_line_error(r, 2, "compared as they were written", "--b, --layer, --seed run")
    r = runner.invoke(app, ["diff", str(a), str(b), "--weights", "missing.pt"])
    assert_one_line_error(r, 2, "--weights runs a model", "drop it")


def test_a_folder_in_batches_equals_one_batch(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "data", 6, size=64)
    common = {"a": parse_side("float32", "--a"), "b": parse_side("bfloat16", "--b")}
    sel = Selection(layers=("layer1.0.*", "fc"))
    model = ModelOptions("resnet18", device="cpu")
    whole = diff_report(model, sel, InputOptions((str(folder),)), batch_size=6, **common)
    parts = diff_report(model, sel, InputOptions((str(folder),)), batch_size=4, **common)
    assert "6 images" in parts.input.description
    for w, p in zip(whole.calls, parts.calls, strict=True):
        assert (w.name, w.call) == (p.name, p.call)
        for key in ("rel_l2", "cosine", "sqnr_db", "max_abs"):
            assert getattr(p.b[0], key) == pytest.approx(getattr(w.b[0], key), rel=1e-6), key


def test_isolate_on_a_real_network_and_channels_last() -> None:
    report = diff_report(
        ModelOptions("resnet18", device="cpu"),
        Selection(layers=("layer1.0.conv1", "layer1.0.bn1")),
        InputOptions((str(CAT),)),
        parse_side("float32", "--a"),
        parse_side("channels_last", "--b"),
        tol=1e-4,
    )
    for c in report.calls:  # the same math in another memory layout: float rounding only
        assert c.b[0].rel_l2 is not None and c.b[0].rel_l2 < 1e-5


def test_side_grammar() -> None:
    s = parse_side("float16, channels_last,weights=x.pt,seed=3", "--b")
    assert (s.dtype, s.channels_last, s.weights, s.seed) == (torch.float16, True, "x.pt", 3)
    assert parse_side("autocast", "--b").autocast == torch.bfloat16
    with pytest.raises(UsageError):
        parse_side("seed=x", "--b")


def test_the_spill_keeps_nothing_in_memory() -> None:
    from hookcli.commands.diff.measure import Spill

    spill = Spill()
    try:
        t = torch.randn(1000)
        spill.write(("x", 0, "out"), t)
        del t
        got = spill.read(("x", 0, "out"))
        assert got is not None and got.shape == (1000,)
        assert os.fstat(spill.fd).st_size == 4000  # unlinked at once: only the fd reaches it
        assert math.isfinite(float(np.asarray(got).sum()))
    finally:
        spill.close()
    assert not Path(spill.path).exists()


def test_quantized_twin_equals_a_hand_built_int8_model() -> None:
    """--b quantized: torchvision's quantizable resnet18 with A's weights, fused, calibrated on
    the input and converted; the model output's difference equals one computed by hand."""
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    report = diff_report(
        ModelOptions("resnet18", device="cpu"),
        Selection(layers=("layer1.0.conv1", "fc")),
        InputOptions(specs=("randn:1x3x64x64",)),
        parse_side("float32", "--a"),
        parse_side("quantized", "--b"),
    )
    rows = {c.name: c.b[0] for c in report.calls}
    assert set(rows) == {"layer1.0.conv1", "fc"}
    assert all(0.001 < (d.rel_l2 or 0) < 0.2 for d in rows.values())  # int8: ~1-3 %
    twin, int8 = quantized_twins(x)
    with torch.no_grad():
        want = differences_by_hand(twin(x), int8(x))
    assert_differences(report.outputs[0].b[0], want)


def test_compiled_layers_are_measured_outside_the_compiled_code() -> None:
    """--b compile: the selected leaves' forwards go through torch.compile while hookcli's hooks
    stay eager, so every row is a real measurement (numel counted, reference read back)."""
    report = diff_report(
        ModelOptions(CHAIN, device="cpu"),
        Selection(layers=("l2",)),
        InputOptions(specs=("randn:8x16",)),
        parse_side("float32", "--a"),
        parse_side("compile", "--b"),
        tol=1e-4,
    )
    (row,) = [c.b[0] for c in report.calls]
    assert row.numel == 128 and row.note is None
    assert row.rel_l2 is not None and row.rel_l2 < 1e-5 and row.cosine == pytest.approx(1.0)


def test_python_api_leaves_the_users_module_as_it_was() -> None:
    import hookcli

    model, x = chain_model(torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    d = hookcli.diff(model, x, b="bfloat16", isolate=True, layers=["l*"])
    assert [c.name for c in d.calls] == ["l1", "l2", "l3", "l4"]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not model._forward_hooks and not model.l1._forward_pre_hooks


def test_onnx_side_equals_onnx_runtime_run_by_hand() -> None:
    """--b onnx: the model output's difference equals torch vs ONNX Runtime computed here, and
    every module call is found in the graph, float32 rounding apart."""
    import onnxruntime

    report = _chain_report(b="onnx")
    assert [(c.name, c.call) for c in report.calls] == [
        ("l1", 0), ("act", 0), ("l2", 0), ("act", 1), ("l3", 0), ("act", 2), ("l4", 0)
    ]  # fmt: skip
    assert all(c.b[0].rel_l2 is not None and c.b[0].rel_l2 < 1e-5 for c in report.calls)
    model, x = chain_model(torch.float32)
    program = torch.onnx.export(model, (x,), dynamo=True, optimize=False)
    assert program is not None
    session = onnxruntime.InferenceSession(
        program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        want = model(x)
    assert_differences(report.outputs[0].b[0], differences_by_hand(want, torch.from_numpy(got)))


def test_onnx_graph_calls_of_a_module_called_twice() -> None:
    """ResNet's BasicBlock calls `relu` twice: two runs of nodes, calls 0 and 1, as the hooks
    number them; a container's call ends at the value it hands on."""
    import torchvision

    from hookcli.commands.diff.onnx import call_outputs

    model = torchvision.models.resnet18().eval()
    program = torch.onnx.export(model, (torch.randn(1, 3, 64, 64),), dynamo=True, optimize=False)
    assert program is not None
    graph = program.model_proto.graph
    calls = call_outputs(graph, {"layer1.0.relu", "layer1.0", "fc"})
    assert [(n, c) for n, c, _ in calls] == [
        ("layer1.0.relu", 0), ("layer1.0.relu", 1), ("layer1.0", 0), ("fc", 0)
    ]  # fmt: skip
    assert calls[1][2] == calls[2][2]  # the block's output is its second relu's
    assert calls[3][2] == [graph.output[0].name]


def test_onnx_side_refuses_isolate_and_the_reference_role() -> None:
    args = ["diff", CHAIN, "--input", "randn:4x16"]
    r = runner.invoke(app, [*args, "--b", "onnx", "--isolate"])
    assert_one_line_error(r, 2, "--isolate cannot feed layers inside ONNX Runtime")
    r = runner.invoke(app, [*args, "--a", "onnx", "--b", "float32"])
    assert_one_line_error(r, 2, "cannot be the reference")


def test_autocast_side_runs_linear_layers_in_bfloat16() -> None:
    report = _chain_report(b="autocast")
    rows = {(c.name, c.call): c.b[0] for c in report.calls}
    model, x = chain_model(torch.float32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = leaf_outputs(model, x)
    ref = leaf_outputs(chain_model(torch.float32)[0], x)
    assert_differences(rows[("l1", 0)], differences_by_hand(ref["l1"], got["l1"].float()))
    assert rows[("l1", 0)].rel_l2 is not None and rows[("l1", 0)].rel_l2 > 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channels_last_sums_equal_the_contiguous_ones(dtype: torch.dtype) -> None:
    """The kernel that reads a channels-last tensor in its own order pairs the same elements
    as the flat one on a contiguous copy, and both equal float64 torch."""
    from hookcli.commands.diff.measure import sums

    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 8, 5, 7, generator=g)
    b = (a + 1e-3 * torch.randn(a.shape, generator=g)).to(dtype)
    b[0, 3, 2, 1] = float("nan")
    nhwc = sums(a.numpy(), b.contiguous(memory_format=torch.channels_last))
    flat = sums(a.numpy(), b.contiguous())
    np.testing.assert_allclose(nhwc, flat, rtol=1e-12)
    finite = torch.isfinite(b.double())
    d = torch.where(finite, b.double() - a.double(), 0.0)
    assert nhwc[0] == pytest.approx(float(d.square().sum()), rel=1e-12)
    assert nhwc[4] == pytest.approx(float(d.abs().max()), rel=1e-12)
    assert nhwc[5] == 1


def test_each_side_gets_the_original_input_not_the_references_cast() -> None:
    """--a bfloat16 --b float32: side B runs on the float32 input itself, not on the input
    after rounding it to the reference side's bfloat16."""
    report = diff_report(
        ModelOptions(CHAIN, device="cpu"),
        Selection(layers=("l1",)),
        InputOptions(specs=("randn:8x16",)),
        parse_side("bfloat16", "--a"),
        parse_side("float32", "--b"),
    )
    a_model, xa = chain_model(torch.bfloat16)
    b_model, xb = chain_model(torch.float32)
    ref, got = leaf_outputs(a_model, xa), leaf_outputs(b_model, xb)
    assert_differences(report.calls[0].b[0], differences_by_hand(ref["l1"].float(), got["l1"]))
