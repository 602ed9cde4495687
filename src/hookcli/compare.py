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
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookcli import beacon, bounds, isa
from hookcli._version import __version__
from hookcli.engine import Prepared, hooked_pass, model_input, prepare
from hookcli.errors import UsageError
from hookcli.hooks import HookSession, PendingCall
from hookcli.inputs import ModelInput, expand_paths
from hookcli.measure import Compared, Spill, measure, shape_label
from hookcli.options import InputOptions, ModelOptions, Selection
from hookcli.records import DiffCall, DiffReport, InputInfo, ModelInfo, TensorDiff
from hookcli.selection import count_params
from hookcli.tree import iter_tensors

_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}
SIDE_HELP = (
    "float32|float64|float16|bfloat16, autocast[:DTYPE], channels_last, quantized, compile, "
    "onnx, weights=W, seed=N, device=D; joined with commas"
)


@dataclass(frozen=True, slots=True)
class Side:
    """One variant of the model."""

    spec: str
    dtype: torch.dtype | None = None
    autocast: torch.dtype | None = None
    channels_last: bool = False
    weights: str | None = None
    seed: int | None = None
    device: str | None = None
    quantized: bool = False  # torchvision's int8 twin, calibrated on the run's input
    compile: bool = False  # each selected leaf module through torch.compile (inductor)
    onnx: bool = False  # exported with torch.onnx (dynamo), run by ONNX Runtime on the CPU

    def describe(self) -> str:
        return self.spec or "as loaded"


