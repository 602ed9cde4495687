"""One inspection: load → select → hook → forward → Report. Also `layers` and `models`.

The model is left as found: hooks removed, every module's train/eval flag restored, and (for a
module passed in through the Python API) its device restored, whatever happens in between.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch
from torch import nn

from hookcli import __version__
from hookcli.errors import ModelError, UsageError
from hookcli.hooks import HookSession, PendingCall, Target, measure
from hookcli.inputs import ModelInput, default_input, from_images, from_specs
from hookcli.loading import (
    SUPPORTED_TASKS,
    TASKS,
    LoadedModel,
    load_model,
    registry_names,
    resolve_device,
    task_of,
    weights_enum,
)
from hookcli.records import (
    InputInfo,
    LayerCall,
    LayersReport,
    ModelEntry,
    ModelInfo,
    ModuleRow,
    Prediction,
    Report,
    TensorStats,
)
from hookcli.selection import ROOT_LABEL, module_entries, select
from hookcli.stats import StatsCollector, fill

RANDOM_WEIGHTS_NOTE = "weights are random (--weights none): predictions are meaningless"


@contextlib.contextmanager
def model_left_as_found(model: nn.Module, device: torch.device) -> Iterator[None]:
    """eval() and the target device for the run; every flag and the device restored after."""
    training = [m for m in model.modules() if m.training]
    first = next(iter(model.parameters()), None)
    home = first.device if first is not None else None
    try:
        for m in training:
            m.training = False
        if home is not None and home != device:
            model.to(device)
        yield
    finally:
        for m in training:
            m.training = True
        if home is not None and home != device:
            model.to(home)


def _failing_layer(tb: TracebackType | None, names: Mapping[int, str]) -> str | None:
    """The innermost module of the model whose code was running when the forward raised."""
    innermost = None
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            innermost = names[id(owner)]
        tb = tb.tb_next
    return innermost


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    first = first if len(first) <= 300 else first[:297] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def run_forward(
    loaded: LoadedModel,
    minput: ModelInput,
    targets: list[Target],
    collector: StatsCollector | None,
    device: torch.device,
) -> tuple[HookSession, Any]:
    """The hooked forward under no_grad; model failures become ModelError (exit 3)."""
    model = loaded.module
    names = {id(m): (n or ROOT_LABEL) for n, m in model.named_modules()}
    session = HookSession(targets, collector)
    with model_left_as_found(model, device), session, torch.no_grad():
        try:
            output = model(*minput.args)
        except torch.OutOfMemoryError as exc:
            raise ModelError(
                f"out of memory running {loaded.name} on {device}: {_one_line(exc)}",
                "use fewer or smaller inputs, or --device cpu.",
            ) from exc
        except Exception as exc:
            where = _failing_layer(exc.__traceback__, names)
            if where is None:
                open_calls = session.open_calls()
                where = open_calls[-1].call.name if open_calls else None
            place = f" in layer {where}" if where else ""
            raise ModelError(
                f"{loaded.name} failed{place}: {_one_line(exc)}",
                "check the input shape against the model (`hookcli layers "
                f"{loaded.spec} --shapes`).",
            ) from exc
    return session, output


def prepare_input(
    loaded: LoadedModel, images: Sequence[str], specs: Sequence[str], seed: int
) -> ModelInput:
    if images and specs:
        raise UsageError(
            "give image files or --input tensor specs, not both.", "use one kind of input per run."
        )
    if images:
        return from_images(images, loaded)
    if specs:
        return from_specs(specs, seed, loaded)
    return default_input(loaded, seed)


def inspect(
    model: str | nn.Module,
    inputs: Sequence[str] | torch.Tensor | Sequence[torch.Tensor] = (),
    *,
    input_specs: Sequence[str] = (),
    layers: Sequence[str] = (),
    types: Sequence[str] = (),
    depth: int | None = None,
    weights: str = "none",
    seed: int = 0,
    device: str = "auto",
    topk: int | None = None,
    model_args: Mapping[str, Any] | None = None,
    stats_backend: str = "auto",
) -> Report:
    """Run one forward pass with statistics hooks on the selected layers; return the Report.

    `model` is a registry name, `file.py:Name`, `package.module:Name` or an nn.Module;
    `inputs` image paths/folders, or tensors (positional arguments of forward).
    `stats_backend` "torch" skips the fused CPU kernel (for comparison; results agree).
    """
    if topk is not None and topk < 0:
        raise UsageError(f"--topk must be 0 or more, got {topk}.", "use --topk 5.")
    dev = resolve_device(device)
    loaded = load_model(model, weights=weights, seed=seed, model_args=model_args)  # type: ignore[arg-type]
    targets = select(
        module_entries(loaded.module),
        layers=layers,
        types=types,
        depth=depth,
        model_label=loaded.spec,
    )
    if isinstance(inputs, torch.Tensor):
        minput = ModelInput((inputs,), f"tensor {'x'.join(map(str, inputs.shape))}")
    elif inputs and all(isinstance(x, torch.Tensor) for x in inputs):
        minput = ModelInput(tuple(inputs), "tensors")
    else:
        minput = prepare_input(loaded, [str(x) for x in inputs], input_specs, seed)
    minput = minput.to(dev)
    collector = StatsCollector(fused=stats_backend != "torch")
    session, output = run_forward(loaded, minput, targets, collector, dev)
    out_stats: list[TensorStats] = []
    out_rows: list[int] = []
    measure(collector, output, "out", out_stats, out_rows)
    if topk is None:  # a custom model's output is not known to be class scores: ask first
        topk = 0 if loaded.task == "custom" else 5
    predictions, note = predict(output, loaded, topk, minput.sources)
    rows = collector.finalize()
    layers_out = [_complete(p, rows) for p in session.calls]
    for s, r in zip(out_stats, out_rows, strict=True):
        if r >= 0:
            fill(s, rows[r])
    notes = [
        f"{c.call.name} call {c.call.call}: {c.call.error}" for c in session.calls if c.call.error
    ]
    return Report(
        model=_model_info(loaded),
        input=InputInfo(minput.description, minput.shapes(), minput.sources, minput.preprocessing),
        device=str(dev),
        layers=layers_out,
        never_called=[t.name for t, n in zip(targets, session.counts, strict=True) if n == 0],
        outputs=out_stats,
        predictions=predictions,
        prediction_note=note,
        notes=notes,
        hookcli_version=__version__,
    )


def _model_info(loaded: LoadedModel) -> ModelInfo:
    params = sum(p.numel() for p in loaded.module.parameters())
    return ModelInfo(loaded.name, loaded.spec, loaded.task, loaded.weights_label, params)


def _complete(pending: PendingCall, rows: Any) -> LayerCall:
    call = pending.call
    for stats_list, idxs in (
        (call.inputs, pending.input_rows),
        (call.outputs, pending.output_rows),
    ):
        for s, r in zip(stats_list, idxs, strict=True):
            if r >= 0:
                fill(s, rows[r])
    return call


# ---------------------------------------------------------------- predictions


def predict(
    output: Any, loaded: LoadedModel, topk: int, sources: Sequence[str]
) -> tuple[list[Prediction] | None, str | None]:
    """Top-k per image: classes (classification), detections (detection), pixel shares
    (segmentation). Labels come from the weights' categories."""
    if topk == 0:
        return None, None
    cats = loaded.categories
    meaningless = "" if loaded.pretrained else f"; {RANDOM_WEIGHTS_NOTE}"

    def label(i: int) -> str | None:
        return cats[i] if cats is not None and 0 <= i < len(cats) else None

    def source(i: int) -> str | None:
        return sources[i] if i < len(sources) else None

    preds: list[Prediction] = []
    with torch.no_grad():
        if loaded.task == "detection" and isinstance(output, list):
            for img, det in enumerate(output):
                if not isinstance(det, Mapping) or "scores" not in det:
                    return None, None
                scores, labels = det["scores"].float().cpu(), det["labels"].cpu()
                order = torch.argsort(scores, descending=True)[:topk]
                for rank, j in enumerate(order.tolist(), 1):
                    idx = int(labels[j])
                    preds.append(
                        Prediction(rank, idx, label(idx), float(scores[j]), img, source(img))
                    )
            return preds, f"top-{topk} detections per image by score{meaningless}"
        if loaded.task == "segmentation" and isinstance(output, Mapping) and "out" in output:
            logits = output["out"]
            for img in range(logits.shape[0]):
                cls = logits[img].argmax(0).reshape(-1).cpu()
                share = torch.bincount(cls, minlength=logits.shape[1]).double() / cls.numel()
                values, idxs = share.topk(min(topk, share.numel()))
                for rank, (v, i) in enumerate(zip(values.tolist(), idxs.tolist(), strict=True), 1):
                    preds.append(Prediction(rank, i, label(i), v, img, source(img)))
            return preds, f"classes by share of pixels (prob = fraction of pixels){meaningless}"
        if (
            loaded.task in ("classification", "custom")
            and isinstance(output, torch.Tensor)
            and output.dim() == 2
            and output.is_floating_point()
            and output.shape[1] > 1
        ):
            probs = torch.softmax(output.detach().double(), dim=1).cpu()
            values, idxs = probs.topk(min(topk, probs.shape[1]), dim=1)
            for img in range(probs.shape[0]):
                for rank, (v, i) in enumerate(
                    zip(values[img].tolist(), idxs[img].tolist(), strict=True), 1
                ):
                    preds.append(Prediction(rank, i, label(i), v, img, source(img)))
            return preds, f"top-{topk} classes by softmax probability{meaningless}"
    return None, None


