"""The two passes of a diff: the reference side's hooked pass spilling every selected call's
output (and, for --isolate or the own-error pass, input) and a classifier's scores to disk, and
a compared side's pass measuring each of its outputs against the spilled one — the hooked pass,
or the side's own (ONNX Runtime) — and, fed its own input, its predictions against the
reference's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from hookcli.commands.diff import ondevice
from hookcli.commands.diff.measure import (
    SCORES,
    Compared,
    ErrorSums,
    RealPositions,
    Reference,
    Sink,
    Spill,
    class_scores,
    measure,
    settle,
)
from hookcli.commands.diff.sides import SideRun
from hookcli.commands.diff.tokens import TokenAccumulator
from hookcli.engine.hooks import HookSession, PendingCall
from hookcli.engine.passes import hooked_pass
from hookcli.inputs import ModelInput
from hookcli.sources.hfbase import logits_of
from hookcli.sources.lm import CausalLM
from hookcli.sources.model import LoadedModel
from hookcli.tree import iter_tensors

MODEL = ("(model)", 0, "out")  # the model's own output (and class scores), after every call


def floats(output: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The floating-point tensors of an output; int8 (quantized) ones as their real values."""
    for path, t in iter_tensors(output, "out"):
        if t.is_quantized:
            yield path, t.dequantize()
        elif t.is_floating_point():
            yield path, t


