"""`hookcli calib`: activation calibration for quantization, over a text file, a folder of
images or given inputs, in passes of `batch_size` sequences (or images).

For every selected layer (default: every Linear, Conv1d/2d/3d and transformers' Conv1D), per
input channel over all tokens (padding never counted): max|x| — SmoothQuant's `act_scales`,
as its `get_act_scales` computes them — and min and max, as torch.ao's
`PerChannelMinMaxObserver(ch_axis=-1)` would record them for a Linear (the channel dimension,
dim 1, of a convolution's NCHW input); a histogram of |x| in log-spaced bins (engine.channels)
for percentile calibration; and each layer's outlier ratio (largest channel max|x| ÷ the median
channel's) of its input and of its weight, before and after SmoothQuant's smoothing at `alpha`:
s_j = max|X_j|^alpha / max|W_j|^(1-alpha) (max|W_j| and s_j clamped at 1e-5, as SmoothQuant
does), X_j / s_j and W_j · s_j.

The numbers of each pass merge exactly (engine.aggregate.merge_channels); memory is O(channels)
per layer however many sequences pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from statistics import median
from typing import Any

import torch
from torch import nn

from hookcli import bounds
from hookcli.commands.inspect import input_info, model_info
from hookcli.commands.measured import measured_pass, statistics
from hookcli.engine.aggregate import merge_channels
from hookcli.engine.channels import hist_bounds
from hookcli.engine.passes import prepare, with_tokenizer
from hookcli.errors import UsageError
from hookcli.options import CalibOptions, InputOptions, ModelOptions, Selection
from hookcli.records import CalibLayer, CalibReport, ChannelStats
from hookcli.sources import load_model

TYPES = ("Linear", "Conv1d", "Conv2d", "Conv3d", "Conv1D")
SMOOTH_MIN = 1e-5  # SmoothQuant clamps its weight scales and smoothing scales here


def _chunks(inputs: InputOptions, size: int) -> Iterator[InputOptions]:
    """The inputs in passes of `size`: text sequences, image files, or (specs, tensors) one."""
    if inputs.has_text:
        from hookcli.inputs.text import texts_of

        texts = texts_of(inputs)
        for i in range(0, len(texts), size):
            yield InputOptions(text=tuple(texts[i : i + size]), chat=inputs.chat)
        return
    if inputs.items and all(isinstance(x, str) for x in inputs.items):
        from hookcli.inputs.images import expand_paths

        files = expand_paths(list(inputs.items))
        for i in range(0, len(files), size):
            part = tuple(str(f.path) for f in files[i : i + size])
            yield InputOptions(items=part, strict=inputs.strict)
        return
    yield inputs


def input_channels(convs: set[str]) -> Callable[[Any, tuple[int, ...]], int | None]:
    """The collector's channel chooser: a selected layer's inputs by their channel dimension,
    the last of a Linear's (…, C), dim 1 of a convolution's (N, C, …) (`convs`: their names)."""

    def choose(context: Any, shape: tuple[int, ...]) -> int | None:
        if not isinstance(context, tuple) or len(context) != 3 or context[2] != "in":
            return None
        if not shape:
            return None
        return 1 if len(shape) >= 3 and context[0] in convs else len(shape) - 1

    return choose


def calib_report(
    model: ModelOptions,
    selection: Selection,
    inputs: InputOptions,
    options: CalibOptions = CalibOptions(),
) -> CalibReport:
    """Every selected layer's input channels over all the inputs (see the module docstring)."""
    size = bounds.integer(
        options.batch_size, "--batch-size", low=1, high=bounds.BATCH_MAX, example="--batch-size 8"
    )
    alpha = bounds.number(options.alpha, "--alpha", low=0, high=1, example="--alpha 0.5")
    if not (inputs.has_text or inputs.items or inputs.specs):
        raise UsageError(
            "calib needs data to calibrate on: a random input's ranges say nothing.",
            "give --text-file FILE (one sequence per line), --text, a folder of images, or inputs.",
        )
    loaded = load_model(
        model.model,
        weights=model.weights,
        seed=model.seed,
        model_args=model.model_args,
        head=model.head,
    )
    if not selection.layers and not selection.types:
        present = {type(m).__name__ for m in loaded.module.modules()}
        found = tuple(t for t in TYPES if t in present)
        if not found:
            raise UsageError(
                f"{loaded.spec} has no Linear or convolution to calibrate.",
                "select the layers to calibrate with -l or -t.",
            )
        selection = Selection(types=found)
    # the tokenizer read once: each pass's prepare finds it there (tokenizer None below)
    loaded = with_tokenizer(loaded, model.tokenizer, needed=inputs.has_text)
    base = ModelOptions(
        loaded, model.weights, model.seed, model.device, model.model_args, model.output_key,
        model.head, None,
    )  # fmt: skip
    merged: dict[str, ChannelStats] = {}
    types: dict[str, str] = {}
    modules: dict[str, nn.Module] = {}
    sequences = passes = 0
    first = None
    notes: list[str] = []
    for part in _chunks(inputs, size):
        prepared = prepare(base, selection, part)
        model_input = prepared.model_input
        assert model_input is not None
        modules.update({t.name: t.module for t in prepared.targets})
        convs = {n for n, m in modules.items() if isinstance(m, nn.modules.conv._ConvNd)}
        collector = statistics(repays_kernels=True)
        collector.set_token_mask(model_input.token_mask)
        collector.channels = input_channels(convs)
        collector.channel_hist = True
        with measured_pass(prepared, collector) as measured:
            pass
        for call in measured.calls:
            if not call.inputs or call.inputs[0].channels is None:
                continue
            ch = call.inputs[0].channels
            have = merged.get(call.name)
            if have is not None and len(have.count) != len(ch.count):
                raise UsageError(
                    f"{call.name}'s input has {len(ch.count)} channels in one call and "
                    f"{len(have.count)} in another: not one layer to calibrate.",
                    "select layers whose input width is fixed (-l).",
                )
            merged[call.name] = merge_channels(have, ch, 0)
            types[call.name] = call.type
        shapes = model_input.shapes()
        sequences += shapes[0][0] if shapes and shapes[0] else 1
        passes += 1
        if first is None:
            first = (prepared, model_input)
        for n in prepared.notes:
            if n not in notes:
                notes.append(n)
    if first is None or not merged:
        raise UsageError(
            "no selected layer saw an input to calibrate.",
            "select layers that run (-l, -t; `hookcli layers MODEL` lists them).",
        )
    prepared, model_input = first
    layers = [
        _layer(name, types[name], ch, modules.get(name), alpha) for name, ch in merged.items()
    ]
    info = input_info(model_input)
    info.description = (
        f"{sequences} {'sequences' if inputs.has_text else 'inputs'} in {passes} passes "
        f"of up to {size}"
    )
    return CalibReport(
        model=model_info(prepared.loaded, False, prepared.seed),
        input=info,
        device=str(prepared.device),
        alpha=alpha,
        layers=layers,
        hist_bounds=hist_bounds().tolist(),
        notes=notes,
    )


