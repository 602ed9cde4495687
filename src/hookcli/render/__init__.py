"""Renderers: Report → text. They read records only and never import torch.

rows.py turns a report into format-neutral sections (lines and tables of strings); table.py
(Rich, width fitting, colour) and markdown.py lay out those same sections. csv.py and json.py
write the records' raw numbers (CSV one row per tensor, JSON the whole report), not the
formatted cells. html.py writes one self-contained page: the JSON embedded, the per-call table
static, sorting/filtering/the module tree in a script (assets/). images.py draws PNGs.
formats.py is the one door: any report (Report, DiffReport, LensReport, CalibReport, a run
log's series and checks) in any Format; writers.py is its table, a writer per Format (the -o
suffixes it owns, whether it is binary, the report kinds it takes and the function for each).
"""

from __future__ import annotations

from enum import StrEnum


class Format(StrEnum):
    """-f's choices; each has its writer in writers.WRITERS."""

    table = "table"
    json = "json"
    csv = "csv"
    markdown = "markdown"
    html = "html"
    parquet = "parquet"  # binary: a file (-o FILE.parquet), never a terminal
    # a run log's series in an experiment tracker (`hookcli report run.jsonl -f … -o DIR`)
    tensorboard = "tensorboard"  # event files in a folder
    mlflow = "mlflow"  # a run in a file store (a folder) or at a tracking URI
    wandb = "wandb"  # an offline W&B run in a folder
