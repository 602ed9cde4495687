"""`hookcli calib`: activation calibration for quantization, over a text file, a folder of
images or given inputs, in passes of `batch_size` sequences (or images).

For every selected layer (default: every Linear-like layer — nn.Linear and its subclasses,
Conv1d/2d/3d, transformers' Conv1D — and each routed expert of a fused MoE block, per expert
over the tokens routed to it: engine.fused_experts), per input channel over all tokens
(padding never counted): max|x| — SmoothQuant's `act_scales`,
as its `get_act_scales` computes them — and min and max, as torch.ao's
`PerChannelMinMaxObserver(ch_axis=-1)` would record them for a Linear (the channel dimension,
dim 1, of a convolution's NCHW input); a histogram of |x| in log-spaced bins (engine.channels)
for percentile calibration; and each layer's outlier ratio (largest channel max|x| ÷ the median
channel's) of its input and of its weight, before and after SmoothQuant's smoothing at `alpha`:
s_j = max|X_j|^alpha / max|W_j|^(1-alpha) (max|W_j| and s_j clamped at 1e-5, as SmoothQuant
does), X_j / s_j and W_j · s_j.

The numbers of each pass merge exactly (engine.aggregate.merge_channels); memory is O(channels)
per layer however many sequences pass. A selected layer that could not be read (it never ran,
its input is not floating point, an expert no token was routed to) is listed in the report's
`skipped` and the file's metadata, never dropped in silence.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from statistics import median
from typing import Any

import torch
from torch import nn

from hookcli import bounds
from hookcli.commands.inspect import input_info, model_info
from hookcli.engine import fused_experts
from hookcli.engine.aggregate import merge_channels
from hookcli.engine.channels import hist_bounds
from hookcli.engine.measure import measured_pass, statistics
from hookcli.engine.prepare import prepare
from hookcli.engine.probes import Armed, Probe
from hookcli.errors import ModelError, UsageError
from hookcli.options import CalibOptions, InputOptions, ModelOptions, Selection
from hookcli.records import CalibLayer, CalibReport, CalibSkip, ChannelStats
from hookcli.sources import load_model

SMOOTH_MIN = 1e-5  # SmoothQuant clamps its weight scales and smoothing scales here


def _chunks(inputs: InputOptions, size: int) -> Iterator[InputOptions]:
    """The inputs in passes of `size`: text sequences, image files, or (specs, tensors) one."""
    if inputs.has_text:
        from hookcli.inputs.text import texts_of

        texts = texts_of(inputs)
        for i in range(0, len(texts), size):
            yield InputOptions(
                text=tuple(texts[i : i + size]), chat=inputs.chat, padding_side=inputs.padding_side
            )
        return
    if inputs.items and all(isinstance(x, str) for x in inputs.items):
        from hookcli.inputs.images import expand_paths

        files = expand_paths(list(inputs.items))
        for i in range(0, len(files), size):
            part = tuple(str(f.path) for f in files[i : i + size])
            yield InputOptions(items=part, strict=inputs.strict)
        return
    yield inputs


def linear_like(module: nn.Module) -> bool:
    """A layer calib reads by default: nn.Linear or a subclass (Falcon's FalconLinear, …), a
    Conv1d/2d/3d (not a transposed one: its weight is (in, out, …)), transformers' Conv1D."""
    if isinstance(module, nn.Linear):
        return True
    conv = nn.modules.conv
    if isinstance(module, conv._ConvNd) and not isinstance(module, conv._ConvTransposeNd):
        return True
    return any(c.__name__ == "Conv1D" for c in type(module).__mro__)


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


class CalibInputs(Probe):
    """calib's probe: each selected layer's input channels with their histograms (the
    collector's channel chooser, `input_channels`); a fused MoE block's routed experts read
    per expert (engine/fused_experts.py). Merged over the passes by calib_report."""

    batched = True

    def __init__(self, convs: set[str], tapped: list[tuple[str, nn.Module]]) -> None:
        self.convs = convs
        self.tapped = tapped
        self.tap: fused_experts.ExpertTap | None = None

    @contextlib.contextmanager
    def arm(self, armed: Armed) -> Iterator[None]:
        armed.collector.channels = input_channels(self.convs)
        armed.collector.channel_hist = True
        with fused_experts.tapping(self.tapped, armed.model_input.token_mask) as tap:
            self.tap = tap
            yield


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
    loaded = load_model(  # with its tokenizer, read once: each pass's prepare finds it there
        model.model,
        weights=model.weights,
        seed=model.seed,
        model_args=model.model_args,
        head=model.head,
        tokenizer=model.tokenizer,
        text=inputs.has_text,
    )
    experts = fused_experts.find_fused_experts(loaded.module)
    if not selection.layers and not selection.types:
        found = tuple(sorted({type(m).__name__ for m in loaded.module.modules() if linear_like(m)}))
        if not found and not experts:
            raise UsageError(
                f"{loaded.spec} has no Linear, convolution or MoE expert to calibrate.",
                "select the layers to calibrate with -l or -t.",
            )
        # by type name: every module of a Linear-like class (subclasses included)
        selection = Selection(types=found) if found else Selection(layers=(experts[0][0],))
        tapped: list[tuple[str, nn.Module]] | None = experts
    else:
        tapped = None  # the experts modules the selection names: found on the first pass
    base = ModelOptions(
        loaded, model.weights, model.seed, model.device, model.model_args, model.output_key,
        model.head, None,
    )  # fmt: skip
    merged: dict[str, ChannelStats] = {}
    types: dict[str, str] = {}
    modules: dict[str, nn.Module] = {}
    ran: set[str] = set()  # selected layers called at least once
    unreadable: dict[str, str] = {}  # experts modules whose calls could not be read
    nonfinite: dict[str, int] = {}  # NaN/Inf values in a layer's input, left out of its scales
    sequences = passes = 0
    first = None
    notes: list[str] = []
    for part in _chunks(inputs, size):
        prepared = prepare(base, selection, part)
        model_input = prepared.model_input
        assert model_input is not None
        modules.update({t.name: t.module for t in prepared.targets})
        if tapped is None:
            chosen = {id(t.module) for t in prepared.targets}
            tapped = [(n, m) for n, m in experts if id(m) in chosen]
        convs = {n for n, m in modules.items() if isinstance(m, nn.modules.conv._ConvNd)}
        probe = CalibInputs(convs, tapped)
        with measured_pass(prepared, statistics(repays_kernels=True), probes=[probe]) as measured:
            pass
        tap = probe.tap
        assert tap is not None
        tapped_names = {n for n, _ in tapped}
        for call in measured.calls:
            if call.inputs and call.name not in tapped_names:
                bad = call.inputs[0].nan + call.inputs[0].inf
                if bad:
                    nonfinite[call.name] = nonfinite.get(call.name, 0) + bad
        found_calls = [
            (call.name, call.type, call.inputs[0].channels if call.inputs else None)
            for call in measured.calls
            if call.name not in tapped_names  # read per expert instead
        ]
        for key, parts in tap.results().items():
            owner = fused_experts.expert_of(key)[0]
            found_calls += [(key, tap.types.get(owner, "experts"), ch) for ch in parts]
        for name, type_, ch in found_calls:
            ran.add(name)
            if ch is None:
                continue
            have = merged.get(name)
            if have is not None and len(have.count) != len(ch.count):
                raise UsageError(
                    f"{name}'s input has {len(ch.count)} channels in one call and "
                    f"{len(have.count)} in another: not one layer to calibrate.",
                    "select layers whose input width is fixed (-l).",
                )
            merged[name] = merge_channels(have, ch, 0)
            types[name] = type_
        unreadable.update(tap.unreadable)
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
    assert tapped is not None  # (set on the first pass)
    experts_of = dict(tapped)
    order = {name: i for i, (name, _) in enumerate(loaded.module.named_modules())}
    # a channel with no finite value has no scale: the layer is not written (a NaN scale
    # would poison what reads the file), and one with some NaN/Inf is said
    empty = {
        name: sum(a is None for a in ch.absmax)
        for name, ch in merged.items()
        if any(a is None for a in ch.absmax)
    }
    for layer, count in nonfinite.items():
        if layer in merged and layer not in empty:
            notes.append(
                f"{layer}: {count} NaN/Inf value{'s' if count != 1 else ''} in its input over "
                "the calibration data, left out of its scales"
            )
    ordered = _in_order([n for n in merged if n not in empty], order)
    if not ordered:
        raise ModelError(
            f"every calibrated layer's input held a channel with no finite value (NaN/Inf in "
            f"{', '.join(list(empty)[:3])}{', …' if len(empty) > 3 else ''}): no scale to write.",
            "find where NaN/Inf begin with hookcli check MODEL … --fail-on nonfinite.",
        )
    layers = [
        _layer(name, types[name], merged[name], _weight_scales(name, modules, experts_of), alpha)
        for name in ordered
    ]
    skipped = _skipped(modules, tapped, ran, merged, unreadable)
    skipped += [
        CalibSkip(
            name,
            types[name],
            f"{n} of its {len(merged[name].absmax)} input channels held no finite value (NaN/Inf "
            "in the calibration data): no scale to write",
        )
        for name, n in empty.items()
    ]
    rank = {name: i for i, name in enumerate(_in_order([k.name for k in skipped], order))}
    skipped.sort(key=lambda k: rank[k.name])
    config = getattr(loaded.module, "config", None)
    info = input_info(model_input)
    info.description = (
        f"{sequences} {'sequences' if inputs.has_text else 'inputs'} in {passes} "
        f"{'pass' if passes == 1 else 'passes'} of up to {size}"
    )
    return CalibReport(
        model=model_info(prepared.loaded, False, prepared.seed),
        input=info,
        device=str(prepared.device),
        alpha=alpha,
        layers=layers,
        hist_bounds=hist_bounds().tolist(),
        notes=notes,
        skipped=skipped,
        sequences=sequences,
        model_type=getattr(config, "model_type", None),
        blocks=getattr(config, "num_hidden_layers", None),
        experts=getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None),
    )


