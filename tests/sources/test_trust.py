"""Answers a user can trust at first sight (issue 32): check's baseline names the layer that
changed, diff never shows values that are not finite as identical and says why a side parted
ways, NaN gradients are never shown as absent ones, a model class is read from a training
script without running it, a bundle handed over never runs code, and replay never writes into
the bundle it reads. Oracles: the state dict edited by hand, float16's range, torch's own
gradients, the script's own side effects."""

from __future__ import annotations

import copy
import csv
import io
import json
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn
from typer.testing import CliRunner, Result

import hookcli
from hookcli.cli import app
from tests.support.cli import assert_one_line_error
from tests.support.paths import ROOT

runner = CliRunner()


def invoke(*args: str | Path) -> Result:
    result = runner.invoke(app, [str(a) for a in args])
    assert "internal error" not in result.stderr, result.stderr
    return result


# ---------------------------------------------------------------- 1. the baseline's first drift


def test_a_baseline_names_the_layer_that_changed_first(tmp_path: Path) -> None:
    """One weight scaled by 1.5: every statistic of that conv's output is exactly 1.5 times
    the baseline's. The failure's first line names it, not a near-zero mean downstream."""
    torch.manual_seed(0)
    sd = torchvision.models.resnet18().state_dict()
    torch.save(sd, tmp_path / "base.pt")
    changed = dict(sd)
    changed["layer3.1.conv2.weight"] = sd["layer3.1.conv2.weight"] * 1.5
    torch.save(changed, tmp_path / "changed.pt")
    run = ["resnet18", "--input", "randn:1x3x64x64", "--no-config"]
    base = tmp_path / "base.json"
    r = invoke("inspect", *run, "--weights", tmp_path / "base.pt", "-f", "json", "-o", base)
    assert r.exit_code == 0, r.output
    r = invoke("check", *run, "--weights", tmp_path / "changed.pt", "--baseline", base)
    assert r.exit_code == 1, r.output
    first_item = next(line for line in r.stdout.splitlines() if line.startswith("    "))
    assert first_item.strip().startswith("layer3.1.conv2 call 0 output out"), r.stdout
    assert "first in the order the hooks saw them: layer3.1.conv2 call 0" in r.stdout
    # the oracle: the statistics of that output are the baseline's times 1.5
    r = invoke(
        "check", *run, "--weights", tmp_path / "changed.pt", "--baseline", base, "-f", "json"
    )
    data = json.loads(r.stdout)
    (check,) = data["checks"]
    assert check["first"]["layer"] == "layer3.1.conv2"
    assert check["failures"][0] == check["first"]
    before = next(
        c for c in json.loads(base.read_text())["layers"] if c["name"] == "layer3.1.conv2"
    )
    after = next(c for c in data["layers"] if c["name"] == "layer3.1.conv2")
    for stat in ("mean", "std", "max", "norm"):
        assert after["outputs"][0][stat] == pytest.approx(1.5 * before["outputs"][0][stat], 1e-5)
    # every call before it, in forward order, is unchanged: none is listed
    order = [(c["name"], c["call"]) for c in data["layers"]]
    earlier = set(order[: order.index(("layer3.1.conv2", 0))])
    assert not earlier & {(f["layer"], f["call"]) for f in check["failures"]}


def test_drift_sizes_do_not_explode_near_zero() -> None:
    from hookcli.commands.baseline import _scale, _size_of_change
    from hookcli.records import TensorStats

    entry = TensorStats("x", (100, 100), "float32", 10_000, mean=0.0123, std=1.0, norm=100.0)
    scale = _scale(entry)
    assert scale == pytest.approx(1.0)
    # a near-zero mean moving by 0.04 is a small change against a tensor of rms 1 …
    assert _size_of_change("mean", 0.0558, 0.0123, scale) == pytest.approx(0.0435)
    # … smaller than a max moving by half of its 4
    assert _size_of_change("max", 6.0, 4.0, scale) == pytest.approx(2.0)
    assert _size_of_change("norm", 150.0, 100.0, scale) == pytest.approx(0.5)
    assert math.isinf(_size_of_change("nan", 3, 0, scale))
    assert math.isinf(_size_of_change("mean", None, 0.5, scale))


# ---------------------------------------------------------------- 2. diff: not finite is not equal


