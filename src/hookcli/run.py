"""One inspection: prepare → hooked pass (and backward) → Report. Also `layers` and `models`.

Every pass goes through the engine (engine.py), which leaves the model as found.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookcli import isa
from hookcli._version import __version__
from hookcli.engine import (
    Prepared,
    deterministic_algorithms,
    every_target,
    hooked_pass,
    model_input,
    prepare,
    unhooked_pass,
)
from hookcli.errors import UsageError
from hookcli.hooks import HookSession, PendingCall, measure
from hookcli.inputs import ModelInput, skipped_note
from hookcli.loading import (
    TASKS,
    LoadedModel,
    registry_names,
    task_of,
    weights_enum,
)
from hookcli.options import InputOptions, Invocation, ModelOptions, RunOptions, Selection
from hookcli.records import (
    Backward,
    CallProfile,
    InputInfo,
    LayerCall,
    LayersReport,
    ModelEntry,
    ModelInfo,
    ModuleRow,
    Origin,
    ParamStats,
    Prediction,
    Profile,
    Report,
    SavedFile,
    TensorStats,
)
from hookcli.selection import ROOT_LABEL, count_params, has_lazy, recount
from hookcli.stats import StatsCollector, finite_or_none

RANDOM_WEIGHTS_NOTE = "weights are random (--weights none): predictions are meaningless"


def inspect(
    model: str | nn.Module,
    inputs: Sequence[str] | torch.Tensor | Sequence[torch.Tensor] = (),
    **options: Any,
) -> Report:
    """Run one forward pass with statistics hooks on the selected layers; return the Report.

    `model` is a registry name, `file.py:Name`, `package.module:Name` or an nn.Module;
    `inputs` image paths/folders, or tensors (positional arguments of forward). Options:
    input_specs, layers, types, depth, also_layers, weights, seed, device, topk, model_args,
    train, hist, profile, save, ablate, deterministic, strict, config,
    stats_backend ("torch" skips the fused CPU kernel; results agree).
    """
    return report(Invocation.from_api(model, inputs, options, backward=False), "inspect")


def grads(
    model: str | nn.Module,
    inputs: Sequence[str] | torch.Tensor | Sequence[torch.Tensor] = (),
    **options: Any,
) -> Report:
    """As inspect, plus a backward pass: each call's grad_output/grad_input statistics and
    each selected layer's parameter gradients. Extra options: target ("top1", a class index
    or label, "sum"), loss ("ce:IDX", "mse:ones", …), input_grad."""
    return report(Invocation.from_api(model, inputs, options, backward=True), "grads")


def report(inv: Invocation, command: str) -> Report:
    """The whole inspection an Invocation describes: one hooked pass (two with --ablate)."""
    run = inv.run
    if run.topk is not None and run.topk < 0:
        raise UsageError(f"--topk must be 0 or more, got {run.topk}.", "use --topk 5.")
    if run.hist < 0:
        raise UsageError(f"histogram bins must be 0 or more, got {run.hist}.", "use --hist.")
    from hookcli import ablation

    specs = [ablation.parse(a) for a in run.ablate]
    prepared = prepare(inv.model, inv.selection, inv.inputs, backward=inv.backward)
    with deterministic_algorithms(run.deterministic):
        clean = _one_run(prepared, run, command)
        if specs:  # the same model and input once more, those layers' outputs changed
            quiet = dataclasses.replace(run, save=None, profile=False)
            changed = _one_run(prepared, quiet, command, specs)
            clean.ablation = ablation.compare(clean, changed, specs)
    return clean


PendingParam = tuple[ParamStats, TensorStats, TensorStats | None]  # the weight's, the gradient's


def _one_run(
    prepared: Prepared, run: RunOptions, command: str, ablations: Sequence[Any] = ()
) -> Report:
    from hookcli.ablation import ablated

    loaded, minput = prepared.loaded, prepared.minput
    assert minput is not None
    backward = prepared.backward is not None
    collector = StatsCollector(fused=run.stats_backend != "torch", hist_bins=run.hist)
    saver = _saver(prepared, run, command) if run.save is not None else None
    session = HookSession(prepared.targets, collector, grads=backward, saver=saver)
    timing = _profile(prepared, run) if run.profile else None
    params: dict[str, list[PendingParam]] = {}
    outputs: list[TensorStats] = []
    try:
        with (
            ablated(prepared.entries, ablations, prepared.seed) as ablation_calls,
            hooked_pass(prepared, session, train=run.train, backward=backward) as result,
        ):
            if backward:
                params = {t.name: _param_stats(t.module, collector) for t in prepared.targets}
            measure(collector, result.output, "out", outputs)
            input_grads = [
                collector.add(t.grad, path)
                for path, t in prepared.input_leaves
                if t.grad is not None
            ]
            predictions, note = predict(result.output, loaded, _topk(run.topk, loaded), minput)
    except BaseException:
        if saver is not None:
            saver.discard()  # never a half-written file
        raise
    if saver is not None:
        saver.close()
    for spec, n in zip(ablations, ablation_calls, strict=True):
        if n == 0:
            raise UsageError(
                f"--ablate: layer {spec.layer} never ran, so ablating it changes nothing.",
                "ablate a layer that runs (`hookcli layers MODEL --shapes` shows calls).",
            )
    collector.finalize()
    layers = [p.complete(backward) for p in session.calls]
    first_call: dict[str, LayerCall] = {}
    for call in layers:
        first_call.setdefault(call.name, call)
    for name, pending in params.items():
        if name in first_call:
            first_call[name].params = [_finish_param(p) for p in pending]
    profile = None
    if timing is not None:
        profile, by_call = timing
        for call in layers:
            call.profile = by_call.get((call.name, call.call))
    notes = isa.notes() + prepared.notes + result.notes
    if session.unhooked:
        refused = ", ".join(f"{name} ({why})" for name, why in session.unhooked[:5])
        notes.append(f"not hookable, so not measured: {refused}")
    notes += [f"{c.name} call {c.call}: {c.error}" for c in layers if c.error]
    if minput.skipped:
        notes.append(skipped_note(minput.skipped))
    if saver is not None:
        notes.append(f"saved {len(saver.entries)} tensors to {saver.dest.label}")
        if saver.skipped:
            notes.append(f"not saved (no safetensors dtype): {', '.join(saver.skipped[:5])}")
    value = None if result.scalar is None else finite_or_none(float(result.scalar.detach()))
    return Report(
        model=model_info(loaded, run.train),
        input=_input_info(minput),
        device=str(prepared.device),
        layers=layers,
        never_called=[
            t.name
            for t, n in zip(prepared.targets, session.counts, strict=True)
            if n == 0 and all(t.name != name for name, _ in session.unhooked)
        ],
        outputs=outputs,
        predictions=predictions,
        prediction_note=note,
        notes=notes,
        backward=Backward(prepared.backward.describe(), value) if prepared.backward else None,
        input_grads=input_grads if prepared.input_leaves else None,
        nonfinite_origins=find_origins(session.calls),
        profile=profile,
        config=run.config,
        command=command,
        hookcli_version=__version__,
    )


def _input_info(minput: ModelInput) -> InputInfo:
    return InputInfo(minput.description, minput.shapes(), minput.sources, minput.preprocessing)


def _saver(prepared: Prepared, run: RunOptions, command: str) -> Any:
    from hookcli.saving import TensorSaver

    assert run.save is not None
    assert prepared.minput is not None
    return TensorSaver(
        run.save,
        {
            "format": "pt",
            "hookcli_version": __version__,
            "command": command,
            "model": prepared.loaded.spec,
            "weights": prepared.loaded.weights_label,
            "input": prepared.minput.description,
            "device": str(prepared.device),
        },
    )


# ---------------------------------------------------------------- --profile


def _profile(
    prepared: Prepared, run: RunOptions, *, runs: int = 3
) -> tuple[Profile, dict[tuple[str, int], CallProfile]]:
    """Per call times from a pass whose hooks only read the clock (no statistics between
    layers to disturb the caches), against the same pass unhooked (median of `runs` after a
    warm-up). Every module is timed, so a container's self time is its total less its
    children's; the selected calls are reported."""
    backward = prepared.backward is not None
    reference = [
        unhooked_pass(prepared, train=run.train, backward=backward, timed=True)
        for _ in range(runs + 1)
    ][1:]
    unhooked_ms = statistics.median(r.forward_ms for r in reference)
    unhooked_bwd = statistics.median(r.backward_ms or 0.0 for r in reference) if backward else None
    session = HookSession(every_target(prepared.entries), None, grads=backward, profile=True)
    with hooked_pass(prepared, session, train=run.train, backward=backward):
        pass
    if any(p.events for p in session.calls):
        torch.cuda.synchronize()  # once: every recorded event has completed
    total = {id(p): _forward_ms(p) for p in session.calls}
    children = {id(p): 0.0 for p in session.calls}
    for p in session.calls:
        if p.parent is not None:
            children[id(p.parent)] += total[id(p)]
    wanted = {t.name for t in prepared.targets}
    leaves = {t.name for t in prepared.targets if next(t.module.children(), None) is None}
    by_call: dict[tuple[str, int], CallProfile] = {}
    layers_ms = layers_bwd = 0.0
    for p in session.calls:
        name = p.call.name
        if name not in wanted:
            continue
        f = total[id(p)]
        b = (p.t_backward[1] - p.t_backward[0]) / 1e6 if len(p.t_backward) == 2 else None
        by_call[(name, p.call.call)] = CallProfile(
            f,
            b,
            p.output_bytes,
            f / unhooked_ms if unhooked_ms else None,
            max(f - children[id(p)], 0.0),
        )
        if name in leaves:
            layers_ms += f
            layers_bwd += b or 0.0
    profile = Profile(unhooked_ms, layers_ms, runs, unhooked_bwd, layers_bwd if backward else None)
    return profile, by_call


