"""One inspection: prepare → hooked pass (and backward) → Report, with its predictions.
(`layers`, `models` and `show` are listing.py; --profile's timing, profile.py; where NaN/Inf
began, engine/origins.py.) The Python API reaches it through hookcli.commands.run_command.

Every pass goes through the engine (engine/passes.py), which leaves the model as found.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hookcli._version import __version__
from hookcli.commands.profile import profile_calls
from hookcli.engine.hooks import HookSession, Target, measure
from hookcli.engine.layout import LayoutOf, image_of, reader
from hookcli.engine.origins import find_origins, number_backward
from hookcli.engine.passes import (
    Prepared,
    deterministic_algorithms,
    hooked_pass,
    prepare,
)
from hookcli.engine.selection import ROOT_LABEL, count_params, depth_of
from hookcli.engine.stats import StatsCollector, finite_or_none
from hookcli.errors import UsageError
from hookcli.inputs import ModelInput, skipped_note
from hookcli.options import Invocation, RunOptions
from hookcli.records import (
    Backward,
    ImageNonfinite,
    InputInfo,
    LayerCall,
    ModelInfo,
    Origin,
    ParamStats,
    Prediction,
    Report,
    TensorStats,
)
from hookcli.runtime import gcpause, isa
from hookcli.sources import LoadedModel
from hookcli.tree import iter_tensors

RANDOM_WEIGHTS_NOTE = "weights are random (--weights none): predictions are meaningless"


def report(inv: Invocation, command: str) -> Report:
    """The whole inspection an Invocation describes: one hooked pass (two with --ablate)."""
    run = inv.run
    if run.topk is not None and run.topk < 0:
        raise UsageError(f"--topk must be 0 or more, got {run.topk}.", "use --topk 5.")
    if run.hist < 0:
        raise UsageError(f"histogram bins must be 0 or more, got {run.hist}.", "use --hist.")
    from hookcli.commands import ablation

    specs = [ablation.parse(a) for a in run.ablate]
    inputs = inv.inputs
    if run.generate:
        if inv.backward is not None:
            raise UsageError(
                "--generate runs model.generate, which has no backward.",
                "drop --generate for gradients (grads takes the text's next-token loss), or "
                "run inspect/check --generate.",
            )
        inputs = dataclasses.replace(inputs, padding_side="left")  # as generate needs
    elif run.sample:
        raise UsageError("--sample chooses how --generate decodes.", "add --generate N.")
    if run.generate and run.position is not None:
        raise UsageError(
            "--position picks the token predictions are read after; with --generate there are "
            "none (the generated tokens are the output).",
            "drop --position, or --generate.",
        )
    prepared = prepare(
        inv.model, inv.selection, inputs, backward=inv.backward, position=run.position
    )
    if run.generate:
        from hookcli.sources.lm import generation_args

        assert prepared.model_input is not None
        ids = prepared.model_input.kwargs.get("input_ids")
        prompt = int(ids.shape[-1]) if isinstance(ids, torch.Tensor) and ids.dim() == 2 else 0
        prepared.model_input.generate = generation_args(
            prepared.loaded, run.generate, run.sample, prompt
        )
    with deterministic_algorithms(run.deterministic):
        clean = _one_run(prepared, run, command)
        if specs:  # the same model and input once more, those layers' outputs changed
            quiet = dataclasses.replace(run, save=None, profile=False)
            changed = _one_run(prepared, quiet, command, specs)
            clean.ablation = ablation.compare(clean, changed, specs)
    return clean


PendingParam = tuple[ParamStats, TensorStats, TensorStats | None]  # the weight's, the gradient's


def label_layouts(layers: Sequence[LayerCall], layout_of: LayoutOf) -> None:
    """Each 3-D/4-D output's layout (engine.layout) into its stats: NCHW, NHWC, tokens:K+HxW,
    or unknown when neither the model nor the input size tells."""
    for call in layers:
        for t in call.outputs:
            if len(t.shape) in (3, 4):
                try:
                    t.layout = layout_of(call.name, t.shape).label
                except UsageError:
                    t.layout = "unknown"


def _one_run(
    prepared: Prepared, run: RunOptions, command: str, ablations: Sequence[Any] = ()
) -> Report:
    with gcpause.held():  # the pass and its report: see runtime/gcpause.py
        return _report_of_run(prepared, run, command, ablations)


def _report_of_run(
    prepared: Prepared, run: RunOptions, command: str, ablations: Sequence[Any]
) -> Report:
    from hookcli.commands.ablation import ablated

    loaded, model_input = prepared.loaded, prepared.model_input
    assert model_input is not None
    backward = prepared.backward is not None
    collector = StatsCollector(backend=run.stats_backend, hist_bins=run.hist)
    collector.set_token_mask(model_input.token_mask)
    if run.per_token:
        collector.per_token = token_grid(model_input)
    saver = _saver(prepared, run, command) if run.save is not None else None
    session = HookSession(
        prepared.targets, collector, grads=backward, saver=saver, readers=backward
    )
    timing = profile_calls(prepared, run) if run.profile else None
    layout_of = reader(loaded.module, *image_of(model_input.forward_values()))
    params: dict[str, list[PendingParam]] = {}
    outputs: list[TensorStats] = []
    batch = images_in(model_input)  # which image holds NaN/Inf: the input counted before
    values = model_input.forward_values()
    input_rows = None if batch is None else nonfinite_rows(values, batch, "in")
    try:
        with (
            ablated(prepared.entries, ablations, prepared.seed, layout_of) as ablation_calls,
            hooked_pass(prepared, session, train=run.train, backward=backward) as result,
        ):
            if backward:
                params = measure_params(claimed_params(prepared.targets), collector)
            measure(collector, result.output, "out", outputs)
            by_image = nonfinite_by_image(model_input, result.output, input_rows)
            input_grads = [
                collector.add(t.grad, path)
                for path, t in prepared.input_leaves
                if t.grad is not None
            ]
            predictions, note = predict(
                result.output, loaded, _topk(run.topk, loaded), model_input, run.topk is not None
            )
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
    if run.per_token:
        label_tokens(layers, model_input)
    number_backward(session.calls)
    label_layouts(layers, layout_of)
    first_call: dict[str, LayerCall] = {}
    for call in layers:
        first_call.setdefault(call.name, call)
    for name, pending in params.items():
        if name in first_call:
            first_call[name].params = [finish_param(p) for p in pending]
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
    if model_input.skipped:
        notes.append(skipped_note(model_input.skipped))
    if saver is not None:
        notes.append(f"saved {len(saver.entries)} tensors to {saver.dest.label}")
        if saver.skipped:
            notes.append(f"not saved (no safetensors dtype): {', '.join(saver.skipped[:5])}")
    value = None if result.scalar is None else finite_or_none(float(result.scalar.detach()))
    generated = None
    if model_input.generate is not None:
        from hookcli.sources.lm import generated_of

        generated, said = generated_of(result.output, model_input, loaded)
        notes.append(said)
    return Report(
        model=model_info(loaded, run.train, prepared.seed),
        input=input_info(model_input),
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
        generated=generated,
        notes=notes,
        backward=backward_of(prepared, value),
        input_grads=input_grads if prepared.input_leaves else None,
        nonfinite_origins=origins_of(prepared, session, outputs),
        nonfinite_images=by_image,
        profile=profile,
        config=run.config,
        command=command,
        hookcli_version=__version__,
    )


def token_grid(model_input: ModelInput) -> tuple[int, int]:
    """--per-token: the (batch, tokens) of the input's token ids."""
    ids = model_input.kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise UsageError(
            "--per-token needs token ids (a text model's input_ids, batch x tokens).",
            "give --text or --input input_ids=SPEC to a text model, or drop --per-token.",
        )
    return int(ids.shape[0]), int(ids.shape[1])


