"""One inspection: load → select → hook → forward → Report. Also `layers` and `models`.

The model is left as found: hooks removed, every module's train/eval flag restored, and (for a
module passed in through the Python API) its device restored, whatever happens in between.
"""

from __future__ import annotations

import contextlib
import fnmatch
import statistics
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from hookcli import __version__
from hookcli.errors import ModelError, UsageError
from hookcli.hooks import HookSession, PendingCall, Target, measure
from hookcli.inputs import ModelInput, default_input, from_images, from_specs
from hookcli.loading import (
    TASKS,
    LoadedModel,
    load_model,
    registry_names,
    resolve_device,
    task_of,
    weights_enum,
)
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
from hookcli.selection import ROOT_LABEL, module_entries, select
from hookcli.stats import StatsCollector, fill
from hookcli.targets import parse_target
from hookcli.targets import scalar as scalar_of

RANDOM_WEIGHTS_NOTE = "weights are random (--weights none): predictions are meaningless"


@contextlib.contextmanager
def model_left_as_found(
    model: nn.Module, device: torch.device, *, train: bool = False
) -> Iterator[None]:
    """The run's mode (eval, or train on request) and device; everything restored after.

    Every module's own train/eval flag comes back, and the device. In train mode BatchNorm
    updates its running statistics even without gradients (HOOK_PITFALLS 9), so buffers are
    snapshotted and copied back: the state_dict is unchanged by any hookcli run.
    """
    modes = [(m, m.training) for m in model.modules()]
    first = next(iter(model.parameters()), None)
    home = first.device if first is not None else None
    buffers = [(b, b.detach().clone()) for b in model.buffers()] if train else []
    try:
        for m, training in modes:
            if training != train:
                m.training = train
        if home is not None and home != device:
            model.to(device)
        yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved.to(b.device))
        for m, training in modes:
            m.training = training
        if home is not None and home != device:
            model.to(home)


@contextlib.contextmanager
def deterministic_algorithms(on: bool) -> Iterator[None]:
    """CI runs: torch's deterministic algorithms where it has them, the setting restored after."""
    if not on:
        yield
        return
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@contextlib.contextmanager
def grads_left_as_found(params: list[nn.Parameter]) -> Iterator[None]:
    """Parameters' .grad set to None for the run (so only this backward is read) and the
    user's own .grad objects put back after."""
    saved = [(p, p.grad) for p in params]
    try:
        for p in params:
            p.grad = None
        yield
    finally:
        for p, g in saved:
            p.grad = g


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
    loaded: LoadedModel, minput: ModelInput, session: HookSession, device: torch.device
) -> Any:
    """The hooked forward (the caller sets grad mode and the model's state); model failures
    become ModelError (exit 3) naming the layer that was running."""
    model = loaded.module
    with session:
        try:
            return model(*minput.args)
        except torch.OutOfMemoryError as exc:
            raise ModelError(
                f"out of memory running {loaded.name} on {device}: {_one_line(exc)}",
                "use fewer or smaller inputs, or --device cpu.",
            ) from exc
        except Exception as exc:
            names = {id(m): (n or ROOT_LABEL) for n, m in model.named_modules()}
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


def run_backward(loaded: LoadedModel, value: torch.Tensor) -> None:
    if not value.requires_grad:
        raise UsageError(
            f"nothing in {loaded.spec} requires grad, so there is no gradient to show "
            "(no trainable parameter reaches the output).",
            "unfreeze parameters, or add --input-grad for the gradient w.r.t. the input.",
        )
    try:
        value.backward()  # type: ignore[no-untyped-call]
    except torch.OutOfMemoryError as exc:
        raise ModelError(
            f"out of memory in backward: {_one_line(exc)}", "use fewer or smaller inputs."
        ) from exc
    except RuntimeError as exc:
        raise ModelError(
            f"{loaded.name} failed in backward: {_one_line(exc)}",
            "the model's own backward raised; check custom autograd code.",
        ) from exc


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


