"""Answers, not tables (issue 16): check's failures as objects with their reasons on stderr,
--min-std, the first vanishing/exploding gradient, a baseline that notes another input,
NaN/Inf made between modules (forward and backward), which image holds NaN/Inf, parameter
rows listed once, and the hint's punctuation. Oracles: torch on the same model and tensors."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import hookcli
from hookcli.cli import app
from hookcli.errors import UsageError
from tests.support import models

runner = CliRunner()


def run(*args: str) -> object:
    return runner.invoke(app, list(args))


def _model(cls: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return cls().eval()


# ---------------------------------------------------------------- NaN/Inf made between modules


def test_inline_nan_origin_names_the_gap() -> None:
    model = _model(models.InlineNet)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        h = model.bn1(model.fc1(x))
    made = int(torch.log(h).isnan().sum())  # the oracle: what the inline log made
    assert made > 0
    report = hookcli.inspect(model, x, device="cpu", topk=0)
    (origin,) = report.nonfinite_origins
    assert (origin.direction, origin.where) == ("forward", "between")
    assert (origin.layer, origin.after, origin.after_finite) == ("fc2", "bn1 call 0", "output")
    assert (origin.path, origin.nan, origin.inf) == ("in[0]", made, 0)
    assert origin.code == ["InlineNet.forward"]
    assert origin.describe() == (
        f"forward: entered between bn1 call 0 (finite output) and fc2 (Linear) call 0 "
        f"(input in[0]: {made} NaN): code in InlineNet.forward"
    )
    # no module made them: before this, the first red row (fc2) was blamed by the reader
    assert not any(t.nonfinite for c in report.layers if c.name != "fc2" for t in c.outputs)


def test_inline_nan_in_the_table_and_check(tmp_path: Path) -> None:
    r = run("inspect", "tests/support/models.py:InlineNet", "--input", "randn:4x8", "--topk", "0")
    assert r.exit_code == 0, r.output
    fc2 = next(line for line in r.stdout.splitlines() if line.startswith("fc2 "))
    assert "in: " in fc2  # the table marks the input's NaN, not only the output's
    assert "entered between bn1 call 0 (finite output) and fc2 (Linear) call 0" in r.stdout
    r = run("check", "tests/support/models.py:InlineNet", "--input", "randn:4x8", "-f", "json")
    assert r.exit_code == 1
    data = json.loads(r.stdout)
    origin = data["nonfinite_origins"][0]
    assert origin["where"] == "between" and origin["code"] == ["InlineNet.forward"]
    (check,) = data["checks"]
    assert check["first"]["layer"] == "fc2"


def test_inline_code_inside_a_block_forward_and_backward() -> None:
    """Forward: finite (the sqrt of h - min h). Backward: sqrt'(0) = Inf reaches inner's
    output gradient, made by code in InlineBlock.forward between inner and out."""
    model = _model(models.InlineDeep)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    # the oracle: the gradient w.r.t. block.inner's output, by autograd
    h = model.block.inner(model.stem(x))
    loss = model.head(model.block.out(torch.sqrt(h - h.min(1, keepdim=True).values))).sum()
    (g,) = torch.autograd.grad(loss, h)
    inf, nan = int(g.isinf().sum()), int(g.isnan().sum())
    assert inf + nan > 0
    report = hookcli.grads(model, x, device="cpu", target="sum")
    origins = {o.direction: o for o in report.nonfinite_origins}
    assert "forward" not in origins
    back = origins["backward"]
    assert (back.where, back.layer, back.path) == ("between", "block.inner", "out")
    assert (back.nan, back.inf) == (nan, inf)
    assert back.after == "block.out call 0" and back.after_finite == "input"
    assert back.code == ["InlineBlock.forward (block)"]
    assert "code in InlineBlock.forward (block)" in back.describe()


def test_a_layers_own_backward_is_still_the_layer() -> None:
    """The gap is not reported when a module made the gradient: NanBackward's sqrt module."""
    report = hookcli.grads(
        "tests/support/models.py:NanBackward",
        input_specs=["randn:16x4"],
        target="sum",
        device="cpu",
    )
    back = next(o for o in report.nonfinite_origins if o.direction == "backward")
    assert (back.where, back.layer) == ("layer", "sqrt")


