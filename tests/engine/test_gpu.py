"""GPU paths. Skipped on machines without CUDA (this project's CI has none); run them where
a GPU exists: the hooked pass must not synchronise with the host (docs/traps.md §8)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision
from typer.testing import CliRunner

import hookcli
from hookcli.cli import app
from hookcli.records import Report
from tests.support.oracles import assert_stats_match
from tests.support.paths import CAT

# HOOKCLI_TEST_DEVICE=cpu runs the device-generic tests below on the CPU (a check of the tests
# where no GPU is); benchmarks/gpu_check.sh runs them all on "cuda"
DEVICE = os.environ.get("HOOKCLI_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="no CUDA device"),
]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
runner = CliRunner()


@contextlib.contextmanager
def _no_sync() -> Iterator[None]:
    """The block raises on any host synchronisation (docs/traps.md §8)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_cuda
def test_hooked_pass_never_synchronises_and_matches_the_oracle() -> None:
    from benchmarks.gpu_figures import NoSync
    from hookcli.engine.stats import StatsCollector

    # the sync debug mode is on inside the model's forward, where every hook fires; the run's
    # one transfer of the statistics after the pass is allowed
    model = NoSync(torchvision.models.resnet18().eval().cuda())
    x = torch.randn(2, 3, 224, 224, device="cuda")
    c = StatsCollector()
    t = torch.randn(1000, device="cuda")
    t[::7] = float("nan")
    with _no_sync():
        entry = c.add(t, "x")
    report = hookcli.inspect(model, x, device="cuda", topk=0)
    c.finalize()
    assert_stats_match(entry, t.cpu())
    assert report.device.startswith("cuda") and report.layers
    assert [c.error for c in report.layers if c.error] == []  # a hook that synchronised


@needs_cuda
def test_profile_on_cuda_uses_events() -> None:
    model = torchvision.models.resnet18().eval().cuda()
    x = torch.randn(2, 3, 224, 224, device="cuda")
    report = hookcli.inspect(model, x, device="cuda", topk=0, profile=True)
    assert report.profile is not None
    assert all(c.profile is not None and c.profile.forward_ms > 0 for c in report.layers)


# ---------------------------------------------------------------- issue 33: every command there


def _json(*args: str) -> dict[str, object]:
    r = runner.invoke(app, [*args, "--device", DEVICE, "--no-config"])
    assert r.exit_code in (0, 1), r.output
    return json.loads(r.stdout)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "args",
    [
        ["inspect", "resnet18", str(CAT), "-f", "json"],
        ["grads", "resnet18", str(CAT), "-l", "layer4.*", "-f", "json"],
        ["check", "resnet18", str(CAT), "--fail-on", "nonfinite", "--backward", "-f", "json"],
        ["diff", "resnet18", str(CAT), "--b", "bfloat16", "-l", "layer1.*", "-f", "json"],
    ],
)
def test_every_command_runs_on_the_device(args: list[str]) -> None:
    report = _json(*args)
    assert str(report["device"]).startswith(DEVICE), report["device"]


def test_pictures_run_on_the_device(tmp_path: Path) -> None:
    for command, extra in (("cam", ["-l", "layer4"]), ("maps", ["-l", "layer1.0.conv1"])):
        png = tmp_path / f"{command}.png"
        r = runner.invoke(
            app, [command, "resnet18", str(CAT), *extra, "-o", str(png), "--device", DEVICE]
        )
        assert r.exit_code == 0, r.output
        assert png.stat().st_size > 0
    png = tmp_path / "attn.png"
    r = runner.invoke(app, ["attn", "vit_b_16", str(CAT), "-o", str(png), "--device", DEVICE])
    assert r.exit_code == 0, r.output