def _in_order(names: list[str], order: dict[str, int]) -> list[str]:
    """Layers in the order they first ran, each expert's projections (EXPERTS.E.PROJ, not
    modules) placed where their experts module sits among them in the model's tree, by expert
    and projection (up, then down): after the last layer that ran whose module comes before
    the experts module in the tree. One sort and one search per name."""
    import bisect

    modules = [n for n in names if n in order]
    experts = [n for n in names if n not in order]
    # the modules by their place in the tree, each with the latest run index among those up
    # to it: the anchor of a place `at` is the latest-run module placed before it
    by_place = sorted((order[n], i) for i, n in enumerate(modules))
    places = [p for p, _ in by_place]
    latest: list[int] = []
    for _, i in by_place:
        latest.append(max(i, latest[-1]) if latest else i)

    def key(name: str) -> tuple[int, int, int, int]:
        owner, e, projection = fused_experts.expert_of(name)
        at = order.get(owner, len(order))
        before = bisect.bisect_left(places, at)
        anchor = latest[before - 1] if before else -1
        return anchor, at, e, int(projection == "down_proj")

    keyed = sorted((key(n), n) for n in experts)
    out: list[str] = [n for k, n in keyed if k[0] < 0]
    at = 0
    placed = [(k, n) for k, n in keyed if k[0] >= 0]
    for i, name in enumerate(modules):
        out.append(name)
        while at < len(placed) and placed[at][0][0] == i:
            out.append(placed[at][1])
            at += 1
    return out