def _model_input(
    loaded: LoadedModel,
    inputs: Sequence[str] | torch.Tensor | Sequence[torch.Tensor],
    input_specs: Sequence[str],
    seed: int,
) -> ModelInput:
    if isinstance(inputs, torch.Tensor):
        return ModelInput((inputs,), f"tensor {'x'.join(map(str, inputs.shape))}")
    if inputs and all(isinstance(x, torch.Tensor) for x in inputs):
        return ModelInput(tuple(inputs), "tensors")
    return prepare_input(loaded, [str(x) for x in inputs], input_specs, seed)


def _with_input_grad(minput: ModelInput) -> tuple[ModelInput, list[tuple[str, torch.Tensor]]]:
    """Copies of the floating-point inputs that require grad (the user's stay untouched)."""
    leaves: list[tuple[str, torch.Tensor]] = []

    def leaf(t: torch.Tensor, path: str) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        copy = t.detach().clone().requires_grad_(True)
        leaves.append((path, copy))
        return copy

    args: list[Any] = []
    for i, a in enumerate(minput.args):
        if isinstance(a, torch.Tensor):
            args.append(leaf(a, f"in[{i}]"))
        elif isinstance(a, list):
            args.append(
                [
                    leaf(t, f"in[{i}][{j}]") if isinstance(t, torch.Tensor) else t
                    for j, t in enumerate(a)
                ]
            )
        else:
            args.append(a)
    return ModelInput(tuple(args), minput.description, minput.sources, minput.preprocessing), leaves


def inspect(
    model: str | nn.Module,
    inputs: Sequence[str] | torch.Tensor | Sequence[torch.Tensor] = (),
    **options: Any,
) -> Report:
    """Run one forward pass with statistics hooks on the selected layers; return the Report.

    `model` is a registry name, `file.py:Name`, `package.module:Name` or an nn.Module;
    `inputs` image paths/folders, or tensors (positional arguments of forward). Options:
    input_specs, layers, types, depth, weights, seed, device, topk, model_args, train,
    stats_backend ("torch" skips the fused CPU kernel; results agree).
    """
    return _run(model, inputs, command="inspect", **options)


def grads(
    model: str | nn.Module,
    inputs: Sequence[str] | torch.Tensor | Sequence[torch.Tensor] = (),
    **options: Any,
) -> Report:
    """As inspect, plus a backward pass: each call's grad_output/grad_input statistics and
    each selected layer's parameter gradients. Extra options: target ("top1", a class index
    or label, "sum"), loss ("ce:IDX", "mse:ones", …), input_grad."""
    return _run(model, inputs, command="grads", **options)