def label_tokens(layers: Sequence[LayerCall], model_input: ModelInput) -> None:
    """--per-token rows: padding positions left out, each row given the id and the token at
    its position."""
    ids = model_input.kwargs["input_ids"].tolist()
    mask = model_input.token_mask
    real = None if mask is None else mask.cpu().tolist()
    words: dict[tuple[int, int], str] = {}
    for b, text in enumerate(model_input.texts or []):
        where = [p for p in range(len(ids[b])) if real is None or real[b][p]]
        words.update({(b, p): tok for p, tok in zip(where, text.tokens, strict=False)})
    for call in layers:
        for t in call.outputs:
            if t.per_token is None:
                continue
            kept = [r for r in t.per_token if real is None or real[r.sequence][r.position]]
            for r in kept:
                r.id = int(ids[r.sequence][r.position])
                r.token = words.get((r.sequence, r.position))
            t.per_token = kept


def backward_of(prepared: Prepared, value: float | None) -> Backward | None:
    """What backward started from; for the next-token loss, its perplexity too."""
    spec = prepared.backward
    if spec is None:
        return None
    perplexity = None
    if spec.kind == "lm" and value is not None:
        perplexity = finite_or_none(math.exp(value)) if value < 700 else None
    return Backward(spec.describe(), value, perplexity)


