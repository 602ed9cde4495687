"""The `onnx` side of `hookcli diff`: the model exported with torch.onnx (the dynamo exporter,
graph optimisations off) and run by ONNX Runtime on the CPU.

ONNX Runtime has no hooks, so module calls are found in the graph instead: the exporter records
on every node the chain of module names it was traced in (`pkg.torch.onnx.name_scopes`, e.g.
`['', 'layer1', 'layer1.0', 'layer1.0.relu', 'relu_1']`). The nodes of one call of a module are
consecutive in graph order; a module called twice (ResNet's `relu`) gives two runs of nodes,
numbered as calls 0 and 1 — the same numbering as hookcli's hooks. A call's output is the value
its nodes produce for a node outside them (or for the graph's output); those values are made
graph outputs, so ONNX Runtime returns them and keeps them out of its own fusions. A module
with no node of its own (Identity, Dropout in eval) has no counterpart and is listed as missing.
"""

from __future__ import annotations

import ast
from typing import Any

import numpy as np
import torch

from hookcli.commands.diff.measure import (
    SCORES,
    Compared,
    RealPositions,
    Spill,
    class_scores,
    measure,
)
from hookcli.engine.prepare import Prepared
from hookcli.errors import ModelError, UsageError
from hookcli.inputs import ModelInput
from hookcli.tree import iter_tensors

_SCOPES = "pkg.torch.onnx.name_scopes"


def _modules() -> tuple[Any, Any]:
    try:
        import onnx
        import onnxruntime
    except ImportError as exc:
        raise UsageError(
            f"the onnx side needs onnx, onnxscript and onnxruntime ({exc.name} is missing).",
            "pip install 'hookcli[onnx]'",
        ) from exc
    return onnx, onnxruntime


def export(prepared: Prepared, model_input: ModelInput) -> Any:
    """The model as an ONNX ModelProto, traced on this input (float32, CPU)."""
    _modules()
    module = prepared.loaded.module
    try:
        program = torch.onnx.export(
            module,
            tuple(model_input.args),
            kwargs=model_input.kwargs or None,
            dynamo=True,
            optimize=False,
            verbose=False,
        )
    except Exception as exc:
        raise ModelError(
            f"torch.onnx.export of {prepared.loaded.spec} failed: {type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
            "the model cannot be exported to ONNX as it is; compare another side.",
        ) from exc
    assert program is not None
    return program.model_proto


def call_outputs(graph: Any, names: set[str]) -> list[tuple[str, int, list[str]]]:
    """(module, call, output value names) for every call of the named modules, in graph order."""
    nodes = list(graph.node)
    chains = []
    for n in nodes:
        scopes = next((p.value for p in n.metadata_props if p.key == _SCOPES), "[]")
        chain = ast.literal_eval(scopes)
        chains.append({c for c in chain[1:-1] if c in names})  # module names only
    consumers: dict[str, set[int]] = {}
    for i, n in enumerate(nodes):
        for v in n.input:
            consumers.setdefault(v, set()).add(i)
    graph_outputs = {o.name for o in graph.output}
    calls: list[tuple[str, int, list[str]]] = []
    count: dict[str, int] = {}
    for name in sorted(names):
        i = 0
        while i < len(nodes):
            if name not in chains[i]:
                i += 1
                continue
            j = i
            while j < len(nodes) and name in chains[j]:
                j += 1
            group = set(range(i, j))
            outs = [
                v
                for k in range(i, j)
                for v in nodes[k].output
                if v and (v in graph_outputs or consumers.get(v, set()) - group)
            ]
            call = count.get(name, 0)
            count[name] = call + 1
            calls.append((name, call, outs))
            i = j
    order = {v: k for k, n in enumerate(nodes) for v in n.output}

    def returned(c: tuple[str, int, list[str]]) -> tuple[int, int]:
        """When the call returned: its last value; a call inside a container (handing on the
        same value) before the container, as hooks see them."""
        return (order.get(c[2][-1], 0) if c[2] else 0), -c[0].count(".")

    calls.sort(key=returned)
    return calls


def onnx_pass(
    prepared: Prepared, model_input: ModelInput, spill: Spill, compared: Compared
) -> None:
    """Export, run with ONNX Runtime returning every selected call's output, and measure each
    against the reference side's (read back from the spill)."""
    onnx, ort = _modules()
    model = export(prepared, model_input)
    graph = model.graph
    targets = {t.name: t.type for t in prepared.targets}
    calls = call_outputs(graph, set(targets))
    known = {o.name for o in graph.output}
    for _, _, outs in calls:
        for v in outs[-1:]:
            if v not in known:
                graph.output.append(onnx.helper.make_empty_tensor_value_info(v))
                known.add(v)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(
            model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        feeds = {
            i.name: t.detach().cpu().numpy()
            for i, (_, t) in zip(
                session.get_inputs(),
                iter_tensors((*model_input.args, *model_input.kwargs.values()), "in"),
                strict=False,
            )
        }
        names = [o.name for o in session.get_outputs()]
        values = dict(zip(names, session.run(names, feeds), strict=True))
    except Exception as exc:
        raise ModelError(
            f"ONNX Runtime failed on {prepared.loaded.spec}: {type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
            "compare another side; the exported graph does not run as it is.",
        ) from exc
    # a padded text batch: its padding enters no figure
    real = RealPositions.of_pass(model_input.token_mask, prepared.targets, prepared.loaded.module)
    for rank, (name, call, outs) in enumerate(calls):
        if not outs:
            continue
        _, accs = compared.calls.setdefault((name, call), (targets[name], {}))
        compared.order.setdefault((name, call), rank)
        got = torch.from_numpy(np.asarray(values[outs[-1]]))
        key = (name, call, "out")
        measure(accs, "out", spill.read(key), got, real=real, context=key)
    first = torch.from_numpy(np.asarray(values[graph.output[0].name]))
    model = ("(model)", 0, "out")
    measure(compared.outputs, "out", spill.read(model), first, real=real, context=model)
    compared.agree(spill.read(SCORES), class_scores(prepared.loaded, first), model_input.sources)
    compared.note_missing(spill.index, "not in the ONNX graph (no node of its own)")