def _run(
    model: str | nn.Module | LoadedModel,
    inputs: Sequence[str] | torch.Tensor | Sequence[torch.Tensor],
    *,
    command: str,
    input_specs: Sequence[str] = (),
    layers: Sequence[str] = (),
    types: Sequence[str] = (),
    depth: int | None = None,
    weights: str = "none",
    seed: int = 0,
    device: str = "auto",
    topk: int | None = None,
    model_args: Mapping[str, Any] | None = None,
    train: bool = False,
    target: str | None = None,
    loss: str | None = None,
    input_grad: bool = False,
    stats_backend: str = "auto",
    config: str | None = None,
    also_layers: Sequence[str] = (),
    deterministic: bool = False,
    save: str | Path | None = None,
    hist: int = 0,
    profile: bool = False,
    ablate: Sequence[str] = (),
    _ablations: Sequence[Any] = (),
) -> Report:
    if topk is not None and topk < 0:
        raise UsageError(f"--topk must be 0 or more, got {topk}.", "use --topk 5.")
    backward = command == "grads"
    dev = resolve_device(device)
    if ablate:  # a clean run and an ablated one of the same model, compared
        from hookcli import ablation

        specs = [ablation.parse(a) for a in ablate]
        shared = load_model(model, weights=weights, seed=seed, model_args=model_args)
        again = {k: v for k, v in locals().items() if k in _RUN_OPTIONS}
        clean = _run(shared, inputs, **again)
        changed = _run(shared, inputs, **{**again, "_ablations": specs, "save": None})
        clean.ablation = ablation.compare(clean, changed, specs)
        return clean
    loaded = load_model(model, weights=weights, seed=seed, model_args=model_args)
    if loaded.task == "quantized":
        if device.strip().lower() == "auto":
            dev = torch.device("cpu")  # int8 kernels exist on the CPU only
        if backward:
            raise UsageError(
                f"{loaded.spec} is quantized: int8 kernels have no autograd, so "
                "there are no gradients.",
                f"use the float model ({loaded.spec.removeprefix('quantized_')}).",
            )
        if dev.type != "cpu":
            raise UsageError(
                f"{loaded.spec} is quantized and runs on the CPU only.", "use --device cpu."
            )
    spec = parse_target(target, loss, loaded.categories) if backward else None
    entries = module_entries(loaded.module)
    targets = select(
        entries,
        layers=layers,
        types=types,
        depth=depth,
        model_label=loaded.spec,
        also=also_layers,
    )
    minput = _model_input(loaded, inputs, input_specs, seed).to(dev)
    input_leaves: list[tuple[str, torch.Tensor]] = []
    if backward and input_grad:
        minput, input_leaves = _with_input_grad(minput)
    if hist < 0:
        raise UsageError(f"histogram bins must be 0 or more, got {hist}.", "use --hist.")
    collector = StatsCollector(fused=stats_backend != "torch", hist_bins=hist)
    saver = None
    if save is not None:
        from hookcli.saving import TensorSaver

        saver = TensorSaver(
            Path(save),
            {
                "format": "pt",
                "hookcli_version": __version__,
                "command": command,
                "model": loaded.spec,
                "weights": loaded.weights_label,
                "input": minput.description,
                "device": str(dev),
            },
        )
    session = HookSession(targets, collector, grads=backward, saver=saver)
    params = list(loaded.module.parameters())
    param_stats: dict[int, list[PendingParam]] = {}
    scalar: torch.Tensor | None = None
    from hookcli.ablation import ablated

    with (
        model_left_as_found(loaded.module, dev, train=train),
        grads_left_as_found(params if backward else []),
        deterministic_algorithms(deterministic),
        ablated(entries, _ablations, seed) as ablation_calls,
    ):
        timing = None
        if profile:  # times from a pass whose hooks only read the clock
            unhooked = _time_unhooked(loaded, minput, spec, seed, params)
            timing = _timed_pass(
                loaded, minput, targets, dev, spec=spec, seed=seed, params=params, backward=backward
            )
            timing_profile = _profiles(timing, targets, unhooked)
        torch.manual_seed(seed)  # dropout and the like, in train mode
        try:
            with torch.set_grad_enabled(backward):
                output = run_forward(loaded, minput, session, dev)
                if spec is not None:
                    scalar = scalar_of(spec, output, seed)
                    run_backward(loaded, scalar)
        except BaseException:
            if saver is not None:
                saver.discard()  # never a half-written file
            raise
        finally:
            session.remove_tensor_hooks()
        if saver is not None:
            saver.close()
        for spec, n in zip(_ablations, ablation_calls, strict=True):
            if n == 0:
                raise UsageError(
                    f"--ablate: layer {spec.layer} never ran, so ablating it changes nothing.",
                    "ablate a layer that runs (`hookcli layers MODEL --shapes` shows calls).",
                )
        if backward:
            param_stats = {i: _param_stats(t.module, collector) for i, t in enumerate(targets)}
        out_stats: list[TensorStats] = []
        out_rows: list[int] = []
        measure(collector, output, "out", out_stats, out_rows)
        grad_rows = [collector.add(t.grad, path) for path, t in input_leaves if t.grad is not None]
        predictions, note = predict(output, loaded, _topk(topk, loaded), minput.sources)
    rows = collector.finalize()
    first_call: dict[str, LayerCall] = {}
    layers_out = []
    for p in session.calls:
        call = _complete(p, rows, backward)
        layers_out.append(call)
        first_call.setdefault(call.name, call)
    for i, t in enumerate(targets):
        if i in param_stats and t.name in first_call:
            first_call[t.name].params = [_fill_param(ps, rows) for ps in param_stats[i]]
    for s, r in zip(out_stats, out_rows, strict=True):
        if r >= 0:
            fill(s, rows[r])
    profile_out = None
    if timing is not None:
        profile_out = timing_profile
        by_call = {(p.call.name, p.call.call): p.call.profile for p in timing.calls}
        for call in layers_out:
            call.profile = by_call.get((call.name, call.call))
    notes = [
        f"{c.call.name} call {c.call.call}: {c.call.error}" for c in session.calls if c.call.error
    ]
    if saver is not None:
        notes.append(f"saved {len(saver.entries)} tensors to {save}")
        if saver.skipped:
            notes.append(f"not saved (no safetensors dtype): {', '.join(saver.skipped[:5])}")
    return Report(
        model=_model_info(loaded, train),
        input=InputInfo(minput.description, minput.shapes(), minput.sources, minput.preprocessing),
        device=str(dev),
        layers=layers_out,
        never_called=[t.name for t, n in zip(targets, session.counts, strict=True) if n == 0],
        outputs=out_stats,
        predictions=predictions,
        prediction_note=note,
        notes=notes,
        backward=Backward(spec.describe(), float(scalar.detach()))
        if spec and scalar is not None
        else None,
        input_grads=[fill(s, rows[r]) for s, r in grad_rows] if input_grad else None,
        nonfinite_origins=find_origins(session.calls),
        profile=profile_out,
        config=config,
        command=command,
        hookcli_version=__version__,
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


def _time_unhooked(
    loaded: LoadedModel,
    minput: ModelInput,
    spec: Any,
    seed: int,
    params: list[nn.Parameter],
    *,
    runs: int = 3,
) -> tuple[float, float | None]:
    """The same pass without hooks: forward (and backward) ms, median of `runs` after one
    warm-up. Parameter gradients it makes are cleared."""
    model = loaded.module
    fwd: list[float] = []
    bwd: list[float] = []
    for i in range(runs + 1):
        torch.manual_seed(seed)
        with torch.set_grad_enabled(spec is not None):
            _sync()
            t0 = time.perf_counter()
            out = model(*minput.args)
            _sync()
            t1 = time.perf_counter()
            if spec is not None:
                value = scalar_of(spec, out, seed)
                t2 = time.perf_counter()
                value.backward()  # type: ignore[no-untyped-call]
                _sync()
                t3 = time.perf_counter()
                for p in params:
                    p.grad = None
                if i:
                    bwd.append((t3 - t2) * 1e3)
        if i:
            fwd.append((t1 - t0) * 1e3)
    return statistics.median(fwd), statistics.median(bwd) if bwd else None


def _timed_pass(
    loaded: LoadedModel,
    minput: ModelInput,
    targets: list[Target],
    dev: torch.device,
    *,
    spec: Any,
    seed: int,
    params: list[nn.Parameter],
    backward: bool,
) -> HookSession:
    """--profile: one more pass with hooks that only read the clock (no statistics between
    layers to disturb the caches), forward and, for grads, backward."""
    session = HookSession(targets, None, grads=backward, profile=True)
    torch.manual_seed(seed)
    try:
        with torch.set_grad_enabled(backward):
            out = run_forward(loaded, minput, session, dev)
            if spec is not None:
                scalar_of(spec, out, seed).backward()  # type: ignore[no-untyped-call]
    finally:
        session.remove_tensor_hooks()
        for p in params:
            p.grad = None
    return session


def _sync() -> None:
    """Wait for queued GPU work, so a clock reading means what it says."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _profiles(
    session: HookSession, targets: list[Target], unhooked: tuple[float, float | None]
) -> Profile:
    fwd_ms, bwd_ms = unhooked
    leaves = {t.name for t in targets if next(t.module.children(), None) is None}
    layers_ms = 0.0
    layers_bwd = 0.0
    if any(p.events for p in session.calls):
        torch.cuda.synchronize()  # once: every recorded event has completed
    for p in session.calls:
        f = (p.t_forward[1] - p.t_forward[0]) / 1e6 if len(p.t_forward) == 2 else 0.0
        if len(p.events) == 2:  # CUDA: the device's own time between the two events
            f = float(p.events[0].elapsed_time(p.events[1]))
        b = (p.t_backward[1] - p.t_backward[0]) / 1e6 if len(p.t_backward) == 2 else None
        p.call.profile = CallProfile(f, b, p.output_bytes, f / fwd_ms if fwd_ms else None)
        if p.call.name in leaves:
            layers_ms += f
            layers_bwd += b or 0.0
    return Profile(fwd_ms, layers_ms, 3, bwd_ms, layers_bwd if bwd_ms is not None else None)


_RUN_OPTIONS = (
    "command",
    "input_specs",
    "layers",
    "types",
    "depth",
    "weights",
    "seed",
    "device",
    "topk",
    "model_args",
    "train",
    "target",
    "loss",
    "input_grad",
    "stats_backend",
    "config",
    "also_layers",
    "deterministic",
    "save",
    "hist",
    "profile",
)


def _topk(topk: int | None, loaded: LoadedModel) -> int:
    if topk is None:  # a custom model's output is not known to be class scores: ask first
        return 0 if loaded.task == "custom" else 5
    return topk


Entry = tuple[TensorStats, int]  # statistics waiting for their collector row
PendingParam = tuple[ParamStats, Entry, Entry | None]  # the weight's entry, the gradient's


def _param_stats(module: nn.Module, collector: StatsCollector) -> list[PendingParam]:
    """A module's parameters and their gradients, measured after backward."""
    out = []
    for name, p in module.named_parameters():
        weight = collector.add(p, name)
        grad = collector.add(p.grad, f"{name}.grad") if p.grad is not None else None
        out.append(
            (ParamStats(name, tuple(p.shape), p.numel(), p.requires_grad, None), weight, grad)
        )
    return out


def _fill_param(pending: PendingParam, rows: Any) -> ParamStats:
    ps, (weight, w_row), grad = pending
    ps.norm = fill(weight, rows[w_row]).norm
    if grad is not None:
        g = fill(grad[0], rows[grad[1]])
        ps.grad = g
        ps.grad_norm = g.norm
        ps.grad_mean = g.mean
        if g.min is not None and g.max is not None:
            ps.grad_max_abs = max(abs(g.min), abs(g.max))
        if ps.norm and g.norm is not None:
            ps.ratio = g.norm / ps.norm
    return ps


def _model_info(loaded: LoadedModel, train: bool = False) -> ModelInfo:
    params = sum(p.numel() for p in loaded.module.parameters())
    return ModelInfo(
        loaded.name,
        loaded.spec,
        loaded.task,
        loaded.weights_label,
        params,
        "train" if train else "eval",
    )


def _complete(pending: PendingCall, rows: Any, backward: bool) -> LayerCall:
    call = pending.call
    for stats_list, idxs in (
        (call.inputs, pending.input_rows),
        (call.outputs, pending.output_rows),
    ):
        for s, r in zip(stats_list, idxs, strict=True):
            if r >= 0:
                fill(s, rows[r])
    if backward:
        # in the order of the inputs/outputs; absent gradients are left out, all absent → None
        for attr, grads, tensors in (
            ("grad_inputs", pending.grad_inputs, call.inputs),
            ("grad_outputs", pending.grad_outputs, call.outputs),
        ):
            found = [fill(*_row(grads[t.path], rows)) for t in tensors if t.path in grads]
            setattr(call, attr, found or None)
    return call


def _row(entry: Entry, rows: Any) -> tuple[TensorStats, Any]:
    return entry[0], rows[entry[1]]


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
            loaded.task in ("classification", "custom", "video", "quantized")
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
    loaded = load_model(model, weights=weights, seed=seed, model_args=model_args)
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
        session = HookSession(targets, None)
        with model_left_as_found(loaded.module, dev), torch.no_grad():
            run_forward(loaded, minput, session, dev)
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
            entries = [collector.add(f.get_tensor(key), key) for key in f.keys()]  # noqa: SIM118
    except (OSError, ValueError, RuntimeError, Exception) as exc:
        raise UsageError(
            f"{p} is not a readable safetensors file: {exc}", "give a file written by --save."
        ) from exc
    rows = collector.finalize()
    return SavedFile(str(p), metadata, [fill(s, rows[i]) for s, i in entries])
