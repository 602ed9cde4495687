"""--channels (issue 36): per-channel statistics, kurtosis, massive activations and outlier
features, and check's rules on them. Oracles: torch in float64 on the retained tensor,
SmoothQuant's `get_act_scales` loop written out by hand, torch.ao's PerChannelMinMaxObserver,
and activations planted at known places in seeded models (found all, nothing else)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import hookcli
from hookcli.cli import app
from hookcli.engine.aggregate import Accumulator
from hookcli.engine.stats import StatsCollector
from tests.support.oracles import act_scales_by_hand, captured_outputs, hooks_left

runner = CliRunner()

# the statistics' two CPU paths, torch ops and the numba kernels (engine/_chankernels.py): the
# oracles hold for both; the second CI pass reruns the kernels' on generic x86-64
BACKENDS = [
    pytest.param("torch", id="torch"),
    pytest.param("kernel", id="kernel", marks=pytest.mark.kernels),
]


def _by_channel(t: torch.Tensor, axis: int) -> torch.Tensor:
    """(values, C) in float64: t with its channel dimension moved last."""
    return t.detach().double().movedim(axis, -1).reshape(-1, t.shape[axis])


def assert_channels_are_torchs(stats: Any, t: torch.Tensor, axis: int) -> None:
    ch = stats.channels
    assert ch is not None and ch.axis == axis
    x = _by_channel(t, axis)
    assert ch.count == [x.shape[0]] * x.shape[1]
    assert torch.allclose(torch.tensor(ch.mean, dtype=torch.float64), x.mean(0), rtol=1e-9)
    std = torch.tensor(ch.std, dtype=torch.float64)
    assert torch.allclose(std, x.std(0, correction=0), rtol=1e-9)
    assert ch.min == x.amin(0).tolist() and ch.max == x.amax(0).tolist()
    assert ch.absmax == x.abs().amax(0).tolist()
    assert ch.zeros == (x == 0).sum(0).tolist()
    assert ch.large == (x.abs() >= 6).sum(0).tolist()
    flat = t.detach().double().reshape(-1)
    dev = flat - flat.mean()
    kurt = (dev**4).mean() / (dev**2).mean() ** 2
    assert ch.kurtosis == pytest.approx(kurt.item(), rel=1e-9)
    if flat.abs().max() > 100:  # the median is what massive activations are judged by
        assert ch.median_abs == pytest.approx(flat.abs().median().item(), rel=1e-6)
    else:  # no activation can be massive: the median is not taken
        assert ch.median_abs is None


class TokenMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 24)
        self.act = nn.ReLU()
        self.down = nn.Linear(24, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class Convs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.act = nn.ReLU()
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.conv(x)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_channel_numbers_are_torchs_on_the_retained_tensor(backend: str) -> None:
    """Tokens (the last dimension) and NCHW (dim 1), every array against float64 torch."""
    torch.manual_seed(0)
    model, x = TokenMLP().eval(), torch.randn(2, 7, 16) * 3
    x[1, 4, 9] = 500.0  # one value past 100: that tensor's median is taken
    names = ["up", "act", "down"]
    kept = captured_outputs(model, x, names)
    report = hookcli.inspect(model, x, channels=True, layers=names, stats_backend=backend)
    for call in report.layers:
        assert_channels_are_torchs(call.outputs[0], kept[call.name], 2)
    assert_channels_are_torchs(report.layers[0].inputs[0], x, 2)
    assert hooks_left(model) == 0
    cnn, img = Convs().eval(), torch.randn(2, 3, 12, 10)
    kept = captured_outputs(cnn, img, ["conv", "act", "head"])
    report = hookcli.inspect(
        cnn, img, channels=True, layers=["conv", "act", "head"], stats_backend=backend
    )
    for call in report.layers:
        assert call.outputs[0].layout == "NCHW"
        assert_channels_are_torchs(call.outputs[0], kept[call.name], 1)
    relu = report.layers[1].outputs[0].channels
    assert relu is not None and relu.zeros == (kept["act"] == 0).sum((0, 2, 3)).tolist()


def test_without_channels_nothing_changes_and_the_json_says_null() -> None:
    torch.manual_seed(0)
    report = hookcli.inspect(TokenMLP(), torch.randn(1, 3, 16))
    assert report.outliers is None
    assert all(t.channels is None for c in report.layers for t in (*c.inputs, *c.outputs))


def test_masked_values_are_counted_apart_and_never_as_values() -> None:
    """Scores filled with the dtype's lowest value or -inf (a causal mask) are not values."""
    x = torch.randn(2, 5, 6)
    x[0, :, 1] = torch.finfo(torch.float32).min
    x[1, 2, 3] = -math.inf
    c = StatsCollector()
    c.channels = lambda ctx, shape: 2
    stats = c.add(x, "out")
    c.finalize()
    ch = stats.channels
    assert ch is not None and ch.masked == 5 + 1
    keep = x.clone()
    keep[0, :, 1] = math.nan
    keep[1, 2, 3] = math.nan
    flat = keep.double().reshape(-1, 6)
    assert ch.count == (~flat.isnan()).sum(0).tolist()
    assert ch.min == [flat[:, k][~flat[:, k].isnan()].min().item() for k in range(6)]
    assert ch.mean[1] == pytest.approx(flat[5:, 1].mean().item(), rel=1e-12)


