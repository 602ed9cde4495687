"""One typed reader for run-log lines (issue 50, item 2): read_log reads every line with the
reader io/recordjson.py compiles for StepLine / NonfiniteLine, which enforces the bounds, the
absent-field values and the tolerance the record fields declare in their metadata; the log's
one-line messages are that reader's RecordError in the log's own words."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from hookcli.commands.watch import logread
from hookcli.errors import UsageError
from hookcli.io.recordjson import RecordError, from_json
from hookcli.records.meta import ABSENT, LEAST, LENIENT, NULL_IS_ABSENT
from tests.support.watchlogs import call_dict, step_dict, write_log

ORIGIN = {
    "direction": "forward", "layer": "fc", "type": "Linear", "call": 0, "path": "out",
    "nan": 2, "inf": 0,
}  # fmt: skip


def _refused(tmp_path: Path, line: dict[str, Any]) -> str:
    """The message for `line` as the second line of a log (the first one good), after
    'line 2 ', without the hint."""
    path = write_log(tmp_path, [step_dict(0), line])
    with pytest.raises(UsageError) as bad:
        logread.read_log(path)
    said = str(bad.value)
    assert "\n" not in said and bad.value.hint
    head = f"run log {path} line 2 "
    assert said.startswith(head), said
    return said[len(head) :].split(". Hint:", maxsplit=1)[0].rstrip(".")


def _with(change: Any) -> dict[str, Any]:
    line = step_dict(1, nonfinite_origins=[dict(ORIGIN)])
    change(line)
    return line


def _set(*path: str | int, value: Any) -> Any:
    def change(line: dict[str, Any]) -> None:
        here: Any = line
        for part in path[:-1]:
            here = here[part]
        here[path[-1]] = value

    return change


# ---------------------------------------------------------------- bounds, from the metadata


@pytest.mark.parametrize(
    ("path", "value", "said"),
    [
        (("step",), -1, "has step = -1, not a whole number >= 0"),
        (("rank",), -2, "has rank = -2, not a whole number >= 0"),
        (("world_size",), 0, "has world_size = 0, not a whole number >= 1"),
        (("layers", 0, "call"), -1, "has call = -1 in layers[0], not a whole number >= 0"),
        (("layers", 1, "outputs", 0, "numel"), -3,
         "has numel = -3 in layers[1].outputs[0], not a whole number >= 0"),
        (("layers", 0, "grad_outputs", 0, "nan"), -1,
         "has nan = -1 in layers[0].grad_outputs[0], not a whole number >= 0"),
        (("params", 0, "grad", "inf"), -5,
         "has inf = -5 in params[0].grad, not a whole number >= 0"),
        (("layers", 0, "inputs", 0, "shape"), [2, -1],
         "has a shape that is not a list of sizes in layers[0].inputs[0]"),
        (("nonfinite_origins", 0, "nan"), -1,
         "has nan = -1 in nonfinite_origins[0], not a whole number >= 0"),
        (("nonfinite_origins", 0, "call"), 1.5,
         "has call = 1.5 in nonfinite_origins[0], not a whole number >= 0"),
    ],
)  # fmt: skip
def test_a_count_below_its_bound_is_refused_naming_it(
    tmp_path: Path, path: tuple[str | int, ...], value: Any, said: str
) -> None:
    assert _refused(tmp_path, _with(_set(*path, value=value))) == said


def test_zero_is_a_count_and_a_size(tmp_path: Path) -> None:
    line = step_dict(1)
    t = line["layers"][0]["outputs"][0]
    t["shape"], t["numel"] = [0, 4], 0
    log = logread.read_log(write_log(tmp_path, [step_dict(0), line]))
    got = log.steps[1].layers[0].outputs[0]
    assert (got.shape, got.numel) == ((0, 4), 0)


# ---------------------------------------------------------------- the log's own words


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (_set("loss", value="high"), "has loss a string, not a number or null"),
        (_set("layers", 0, "outputs", 0, "std", value=[1]),
         "has std a list in layers[0].outputs[0], not a number or null"),
        (_set("layers", 1, value=7), "has a number in layers[1], not an object"),
        (_set("params", 0, "grad", value="g"), "has a string in params[0].grad, not an object"),
        (_set("layers", 0, "name", value=None), "has name null in layers[0], not a string"),
        (_set("params", value={}), "has params an object, not a list"),
        (lambda d: d["layers"][0].pop("outputs"), "has no 'outputs' in layers[0]"),
        (lambda d: d["params"][0]["grad"].pop("path"), "has no 'path' in params[0].grad"),
        (lambda d: d.pop("layers"), "has no 'layers'"),
        (_set("rank", value=3), "is rank 3 of a world of 1"),
    ],
)  # fmt: skip
def test_a_misplaced_value_is_one_line_in_the_logs_words(
    tmp_path: Path, change: Any, said: str
) -> None:
    assert _refused(tmp_path, _with(change)) == said


def test_an_event_line_is_read_by_its_typed_reader_too(tmp_path: Path) -> None:
    event = {"schema": 1, "kind": "nonfinite", "step": 0, "rank": 0, "world_size": 1}
    assert _refused(tmp_path, event) == "has no 'found'"
    said = _refused(tmp_path, event | {"found": ["grad", 3]})
    assert said == "has a 'found' that is not a list of strings"
    said = _refused(tmp_path, event | {"found": [], "origins": [ORIGIN | {"inf": -1}]})
    assert said == "has inf = -1 in origins[0], not a whole number >= 0"


# ---------------------------------------------------------------- what a line may leave out


def test_absent_and_null_fields_read_as_their_declared_values(tmp_path: Path) -> None:
    step = step_dict(1, nonfinite_origins=None)
    del step["loss"]
    call = step["layers"][0]
    del call["grad_outputs"], call["grad_inputs"], call["outputs"][0]["dtype"]
    param = step["params"][0]
    for key in ("norm", "grad", "update_norm", "update_ratio"):
        del param[key]
    event = {"schema": 1, "kind": "nonfinite", "step": 1, "rank": 0, "world_size": 1}
    event |= {"found": ["loss"], "origins": None, "nonfinite_params": None}
    log = logread.read_log(write_log(tmp_path, [step_dict(0), step, event]))
    got = log.steps[1]
    assert got.loss is None and got.nonfinite_origins == []
    assert (got.layers[0].grad_outputs, got.layers[0].grad_inputs) == (None, None)
    assert got.layers[0].outputs[0].dtype == ""
    p = got.params[0]
    assert (p.norm, p.grad, p.update_norm, p.update_ratio) == (None, None, None, None)
    (e,) = log.events
    assert (e.found, e.origins, e.nonfinite_params) == (["loss"], [], [])


def test_extras_nothing_checks_read_as_their_defaults_when_malformed(tmp_path: Path) -> None:
    """watch(memory=True)'s numbers, --per-token rows and an origin's description: a
    hand-edited line still reads, and says what it can."""
    line = step_dict(1, memory={"device": 3}, nonfinite_origins=[ORIGIN | {"where": 5}])
    line["nonfinite_origins"][0] |= {"after": ["x"], "after_finite": 1, "code": "f"}
    out = line["layers"][0]["outputs"][0]
    out["per_token"] = [{"sequence": "first"}]
    line["layers"][0]["memory"] = "lots"
    got = logread.read_log(write_log(tmp_path, [step_dict(0), line])).steps[1]
    assert got.memory is None and got.layers[0].memory is None
    assert got.layers[0].outputs[0].per_token is None
    o = got.nonfinite_origins[0]
    assert (o.where, o.after, o.after_finite, o.code) == ("layer", None, None, [])
    assert (o.nan, o.path) == (2, "out")  # the checked fields as written
    assert "nan 2" not in o.describe() and "2 NaN" in o.describe()


def test_a_well_formed_extra_is_kept(tmp_path: Path) -> None:
    row = {"sequence": 0, "position": 1, "norm": 2.0, "mean": 0.5, "std": 0.1, "max_abs": 3.0}
    line = step_dict(1, layers=[call_dict("fc")])
    line["layers"][0]["outputs"][0]["per_token"] = [row | {"channel": 4}]
    got = logread.read_log(write_log(tmp_path, [step_dict(0), line])).steps[1]
    (r,) = got.layers[0].outputs[0].per_token or []
    assert (r.sequence, r.position, r.norm, r.channel, r.id, r.token) == (0, 1, 2.0, 4, None, None)


# ---------------------------------------------------------------- the metadata, on its own


@dataclass(slots=True)
class _Box:
    size: int = field(metadata={LEAST: 2})
    sides: list[int] = field(metadata={LEAST: 0})
    label: str = field(metadata={ABSENT: "none"})
    tags: list[str] = field(default_factory=list, metadata={NULL_IS_ABSENT: True})
    colour: str = field(default="grey", metadata={LENIENT: True})


def test_the_reader_compiles_each_fields_metadata_in() -> None:
    box = from_json(_Box, {"size": 2, "sides": [0, 3], "tags": None, "colour": 9})
    assert box == _Box(2, [0, 3], "none", [], "grey")
    for data, where in (
        ({"size": 1, "sides": []}, "size is a number, not a whole number >= 2"),
        ({"size": 2, "sides": [1, -1]}, "sides[1] is a number, not a whole number >= 0"),
        ({"size": 2, "sides": [], "label": None}, "label is null, not a string"),
        ({"size": 2, "sides": [], "tags": [1]}, "tags[0] is a number, not a string"),
    ):
        with pytest.raises(RecordError) as bad:
            from_json(_Box, copy.deepcopy(data))
        assert str(bad.value) == where
    with pytest.raises(RecordError) as bad:
        from_json(_Box, {"size": 2, "sides": [1, -1]})
    e = bad.value
    assert (e.path, e.value, e.expected, e.missing) == (
        ("sides", 1),
        -1,
        "a whole number >= 0",
        None,
    )


@pytest.mark.parametrize(
    ("path", "said"),
    [
        (("loss",), "has loss a number, not a finite number or null"),
        (("scale",), "has scale a number, not a finite number or null"),
        (("layers", 0, "outputs", 0, "max"),
         "has max a number in layers[0].outputs[0], not a finite number or null"),
        (("params", 0, "update_ratio"),
         "has update_ratio a number in params[0], not a finite number or null"),
    ],
)  # fmt: skip
def test_a_number_beyond_a_float_is_refused(
    tmp_path: Path, path: tuple[str | int, ...], said: str
) -> None:
    """JSON's 1e999 parses as inf: what hookcli writes as null when not finite."""
    path_ = write_log(tmp_path, [step_dict(0)])
    text = path_.read_text()
    line = _with(_set(*path, value=12345.5))
    bad = json.dumps(line).replace("12345.5", "1e999")
    path_.write_text(text + bad + "\n")
    with pytest.raises(UsageError) as e:
        logread.read_log(path_)
    assert f"line 2 {said}." in str(e.value), str(e.value)
