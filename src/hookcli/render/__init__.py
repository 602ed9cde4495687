"""Renderers: Report → text. They read records only and never import torch."""

from __future__ import annotations

from enum import StrEnum


class Format(StrEnum):
    table = "table"
    json = "json"
    csv = "csv"
    markdown = "markdown"


SUFFIX_FORMATS = {
    ".json": Format.json,
    ".csv": Format.csv,
    ".md": Format.markdown,
    ".markdown": Format.markdown,
    ".txt": Format.table,
}
