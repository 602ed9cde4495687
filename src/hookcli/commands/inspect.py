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
from hookcli.commands import probes as probing
from hookcli.engine.callers import fsdp_managed_any
from hookcli.engine.measure import (
    PART,
    PendingParam,
    claimed_params,
    finish,
    finish_param,
    images_in,
    label_layouts,
    measure_params,
    measured_pass,
    origins_of,
    statistics,
)
from hookcli.engine.passes import deterministic_algorithms
from hookcli.engine.prepare import Prepared, prepare
from hookcli.engine.probes import Measured, Probe
from hookcli.engine.selection import held, params_and_dtype
from hookcli.engine.sharded import data_parallel_size, is_sharded, mean_over_ranks
from hookcli.engine.tensorbits import finite_or_none
from hookcli.errors import UsageError
from hookcli.inputs import ModelInput, skipped_note
from hookcli.inputs.text import POSITIONS_NOTE
from hookcli.options import Invocation, RunOptions
from hookcli.records import (
    Backward,
    InputInfo,
    LayerCall,
    ModelInfo,
    Prediction,
    Report,
)
from hookcli.runtime import gcpause, isa
from hookcli.sources import LoadedModel
from hookcli.text import few
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

    clean_run = dataclasses.replace(run, ablate=())
    probes = probing.inspection(clean_run, command)
    ablating = probing.inspection(  # the second pass: no file, timing or memory of its own
        dataclasses.replace(run, save=None, profile=False, memory=False), command
    )
    inputs = inv.inputs
    if run.generate:
        if inv.backward is not None:
            raise UsageError(
                "--generate runs model.generate, which has no backward.",
                "drop --generate for gradients (grads takes the text's next-token loss), or "
                "run inspect/check --generate.",
            )
        if inputs.has_text:  # (token ids given as a tensor carry no padding to place)
            inputs = dataclasses.replace(inputs, generating=True)  # (its side: from_text)
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
    if run.generate:  # part of the input every pass runs (--profile's timed ones too)
        from hookcli.sources.lm import generation_args, generation_prompt

        assert prepared.model_input is not None
        made = prepared.model_input
        if made.positions_from_mask:  # (generate makes them, step by step)
            made.kwargs.pop("position_ids", None)
            made.positions_from_mask = False
            made.description = made.description.replace(POSITIONS_NOTE, "")
        prompt = generation_prompt(prepared.model_input, prepared.loaded)
        prepared.model_input.generate = generation_args(
            prepared.loaded, run.generate, run.sample, prompt
        )
    with deterministic_algorithms(run.deterministic):
        clean = _one_run(prepared, clean_run, command, probes)
        if run.ablate:  # the same model and input once more, those layers' outputs changed
            changed = _one_run(prepared, run, command, ablating)
            ablate = next(p for p in ablating if isinstance(p, probing.Ablate))
            clean.ablation = ablation.compare(clean, changed, ablate.specs)
    return clean


def _one_run(prepared: Prepared, run: RunOptions, command: str, probes: Sequence[Probe]) -> Report:
    with gcpause.held():  # the pass and its report: see runtime/gcpause.py
        return _report_of_run(prepared, run, command, probes)


def _report_of_run(
    prepared: Prepared, run: RunOptions, command: str, probes: Sequence[Probe]
) -> Report:
    """One measured pass with the run's probes; its report is what every pass measures (the
    calls, the model's outputs, parameters and gradients, predictions, where NaN/Inf began)
    with each probe's findings folded in."""
    loaded, model_input = prepared.loaded, prepared.model_input
    assert model_input is not None
    backward = prepared.backward is not None
    collector = statistics(run.stats_backend, hist_bins=run.hist)
    params: dict[str, list[PendingParam]] = {}
    with measured_pass(
        prepared,
        collector,
        images=images_in(model_input),
        backward=backward,
        train=run.train,
        probes=probes,
    ) as measured:
        result = measured.result
        assert result is not None
        if backward:
            params = measure_params(claimed_params(prepared.targets), collector)
        collector.context = ("(input)", 0, "grad_input")  # (data parallel: ÷ W, as the rest)
        input_grads = [
            collector.add(t.grad, path) for path, t in prepared.input_leaves if t.grad is not None
        ]
        predictions, note = predict(
            collector.book.as_whole(result.output),  # (TP: the whole output's classes)
            loaded,
            _topk(run.topk, loaded),
            model_input,
            run.topk is not None,
        )
    session, layers, outputs = measured.session, measured.calls, measured.outputs
    label_layouts(layers, measured.armed.layout_of)
    first_call: dict[str, LayerCall] = {}
    for call in layers:
        first_call.setdefault(call.name, call)
    for name, pending in params.items():
        if name in first_call:
            first_call[name].params = [finish_param(p) for p in pending]
    value = None
    if result.scalar is not None:  # (data parallel: the ranks' mean, DDP's and FSDP's loss)
        value = finite_or_none(mean_over_ranks(result.scalar, collector.book.batch_groups))
    tensors = held(loaded.module)  # (after the pass: lazy parameters are materialised)
    report = Report(
        model=model_info(loaded, run.train, prepared.seed, tensors),
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
        notes=_notes(prepared, measured, tensors[0]),
        backward=backward_of(prepared, value),
        input_grads=input_grads if prepared.input_leaves else None,
        nonfinite_origins=origins_of(prepared, session, outputs),
        nonfinite_images=measured.by_image,
        config=run.config,
        command=command,
        hookcli_version=__version__,
    )
    return finish(measured, report, probes)