def test_nan_in_the_models_input_and_which_image(tmp_path: Path) -> None:
    x = torch.rand(5, 4, generator=torch.Generator().manual_seed(0))
    x[3] = float("nan")  # bad data in image 3
    x[1, 0] = -1.0  # image 1: sqrt(-1) in the model's forward
    spec = tmp_path / "batch.pt"
    torch.save(x, spec)
    model = _model(models.RowNet)
    with torch.no_grad():
        y = model(x)
    report = hookcli.inspect(model, x, device="cpu", topk=0)
    (origin,) = report.nonfinite_origins
    assert origin.where == "before" and origin.layer == "fc"
    got = {(b.image, b.input_nan, b.output_nan) for b in report.nonfinite_images}
    want = {
        (i, int(x[i].isnan().sum()), int(y[i].isnan().sum()))
        for i in range(5)
        if x[i].isnan().any() or y[i].isnan().any()
    }
    assert got == want == {(1, 0, 3), (3, 4, 3)}
    r = run("inspect", "tests/support/models.py:RowNet", "--input", str(spec), "--topk", "0")
    assert "NaN/Inf by image (2 of 5): image 1: output 3 NaN; image 3: input 4 NaN" in r.stdout


# ---------------------------------------------------------------- check: failures as objects


def test_failures_are_objects_and_stderr_says_why(tmp_path: Path) -> None:
    args = ["check", "tests/support/models.py:Collapse", "--input", "randn:4x8", "--max-abs", "0.5"]
    r = run(*args, "-f", "json")
    assert r.exit_code == 1
    (check,) = json.loads(r.stdout)["checks"]
    assert check["rule"] == "max-abs" and not check["passed"]
    report = hookcli.inspect(
        "tests/support/models.py:Collapse", input_specs=["randn:4x8"], device="cpu"
    )
    want = {  # the oracle: max |x| of every output in the run's own statistics
        (c.name, c.call): max(abs(t.min or 0), abs(t.max or 0))
        for c in report.layers
        for t in c.outputs
        if max(abs(t.min or 0), abs(t.max or 0)) > 0.5
    }
    got = {(f["layer"], f["call"]): f["value"] for f in check["failures"]}
    assert got.keys() == want.keys() and want
    for key, value in want.items():
        assert got[key] == pytest.approx(value)
    assert {f["limit"] for f in check["failures"]} == {0.5}
    assert all(
        set(f) == {"message", "layer", "call", "path", "value", "limit", "channel", "position"}
        for f in check["failures"]
    )
    # stderr: one line per failed rule, whatever the format; a file output too
    assert r.stderr.count("check failed: max-abs:") == 1
    out = tmp_path / "r.md"
    r = run(*args, "-o", str(out))
    assert r.exit_code == 1 and "check failed: max-abs:" in r.stderr and out.exists()
    # a table on stdout shows them itself: stderr stays quiet
    r = run(*args)
    assert "FAIL max-abs" in r.stdout and "check failed" not in r.stderr


def test_min_std_flags_collapse_first_in_forward_order() -> None:
    model = _model(models.Collapse)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = model.fc1(x)
        outs = {"fc1": a, "squash": model.squash(a)}
        outs["fc2"] = model.fc2(outs["squash"])
        outs["act"] = model.act(outs["fc2"])
    stds = {k: float(v.double().std(correction=0)) for k, v in outs.items()}
    limit = 1e-6
    report = hookcli.check(model, x, device="cpu", min_std=limit)
    (result,) = report.checks
    assert not result.passed
    assert [f.layer for f in result.failures] == [k for k, s in stds.items() if s < limit]
    assert [f.layer for f in result.failures] == ["squash", "fc2", "act"]
    for f in result.failures:
        assert f.value == pytest.approx(stds[f.layer], rel=1e-6)
    assert result.first is not None and result.first.layer == "squash"
    assert "first in forward: squash call 0" in result.message
    # a limit below every std passes
    below = min(stds.values()) / 2
    assert hookcli.check(model, x, device="cpu", min_std=below).checks[0].passed
    r = run("check", "resnet18", "--min-std", "-1")
    assert r.exit_code == 2 and "--min-std" in r.stderr