def _forward_ms(p: PendingCall) -> float:
    if len(p.events) == 2:  # CUDA: the device's own time between the two events
        return float(p.events[0].elapsed_time(p.events[1]))
    return (p.t_forward[1] - p.t_forward[0]) / 1e6 if len(p.t_forward) == 2 else 0.0


def _topk(topk: int | None, loaded: LoadedModel) -> int:
    if topk is None:  # a custom model's output is not known to be class scores: ask first
        return loaded.kind.default_topk
    return topk


def _param_stats(module: nn.Module, collector: StatsCollector) -> list[PendingParam]:
    """A module's parameters and their gradients, measured after backward."""
    return [
        (
            ParamStats(name, tuple(p.shape), p.numel(), p.requires_grad, None),
            collector.add(p, name),
            collector.add(p.grad, f"{name}.grad") if p.grad is not None else None,
        )
        for name, p in module.named_parameters()
    ]


def _finish_param(pending: PendingParam) -> ParamStats:
    ps, weight, g = pending
    ps.norm = weight.norm
    if g is not None:
        ps.grad = g
        ps.grad_norm = g.norm
        ps.grad_mean = g.mean
        if g.min is not None and g.max is not None:
            ps.grad_max_abs = max(abs(g.min), abs(g.max))
        if ps.norm and g.norm is not None:
            ps.ratio = g.norm / ps.norm
    return ps


