"""hookcli diff on fused models and diff triage (issue 16, items 1 and 2): fused units compared
as one, Identity rows left by fusion marked, the default tolerance from the sides' precision,
each layer's own error, rows sorted, prediction agreement and the signed norm change, each
against a hand computation on the two sides' tensors."""

from __future__ import annotations

import copy
import csv
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from hookcli.cli import app
from hookcli.commands.diff import diff_report, parse_side
from hookcli.commands.diff.tolerance import PRECISIONS, default_tol
from hookcli.options import InputOptions, ModelOptions, Selection
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
from tests.support.oracles import captured_outputs
from tests.support.paths import CAT

pytestmark = pytest.mark.kernels  # the second CI pass reruns these on generic x86-64

runner = CliRunner()


def _json(*args: str, code: int = 0) -> dict[str, Any]:
    r = runner.invoke(app, ["diff", *args, "-f", "json"])
    assert r.exit_code == code, (r.exit_code, r.stderr)
    data: dict[str, Any] = json.loads(r.stdout)
    return data


def _rows(data: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(c["name"], c["call"]): c for c in data["calls"]}


def _weights(tmp_path: Path, **scale: float) -> str:
    """Chain's weights (seed 0) with the named layers' weights and biases multiplied: their
    outputs multiplied by k."""
    model, _ = chain_model(torch.float32)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for layer, k in scale.items():
        state[f"{layer}.weight"] *= k
        state[f"{layer}.bias"] *= k
    path = tmp_path / "b.pt"
    torch.save(state, path)
    return str(path)


# ---------------------------------------------------------------- 1. fused models


def test_quantized_resnet18_compares_every_conv_as_the_fused_unit(tmp_path: Path) -> None:
    """Default selection: A's fused ConvReLU2d container `conv1` against B's one int8
    module `conv1`, every conv of layer1 measured, `fc` too; nothing only on one side."""
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    given = tmp_path / "x.pt"
    torch.save(x, given)
    data = _json("resnet18", "--input", str(given), "--b", "quantized", "--device", "cpu")
    rows = _rows(data)
    convs = ["layer1.0.conv1", "layer1.0.conv2", "layer1.1.conv1", "layer1.1.conv2"]
    for name in [*convs, "conv1", "fc"]:
        d = rows[(name, 0)]["b"][0]
        assert d["note"] is None and d["rel_l2"] is not None and d["numel"] > 0, (name, d)
    assert not any(".conv1.0" in n or ".conv1.1" in n or "_packed" in n for n, _ in rows)
    assert data["missing"] == []  # `fc call 0` and the fused convs' insides were missing
    # the rows are A's fused unit against B's int8 module, as computed by hand
    twin, int8 = quantized_twins(x)
    names = ["conv1", *convs, "fc"]
    a, b = captured_outputs(twin, x, names), captured_outputs(int8, x, names)
    for name in names:
        got = rows[(name, 0)]["b"][0]
        for key, want in differences_by_hand(a[name], b[name]).items():
            assert got[key] == pytest.approx(want, rel=1e-6), (name, key)
    # the type column: A's type, and B's when it differs
    assert (rows[("conv1", 0)]["type"], rows[("conv1", 0)]["type_b"]) == (
        "ConvReLU2d",
        "QuantizedConvReLU2d",
    )
    assert (rows[("fc", 0)]["type"], rows[("fc", 0)]["type_b"]) == ("Linear", "QuantizedLinear")
    assert rows[("maxpool", 0)]["type_b"] is None
    # Identity rows fusion left: marked, no numbers, never over
    fused = {n: c["fused_into"] for (n, _), c in rows.items() if c["fused_into"]}
    assert fused["bn1"] == fused["relu"] == "conv1"
    assert fused["layer1.0.bn2"] == "layer1.0.conv2"
    assert fused["layer2.0.downsample.1"] == "layer2.0.downsample.0"
    assert len(fused) == 2 + 8 * 3 + 3  # bn1, relu; each block's bn1, relu, bn2; downsamples
    for name, into in fused.items():
        (d,) = rows[(name, 0)]["b"]
        assert d["rel_l2"] is None and not d["over"] and d["note"] == f"fused into {into}"
    assert (rows[("conv1", 0)]["fused_into"], rows[("quant", 0)]["fused_into"]) == (None, None)