def test_first_vanishing_gradient_is_nearest_the_loss() -> None:
    model = _model(models.Shrinking)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    layers = list(model.layers)
    outs = []
    h = x
    for layer in layers:
        h = layer(h)
        outs.append(h)
    grads = torch.autograd.grad(h.sum(), outs)  # the oracle: each layer's output gradient
    norms = [float(g.double().norm()) for g in grads]
    lo = sorted(norms)[2] * 1.0001  # three layers below: vanishing
    report = hookcli.check(
        model, x, device="cpu", grad_norm=f"{lo}:", target="sum", layers=["layers.*"]
    )
    (result,) = report.checks
    outputs = [f for f in result.failures if f.path.startswith("grad_output")]
    want = [f"layers.{i}" for i, n in enumerate(norms) if n < lo]
    assert [f.layer for f in outputs] == want
    for f in outputs:
        assert f.value == pytest.approx(norms[int(f.layer.split(".")[1])], rel=1e-6)
    # backward reaches the last layer first: the first failure is the vanishing one nearest
    # the loss, in the order the gradients arrived
    assert result.first is not None
    order = {c.name: c.backward_order for c in report.layers}
    assert order == {f"layers.{i}": 4 - i for i in range(5)}
    first_layer = max(int(f.layer.split(".")[1]) for f in result.failures)
    assert result.first.layer == f"layers.{first_layer}"
    assert "first to arrive in backward" in result.message


def test_baseline_notes_another_input(tmp_path: Path) -> None:
    base = tmp_path / "base.json"
    model = "tests/support/models.py:Healthy"
    r = run("inspect", model, "--input", "randn:4x4", "-f", "json", "-o", str(base))
    assert r.exit_code == 0 and json.loads(base.read_text())["model"]["seed"] == 0
    r = run("check", model, "--input", "rand:4x4", "--baseline", str(base), "-f", "json")
    assert r.exit_code == 1
    (check,) = json.loads(r.stdout)["checks"]
    assert "the baseline's input was 'randn:4x4', this run's is 'rand:4x4'" in check["message"]
    assert "the drift may come from that, not from the model" in r.stderr
    # the same input and seed: no note
    r = run("check", model, "--input", "randn:4x4", "--baseline", str(base), "-f", "json")
    assert r.exit_code == 0
    assert "input" not in json.loads(r.stdout)["checks"][0]["message"]


def test_a_baseline_with_gradients_is_not_half_compared_without_backward(tmp_path: Path) -> None:
    """A baseline saved with --backward holds gradients; a check without --backward compared
    only the forward and passed (exit 0) with every gradient unchecked. It is refused (exit 2),
    and with --backward the gradients are compared."""
    base = tmp_path / "base.json"
    model = "tests/support/models.py:Healthy"
    args = ("--input", "randn:4x4")
    r = run("check", model, *args, "--backward", "--save-baseline", str(base))
    assert r.exit_code == 0, r.stderr
    r = run("check", model, *args, "--baseline", str(base))
    assert r.exit_code == 2 and r.stdout == ""
    assert "holds gradients" in r.stderr and "add --backward" in r.stderr
    r = run("check", model, *args, "--backward", "--baseline", str(base), "-f", "json")
    assert r.exit_code == 0, r.stderr
    (check,) = json.loads(r.stdout)["checks"]
    kinds = ("inputs", "outputs", "grad_inputs", "grad_outputs")
    layers = json.loads(base.read_text())["layers"]
    grads = sum(len(c.get(k) or []) for c in layers for k in kinds[2:])
    grads += sum(1 for c in layers for q in c.get("params") or [] if q.get("grad"))
    entries = sum(len(c.get(k) or []) for c in layers for k in kinds[:2]) + grads
    assert grads > 0 and f"{entries} tensors within" in check["message"]