GROW = '''
import torch
from torch import nn


class Grow(nn.Module):
    """Each Linear multiplies by 100: float16 overflows at the third (1e6 > 65504)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(8, 8) for _ in range(5)])
        for lin in self.layers:
            nn.init.eye_(lin.weight)
            lin.weight.data *= 100.0
            nn.init.zeros_(lin.bias)

    def forward(self, x):
        return self.layers(x)
'''


def test_diff_rows_not_finite_are_not_identical(tmp_path: Path) -> None:
    (tmp_path / "grow.py").write_text(GROW)
    model = f"{tmp_path / 'grow.py'}:Grow"
    r = invoke("diff", model, "--input", "ones:2x8", "--b", "float16", "--no-config", "-f", "json")
    assert r.exit_code == 1, r.output
    data = json.loads(r.stdout)
    rows = {c["name"]: c["b"][0] for c in data["calls"]}
    # the oracle: float16's range, and the reference's values (1e2, 1e4, 1e6 …)
    assert torch.finfo(torch.float16).max == 65504
    assert rows["layers.1"]["rel_l2"] == 0 and rows["layers.1"]["nonfinite"] == 0
    for name in ("layers.2", "layers.3", "layers.4"):
        row = rows[name]
        assert row["nonfinite"] == 16 and row["over"] is True
        for metric in ("max_abs", "rel_l2", "cosine", "sqnr_db", "norm_rel", "own_rel_l2"):
            assert row[metric] is None, (name, metric, row)
    assert (
        rows["layers.2"]["note"]
        == "overflow: the reference's max |x| 1e+06 exceeds float16's 65504"
    )
    assert "layers.2 (Linear) call 0" in data["first_over"]
    assert "overflow" in data["first_over"]
    r = invoke("diff", model, "--input", "ones:2x8", "--b", "float16", "--no-config")
    row = next(line for line in r.stdout.splitlines() if line.startswith("layers.2 "))
    assert " inf " not in row and "| 0 " not in row
    assert "16 not finite: overflow" in row


def test_the_largest_own_error_list_says_accumulated_values_are_not_finite() -> None:
    from hookcli.records import DiffReport, InputInfo, ModelInfo
    from hookcli.render.diffrows import largest_lines

    report = DiffReport(
        model=ModelInfo("m", "m", "custom", "none", 1),
        input=InputInfo("x", [(1,)]),
        device="cpu",
        a="float32",
        b="float16",
        ref=None,
        isolate=False,
        tol=0.004,
        calls=[],
        largest_own=[
            {"name": "l", "call": 0, "type": "Linear", "side": "B", "path": "out",
             "own_rel_l2": 0.01, "rel_l2": None},
        ],
    )  # fmt: skip
    (_, line) = [x.text for x in largest_lines(report)]
    assert "(accumulated: values not finite)" in line and "accumulated 0" not in line


# ---------------------------------------------------------------- 3. NaN is not "absent"


class NaNGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 3)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x) * float("nan"))


def test_nan_gradients_are_shown_as_not_finite_never_as_absent() -> None:
    torch.manual_seed(0)
    model = NaNGrad().eval()
    x = torch.randn(2, 4)
    report = hookcli.grads(model, x, device="cpu", target="sum", topk=0)
    # the oracle: torch's own gradients of the same sum
    model.zero_grad()
    model(x).sum().backward()  # type: ignore[no-untyped-call]
    assert model.fc1.weight.grad is not None and model.fc1.weight.grad.isnan().all()
    assert model.unused.weight.grad is None
    from hookcli.render.rows import grad_rows, param_rows

    params = {(r[0], r[1]): r for r in param_rows(report)}
    nan_row = params[("fc1", "weight")]
    assert nan_row[4] == "not finite" and nan_row[-1] == "grad: 16 NaN", nan_row
    assert "—" not in nan_row[4:7]
    rows = {r[0]: r for r, _ in grad_rows(report) if r[0]}
    # fc1's output gradient is NaN (fc2's input times NaN): labelled, never "—"
    assert rows["fc1"][6] == "not finite"
    assert rows["fc1"][-1] == "grad_out: 8 NaN"
    # fc2: its output NaN, made from an input that already was: each count says what it counts
    assert rows["fc2"][-1].split("; ")[0] == "out: 6 NaN" and "in: 8 NaN" in rows["fc2"][-1]
    from hookcli.render.html import report_html

    html = report_html(report)
    assert "grad: 16 NaN" in html and "grad_out: 8 NaN" in html


# ---------------------------------------------------------------- 4-6. replay: scripts, bundles