def test_identity_rows_are_never_first_past_tolerance() -> None:
    """bn1 and relu return before layer1.0.conv1; past a tolerance every measured row
    exceeds, the first named is still the conv, and the table says what they were fused into."""
    args = ["resnet18", "--input", "randn:1x3x32x32", "--b", "quantized", "--device", "cpu"]
    sel = ["-l", "bn1", "-l", "relu", "-l", "layer1.0.conv1", "--tol", "1e-9"]
    data = _json(*args, *sel, code=1)
    assert [c["name"] for c in data["calls"]] == ["bn1", "relu", "layer1.0.conv1"]
    assert data["first_over"].startswith("layer1.0.conv1 (ConvReLU2d) call 0")
    table = runner.invoke(app, ["diff", *args, *sel])
    assert table.exit_code == 1
    assert re.search(r"^bn1\s*\|\s*Identity\s*\|.*\|\s*fused into conv1\s*$", table.stdout, re.M)
    assert re.search(r"ConvReLU2d / QuantizedConvReLU2d", table.stdout)


# ---------------------------------------------------------------- 2. the default tolerance


def test_default_tol_comes_from_the_coarsest_sides_precision() -> None:
    def tol_of(*sides: str) -> float:
        return default_tol(p for s in sides for p in parse_side(s, "--b").precisions)[0]

    assert tol_of("float32", "channels_last") == 1e-3
    assert tol_of("float32", "float16") == 4e-3
    assert tol_of("float32", "bfloat16") == tol_of("float64", "autocast:bfloat16") == 3e-2
    assert tol_of("float32", "quantized") == tol_of("bfloat16", "quantized") == 1e-1
    for name, u in (("float16", 2.0**-11), ("bfloat16", 2.0**-8)):  # 8 unit roundoffs
        assert PRECISIONS[name].tol == pytest.approx(8 * u, rel=0.25)
    report = diff_report(
        ModelOptions(CHAIN, device="cpu"),
        Selection(),
        InputOptions(specs=("randn:8x16",)),
        parse_side("float32", "--a"),
        parse_side("float16", "--b"),
    )
    assert report.tol == 4e-3 and report.tol_source.startswith("default for float16")
    assert any(n.startswith("tol 0.004: default for float16") for n in report.notes)


def test_bf16_resnet18_on_the_cat_passes_on_rounding_and_fails_on_a_fault() -> None:
    """bfloat16's own rounding stays under its default tolerance; another seed's weights (a
    real fault) on the same bfloat16 side is past it. Both report top-1 agreement."""
    rounding = _json("resnet18", str(CAT), "--b", "bfloat16")
    assert rounding["first_over"] is None and rounding["tol"] == 3e-2
    assert "bfloat16" in rounding["tol_source"]
    worst = max(d["rel_l2"] for c in rounding["calls"] for d in c["b"] if d["rel_l2"] is not None)
    assert 1e-3 < worst < rounding["tol"]  # past the old 1e-3 default, which flagged every row
    agree = rounding["agreement"]["B"]
    assert (agree["images"], agree["top1_same"], agree["top1_flips"]) == (1, 1, 0)
    assert agree["flipped"] == [] and agree["against"] == "A"
    fault = _json("resnet18", str(CAT), "--b", "bfloat16,seed=1", "-l", "conv1", code=1)
    assert fault["first_over"].startswith("conv1 (Conv2d) call 0")
    assert fault["agreement"]["B"]["images"] == 1


# ---------------------------------------------------------------- prediction agreement


