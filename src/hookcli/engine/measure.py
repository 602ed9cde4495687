"""One measured pass: the prepared model run once with hookcli's hooks on the selected layers,
every selected call's statistics taken, the model's outputs measured, and which image of a batch
held NaN/Inf. inspect makes one into a Report, a folder run folds one per batch; the statistics
collector of every command is built here (`statistics`), where the backend is decided.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from hookcli.engine.hookbits import holds_compiled, measure
from hookcli.engine.hooks import HookSession, Target
from hookcli.engine.layout import LayoutOf
from hookcli.engine.origins import any_nonfinite, find_origins, number_backward
from hookcli.engine.passes import hooked_pass
from hookcli.engine.prepare import Prepared
from hookcli.engine.probes import Armed, Measured, Probe, armed_probes
from hookcli.engine.selection import ROOT_LABEL, depth_of
from hookcli.engine.sharded import data_parallel_groups
from hookcli.engine.stats import StatsCollector
from hookcli.errors import UsageError
from hookcli.inputs import ModelInput
from hookcli.records import ImageNonfinite, LayerCall, Origin, ParamStats, Report, TensorStats
from hookcli.tree import iter_tensors

RowCounts = tuple[torch.Tensor, torch.Tensor]  # NaN and Inf per image (int64, on the CPU)
# the weight's norm (or the TensorStats finalize() fills it into), the gradient's statistics
PendingParam = tuple[ParamStats, float | TensorStats | None, TensorStats | None]


def statistics(
    backend: str = "auto",
    *,
    repays_kernels: bool = False,
    hist_bins: int = 0,
    hist_edges: dict[Any, tuple[Any, Any]] | None = None,
) -> StatsCollector:
    """The statistics collector of a command: the one place one is built. `backend` is the
    option ("auto", "kernel", "torch"); "auto" loads the numba kernels at once where the run
    repays their loading (`repays_kernels`: a folder's batches, a training run's steps), else
    once a process has measured enough to pay for them. The figures agree either way."""
    if backend == "auto" and repays_kernels:
        backend = "kernel"
    return StatsCollector(backend=backend, hist_bins=hist_bins, hist_edges=hist_edges)


# the heads whose logits are one row a sequence (Hugging Face's class names)
_PER_SEQUENCE = ("ForSequenceClassification", "ForMultipleChoice", "ForNextSentencePrediction")


def rows_only(targets: Sequence[Target], model: nn.Module) -> frozenset[str]:
    """The calls whose 2-D tensors are (rows, features), never a padded batch's (batch,
    tokens) whatever their sizes: a Linear's (it acts on the last dimension: a 2-D input is
    rows of features), a norm's over the last dimension, a pooler's or a classifier head's
    (by Hugging Face's names: BERT's pooler.activation gets the pooled rows); and the model's
    own, where it is a sequence classifier (its logits are a row a sequence)."""
    names = {t.name for t in targets if _on_features(t.module) or _pooled(t.name)}
    if type(model).__name__.endswith(_PER_SEQUENCE):
        names.add(ROOT_LABEL)
    return frozenset(names)


def _pooled(name: str) -> bool:
    return any("pooler" in part or "classifier" in part for part in name.split("."))


def _on_features(module: nn.Module) -> bool:
    if isinstance(module, nn.Linear | nn.LayerNorm | nn.RMSNorm):
        return True
    if isinstance(getattr(module, "in_features", None), int):  # quantized, bitsandbytes, TP
        return isinstance(getattr(module, "out_features", None), int)
    # transformers' GPT-2 Conv1D: a Linear with its weight transposed
    return type(module).__name__ == "Conv1D" and isinstance(getattr(module, "nf", None), int)


@contextlib.contextmanager
def measured_pass(
    prepared: Prepared,
    collector: StatsCollector,
    *,
    model_input: ModelInput | None = None,
    images: int | None = None,
    backward: bool = False,
    train: bool = False,
    probes: Sequence[Probe] = (),
) -> Iterator[Measured]:
    """One hooked pass of `model_input` (default: the prepared one), its padding left out of
    every statistic, with `probes` armed around it (engine/probes.py: the only place they
    are). Inside the `with`, the pass has run: the model's outputs are measured, and every
    probe has read what it reads while gradients live; what a command reads then (parameters,
    predictions) goes there too. After it, the statistics are finalized (a few batched
    transfers per device), `calls` are complete and, for a batch of `images`, the images
    holding NaN/Inf are known (the input counted before the pass: a model may change it; the
    output counted image by image only where its statistics do not already say it holds
    none); the probes' contexts close last (a probe that writes a file discards it if
    anything failed)."""
    model_input = prepared.model_input if model_input is None else model_input
    assert model_input is not None
    collector.set_token_mask(model_input.token_mask)
    if model_input.token_mask is not None:
        collector.rows_only = rows_only(prepared.targets, prepared.loaded.module)
    # a data-parallel model (FSDP2, DDP): each rank's batch merged into the global batch
    collector.book.batch_groups = data_parallel_groups(prepared.loaded.module)
    collector.book.arm_tensor_parallel(prepared.loaded.module)
    armed = Armed(prepared, model_input, collector, backward=backward, train=train)
    with armed_probes(tuple(probes), armed):
        session = HookSession(
            prepared.targets,
            collector,
            grads=backward,
            saver=armed.saver,
            readers=backward,
            memory=armed.memory,
            dense=2 * len(prepared.targets) >= len(prepared.entries)
            and not holds_compiled(e.module for e in prepared.entries),
        )
        rows = (
            None if images is None else nonfinite_rows(model_input.forward_values(), images, "in")
        )
        measured = Measured(session, collector, armed)
        with hooked_pass(
            prepared, session, model_input=model_input, train=train, backward=backward
        ) as result:
            measured.result = result
            collector.context = ("(model)", 0, "out")
            measure(collector, result.output, "out", measured.outputs)
            for probe in probes:
                probe.read(measured)
            yield measured
        measured.calls = finished_calls(session, backward=backward)
        if images is not None:  # (the output's own statistics may already say: none)
            finite = outputs_known_finite(result.output, measured.outputs, images, collector)
            measured.by_image = nonfinite_by_image(
                model_input, result.output, rows, outputs_finite=finite
            )


def finish(measured: Measured, report: Report, probes: Sequence[Probe]) -> Report:
    """The report of a measured pass: each probe's findings folded in, in the list's order."""
    for probe in probes:
        probe.finish(measured, report)
    return report


def finished_calls(session: HookSession, *, backward: bool) -> list[LayerCall]:
    """The calls of a measured pass once it has ended (a command's pass, a watched training
    step, a step's re-run): the statistics finalized, a few batched transfers per device;
    gradients in the order of the tensors they belong to; backward calls numbered."""
    assert session.collector is not None
    session.collector.finalize()
    calls = [p.complete(backward) for p in session.calls]
    number_backward(session.calls)
    if backward and session.collector.book.distributed:
        parts_of_parts(calls)
    return calls


PART = "this rank's part only"  # (engine/sharded.py's notes begin so)


def parts_of_parts(calls: Sequence[LayerCall]) -> None:
    """A gradient of a tensor read as this rank's part (made from a shard, its values
    differing between the ranks) is this rank's part too, whatever its own numbers say: the
    gradient of a sum is all ones on every rank, the same numbers, and no whole."""
    for call in calls:
        for tensors, grads in ((call.outputs, call.grad_outputs), (call.inputs, call.grad_inputs)):
            parts = {t.path for t in tensors if t.note and PART in t.note}
            for g in grads or () if parts else ():
                if g.path in parts and PART not in (g.note or ""):
                    said = f"{PART}: the gradient of this rank's part of the {g.path} tensor"
                    g.note = f"{g.note}; {said}" if g.note else said


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


def origins_of(
    prepared: Prepared, session: HookSession, outputs: Sequence[TensorStats] = ()
) -> list[Origin]:
    """Where NaN/Inf first appeared; a gap between calls named by the module tree."""
    if not any_nonfinite(session.calls, outputs):
        return []
    session.settle_readers()  # whose inputs others read too (a backward origin)
    types = {n: e.type for e in prepared.entries for n in e.names}
    selected = {id(t.module) for t in session.targets}
    partial = any(e.leaf and id(e.module) not in selected for e in prepared.entries)
    return find_origins(session.calls, types, partial=partial, outputs=outputs)


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


def outputs_known_finite(
    output: Any, stats: Sequence[TensorStats], batch: int, collector: StatsCollector
) -> bool:
    """Whether the pass's own statistics of the model's output (finalized) already say that
    no tensor `nonfinite_rows` counts holds a NaN or Inf, so that counting them image by
    image would read each again for nothing (on a language model, the whole logits tensor
    twice more on the device, and a wait for it). Only when every such tensor is a plain one,
    was measured whole (no padding left out: a padded position's NaN is counted per image),
    with its exact counts and no note; a list of per-image items is always counted."""
    if collector.token_mask is not None or isinstance(output, list):
        return False
    if isinstance(output, tuple) and len(output) == 1 and isinstance(output[0], list):
        return False
    by_path = {s.path: s for s in stats}
    for path, t in iter_tensors(output, "out"):
        if not (t.is_floating_point() and t.dim() > 0 and t.shape[0] == batch):
            continue  # (not counted per image either)
        s = by_path.get(path)
        if (
            type(t) is not torch.Tensor
            or s is None
            or s.note is not None
            or s.numel != t.numel()
            or s.nan
            or s.inf
        ):
            return False
    return True


def _finite(t: torch.Tensor) -> bool:
    """Known at once that a CPU tensor holds no NaN/Inf: its sum is finite (one fast read;
    a NaN or Inf anywhere makes the sum NaN or Inf). A sum that overflows only sends the
    tensor to the exact count. Off the CPU, never known without waiting for the device."""
    if not t.is_cpu:
        return False
    acc = torch.float64 if t.dtype is torch.float64 else torch.float32
    return math.isfinite(float(t.detach().sum(dtype=acc)))


def nonfinite_by_image(
    model_input: ModelInput,
    output: Any,
    inputs: RowCounts | None = None,
    *,
    outputs_finite: bool = False,
) -> list[ImageNonfinite]:
    """The images whose input or the model's output hold NaN/Inf, with their counts.
    `inputs`: the input's counts taken before the pass (a model may change its input in
    place); else counted now. `outputs_finite`: known already that the output holds none
    (`outputs_known_finite`): not counted again."""
    batch = images_in(model_input)
    if batch is None:
        return []
    in_nan, in_inf = inputs or nonfinite_rows(model_input.forward_values(), batch, "in")
    if outputs_finite:
        out_nan = out_inf = torch.zeros(batch, dtype=torch.int64)
    else:
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


def claimed_params(targets: Sequence[Target]) -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
    """Each selected module's parameters, by target name in the targets' order. A parameter is
    listed once, under the innermost selected module that holds it: a selected container lists
    only what no selected module inside it (nor a tied module before it) already lists."""
    claimed: set[int] = set()
    by_name: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
    for t in sorted(targets, key=lambda t: -depth_of("" if t.name == ROOT_LABEL else t.name)):
        own = []
        module = t.module
        leaf = not module._modules  # (its own parameters: no generator over the tree)
        for name, p in module._parameters.items() if leaf else module.named_parameters():
            if p is None:
                continue
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
    """Each claimed parameter's norm and its gradient's statistics (`grad_of`: its .grad after
    backward; a folder run's sum over the batches), measured by the collector."""
    every = [(p, name) for own in params.values() for name, p in own]
    grads = [grad_of(p) for p, _ in every]
    named = [
        (g, f"{name}.grad") for (_, name), g in zip(every, grads, strict=True) if g is not None
    ]
    # the small ones measured together: the weights' norms, then the gradients
    now = collector.params_now([p for p, _ in every], named)
    norms: Iterator[float | TensorStats | None]
    if now is not None:
        norms, measured = iter(now[0]), iter(now[1])
    else:
        norms, measured = iter(collector.norms(every)), iter(collector.add_whole(named))
    got = iter(grads)
    return {
        target: [
            (
                ParamStats(name, tuple(p.shape), p.numel(), p.requires_grad, None),
                next(norms),
                next(measured) if next(got) is not None else None,
            )
            for name, p in own
        ]
        for target, own in params.items()
    }


def finish_param(pending: PendingParam) -> ParamStats:
    ps, weight, g = pending
    ps.norm = weight.norm if isinstance(weight, TensorStats) else weight
    if g is not None:
        ps.grad = g
        ps.grad_norm = g.norm
        ps.grad_mean = g.mean
        if g.min is not None and g.max is not None:
            ps.grad_max_abs = max(abs(g.min), abs(g.max))
        if ps.norm and g.norm is not None:
            ps.ratio = g.norm / ps.norm
    return ps
