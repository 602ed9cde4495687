"""JSON (schema 1): the Report as plain data; absent values are null, never NaN."""

from __future__ import annotations

import json
from typing import Any

from hookcli.records import Report


def report_json(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2, allow_nan=False) + "\n"


def data_json(data: Any) -> str:
    import dataclasses

    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        payload: Any = dataclasses.asdict(data)
    elif isinstance(data, list) and all(dataclasses.is_dataclass(x) for x in data):
        payload = [dataclasses.asdict(x) for x in data]
    else:
        payload = data
    return json.dumps(payload, indent=2, allow_nan=False) + "\n"