TRAIN = """
import pathlib
import torch
from torch import nn
import torch.nn.functional as F

import hookcli

HIDDEN = 16
pathlib.Path("ran.txt").open("a").write("trained\\n")  # a side effect of running the script


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with hookcli.watch(model, optimizer=opt, log="run.jsonl") as w:
    for step in range(3):
        if step == 2:
            with torch.no_grad():
                model.fc1.weight[0, 0] = float("nan")
        opt.zero_grad()
        x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        loss = F.cross_entropy(model(x), y)
        w.loss(loss)
        loss.backward()
        opt.step()
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A training script that defines its model, trains with hookcli.watch and writes a
    bundle at its NaN step; run once, as a user would."""
    folder = tmp_path_factory.mktemp("train")
    (folder / "train.py").write_text(TRAIN)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, "train.py"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert (folder / "run.bundle" / "bundle.json").is_file(), done.stderr
    assert (folder / "ran.txt").read_text() == "trained\n"
    return folder


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def test_replay_reads_the_model_class_from_the_script_without_running_it(
    trained: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(trained)
    before = _snapshot(trained)
    r = invoke("replay", "run.bundle", "--model", "train.py:Net", "-f", "json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["nonfinite_origins"][0]["layer"] == "fc1"
    assert data["checks"][0]["passed"] is True
    assert any("top-level code at lines" in n and "was not run" in n for n in data["notes"])
    # nothing ran: no second "trained" line, the log and the bundle byte for byte as they were
    assert _snapshot(trained) == before
    assert (trained / "ran.txt").read_text() == "trained\n"


def test_a_name_the_script_binds_by_running_code_is_explained(tmp_path: Path) -> None:
    (tmp_path / "s.py").write_text(
        "import os\nfrom functools import partial\nfrom torch import nn\n"
        "WIDTH = int(os.environ.get('W', '4'))\nmade = partial(nn.Linear, 2, 2)\n\n"
        "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.fc = nn.Linear(2, WIDTH)\n\n    def forward(self, x):\n"
        "        return self.fc(x)\n"
    )
    r = invoke("inspect", f"{tmp_path / 's.py'}:Net", "--input", "ones:2x2", "--no-config")
    assert_one_line_error(r, 2, "needs 'WIDTH'", "line 4", "does not run")
    # the name asked for is bound by the one statement the user named: that one runs
    r = invoke("inspect", f"{tmp_path / 's.py'}:made", "--input", "ones:2x2", "--no-config")
    assert r.exit_code == 0, r.output


class Evil:
    """Unpickling it writes a file: the proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, ...]]:
        return (os.system, (f"touch {self.marker}",))


def _evil_bundle(trained: Path, tmp_path: Path, part: str) -> tuple[Path, Path]:
    bundle = tmp_path / "handed.bundle"
    bundle.mkdir()
    for p in (trained / "run.bundle").iterdir():
        (bundle / p.name).write_bytes(p.read_bytes())
    marker = tmp_path / "pwned"
    with (bundle / part).open("wb") as f:
        pickle.dump(Evil(marker), f)
    return bundle, marker


@pytest.mark.parametrize("part", ["model.pt", "state.pt", "batch.pt"])
def test_a_bundle_handed_over_never_runs_code(trained: Path, tmp_path: Path, part: str) -> None:
    bundle, marker = _evil_bundle(trained, tmp_path, part)
    # without --model, the bundle's own model would be unpickled: refused, saying why
    r = invoke("replay", bundle)
    assert_one_line_error(r, 2, "unpickling its model.pt", "--model SPEC", "--unpickle")
    assert not marker.exists()
    # --model: the state and batch are read as tensors and plain values only
    r = invoke("replay", bundle, "--model", f"{trained / 'train.py'}:Net")
    if part == "model.pt":  # never read
        assert r.exit_code == 0, r.output
    else:
        assert_one_line_error(r, 2, part, "would run code", "--unpickle")
    assert not marker.exists()


def test_unpickle_is_the_opt_in_that_runs_the_bundles_code(trained: Path, tmp_path: Path) -> None:
    bundle, marker = _evil_bundle(trained, tmp_path, "model.pt")
    r = invoke("replay", bundle, "--unpickle")
    assert r.exit_code == 2  # the evil pickle is no module …
    assert marker.exists()  # … but it did run: that is what --unpickle says it does
    assert "--unpickle" in invoke("replay", "--help").stdout


@pytest.mark.parametrize(
    "name", ["bundle.json", "state.pt", "batch.pt", "records.jsonl", "model.pt"]
)
def test_replay_output_into_the_bundle_is_refused(trained: Path, name: str) -> None:
    before = _snapshot(trained / "run.bundle")
    target = trained / "run.bundle" / name
    r = invoke(
        "replay", trained / "run.bundle", "--model", f"{trained / 'train.py'}:Net", "-o", target
    )
    assert_one_line_error(r, 2, "also an input of this run")
    assert _snapshot(trained / "run.bundle") == before


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (lambda b: (b / "state.pt").write_bytes((b / "state.pt").read_bytes()[:100]), "state.pt"),
        (lambda b: (b / "batch.pt").write_bytes(b""), "batch.pt"),
        (lambda b: _edit(b, layers=5), "bundle.json's layers is a number, not a list"),
        (lambda b: _edit(b, layers=["a", 1]), "bundle.json's layers[1] is a number, not a string"),
        (lambda b: _edit(b, origins=[{"layer": 1}]), "bundle.json's origins[0] has no 'direction'"),
        (lambda b: _edit(b, step="two"), "bundle.json's step is a string, not a whole number"),
        (lambda b: _edit(b, rank=-1), "bundle.json's rank is a number, not a whole number >= 0"),
        (lambda b: _edit(b, schema=2), "ValueError: schema 2"),
        (lambda b: (b / "records.jsonl").write_text("[1, 2]\n"), "not an object"),
        (
            lambda b: torch.save({"model": {"fc1.weight": "x"}}, b / "state.pt"),
            "other than tensors",
        ),
        (lambda b: torch.save([{"args": 1}], b / "batch.pt"), "not what the recorder wrote"),
    ],
)
def test_a_damaged_bundle_is_one_line(
    trained: Path, tmp_path: Path, damage: object, needle: str
) -> None:
    bundle = tmp_path / "b"
    bundle.mkdir()
    for p in (trained / "run.bundle").iterdir():
        (bundle / p.name).write_bytes(p.read_bytes())
    damage(bundle)  # type: ignore[operator]
    r = invoke("replay", bundle, "--model", f"{trained / 'train.py'}:Net")
    assert_one_line_error(r, 2, needle)


def _edit(bundle: Path, **fields: object) -> None:
    meta = json.loads((bundle / "bundle.json").read_text())
    meta.update(fields)
    (bundle / "bundle.json").write_text(json.dumps(meta))


# ---------------------------------------------------------------- 7. gates that cannot fail

TINY = ["examples/tiny/net.py:Net", "--input", "ones:2x2", "--no-config"]


def test_check_with_an_output_key_the_output_lacks_fails() -> None:
    """A custom model's output is read by nothing (no predictions), yet a key that names nothing
    is an error, never a pass."""
    r = invoke("check", *TINY, "--output-key", "nosuch", "--fail-on", "nonfinite")
    assert_one_line_error(r, 2, "--output-key 'nosuch'", "no 'nosuch'")
    r = invoke("inspect", *TINY, "--output-key", "nosuch", "--topk", "0")
    assert_one_line_error(r, 2, "--output-key 'nosuch'")


def test_world_size_and_rank_without_torchrun_still_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """WORLD_SIZE/RANK left by a SLURM or MPI job: no other rank will come, so this process
    writes its own results and says why."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    out = tmp_path / "r.json"
    r = invoke("check", *TINY, "--fail-on", "nonfinite", "-o", out)
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["checks"][0]["passed"] is True
    assert any("torchrun did not start this process" in n for n in data["notes"])
    r = invoke("check", *TINY, "--fail-on", "nonfinite")
    assert "PASS nonfinite" in r.stdout
    # under torchrun's own environment rank 1 leaves the writing to rank 0, as before
    from hookcli.runtime import ranks

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert ranks.writer() is False and ranks.stray_note() is None


# ---------------------------------------------------------------- 10. Hugging Face folders


def _vit_folder(tmp_path: Path) -> Path:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        image_size=32, patch_size=16, num_labels=3,
    )  # fmt: skip
    torch.manual_seed(0)
    folder = tmp_path / "vit"
    ViTForImageClassification(config).save_pretrained(folder)
    return folder


def test_a_saved_folder_loads_and_matches_transformers(tmp_path: Path) -> None:
    from transformers import ViTForImageClassification

    folder = _vit_folder(tmp_path)
    assert (folder / "model.safetensors").is_file()
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    torch.save(x, tmp_path / "x.pt")
    r = invoke("inspect", f"hf:{folder}", "--input", tmp_path / "x.pt", "-f", "json", "--no-config")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    oracle = ViTForImageClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        logits = oracle(pixel_values=x).logits
    (out,) = [t for t in data["outputs"] if t["shape"] == [1, 3]]
    assert out["mean"] == pytest.approx(float(logits.double().mean()), rel=1e-5, abs=1e-6)


def _config(folder: Path, **fields: object) -> None:
    data = json.loads((folder / "config.json").read_text())
    data.update(fields)
    (folder / "config.json").write_text(json.dumps(data))


def _pickled_only(folder: Path) -> None:
    from safetensors.torch import load_file

    state = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")


@pytest.mark.parametrize(
    ("change", "needles"),
    [
        (
            lambda f: _config(f, auto_map={"AutoModel": "modeling_x.XModel"}),
            ["needs code of its own", "auto_map", "never runs"],
        ),
        (lambda f: _config(f, model_type="my_own_arch"), ["'my_own_arch' is not one transformers"]),
        (
            lambda f: (f / "config.json").write_text("{not json"),
            ["config.json is not a readable JSON"],
        ),
        (lambda f: (f / "config.json").write_text("[1, 2]"), ["config.json holds a list"]),
        (
            lambda f: (f / "preprocessor_config.json").write_text("{"),
            ["preprocessor_config.json is not a readable JSON"],
        ),
        (lambda f: _config(f, hidden_size=-4), ["hidden_size is -4"]),
        (lambda f: _config(f, hidden_size=10**8), ["would need about", "GiB"]),
        (_pickled_only, ["only as pytorch_model.bin", "does not unpickle"]),
        (lambda f: (f / "model.safetensors").unlink(), ["holds no weights"]),
    ],
)
def test_hf_folders_that_cannot_be_loaded_safely_are_one_line(
    tmp_path: Path, change: object, needles: list[str]
) -> None:
    folder = _vit_folder(tmp_path)
    change(folder)  # type: ignore[operator]
    r = invoke("inspect", f"hf:{folder}", "--no-config")
    assert_one_line_error(r, 2, *needles)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["hf:vit", "--model-arg", "image_size=-1"], "image_size is -1"),
        (["timm:vit_tiny_patch16_224", "--model-arg", "img_size=-1"], "img_size=-1"),
    ],
)
def test_bad_model_arg_values_are_exit_2(args: list[str], needle: str) -> None:
    r = invoke("inspect", *args, "--no-config")
    assert_one_line_error(r, 2, needle)