def _on_both(run: Any, size: int) -> tuple[Report, Report]:
    """`run` (hookcli.inspect or grads) of a resnet18 (seed 0) on two size x size images, on
    the CPU and on DEVICE, in float32 with TF32 off (then as it was)."""
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        torch.manual_seed(0)
        model = torchvision.models.resnet18().eval()
        x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))
        return run(model, x, device="cpu", topk=0), run(model, x, device=DEVICE, topk=0)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def test_statistics_on_the_device_equal_the_cpus() -> None:
    """float32 with TF32 off: the device's statistics are the CPU's within float tolerance."""
    here, there = _on_both(hookcli.inspect, 96)
    assert [c.name for c in here.layers] == [c.name for c in there.layers]
    for a, b in zip(here.layers, there.layers, strict=True):
        for ta, tb in zip(a.outputs, b.outputs, strict=True):
            for stat in ("mean", "std", "min", "max", "norm"):
                va, vb = getattr(ta, stat), getattr(tb, stat)
                assert vb == pytest.approx(va, rel=1e-3, abs=1e-4), (a.name, stat)
            assert ta.zeros == pytest.approx(tb.zeros, abs=1e-3)


def test_grads_weights_and_gradients_on_the_device_equal_the_cpus() -> None:
    """Issue 52: grads' weights and gradients, started together on the device (one launch a
    dtype), give the CPU's norms and gradient statistics within float tolerance."""
    here, there = _on_both(hookcli.grads, 64)
    pairs = [
        (pa, pb)
        for a, b in zip(here.layers, there.layers, strict=True)
        for pa, pb in zip(a.params or (), b.params or (), strict=True)
    ]
    assert len(pairs) > 40
    for pa, pb in pairs:
        assert pa.name == pb.name
        assert pb.norm == pytest.approx(pa.norm, rel=1e-5), pa.name
        assert pb.grad_norm == pytest.approx(pa.grad_norm, rel=1e-3, abs=1e-6), pa.name
        assert pb.grad_mean == pytest.approx(pa.grad_mean, rel=1e-2, abs=1e-6), pa.name


def test_a_folder_run_on_the_device(tmp_path: Path) -> None:
    for i in range(3):
        (tmp_path / f"{i}.jpeg").write_bytes(CAT.read_bytes())
    report = _json("inspect", "resnet18", str(tmp_path), "--batch-size", "2", "-f", "json")
    assert str(report["device"]).startswith(DEVICE)
    assert str(report["input"]["description"]).startswith("3 images")  # type: ignore[index]


def test_watch_with_a_grad_scaler_on_the_device(tmp_path: Path) -> None:
    device = torch.device(DEVICE)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=4).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler(device.type)
    half = torch.float16 if device.type == "cuda" else torch.bfloat16
    with hookcli.watch(model, optimizer=opt, every=2, log=tmp_path / "run.jsonl", scaler=scaler):
        for _ in range(4):
            x = torch.randn(2, 3, 64, 64, device=device)
            y = torch.randint(0, 4, (2,), device=device)
            opt.zero_grad()
            with torch.autocast(device.type, dtype=half):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
            scaler.step(opt)
            scaler.update()
    steps = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if s["kind"] == "step"] == [0, 2]
    assert all(s["layers"] for s in steps if s["kind"] == "step")


@needs_cuda
def test_a_padded_token_batch_is_measured_without_a_sync_per_tensor() -> None:
    """The padding mask is read once (set_token_mask); each (batch, tokens, C) output and each
    (batch, heads, tokens, tokens) attention is then measured at its real positions, and its
    per-token rows computed, on the device with no host synchronisation."""
    from hookcli.engine.stats import StatsCollector

    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    hidden = torch.randn(2, 6, 16, generator=g)
    attn = torch.softmax(torch.randn(2, 4, 6, 6, generator=g), dim=-1)
    c = StatsCollector()
    c.set_token_mask(mask.cuda())
    c.per_token = (2, 6)
    on_device = hidden.cuda(), attn.cuda()
    with _no_sync():
        h = c.add(on_device[0], "out")
        a = c.add(on_device[1], "out.attn")
    c.finalize()
    assert_stats_match(h, hidden[mask], rtol=1e-5, same_tensor=False)
    assert_stats_match(a, attn.permute(0, 2, 1, 3)[mask], rtol=1e-5, same_tensor=False)
    rows = h.per_token  # every position's row (the report leaves the padding's out later)
    assert rows is not None and len(rows) == mask.numel()
    for r in rows:
        x = hidden[r.sequence, r.position].double()
        assert r.norm == pytest.approx(float(x.norm()), rel=1e-5)
        assert r.max_abs == pytest.approx(float(x.abs().max()), rel=1e-5)
        assert r.channel == int(x.abs().argmax())