def reference_pass(run: SideRun, model_input: ModelInput, sink: Sink, isolate: bool) -> None:
    """The reference side's hooked pass: each selected call's outputs (and, isolate, its
    inputs) put in the sink, then the model's output and class scores."""

    def keep_output(pending: PendingCall, output: Any) -> None:
        c = pending.call
        sink.put(c.name, c.call, "out", list(floats(output)))

    def keep_input(pending: PendingCall, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        c = pending.call
        floats = [
            (f"in[{i}]", a)
            for i, a in enumerate(args)
            if isinstance(a, torch.Tensor) and a.is_floating_point()
        ]
        sink.put(c.name, c.call, "in", floats)

    p = run.prepared
    session = HookSession(
        p.targets, None, on_output=keep_output, on_input=keep_input if isolate else None
    )
    with (
        run.side.context(p.device),
        torch.no_grad(),
        hooked_pass(p, session, model_input=model_input) as result,
    ):
        final = list(floats(result.output))
        scores = class_scores(p.loaded, result.output)
        if scores is not None:
            final.append((SCORES[2], scores))
        sink.put(*MODEL, final)


def compared_pass(
    run: SideRun,
    model_input: ModelInput,
    ref: Reference,
    isolate: bool,
    compared: Compared,
    *,
    exclude: Callable[[], bool] | None = None,
) -> None:
    """The hooked pass of a compared side; fed the reference's inputs (isolate), its
    predictions are not its own, so they are not compared. `exclude`: HookSession's (another
    pass of this side runs on the same model at the same time)."""
    p = run.prepared
    # a padded text batch: its padding enters no figure
    real = RealPositions.of_pass(model_input.token_mask, p.targets, p.loaded.module)
    # this pass's calls, added to `compared` once its forward is over: a forward that fails
    # and runs again with gradients (hooked_pass) forgets its first try's calls
    calls: dict[tuple[str, int], tuple[str, dict[str, ErrorSums]]] = {}
    order: dict[tuple[str, int], int] = {}
    tries = [0]

    def compare(pending: PendingCall, output: Any) -> None:
        c = pending.call
        if session.resets != tries[0]:
            calls.clear()
            order.clear()
            tries[0] = session.resets
        _, accs = calls.setdefault((c.name, c.call), (c.type, {}))
        order.setdefault((c.name, c.call), pending.finished or 0)
        key = (c.name, c.call, "out")
        with ref.get(*key) as lookup:
            for path, t in floats(output):
                measure(accs, path, lookup(path), t, real=real, context=key)

    def pace(pending: PendingCall, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ref.pace()

    def feed(pending: PendingCall, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        c = pending.call
        new = list(args)
        with ref.get(c.name, c.call, "in") as lookup:
            for i, a in enumerate(args):
                if not isinstance(a, torch.Tensor) or not (a.is_floating_point() or a.is_quantized):
                    continue
                given = lookup(f"in[{i}]")
                if given is None or tuple(given.shape) != tuple(a.shape):
                    continue
                # a copy: the reference's buffer (or tensor) moves on
                if isinstance(given, torch.Tensor):  # on the device: one copy, contiguous
                    x = given.to(
                        "cpu" if a.is_quantized else a.device,
                        torch.float32 if a.is_quantized else a.dtype,
                        memory_format=torch.contiguous_format,
                        copy=True,
                    )
                else:
                    x = torch.from_numpy(given.copy())
                if a.is_quantized:  # an int8 layer: the reference input on the layer's own grid
                    x = torch.quantize_per_tensor(x, a.q_scale(), a.q_zero_point(), a.dtype)
                else:
                    x = x.to(a.device, a.dtype)
                if a.layout is not torch.strided:  # a sparse input: A's values, its layout
                    x = _sparse_like(x, a)
                elif a.dim() == 4 and a.is_contiguous(memory_format=torch.channels_last):
                    x = x.contiguous(memory_format=torch.channels_last)
                new[i] = x
        ref.pace()  # the reference's input taken: its call runs first
        return tuple(new), kwargs

    session = HookSession(
        p.targets,
        None,
        on_output=compare,
        on_input=feed if isolate else pace,
        exclude=exclude,
    )
    with (
        run.side.context(p.device),
        torch.no_grad(),
        hooked_pass(p, session, model_input=model_input) as result,
        ref.get(*MODEL) as lookup,
    ):
        settle(acc for _, accs in calls.values() for acc in accs.values())  # one transfer
        compared.add_calls(calls, order)
        for path, t in floats(result.output):
            at = lookup(path)
            measure(compared.outputs, path, at, t, positions=True, real=real, context=MODEL)
        settle(compared.outputs.values())
        if not isolate:
            scores = class_scores(p.loaded, result.output)
            compared.agree(lookup(SCORES[2]), scores, model_input.sources)
            _next_tokens(p.loaded, model_input, result.output, lookup, compared)
    compared.note_missing(ref.index, "only on the reference side")


def _next_tokens(
    loaded: LoadedModel,
    model_input: ModelInput,
    output: Any,
    lookup: Callable[[str], Any],
    compared: Compared,
) -> None:
    """A causal language model's text: this side's next-token distributions against the
    reference's, position by position (commands/diff/tokens.py)."""
    ids = model_input.kwargs.get("input_ids")
    if not isinstance(loaded.kind, CausalLM) or not isinstance(ids, torch.Tensor):
        return
    logits = logits_of(output)
    path = next((path for path, t in floats(output) if t is logits), None)
    ref = None if path is None else lookup(path)
    if ref is None or not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        return
    if tuple(ref.shape) != tuple(logits.shape):
        compared.tokens_skipped = (
            f"the sides' logits differ in shape ({tuple(ref.shape)} and {tuple(logits.shape)}: "
            "another vocabulary?)"
        )
        return
    if tuple(logits.shape[:2]) != tuple(ids.shape):
        compared.tokens_skipped = (
            f"the logits' positions {tuple(logits.shape[:2])} are not the input's "
            f"{tuple(ids.shape)}"
        )
        return
    if isinstance(ref, torch.Tensor):
        ref = ondevice.after_writes(ref)  # (read here, on this thread's stream)
    if compared.tokens is None:
        compared.tokens = TokenAccumulator()
    mask = model_input.kwargs.get("attention_mask")
    compared.tokens.add(ref, logits, ids, mask, first=compared.texts_before)


def side_pass(
    run: SideRun, model_input: ModelInput, spill: Spill, isolate: bool, compared: Compared
) -> None:
    """A compared side's pass: its own if its kinds bring one (ONNX Runtime), else hooked."""
    runner = run.side.pass_runner()
    if runner is not None:
        runner(run.prepared, model_input, spill, compared)
    else:
        compared_pass(run, model_input, spill, isolate, compared)


def _sparse_like(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The reference's dense values `x` in the sparse layout of this side's input `a`."""
    if a.layout is torch.sparse_coo:
        return x.to_sparse(a.sparse_dim())
    if a.layout in (torch.sparse_bsr, torch.sparse_bsc):
        return x.to_sparse(layout=a.layout, blocksize=tuple(a.values().shape[1:3]))
    return x.to_sparse(layout=a.layout)
