"""Folders and datasets: thousands of images in batches, statistics aggregated exactly.

A torch DataLoader decodes and preprocesses in `--workers` processes; each batch runs the
engine's hooked pass, its per-tensor statistics are merged into running accumulators
(aggregate.py) and the batch is dropped, so memory stays flat as the number of images grows.
Unreadable images follow the same rule as in one batch (inputs.read_or_skip): found in a
folder, skipped and listed (`--strict`: an error); named on the command line, an error.
Ctrl-C stops after the current batch and reports what was seen, marked as interrupted.
--profile times each batch (and counts its FLOPs) before its statistics are taken, and adds
the batches up (commands/profile.py).

grads over a folder runs backward on each batch from a target that is a sum over the images
(top-1, a class, `sum`, box/mask scores), so the gradients of the whole folder are the sums of
the batches': each call's gradient statistics merge like its activations', and each
parameter's gradient is accumulated (float64) over the batches — and over the ranks, under
torchrun — and measured once at the end. A --loss (a mean over one batch) is refused.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset

from hookcli._version import __version__
from hookcli.commands import outliers, shards
from hookcli.commands import probes as probing
from hookcli.commands.inspect import model_info, predict
from hookcli.commands.profile import ProfileSum
from hookcli.engine.aggregate import Aggregate
from hookcli.engine.experts import find_routers
from hookcli.engine.layout import reader
from hookcli.engine.measure import (
    claimed_params,
    finish_param,
    label_layouts,
    measure_params,
    measured_pass,
    origins_of,
    statistics,
)
from hookcli.engine.prepare import Prepared, prepare
from hookcli.engine.probes import Probe
from hookcli.engine.sharded import mean_over_ranks
from hookcli.engine.tensorbits import accumulate_dtype, dtype_name, finite_or_none
from hookcli.errors import UsageError
from hookcli.inputs import (
    ImageFile,
    ModelInput,
    expand_paths,
    imagenet_preprocess,
    resize_problem,
    short_side_resize,
    skip_or_raise,
    skipped_note,
    try_read,
)
from hookcli.options import DEFAULT_BATCH, Batching, FolderOptions, Invocation, RunOptions
from hookcli.records import (
    Backward,
    ImageNonfinite,
    InputInfo,
    LayerCall,
    Origin,
    ParamStats,
    Prediction,
    Report,
)
from hookcli.sources import Task

if TYPE_CHECKING:
    from hookcli.commands.checks import Rules

Item = tuple[torch.Tensor | None, int, str | None]  # tensor, index, why it is unreadable


def image_files(paths: Sequence[str]) -> list[ImageFile]:
    """Image files named, or found in folders and their subfolders (an ImageFolder tree)."""
    return expand_paths(paths)


class ImageFiles(Dataset[Item]):
    """Decoded, preprocessed images; an unreadable one yields (None, index, why). Workers
    never raise: the main process applies the rule (inputs.skip_or_raise)."""

    def __init__(
        self, files: Sequence[ImageFile], preprocess: Callable[..., Any], task: Task
    ) -> None:
        self.files = list(files)
        self.preprocess = preprocess
        self.task = task  # (a video model's: each image a clip of its own)
        self.short_side = short_side_resize(preprocess)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> Item:
        file = self.files[i]
        image, why = try_read(file)
        if image is None:
            return None, i, why or "unreadable"
        why = resize_problem(image, self.short_side, str(file.path))
        if why is not None:  # a 1x5000 strip: gigabytes after the resize, skipped like unreadable
            return None, i, why
        return self.task.one_image(image, self.preprocess), i, None


def _collate(items: list[Item]) -> tuple[list[torch.Tensor], list[int], list[tuple[int, str]]]:
    ok = [(t, i) for t, i, _ in items if t is not None]
    failed = [(i, why) for t, i, why in items if t is None and why is not None]
    return [t for t, _ in ok], [i for _, i in ok], failed


def is_folder_run(items: Sequence[Any], batching: Batching) -> bool:
    """Batches with aggregated statistics: asked for (--batch-size, --limit, --workers), or
    more images than one batch holds. Only image files and folders are batched."""
    if not items:
        if batching.asked:
            raise UsageError(
                "--batch-size, --limit and --workers batch image files and folders; this run "
                "has none (a tensor spec or the model's own random input).",
                "give a folder or image files, or leave batching out.",
            )
        return False
    if not all(isinstance(x, str) for x in items):  # tensors (the Python API)
        if batching.asked:
            raise UsageError(
                "batch_size, limit and workers batch image files and folders, not tensors.",
                "pass image paths or a folder, or leave batching out.",
            )
        return False
    if batching.asked:
        return True
    return len(image_files(items)) > DEFAULT_BATCH


def folder_options(
    inv: Invocation, batching: Batching, rules: Rules | None = None
) -> FolderOptions | None:
    """The folder run an inspection makes (None: one batch), its one-batch options (and the
    probes its rules need that read one batch) refused."""
    if inv.inputs.has_text:
        return _text_options(inv, batching, rules)
    if not is_folder_run(inv.inputs.items, batching):
        return None
    run = inv.run
    backward = inv.backward
    if backward is not None and backward.loss:
        raise UsageError(
            "--loss is a mean over one batch, so over a folder run it is not the folder's loss "
            "and its gradients do not add up across batches.",
            "use --target (top1, a class, sum: sums over the images) on a folder, or give at "
            f"most {DEFAULT_BATCH} images without --batch-size/--limit/--workers.",
        )
    one = f"give at most {DEFAULT_BATCH} images without --batch-size/--limit/--workers."
    for flag in (
        *_one_batch_probes(run, rules, images=True),
        *(["train"] if run.train else []),
        *(["input-grad"] if backward is not None and backward.input_grad else []),
    ):
        raise UsageError(f"--{flag} works on one batch, not on a folder run.", one)
    _refuse_own(run, rules)
    return batching.folder()


def _one_batch_probes(run: RunOptions, rules: Rules | None, *, images: bool = False) -> list[str]:
    """The flags of the probes the run or its rules ask for that read one batch (commands/
    probes): a run in batches refuses them by flag; `_refuse_own` then refuses, in its own words,
    one whose refusal says more. On a folder of images, one that reads text says so."""
    flags = []
    for probe in probing.one_batch_only(run, rules):
        if images and probe.text_only:
            raise UsageError(
                f"--{probe.flag} reads a text's tokens; this run is a folder of images.",
                f"give text (--text, --text-file) to a language model, or drop --{probe.flag}.",
            )
        if probe.refusal is None:
            flags.append(probe.flag)
    return flags


def _refuse_own(run: RunOptions, rules: Rules | None) -> None:
    """The one-batch probes whose refusal says more than their flag (after every flag's)."""
    for probe in probing.one_batch_only(run, rules):
        if probe.refusal is not None:
            raise UsageError(*probe.refusal)


def _text_options(inv: Invocation, batching: Batching, rules: Rules | None) -> FolderOptions | None:
    """A text run in batches: asked for (--batch-size, --limit), or more texts than one batch
    holds (a long --text-file). What reads one batch is refused, naming the way round."""
    from hookcli.inputs.text import texts_of

    count = len(texts_of(inv.inputs))
    if not batching.asked and count <= DEFAULT_BATCH:
        return None
    run = inv.run
    why = f"{count} texts run in batches of {batching.batch_size or DEFAULT_BATCH}"
    one = f"give at most {DEFAULT_BATCH} texts without --batch-size/--limit"
    if batching.workers:
        raise UsageError(
            "--workers decode images in worker processes; text is tokenized here.",
            "drop --workers.",
        )
    if batching.per_image:
        raise UsageError(f"--per-image lists each image's predictions; {why}.", "drop --per-image.")
    if inv.backward is not None:
        raise UsageError(
            f"grads starts from the next-token loss, a mean over one batch; {why}, and their "
            "gradients would not add up to the whole file's.",
            f"{one} (the gradients of one batch), or inspect/check the statistics of all.",
        )
    for flag, value in (
        *((probe, True) for probe in _one_batch_probes(run, rules)),
        ("train", run.train),
        ("position", run.position is not None),
        ("topk", run.topk),
        ("target-text", inv.inputs.target_text),
    ):
        if value:
            raise UsageError(f"--{flag} works on one batch of text; {why}.", f"{one}.")
    _refuse_own(run, rules)
    return batching.folder()


def folder_report(
    inv: Invocation,
    folder: FolderOptions,
    progress: Callable[[int, int], None] | None = None,
) -> Report:
    if folder.batch_size < 1:
        raise UsageError(
            f"--batch-size must be 1 or more, got {folder.batch_size}.", "e.g. --batch-size 32"
        )
    if folder.limit is not None and folder.limit < 1:
        raise UsageError(f"--limit must be 1 or more, got {folder.limit}.", "e.g. --limit 1000")
    if folder.workers < 0:
        raise UsageError(f"--workers must be 0 or more, got {folder.workers}.", "e.g. --workers 2")
    if inv.inputs.has_text:
        return _text_report(inv, folder, progress)
    paths = [str(p) for p in inv.inputs.items]
    files = image_files(paths)[: folder.limit]
    # torchrun: this rank's share of the batches (--tp: every batch, the model spread)
    group = None if inv.model.tp else shards.join()
    try:
        if group is not None:
            shards.agree(group, settings(inv, folder), [f.name for f in files])
        return _folder_report(inv, folder, files=files, paths=paths, group=group, progress=progress)
    finally:
        shards.leave(group)


CHAT_CHUNK = 1024  # texts rendered through a chat template in one bounded child


def _text_report(
    inv: Invocation, folder: FolderOptions, progress: Callable[[int, int], None] | None
) -> Report:
    """A text run in batches: every text tokenized and padded to the run's longest (so every
    batch has one shape; padding is left out of every statistic), each batch's pass merged
    into the running statistics as a folder's images are."""
    from hookcli.inputs.text import from_text, texts_of, token_lengths
    from hookcli.sources.lm import with_tokenizer

    shown = texts_of(inv.inputs)[: folder.limit]
    # torchrun: this rank's share of the batches (--tp: every batch, the model spread)
    group = None if inv.model.tp else shards.join()
    try:
        if group is not None:
            shards.agree(group, settings(inv, folder), [str(len(shown))])
        prepared = prepare(inv.model, inv.selection, None)
        loaded = prepared.loaded = with_tokenizer(prepared.loaded, inv.model.tokenizer, needed=True)
        texts = shown
        if inv.inputs.chat:
            from hookcli.inputs.chat import render_chat

            # each chunk under the bounds one render has (a 600,000-line file is not one
            # prompt), the whole under a cap that scales with the file
            texts, budget = [], 8 * sum(map(len, shown)) + (16 << 20)
            for start in range(0, len(shown), CHAT_CHUNK):
                chunk = render_chat(loaded.tokenizer, shown[start : start + CHAT_CHUNK])
                texts += chunk
                budget -= sum(map(len, chunk))  # (this chunk's only: a short last one too)
                if budget < 0:
                    raise UsageError(
                        "--chat: the chat template renders the text file to more than 8 times "
                        "its size.",
                        "drop --chat and give the text as the model should see it.",
                    )
        longest = max(token_lengths(loaded, texts, inv.inputs.chat))
        limit = loaded.max_tokens
        if limit is not None and longest > limit:  # every batch is padded to the longest
            raise UsageError(
                f"a sequence of {longest} tokens is longer than {loaded.spec} takes ({limit}, "
                "its config's maximum positions).",
                f"shorten the longest lines to at most {limit} tokens.",
            )
        batch = folder.batch_size
        total = -(-len(texts) // batch)
        mine = group.batches(total) if group is not None else list(range(total))
        run = _FolderRun(prepared, inv.run)
        part = shards.Part(group.rank if group else 0, run.agg, run.model_out, run.counts, {})
        edges_shared = group is None or not run.hist
        started = time.monotonic()
        try:
            for k in mine:
                if not edges_shared and group is not None and group.rank != 0:
                    shards.share_edges(group, run.edges, prepared.device)  # rank 0's batch 0
                    edges_shared = True
                rows = range(k * batch, min((k + 1) * batch, len(texts)))
                model_input = from_text(
                    loaded,
                    inv.inputs,
                    texts=texts[rows.start : rows.stop],
                    shown=shown[rows.start : rows.stop],
                    pad_to=longest,
                ).to(prepared.device)
                run.run_batch(model_input, [f"text {i}" for i in rows], k)
                part.seen[k] = len(rows)
                if not edges_shared and group is not None and group.rank == 0:
                    shards.share_edges(group, run.edges, prepared.device)
                    edges_shared = True
                if progress is not None:
                    progress(run.seen, len(texts) if group is None else len(mine) * batch)
        except KeyboardInterrupt:
            part.interrupted = True
        if not edges_shared and group is not None:  # a rank with no batch still takes part
            shards.share_edges(group, run.edges, prepared.device)
        where = {None: "--text", "-": "standard input"}.get(
            inv.inputs.text_file, str(inv.inputs.text_file)
        )
        label = f"tokenizer {loaded.tokenizer_label}, padded to {longest} tokens" + (
            ", each text a user turn of its chat template" if inv.inputs.chat else ""
        )
        unit = Unit("texts", len(shown), where)
        return _merged_report(
            inv, folder, run, part, group, started=started, unit=unit, preprocessing=label
        )
    finally:
        shards.leave(group)


def settings(inv: Invocation, folder: FolderOptions | None = None) -> dict[str, Any]:
    """What every torchrun rank must have been started with alike (shards.agree)."""
    model = inv.model.model
    return {
        "command": "grads" if inv.backward is not None else "inspect",
        "model": dataclasses.replace(
            inv.model, model=model if isinstance(model, str) else type(model).__name__
        ),
        "selection": inv.selection,
        "run": inv.run,
        "backward": inv.backward,
        "folder": folder,
        "inputs": dataclasses.replace(inv.inputs, items=()),
    }


def _folder_report(
    inv: Invocation,
    folder: FolderOptions,
    *,
    files: list[ImageFile],
    paths: list[str],
    group: shards.Group | None,
    progress: Callable[[int, int], None] | None,
) -> Report:
    prepared = prepare(inv.model, inv.selection, None, backward=inv.backward)
    loaded = prepared.loaded
    preprocess = loaded.preprocess or imagenet_preprocess(loaded.input_size or (224, 224))
    if loaded.kind.pairs:
        raise UsageError(
            f"{loaded.spec} takes two images (frame 1, frame 2), not a folder's images one by "
            "one in batches.",
            "give exactly two image files.",
        )
    batch = folder.batch_size
    total = -(-len(files) // batch)
    mine = group.batches(total) if group is not None else list(range(total))
    index = [i for k in mine for i in range(k * batch, min((k + 1) * batch, len(files)))]
    loader = DataLoader(
        ImageFiles([files[i] for i in index], preprocess, loaded.kind),
        batch_size=batch,
        num_workers=folder.workers,
        collate_fn=_collate,
        shuffle=False,
    )
    run = _FolderRun(prepared, inv.run)
    part = shards.Part(group.rank if group else 0, run.agg, run.model_out, run.counts, {})
    skipped: list[tuple[str, str]] = []
    prediction_note: str | None = None
    edges_shared = group is None or not run.hist
    started = time.monotonic()
    try:
        for j, (tensors, local, failed) in enumerate(loader):
            k = mine[j]
            if not edges_shared and group is not None and group.rank != 0:
                shards.share_edges(group, run.edges, prepared.device)  # batch 0's, from rank 0
                edges_shared = True
            for i, why in failed:
                skip_or_raise(files[index[i]], why, inv.inputs.strict, skipped)
                part.skipped.append((index[i], *skipped[-1]))
            if tensors:
                chosen = [files[index[i]] for i in local]
                output = run.batch(tensors, chosen, k)
                if folder.per_image:
                    model_input = ModelInput(
                        (), "", [f.name for f in chosen], classes=[f.folder_class for f in chosen]
                    )
                    preds, prediction_note = predict(output, loaded, folder.per_image, model_input)
                    part.predictions += [(k, pr.image, pr) for pr in preds or []]
            part.seen[k] = len(tensors)  # after its pass: an interrupted batch is not counted
            if not edges_shared and group is not None and group.rank == 0:
                shards.share_edges(group, run.edges, prepared.device)
                edges_shared = True
            if progress is not None:
                progress(run.seen + len(skipped), len(index))
    except KeyboardInterrupt:
        part.interrupted = True
    if not edges_shared and group is not None:  # a rank with no batch still takes part
        shards.share_edges(group, run.edges, prepared.device)
    return _merged_report(
        inv,
        folder,
        run,
        part,
        group,
        started=started,
        unit=Unit("images", len(files), ", ".join(paths[:2]) + ("…" if len(paths) > 2 else "")),
        preprocessing=loaded.preprocess_label,
        prediction_note=prediction_note,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Unit:
    """What a batched run reads: `images` or `texts`, how many, and from where."""

    name: str
    count: int
    where: str


def _merged_report(
    inv: Invocation,
    folder: FolderOptions,
    run: _FolderRun,
    part: shards.Part,
    group: shards.Group | None,
    *,
    started: float,
    unit: Unit,
    preprocessing: str,
    prediction_note: str | None = None,
) -> Report:
    """Every rank's part merged (one part without torchrun) into the run's report."""
    prepared = run.prepared
    loaded = prepared.loaded
    part.nonfinite, part.origins = run.nonfinite_images, run.origins_at
    part.notes, part.unhooked, part.timing, part.shape = (
        run.notes,
        run.unhooked,
        run.timing,
        run.shape,
    )
    part.value, part.orders = run.value, run.orders
    elapsed = time.monotonic() - started
    parts = shards.gather(part, group, elapsed) if group is not None else [part]
    run.absorb(parts)
    skipped = [(name, why) for _, name, why in sorted(x for p in parts for x in p.skipped)]
    interrupted = any(p.interrupted for p in parts)
    offsets = _offsets(parts)
    predictions: list[Prediction] = []
    for k, pos, pr in sorted(
        (x for p in parts for x in p.predictions), key=lambda x: (x[0], x[1], x[2].rank)
    ):
        pr.image = offsets[k] + pos
        predictions.append(pr)
    images: list[ImageNonfinite] = []
    for k, b in sorted((x for p in parts for x in p.nonfinite), key=lambda x: (x[0], x[1].image)):
        b.image += offsets[k]
        images.append(b)
    earliest = min((p.origins for p in parts if p.origins), key=lambda o: o[0], default=None)
    if earliest is not None:
        k, n, run.origins = earliest
        run.origins_batch = (k, offsets[k], offsets[k] + n - 1)
    notes = [
        f"statistics are over all {unit.name}"
        + (
            ""
            if folder.per_image or unit.name != "images"
            else "; add --per-image K for each image's top-K predictions"
        )
    ]
    if run.backward:
        notes.append(
            "gradients of the whole folder: backward from each batch's sum over its images, "
            "each parameter's gradient summed over the batches"
        )
    if group is not None:
        notes.append(shards.spread_note(group, [(p.rank, sum(p.seen.values())) for p in parts]))
    notes += prepared.notes + run.notes  # modules hooks cannot see; how the passes ran
    if find_routers(prepared.loaded.module, [e.type for e in prepared.entries]):
        notes.append(  # (never dropped without a word: a one-batch run always reports it)
            f"expert routing is read on one batch: this run in {run.batches} batches reports "
            f"none (give at most {DEFAULT_BATCH} {unit.name}, without --batch-size/--limit)"
        )
    if run.unhooked:
        refused = ", ".join(f"{name} ({why})" for name, why in list(run.unhooked.items())[:5])
        notes.append(f"not hookable, so not measured: {refused}")
    if skipped:
        notes.append(skipped_note(skipped))
    if run.origins_batch is not None:
        k, first, last = run.origins_batch
        notes.append(
            f"NaN/Inf first appeared in batch {k} ({unit.name} {first}–{last}); the origin "
            "is where they appeared in that batch"
        )
    if interrupted:
        notes.append(
            f"interrupted after {run.seen} of {unit.count} {unit.name}: partial statistics"
        )
    if run.seen == 0 and not interrupted:
        raise UsageError(f"none of the {unit.count} {unit.name} could be read.", "check the files.")
    layers = run.layer_calls(run.param_stats(group) if run.backward else {})
    shape = run.shape or ()
    size = (shape[-2], shape[-1]) if len(shape) == 3 else None
    label_layouts(layers, reader(loaded.module, size))
    report = Report(
        model=model_info(loaded, inv.run.train, prepared.seed),
        input=InputInfo(
            f"{run.seen} {unit.name} from {unit.where} in {run.batches} batches of up to "
            f"{folder.batch_size}"
            + (f" over {group.world} processes" if group is not None else ""),
            [(run.seen, *run.shape)] if run.shape else [],
            [],
            preprocessing,
        ),
        device=str(prepared.device),
        layers=layers,
        never_called=[
            t.name
            for t, n in zip(prepared.targets, run.counts, strict=True)
            if n == 0 and t.name not in run.unhooked
        ],
        outputs=run.model_out.tensors("(model)", 0, "outputs"),
        nonfinite_origins=run.origins,
        nonfinite_images=images,
        predictions=predictions if folder.per_image else None,
        prediction_note=prediction_note,
        notes=notes,
        profile=run.timing.profile,
        outliers=outliers.summary(layers) if inv.run.channels else None,
        backward=(
            Backward(prepared.backward.describe(), finite_or_none(run.value) if run.seen else None)
            if prepared.backward
            else None
        ),
        config=inv.run.config,
        hookcli_version=__version__,
    )
    report.interrupted = interrupted
    return report


def _offsets(parts: Sequence[shards.Part]) -> dict[int, int]:
    """Each global batch's first image's place in the run: the images read before it."""
    seen = sorted((k, n) for p in parts for k, n in p.seen.items())
    offsets, total = {}, 0
    for k, n in seen:
        offsets[k] = total
        total += n
    return offsets


def _nonfinite(call: LayerCall) -> bool:
    grads = (*(call.grad_inputs or ()), *(call.grad_outputs or ()))
    return any(t.nonfinite for t in (*call.inputs, *call.outputs, *grads))


class _FolderRun:
    """The running aggregate of a folder run: one hooked pass per batch, merged and dropped."""

    def __init__(self, prepared: Prepared, run: RunOptions) -> None:
        self.prepared = prepared
        self.run = run
        self.train = run.train
        self.hist = run.hist
        self.timing = ProfileSum()  # --profile: each batch's times and FLOPs, added up
        # what a run in batches measures beside the statistics: probes that merge
        self.probes: list[Probe] = []
        if run.channels:
            self.probes.append(probing.Channels(per_expert=False))
        if run.profile:
            self.probes.append(probing.Profiled(into=self.timing))
        self.agg = Aggregate()
        self.model_out = Aggregate()
        self.counts = [0] * len(prepared.targets)
        self.seen = 0
        self.batches = 0
        self.shape: tuple[int, ...] | None = None
        self.edges: dict[Any, tuple[Any, Any]] = {}  # histogram edges, fixed by batch one
        self.notes: list[str] = []  # each distinct note of the passes, once
        self.nonfinite_images: list[tuple[int, ImageNonfinite]] = []  # global batch, image
        self.origins: list[Origin] = []  # in the first batch that showed NaN/Inf
        self.origins_batch: tuple[int, int, int] | None = None  # its index, first/last image
        self.origins_at: tuple[int, int, list[Origin]] | None = None  # global batch, size, origins
        self.unhooked: dict[str, str] = {}  # targets that refused hooks, and why
        # grads: each call's (forward, backward) order, the backward scalars' sum, and each
        # selected parameter's gradient summed over the batches (float64), by target
        self.backward = prepared.backward is not None
        self.orders: dict[tuple[str, int], tuple[int | None, int | None]] = {}
        self.value = 0.0
        self.params = claimed_params(prepared.targets) if self.backward else {}
        self.grads: dict[int, torch.Tensor] = {}  # id(parameter) → its summed gradient

    def batch(self, tensors: list[torch.Tensor], files: list[ImageFile], k: int) -> Any:
        """Global batch k of images: its pass (see `run_batch`)."""
        loaded = self.prepared.loaded
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) > 1 and loaded.kind.stacks:
            raise UsageError(
                f"images of different sizes after preprocessing in one batch ({files[0].name}: "
                f"{'x'.join(map(str, tensors[0].shape))}, …).",
                "use a model whose preprocessing crops to one size, or --batch-size 1.",
            )
        args: tuple[Any, ...] = (torch.stack(tensors),) if loaded.kind.stacks else (list(tensors),)
        model_input = ModelInput(args, "batch").to(self.prepared.device)
        return self.run_batch(model_input, [f.name for f in files], k)

    def run_batch(self, model_input: ModelInput, names: list[str], k: int) -> Any:
        """Global batch k: its pass, merged into the running statistics (a padded batch of
        text: its real tokens only); its inputs' NaN/Inf rows and origins kept by (k, place
        in the batch), placed when the run ends."""
        prepared = self.prepared
        rows = len(names)
        self.shape = self.shape or tuple(model_input.shapes()[0])[1:]
        collector = statistics(  # a folder repays loading the kernels at once
            self.run.stats_backend,
            repays_kernels=True,
            hist_bins=self.hist,
            hist_edges=self.edges,
        )
        backward = self.backward
        with measured_pass(
            prepared,
            collector,
            model_input=model_input,
            images=rows,
            backward=backward,
            train=self.train,
            probes=self.probes,
        ) as measured:
            result = measured.result
            assert result is not None
            if backward:  # while the gradients are readable
                self._add_grads()
                if result.scalar is not None:  # (data parallel: the ranks' mean, as grads')
                    self.value += mean_over_ranks(
                        result.scalar, measured.collector.book.batch_groups
                    )
        session, calls = measured.session, measured.calls
        out_stats, by_image = measured.outputs, measured.by_image
        for b in by_image:  # which image: its file, its place in the batch
            b.source = names[b.image]
        self.nonfinite_images += [(k, b) for b in by_image]
        if not self.origins and (by_image or any(_nonfinite(c) for c in calls)):
            # the first batch that shows NaN/Inf: where they first appeared in it
            self.origins = origins_of(prepared, session, out_stats)
            if self.origins:
                self.origins_at = (k, rows, self.origins)
        self.unhooked.update(session.unhooked)
        for note in result.notes:
            if note not in self.notes:
                self.notes.append(note)
        for call in calls:
            self.agg.add(call.name, call.type, call.call, "inputs", call.inputs)
            self.agg.add(call.name, call.type, call.call, "outputs", call.outputs)
            for kind in ("grad_inputs", "grad_outputs"):
                grads = getattr(call, kind)
                if grads:
                    self.agg.add(call.name, call.type, call.call, kind, grads)
            order = (call.forward_order, call.backward_order)
            self.orders.setdefault((call.name, call.call), order)
        self.model_out.add("(model)", "output", 0, "outputs", [s for s in out_stats if s.dtype])
        for i, n in enumerate(session.counts):
            self.counts[i] += n
        self.seen += rows
        self.batches += 1
        return result.output

    def _add_grads(self) -> None:
        """This batch's parameter gradients added to the run's, on the parameter's device, in
        float64 (float32 on MPS): the sum does not depend on how the batches were cut, or
        spread over ranks, beyond float64 rounding. Costs one float64 copy of the selected
        parameters (select fewer layers with -l for a model near the device's memory)."""
        for params in self.params.values():
            for _, p in params:
                if p.grad is None:
                    continue
                have = self.grads.get(id(p))
                if have is None:  # a copy, always (a float64 gradient must not be aliased)
                    acc = accumulate_dtype(p.grad.device)
                    self.grads[id(p)] = p.grad.detach().to(acc, copy=True)
                else:
                    have += p.grad.detach()

    def param_stats(self, group: shards.Group | None) -> dict[str, list[ParamStats]]:
        """Each target's parameters with the statistics of their summed gradient (summed over
        the ranks too: every rank takes part, in the same order)."""
        params = [p for ps in self.params.values() for _, p in ps]
        summed: list[torch.Tensor | None] = [self.grads.get(id(p)) for p in params]
        if group is not None:
            summed = shards.sum_tensors(group, summed, params)
        by_id = {id(p): g for p, g in zip(params, summed, strict=True)}
        collector = statistics(self.run.stats_backend, hist_bins=self.hist)
        pending = measure_params(self.params, collector, lambda p: by_id[id(p)])
        collector.finalize()
        for target, rows in pending.items():
            for (_, p), (_, _, grad) in zip(self.params[target], rows, strict=True):
                if grad is not None:  # summed in float64; the gradient's own dtype is the weight's
                    grad.dtype = dtype_name(p.dtype)
        return {target: [finish_param(row) for row in rows] for target, rows in pending.items()}

    def absorb(self, parts: Sequence[shards.Part]) -> None:
        """Every rank's part merged into this run (one part: this run's own, as it is)."""
        self.seen = sum(n for p in parts for n in p.seen.values())
        if len(parts) == 1:
            return
        agg, out = Aggregate(), Aggregate()
        for p in parts:
            agg.absorb(p.agg)
            out.absorb(p.model_out)
        self.agg, self.model_out = agg, out
        self.batches = sum(len(p.seen) for p in parts)
        self.counts = [sum(c) for c in zip(*(p.counts for p in parts), strict=True)]
        self.notes = list(dict.fromkeys(n for p in parts for n in p.notes))
        self.unhooked = {k: v for p in parts for k, v in p.unhooked.items()}
        self.value = sum(p.value for p in parts)
        self.orders = {}
        for p in parts:
            for key, order in p.orders.items():
                self.orders.setdefault(key, order)
        self.shape = next((p.shape for p in parts if p.shape), None)
        timing = ProfileSum()
        for p in parts:
            if p.timing is not None and p.timing.profile is not None:
                timing.add(p.timing.profile, p.timing.by_call)
        self.timing = timing

    def layer_calls(self, params: dict[str, list[ParamStats]]) -> list[LayerCall]:
        """The merged calls; a target's parameters on its first call (as in one batch)."""
        aliases = {t.name: t.aliases for t in self.prepared.targets}
        timed = self.timing.calls() if self.timing.profile is not None else {}
        calls = []
        for name, call in self.agg.order:
            forward, backward = self.orders.get((name, call), (None, None))
            calls.append(
                LayerCall(
                    name,
                    self.agg.types[name],
                    call,
                    aliases[name],
                    self.agg.tensors(name, call, "inputs"),
                    self.agg.tensors(name, call, "outputs"),
                    grad_inputs=self.agg.tensors(name, call, "grad_inputs") or None,
                    grad_outputs=self.agg.tensors(name, call, "grad_outputs") or None,
                    params=params.pop(name, None),
                    forward_order=forward,
                    backward_order=backward,
                    profile=timed.get((name, call)),
                )
            )
        return calls
