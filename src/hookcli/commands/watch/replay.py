"""`hookcli replay BUNDLE`: the training step a repro bundle holds, run again with hooks on.

The model comes from `--model SPEC` (any MODEL hookcli can build) with the bundle's state dict
loaded into it, or, only with `--unpickle`, from the bundle's pickle (model.pt): unpickling runs
whatever code the pickle names, so a bundle someone handed over is never unpickled by default.
Each module's train/eval flag is the step's. The step runs as the recorder's own re-run does
(bundle.rerun: the same forwards from the same RNG states and autocast, backward from the same
output gradients), on the device the step ran on when this machine has it, else on the CPU, or
on `--device`. The answer is a report like `grads`' — every selected call's statistics and
gradients — with the non-finite origin, and one check: the origin found now is the one the
recorder logged.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookcli._version import __version__
from hookcli.commands.watch.bundle import Bundle, read_bundle, rerun, to_device
from hookcli.engine.selection import module_entries, select
from hookcli.errors import ModelError, UsageError, one_line
from hookcli.records import (
    Backward,
    CheckResult,
    Failure,
    InputInfo,
    ModelInfo,
    Origin,
    Report,
)
from hookcli.runtime import gcpause, rng
from hookcli.tree import iter_tensors


def replay(
    path: str | Path,
    *,
    model: str | nn.Module | None = None,
    model_args: dict[str, Any] | None = None,
    device: str | None = None,
    layers: Sequence[str] = (),
    types: Sequence[str] = (),
    unpickle: bool = False,
) -> Report:
    """The bundle's step re-run with hooks on (see the module docstring). `unpickle`: load the
    bundle's pickled model (and any Python objects in its batch), which runs code from it."""
    if model is None and not unpickle:
        raise UsageError(
            f"replaying {path} with its own model means unpickling its model.pt, which runs any "
            "code the bundle holds.",
            "give --model SPEC (e.g. train.py:Net) to build the model from your code, or "
            "--unpickle only if you wrote this bundle yourself.",
        )
    bundle = read_bundle(Path(path), unpickle=unpickle)
    if not bundle.info.replayable:
        raise UsageError(
            f"the bundle {bundle.path} holds no batch: it could not be saved "
            f"({'; '.join(bundle.info.notes)}).",
            "its bundle.json still names the origin the recorder found.",
        )
    module, loading = _module(bundle, model, model_args)
    where = _device(bundle, device)
    module.to(where)
    entries = module_entries(module)
    targets = select(
        entries,
        layers=tuple(layers) or tuple(bundle.info.layers),
        types=tuple(types) or tuple(bundle.info.types),
        model_label="the bundle's model",
    )
    kinds = {n: e.type for e in entries for n in e.names}
    selected = {id(t.module) for t in targets}
    partial = any(e.leaf and id(e.module) not in selected for e in entries)
    forwards = to_device(bundle.forwards, where)
    try:
        with rng.left_as_found():
            again = rerun(module, forwards, targets, kinds, partial=partial)
    except Exception as exc:
        raise ModelError(f"the replayed step raised: {one_line(exc)}") from exc
    if again.errors:  # the model failed on the step's batch: its failure, not a finding
        more = f" (and {len(again.errors) - 1} more)" if len(again.errors) > 1 else ""
        raise ModelError(
            f"the replayed step failed: {again.errors[0]}{more}",
            "the model built here does not run the step's batch: give the --model the run "
            "trained (with its --model-arg).",
        )
    found = ", ".join(bundle.info.found)
    step, rank = bundle.info.step, bundle.info.rank
    notes = [f"bundle {bundle.path}: step {step} of rank {rank}, NaN/Inf seen in the {found}"]
    notes += list(bundle.info.notes)
    notes += loading
    if model is not None:
        notes.append(
            f"model built from {model if isinstance(model, str) else type(model).__name__} with "
            "the bundle's state dict: attributes outside it are the constructor's"
        )
    if str(where) != bundle.info.device:
        notes.append(f"recorded on {bundle.info.device}, replayed on {where}")
    notes += [f"{c.name} call {c.call}: {c.error}" for c in again.calls if c.error]
    shapes = [tuple(t.shape) for f in forwards for _, t in iter_tensors((f.args, f.kwargs), "in")][
        :8
    ]
    return Report(
        model=ModelInfo(
            name=type(module).__name__,
            spec=bundle.info.model or type(module).__name__,
            task="training step",
            weights=f"bundle {bundle.path.name}",
            params=sum(p.numel() for p in module.parameters()),
            mode="train" if module.training else "eval",
        ),
        input=InputInfo(f"step {bundle.info.step}'s batch: {len(forwards)} forward(s)", shapes),
        device=str(where),
        layers=again.calls,
        never_called=again.never_called,
        outputs=again.outputs,
        notes=notes,
        nonfinite_origins=again.origins,
        backward=Backward("the gradients the step's loss gave its outputs", None),
        checks=[_reproduced(bundle, again.origins)],
        command="replay",
        hookcli_version=__version__,
    )