def test_prediction_agreement_equals_a_hand_computation_from_both_sides_logits(
    tmp_path: Path,
) -> None:
    """Side B: resnet18 with noise on fc's weights, over 8 images; top-1 flips (which images)
    and the mean top-5 overlap equal those of the two models' logits computed here."""
    from hookcli.sources import load_model

    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    torch.save(x, tmp_path / "x.pt")
    model_a = load_model("resnet18", seed=0).module.eval()
    state = {k: v.clone() for k, v in model_a.state_dict().items()}
    noise = torch.randn(state["fc.weight"].shape, generator=torch.Generator().manual_seed(1))
    state["fc.weight"] += 0.005 * noise
    torch.save(state, tmp_path / "b.pt")
    model_b = copy.deepcopy(model_a)
    model_b.load_state_dict(state)
    with torch.no_grad():
        la, lb = model_a(x).double(), model_b(x).double()
    top_a, top_b = la.topk(5, dim=1).indices, lb.topk(5, dim=1).indices
    flips = [i for i in range(8) if top_a[i, 0] != top_b[i, 0]]
    overlap = sum(len(set(top_a[i].tolist()) & set(top_b[i].tolist())) / 5 for i in range(8)) / 8
    assert 0 < len(flips) < 8 and 0 < overlap < 1  # the case tells both apart

    args = ["resnet18", "--input", str(tmp_path / "x.pt"), "--b", f"weights={tmp_path / 'b.pt'}"]
    data = _json(*args, "-l", "fc", "--tol", "1", "--no-own")
    agree = data["agreement"]["B"]
    assert (agree["images"], agree["top1_flips"], agree["top1_same"]) == (
        8,
        len(flips),
        8 - len(flips),
    )
    assert [f["index"] for f in agree["flipped"]] == flips
    assert [(f["ref"], f["side"]) for f in agree["flipped"]] == [
        (int(top_a[i, 0]), int(top_b[i, 0])) for i in flips
    ]
    assert agree["topk"] == 5 and agree["topk_overlap"] == pytest.approx(overlap, abs=1e-12)
    table = runner.invoke(app, ["diff", *args, "-l", "fc", "--tol", "1"])
    assert f"top-1 flipped on {len(flips)} of 8 images; top-5 overlap" in table.stdout
    shown = f"flipped: image {flips[0]}: {int(top_a[flips[0], 0])} ("  # then its label
    assert shown in table.stdout and f"-> {int(top_b[flips[0], 0])} (" in table.stdout


def test_no_agreement_without_class_scores_or_with_isolate() -> None:
    """A user's model (Chain) is not known to return class scores: no agreement; a classifier
    fed the reference's inputs (--isolate) has no predictions of its own: none, and a note."""
    assert _json(CHAIN, "--input", "randn:4x16", "--b", "float64")["agreement"] is None
    iso = _json("resnet18", "--input", "randn:1x3x32x32", "--b", "float64", "-l", "fc", "--isolate")
    assert iso["agreement"] is None
    assert any(n.startswith("predictions not compared") for n in iso["notes"])
    plain = _json("resnet18", "--input", "randn:1x3x32x32", "--b", "float64", "-l", "fc")
    assert plain["agreement"]["B"]["top1_same"] == 1


# ---------------------------------------------------------------- the signed norm change


def test_norm_change_keeps_its_sign(tmp_path: Path) -> None:
    """B's l1 output times 1.5 (grows), l3's times 0.25 (shrinks): norm_rel is
    (‖B‖-‖A‖)/‖A‖ of the captured tensors, with its sign, in JSON, CSV and the table."""
    path = _weights(tmp_path, l1=1.5, l3=0.25)
    args = ["diff", CHAIN, "--input", "randn:8x16", "--b", f"weights={path}", "--tol", "1"]
    data = json.loads(runner.invoke(app, [*args, "-f", "json"]).stdout)
    model_a, x = chain_model(torch.float32)
    model_b, _ = chain_model(torch.float32)
    model_b.load_state_dict(torch.load(path, weights_only=True))
    a, b = leaf_outputs(model_a, x), leaf_outputs(model_b, x)
    rows = {c["name"]: c["b"][0] for c in data["calls"] if c["call"] == 0}
    for name in ("l1", "l2", "l3", "l4"):
        na, nb = a[name].double().norm(), b[name].double().norm()
        assert rows[name]["norm_rel"] == pytest.approx(float((nb - na) / na), rel=1e-9), name
    assert rows["l1"]["norm_rel"] > 0.4 and rows["l3"]["norm_rel"] < -0.5
    out = runner.invoke(app, [*args, "-f", "csv"]).stdout
    by_layer = {(r["layer"], r["call"]): r for r in csv.DictReader(io.StringIO(out))}
    assert float(by_layer[("l3", "0")]["norm_rel"]) == pytest.approx(rows["l3"]["norm_rel"])
    table = runner.invoke(app, args).stdout
    l1 = next(line for line in table.splitlines() if line.startswith("l1 "))
    assert re.search(rf"\|\s*\+{rows['l1']['norm_rel']:.4g}\s*\|", l1), l1
    l3 = next(line for line in table.splitlines() if line.startswith("l3 "))
    assert re.search(rf"\|\s*{re.escape(format(rows['l3']['norm_rel'], '+.4g'))}\s*\|", l3), l3