def _ratio(values: Sequence[float]) -> float | None:
    """max ÷ median of finite values; None where there are none or the median is 0."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return None
    middle = median(finite)
    ratio = max(finite) / middle if middle > 0 else None
    return ratio if ratio is not None and math.isfinite(ratio) else None


def weight_scales(module: nn.Module | None, channels: int) -> torch.Tensor | None:
    """max|W| per input channel: a Linear's (out, in) over its rows, transformers' Conv1D
    (in, out) over its columns, a convolution's (out, in, …) over all but dim 1 (groups of
    one only). None for another module, or a weight of another width."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() < 2:
        return None
    w = weight.detach().abs().double()
    if isinstance(module, nn.Linear):
        scales = w.amax(0)
    elif type(module).__name__ == "Conv1D":
        scales = w.amax(1)
    elif isinstance(module, nn.modules.conv._ConvNd) and module.groups == 1:
        scales = w.transpose(0, 1).reshape(w.shape[1], -1).amax(1)
    else:
        return None
    return scales.cpu() if scales.numel() == channels else None


def _layer(
    name: str, type_: str, ch: ChannelStats, module: nn.Module | None, alpha: float
) -> CalibLayer:
    act = [a if a is not None else 0.0 for a in ch.absmax]
    w = weight_scales(module, len(act))
    after = w_before = w_after = None
    if w is not None:
        x = torch.tensor(act, dtype=torch.float64)
        w = w.clamp(min=SMOOTH_MIN)  # as SmoothQuant's smooth_ln_fcs clamps weight scales
        s = (x.pow(alpha) / w.pow(1 - alpha)).clamp(min=SMOOTH_MIN)
        after = _ratio((x / s).tolist())
        w_before = _ratio(w.tolist())
        w_after = _ratio((w * s).tolist())
    return CalibLayer(
        name=name,
        type=type_,
        channels=ch,
        act_ratio=_ratio(act),
        smoothed_act_ratio=after,
        weight_ratio=w_before,
        smoothed_weight_ratio=w_after,
    )


def calib_tensors(report: CalibReport) -> dict[str, torch.Tensor]:
    """What the safetensors file holds, by key: `NAME` SmoothQuant's act scales (float32),
    `NAME.min_val` / `NAME.max_val` as PerChannelMinMaxObserver's buffers (float32),
    `NAME.histogram` the |x| counts (int64); `hookcli.histogram_bounds` their bins' inner bounds
    (CalibReport.hist_bounds)."""
    out: dict[str, torch.Tensor] = {}
    for layer in report.layers:
        ch = layer.channels
        out[layer.name] = torch.tensor([_num(a) for a in ch.absmax], dtype=torch.float32)
        out[f"{layer.name}.min_val"] = torch.tensor([_num(a) for a in ch.min], dtype=torch.float32)
        out[f"{layer.name}.max_val"] = torch.tensor([_num(a) for a in ch.max], dtype=torch.float32)
        if ch.abs_hist is not None:
            out[f"{layer.name}.histogram"] = torch.tensor(ch.abs_hist, dtype=torch.int64)
    out["hookcli.histogram_bounds"] = torch.tensor(report.hist_bounds, dtype=torch.float64)
    return out


def _num(v: float | None) -> float:
    return math.nan if v is None else v
