"""`hookcli calib` (issue 36): activation scales for quantization over a text file. Oracles:
SmoothQuant's `get_act_scales` loop written out by hand (one sequence at a time, no padding),
torch.ao's PerChannelMinMaxObserver, numpy's histogram of the same |x|, SmoothQuant's smoothing
by hand; the file read back by the safetensors library."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from hookcli.cli import app
from hookcli.commands.calib import _chunks, calib_report, weight_scales
from hookcli.options import CalibOptions, InputOptions, ModelOptions, Selection
from tests.support.oracles import act_scales_by_hand

transformers = pytest.importorskip("transformers")
runner = CliRunner()
TEXTS = [
    "The cat sat on the mat.",
    "hello",
    "A dog ran in the park.",
    "Once upon a time there was a model.",
    "the cat and the dog",
]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.llm import save

    return save(tmp_path_factory.mktemp("calib_llama"), "llama")


def _inputs_by_hand(folder: Path) -> tuple[Any, dict[str, list[torch.Tensor]]]:
    """Every Linear's input, sequence by sequence, kept by an independent hook."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    seen: dict[str, list[torch.Tensor]] = {}
    handles = [
        m.register_forward_hook(
            lambda m, a, o, n=n: seen.setdefault(n, []).append(a[0].detach().clone())
        )
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    ]
    try:
        with torch.no_grad():
            for t in TEXTS:
                model(**tok(t, return_tensors="pt"))
    finally:
        for h in handles:
            h.remove()
    return model, seen