# ---------------------------------------------------------------- own error, sorting


def test_own_error_equals_each_layer_fed_the_reference_input() -> None:
    """Without --isolate the rows stay accumulated and `own_rel_l2` comes from a second pass:
    each layer run by hand on A's input to it, in bfloat16."""
    report = diff_report(
        ModelOptions(CHAIN, device="cpu"),
        Selection(),
        InputOptions(specs=("randn:8x16",)),
        parse_side("float32", "--a"),
        parse_side("bfloat16", "--b"),
    )
    a_model, xa = chain_model(torch.float32)
    b_model, xb = chain_model(torch.bfloat16)
    ref = leaf_outputs(a_model, xa)
    acc = leaf_outputs(b_model, xb)
    fed = {n: t.to(torch.bfloat16) for n, t in leaf_inputs(a_model, xa).items()}
    own = leaf_outputs(b_model, xb, feed=fed)
    for c in report.calls:
        if c.call == 0 and c.name.startswith("l"):
            assert_differences(
                c.b[0], differences_by_hand(ref[c.name], acc[c.name].float())
            )  # accumulated rows
            want = differences_by_hand(ref[c.name], own[c.name].float())["rel_l2"]
            assert c.b[0].own_rel_l2 == pytest.approx(want, rel=1e-9), c.name
    l4 = next(c.b[0] for c in report.calls if c.name == "l4")
    assert l4.own_rel_l2 is not None and l4.rel_l2 is not None and l4.own_rel_l2 < l4.rel_l2
    assert report.outputs[0].b[0].own_rel_l2 is None


def test_largest_own_error_names_the_one_changed_layer(tmp_path: Path) -> None:
    """B's weights differ in l3 only: accumulated error runs from l3 to the end, but only l3
    has an own error, so the summary lists l3 and nothing else."""
    path = _weights(tmp_path, l3=1.1)
    data = _json(CHAIN, "--input", "randn:8x16", "--b", f"weights={path}", code=1)
    rows = _rows(data)
    assert rows[("l4", 0)]["b"][0]["rel_l2"] > 0 and rows[("l4", 0)]["b"][0]["own_rel_l2"] == 0
    (top,) = data["largest_own"]
    assert (top["name"], top["call"], top["side"], top["type"]) == ("l3", 0, "B", "Linear")
    assert top["own_rel_l2"] == pytest.approx(rows[("l3", 0)]["b"][0]["own_rel_l2"])
    assert top["own_rel_l2"] == pytest.approx(0.1, rel=1e-5)  # l3's output times 1.1
    table = runner.invoke(app, ["diff", CHAIN, "--input", "randn:8x16", "--b", f"weights={path}"])
    assert "largest own error (relative L2, each layer fed A's input):" in table.stdout
    assert re.search(
        r"^  1\. l3 \(Linear\) call 0: 0\.\d+ \(accumulated 0\.\d+\)$", table.stdout, re.M
    )


def test_rows_sort_by_accumulated_or_own_error() -> None:
    args = [CHAIN, "--input", "randn:8x16", "--b", "bfloat16"]
    order = _json(*args)
    assert [(c["name"], c["call"]) for c in order["calls"]] == [
        ("l1", 0), ("act", 0), ("l2", 0), ("act", 1), ("l3", 0), ("act", 2), ("l4", 0)
    ]  # fmt: skip
    values = {(c["name"], c["call"]): c["b"][0] for c in order["calls"]}
    for sort, key in (("error", "rel_l2"), ("own", "own_rel_l2")):
        data = _json(*args, "--sort", sort)
        assert data["sort"] == sort
        got = [(c["name"], c["call"]) for c in data["calls"]]
        want = sorted(values, key=lambda k: -values[k][key])
        assert got == want, sort
        assert [c["b"][0] for c in data["calls"]] == [values[k] for k in want]  # same rows
        table = runner.invoke(app, ["diff", *args, "--sort", sort]).stdout
        shown = [
            ln.split("|")[0].strip() for ln in table.splitlines() if re.match(r"^(l\d|act) ", ln)
        ]
        assert shown == [n for n, _ in want]
    assert _json(*args, "--sort", "error")["calls"] != _json(*args, "--sort", "own")["calls"]


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--sort", "size"], ["--sort 'size' is not an order", "order", "error", "own"]),
        (["--sort", "own", "--no-own"], ["--sort own needs each layer's own error", "--no-own"]),
        (["--b", "onnx", "--sort", "own"], ["--sort own", "--isolate cannot feed layers"]),
    ],
)
def test_bad_sort_is_a_one_line_error(extra: list[str], needles: list[str]) -> None:
    args = ["diff", CHAIN, "--input", "randn:4x16", "--b", "bfloat16", *extra]
    assert_one_line_error(runner.invoke(app, args), 2, *needles)


