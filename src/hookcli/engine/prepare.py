"""Preparation, once per run: the model loaded (its tokenizer with it when text is given), the
modules to hook selected, the input built — the same way for inspect, grads, check, layers
--shapes, maps, cam, attn, lens, calib and folder runs — and what backward starts from. Every
usage error of a run is raised here, before any pass (engine/passes.py runs the passes)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hookcli.engine.hooks import Target
from hookcli.engine.selection import (
    ModuleEntry,
    module_entries,
    select,
    target_of,
    unhookable_note,
)
from hookcli.engine.targets import TargetSpec, parse_target
from hookcli.errors import UsageError
from hookcli.inputs import ModelInput, default_input, from_images, from_specs, padding_mask
from hookcli.options import BackwardOptions, InputOptions, ModelOptions, Selection
from hookcli.runtime import beacon, isa, ranks
from hookcli.sources import LoadedModel, load_model, resolve_device


@dataclass(slots=True)
class Prepared:
    """A loaded model on its device, the modules to hook, the input, and what backward
    starts from (None: forward only)."""

    loaded: LoadedModel
    device: torch.device
    seed: int
    entries: list[ModuleEntry]
    targets: list[Target]
    model_input: ModelInput | None
    backward: TargetSpec | None = None
    input_leaves: tuple[tuple[str, torch.Tensor], ...] = ()  # --input-grad: the input copies
    notes: list[str] = field(default_factory=list)  # for the report: modules hooks cannot see


def prepare(
    model: ModelOptions,
    selection: Selection | None = None,
    inputs: InputOptions | None = None,
    *,
    backward: BackwardOptions | None = None,
    position: int | None = None,
) -> Prepared:
    """Model, modules and input for a run; every usage error is raised here, before any pass.
    No selection: nothing hooked (timing, pictures pick their own). No inputs: none built
    (folder runs bring their batches)."""
    isa.ensure()  # before oneDNN first runs: a CPU whose AMX kernels die gets a limit
    if model.offload and backward is not None:
        raise UsageError(
            "--offload keeps one block's weights in memory at a time; a backward needs them "
            "all again (autograd saves them).",
            "drop --offload for gradients, or check without --backward and gradient rules.",
        )
    device = torch.device("meta") if model.meta else resolve_device(model.device)
    # a module given through the API is named by its class: its repr can be huge, or endless
    label = model.model if isinstance(model.model, str) else type(model.model).__name__
    with beacon.phase(f"building {label}"):
        loaded = load_model(
            model.model,
            weights=model.weights,
            seed=model.seed,
            model_args=model.model_args,
            head=model.head,
            building=model.building,
            tokenizer=model.tokenizer,
            text=inputs is not None and inputs.has_text,
        )
    if model.output_key:  # a copy: a LoadedModel passed in is left as it was
        loaded = dataclasses.replace(loaded, kind=loaded.kind.keyed(model.output_key))
    # the task may constrain the device (quantized: CPU only, no backward)
    device = loaded.kind.device(loaded.spec, model.device, device, backward is not None)
    if model.offload:
        from hookcli.sources.offload import place

        place(loaded.module, device)
    if position is not None:  # --position: which real token a language model predicts after
        at = getattr(loaded.kind, "at_position", None)
        if at is None:
            raise UsageError(
                f"--position picks a language model's token; {loaded.spec} is {loaded.task}.",
                "drop --position.",
            )
        loaded = dataclasses.replace(loaded, kind=at(position))
    spec = None
    if backward is not None:
        default = loaded.kind.default_target
        if inputs is not None and inputs.target_text:  # a seq2seq target: its teacher-forced loss
            default = "next-token"
        target = backward.target or (None if backward.loss else default)
        spec = parse_target(target, backward.loss, loaded.categories)
        spec.item = loaded.kind.item
    entries = module_entries(loaded.module)
    targets: list[Target] = []
    if selection is not None and selection.every:
        targets = every_target(entries)
    elif selection is not None:
        targets = select(
            entries,
            layers=selection.layers,
            types=selection.types,
            depth=selection.depth,
            model_label=loaded.spec,
            always=selection.always,
        )
    model_input = None
    leaves: tuple[tuple[str, torch.Tensor], ...] = ()
    if inputs is not None:
        built = build_input(loaded, inputs, model.seed)  # (read before a move to meta)
        loaded = dataclasses.replace(loaded, kind=loaded.kind.for_input(built))
        mask = built.kwargs.get("attention_mask")
        if model.meta and isinstance(mask, torch.Tensor) and bool(mask.all()):
            # a mask of ones changes nothing, and transformers reads its values to skip it
            del built.kwargs["attention_mask"]
        model_input = built.to(device)
        if spec is not None and spec.kind == "lm":
            if model_input.labels is not None:  # --target-text: aligned with the logits
                spec.labels, spec.aligned = model_input.labels, True
            elif getattr(loaded.kind, "ids_key", "input_ids") == "decoder_input_ids":
                raise UsageError(
                    f"--target next-token of {loaded.spec} (a seq2seq model) needs its target "
                    "text: the decoder's tokens are not the input's.",
                    "give --target-text TEXT (one per --text), or --target top1.",
                )
            else:
                spec.labels = next_token_labels(model_input)
        if backward is not None and backward.input_grad:
            model_input, leaves = _with_input_grad(model_input)
    note = unhookable_note(entries)
    stray = ranks.stray_note()
    return Prepared(
        loaded,
        device,
        model.seed,
        entries,
        targets,
        model_input,
        spec,
        leaves,
        [*loaded.notes, *(n for n in (note, stray) if n)],
    )


def every_target(entries: Sequence[ModuleEntry]) -> list[Target]:
    """Every module Python hooks can see, the model itself included (as `(model)`)."""
    return [target_of(e) for e in entries if e.unhookable is None]


def next_token_labels(model_input: ModelInput) -> torch.Tensor:
    """The ids each position of a text predicts: input_ids, -100 where padding is."""
    from hookcli.engine.targets import IGNORE

    ids = model_input.token_ids()
    if ids is None:
        raise UsageError(
            "--target next-token needs the text's input_ids (batch x tokens).",
            "give --text, or --input input_ids=SPEC (from Python: a tensor of ids); or use "
            "--target top1.",
        )
    mask = model_input.kwargs.get("attention_mask")
    labels = ids.detach().clone()
    if isinstance(mask, torch.Tensor) and tuple(mask.shape) == tuple(ids.shape):
        labels[mask == 0] = IGNORE
        # a sequence's first real token has nothing before it to be predicted from (with
        # padding on the left, the position before it is padding)
        labels[:, 1:][mask[:, :-1] == 0] = IGNORE
    return labels


def build_input(loaded: LoadedModel, inputs: InputOptions, seed: int) -> ModelInput:
    """Images, tensors (Python API), tensor specs, text (a language model), or a random input
    of the right shape."""
    items = inputs.items
    if inputs.has_text:
        if items or inputs.specs:
            raise UsageError(
                "give text or images/--input tensors, not both.", "use one kind of input per run."
            )
        from hookcli.inputs.text import from_text

        return from_text(loaded, inputs)
    text_only = (
        ("--chat", inputs.chat),
        ("--target-text", inputs.target_text),
        ("--padding-side", inputs.padding_side),
    )
    for option, given_too in text_only:
        if given_too:  # (never silently ignored: it shapes what a text input becomes)
            raise UsageError(
                f"{option} applies to text input, and this run has none.",
                "give --text 'your text' (or --text-file FILE), or drop " + option + ".",
            )
    given = _given_tensors(loaded, inputs)
    if given is not None:
        return given
    if items and inputs.specs:
        raise UsageError(
            "give image files or --input tensor specs, not both.", "use one kind of input per run."
        )
    if items and not loaded.kind.takes_images:
        raise UsageError(
            f"{loaded.spec} takes token ids, not images.",
            "give --input randint:LOW:HIGH:1x16 (ids below its vocabulary size) or "
            "--input input_ids=SPEC.",
        )
    if items:
        return from_images([str(x) for x in items], loaded, strict=inputs.strict)
    if inputs.specs:
        return from_specs(inputs.specs, seed, loaded)
    return default_input(loaded, seed)


def _given_tensors(loaded: LoadedModel, inputs: InputOptions) -> ModelInput | None:
    """The Python API's tensors, or its mapping of keyword tensors; None for other inputs."""
    items = inputs.items
    if len(items) == 1 and isinstance(items[0], Mapping):
        if inputs.specs:
            raise UsageError("give keyword tensors or --input specs, not both.", "use one kind.")
        return _keyword_input(loaded, items[0])
    if not items or not all(isinstance(x, torch.Tensor) for x in items):
        return None
    if inputs.specs:
        raise UsageError("give tensors or --input specs, not both.", "use one kind of input.")
    if len(items) == 1:
        t = items[0]
        shown = f"tensor {'x'.join(map(str, t.shape))}"
        if not loaded.kind.takes_images:  # a text model's ids: its input_ids, as --input's
            args, kwargs, note = loaded.kind.spec_inputs([t], {})
            made = kwargs.get("input_ids")
            if made is t:  # (read as its token ids)
                from hookcli.inputs.tokenids import check_token_ids

                check_token_ids(loaded, made, shown)
            return ModelInput(args, shown + note, kwargs=kwargs)
        return ModelInput((t,), shown)
    return ModelInput(tuple(items), "tensors")