def parse_side(raw: str, option: str) -> Side:
    fields: dict[str, Any] = {}
    for part in (p.strip() for p in raw.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        key = key.lower()
        if key in _DTYPES and not sep:
            fields["dtype"] = _DTYPES[key]
        elif key.startswith("autocast") and not sep:
            name = key.partition(":")[2] or "bfloat16"
            if name not in ("bfloat16", "float16"):
                raise UsageError(
                    f"{option} {raw!r}: autocast has no dtype {name!r}; "
                    "its dtypes are bfloat16 and float16.",
                    f"e.g. {option} autocast:bfloat16 (or {option} quantized for int8).",
                )
            fields["autocast"] = _DTYPES[name]
        elif key in ("channels_last", "nhwc") and not sep:
            fields["channels_last"] = True
        elif key in ("quantized", "int8") and not sep:
            fields["quantized"] = True
        elif key == "compile" and not sep:
            fields["compile"] = True
        elif key in ("onnx", "onnxruntime", "ort") and not sep:
            fields["onnx"] = True
        elif key in ("weights", "device") and sep and value:
            fields[key] = value
        elif key == "seed" and sep and value.strip().lstrip("-").isdigit():
            fields["seed"] = bounds.integer(
                value.strip(), f"{option} seed", low=0, high=bounds.SEED_MAX, example="seed=1"
            )
        else:
            raise UsageError(
                f"{option} {raw!r}: {part!r} is not a side.", f"a side is made of: {SIDE_HELP}."
            )
    return Side(raw.strip(), **fields)


# ---------------------------------------------------------------- the spill file


# ---------------------------------------------------------------- sides


@dataclass(slots=True)
class _Run:
    side: Side
    prepared: Prepared


def _prepare_side(
    model: ModelOptions, selection: Selection, side: Side, *, with_input: InputOptions | None
) -> _Run:
    base = model.model
    if isinstance(base, nn.Module) and (side.dtype or side.channels_last or side.compile):
        base = copy.deepcopy(base)  # the Python API's own module: never changed in place
    options = dataclasses.replace(
        model,
        model=base,
        weights=side.weights if side.weights is not None else model.weights,
        seed=side.seed if side.seed is not None else model.seed,
        device=side.device if side.device is not None else model.device,
    )
    prepared = prepare(options, selection, with_input)
    module = prepared.loaded.module
    if side.dtype is not None:
        module.to(side.dtype)
    if side.channels_last:
        module.to(memory_format=torch.channels_last)
    if side.compile:
        _compile_leaves(prepared)
    return _Run(side, prepared)


def _compile_leaves(prepared: Prepared) -> None:
    """Each selected leaf module's forward through torch.compile (inductor), its hooks left
    outside the compiled code, so each row shows that layer's compiled numerics. (A whole-model
    torch.compile would break its graph at every hook anyway.) The first run compiles: seconds
    per distinct layer."""
    for t in prepared.targets:
        if next(t.module.children(), None) is None:
            t.module.forward = torch.compile(t.module.forward)


def _cast_tensor(t: torch.Tensor, side: Side, device: torch.device) -> torch.Tensor:
    if t.is_floating_point():
        t = t.to(device, side.dtype) if side.dtype is not None else t.to(device)
        if side.channels_last and t.dim() == 4:
            t = t.contiguous(memory_format=torch.channels_last)
        return t
    return t.to(device)


def _cast(minput: ModelInput, side: Side, device: torch.device) -> ModelInput:
    def cast(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return _cast_tensor(a, side, device)
        if isinstance(a, list):
            return [cast(x) for x in a]
        return a

    return minput.replace_args(tuple(cast(a) for a in minput.args))


@contextlib.contextmanager
def _autocast(side: Side, device: torch.device) -> Iterator[None]:
    if side.autocast is None:
        yield
        return
    with torch.autocast(device.type, dtype=side.autocast):
        yield


def _quantizable_twin(run: _Run, selection: Selection, calibration: ModelInput) -> None:
    """torchvision's quantizable version of the model, with this side's weights and conv+bn
    (+relu) fused, so that every side has the same modules under the same names; for a
    `quantized` side, then prepared, calibrated on the run's first input and converted to
    int8 (CPU)."""
    from torch.ao import quantization as tq

    from hookcli.loading import quiet_warnings, registry_names
    from hookcli.selection import module_entries, select

    p = run.prepared
    name = f"quantized_{p.loaded.name}"
    if name not in registry_names():
        twins = [n.removeprefix("quantized_") for n in registry_names() if n.startswith("quant")]
        raise UsageError(
            f"{p.loaded.spec} has no quantized twin in torchvision.",
            f"the quantized side works with: {', '.join(twins)}.",
        )
    if p.device.type != "cpu":
        raise UsageError("the quantized side runs on the CPU only.", "add --device cpu.")
    import torchvision

    with quiet_warnings():  # torch.ao.quantization's deprecation notices: not the user's
        twin = torchvision.models.get_model(name, weights=None, quantize=False)
        twin.load_state_dict(p.loaded.module.float().state_dict())
        twin.eval()
        twin.fuse_model()
        if run.side.quantized:
            twin.qconfig = tq.get_default_qconfig("x86")  # type: ignore[no-untyped-call]
            tq.prepare(twin, inplace=True)  # type: ignore[no-untyped-call]
            with torch.no_grad():
                twin(*_cast(calibration, Side(""), p.device).args)
            tq.convert(twin, inplace=True)  # type: ignore[no-untyped-call]
    if not run.side.quantized and run.side.dtype is not None:
        twin.to(run.side.dtype)
    p.loaded.module = twin
    p.entries = module_entries(twin)
    p.targets = select(
        p.entries,
        layers=selection.layers,
        types=selection.types,
        depth=selection.depth,
        model_label=p.loaded.spec,
    )


# ---------------------------------------------------------------- the passes


def _real(output: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The floating-point tensors of an output; int8 (quantized) ones as their real values."""
    for path, t in iter_tensors(output, "out"):
        if t.is_quantized:
            yield path, t.dequantize()
        elif t.is_floating_point():
            yield path, t


def _reference_pass(run: _Run, minput: ModelInput, spill: Spill, isolate: bool) -> None:
    def keep_output(pending: PendingCall, output: Any) -> None:
        c = pending.call
        for path, t in _real(output):
            spill.write((c.name, c.call, path), t)

    def keep_input(pending: PendingCall, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        c = pending.call
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.is_floating_point():
                spill.write((c.name, c.call, f"in[{i}]"), a)

    p = run.prepared
    session = HookSession(
        p.targets, None, on_output=keep_output, on_input=keep_input if isolate else None
    )
    with (
        _autocast(run.side, p.device),
        torch.no_grad(),
        hooked_pass(p, session, minput=minput) as result,
    ):
        for path, t in _real(result.output):
            spill.write(("(model)", 0, path), t)


def _compared_pass(
    run: _Run, minput: ModelInput, spill: Spill, isolate: bool, into: Compared
) -> None:
    p = run.prepared

    def compare(pending: PendingCall, output: Any) -> None:
        c = pending.call
        _, accs = into.calls.setdefault((c.name, c.call), (c.type, {}))
        into.order.setdefault((c.name, c.call), pending.finished or 0)
        for path, t in _real(output):
            measure(accs, path, spill.read((c.name, c.call, path)), t)

    def feed(pending: PendingCall, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        c = pending.call
        new = list(args)
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor) or not (a.is_floating_point() or a.is_quantized):
                continue
            ref = spill.read((c.name, c.call, f"in[{i}]"))
            if ref is None or tuple(ref.shape) != tuple(a.shape):
                continue
            x = torch.from_numpy(ref.copy())  # a copy: the read buffer is reused
            if a.is_quantized:  # an int8 layer: the reference input on the layer's own grid
                x = torch.quantize_per_tensor(x, a.q_scale(), a.q_zero_point(), a.dtype)
            else:
                x = x.to(a.device, a.dtype)
            if a.dim() == 4 and a.is_contiguous(memory_format=torch.channels_last):
                x = x.contiguous(memory_format=torch.channels_last)
            new[i] = x
        return tuple(new), kwargs

    session = HookSession(p.targets, None, on_output=compare, on_input=feed if isolate else None)
    with (
        _autocast(run.side, p.device),
        torch.no_grad(),
        hooked_pass(p, session, minput=minput) as result,
    ):
        for path, t in _real(result.output):
            measure(into.outputs, path, spill.read(("(model)", 0, path)), t)
    into.note_missing(spill, "only on the reference side")


# ---------------------------------------------------------------- the report


def diff_report(
    model: ModelOptions,
    selection: Selection,
    inputs: InputOptions,
    a: Side,
    b: Side,
    *,
    ref: Side | None = None,
    isolate: bool = False,
    tol: float = 1e-3,
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
    if reference.onnx:
        raise UsageError(
            "the onnx side cannot be the reference (its layers are not hooked).",
            "put it on --b, e.g. --a float32 --b onnx.",
        )
    if isolate and any(s.onnx for s in compared):
        raise UsageError(
            "--isolate cannot feed layers inside ONNX Runtime.",
            "drop --isolate for the onnx side (its rows are accumulated error).",
        )
    batches = _batches(inputs, batch_size)
    twin = any(s.quantized for s in (reference, *compared))
    runs = [  # the input is built once, by the reference side, and cast for each side
        _prepare_side(
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
                minput = model_input(base.loaded, batch, model.seed)
            else:
                assert base.minput is not None
                minput = base.minput
            if twin and first_input is None:  # every side the fused twin; int8 calibrated here
                for run in runs:
                    _quantizable_twin(run, selection, minput)
            first_input = first_input or minput
            spill.reset()
            with beacon.phase(f"diff side {labels[0]} ({runs[0].side.describe()})"):
                _reference_pass(runs[0], _cast(minput, reference, base.device), spill, isolate)
            spill.raise_if_failed()  # a tensor not spilled is not "only on this side"
            for label, run, into in zip(labels[1:], runs[1:], results, strict=True):
                side_input = _cast(minput, run.side, run.prepared.device)
                with beacon.phase(f"diff side {label} ({run.side.describe()})"):
                    if run.side.onnx:
                        from hookcli.onnx_side import onnx_pass

                        onnx_pass(run.prepared, side_input, spill, into)
                    else:
                        _compared_pass(run, side_input, spill, isolate, into)
            seen += minput.shapes()[0][0] if minput.shapes() else 1
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
    runs: list[_Run],
    results: list[Compared],
    minput: ModelInput,
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
                first = (rank, _describe_over(call, over[0], tol))
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
    description = minput.description
    if folder is not None:
        description = f"{seen} images from {folder}"
        notes.append(f"differences are over all {seen} images, summed exactly across batches")
    return DiffReport(
        model=info,
        input=InputInfo(description, minput.shapes(), minput.sources, minput.preprocessing),
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


def _describe_over(call: DiffCall, d: TensorDiff, tol: float) -> str:
    side = "A" if call.a and d in call.a else "B"
    what = (
        f"{d.nonfinite} values not finite"
        if d.nonfinite
        else d.note or f"relative L2 {d.rel_l2:.3g} > tol {tol:g}"
    )
    return f"{call.name} ({call.type}) call {call.call}, {d.path}, side {side}: {what}"


# ---------------------------------------------------------------- two saved reports


def diff_saved(path_a: str, path_b: str, tol: float = 1e-3) -> DiffReport:
    """Two JSON reports of one model (inspect/grads -f json): only their statistics are
    known, so each tensor is compared by the relative change of its norm (`norm_rel`); the
    mean and std changes are noted."""
    from hookcli.reportfile import load_report

    tol = bounds.tolerance(tol, "--tol", "--tol 1e-3")
    record = "give two reports written by hookcli inspect/grads/check -f json -o FILE."
    reports = [load_report(p, "", record) for p in (path_a, path_b)]
    a, b = reports
    if a["model"].get("spec") != b["model"].get("spec"):
        raise UsageError(
            f"the reports are of different models ({a['model'].get('spec')} vs "
            f"{b['model'].get('spec')}).",
            "compare two reports of one model.",
        )
    before = {(c["name"], c["call"]): c for c in a["layers"]}
    calls: list[DiffCall] = []
    first = None
    for c in b["layers"]:
        old = before.pop((c["name"], c["call"]), None)
        if old is None:
            continue
        by_path = {t["path"]: t for t in old["outputs"]}
        diffs = [_stat_diff(by_path.get(t["path"]), t, tol) for t in c["outputs"]]
        calls.append(DiffCall(c["name"], c["type"], c["call"], diffs))
        over = next((d for d in diffs if d.over), None)
        if over is not None and first is None:
            first = _describe_over(calls[-1], over, tol)
    matched = {(c.name, c.call) for c in calls}
    missing = [f"{n} call {k}: only in {path_a}" for n, k in before]
    missing += [
        f"{c['name']} call {c['call']}: only in {path_b}"
        for c in b["layers"]
        if (c["name"], c["call"]) not in matched
    ]
    m = b["model"]
    return DiffReport(
        model=ModelInfo(m["name"], m["spec"], m["task"], m["weights"], m["params"]),
        input=InputInfo(f"{a['input']['description']} | {b['input']['description']}", []),
        device=f"{a.get('device')} | {b.get('device')}",
        a=path_a,
        b=path_b,
        ref=None,
        isolate=False,
        tol=tol,
        calls=calls,
        first_over=first,
        missing=missing,
        notes=[
            "two saved reports: only statistics are known, so tensors are compared by the "
            "relative change of their norm (norm Δ); run `hookcli diff MODEL …` for max|Δ|, "
            "relative L2, cosine and SQNR"
        ],
        hookcli_version=__version__,
    )


def _stat_diff(old: dict[str, Any] | None, new: dict[str, Any], tol: float) -> TensorDiff:
    d = TensorDiff(new["path"], tuple(new["shape"]), new["numel"])
    if old is None:
        d.note, d.over = "only in the second report", True
        return d
    if old["shape"] != new["shape"]:
        d.note, d.over = (
            f"shapes differ: {shape_label(old['shape'])} vs {shape_label(new['shape'])}",
            True,
        )
        return d
    d.nonfinite = int((new.get("nan") or 0) + (new.get("inf") or 0))
    na, nb = old.get("norm"), new.get("norm")
    if na is not None and nb is not None:
        d.norm_rel = abs(nb - na) / na if na else (0.0 if nb == 0 else None)
    changes = [
        f"{k} {old[k]:.4g} -> {new[k]:.4g}"
        for k in ("mean", "std")
        if old.get(k) is not None and new.get(k) is not None and old[k] != new[k]
    ]
    d.note = "; ".join(changes) or None
    d.over = d.nonfinite > 0 or d.norm_rel is None or d.norm_rel > tol
    return d
