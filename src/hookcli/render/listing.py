"""Format-neutral sections of the listings: `hookcli layers` (the module tree), `hookcli
models` (a registry) and `hookcli show` (a saved file), built from rows.py's parts."""

from __future__ import annotations

from hookcli.records import KVCache, LayersReport, ModelEntry, SavedFile, WeightBytes
from hookcli.render.fmt import DASH, count, nonfinite, shape
from hookcli.render.memrows import size
from hookcli.render.rows import (
    SAVED_HEADERS,
    Line,
    Part,
    Row,
    Section,
    Table,
    flops_label,
    lines_section,
    stat_cells,
)


def layers_sections(report: LayersReport) -> list[Section]:
    m = report.model
    head = [f"{m.spec} ({m.task}): {count(m.params)} parameters, {len(report.modules)} modules"]
    if report.input is not None:
        where = " on the meta device" if report.flops is not None else ""
        head.append(f"shapes from one forward pass{where}; input: {report.input.description}")
    if report.flops is not None:
        head.append(f"forward FLOPs {flops_label(report.flops)} (FlopCounterMode; MACs = FLOPs/2)")
    head += [f"note: {n}" for n in report.notes]
    tied = any(r.tied for r in report.modules)
    headers = ["layer", "type", "params", "leaf", "also named"]
    headers += ["tied (counted once)"] if tied else []
    if report.input is not None:
        headers += ["calls", "output shape"]
    if report.flops is not None:
        headers.append("FLOPs")
    # a column no module fills says nothing, and its width is the names' to fold less
    hidden = () if any(r.aliases for r in report.modules) else ("also named",)
    # given up first where the table does not fit (then each module turns vertical)
    t = Table(None, headers, drop=("leaf", "calls"), hidden=hidden)
    for r in report.modules:
        indent = "  " * max(r.depth - 1, 0)
        cells = [
            indent + r.name,
            r.type if r.hookable else f"{r.type} (TorchScript, not hookable)",
            count(r.params),
            "yes" if r.leaf else "",
            ", ".join(r.aliases),
        ]
        if tied:
            cells.append(", ".join(r.tied))
        if report.input is not None:
            cells += [str(r.calls or 0), "; ".join(r.output_shapes or []) or DASH]
        if report.flops is not None:
            cells.append(flops_label(r.flops))
        t.rows.append(Row(cells))
    hint = (
        "select with -l NAME (exact or glob, e.g. -l 'layer1.*'), -t TYPE, --depth N;"
        " default: every leaf module"
    )
    sections = [lines_section("header", "model", head), Section("modules", "modules", [t])]
    memory = memory_lines(report)
    if memory:
        sections.append(Section("memory", "memory", memory))
    return [*sections, lines_section("hint", "selecting", [hint])]


def memory_lines(report: LayersReport) -> list[Part]:
    """Under the module table: the weights' bytes (as held, and in each dtype they are also
    given in) and a causal LM's KV cache a token."""
    out: list[Part] = []
    if report.weights is not None:
        out += weight_lines(report.weights)
    if report.kv_cache is not None:
        out += kv_lines(report.kv_cache)
    return out


def weight_lines(w: WeightBytes) -> list[Line]:
    held = ", ".join(f"{dtype} {size(n)}" for dtype, n in w.held.items()) or "no parameters"
    if len(w.held) > 1:
        held = f"{size(w.bytes)}: {held}"
    buffers = f"; buffers {size(w.buffer_bytes)}" if w.buffer_bytes else ""
    first = f"weights {held} ({count(w.params)} parameters, tied ones once){buffers}"
    each = ", ".join(f"{dtype} {size(n)}" for dtype, n in w.as_dtype.items())
    return [Line(first), Line(f"  as {each} ({w.assumes})", "dim")]


def kv_lines(kv: KVCache) -> list[Line]:
    if kv.bytes_per_token is None:
        return [Line(f"KV cache {kv.note or 'unknown'}", "note")]
    formula = f": {kv.formula}" if kv.formula else ""
    line = f"KV cache {size(kv.bytes_per_token)} a token ({kv.dtype}{formula})"
    if kv.sliding_layers and kv.full_bytes is not None:
        window = f"{kv.window} tokens" if kv.window is not None else "their windows"
        line += (
            f"; past {window}, {size(kv.full_bytes)} a token: the {kv.sliding_layers} "
            f"sliding-window layers keep the last {window}"
        )
    if kv.bytes_at_context is not None and kv.context is not None:
        line += f"; {size(kv.bytes_at_context)} a sequence of its {kv.context}-token context"
    out = [Line(line)]
    if kv.note:
        out.append(Line(f"  {kv.note}", "dim"))
    return out


def models_sections(entries: list[ModelEntry]) -> list[Section]:
    prefix = entries[0].name.partition(":")[0] if entries and ":" in entries[0].name else ""
    source = {"timm": "timm", "hf": "Hugging Face model types with a classification head"}.get(
        prefix, "torchvision"
    )
    t = Table(
        f"{len(entries)} {source}" + ("" if prefix == "hf" else " models"),
        ["name", "task", "params", "input", "weights", "metric (DEFAULT)"],
    )
    for e in entries:
        weights = ", ".join(w + ("*" if w == e.default else "") for w in e.weights) or DASH
        cells = [
            e.name,
            e.task,
            count(e.params) if e.params else DASH,
            e.input_size or DASH,
            weights,
            e.metric or DASH,
        ]
        t.rows.append(Row(cells))
    hint = {
        "timm": "* = DEFAULT (read from the local Hugging Face cache). Use: hookcli inspect "
        "timm:NAME [IMAGE] --weights DEFAULT|TAG|FILE|none",
        "hf": "Use: hookcli inspect hf:TYPE [IMAGE] --model-arg key=value (config fields); "
        "random init. hf:PATH or hf:ORG/NAME load saved weights.",
    }.get(prefix, "* = DEFAULT. Use: hookcli inspect NAME [IMAGE] --weights DEFAULT|ENUM|none")
    return [Section("models", "models", [t]), lines_section("hint", "using", [hint])]


def saved_sections(saved: SavedFile) -> list[Section]:
    head: list[Part] = [Line(f"{saved.path}: {len(saved.tensors)} tensors", "heading")]
    head += [Line(f"{key}: {value}", "dim") for key, value in sorted(saved.metadata.items())]
    t = Table(None, list(SAVED_HEADERS))
    for s in saved.tensors:
        cells = [
            s.path,
            shape(s.shape),
            s.dtype,
            *stat_cells(s),
            nonfinite(s) or DASH,
        ]
        t.rows.append(Row(cells, s.nonfinite))
    return [Section("header", "file", head), Section("tensors", "tensors", [t])]