def _bin_cache(root: Path, repo: str, payload: object) -> None:
    """A hub cache whose snapshot of repo holds only pytorch_model.bin (huggingface_hub's
    layout)."""
    base = root / ("models--" + repo.replace("/", "--"))
    snap = base / "snapshots" / ("b" * 40)
    snap.mkdir(parents=True)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text("b" * 40)
    torch.save(payload, snap / "pytorch_model.bin")


def test_timm_cached_pickled_weights_are_read_as_weights_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import timm

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    marker = tmp_path / "pwned"
    _bin_cache(tmp_path / "hub", "timm/test_vit.r160_in1k", {"x": Evil(marker)})
    r = invoke("inspect", "timm:test_vit", "--weights", "DEFAULT", "-l", "head", "--no-config")
    assert_one_line_error(r, 2, "pytorch_model.bin", "does not unpickle")
    assert not marker.exists()
    # plain tensors in the same file load as before, equal to what was saved
    torch.manual_seed(3)
    saved = timm.create_model("test_vit", pretrained=False).state_dict()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub2"))
    _bin_cache(tmp_path / "hub2", "timm/test_vit.r160_in1k", saved)
    from hookcli.sources import load_model

    loaded = load_model("timm:test_vit", weights="DEFAULT")
    for key, value in loaded.module.state_dict().items():
        assert torch.equal(value, saved[key]), key