# ---------------------------------------------------------------- layers and models


def layers_report(
    model: str | nn.Module,
    inputs: Sequence[str] = (),
    *,
    input_specs: Sequence[str] = (),
    shapes: bool = False,
    depth: int | None = None,
    weights: str = "none",
    seed: int = 0,
    device: str = "auto",
    model_args: Mapping[str, Any] | None = None,
) -> LayersReport:
    """The module tree; with shapes, one forward fills output shapes and call counts."""
    if depth is not None and depth < 1:
        raise UsageError(
            f"--depth must be 1 or more, got {depth}.", "use --depth 1 for top-level blocks."
        )
    dev = resolve_device(device) if shapes else torch.device("cpu")
    loaded = load_model(model, weights=weights, seed=seed, model_args=model_args)  # type: ignore[arg-type]
    entries = module_entries(loaded.module)
    rows = [
        ModuleRow(
            e.name or ROOT_LABEL, e.type, e.depth, e.params, e.own_params, e.leaf, e.names[1:]
        )
        for e in entries
        if depth is None or e.depth <= depth
    ]
    info = None
    if shapes:
        minput = prepare_input(loaded, inputs, input_specs, seed).to(dev)
        targets = [Target(e.module, e.name or ROOT_LABEL, e.names[1:], e.type) for e in entries]
        session, _ = run_forward(loaded, minput, targets, None, dev)
        first: dict[str, LayerCall] = {}
        for p in session.calls:
            first.setdefault(p.call.name, p.call)
        counts = {t.name: n for t, n in zip(targets, session.counts, strict=True)}
        for row in rows:
            call = first.get(row.name)
            row.calls = counts.get(row.name, 0)
            if call is not None:
                row.output_shapes = [
                    ("" if o.path == "out" else o.path.removeprefix("out") + " ")
                    + "x".join(map(str, o.shape))
                    for o in call.outputs
                ]
        info = InputInfo(minput.description, minput.shapes(), minput.sources, minput.preprocessing)
    return LayersReport(_model_info(loaded), rows, info)


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
        if default is not None and t in SUPPORTED_TASKS:
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