def test_onnx_side_says_its_own_error_is_not_measured() -> None:
    data = _json(CHAIN, "--input", "randn:4x16", "--b", "onnx")
    assert all(d["own_rel_l2"] is None for c in data["calls"] for d in c["b"])
    assert data["largest_own"] == []
    assert any(n.startswith("own error not measured for side B") for n in data["notes"])


# ---------------------------------------------------------------- saved reports, JSON


def test_saved_reports_sort_and_take_their_dtypes_tolerance(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    base = ["inspect", CHAIN, "--input", "randn:4x16", "-f", "json"]
    assert runner.invoke(app, [*base, "-o", str(a)]).exit_code == 0
    assert runner.invoke(app, [*base, "--seed", "1", "-o", str(b)]).exit_code == 0
    data = _json(str(a), str(b), "--sort", "error", code=1)
    assert (data["tol"], data["sort"], data["agreement"]) == (1e-3, "error", None)
    changes = [abs(c["b"][0]["norm_rel"]) for c in data["calls"]]
    assert changes == sorted(changes, reverse=True) and len(set(changes)) > 1
    bf = json.loads(a.read_text())
    for c in bf["layers"]:
        for t in c["outputs"]:
            t["dtype"] = "bfloat16"
    a.write_text(json.dumps(bf))
    assert _json(str(a), str(a))["tol"] == 3e-2
    r = runner.invoke(app, ["diff", str(a), str(b), "--sort", "own"])
    assert_one_line_error(r, 2, "two saved reports do not hold")


def test_saved_classifier_reports_compare_their_predictions(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    base = ["inspect", "resnet18", "--input", "randn:3x3x32x32", "-l", "fc", "-f", "json"]
    assert runner.invoke(app, [*base, "-o", str(a)]).exit_code == 0
    assert runner.invoke(app, [*base, "--seed", "1", "-o", str(b)]).exit_code == 0

    def tops(path: Path) -> dict[int, list[int]]:
        found: dict[int, list[tuple[int, int]]] = {}
        for p in json.loads(path.read_text())["predictions"]:
            found.setdefault(p["image"], []).append((p["rank"], p["index"]))
        return {i: [k for _, k in sorted(ps)] for i, ps in found.items()}

    ta, tb = tops(a), tops(b)
    agree = _json(str(a), str(b), code=1)["agreement"]["B"]
    flips = [i for i in ta if ta[i][0] != tb[i][0]]
    overlap = sum(len(set(ta[i][:5]) & set(tb[i][:5])) / 5 for i in ta) / len(ta)
    assert (agree["images"], agree["top1_flips"]) == (3, len(flips))
    assert [f["index"] for f in agree["flipped"]] == flips
    assert agree["topk_overlap"] == pytest.approx(overlap)


def test_the_json_carries_the_new_fields() -> None:
    data = _json(CHAIN, "--input", "randn:4x16", "--b", "float16", "--sort", "error")
    assert {"tol_source", "sort", "agreement", "largest_own"} <= set(data)
    call = data["calls"][0]
    assert {"type_b", "fused_into"} <= set(call) and "own_rel_l2" in call["b"][0]
    assert len(data["largest_own"]) == 5
    entry = data["largest_own"][0]
    assert set(entry) == {"name", "call", "type", "side", "path", "own_rel_l2", "rel_l2"}
    owns = [e["own_rel_l2"] for e in data["largest_own"]]
    assert owns == sorted(owns, reverse=True)
    every = sorted((d["own_rel_l2"] for c in data["calls"] for d in c["b"]), reverse=True)
    assert owns == every[:5]