def model_info(loaded: LoadedModel, train: bool = False) -> ModelInfo:
    """The model's description; its parameter count taken now (after the forward, lazy
    parameters are materialised)."""
    params = count_params(loaded.module)
    return ModelInfo(
        loaded.name,
        loaded.spec,
        loaded.task,
        loaded.weights_label,
        params,
        "train" if train else "eval",
    )


def find_origins(calls: Sequence[PendingCall]) -> list[Origin]:
    """Where NaN/Inf first appeared, from the order hooks ran in — no re-run, no trace.

    Forward: calls in the order they *returned* (a child before its container), the first
    with finite inputs and a non-finite output. Backward: calls in the order their input
    gradient arrived, the first whose output gradients are finite and an input gradient not.
    """
    origins = []
    for p in sorted((p for p in calls if p.finished is not None), key=lambda p: p.finished or 0):
        c = p.call
        bad = next((t for t in c.outputs if t.nonfinite), None)
        if bad is not None and not any(t.nonfinite for t in c.inputs):
            origins.append(Origin("forward", c.name, c.type, c.call, bad.path, bad.nan, bad.inf))
            break
    arrived = (p for p in calls if p.grad_input_seen is not None)
    for p in sorted(arrived, key=lambda p: p.grad_input_seen or 0):
        c = p.call
        bad = next((g for g in c.grad_inputs or [] if g.nonfinite), None)
        if bad is not None and not any(g.nonfinite for g in c.grad_outputs or []):
            origins.append(Origin("backward", c.name, c.type, c.call, bad.path, bad.nan, bad.inf))
            break
    return origins


# ---------------------------------------------------------------- predictions


def predict(
    output: Any, loaded: LoadedModel, topk: int, minput: ModelInput
) -> tuple[list[Prediction] | None, str | None]:
    """Top-k per image: classes (classification), detections (detection), pixel shares
    (segmentation). Labels come from the weights' categories; each row names its image (path
    relative to its folder) and, in an ImageFolder tree, the image's class folder. A
    non-finite score has prob None (JSON null), flagged in the table."""
    if topk == 0:
        return None, None
    cats = loaded.categories
    meaningless = "" if loaded.pretrained else f"; {RANDOM_WEIGHTS_NOTE}"
    sources, classes = minput.sources, minput.classes

    def label(i: int) -> str | None:
        return cats[i] if cats is not None and 0 <= i < len(cats) else None

    def row(rank: int, index: int, prob: float, img: int) -> Prediction:
        return Prediction(
            rank,
            index,
            label(index),
            finite_or_none(prob),
            img,
            sources[img] if img < len(sources) else None,
            classes[img] if img < len(classes) else None,
        )

    with torch.no_grad():
        read = loaded.kind.predict(output, topk, row)
    if read is None:
        return None, None
    preds, header = read
    return preds, header + meaningless


