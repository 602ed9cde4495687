"""--memory in text: the totals (parameters, buffers, gradients, optimizer state, what
autograd saved, the predicted and measured peaks), the calls that saved most, and the
checkpointing candidates. JSON carries every call's numbers."""

from __future__ import annotations

from hookcli.records import Memory, Report
from hookcli.render.fmt import DASH, count
from hookcli.render.parts import Line, Row, Section, Table

SHOWN = 15  # calls listed by saved (or output) bytes
DROP = ("tensors", "peak")


def size(n: int | None) -> str:
    """Bytes in binary units: 512 B, 3.50 KiB, 97.9 MiB, 1.25 GiB."""
    if n is None:
        return DASH
    for scale, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def total_lines(m: Memory) -> list[str]:
    lines = [
        f"parameters {size(m.parameter_bytes)} ({count(m.parameters)}, each shared one once), "
        f"buffers {size(m.buffer_bytes)}"
    ]
    if m.gradient_bytes is not None:
        lines.append(f"gradients {size(m.gradient_bytes)}")
    if m.optimizer_bytes is not None:
        lines.append(f"optimizer state {size(m.optimizer_bytes)}")
    if m.saved_bytes is not None:
        lines.append(
            f"saved for backward {size(m.saved_bytes)} ({m.saved_tensors} storages, each once)"
        )
    if m.predicted_peak is not None:
        lines.append(
            f"a training step holds {size(m.predicted_peak)} at its peak (its backward walked "
            "call by call: what is still saved, the gradients made so far and in flight)"
        )
    if m.measured_peak is not None:
        lines.append(f"allocator peak over the pass {size(m.measured_peak)} ({m.device})")
    lines += [f"note: {n}" for n in m.notes]
    return lines


def memory_section(report: Report) -> Section:
    s = Section("memory", "memory")
    m = report.memory
    if m is None:
        return s
    calls = [c for c in report.layers if c.memory is not None]
    saved = m.saved_bytes is not None
    peak = any(c.memory.peak_bytes is not None for c in calls if c.memory)
    headers = ["layer", "call", "saved", "tensors", "freed by checkpoint", "output"]
    headers += ["peak"] if peak else []

    def key(c: object) -> int:
        mem = getattr(c, "memory", None)
        return -((mem.saved_bytes or 0) if saved else mem.output_bytes) if mem else 0

    ranked = sorted(calls, key=key)[:SHOWN]
    rows = []
    for c in ranked:
        mem = c.memory
        assert mem is not None
        cells = [
            c.name,
            str(c.call),
            size(mem.saved_bytes),
            DASH if mem.saved_tensors is None else str(mem.saved_tensors),
            size(mem.freed_bytes),
            size(mem.output_bytes),
        ]
        if peak:
            cells.append(size(mem.peak_bytes))
        rows.append(Row(cells))
    if rows:
        by = "saved for backward" if saved else "output size"
        more = f" ({SHOWN} of {len(calls)})" if len(calls) > SHOWN else ""
        s.parts.append(Table(f"memory per call, by {by}{more}", headers, rows, DROP))
    if m.candidates:
        rows = [
            Row(
                [
                    k.layer,
                    str(k.call),
                    size(k.freed_bytes),
                    DASH if k.flops is None else count(k.flops),
                    "no FLOPs" if k.bytes_per_flop is None else f"{k.bytes_per_flop:.3g}",
                ]
            )
            for k in m.candidates
        ]
        headers = ["layer", "call", "freed", "forward FLOPs", "freed bytes per FLOP"]
        title = "checkpointing candidates (most memory freed per FLOP recomputed)"
        s.parts.append(Table(title, headers, rows, ("forward FLOPs",)))
    s.parts += [Line(text) for text in total_lines(m)]
    return s