def origin_key(o: Origin) -> tuple[str, str, str, int, str]:
    """What makes two origins the same: direction, where, layer call and tensor path."""
    return (o.direction, o.where, o.layer, o.call, o.path)


def _reproduced(bundle: Bundle, found: list[Origin]) -> CheckResult:
    # the loss is not run again (backward restarts from its gradients): an origin in it is not
    # there to be found
    recorded = [origin_key(o) for o in bundle.info.origins if o.where != "loss"]
    now = [origin_key(o) for o in found]
    text = "; ".join(o.describe() for o in found) or "every value finite"
    if recorded == now:
        return CheckResult("replay", True, f"the recorded origin again: {text}")
    was = ", ".join(f"{d} {w} at {layer} call {c} {p}" for d, w, layer, c, p in recorded)
    return CheckResult(
        "replay",
        False,
        f"not the recorded origin ({was or 'none recorded'}): now {text}",
        [Failure(f"recorded {was or 'none'}, replayed: {text}")],
    )


def _module(
    bundle: Bundle, spec: str | nn.Module | None, args: dict[str, Any] | None
) -> tuple[nn.Module, list[str]]:
    """The model to replay, and what its loading has to say (a script read, not run)."""
    if spec is None:
        if not bundle.info.pickled or not (bundle.path / "model.pt").is_file():
            raise UsageError(
                f"the bundle {bundle.path} holds no pickled model.",
                "give --model SPEC (e.g. train.py:Net): its state comes from the bundle.",
            )
        try:
            module = torch.load(bundle.path / "model.pt", map_location="cpu", weights_only=False)
        except (ImportError, AttributeError) as exc:
            raise UsageError(
                f"cannot rebuild {bundle.info.model} from the bundle: {one_line(exc)}.",
                "run replay where the training code imports (its directory), or give --model "
                "train.py:Net (a class defined in the training script itself needs --model).",
            ) from exc
        except Exception as exc:  # truncated, not a torch file, a pickle that raises
            raise UsageError(
                f"cannot unpickle {bundle.path / 'model.pt'}: {type(exc).__name__}: "
                f"{one_line(exc)}.",
                "give --model SPEC (e.g. train.py:Net): its state comes from the bundle.",
            ) from exc
        finally:
            gcpause.resume()  # the CLI: the model is built, start-up is over
        if not isinstance(module, nn.Module):
            raise UsageError(f"{bundle.path / 'model.pt'} holds no nn.Module.", "give --model.")
        return module, []
    from hookcli.sources import load_model

    loaded = load_model(spec, model_args=args)
    module = loaded.module
    try:
        module.load_state_dict(bundle.state["model"])
    except RuntimeError as exc:
        raise UsageError(
            f"the bundle's state does not fit {spec}: {one_line(exc, whole=True).rstrip('.')}.",
            "give the --model (and --model-arg) the run trained.",
        ) from exc
    flags = bundle.state.get("training") or {}
    for name, m in module.named_modules():
        if name in flags:
            m.training = bool(flags[name])
    return module, loaded.notes


def _device(bundle: Bundle, spec: str | None) -> torch.device:
    from hookcli.sources import resolve_device

    if spec is not None:
        return resolve_device(spec)
    recorded = torch.device(bundle.info.device)
    if recorded.type == "cuda" and torch.cuda.is_available():
        return (
            recorded if (recorded.index or 0) < torch.cuda.device_count() else torch.device("cuda")
        )
    return torch.device("cpu")