# ---------------------------------------------------------------- layers and models


def layers_report(
    model: ModelOptions,
    inputs: InputOptions = InputOptions(),
    *,
    shapes: bool = False,
    depth: int | None = None,
) -> LayersReport:
    """The module tree; with shapes, one forward fills output shapes and call counts."""
    if depth is not None and depth < 1:
        raise UsageError(
            f"--depth must be 1 or more, got {depth}.", "use --depth 1 for top-level blocks."
        )
    if not shapes:  # no pass: no device, no input
        model = dataclasses.replace(model, device="cpu")
    prepared = prepare(model, Selection(every=True) if shapes else None, inputs if shapes else None)
    if not shapes and has_lazy(prepared.loaded.module):
        # lazy parameters get their sizes in a first forward: run one, unhooked
        x = model_input(prepared.loaded, inputs, model.seed).to(prepared.device)
        with hooked_pass(prepared, HookSession([], None), minput=x):
            pass
        recount(prepared.entries)
    session = HookSession(prepared.targets, None)
    if shapes:
        assert prepared.minput is not None
        with hooked_pass(prepared, session):
            pass
        recount(prepared.entries)  # lazy parameters are materialised now
    rows = [
        ModuleRow(
            e.name or ROOT_LABEL,
            e.type,
            e.depth,
            e.params,
            e.own_params,
            e.leaf,
            e.names[1:],
            hookable=e.unhookable is None,
        )
        for e in prepared.entries
        if depth is None or e.depth <= depth
    ]
    info = None
    if shapes:
        assert prepared.minput is not None
        first: dict[str, LayerCall] = {}
        for p in session.calls:
            first.setdefault(p.call.name, p.call)
        counts = {t.name: n for t, n in zip(prepared.targets, session.counts, strict=True)}
        for row in rows:
            call = first.get(row.name)
            row.calls = counts.get(row.name, 0)
            if call is not None:
                row.output_shapes = [
                    ("" if o.path == "out" else o.path.removeprefix("out") + " ")
                    + "x".join(map(str, o.shape))
                    for o in call.outputs
                ]
        info = _input_info(prepared.minput)
    return LayersReport(model_info(prepared.loaded), rows, info)


def _metric(meta: Mapping[str, Any]) -> str | None:
    metrics = meta.get("_metrics") or {}
    for dataset, values in metrics.items():
        for key, value in values.items():
            return f"{dataset} {key} {value}"
    return None


def list_registry(pattern: str | None = None, task: str | None = None) -> list[ModelEntry]:
    if task is not None and task not in TASKS:
        raise UsageError(f"unknown task {task!r}.", f"use one of: {', '.join(TASKS)}.")
    out: list[ModelEntry] = []
    for name in registry_names():
        if pattern and not fnmatch.fnmatchcase(name, pattern):
            continue
        t = task_of(name)
        if task is not None and t != task:
            continue
        enum = weights_enum(name)
        members = [w.name for w in enum] if enum is not None else []
        default = enum.DEFAULT if enum is not None else None
        size = None
        if default is not None:
            crop = getattr(default.transforms(), "crop_size", None)
            size = f"{crop[0]}" if crop else None
        out.append(
            ModelEntry(
                name=name,
                task=t,
                weights=members,
                default=default.name if default is not None else None,
                params=default.meta.get("num_params") if default is not None else None,
                input_size=size,
                metric=_metric(default.meta) if default is not None else None,
            )
        )
    if not out:
        what = f" matching {pattern!r}" if pattern else ""
        raise UsageError(
            f"no registry model{what}{f' in task {task}' if task else ''}.",
            "run `hookcli models` to list them all.",
        )
    return out


def show_file(path: str | Path) -> SavedFile:
    """Every tensor in a .safetensors file, with its statistics; metadata as stored."""
    from safetensors import safe_open

    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{p} not found.", "give a file written by --save.")
    try:
        with safe_open(str(p), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            collector = StatsCollector()
            tensors = [collector.add(f.get_tensor(key), key) for key in f.keys()]  # noqa: SIM118
    except Exception as exc:
        raise UsageError(
            f"{p} is not a readable safetensors file: {exc}", "give a file written by --save."
        ) from exc
    collector.finalize()
    return SavedFile(str(p), metadata, tensors)
