"""CSV: one row per measured tensor (render/tabular.py has the rows and their columns: every
tensor of every layer call, each parameter gradient, the model's output, then a row per
position, channel, massive activation, outlier feature, attention head and expert a run
measured; a diff's tensors side by side). Every layers report has the same columns, whatever
it measured: a family it did not measure leaves its cells empty.

Text cells (names, paths, notes) go through text.csv_cell: control characters escaped and a
cell a spreadsheet would run as a formula (`=cmd|…`) prefixed with `'`; numbers stay numbers.
"""

from __future__ import annotations

import csv
import io

from hookcli.records import DiffReport, Report
from hookcli.render.tabular import Value, csv_cells, diff_rows, report_rows


def _write(columns: list[str], rows: list[list[Value]]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for row in rows:
        w.writerow(csv_cells(columns, row))
    return buf.getvalue()


def report_csv(report: Report) -> str:
    """One row per tensor of every layer call, parameter gradient and model output, then the
    families' rows (tabular.family_rows); with --profile, each tensor row also carries its
    call's forward_ms, self_ms, backward_ms and flops (empty when not measured)."""
    return _write(*report_rows(report))


def diff_csv(report: DiffReport) -> str:
    """One row per (layer call, side, tensor) (tabular.diff_rows)."""
    return _write(*diff_rows(report))
