"""The Python API's keyword arguments (`hookcli.inspect(model, x, layers=..., fail_on=...)`)
turned into the option objects the CLI builds from its flags, then the one run_command."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hookcli.commands.checks import Rules, parse_rules
from hookcli.commands.run import run_command
from hookcli.options import API_KEYS, Batching, Invocation, RuleOptions, field_names, pick
from hookcli.records import Report

# Keyword arguments of the Python API beyond Invocation.from_api's, by command: the fields
# of the option objects they fill
RULE_KEYS = field_names(RuleOptions)
INSPECT_RULE_KEYS = ("fail_on", "dead_frac")  # --fail-on works on inspect and grads too
BATCH_KEYS = field_names(Batching)  # folder runs (check: no --per-image)


def api_report(command: str, model: Any, inputs: Any, options: Mapping[str, Any]) -> Report:
    """hookcli.inspect/grads/check: keyword arguments → the option objects → run_command."""
    rule_keys = RULE_KEYS if command == "check" else INSPECT_RULE_KEYS
    allowed = {*API_KEYS, *rule_keys, *BATCH_KEYS}
    if command == "check":
        allowed -= {"topk", "per_image"}  # check makes no predictions
    for key in options:
        if key not in allowed:
            raise TypeError(
                f"unexpected option {key!r} for {command}; options are: "
                + ", ".join(sorted(allowed))
            )
    given = dict(options)
    rule_options = {k: given.pop(k) for k in rule_keys if k in given}
    batching = pick(Batching, {k: given.pop(k) for k in BATCH_KEYS if k in given})
    inv = Invocation.from_api(model, inputs, given, backward=command != "inspect")
    if inv.run.save is not None:
        from hookcli.io.output import claim

        save = claim(inv.run.save, "save", suffix=".safetensors", stdout_ok=False)
        inv = dataclasses.replace(inv, run=dataclasses.replace(inv.run, save=save))
    return run_command(command, inv, rules_from_api(rule_options), batching=batching)


def rules_from_api(options: Mapping[str, Any]) -> Rules:
    """The check options of the Python API, in the CLI's forms or Python's: fail_on="dead" or
    a list; grad_norm "MIN:MAX" or (min, max) with None for no bound; expect_shape
    "LAYER=1x64x112x112", a list of those, or {layer: (1, 64, 112, 112)}."""
    given = dict(options)
    if isinstance(given.get("fail_on"), str):
        given["fail_on"] = [given["fail_on"]]
    grad_norm = given.get("grad_norm")
    if isinstance(grad_norm, tuple):
        given["grad_norm"] = ":".join("" if v is None else repr(float(v)) for v in grad_norm)
    shapes = given.get("expect_shape")
    if isinstance(shapes, str):
        given["expect_shape"] = [shapes]
    elif isinstance(shapes, Mapping):
        given["expect_shape"] = [
            f"{layer}={shape if isinstance(shape, str) else 'x'.join(map(str, shape))}"
            for layer, shape in shapes.items()
        ]
    elif shapes is not None:
        given["expect_shape"] = list(shapes)
    if given.get("baseline") is not None:
        given["baseline"] = Path(given["baseline"])
    return parse_rules(pick(RuleOptions, given))