def test_a_model_file_spelled_another_way_is_the_same_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The baseline's spec 'models.py:Healthy' and the run's './models.py:Healthy' (or an
    absolute path, or a path from another folder) name one file: compared, not refused."""
    import shutil

    shutil.copy(Path(models.__file__), tmp_path / "models.py")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    base = tmp_path / "base.json"
    args = ("--input", "randn:4x4")
    assert run("check", "models.py:Healthy", *args, "--save-baseline", str(base)).exit_code == 0
    for spec in ("./models.py:Healthy", f"{tmp_path}/models.py:Healthy"):
        r = run("check", spec, *args, "--baseline", str(base))
        assert r.exit_code == 0, (spec, r.stderr)
    saved = json.loads(base.read_text())  # recorded on Windows: the same file and object
    saved["model"]["spec"] = "C:\\work\\models.py:Healthy"
    windows = tmp_path / "windows.json"
    windows.write_text(json.dumps(saved))
    assert run("check", "models.py:Healthy", *args, "--baseline", str(windows)).exit_code == 0
    shutil.copy(tmp_path / "models.py", tmp_path / "other.py")  # another file: refused
    r = run("check", "other.py:Healthy", *args, "--baseline", str(base))
    assert r.exit_code == 2 and "is from model 'models.py:Healthy'" in r.stderr


def test_schema_1_baselines_still_read(tmp_path: Path) -> None:
    base = tmp_path / "base.json"
    r = run(
        "inspect",
        "tests/support/models.py:Healthy",
        "--input",
        "randn:4x4",
        "-f",
        "json",
        "-o",
        str(base),
    )
    assert r.exit_code == 0
    data = json.loads(base.read_text())
    assert data["schema"] == 2
    data["schema"] = 1
    base.write_text(json.dumps(data))
    r = run(
        "check", "tests/support/models.py:Healthy", "--input", "randn:4x4", "--baseline", str(base)
    )
    assert r.exit_code == 0, r.output


# ---------------------------------------------------------------- small ones


def test_parameter_rows_listed_once_under_the_innermost_selected_module() -> None:
    model = _model(models.InlineDeep)
    x = torch.rand(3, 4, generator=torch.Generator().manual_seed(0))
    report = hookcli.grads(
        model, x, device="cpu", target="sum", layers=["block", "block.inner", "head"]
    )
    rows = [(c.name, p.name) for c in report.layers for p in c.params or []]
    assert rows == [
        ("block", "out.weight"),
        ("block", "out.bias"),
        ("block.inner", "weight"),
        ("block.inner", "bias"),
        ("head", "weight"),
        ("head", "bias"),
    ]
    loss = model(x).sum()
    (g,) = torch.autograd.grad(loss, [model.block.out.weight])
    block = next(c for c in report.layers if c.name == "block")
    assert block.params is not None
    assert block.params[0].grad_norm == pytest.approx(float(g.double().norm()), rel=1e-6)


def test_hint_follows_a_full_stop() -> None:
    assert str(UsageError("use a file instead", "give FILE.")) == (
        "use a file instead. Hint: give FILE."
    )
    assert str(UsageError("bad value.", "fix it.")) == "bad value. Hint: fix it."
    assert str(UsageError("unknown key: x", None)) == "unknown key: x"


def test_quiet_says_nothing_but_failures(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    args = ["check", "tests/support/models.py:Healthy", "--input", "randn:4x4", "-o", str(out)]
    r = run(*args, "-q")
    assert r.exit_code == 0 and r.output == "" and json.loads(out.read_text())["schema"] == 2
    r = run(*args)
    assert f"wrote {out}" in r.stderr  # without --quiet it is said
    r = run(*args, "-q", "--max-abs", "1e-9")
    assert r.exit_code == 1 and r.stdout == ""
    assert r.stderr.startswith("check failed: max-abs:") and "wrote" not in r.stderr


def test_folder_names_the_images_and_the_batch(tmp_path: Path) -> None:
    from PIL import Image

    folder = tmp_path / "imgs"
    folder.mkdir()
    shades = [255, 0, 255, 255, 0]  # images 1 and 4 are black: log of a negative mean
    for i, v in enumerate(shades):
        Image.new("RGB", (40, 40), (v, v, v)).save(folder / f"{i:02d}.png")
    report = hookcli.inspect(
        "tests/support/models.py:DarkNan", [str(folder)], batch_size=2, device="cpu", topk=0
    )
    got = [(b.image, b.source, b.input_nan, b.output_nan) for b in report.nonfinite_images]
    assert got == [(1, "01.png", 0, 4), (4, "04.png", 0, 4)]
    (origin,) = report.nonfinite_origins
    assert (origin.where, origin.after, origin.layer) == ("between", "pool call 0", "fc")
    assert origin.nan == 3  # image 1's three channels, in batch 0 (images 0-1)
    assert any("first appeared in batch 0 (images 0–1)" in n for n in report.notes)
    r = run(
        "inspect",
        "tests/support/models.py:DarkNan",
        str(folder),
        "--batch-size",
        "2",
        "--topk",
        "0",
    )
    assert r.exit_code == 0, r.output
    assert "NaN/Inf by image (2 of 5): image 1 (01.png): output 4 NaN" in r.stdout


# ---------------------------------------------------------------- from the review


@pytest.mark.parametrize("module", [False, True])
def test_a_gradient_summed_from_several_readers_is_not_one_layers(module: bool) -> None:
    """x feeds lin and sqrt: autograd sums both readers' gradients into x's, so the Inf
    (sqrt's, at 0) must not be blamed on lin, whose own backward is a finite matmul."""
    model = _model(models.SharedInput)
    model.sq = models.Sqrt() if module else None
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    # the oracle: lin's own contribution to x's gradient is finite, the sum is not
    h = model.act(model.fc1(x))
    out = model.lin(h)
    loss = model.head(out + torch.sqrt(h)).sum()
    (g_out,) = torch.autograd.grad(loss, out, retain_graph=True)
    assert torch.isfinite(g_out @ model.lin.weight).all()
    (g_h,) = torch.autograd.grad(loss, h)
    assert not torch.isfinite(g_h).all()
    report = hookcli.grads(model, x, device="cpu", target="sum")
    back = next(o for o in report.nonfinite_origins if o.direction == "backward")
    # named: the first reader whose hook saw it; the others are listed as candidates
    first, others = ("sq", ["lin call 0"]) if module else ("lin", [])
    assert (back.where, back.layer, back.path) == ("shared", first, "in[0]")
    assert back.inf == int(g_h.isinf().sum())
    assert back.code == [*others, "code in SharedInput.forward"]
    assert "which was read outside it too" in back.describe()
    # a reader inside the call does not make it shared: sqrt's own input is its own
    report = hookcli.grads(
        "tests/support/models.py:NanBackward",
        input_specs=["randn:16x4"],
        target="sum",
        device="cpu",
    )
    assert [o.where for o in report.nonfinite_origins if o.direction == "backward"] == ["layer"]


def test_an_input_read_outside_the_layer_too_is_shared_when_it_is_the_leaf_itself() -> None:
    """The same as above with the model's input as the shared tensor: a leaf, whose readers
    autograd finds through the leaf's own node, not a producer's output."""
    model = _model(models.SharedLeafInput)
    x = torch.rand(4, 8, generator=torch.Generator().manual_seed(0)) + 0.1
    x[1, 2] = 0.0  # sqrt's gradient there is Inf; lin's own is a finite matmul
    leaf = x.clone().requires_grad_(True)
    (g_x,) = torch.autograd.grad(model(leaf).sum(), leaf)
    assert not torch.isfinite(g_x).all()
    report = hookcli.grads(model, x, device="cpu", target="sum", input_grad=True)
    back = next(o for o in report.nonfinite_origins if o.direction == "backward")
    assert (back.where, back.layer, back.path) == ("shared", "lin", "in[0]")
    assert back.inf == int(g_x.isinf().sum())
    assert "which was read outside it too" in back.describe()


def test_inf_fails_max_abs_and_grad_norm_and_nan_is_not_vanishing() -> None:
    r = run(
        "check",
        "tests/support/models.py:Overflow",
        "--input",
        "randn:4x8",
        "--max-abs",
        "1e4",
        "-f",
        "json",
    )
    assert r.exit_code == 1
    (check,) = json.loads(r.stdout)["checks"]  # the JSON parses: Inf is a string there
    # big's output is Inf; out's is NaN (Inf - Inf): a magnitude rule flags the Inf only
    assert {(f["layer"], f["value"]) for f in check["failures"]} == {("big", "Inf")}
    report = hookcli.check(
        "tests/support/models.py:InlineBlock",
        input_specs=["randn:6x8"],
        grad_norm=":1e3",
        target="sum",
        device="cpu",
    )
    (result,) = report.checks
    assert not result.passed
    assert all(
        "Inf (exploding)" in f.message or "NaN (not finite)" in f.message for f in result.failures
    )
    assert not any("vanishing" in f.message for f in result.failures)


def test_root_selected_keeps_the_parameters_of_its_selected_children() -> None:
    report = hookcli.grads(
        "tests/support/models.py:InlineDeep",
        input_specs=["rand:3x4"],
        target="sum",
        device="cpu",
        layers=["", "head"],
    )
    rows = [(c.name, p.name) for c in report.layers for p in c.params or []]
    assert ("head", "weight") in rows and ("head", "bias") in rows
    assert not any(name.startswith("head.") for _, name in rows)
    assert len(rows) == len({n for _, n in rows})


def test_nan_made_after_the_last_call() -> None:
    report = hookcli.inspect(
        "tests/support/models.py:LogAfter", input_specs=["randn:4x8"], device="cpu"
    )
    (origin,) = report.nonfinite_origins
    assert (origin.where, origin.layer, origin.after) == ("after", "(model)", "fc call 0")
    assert origin.code == ["LogAfter.forward"]
    assert origin.nan == report.outputs[0].nan > 0


def test_which_image_counts_the_input_before_the_model_changes_it() -> None:
    x = torch.rand(3, 8, generator=torch.Generator().manual_seed(0)) + 0.5  # log: finite
    x[1, 0] = float("nan")
    report = hookcli.inspect(_model(models.EatsInput), x.clone(), device="cpu", topk=0)
    assert [(b.image, b.input_nan) for b in report.nonfinite_images] == [(1, 1)]


def test_which_image_in_a_list_input_is_one_per_element() -> None:
    from hookcli.engine.measure import nonfinite_by_image
    from hookcli.inputs import ModelInput

    a, b = torch.rand(3, 20, 20), torch.rand(3, 20, 20)
    b[2, :2, :2] = float("nan")
    got = nonfinite_by_image(ModelInput(([a, b],), "", ["a.jpg", "b.jpg"]), [{"x": a}, {"x": b}])
    assert [(g.image, g.source, g.input_nan, g.output_nan) for g in got] == [(1, "b.jpg", 4, 4)]


def test_which_image_the_quick_finite_check_never_hides_a_nan_or_inf() -> None:
    """nonfinite_rows skips a CPU tensor whose sum is finite; a sum that overflows (large finite
    values) or that Inf and -Inf make NaN still gets the exact per-image count."""
    from hookcli.engine.measure import _finite, nonfinite_rows

    big = torch.full((2, 4), 3e38)  # finite; the float32 sum overflows
    assert not _finite(big), "so the exact count runs"
    nan, inf = nonfinite_rows(big, 2, "in")
    assert nan.tolist() == [0, 0] and inf.tolist() == [0, 0]
    both = torch.zeros(3, 4, dtype=torch.float64)
    both[1, 0], both[1, 1], both[2, 3] = math.inf, -math.inf, math.nan
    nan, inf = nonfinite_rows(both, 3, "in")
    assert nan.tolist() == [0, 0, 1] and inf.tolist() == [0, 2, 0]
    half = torch.zeros(2, 3, dtype=torch.bfloat16)
    half[0, 2] = math.nan
    nan, _ = nonfinite_rows((half,), 2, "in")
    assert nan.tolist() == [1, 0]


def _counted_outputs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The roots nonfinite_rows counts image by image, recorded."""
    from hookcli.engine import measure as measure_mod

    seen: list[str] = []
    real = measure_mod.nonfinite_rows

    def counting(values: Any, batch: int, root: str) -> Any:
        seen.append(root)
        return real(values, batch, root)

    monkeypatch.setattr(measure_mod, "nonfinite_rows", counting)
    return seen


def test_a_finite_output_is_not_read_again_image_by_image(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The output's own statistics (every NaN and Inf counted, whole) already say it holds
    none: its images are not counted again (on a language model that read the logits twice
    more, and waited for the device); an output that holds some still is, image by image."""
    seen = _counted_outputs(monkeypatch)
    x = torch.rand(4, 4, generator=torch.Generator().manual_seed(0))
    report = hookcli.inspect(_model(models.RowNet), x, device="cpu", topk=0)
    assert report.nonfinite_images == [] and seen == ["in"]
    seen.clear()
    x[2, 0] = -1.0  # image 2: sqrt(-1) in the forward
    report = hookcli.inspect(_model(models.RowNet), x, device="cpu", topk=0)
    assert seen == ["in", "out"]
    assert [(b.image, b.input_nan, b.output_nan) for b in report.nonfinite_images] == [
        (2, 0, report.outputs[0].nan)
    ]


def test_an_output_whose_statistics_leave_padding_out_is_still_counted_by_image() -> None:
    """With a token mask (a padded batch) the statistics leave the padded positions out, and
    a NaN there is not in them: the per-image count still reads the output."""
    from hookcli.engine.measure import outputs_known_finite
    from hookcli.engine.stats import StatsCollector

    out = torch.zeros(2, 3, 4)
    collector = StatsCollector()
    stats = [collector.add(out, "out")]
    collector.finalize()
    assert outputs_known_finite(out, stats, 2, collector)
    collector.set_token_mask(torch.tensor([[1, 1, 0], [1, 1, 1]]))
    assert not outputs_known_finite(out, stats, 2, collector)
    assert not outputs_known_finite([out[0], out[1]], stats, 2, StatsCollector())  # per item
    stats[0].note = "not measured: the device's statistics failed (boom)"
    assert not outputs_known_finite(out, stats, 2, StatsCollector())
    unmeasured = (out, out.clone())  # tensors measure() left out (past its cap): no statistics
    assert not outputs_known_finite(unmeasured, [], 2, StatsCollector())


class _Summed(nn.Module):
    """A layer whose input and output have no channel dimension (1-D and 0-d)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x.sum(-1))


@pytest.mark.parametrize("rule", [{"fail_on": ["massive"]}, {"max_kurtosis": 3.0}])
def test_a_per_channel_rule_that_measured_nothing_fails_and_says_why(rule: Any) -> None:
    """It passed ("no massive activation in 0 tensors"): a gate that checked nothing."""
    report = hookcli.check(_Summed(), torch.randn(3), device="cpu", **rule)
    (result,) = report.checks
    assert not result.passed and hookcli.exit_code(report) == 1
    assert "nothing measured per channel" in result.message
    assert "has a channel dimension" in result.message


def test_a_per_channel_rule_over_constant_tensors_says_they_have_no_value() -> None:
    """Every tensor measured per channel is constant (no kurtosis): the rule checked nothing,
    and says why (not "no channel dimension")."""
    report = hookcli.check(nn.Sequential(nn.Identity()), torch.ones(2, 4), max_kurtosis=3.0)
    (result,) = report.checks
    assert not result.passed and "have no kurtosis" in result.message