def origins_of(
    prepared: Prepared, session: HookSession, outputs: Sequence[TensorStats] = ()
) -> list[Origin]:
    """Where NaN/Inf first appeared; a gap between calls named by the module tree."""
    types = {n: e.type for e in prepared.entries for n in e.names}
    selected = {id(t.module) for t in session.targets}
    partial = any(e.leaf and id(e.module) not in selected for e in prepared.entries)
    return find_origins(session.calls, types, partial=partial, outputs=outputs)


RowCounts = tuple[torch.Tensor, torch.Tensor]  # NaN and Inf per image (int64, on the CPU)


def images_in(model_input: ModelInput) -> int | None:
    """How many images a batch holds: a list input (detection) one per element, else the
    first tensor's first dimension; None when that cannot be told."""
    values = model_input.forward_values()
    if values and isinstance(values[0], list | tuple):
        return len(values[0])
    shapes = model_input.shapes()
    return shapes[0][0] if shapes and shapes[0] else None


def nonfinite_rows(values: Any, batch: int, root: str) -> RowCounts:
    """The NaN and Inf of `values` per image: a list of per-image items (detection's images
    and outputs) item by item, else every floating tensor whose first dimension is the batch,
    row by row (one small transfer at the end)."""
    nan = torch.zeros(batch, dtype=torch.int64)
    inf = torch.zeros(batch, dtype=torch.int64)
    per_item = isinstance(values, tuple) and len(values) == 1 and isinstance(values[0], list)
    items = values[0] if per_item else values
    if isinstance(items, list) and len(items) == batch and (per_item or root == "out"):
        for row, item in enumerate(items):
            for _, t in iter_tensors(item, root):
                if t.is_floating_point():
                    nan[row] += int(t.isnan().sum())
                    inf[row] += int(t.isinf().sum())
        return nan, inf
    found: list[torch.Tensor] = []
    for _, t in iter_tensors(values, root):
        if t.is_floating_point() and t.dim() > 0 and t.shape[0] == batch and not _finite(t):
            flat = t.detach().reshape(batch, -1)
            found.append(torch.stack([flat.isnan().sum(1), flat.isinf().sum(1)]))
    if found:
        both = torch.stack([f.to(found[0].device) for f in found]).sum(0).cpu()
        nan, inf = both[0], both[1]
    return nan, inf


def _finite(t: torch.Tensor) -> bool:
    """Known at once that a CPU tensor holds no NaN/Inf: its sum is finite (one fast read;
    a NaN or Inf anywhere makes the sum NaN or Inf). A sum that overflows only sends the
    tensor to the exact count. Off the CPU, never known without waiting for the device."""
    if not t.is_cpu:
        return False
    acc = torch.float64 if t.dtype is torch.float64 else torch.float32
    return math.isfinite(float(t.detach().sum(dtype=acc)))


def nonfinite_by_image(
    model_input: ModelInput, output: Any, inputs: RowCounts | None = None
) -> list[ImageNonfinite]:
    """The images whose input or the model's output hold NaN/Inf, with their counts.
    `inputs`: the input's counts taken before the pass (a model may change its input in
    place); else counted now."""
    batch = images_in(model_input)
    if batch is None:
        return []
    in_nan, in_inf = inputs or nonfinite_rows(model_input.forward_values(), batch, "in")
    out_nan, out_inf = nonfinite_rows(output, batch, "out")
    table = torch.stack([in_nan, in_inf, out_nan, out_inf]).tolist()
    sources = model_input.sources
    return [
        ImageNonfinite(
            row,
            sources[row] if row < len(sources) else None,
            *(int(table[k][row]) for k in range(4)),
        )
        for row in range(batch)
        if any(table[k][row] for k in range(4))
    ]