def _keyword_input(loaded: LoadedModel, given: Mapping[Any, Any]) -> ModelInput:
    """The Python API's mapping of keyword tensors (a tokenizer's output: input_ids,
    attention_mask, …) as the forward's keyword arguments; a padded batch's mask keeps its
    padding out of every statistic, as text given to hookcli does."""
    named: dict[str, torch.Tensor] = {}
    for key, value in given.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise TypeError(f"keyword inputs are named by argument names, not {key!r}")
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"keyword input {key!r} is a {type(value).__name__}, not a tensor (a "
                "tokenizer's output needs return_tensors='pt')"
            )
        named[key] = value
    if not named:
        raise TypeError("the mapping of keyword inputs is empty")
    labels = named.get("labels")
    shift = getattr(loaded.module, "prepare_decoder_input_ids_from_labels", None)
    if isinstance(labels, torch.Tensor) and "decoder_input_ids" not in named and callable(shift):
        # a seq2seq tokenizer's text_target: the decoder reads its labels shifted right, as
        # the model does itself when given labels alone
        named["decoder_input_ids"] = shift(labels=labels)
    args, kwargs, note = loaded.kind.spec_inputs([], named)
    shown = ", ".join(f"{k} {'x'.join(map(str, v.shape))}" for k, v in named.items())
    if not loaded.kind.takes_images and isinstance(ids := kwargs.get("input_ids"), torch.Tensor):
        from hookcli.inputs.tokenids import check_token_ids

        check_token_ids(loaded, ids, f"input_ids {'x'.join(map(str, ids.shape))}")
    return ModelInput(
        args, f"keyword tensors {shown}" + note, kwargs=kwargs, token_mask=padding_mask(named)
    )


def _with_input_grad(
    model_input: ModelInput,
) -> tuple[ModelInput, tuple[tuple[str, torch.Tensor], ...]]:
    """Copies of the floating-point inputs that require grad (the user's stay untouched)."""
    leaves: list[tuple[str, torch.Tensor]] = []

    def leaf(t: torch.Tensor, path: str) -> torch.Tensor:  # paths as hooks name inputs: in[0]
        if not t.is_floating_point():
            return t
        copy = t.detach().clone().requires_grad_(True)
        leaves.append((path, copy))
        return copy

    return model_input.map(lambda path, t: leaf(t, path)), tuple(leaves)


def one_target(prepared: Prepared, pattern: str) -> Target:
    """Exactly one module for a picture's -l."""
    targets = select(prepared.entries, layers=[pattern], model_label=prepared.loaded.spec)
    if len(targets) > 1:
        shown = ", ".join(t.name for t in targets[:5])
        raise UsageError(
            f"-l {pattern!r} matches {len(targets)} layers ({shown}…); pictures are of one layer.",
            "name one layer exactly.",
        )
    return targets[0]
