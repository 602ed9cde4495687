"""One inspection: prepare → hooked pass (and backward) → Report, with its predictions.
(`layers`, `models` and `show` are listing.py; --profile's timing, profile.py; where NaN/Inf
began, engine/origins.py.) The Python API reaches it through hookcli.commands.run_command.

Every pass goes through the engine (engine/passes.py), which leaves the model as found.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from hookcli._version import __version__
from hookcli.commands import outliers
from hookcli.commands.experts import routing_report
from hookcli.commands.memory import gradient_bytes, memory_report
from hookcli.commands.profile import profile_calls
from hookcli.engine import fused_experts
from hookcli.engine.experts import counting_routes
from hookcli.engine.layout import image_of, reader
from hookcli.engine.measure import (
    PendingParam,
    claimed_params,
    finish_param,
    images_in,
    label_layouts,
    measure_params,
    measured_pass,
    origins_of,
    statistics,
)
from hookcli.engine.memory import MemoryMeter, distinct_bytes
from hookcli.engine.passes import deterministic_algorithms
from hookcli.engine.prepare import Prepared, prepare
from hookcli.engine.selection import count_params, dtype_of
from hookcli.engine.tensorbits import finite_or_none
from hookcli.errors import UsageError
from hookcli.inputs import ModelInput, skipped_note
from hookcli.options import Invocation, RunOptions
from hookcli.records import (
    Backward,
    InputInfo,
    LayerCall,
    ModelInfo,
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
        if run.heads:
            raise UsageError(
                "--heads reads attention in one forward of the input; --generate runs many.",
                "drop --generate to read the prompt's heads.",
            )
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
            quiet = dataclasses.replace(run, save=None, profile=False, memory=False)
            changed = _one_run(prepared, quiet, command, specs)
            clean.ablation = ablation.compare(clean, changed, specs)
    return clean


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
    collector = statistics(run.stats_backend, hist_bins=run.hist)
    collector.set_token_mask(model_input.token_mask)
    if run.per_token:
        collector.per_token = token_grid(model_input)
    saver = _saver(prepared, run, command) if run.save is not None else None
    timing = profile_calls(prepared, run) if run.profile else None
    layout_of = reader(loaded.module, *image_of(model_input.forward_values()))
    tapped: list[tuple[str, Any]] = []
    if run.channels:
        types = {n: e.type for e in prepared.entries for n in e.names}
        collector.channels = outliers.chooser(layout_of, types)
        # a fused MoE block's routed experts, per expert (no Linear runs per expert)
        tapped = fused_experts.selected_experts(loaded.module, (t.module for t in prepared.targets))
    params: dict[str, list[PendingParam]] = {}
    meter = MemoryMeter(loaded.module, prepared.device) if run.memory else None
    gradients = None
    output_bytes = 0
    try:
        with (
            counting_routes(loaded.module, model_input.token_mask) as routing,
            fused_experts.tapping(
                tapped, model_input.token_mask, hist=False, collector=collector
            ) as tap,
            ablated(prepared.entries, ablations, prepared.seed, layout_of) as ablation_calls,
            measured_pass(
                prepared,
                collector,
                images=images_in(model_input),
                backward=backward,
                train=run.train,
                saver=saver,
                memory=meter,
            ) as measured,
        ):
            result = measured.result
            assert result is not None
            if backward:
                params = measure_params(claimed_params(prepared.targets), collector)
                if meter is not None:
                    gradients = gradient_bytes(loaded.module)
            if meter is not None:
                output_bytes = distinct_bytes(t for _, t in iter_tensors(result.output, "out"))[0]
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
    session, layers, outputs = measured.session, measured.calls, measured.outputs
    if tap.measured:
        owners = {name: type(m).__name__ for name, m in tapped}
        layers = outliers.expert_rows(layers, tap.measured, owners)
    by_image = measured.by_image
    if run.per_token:
        label_tokens(layers, model_input, outputs)
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
    memory = None
    if meter is not None:
        memory = memory_report(
            prepared,
            meter,
            session.calls,
            gradients=gradients,
            output_bytes=output_bytes,
            train=run.train,
        )
    notes = isa.notes() + prepared.notes + result.notes
    if backward and any(p.is_meta for p in loaded.module.parameters()):
        notes.append(
            "parameters on the meta device (offloaded, e.g. by accelerate, and loaded only "
            "while their module runs): their weights and gradients cannot be read here"
        )
    if session.unhooked:
        refused = ", ".join(f"{name} ({why})" for name, why in session.unhooked[:5])
        notes.append(f"not hookable, so not measured: {refused}")
    notes += [f"{c.name} call {c.call}: {c.error}" for c in layers if c.error]
    if tap.measured:
        notes.append(
            "--channels: each routed expert's projections of a fused MoE block are rows of "
            "their own (EXPERTS.E.gate_up_proj, .down_proj), their input over the real tokens "
            "routed to expert E"
        )
    notes += [f"{name}: not read per expert: {why}" for name, why in tap.unreadable.items()]
    if model_input.token_mask is not None:
        notes += fused_experts.pair_notes(loaded.module, (t.name for t in prepared.targets))
    if model_input.skipped:
        notes.append(skipped_note(model_input.skipped))
    if saver is not None:
        notes.append(f"saved {len(saver.entries)} tensors to {saver.dest.label}")
        if saver.skipped:
            notes.append(f"not saved (no safetensors dtype): {', '.join(saver.skipped[:5])}")
    value = None if result.scalar is None else finite_or_none(float(result.scalar.detach()))
    experts = None
    if routing.routers:
        experts, routed = routing_report(routing)
        notes += routed
    heads = None
    if run.heads:
        from hookcli.commands.heads import attention_heads

        heads, heard = attention_heads(prepared)
        notes += heard
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
        memory=memory,
        outliers=outliers.summary(layers) if run.channels else None,
        heads=heads,
        experts=experts,
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


def label_tokens(
    layers: Sequence[LayerCall], model_input: ModelInput, outputs: Sequence[TensorStats] = ()
) -> None:
    """--per-token rows of every tensor that has them (a call's inputs and outputs, the
    model's own outputs): padding positions left out, each row given the id and the token at
    its position, and its position counted in its own text (a left-padded sequence's first
    real token is position 0, as when the text is run alone)."""
    ids = model_input.kwargs["input_ids"].tolist()
    mask = model_input.token_mask
    real = None if mask is None else mask.cpu().tolist()
    own: dict[tuple[int, int], int] = {}  # (sequence, column) → position in its text
    for b, row in enumerate(ids):
        where = [p for p in range(len(row)) if real is None or real[b][p]]
        own.update({(b, p): i for i, p in enumerate(where)})
    words: dict[tuple[int, int], str] = {}
    for b, text in enumerate(model_input.texts or []):
        words.update({(b, i): tok for i, tok in enumerate(text.tokens)})
    done: set[int] = set()  # a tensor's statistics shared by two places: labelled once
    tensors = [t for call in layers for t in (*call.inputs, *call.outputs)] + list(outputs)
    for t in tensors:
        if t.per_token is None or id(t) in done:
            continue
        done.add(id(t))
        rows = [dataclasses.replace(r) for r in t.per_token]  # (rows may be shared too)
        kept = [r for r in rows if (r.sequence, r.position) in own]
        for r in kept:
            r.id = int(ids[r.sequence][r.position])
            r.position = own[(r.sequence, r.position)]
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
        dtype_of(loaded.module),
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