@pytest.mark.kernels  # auto: the kernels, loaded by then (conftest)
def test_merged_parts_are_the_whole_tensors_numbers() -> None:
    """Two batches' channel statistics merged (a folder run, torchrun ranks) = one batch's."""
    torch.manual_seed(1)
    whole = torch.randn(6, 4, 10) * torch.linspace(0.1, 30, 10)
    whole[4, 2, 7] = 9000.0
    c = StatsCollector()
    c.channels = lambda ctx, shape: 2
    parts = [c.add(whole[:2], "out"), c.add(whole[2:], "out")]
    one = c.add(whole.clone(), "out")
    c.finalize()
    acc = Accumulator("out", "float32", (4, 10))
    for p in parts:
        acc.add(p)
    got, want = acc.stats().channels, one.channels
    assert got is not None and want is not None
    assert got.count == want.count and got.zeros == want.zeros and got.large == want.large
    assert got.min == want.min and got.max == want.max and got.absmax == want.absmax
    for a, b in ((got.mean, want.mean), (got.std, want.std)):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-12)
    assert [(m.index, m.value) for m in got.massive] == [(m.index, m.value) for m in want.massive]
    assert got.massive[0].index == [4, 2, 7]


class Planted(nn.Module):
    """A block that puts given values at given places of its output (the planted outliers)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.places: list[tuple[tuple[int, ...], float]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if self.places:
            y = y.clone()
            for where, value in self.places:
                y[where] = value
        return y


class Fan(nn.Module):
    """Blocks side by side on one input: each output holds its own planted values only."""

    def __init__(self, width: int, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Planted(width) for _ in range(n))

    def __getitem__(self, k: int) -> Planted:
        return self.blocks[k]  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([b(x) for b in self.blocks])


def _planted_model(seed: int) -> tuple[Fan, torch.Tensor, set[tuple[str, tuple[int, ...]]]]:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    width, depth = rng.choice([8, 16, 32]), rng.randint(2, 5)
    blocks = Fan(width, depth).eval()
    x = torch.randn(rng.randint(1, 3), rng.randint(4, 12), width)
    want = set()
    for _ in range(rng.randint(0, 4)):
        k = rng.randrange(depth)
        where = (rng.randrange(x.shape[0]), rng.randrange(x.shape[1]), rng.randrange(width))
        value = rng.choice([-1, 1]) * rng.uniform(2e3, 5e4)
        blocks[k].places.append((where, value))
        want.add((f"blocks.{k}", where))
    for _ in range(rng.randint(0, 3)):  # decoys: large, yet not massive
        k = rng.randrange(depth)
        where = (rng.randrange(x.shape[0]), rng.randrange(x.shape[1]), rng.randrange(width))
        if any(w == where for w, _ in blocks[k].places):
            continue
        blocks[k].places.append((where, rng.choice([60.0, -90.0, 150.0])))
    return blocks, x, want


@pytest.mark.parametrize("backend", BACKENDS)
def test_planted_massive_activations_are_all_found_and_nothing_else_over_60_models(
    backend: str,
) -> None:
    """Values past 100 and 1000x the median, planted at random places of random layers, are
    found with their layer, channel and position; decoys (|x| 60-150: under the 1000x) are not."""
    planted = found_right = 0
    for seed in range(60):
        model, x, want = _planted_model(seed)
        blocks = [f"blocks.{k}" for k in range(len(model.blocks))]
        report = hookcli.inspect(
            model, x, channels=True, topk=0, layers=blocks, stats_backend=backend
        )
        assert report.outliers is not None
        got = {(m.layer, tuple(m.index)) for m in report.outliers.massive}
        assert got == want, seed
        for m in report.outliers.massive:
            assert m.channel == m.index[2] and m.position == m.index[1]
            assert m.sequence == m.index[0]
        planted += len(want)
        found_right += len(got & want)
    assert planted > 60 and found_right == planted


@pytest.mark.kernels  # auto: the kernels, loaded by then (conftest)
def test_outlier_features_are_llm_int8s() -> None:
    """A channel at |x| >= 6 in 10% of the tokens of 3 of 5 layers is an outlier feature; one
    in a single layer (20%), or in 2% of the tokens, is not."""
    torch.manual_seed(0)
    model = Fan(16, 5).eval()
    x = torch.randn(1, 50, 16) * 0.1
    for k in range(3):
        model[k].places += [((0, t, 5), 7.0) for t in range(0, 50, 10)]  # 5 of 50 tokens
        model[k].places += [((0, 3, 9), -8.0)]  # 1 of 50: 2%
    model[0].places += [((0, t, 11), 6.5) for t in range(10)]  # one layer of five
    blocks = [f"blocks.{k}" for k in range(5)]
    report = hookcli.inspect(model, x, channels=True, topk=0, layers=blocks)
    assert report.outliers is not None
    features = [(f.channel, f.width, f.layers, f.of) for f in report.outliers.features]
    assert features == [(5, 16, 3, 5)]
    assert report.outliers.features[0].share == pytest.approx(0.1)


@pytest.mark.kernels  # auto: the kernels, loaded by then (conftest)
def test_linear_inputs_give_smoothquants_act_scales_and_the_observers_min_max(
    tmp_path: Path,
) -> None:
    """A padded batch of three texts through a tiny Llama: every Linear input's channel
    max|x| is SmoothQuant's act scale (sequence by sequence, no padding), its min/max the
    PerChannelMinMaxObserver's."""
    transformers = pytest.importorskip("transformers")
    from tests.support.llm import LINES, save

    folder = save(tmp_path / "llama", "llama")
    texts = [LINES[3], "hello", LINES[0]]
    report = hookcli.inspect(
        f"hf:{folder}", text=texts, device="cpu", types=["Linear"], channels=True, topk=0
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    sequences = [tok(t, return_tensors="pt")["input_ids"] for t in texts]
    truth = act_scales_by_hand(model, sequences)
    assert len(report.layers) == len(truth["scales"]) > 10
    for call in report.layers:
        ch = call.inputs[0].channels
        assert ch is not None, call.name
        scale = truth["scales"][call.name].double()
        assert torch.allclose(torch.tensor(ch.absmax, dtype=torch.float64), scale, rtol=1e-6)
        obs = truth["observers"][call.name]
        assert torch.allclose(torch.tensor(ch.min), obs.min_val, rtol=1e-6, atol=1e-7)
        assert torch.allclose(torch.tensor(ch.max), obs.max_val, rtol=1e-6, atol=1e-7)
        assert sum(ch.count) == sum(s.numel() for s in sequences) * len(ch.count)


def _run(*args: str) -> Any:
    return runner.invoke(app, list(args))


@pytest.mark.kernels  # auto: the kernels, loaded by then (conftest)
def test_check_fails_on_a_massive_activation_naming_where(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    r = _run(
        "check", "tests/support/models.py:MassiveAt", "--input", "randn:1x6x16",
        "--fail-on", "massive", "-f", "json", "-o", str(out),
    )  # fmt: skip
    assert r.exit_code == 1, (r.stdout, r.stderr)
    data = json.loads(out.read_text())
    (check,) = [c for c in data["checks"] if c["rule"] == "massive"]
    first = check["failures"][0]
    assert (first["layer"], first["call"], first["channel"], first["position"]) == (
        "spike", 0, 3, 2,
    )  # fmt: skip
    assert first["value"] == 4000.0
    assert data["outliers"]["massive"][0]["index"] == [0, 2, 3]
    ok = _run("check", "tests/support/models.py:MassiveAt", "--input", "randn:1x6x16",
              "--max-kurtosis", "1e9", "--max-outlier-ratio", "1e9")  # fmt: skip
    assert ok.exit_code == 0, (ok.stdout, ok.stderr)
    bad = _run("check", "tests/support/models.py:MassiveAt", "--input", "randn:1x6x16",
               "--max-outlier-ratio", "5")  # fmt: skip
    assert bad.exit_code == 1 and "outlier-ratio" in bad.stdout
    assert "channel 3's max|x|" in bad.stdout
    wrong = _run("check", "tests/support/models.py:MassiveAt", "--input", "randn:1x6x16",
                 "--max-kurtosis", "-1")  # fmt: skip
    assert wrong.exit_code == 2 and "--max-kurtosis" in wrong.stderr


def test_inspect_channels_shows_the_tables(tmp_path: Path) -> None:
    r = _run(
        "inspect", "tests/support/models.py:MassiveAt", "--input", "randn:1x6x16", "--channels"
    )
    assert r.exit_code == 0, (r.stdout, r.stderr)
    assert "outlier ratio" in r.stdout and "kurtosis" in r.stdout
    assert "massive activations (largest first)" in r.stdout
    assert "spike call 0 out: 4000 at channel 3, sequence 0 position 2" in r.stdout


@pytest.mark.kernels  # auto: the kernels, loaded by then (conftest)
def test_rank_reports_merge_to_the_whole_runs_channels_and_outliers() -> None:
    """Two shards' JSON reports (a torchrun's ranks) merged: per-channel numbers and the
    outliers are one run's over all the data."""
    from hookcli.engine.aggregate import merge_reports

    torch.manual_seed(3)
    model, x = TokenMLP().eval(), torch.randn(4, 5, 16)
    x[3, 1, 2] = 8000.0
    whole = hookcli.inspect(model, x, channels=True, topk=0)
    parts = [hookcli.inspect(model, x[:2], channels=True, topk=0),
             hookcli.inspect(model, x[2:], channels=True, topk=0)]  # fmt: skip
    merged = merge_reports([json.loads(json.dumps(p.to_dict())) for p in parts])
    for got, want in zip(merged["layers"], whole.layers, strict=True):
        for kind in ("inputs", "outputs"):
            for g, w in zip(got[kind], getattr(want, kind), strict=True):
                gc, wc = g["channels"], w.channels
                for key in ("count", "zeros", "large"):
                    assert gc[key] == getattr(wc, key), key
                # another batch size rounds the matmuls otherwise: a float32 ulp or so
                for key in ("min", "max", "absmax", "mean", "std"):
                    assert gc[key] == pytest.approx(getattr(wc, key), rel=1e-5, abs=1e-6), key
    assert whole.outliers is not None
    want = [(m["layer"], m["index"]) for m in dataclasses_asdict(whole.outliers)["massive"]]
    assert [(m["layer"], m["index"]) for m in merged["outliers"]["massive"]] == want
    assert want and want[0] == ("up", [3, 1, 2])


def dataclasses_asdict(x: Any) -> Any:
    import dataclasses

    return dataclasses.asdict(x)


class PlantedConv(nn.Module):
    """Convolutions side by side on one image (values are planted in their NCHW outputs)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(3, 6, 3, padding=1) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([conv(x) for conv in self.convs])


def _plant(places: list[tuple[tuple[int, ...], float]]) -> Any:
    """A forward hook (registered before hookcli's) that writes the planted values."""

    def hook(m: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        for where, value in places:
            out[where] = value
        return out

    return hook


@pytest.mark.parametrize("backend", BACKENDS)
def test_planted_massive_activations_in_cnns_and_tiny_lms_are_found_exactly(
    backend: str,
) -> None:
    """40 seeded CNNs (NCHW: channel dim 1) and 12 tiny random Llamas (planted in each
    block's MLP output, the residual stream's source): every planted value found with its
    layer, channel and position; nothing else."""
    for seed in range(40):
        rng = random.Random(seed)
        torch.manual_seed(seed)
        n = rng.randint(1, 3)
        model = PlantedConv(n).eval()
        x = torch.randn(rng.randint(1, 2), 3, 8, 8)
        want = set()
        for k in range(n):
            places = []
            for _ in range(rng.randint(0, 3)):
                where = tuple(rng.randrange(d) for d in (x.shape[0], 6, 8, 8))
                places.append((where, rng.choice([-1, 1]) * rng.uniform(3e3, 4e4)))
                want.add((f"convs.{k}", where))
            model.convs[k].register_forward_hook(_plant(places))
        report = hookcli.inspect(
            model, x, channels=True, topk=0, layers=["convs.*"], stats_backend=backend
        )
        assert report.outliers is not None
        got = {(m.layer, tuple(m.index)) for m in report.outliers.massive}
        assert got == want, seed
        assert all(m.channel == m.index[1] and m.position is None for m in report.outliers.massive)
    transformers = pytest.importorskip("transformers")
    from tests.support.llm import llama_config

    for seed in range(12):
        rng = random.Random(seed)
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(llama_config()).eval()
        ids = torch.randint(3, 300, (rng.randint(1, 2), rng.randint(4, 10)))
        want = set()
        for k in range(2):
            places = []
            if rng.random() < 0.7:
                where = (
                    rng.randrange(ids.shape[0]),
                    rng.randrange(ids.shape[1]),
                    rng.randrange(32),
                )
                places.append((where, rng.choice([-1, 1]) * rng.uniform(2e3, 2e4)))
                want.add((f"model.layers.{k}.mlp.down_proj", where))
            model.model.layers[k].mlp.down_proj.register_forward_hook(_plant(places))
        layers = ["model.layers.*.mlp.down_proj"]
        report = hookcli.inspect(
            model, ids, channels=True, topk=0, layers=layers, stats_backend=backend
        )
        assert report.outliers is not None
        got = {(m.layer, tuple(m.index)) for m in report.outliers.massive}
        assert got == want, seed


@pytest.mark.kernels  # auto: the kernels, loaded by then (conftest)
def test_a_folder_runs_channels_are_one_batchs() -> None:
    """Two images in batches of one (a folder run) = the same two in one batch."""
    from tests.support.paths import CAT, COFFEE

    files = [str(CAT), str(COFFEE)]
    layers = ["conv1", "layer1.0.relu"]
    kw: dict[str, Any] = {"layers": layers, "device": "cpu", "channels": True, "topk": 0}
    folder = hookcli.inspect("resnet18", files, batch_size=1, **kw)
    whole = hookcli.inspect("resnet18", files, **kw)
    assert "2 batches" in folder.input.description
    for got, want in zip(folder.layers, whole.layers, strict=True):
        g, w = got.outputs[0].channels, want.outputs[0].channels
        assert g is not None and w is not None and g.axis == w.axis == 1
        assert g.count == w.count and g.zeros == w.zeros and g.large == w.large
        for key in ("min", "max", "absmax", "mean", "std"):
            assert getattr(g, key) == pytest.approx(getattr(w, key), rel=1e-4, abs=1e-5), key
    assert folder.outliers is not None and whole.outliers is not None


def test_a_training_log_refuses_the_model_rules(tmp_path: Path) -> None:
    """A log records no per-channel numbers nor routing: those rules are one-line errors."""
    model = TokenMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = tmp_path / "run.jsonl"
    with hookcli.watch(model, optimizer=opt, log=str(log)) as w:
        for _ in range(2):
            loss = model(torch.randn(2, 3, 16)).square().mean()
            w.loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
    for extra, needle in [
        (["--fail-on", "massive"], "--fail-on massive reads a model's run"),
        (["--fail-on", "dead-experts"], "--fail-on dead-experts"),
        (["--max-kurtosis", "3"], "--max-kurtosis is for checking a model"),
        (["--heads"], "--heads is for checking a model"),
        (["--max-saved-mb", "1"], "--max-saved-mb is for checking a model"),  # (was ignored)
    ]:
        r = runner.invoke(app, ["check", str(log), *extra])
        assert r.exit_code == 2, (extra, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (extra, r.stderr)


def test_a_conv1d_s_channels_are_dim_1() -> None:
    from hookcli.commands.outliers import channel_axis, chooser

    assert channel_axis((2, 8, 50), None) == 2 and channel_axis((2, 8, 50), None, first=True) == 1
    choose = chooser(lambda name, shape: None, {"conv": "Conv1d", "proj": "Linear"})
    assert choose(("conv", 0, "out"), (2, 8, 50)) == 1
    assert choose(("proj", 0, "out"), (2, 8, 50)) == 2
    assert choose(("conv", 0, "grad_output"), (2, 8, 50)) is None


def _layouts() -> list[tuple[str, torch.Tensor, int]]:
    """Tensors the kernels read in each of their ways: rows (channel last, or channels-last
    memory), planes (NCHW, read in place), copied (a transposed view), split among threads
    (past PARALLEL_MIN elements), every float dtype, a mean far from zero, zeros and values
    past 6, and massive values (the median and the top taken)."""
    g = torch.Generator().manual_seed(3)
    big = torch.randn(700, 96, generator=g) * torch.linspace(0.1, 9, 96)
    big[17, 40] = -7000.0
    relu = torch.randn(4, 24, 16, 16, generator=g).clamp(min=0)
    relu[2, 5, 3, 9] = 4000.0
    return [
        ("tokens", torch.randn(2, 9, 40, generator=g) * 3, 2),
        ("tokens split", big, 1),
        ("tokens split serial-sized", big[:200, :60].contiguous(), 1),
        ("far from zero", torch.randn(300, 17, generator=g, dtype=torch.float64) + 1e6, 1),
        ("nchw", relu, 1),
        ("channels last", relu.to(memory_format=torch.channels_last), 1),
        ("transposed", torch.randn(6, 11, 5, generator=g).transpose(0, 2), 1),
        ("bfloat16", (torch.randn(3, 8, 24, generator=g) * 20).bfloat16(), 2),
        ("float16", (torch.randn(2, 16, 6, 5, generator=g) * 200).half(), 1),
        ("conv1d", torch.randn(2, 12, 33, generator=g), 1),
        ("float64 nchw massive", relu.double() * 1e3, 1),
        ("one channel", torch.randn(50, 1, generator=g), 1),
        ("pooled", torch.randn(3, 7, 1, 1, generator=g), 1),
    ]


@pytest.mark.parametrize("case", _layouts(), ids=lambda c: c[0])
def test_the_torch_ops_give_torchs_numbers_in_every_layout_and_leave_the_tensor(
    case: tuple[str, torch.Tensor, int],
) -> None:
    """--channels by torch ops (no numba, or before it loads): float64 torch's numbers, and
    the measured tensor as it was (a float64 tensor is not widened into a copy of its own)."""
    _, x, axis = case
    kept = x.clone()
    c = StatsCollector(backend="torch")
    c.channels = lambda ctx, shape: axis
    stats = c.add(x, "out")
    c.finalize()
    assert torch.equal(x, kept)
    assert_channels_are_torchs(stats, x, axis)


@pytest.mark.kernels
@pytest.mark.parametrize("threads", [None, 3], ids=["threads as loaded", "rows in 3 parts"])
@pytest.mark.parametrize("case", _layouts(), ids=lambda c: c[0])
def test_the_channel_kernels_give_torchs_numbers_in_every_layout(
    case: tuple[str, torch.Tensor, int], threads: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--channels by the numba kernels, against float64 torch on the same tensor, and the
    kernels are what measured it (the torch path is never called); rows split in uneven
    parts (3, past any row count here where one part is empty) give the same numbers."""
    from hookcli.engine import channels as channels_mod
    from hookcli.engine import stats as stats_mod

    if stats_mod.kernels() is None:
        pytest.skip("numba unavailable")
    if threads is not None:
        from hookcli.engine import _chankernels

        monkeypatch.setattr(_chankernels, "threads", lambda: threads)
        monkeypatch.setattr(_chankernels, "PARALLEL_MIN", 0)
    _, x, axis = case
    kept = x.clone()
    torch_path: list[object] = []
    monkeypatch.setattr(channels_mod, "_every_value_counts", lambda *a: torch_path.append(a))
    by_kernels = channels_mod._by_kernels
    kernel_path: list[object] = []

    def spy(*args: Any) -> Any:
        kernel_path.append(by_kernels(*args))
        return kernel_path[-1]

    monkeypatch.setattr(channels_mod, "_by_kernels", spy)
    c = StatsCollector(backend="kernel")
    c.channels = lambda ctx, shape: axis
    stats = c.add(x, "out")
    c.finalize()
    assert torch_path == [] and len(kernel_path) == 1 and kernel_path[0] is not None
    assert torch.equal(x, kept)
    assert_channels_are_torchs(stats, x, axis)
    absx = x.double().abs()
    if absx.max() > 100 and absx.max() > 1000 * absx.median():  # planted: massive
        found = stats.channels.massive  # type: ignore[union-attr]
        peak = int(absx.argmax())
        assert found and found[0].index == list(torch.unravel_index(torch.tensor(peak), x.shape))


@pytest.mark.kernels
def test_the_kernels_leave_nonfinite_and_masked_tensors_to_the_careful_path() -> None:
    """NaN, Inf or a mask's lowest value anywhere: the kernels' fast-math figures are not
    trusted; the numbers are the general path's, which keeps them out."""
    from hookcli.engine import stats as stats_mod

    if stats_mod.kernels() is None:
        pytest.skip("numba unavailable")
    x = torch.randn(40, 8)
    cases = [x.clone(), x.clone(), x.clone()]
    cases[0][3, 2] = math.nan
    cases[1][5, 1] = math.inf
    cases[2][:, 6] = torch.finfo(torch.float32).min
    for t in cases:
        got = []
        for backend in ("kernel", "torch"):
            c = StatsCollector(backend=backend)
            c.channels = lambda ctx, shape: 1
            got.append(c.add(t, "out"))
            c.finalize()
        a, b = (s.channels for s in got)
        assert a is not None and b is not None
        assert (a.count, a.min, a.max, a.zeros, a.masked) == (
            b.count,
            b.min,
            b.max,
            b.zeros,
            b.masked,
        )
        assert a.count != [40] * 8