def input_info(model_input: ModelInput) -> InputInfo:
    return InputInfo(
        model_input.description,
        model_input.shapes(),
        model_input.sources,
        model_input.preprocessing,
        model_input.texts,
    )


def _saver(prepared: Prepared, run: RunOptions, command: str) -> Any:
    from hookcli.io.saving import TensorSaver

    assert run.save is not None
    assert prepared.model_input is not None
    return TensorSaver(
        run.save,
        {
            "format": "pt",
            "hookcli_version": __version__,
            "command": command,
            "model": prepared.loaded.spec,
            "weights": prepared.loaded.weights_label,
            "input": prepared.model_input.description,
            "device": str(prepared.device),
        },
    )


def _topk(topk: int | None, loaded: LoadedModel) -> int:
    if topk is None:  # a custom model's output is not known to be class scores: ask first
        return loaded.kind.default_topk
    return topk


def claimed_params(targets: Sequence[Target]) -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
    """Each selected module's parameters, by target name in the targets' order. A parameter is
    listed once, under the innermost selected module that holds it: a selected container lists
    only what no selected module inside it (nor a tied module before it) already lists."""
    claimed: set[int] = set()
    by_name: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
    for t in sorted(targets, key=lambda t: -depth_of("" if t.name == ROOT_LABEL else t.name)):
        own = []
        for name, p in t.module.named_parameters():
            if id(p) not in claimed:
                claimed.add(id(p))
                own.append((name, p))
        by_name[t.name] = own
    return {t.name: by_name[t.name] for t in targets}


def measure_params(
    params: dict[str, list[tuple[str, torch.nn.Parameter]]],
    collector: StatsCollector,
    grad_of: Callable[[torch.nn.Parameter], torch.Tensor | None] = lambda p: p.grad,
) -> dict[str, list[PendingParam]]:
    """Each claimed parameter and its gradient (`grad_of`: its .grad after backward; a folder
    run's sum over the batches), measured by the collector."""
    return {
        target: [
            (
                ParamStats(name, tuple(p.shape), p.numel(), p.requires_grad, None),
                collector.add(p, name),
                None if (g := grad_of(p)) is None else collector.add(g, f"{name}.grad"),
            )
            for name, p in own
        ]
        for target, own in params.items()
    }


def finish_param(pending: PendingParam) -> ParamStats:
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


def model_info(loaded: LoadedModel, train: bool = False, seed: int | None = None) -> ModelInfo:
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
        seed,
    )


# ---------------------------------------------------------------- predictions


def _outline(output: Any) -> str:
    shapes = ["x".join(map(str, t.shape)) or "scalar" for _, t in iter_tensors(output, "out")]
    return ", ".join(shapes[:3]) + (", …" if len(shapes) > 3 else "") or type(output).__name__


def predict(
    output: Any, loaded: LoadedModel, topk: int, model_input: ModelInput, asked: bool = False
) -> tuple[list[Prediction] | None, str | None]:
    """Top-k per image: classes (classification), detections (detection), pixel shares
    (segmentation). Labels come from the weights' categories; each row names its image (path
    relative to its folder) and, in an ImageFolder tree, the image's class folder. A
    non-finite score has prob None (JSON null), flagged in the table. An --output-key the
    output does not have is an error whether or not anything reads it (no prediction, --topk
    0): a gate never passes on a key that names nothing."""
    selected = loaded.kind.select(output)
    if topk == 0 or model_input.generate is not None:  # (generated text: report.generated)
        return None, None
    cats = loaded.categories
    meaningless = "" if loaded.pretrained else f"; {RANDOM_WEIGHTS_NOTE}"
    sources, classes = model_input.sources, model_input.classes

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
        read = loaded.kind.predict(selected, topk, row)
    if read is None:
        if asked:  # --topk given: never silent about what it could not read
            return None, (
                f"--topk {topk}: no predictions: the output ({_outline(selected)}) is neither "
                "class scores (N x classes) nor a language model's next-token logits"
            )
        return None, None
    preds, header = read
    return preds, header + meaningless