def test_a_language_models_text_run_on_the_device_equals_the_cpus(tmp_path: Path) -> None:
    """A saved tiny Llama and its tokenizer, a padded batch of two texts with --per-token: the
    device's statistics, next tokens and per-token rows are the CPU's within float tolerance."""
    pytest.importorskip("transformers")
    from tests.support.llm import LINES, save

    torch.backends.cuda.matmul.allow_tf32 = False
    folder = save(tmp_path / "tiny", "llama")
    texts = [LINES[0], "hello world"]
    layers = ["model.layers.0", "model.norm", "lm_head"]
    kw: dict[str, object] = {"text": texts, "layers": layers, "per_token": True, "topk": 3}
    here = hookcli.inspect(f"hf:{folder}", device="cpu", **kw)
    there = hookcli.inspect(f"hf:{folder}", device=DEVICE, **kw)
    assert there.device.startswith(DEVICE)

    def top1(r: Report) -> list[tuple[int, int]]:
        return [(p.image, p.index) for p in r.predictions or [] if p.rank == 1]

    assert top1(there) == top1(here) and len(top1(here)) == 2
    for a, b in zip(here.layers, there.layers, strict=True):
        assert a.name == b.name
        ta, tb = a.outputs[0], b.outputs[0]
        assert tb.numel == ta.numel and tb.note == ta.note
        for stat in ("mean", "std", "min", "max", "norm"):
            assert getattr(tb, stat) == pytest.approx(getattr(ta, stat), rel=1e-3, abs=1e-4)
        assert ta.per_token is not None and tb.per_token is not None
        assert len(tb.per_token) == len(ta.per_token)
        for ra, rb in zip(ta.per_token, tb.per_token, strict=True):
            assert (rb.sequence, rb.position, rb.id) == (ra.sequence, ra.position, ra.id)
            assert rb.norm == pytest.approx(ra.norm, rel=1e-3, abs=1e-4)


