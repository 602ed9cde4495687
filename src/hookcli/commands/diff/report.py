"""`hookcli diff`: where two runs of one model part ways, layer by layer.

A *side* is a variant of one model: a dtype (`float16`, `bfloat16`, `float64`), `autocast`
(`autocast:bfloat16`), `channels_last`, another `weights=…` or `seed=…`, another `device=…`,
combined with commas (`--b float16,channels_last`). Both sides run the same input through the
engine's hooked pass; every selected layer call's output is aligned by module name, call index
and tensor path, and measured against the reference: max|Δ|, relative L2, cosine, SQNR (dB),
accumulated in float64 over the elements finite on both sides.

The reference side runs first and its outputs spill to a temporary file the moment a hook sees
them; the compared side reads each one back when its own hook fires and keeps only the five
sums a difference needs. Peak memory is one activation, whatever the number of layers; the
sums add exactly across batches (folders). `--isolate` feeds each selected layer the reference
side's input, so a row shows that layer's own error rather than what it inherited; `--ref SIDE`
(e.g. float64) measures both sides against a third run, to say which one is wrong.

This module runs the steps in order; what each side changes is its kinds' own (sides.py).
"""

from __future__ import annotations

import dataclasses

from hookcli import bounds
from hookcli._version import __version__
from hookcli.commands.diff.measure import Compared, Spill, describe_over
from hookcli.commands.diff.passes import reference_pass, side_pass
from hookcli.commands.diff.sides import Side, SideRun, prepare_side, quantizable_twin
from hookcli.engine.passes import build_input
from hookcli.engine.selection import count_params
from hookcli.inputs import ModelInput, expand_paths
from hookcli.options import DEFAULTS, InputOptions, ModelOptions, Selection
from hookcli.records import DiffCall, DiffReport, InputInfo, ModelInfo
from hookcli.runtime import beacon, isa


def diff_report(
    model: ModelOptions,
    selection: Selection,
    inputs: InputOptions,
    a: Side,
    b: Side,
    *,
    ref: Side | None = None,
    isolate: bool = DEFAULTS.diff.isolate,
    tol: float = DEFAULTS.diff.tol,
    batch_size: int | None = None,
) -> DiffReport:
    """Side B (and, with a --ref side, side A) against the reference, per layer call."""
    tol = bounds.tolerance(tol, "--tol", "--tol 1e-3")
    if batch_size is not None:
        batch_size = bounds.integer(
            batch_size, "--batch-size", low=1, high=bounds.BATCH_MAX, example="--batch-size 32"
        )
    reference = ref or a
    compared = [a, b] if ref is not None else [b]
    reference.check_role(reference=True, isolate=isolate)
    for side in compared:
        side.check_role(reference=False, isolate=isolate)
    batches = _batches(inputs, batch_size)
    twin = any(s.needs_twin for s in (reference, *compared))
    runs = [  # the input is built once, by the reference side, and cast for each side
        prepare_side(
            model,
            Selection() if twin else selection,  # the twin's own modules are selected later
            s,
            with_input=None if batches or i else inputs,
        )
        for i, s in enumerate([reference, *compared])
    ]
    results = [Compared() for _ in compared]
    labels = ["ref", "A", "B"][-len(runs) :]  # what a crash message calls each side
    spill = Spill()
    seen = 0
    first_input: ModelInput | None = None
    try:
        todo: list[InputOptions | None] = [*batches] if batches else [None]
        for batch in todo:
            base = runs[0].prepared
            if batch is not None:
                model_input = build_input(base.loaded, batch, model.seed)
            else:
                assert base.model_input is not None
                model_input = base.model_input
            if twin and first_input is None:  # every side the fused twin; int8 calibrated here
                for run in runs:
                    quantizable_twin(run, selection, model_input)
            first_input = first_input or model_input
            spill.reset()
            with beacon.phase(f"diff side {labels[0]} ({runs[0].side.describe()})"):
                reference_pass(runs[0], reference.cast(model_input, base.device), spill, isolate)
            spill.raise_if_failed()  # a tensor not spilled is not "only on this side"
            for label, run, result in zip(labels[1:], runs[1:], results, strict=True):
                side_input = run.side.cast(model_input, run.prepared.device)
                with beacon.phase(f"diff side {label} ({run.side.describe()})"):
                    side_pass(run, side_input, spill, isolate, result)
            seen += model_input.shapes()[0][0] if model_input.shapes() else 1
    finally:
        spill.close()
    assert first_input is not None
    where = ", ".join(map(str, inputs.items[:2])) if batches else None
    return _report(runs, results, first_input, seen, isolate=isolate, tol=tol, folder=where)


def _batches(inputs: InputOptions, batch_size: int | None) -> list[InputOptions]:
    """Image folders in batches (the sums add exactly); other inputs: one pass."""
    paths = [x for x in inputs.items if isinstance(x, str)]
    if not paths or len(paths) != len(inputs.items):
        return []
    files = expand_paths(paths)
    size = batch_size or 32
    if batch_size is None and len(files) <= size:
        return []
    chunks = [files[i : i + size] for i in range(0, len(files), size)]
    return [
        dataclasses.replace(inputs, items=tuple(str(f.path) for f in chunk)) for chunk in chunks
    ]


def _report(
    runs: list[SideRun],
    results: list[Compared],
    model_input: ModelInput,
    seen: int,
    *,
    isolate: bool,
    tol: float,
    folder: str | None,
) -> DiffReport:
    with_ref = len(results) == 2
    last = results[-1]
    calls: list[DiffCall] = []
    first: tuple[int, str] | None = None
    for key, (type_, accs) in last.calls.items():
        call = DiffCall(key[0], type_, key[1], [acc.result(p, tol) for p, acc in accs.items()])
        if with_ref:
            _, a_accs = results[0].calls.get(key, (type_, {}))
            call.a = [acc.result(p, tol) for p, acc in a_accs.items()]
        calls.append(call)
        over = [d for d in [*call.b, *(call.a or [])] if d.over]
        if over:
            rank = last.order.get(key, 0)
            if first is None or rank < first[0]:
                first = (rank, describe_over(call, over[0], tol))
    outputs = [
        DiffCall("(model)", "output", 0, [a.result(p, tol) for p, a in last.outputs.items()])
    ]
    if with_ref:
        outputs[0].a = [acc.result(p, tol) for p, acc in results[0].outputs.items()]
    loaded = runs[0].prepared.loaded
    params = count_params(loaded.module)  # lazy parameters as materialised by the passes
    info = ModelInfo(loaded.name, loaded.spec, loaded.task, loaded.weights_label, params)
    notes = isa.notes()
    notes += [
        "--isolate: each selected layer was fed the reference side's input, so each row is "
        "that layer's own error"
        if isolate
        else "errors accumulate: each row includes what the layers before it passed on "
        "(--isolate separates a layer's own error)"
    ]
    description = model_input.description
    if folder is not None:
        description = f"{seen} images from {folder}"
        notes.append(f"differences are over all {seen} images, summed exactly across batches")
    return DiffReport(
        model=info,
        input=InputInfo(
            description, model_input.shapes(), model_input.sources, model_input.preprocessing
        ),
        device=str(runs[0].prepared.device),
        a=runs[1].side.describe() if with_ref else runs[0].side.describe(),
        b=runs[-1].side.describe(),
        ref=runs[0].side.describe() if with_ref else None,
        isolate=isolate,
        tol=tol,
        calls=calls,
        outputs=outputs,
        first_over=first[1] if first else None,
        missing=sorted(set().union(*(r.missing for r in results))),
        notes=notes,
        hookcli_version=__version__,
    )