def _notes(prepared: Prepared, measured: Measured, params: Sequence[torch.Tensor]) -> list[str]:
    """What every pass says: the machine, the preparation, how the pass ran, what could not
    be hooked or failed in a layer, the inputs skipped. `params`: the model's, after the
    pass."""
    session, model_input = measured.session, measured.model_input
    assert measured.result is not None
    notes = isa.notes() + prepared.notes + measured.result.notes
    if measured.armed.backward and any(p.is_meta for p in params):
        notes.append(
            "parameters on the meta device (offloaded, e.g. by accelerate, and loaded only "
            "while their module runs): their weights and gradients cannot be read here"
        )
    ranks = data_parallel_size(measured.collector.book.batch_groups)
    if measured.armed.backward and ranks > 1:
        notes.append(
            f"data parallel over {ranks} ranks: the loss is the ranks' mean and the activation "
            f"gradients are its own (each rank's ÷ {ranks}), as DDP and FSDP average the "
            "parameters' gradients"
        )
        # FSDP2 shards (and averages) the parameters it manages; another one's gradient is
        # this rank's own (the optimizer steps it so, each rank its own way)
        if fsdp_managed_any(prepared.loaded.module) and any(is_sharded(p) for p in params):
            plain = [
                n for n, p in prepared.loaded.module.named_parameters()
                if p.requires_grad and not is_sharded(p)
            ]  # fmt: skip
            if plain:
                notes.append(
                    f"parameters FSDP2 does not manage (plain tensors, not DTensors): "
                    f"{few(plain, 4)}: "
                    "their gradients are this rank's own, not averaged over the ranks"
                )
    if measured.armed.backward and any(PART in (t.note or "") for t in measured.outputs):
        notes.append(
            "the backward target read this rank's part of the model's output (how it lies over "
            "the ranks cannot be told here): its value and every gradient from it are that "
            "part's, not the whole output's"
        )
    unseen = [
        t.name
        for t, n in zip(prepared.targets, session.counts, strict=True)
        if n == 0 and "_orig_mod." in f"{t.name}."
    ]
    if unseen:  # (torch.compile's cached graph, traced before the hooks: it calls none)
        notes.append(
            f"selected layers inside torch.compile'd code never ran as modules: {few(unseen, 4)}"
            " — compiled code run from a graph traced before hookcli's hooks (a warm cache) "
            "calls none of them; run hookcli before the model's first compiled call, or "
            "torch._dynamo.reset() first"
        )
    if session.without_grad:
        notes.append(
            f"ran under torch.no_grad inside the model: {few(list(session.without_grad), 4)} — "
            "a reentrant torch.utils.checkpoint (which recomputes them in backward, unhooked) "
            "or the model's own no_grad: their gradients are not measured (use_reentrant=False "
            "checkpoints are)"
        )
    if session.unhooked:
        refused = ", ".join(f"{name} ({why})" for name, why in session.unhooked[:5])
        notes.append(f"not hookable, so not measured: {refused}")
    notes += [f"{c.name} call {c.call}: {c.error}" for c in measured.calls if c.error]
    if model_input.skipped:
        notes.append(skipped_note(model_input.skipped))
    return notes


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


def _topk(topk: int | None, loaded: LoadedModel) -> int:
    if topk is None:  # a custom model's output is not known to be class scores: ask first
        return loaded.kind.default_topk
    return topk


def model_info(
    loaded: LoadedModel,
    train: bool = False,
    seed: int | None = None,
    tensors: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
) -> ModelInfo:
    """The model's description; its parameter count taken now (after the forward, lazy
    parameters are materialised). `tensors`: what `held(loaded.module)` gives now, when the
    caller has it."""
    params, dtype = params_and_dtype(loaded.module, tensors)
    return ModelInfo(
        loaded.name,
        loaded.spec,
        loaded.task,
        loaded.weights_label,
        params,
        "train" if train else "eval",
        seed,
        dtype,
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
    if model_input.generate is not None:  # (generated text: report.generated)
        said = "--topk: with --generate the generated tokens are the output (no top-k table)"
        return None, said if asked and topk > 0 else None
    if topk == 0:
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
