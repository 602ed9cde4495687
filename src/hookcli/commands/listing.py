"""Listings: the module tree (`hookcli layers`), the torchvision registry (`hookcli models`) and
what a saved safetensors file holds (`hookcli show`)."""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hookcli.commands.inspect import input_info, model_info
from hookcli.commands.measured import statistics
from hookcli.commands.memory import tied_names
from hookcli.engine.hooks import HookSession
from hookcli.engine.passes import build_input, hooked_pass, prepare
from hookcli.engine.selection import ROOT_LABEL, has_lazy, recount
from hookcli.errors import ModelError, UsageError, one_line
from hookcli.options import InputOptions, ModelOptions, Selection
from hookcli.records import LayerCall, LayersReport, ModelEntry, ModuleRow, SavedFile
from hookcli.sources import TASKS
from hookcli.sources.torchvision import registry_names, task_of, weights_enum


def layers_report(
    model: ModelOptions,
    inputs: InputOptions = InputOptions(),
    *,
    shapes: bool = False,
    depth: int | None = None,
) -> LayersReport:
    """The module tree; with shapes, one forward fills output shapes and call counts. Built on
    the meta device (model.meta), the forward runs there too: shapes and each module's FLOPs
    with no weight read or allocated."""
    if depth is not None and depth < 1:
        raise UsageError(
            f"--depth must be 1 or more, got {depth}.", "use --depth 1 for top-level blocks."
        )
    shapes = shapes or model.meta
    if not shapes:  # no pass: no device, no input
        model = dataclasses.replace(model, device="cpu")
    prepared = prepare(model, Selection(every=True) if shapes else None, inputs if shapes else None)
    if not shapes and has_lazy(prepared.loaded.module):
        # lazy parameters get their sizes in a first forward: run one, unhooked
        x = build_input(prepared.loaded, inputs, model.seed).to(prepared.device)
        with hooked_pass(prepared, HookSession([], None), model_input=x):
            pass
        recount(prepared.entries)
    session = HookSession(prepared.targets, None)
    if shapes:
        assert prepared.model_input is not None
        try:
            with _meta_kernels(model.meta), hooked_pass(prepared, session):
                pass
        except ModelError as exc:
            if model.meta and "meta" in str(exc):
                raise ModelError(
                    f"{prepared.loaded.spec}'s forward reads a tensor's values, which the meta "
                    f"device does not have ({one_line(exc.__cause__ or exc)}).",
                    "drop --meta: --shapes runs the forward with real (random) weights.",
                ) from exc
            raise
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
    tied: dict[str, list[str]] = {}
    for name, met in tied_names(prepared.loaded.module):
        owner, _, attr = name.rpartition(".")
        tied.setdefault(owner or ROOT_LABEL, []).append(f"{attr} = {met}")
    for row in rows:
        row.tied = tied.get(row.name, [])
    info = None
    flops = None
    if model.meta:
        from hookcli.engine.flops import count_flops

        with _meta_kernels(True):
            count = count_flops(prepared)
        if count.note:
            prepared.notes.append(count.note)
        flops = count.forward
        per: dict[str, int] = {}
        for (name, _), n in count.by_call.items():
            per[name] = per.get(name, 0) + n
        for row in rows:
            row.flops = per.get(row.name)
    if shapes:
        assert prepared.model_input is not None
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
        info = input_info(prepared.model_input)
    notes = list(dict.fromkeys(prepared.loaded.notes + prepared.notes))
    return LayersReport(model_info(prepared.loaded), rows, info, flops, notes)


def _meta_kernels(meta: bool) -> contextlib.AbstractContextManager[None]:
    """On the meta device, a mixture-of-experts model's fused experts run in every dtype
    (engine/flops.py's grouped_mm_on_meta); elsewhere nothing changes."""
    if not meta:
        return contextlib.nullcontext()
    from hookcli.engine.flops import grouped_mm_on_meta

    return grouped_mm_on_meta()


def _metric(meta: Mapping[str, Any]) -> str | None:
    metrics = meta.get("_metrics") or {}
    for dataset, values in metrics.items():
        for key, value in values.items():
            return f"{dataset} {key} {value}"
    return None


SOURCES = ("torchvision", "timm", "hf")


def list_models(
    pattern: str | None = None, task: str | None = None, source: str = "torchvision"
) -> list[ModelEntry]:
    """`hookcli models`: torchvision's registry, timm's (`--source timm`), or the Hugging Face
    model types with a classification head (`--source hf`); GLOB on the name after the prefix."""
    if source == "torchvision":
        return list_registry(pattern, task)
    if source not in SOURCES:
        raise UsageError(f"unknown source {source!r}.", f"use one of: {', '.join(SOURCES)}.")
    if task is not None and task != "classification":
        raise UsageError(
            f"--source {source} lists classification models only, not {task}.",
            "drop --task, or use --source torchvision.",
        )
    out = _timm_entries(pattern) if source == "timm" else _hf_entries(pattern)
    if not out:
        raise UsageError(
            f"no {source} model matching {pattern!r}.",
            f"run `hookcli models --source {source}` to list them all.",
        )
    return out


def _timm_entries(pattern: str | None) -> list[ModelEntry]:
    from hookcli.sources.timm import list_timm, pretrained_tags

    tags = pretrained_tags()
    out = []
    for name in list_timm(pattern):
        own = tags.get(name, ([], None))
        out.append(
            ModelEntry(
                name=f"timm:{name}",
                task="classification",
                weights=own[0],
                default=own[0][0] if own[0] else None,
                params=None,
                input_size=own[1],
                metric=None,
            )
        )
    return out


def _hf_entries(pattern: str | None) -> list[ModelEntry]:
    from hookcli.sources.hf import model_types

    kinds = [("image", "classification"), ("text", "text-classification")]
    return [
        ModelEntry(f"hf:{t}", task, [], None, None, None, None)
        for kind, task in kinds
        for t in model_types(kind)
        if not pattern or fnmatch.fnmatchcase(t, pattern)
    ]


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
            collector = statistics()
            tensors = [collector.add(f.get_tensor(key), key) for key in f.keys()]  # noqa: SIM118
    except Exception as exc:
        raise UsageError(
            f"{p} is not a readable safetensors file: {exc}", "give a file written by --save."
        ) from exc
    collector.finalize()
    return SavedFile(str(p), metadata, tensors)