def test_scales_min_max_and_histogram_are_the_oracles_over_passes(
    llama: Path, tmp_path: Path
) -> None:
    """Five texts in passes of two (padded): act scales = SmoothQuant's loop, min/max = the
    observer's, the |x| histogram = numpy's over the same values, smoothing = by hand."""
    text_file = tmp_path / "calib.txt"
    text_file.write_text("\n".join(TEXTS) + "\n")
    report = calib_report(
        ModelOptions(f"hf:{llama}", device="cpu"),
        Selection(),
        InputOptions(text_file=str(text_file)),
        CalibOptions(batch_size=2, alpha=0.6),
    )
    assert report.input.description == "5 sequences in 3 passes of up to 2"
    model, seen = _inputs_by_hand(llama)
    tok = transformers.AutoTokenizer.from_pretrained(llama)
    truth = act_scales_by_hand(model, [tok(t, return_tensors="pt")["input_ids"] for t in TEXTS])
    assert [layer.name for layer in report.layers] == list(seen)
    bounds = np.array(report.hist_bounds)
    for layer in report.layers:
        ch = layer.channels
        scale = truth["scales"][layer.name].double()
        assert torch.allclose(torch.tensor(ch.absmax, dtype=torch.float64), scale, rtol=1e-6)
        obs = truth["observers"][layer.name]
        assert torch.allclose(torch.tensor(ch.min), obs.min_val, rtol=1e-6, atol=1e-7)
        assert torch.allclose(torch.tensor(ch.max), obs.max_val, rtol=1e-6, atol=1e-7)
        xs = torch.cat([x.reshape(-1, x.shape[-1]) for x in seen[layer.name]]).double()
        assert ch.count == [xs.shape[0]] * xs.shape[1]
        assert torch.allclose(torch.tensor(ch.mean, dtype=torch.float64), xs.mean(0), rtol=1e-5,
                              atol=1e-6)  # fmt: skip
        counts = np.histogram(xs.abs().numpy(), bins=[0.0, *bounds, np.inf])[0]
        assert ch.abs_hist is not None and sum(ch.abs_hist) == counts.sum()
        # the padded batch rounds its matmuls otherwise than one sequence at a time: a value
        # within that rounding of a bin's bound may land next door, nowhere further
        moved = np.abs(np.array(ch.abs_hist) - counts)
        assert moved.sum() <= 2 + counts.sum() // 1000, moved.nonzero()
        # SmoothQuant's smoothing by hand
        w = model.get_submodule(layer.name).weight.detach().abs().double().amax(0)
        w = w.clamp(min=1e-5)  # as smooth_ln_fcs does
        s = (scale.pow(0.6) / w.pow(0.4)).clamp(min=1e-5)
        ratio = lambda v: (v.max() / v.median() if len(v) % 2 else v.max() / v.sort()[0][  # noqa: E731
            len(v) // 2 - 1 : len(v) // 2 + 1].mean()).item()  # fmt: skip
        assert layer.act_ratio == pytest.approx(ratio(scale), rel=1e-6)
        assert layer.smoothed_act_ratio == pytest.approx(ratio(scale / s), rel=1e-6)
        assert layer.weight_ratio == pytest.approx(ratio(w), rel=1e-9)
        assert layer.smoothed_weight_ratio == pytest.approx(ratio(w * s), rel=1e-6)


def test_the_cli_writes_safetensors_that_safetensors_reads(llama: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    text_file = tmp_path / "calib.txt"
    text_file.write_text("\n".join(TEXTS) + "\n")
    out = tmp_path / "act_scales.safetensors"
    r = runner.invoke(app, ["calib", f"hf:{llama}", "--text-file", str(text_file), "-o",
                            str(out), "--batch-size", "3", "-t", "Linear"])  # fmt: skip
    assert r.exit_code == 0, (r.stdout, r.stderr)
    assert "smoothed act" in r.stdout and "model.layers.0.mlp.down_proj" in r.stdout
    with safe_open(str(out), framework="pt") as f:
        keys = set(f.keys())
        scales = f.get_tensor("model.layers.1.mlp.down_proj")
        meta = f.metadata()
        edges = f.get_tensor("hookcli.histogram_bounds")
        hist = f.get_tensor("model.layers.1.mlp.down_proj.histogram")
    assert {"lm_head", "lm_head.min_val", "lm_head.max_val", "lm_head.histogram"} <= keys
    assert scales.dtype == torch.float32 and scales.shape == (64,)
    assert meta["format"] == "hookcli calib" and meta["alpha"] == "0.5"
    assert edges.shape == (2047,) and int(hist.sum()) > 0


def test_bad_calib_requests_get_one_line(llama: Path, tmp_path: Path) -> None:
    cases = [
        (["-o", str(tmp_path / "x.pt")], "must end in .safetensors"),
        (["--alpha", "2"], "--alpha"),
        (["--batch-size", "0"], "--batch-size"),
        (["-t", "Conv2d"], "no layer has type"),
    ]
    bare = runner.invoke(app, ["calib", f"hf:{llama}"])
    assert bare.exit_code == 2 and "calib needs data" in bare.stderr, bare.stderr
    for extra, needle in cases:
        r = runner.invoke(app, ["calib", f"hf:{llama}", "--text", "hello", *extra])
        assert r.exit_code == 2, (extra, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (extra, r.stderr)
    assert not (tmp_path / "x.pt").exists()


def test_a_convolutions_input_channels_are_dim_1() -> None:
    conv = torch.nn.Conv2d(3, 5, 3)
    w = weight_scales(conv, 3)
    assert w is not None
    assert torch.equal(w, conv.weight.detach().abs().double().amax((0, 2, 3)))
    lin = torch.nn.Linear(4, 6)
    assert torch.equal(weight_scales(lin, 4), lin.weight.detach().abs().double().amax(0))  # type: ignore[arg-type]
    assert weight_scales(lin, 5) is None


def test_a_linears_input_first_seen_as_a_selected_output_still_leaves_padding_out(
    llama: Path,
) -> None:
    """q_proj's input is input_layernorm's output, measured first as that (no channel numbers
    wanted there): its channels are still counted at the real tokens only."""
    layers = ("model.layers.0.input_layernorm", "model.layers.0.self_attn.q_proj")
    report = calib_report(
        ModelOptions(f"hf:{llama}", device="cpu"),
        Selection(layers=layers),
        InputOptions(text=(TEXTS[3], TEXTS[1])),
    )
    tok = transformers.AutoTokenizer.from_pretrained(llama)
    real = sum(len(tok(t)["input_ids"]) for t in (TEXTS[3], TEXTS[1]))
    assert [layer.name for layer in report.layers] == list(layers)
    for layer in report.layers:
        assert set(layer.channels.count) == {real}, layer.name


def test_calib_passes_keep_the_padding_side_and_the_chat_template() -> None:
    """Each pass of a text corpus is the same text options over fewer texts: --padding-side
    was dropped (every pass padded on the tokenizer's side)."""

    given = InputOptions(text=("a b", "c", "d e f"), chat=True, padding_side="left")
    parts = list(_chunks(given, 2))
    assert [p.text for p in parts] == [("a b", "c"), ("d e f",)]
    assert all(p.padding_side == "left" and p.chat for p in parts)