# ---------------------------------------------------------------- 11. smaller ones


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["diff", *TINY, "--output-key", "nosuch"], "No such option: --output-key"),
        (["attn", *TINY, "--output-key", "nosuch"], "No such option: --output-key"),
        (["inspect", *TINY, "--topk", "abc"], "Invalid value for '--topk'"),
        (["nosuch"], "No such command 'nosuch'"),
    ],
)
def test_usage_errors_are_one_line_too(args: list[str], needle: str) -> None:
    r = invoke(*args)
    assert_one_line_error(r, 2, needle, "-h` shows the usage")


def test_a_wrong_input_shape_says_what_the_model_expects() -> None:
    r = invoke("inspect", "examples/tiny/net.py:Net", "--input", "randn:2x3", "--no-config")
    assert_one_line_error(
        r, 3, "failed in layer l1", "the model was given 2x3", "Linear takes (…, 2)"
    )
    r = invoke("inspect", "resnet18", "--input", "randn:1x4x64x64", "--no-config")
    assert_one_line_error(r, 3, "given 1x4x64x64", "Conv2d takes (N, 3, …, …)")


def test_a_model_nested_past_the_recursion_limit_says_so(tmp_path: Path) -> None:
    # the limit this test relies on, set here: an earlier test's torch.compile (inductor)
    # raises the process's limit, past which 400 levels would not fail (issue 48)
    sys.setrecursionlimit(1000)  # the conftest puts the process's own limit back after
    (tmp_path / "deep.py").write_text(
        "from torch import nn\n\n\ndef Deep():\n    m = nn.Linear(4, 4)\n"
        "    for _ in range(400):\n        m = nn.Sequential(m)\n    return m\n"
    )
    # the oracle: its plain forward fails the same way
    import importlib.util

    spec = importlib.util.spec_from_file_location("deep_oracle", tmp_path / "deep.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(RecursionError):
        mod.Deep()(torch.randn(2, 4))
    r = invoke("grads", f"{tmp_path / 'deep.py'}:Deep", "--input", "randn:2x4", "--no-config")
    assert_one_line_error(r, 3, "levels deep", "recursion limit", "plain forward fails the same")


def test_config_attn_table_randint_input_and_errors_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.py").write_text((ROOT / "examples" / "tiny" / "net.py").read_text())
    cfg = tmp_path / "hookcli.toml"
    # a randint spec is a spec, not a file name; [attn] is a command table like the others
    cfg.write_text(
        'model = "net.py:Net"\ninput = "randint:0:5:2x2:float32"\n[attn]\nlayer = "l1"\n'
    )
    r = invoke("inspect", "-f", "json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["input"]["description"].startswith("randint:0:5:2x2")
    # an error about a value the config set names the file
    for line, needle in [
        ("topk = -5", "topk = -5 comes from"),
        ('device = "tpu"', 'device = "tpu" comes from'),
        ('layer = "nosuch"', 'layer = ["nosuch"] comes from'),
    ]:
        cfg.write_text(f'model = "net.py:Net"\ninput = "randn:2x2"\n{line}\n')
        r = invoke("inspect")
        assert_one_line_error(r, 2, needle, str(cfg))
    # given on the command line, it is not the config's
    r = invoke("inspect", "--device", "tpu")
    assert_one_line_error(r, 2, "unknown device 'tpu'")
    assert "comes from" not in r.stderr
    # the config's format is a default: an -o name typed on the command line picks its own
    # (a config's `format = "csv"` wrote CSV into r.json, and refused r.parquet); a value is
    # named as the file spells it, not as a Python object's repr (<Format.csv: 'csv'>)
    cfg.write_text('model = "net.py:Net"\ninput = "randn:2x2"\nformat = "csv"\n')
    out = tmp_path / "r.json"
    r = invoke("inspect", "-o", str(out))
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["model"]
    r = invoke("inspect")  # no -o: the config's format
    assert r.exit_code == 0, r.output
    header = next(csv.reader(io.StringIO(r.stdout)))
    assert len(header) > 3 and "layer" in header, header
    r = invoke("inspect", "-f", "json", "-o", str(tmp_path / "r.csv"))  # -f typed: it wins
    assert r.exit_code == 0 and json.loads((tmp_path / "r.csv").read_text())["model"]
    # both in the config, at odds: refused, each value as the file spells it
    cfg.write_text(
        'model = "net.py:Net"\ninput = "randn:2x2"\nformat = "csv"\noutput = "r.parquet"\n'
    )
    r = invoke("inspect")
    assert_one_line_error(r, 2, 'format = "csv" comes from')
    assert "<Format" not in r.stderr


def test_a_target_word_finds_the_classes_that_hold_it() -> None:
    import re

    cats = torchvision.models.ResNet18_Weights.IMAGENET1K_V1.meta["categories"]
    holding = [c for c in cats if re.search(r"\bcat\b", c.lower())]
    assert len(holding) > 1  # the oracle: torchvision's own label list
    run = ["resnet18", "--input", "randn:1x3x32x32", "-l", "fc", "--no-config"]
    r = invoke("grads", *run, "--target", "cat")
    assert_one_line_error(r, 2, f"{len(holding)} classes hold the word", *map(repr, holding[:3]))
    # a word only one class holds picks that class
    words = {w for c in cats for w in re.findall(r"[a-z]+", c.lower()) if len(w) > 5}
    unique = sorted(
        w for w in words
        if sum(bool(re.search(rf"\b{w}\b", c.lower())) for c in cats) == 1
        and w not in {c.lower() for c in cats}
    )  # fmt: skip
    word = unique[0]
    (index,) = [i for i, c in enumerate(cats) if re.search(rf"\b{word}\b", c.lower())]
    r = invoke("grads", *run, "--target", word, "-f", "json")
    assert r.exit_code == 0, r.output
    assert f"class {index} " in json.loads(r.stdout)["backward"]["source"]


def test_a_class_name_the_label_list_holds_twice_is_refused_with_both_indices() -> None:
    """timm's ImageNet labels name 'crane' twice (the bird, the machine) and 'maillot' twice:
    the name resolved silently to the last one. Oracle: timm's own label list."""
    timm = pytest.importorskip("timm")
    from timm.data import ImageNetInfo

    labels = [d.split(",")[0] for d in ImageNetInfo().label_descriptions()]  # its short names
    run = ["timm:resnet10t", "--input", "randn:1x3x32x32", "-l", "fc", "--no-config"]
    for word, option in (("crane", "--target"), ("maillot", "--loss")):
        same = [i for i, c in enumerate(labels) if c.lower() == word]
        assert len(same) == 2, (word, same)
        given = word if option == "--target" else f"ce:{word}"
        r = invoke("grads", *run, option, given)
        assert_one_line_error(r, 2, f"names 2 classes of this model: {same[0]} and {same[1]}")
    del timm


@pytest.mark.parametrize("given", ["crane ", "the crane", "crane bird", "maillot swimsuit"])
def test_a_name_held_twice_is_refused_inside_a_longer_text_too(given: str) -> None:
    """The word-inside fallback ('tabby cat' picks 'tabby') took the last of two classes that
    share a name; refused with both, as the name alone is."""
    from hookcli.engine.targets import parse_target
    from hookcli.errors import UsageError

    cats = ["goldfish", "crane", "tabby", "maillot", "crane", "maillot"]
    with pytest.raises(UsageError, match=r"names 2 classes of this model: (1 and 4|3 and 5)"):
        parse_target(given, None, cats)
    assert parse_target("tabby cat", None, cats).index == 2


def test_no_third_party_progress_bar_reaches_the_terminal(tmp_path: Path) -> None:
    """A sharded save_pretrained folder: transformers draws "Loading checkpoint shards" with
    carriage returns while it loads; hookcli turns such bars off."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        image_size=32, patch_size=16, num_labels=3,
    )  # fmt: skip
    folder = tmp_path / "sharded"
    ViTForImageClassification(config).save_pretrained(folder, max_shard_size="20KB")
    assert len(list(folder.glob("*.safetensors"))) > 1
    r = invoke("inspect", f"hf:{folder}", "--no-config", "-l", "classifier")
    assert r.exit_code == 0, r.output
    assert "\r" not in r.stderr and "\x1b" not in r.stderr and "shards" not in r.stderr, r.stderr


POOL = """
from concurrent.futures import ThreadPoolExecutor

from torch import nn


class Net(nn.Module):
    \"\"\"Three heads run by a thread pool in its forward.\"\"\"

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        with ThreadPoolExecutor(3) as pool:
            outs = list(pool.map(lambda h: h(x), self.heads))
        return outs[0] + outs[1] + outs[2]
"""


def test_diff_of_a_model_running_layers_in_threads(tmp_path: Path) -> None:
    """Layers called from the model's own threads: no traceback from a thread, and each
    layer compared with its own reference (the spill was written from three threads at once)."""
    (tmp_path / "pool.py").write_text(POOL)
    spec = f"{tmp_path / 'pool.py'}:Net"
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(5))
    torch.save(x, tmp_path / "x.pt")
    run = ["--input", str(tmp_path / "x.pt"), "--no-config", "-f", "json"]
    r = invoke("diff", spec, *run, "--b", "seed=0")
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.stderr and "Exception in thread" not in r.stderr
    rows = {c["name"]: c["b"][0] for c in json.loads(r.stdout)["calls"]}
    assert all(rows[f"heads.{i}"]["rel_l2"] == 0 for i in range(3)), rows
    r = invoke("diff", spec, *run, "--b", "float16", "--no-own")
    assert "Traceback" not in r.stderr and "Exception in thread" not in r.stderr
    rows = {c["name"]: c["b"][0] for c in json.loads(r.stdout)["calls"]}
    # the oracle: each head in float32 and in float16 on the same input, by hand
    import importlib.util

    loader = importlib.util.spec_from_file_location("pool_oracle", tmp_path / "pool.py")
    assert loader is not None and loader.loader is not None
    mod = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(mod)
    torch.manual_seed(0)
    model = mod.Net().eval()
    with torch.no_grad():
        for i, head in enumerate(model.heads):
            a = head(x).double()
            b = copy.deepcopy(head).half()(x.half()).double()
            want = float((b - a).norm() / a.norm())
            assert rows[f"heads.{i}"]["rel_l2"] == pytest.approx(want, rel=1e-3, abs=1e-7)


# ---------------------------------------------------------------- the review's findings


def test_a_script_annotation_that_calls_is_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (tmp_path / "s.py").write_text(
        "from torch import nn\n"
        f"x: open({str(marker)!r}, 'w').write('x') = 1\n\n"
        "class Net(nn.Linear):\n    def __init__(self):\n        super().__init__(2, 2)\n"
    )
    r = invoke("inspect", f"{tmp_path / 's.py'}:Net", "--input", "ones:2x2", "--no-config")
    assert r.exit_code == 0, r.output
    assert not marker.exists()


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        # a default value needs a skipped name: raised while the definitions run
        (
            "class Net(nn.Linear):\n    def __init__(self, n=WIDTH):\n"
            "        super().__init__(2, n)\n",
            "needs 'WIDTH', set at line 3",
        ),
        # the forward needs one: raised in the pass
        (
            "class Net(nn.Linear):\n    def __init__(self):\n        super().__init__(2, 2)\n\n"
            "    def forward(self, x):\n        return super().forward(x) * WIDTH\n",
            "forward needs 'WIDTH', set at line 3",
        ),
    ],
)
def test_a_name_set_by_skipped_code_is_explained_wherever_it_is_needed(
    tmp_path: Path, body: str, needle: str
) -> None:
    (tmp_path / "s.py").write_text(
        "import os\nfrom torch import nn\nWIDTH = int(os.environ.get('W', '2'))\n\n" + body
    )
    r = invoke("inspect", f"{tmp_path / 's.py'}:Net", "--input", "ones:2x2", "--no-config")
    assert_one_line_error(r, 2, needle, "does not run")


def test_bare_hookcli_still_shows_its_help() -> None:
    r = runner.invoke(app, [])
    assert "Usage: hookcli" in r.output and "error:" not in r.output


def test_a_config_value_is_named_only_where_the_error_is_about_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.py").write_text((ROOT / "examples" / "tiny" / "net.py").read_text())
    # seed 2 is no part of "2x3" (the shapes in the model's own error), and that error is
    # the model's (exit 3), not the config's
    (tmp_path / "hookcli.toml").write_text('model = "net.py:Net"\ninput = "randn:2x3"\nseed = 2\n')
    r = invoke("inspect")
    assert r.exit_code == 3 and "comes from" not in r.stderr, r.stderr


def test_an_endless_stop_grace_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from hookcli.runtime import supervise

    for raw, want in [("inf", 1e6), ("1e20", 1e6), ("nan", 10.0), ("-3", 0.0), ("x", 10.0)]:
        monkeypatch.setenv("HOOKCLI_STOP_GRACE_S", raw)
        assert supervise._grace() == want


def test_a_tests_leftovers_are_gone_before_the_next_one_a() -> None:
    """Tests must not depend on each other's leftovers (issue 48): this one leaves the
    recursion limit, the default dtype, the random state and the environment changed, as
    torch.compile, a float64 test or a seeded one would; the next one finds them as found."""
    sys.setrecursionlimit(54321)
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(12345)
    os.environ["HOOKCLI_LEFTOVER"] = "1"


def test_a_tests_leftovers_are_gone_before_the_next_one_b() -> None:
    assert sys.getrecursionlimit() != 54321
    assert torch.get_default_dtype() == torch.float32
    assert "HOOKCLI_LEFTOVER" not in os.environ
    torch.manual_seed(12345)
    seeded = torch.rand(3)
    from tests.support.process_state import AT_START

    torch.random.set_rng_state(AT_START[0].rng)
    assert not torch.equal(torch.rand(3), seeded)  # the generator is the suite's, not 12345's