def _weight_scales(
    name: str, modules: dict[str, nn.Module], experts: dict[str, nn.Module]
) -> Callable[[int], torch.Tensor | None]:
    """How to read a calibrated layer's max|W| per input channel, given its channel count."""
    if name in modules:
        module = modules[name]
        return lambda channels: weight_scales(module, channels)
    owner, e, projection = fused_experts.expert_of(name)
    experts_module = experts[owner]

    def scales(channels: int) -> torch.Tensor | None:
        w = fused_experts.weight_scales(experts_module, projection, e)
        return w if w.numel() == channels else None

    return scales


def _skipped(
    modules: dict[str, nn.Module],
    tapped: list[tuple[str, nn.Module]],
    ran: set[str],
    merged: dict[str, ChannelStats],
    unreadable: dict[str, str],
) -> list[CalibSkip]:
    """The selected layers calib has no numbers for, each with why."""
    tapped_names = {n for n, _ in tapped}
    out = []
    for name, module in modules.items():
        if name in merged or name in tapped_names:
            continue
        why = (
            "it never ran on the calibration data"
            if name not in ran
            else "its input is not a floating-point tensor with a channel dimension"
        )
        out.append(CalibSkip(name, type(module).__name__, why))
    for name, module in tapped:
        type_ = type(module).__name__
        if name in unreadable:
            out.append(CalibSkip(name, type_, f"its experts could not be read: {unreadable[name]}"))
            continue
        n = int(getattr(module, "num_experts", 0) or 0)
        for e in range(n):
            for projection in fused_experts.projections(module):
                key = fused_experts.expert_layer(name, e, projection)
                if key in merged:
                    continue
                why = (
                    "it never ran on the calibration data"
                    if not any(k.startswith(f"{name}.") for k in merged)
                    else f"no calibration token was routed to expert {e}"
                )
                out.append(CalibSkip(key, type_, why))
    return out


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
    name: str,
    type_: str,
    ch: ChannelStats,
    scales_of: Callable[[int], torch.Tensor | None],
    alpha: float,
) -> CalibLayer:
    act = [a if a is not None else 0.0 for a in ch.absmax]
    w = scales_of(len(act))
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