def test_generate_on_the_device_makes_transformers_tokens_and_the_cpus_statistics(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """--generate on the device (issue 52 item 4): the new tokens are model.generate's there,
    one call of each hooked layer per step, each step's statistics the CPU run's within float
    tolerance."""
    pytest.importorskip("transformers")
    import transformers

    from tests.support.llm import LINES, save

    matmul, tf32 = torch.backends.cuda.matmul, torch.backends.cuda.matmul.allow_tf32
    matmul.allow_tf32 = False  # (put back after: monkeypatch cannot undo this module's setting)
    request.addfinalizer(lambda: setattr(matmul, "allow_tf32", tf32))
    folder = save(tmp_path / "tiny", "llama")
    kw: dict[str, object] = {"text": LINES[0], "generate": 3, "layers": ["model.norm", "lm_head"]}
    here = hookcli.inspect(f"hf:{folder}", device="cpu", **kw)
    there = hookcli.inspect(f"hf:{folder}", device=DEVICE, **kw)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval().to(DEVICE)
    enc = transformers.AutoTokenizer.from_pretrained(folder)(LINES[0], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **enc.to(DEVICE), max_new_tokens=3, do_sample=False, pad_token_id=0
        )  # fmt: skip
    new = out[:, enc["input_ids"].shape[1] :].tolist()
    assert [g.ids for g in there.generated or []] == new
    assert [g.ids for g in here.generated or []] == new
    assert [(c.name, c.call) for c in there.layers] == [(c.name, c.call) for c in here.layers]
    assert sorted({c.call for c in there.layers}) == [0, 1, 2]
    for a, b in zip(here.layers, there.layers, strict=True):
        ta, tb = a.outputs[0], b.outputs[0]
        assert tb.shape == ta.shape and tb.numel == ta.numel
        for stat in ("mean", "std", "min", "max", "norm"):
            assert getattr(tb, stat) == pytest.approx(getattr(ta, stat), rel=1e-3, abs=1e-4)


# ---------------------------------------------------------------- issue 39: --memory on a GPU


@needs_cuda
def test_memory_on_cuda_reads_allocator_peaks_without_synchronising() -> None:
    from benchmarks.gpu_figures import NoSync

    torch.manual_seed(0)
    model = NoSync(torchvision.models.resnet18().eval().cuda())
    x = torch.randn(4, 3, 112, 112, device="cuda")
    report = hookcli.grads(model, x, device="cuda", memory=True, target="sum", topk=0)
    assert [c.error for c in report.layers if c.error] == []  # a hook that synchronised
    mem = report.memory
    assert mem is not None and mem.measured_peak is not None and mem.saved_bytes
    assert mem.measured_peak >= mem.parameter_bytes + mem.saved_bytes
    calls = [c.memory for c in report.layers if c.memory is not None]
    assert calls and all(m.peak_bytes is not None and m.peak_bytes > 0 for m in calls)
    assert max(m.peak_bytes or 0 for m in calls) <= mem.measured_peak
    assert sum(1 for m in calls if m.saved_bytes) > len(calls) // 2


@needs_cuda
def test_cuda_rows_come_from_the_fused_kernel_bitwise_and_without_a_sync(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 52: a CUDA float tensor's row is the Triton kernel's (one read, one launch in the
    pass, the rows merged together at finalize: engine/_triton.Pool), with no host
    synchronisation, equal to float64 torch and bitwise the same when measured again, and
    bitwise `_triton.row`'s (two launches); integers too, widened to float64 first."""
    pytest.importorskip("triton")
    from hookcli.engine import _triton
    from hookcli.engine.stats import StatsCollector

    launched: list[int] = []
    original = _triton.Pool.add
    monkeypatch.setattr(
        _triton.Pool, "add", lambda self, x, **k: launched.append(1) or original(self, x, **k)
    )
    g = torch.Generator(device="cuda").manual_seed(0)
    dirty = torch.randn(3 * 4096 + 5, device="cuda", generator=g)
    dirty[::97] = float("nan")
    dirty[::5] = 0.0
    cases = [
        dirty,
        torch.randn((1 << 22) + 12345, device="cuda", generator=g) * 1e-3 + 1000,  # > a chunk
        torch.randn(5000, device="cuda", generator=g).bfloat16(),
        torch.randn(64, 7, device="cuda", generator=g).half().t(),  # gapped: copied dense
        torch.randn(100, device="cuda", generator=g, dtype=torch.float64),
        torch.full((9000,), 0.1, device="cuda"),
        torch.randint(0, 5, (100,), device="cuda"),
    ]
    rows = []
    for _ in range(2):
        c = StatsCollector()
        with _no_sync():
            got = [c.add(t, f"x{k}") for k, t in enumerate(cases)]
        c.finalize()
        rows.append(got)
    assert len(launched) == 2 * len(cases)  # every case, twice, the integers as float64
    for t, first, second in zip(cases, *rows, strict=True):
        assert_stats_match(first, t.cpu())
        assert first == second  # every figure, exactly
    # a layer call's tensors (quick: the plain ones launched as they lie) give the same rows
    c = StatsCollector()
    with _no_sync():
        quick = [c.quick(t, f"x{k}") for k, t in enumerate(cases)]
    c.finalize()
    assert len(launched) == 3 * len(cases)
    assert quick == rows[0]
    # the pool's rows (one launch each, merged together) are the two launches' bit for bit
    flats = [t.reshape(-1).contiguous() for t in cases]
    flats = [f if f.is_floating_point() else f.double() for f in flats]
    pool = _triton.Pool()
    places = [pool.add(f) for f in flats]
    pooled = pool.rows()
    for f, at in zip(flats, places, strict=True):
        assert pooled[at].view(torch.int64).equal(_triton.row(f).view(torch.int64))


@needs_cuda
def test_cuda_tensors_started_together_are_each_ones_row_bitwise_without_a_sync(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 52: many CUDA tensors measured whole (a model's weights, their gradients) are
    started by one launch a dtype (`_triton.Pool.add_many`), with no host synchronisation, each
    row bitwise `_triton.row`'s and equal to float64 torch."""
    pytest.importorskip("triton")
    from hookcli.engine import _triton
    from hookcli.engine.stats import StatsCollector

    launched: list[str] = []
    for name in ("add", "add_many"):
        real = getattr(_triton.Pool, name)
        monkeypatch.setattr(
            _triton.Pool,
            name,
            lambda self, x, _real=real, _name=name, **k: (
                launched.append(_name) or _real(self, x, **k)
            ),
        )
    g = torch.Generator(device="cuda").manual_seed(1)
    big = torch.randn(3 * 4096 + 7, device="cuda", generator=g)
    cases = [
        torch.randn(512, 64, 3, 3, device="cuda", generator=g),
        big[4096:],  # a view: its address inside another's storage
        torch.randn(10, device="cuda", generator=g),
        torch.randn(64, 3, device="cuda", generator=g).bfloat16(),
        torch.randn(9000, device="cuda", generator=g).bfloat16(),
    ]
    c = StatsCollector()
    with _no_sync():
        got = c.add_whole([(t, f"w{k}") for k, t in enumerate(cases)])
    c.finalize()
    assert launched == ["add_many", "add_many"]  # float32, bfloat16
    for t, stats in zip(cases, got, strict=True):
        assert_stats_match(stats, t.cpu())
    pool = _triton.Pool()
    places = pool.add_many([t.reshape(-1) for t in cases[:3]])
    pooled = pool.rows()
    for t, at in zip(cases[:3], places, strict=True):
        assert pooled[at].view(torch.int64).equal(_triton.row(t).view(torch.int64))
    # and by construction, not by the luck of these values: the compiled kernels lay a block's
    # elements over the threads alike (the order of the sums), for each dtype
    for t in cases[3:]:  # (the bfloat16 ones measured alone too: their kernels compiled)
        _triton.row(t)
    for dtype in (torch.float32, torch.bfloat16):
        together, alone = _layouts(_triton._BLOCKS_AT, dtype), _layouts(_triton._BLOCKS, dtype)
        assert together and together <= alone, (dtype, together, alone)


@needs_cuda
def test_cuda_memoryless_zeros_are_never_read_where_they_lie() -> None:
    """A CUDA ZeroTensor (data_ptr 0) is measured as zeros, not handed to a kernel that would
    read address 0 (and leave the device unusable)."""
    from hookcli.engine.stats import StatsCollector

    c = StatsCollector()
    z = torch._efficientzerotensor((300, 400), device="cuda")
    got = [c.add(z, "a"), c.quick(z, "q"), *c.add_whole([(z, "w")])]
    c.finalize()
    torch.cuda.synchronize()
    for s in got:
        assert (s.numel, s.mean, s.std, s.norm, s.zeros) == (120000, 0, 0, 0, 1.0)


def _layouts(fast: Any, dtype: torch.dtype) -> set[str]:
    """The thread layouts in the compiled kernels of a `_launch.Fast` for 16-byte-aligned
    tensors of `dtype` (Triton's GPU IR)."""
    import re

    return {
        layout
        for key, compiled in fast._compiled.items()
        if key[1] == (dtype, True)
        for layout in re.findall(r"sizePerThread = \[[^\]]*\]", compiled.asm["ttgir"])
    }


@needs_cuda
def test_cuda_per_token_rows_come_from_the_kernel_in_one_launch_without_a_sync(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 52: --per-token on CUDA is the Triton kernel's, one launch per tensor, with no
    host synchronisation, equal to float64 torch's rows on the CPU and bitwise the same run
    to run; HOOKCLI_STATS=torch's backend keeps torch ops."""
    pytest.importorskip("triton")
    from hookcli.engine import _triton, devicerow
    from hookcli.engine.tensorbits import token_rows

    launched: list[int] = []
    original = _triton.token_rows
    monkeypatch.setattr(
        _triton, "token_rows", lambda x, **k: launched.append(1) or original(x, **k)
    )
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 33, 4100, device="cuda", generator=g)
    x[0, 3, 7] = float("nan")
    cases = [x, x.bfloat16(), x.transpose(0, 1)]  # the last one not contiguous: copied
    runs = []
    for _ in range(2):
        with _no_sync():
            runs.append([devicerow.token_rows(t) for t in cases])
    assert len(launched) == 2 * len(cases)
    for t, first, second in zip(cases, *runs, strict=True):
        assert first.view(torch.int64).equal(second.view(torch.int64))
        want = token_rows(t.cpu())
        assert torch.equal(first[..., 4].cpu(), want[..., 4])
        assert torch.allclose(first.cpu(), want, rtol=1e-10, atol=1e-12, equal_nan=True)
    devicerow.token_rows(x, fused=False)
    assert len(launched) == 2 * len(cases)


@needs_cuda
def test_cuda_channels_come_from_the_kernels_without_a_sync(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 52: --channels on CUDA is the two Triton kernels' (no float64 copy of the
    tensor), with no host synchronisation, its ChannelStats those of the CPU's torch path."""
    pytest.importorskip("triton")
    from hookcli.engine import _triton
    from hookcli.engine.channels import measure_channels, unpack

    launched: list[int] = []
    original = _triton.channel_rows
    monkeypatch.setattr(
        _triton, "channel_rows", lambda *a, **k: launched.append(1) or original(*a, **k)
    )
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3, 70, 300, device="cuda", generator=g) * 4
    x[0, 3, 7] = float("nan")
    x[1, :, 9] = float("-inf")
    x[2, 5, 11] = 3000.0
    for t in (x, x.bfloat16()):
        with _no_sync():
            packed = measure_channels(t, 2)
        got, got_top = unpack(packed.cpu(), 2, 300)
        want, want_top = unpack(measure_channels(t.cpu(), 2), 2, 300)
        assert got.count == want.count and got.zeros == want.zeros and got.large == want.large
        assert got.masked == want.masked
        for field in ("mean", "std", "min", "max"):
            for a, b in zip(getattr(got, field), getattr(want, field), strict=True):
                assert (a is None) == (b is None)
                assert a is None or abs(a - b) <= 1e-9 * max(1.0, abs(b))
        assert got_top[: len(want_top)] == want_top
    assert len(launched) == 2


@needs_cuda
def test_cuda_heads_and_calib_histograms_come_from_the_kernels_without_a_sync(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 52: --heads' sums and calib's |x| histogram on CUDA are the Triton kernels' (no
    float64 copy), with no host synchronisation, equal to the CPU's torch path."""
    pytest.importorskip("triton")
    from hookcli.engine import _triton
    from hookcli.engine.channels import HIST_BINS, measure_channels
    from hookcli.engine.heads import head_numbers

    launched: list[str] = []
    for name in ("head_sums", "abs_hist"):
        original = getattr(_triton, name)
        monkeypatch.setattr(
            _triton, name, lambda *a, n=name, f=original, **k: launched.append(n) or f(*a, **k)
        )
    g = torch.Generator(device="cuda").manual_seed(0)
    scores = torch.randn(2, 4, 150, 150, device="cuda", generator=g) * 3
    causal = torch.ones(150, 150, dtype=torch.bool, device="cuda").tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    real = torch.ones(2, 150, dtype=torch.bool, device="cuda")
    real[1, :20] = False
    x = torch.randn(3, 70, 300, device="cuda", generator=g) * 4
    x[1, :, 9] = float("-inf")
    x[2, 5, 11] = 3000.0
    for p, t in ((probs, x), (probs.bfloat16(), x.bfloat16())):
        with _no_sync():
            heads = head_numbers(p, real)
            packed = measure_channels(t, 2, hist=True)
        torch.testing.assert_close(heads.cpu(), head_numbers(p.cpu(), real.cpu()), rtol=1e-12,
                                   atol=1e-12)  # fmt: skip
        want = measure_channels(t.cpu(), 2, hist=True)
        assert packed[-HIST_BINS:].cpu().equal(want[-HIST_BINS:])  # the counts, exactly
        torch.testing.assert_close(packed[:-HIST_BINS].cpu(), want[:-HIST_BINS], rtol=1e-9,
                                   atol=1e-9, equal_nan=True)  # fmt: skip
    assert launched == ["head_sums", "abs_hist"] * 2


@needs_cuda
def test_diff_on_the_device_reads_each_reference_tensor_where_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 52 item 3: side by side on CUDA, the compared side's sums are measured on the
    device against the reference's tensor itself (no host copy, no spill), and the report
    holds every call with finite figures."""
    from hookcli.commands.diff import diff_report, ondevice, parse_side
    from hookcli.commands.diff.measure import Spill
    from hookcli.options import InputOptions, ModelOptions, Selection

    measured: list[int] = []
    original = ondevice.sums
    monkeypatch.setattr(ondevice, "sums", lambda a, b: measured.append(1) or original(a, b))
    monkeypatch.setattr(Spill, "write", lambda *a: pytest.fail("written to the spill"))
    report = diff_report(
        ModelOptions("resnet18", device="cuda"),
        Selection(),
        InputOptions(specs=("randn:2x3x64x64",)),
        parse_side("float32", "--a"),
        parse_side("bfloat16", "--b"),
        own=False,
    )
    assert measured and report.calls
    assert all(c.b[0].rel_l2 is not None and c.b[0].rel_l2 < 0.5 for c in report.calls)


@needs_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_a_model_on_the_device_is_not_moved_and_its_buffers_come_back(
    monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    """Issue 52: a model already on the GPU is not moved for the run ("cuda" is the current
    device, "cuda:0"), and its buffers — batch norm's running statistics, written by a train-
    mode pass — come back bit for bit, copied back together (engine/passes.BufferSnapshot)."""
    model = torchvision.models.resnet18().cuda()
    x = torch.randn(2, 3, 64, 64, device="cuda")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    versions_of_params = [p._version for p in model.parameters()]
    moves: list[object] = []
    original = torch.nn.Module.to
    monkeypatch.setattr(
        torch.nn.Module, "to", lambda self, *a, **k: moves.append(a) or original(self, *a, **k)
    )
    report = hookcli.inspect(model, x, device=device, train=True, topk=0)
    assert report.layers and moves == []
    after = model.state_dict()
    for name, value in before.items():
        assert after[name].equal(value), name  # running_mean/var and the counts restored
    assert [p._version for p in model.parameters()] == versions_of_params
    assert model.training  # as found


@needs_cuda
def test_cuda_diff_sums_come_from_the_kernel_without_a_sync() -> None:
    """Issue 52 item 3: diff's sums on CUDA are the fused kernel's (one read of each side in
    its own dtype), with no host synchronisation, equal to float64 torch's on the CPU and
    bitwise the same run to run."""
    from hookcli.commands.diff import ondevice
    from hookcli.engine import devicerow

    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(3, 70, 3000, device="cuda", generator=g)
    b = a.bfloat16()
    b[0, 3, 7] = float("nan")
    a[1, 2, 5] = float("inf")
    runs = []
    for _ in range(2):
        with _no_sync():
            runs.append(ondevice.sums(a, b))
            fused = devicerow.diff_sums(a, b)
    assert fused is not None and fused.view(torch.int64).equal(runs[0].view(torch.int64))
    assert runs[0].view(torch.int64).equal(runs[1].view(torch.int64))
    want = ondevice.sums(a.cpu(), b.cpu())
    torch.testing.assert_close(runs[0].cpu(), want, rtol=1e-12, atol=0.0)
