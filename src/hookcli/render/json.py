"""JSON (schema 1): the Report as plain data; absent values are null, never NaN."""

from __future__ import annotations

import json
from typing import Any

from hookcli.records import LayersReport, ModelEntry, Report


def report_json(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2, allow_nan=False) + "\n"


def data_json(data: Any) -> str:
    import dataclasses

    if isinstance(data, LayersReport) or dataclasses.is_dataclass(data):
        payload: Any = dataclasses.asdict(data)  # type: ignore[arg-type]
    elif isinstance(data, list) and all(isinstance(x, ModelEntry) for x in data):
        payload = [dataclasses.asdict(x) for x in data]
    else:
        payload = data
    return json.dumps(payload, indent=2, allow_nan=False) + "\n"
