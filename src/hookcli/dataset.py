"""Folders and datasets: thousands of images in batches, statistics aggregated exactly.

A torch DataLoader decodes and preprocesses in `--workers` processes; each batch runs the hooked
forward, its per-tensor statistics are merged into running accumulators (aggregate.py) and the
batch is dropped, so memory stays flat as the number of images grows. Unreadable images are
skipped and listed (`--strict` makes the first one an error). Ctrl-C stops after the current
batch and reports what was seen, marked as interrupted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from hookcli import __version__
from hookcli.aggregate import Aggregate
from hookcli.errors import UsageError
from hookcli.hooks import HookSession, measure
from hookcli.inputs import ModelInput, _imagenet_preprocess, expand_paths, read_image
from hookcli.loading import LoadedModel, load_model, resolve_device
from hookcli.records import InputInfo, LayerCall, Prediction, Report, TensorStats
from hookcli.run import _complete, _model_info, model_left_as_found, predict, run_forward
from hookcli.selection import module_entries, select
from hookcli.stats import StatsCollector, fill

DEFAULT_BATCH = 32


def image_files(paths: Sequence[str]) -> list[Path]:
    """Image files named, or found in folders and their subfolders (an ImageFolder tree)."""
    return expand_paths(paths, recursive=True)


class ImageFiles(Dataset[tuple[torch.Tensor | None, str, str | None]]):
    """Decoded, preprocessed images; an unreadable one yields (None, path, reason)."""

    def __init__(self, files: Sequence[Path], preprocess: Callable[[Any], torch.Tensor]) -> None:
        self.files = list(files)
        self.preprocess = preprocess

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor | None, str, str | None]:
        path = self.files[i]
        try:
            return self.preprocess(read_image(path)), str(path), None
        except UsageError as exc:
            return None, str(path), exc.message


def _collate(
    items: list[tuple[torch.Tensor | None, str, str | None]],
) -> tuple[list[torch.Tensor], list[str], list[tuple[str, str]]]:
    ok = [(t, p) for t, p, _ in items if t is not None]
    failed = [(p, e or "unreadable") for t, p, e in items if t is None]
    return [t for t, _ in ok], [p for _, p in ok], failed


def inspect_folder(
    model: str | nn.Module,
    paths: Sequence[str],
    *,
    batch_size: int = DEFAULT_BATCH,
    limit: int | None = None,
    workers: int = 0,
    strict: bool = False,
    layers: Sequence[str] = (),
    types: Sequence[str] = (),
    depth: int | None = None,
    weights: str = "none",
    seed: int = 0,
    device: str = "auto",
    model_args: Mapping[str, Any] | None = None,
    train: bool = False,
    per_image: int = 0,
    hist: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> Report:
    """Statistics of every selected layer over every image, aggregated across batches;
    with per_image=K, also each image's top-K predictions (kept as numbers, per image)."""
    if batch_size < 1:
        raise UsageError(
            f"--batch-size must be 1 or more, got {batch_size}.", "e.g. --batch-size 32"
        )
    if limit is not None and limit < 1:
        raise UsageError(f"--limit must be 1 or more, got {limit}.", "e.g. --limit 1000")
    if workers < 0:
        raise UsageError(f"--workers must be 0 or more, got {workers}.", "e.g. --workers 2")
    dev = resolve_device(device)
    loaded = load_model(model, weights=weights, seed=seed, model_args=model_args)
    targets = select(
        module_entries(loaded.module),
        layers=layers,
        types=types,
        depth=depth,
        model_label=loaded.spec,
    )
    files = image_files(paths)[:limit]
    preprocess = loaded.preprocess or _imagenet_preprocess(loaded.input_size or (224, 224))
    loader = DataLoader(
        ImageFiles(files, preprocess),
        batch_size=batch_size,
        num_workers=workers,
        collate_fn=_collate,
        shuffle=False,
    )
    agg = Aggregate()
    model_out = Aggregate()
    counts = [0] * len(targets)
    seen = 0
    batches = 0
    skipped: list[tuple[str, str]] = []
    interrupted = False
    shape: tuple[int, ...] | None = None
    predictions: list[Prediction] = []
    edges: dict[Any, tuple[Any, Any]] = {}  # histogram edges, fixed by the first batch
    prediction_note: str | None = None
    with model_left_as_found(loaded.module, dev, train=train), torch.no_grad():
        try:
            for tensors, names, failed in loader:
                if failed and strict:
                    raise UsageError(
                        f"{failed[0][0]}: {failed[0][1]}",
                        "remove it, or drop --strict to skip unreadable images.",
                    )
                skipped.extend(failed)
                if not tensors:
                    continue
                shapes = {tuple(t.shape) for t in tensors}
                if len(shapes) > 1 and loaded.task != "detection":
                    raise UsageError(
                        f"images of different sizes after preprocessing in one batch ({names[0]}: "
                        f"{'x'.join(map(str, tensors[0].shape))}, …).",
                        "use a model whose preprocessing crops to one size, or --batch-size 1.",
                    )
                args: tuple[Any, ...] = (
                    (list(tensors),) if loaded.task == "detection" else (torch.stack(tensors),)
                )
                minput = ModelInput(args, "batch").to(dev)
                shape = shape or tuple(minput.shapes()[0])[1:]
                output = _one_batch(
                    loaded,
                    minput,
                    targets,
                    dev,
                    agg=agg,
                    model_out=model_out,
                    counts=counts,
                    collector=StatsCollector(hist_bins=hist, hist_edges=edges),
                )
                if per_image:
                    preds, prediction_note = predict(output, loaded, per_image, names)
                    for pr in preds or []:
                        pr.image += seen
                    predictions.extend(preds or [])
                seen += len(tensors)
                batches += 1
                if progress is not None:
                    progress(seen + len(skipped), len(files))
        except KeyboardInterrupt:
            interrupted = True
    notes = [
        "statistics are over all images"
        + ("" if per_image else "; add --per-image K for each image's top-K predictions")
    ]
    if skipped:
        shown = ", ".join(f"{Path(p).name} ({e})" for p, e in skipped[:5])
        more = f" and {len(skipped) - 5} more" if len(skipped) > 5 else ""
        notes.append(f"skipped {len(skipped)} unreadable image(s): {shown}{more}")
    if interrupted:
        notes.append(f"interrupted after {seen} of {len(files)} images: partial statistics")
    if seen == 0 and not interrupted:
        raise UsageError(f"none of the {len(files)} images could be read.", "check the files.")
    layers_out = [
        LayerCall(
            name,
            agg.types[name],
            call,
            next(t.aliases for t in targets if t.name == name),
            agg.tensors(name, call, "inputs"),
            agg.tensors(name, call, "outputs"),
        )
        for name, call in agg.order
    ]
    where = ", ".join(paths[:2]) + ("…" if len(paths) > 2 else "")
    report = Report(
        model=_model_info(loaded, train),
        input=InputInfo(
            f"{seen} images from {where} in {batches} batches of up to {batch_size}",
            [(seen, *shape)] if shape else [],
            [],
            loaded.preprocess_label,
        ),
        device=str(dev),
        layers=layers_out,
        never_called=[t.name for t, n in zip(targets, counts, strict=True) if n == 0],
        outputs=model_out.tensors("(model)", 0, "outputs"),
        predictions=predictions if per_image else None,
        prediction_note=prediction_note,
        notes=notes,
        hookcli_version=__version__,
    )
    report.interrupted = interrupted
    return report


def _one_batch(
    loaded: LoadedModel,
    minput: ModelInput,
    targets: list[Any],
    dev: torch.device,
    *,
    agg: Aggregate,
    model_out: Aggregate,
    counts: list[int],
    collector: StatsCollector,
) -> Any:
    """One batch through the hooked forward; its statistics merged, its tensors dropped."""
    session = HookSession(targets, collector)
    output = run_forward(loaded, minput, session, dev)
    out_stats: list[TensorStats] = []
    out_rows: list[int] = []
    collector.context = ("(model)", 0, "out")
    measure(collector, output, "out", out_stats, out_rows)
    rows = collector.finalize()
    for p in session.calls:
        call = _complete(p, rows, False)
        agg.add(call.name, call.type, call.call, "inputs", call.inputs)
        agg.add(call.name, call.type, call.call, "outputs", call.outputs)
    done = [fill(s, rows[r]) for s, r in zip(out_stats, out_rows, strict=True) if r >= 0]
    model_out.add("(model)", "output", 0, "outputs", done)
    for i, n in enumerate(session.counts):
        counts[i] += n
    return output
