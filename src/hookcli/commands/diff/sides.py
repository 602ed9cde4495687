"""The sides of a diff: what each kind of variant changes, one class per kind.

A side (`--b float16,channels_last`) is a composite of *side kinds*. Each kind owns all it
changes, behind one small interface (`SideKind`), every step of which defaults to "nothing":

- `model_options`: the load itself (another `weights=`, `seed=`, `device=`);
- `changes_module`: whether it changes the module in place (the Python API's own module is
  then copied first), and `prepare`: how (`module.to(float16)`, channels-last, torch.compile);
- `cast`: how a floating-point input tensor is cast (already on the side's device);
- `context`: what the side's pass runs under (autocast);
- `needs_twin` / `adapt_twin`: torchvision's quantizable twin, and what this kind does to it;
- `check_role`: a role it cannot take (the reference side, `--isolate`);
- `pass_runner`: a pass of its own instead of the hooked one (ONNX Runtime);
- `precision`: the precision it computes in (bfloat16, int8), which sets the default --tol.

`parse_side` reads a spec with the registered kinds, in registration order: the first kind
whose `parse` accepts a part takes it. Adding a side kind is one class and `@register`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

import torch
from torch import nn

from hookcli import bounds
from hookcli.commands.diff.align import fused_into
from hookcli.commands.diff.measure import Compared, Spill
from hookcli.commands.diff.onnx import onnx_pass
from hookcli.engine.prepare import Prepared, prepare
from hookcli.engine.selection import all_modules, held
from hookcli.errors import UsageError
from hookcli.inputs import ModelInput
from hookcli.options import InputOptions, ModelOptions, Selection
from hookcli.sources import LoadedModel


class PassRunner(Protocol):
    """A compared side's pass that is not the hooked one: the side's input through its own
    runtime, each selected call's output measured against the spilled reference into `into`."""

    def __call__(
        self, prepared: Prepared, model_input: ModelInput, spill: Spill, compared: Compared
    ) -> None: ...


class SideKind:
    """One thing a side changes. Subclasses override what their kind touches; the rest stays
    as loaded."""

    help: ClassVar[str]  # how the kind is written, for the list of sides
    changes_module: ClassVar[bool] = False  # `prepare` changes the module in place
    changes_weights: ClassVar[bool] = False  # the side's weights may differ from the reference's
    needs_twin: ClassVar[bool] = False  # every side then runs the quantizable twin

    @classmethod
    def parse(cls, key: str, value: str | None, raw: str, option: str) -> SideKind | None:
        """This kind from one part of a spec (`key`, lower case, and the text after `=`, None
        without one), or None when the part is not of this kind."""
        raise NotImplementedError

    @property
    def slot(self) -> object:
        """A later part with the same slot replaces an earlier one (`float16,float32`)."""
        return type(self)

    def model_options(self, options: ModelOptions) -> ModelOptions:
        return options

    def refuses(self, other: SideKind) -> str | None:
        """Why this kind cannot be on one side with `other` (whose work it would undo or
        ignore), or None."""
        return None

    def prepare(self, prepared: Prepared) -> None:
        """Change the loaded (already copied) model: dtype, memory format, compiled layers."""

    def cast(self, t: torch.Tensor) -> torch.Tensor:
        """A floating-point input tensor, already on the side's device."""
        return t

    def context(self, device: torch.device) -> AbstractContextManager[None]:
        """What the side's pass runs under."""
        return contextlib.nullcontext()

    def adapt_twin(self, twin: nn.Module, side: Side, calibrate: Callable[[], None]) -> None:
        """The quantizable twin (fused, this side's weights), changed as this kind changes a
        model. `calibrate` runs the twin once on the run's first input."""

    def check_role(self, *, reference: bool, isolate: bool) -> None:
        """Refuse a role this kind cannot take (a UsageError)."""

    def pass_runner(self) -> PassRunner | None:
        """A pass of its own for a compared side; None: the hooked pass."""
        return None

    @property
    def precision(self) -> str | None:
        """The precision the side computes in (a name of tolerance.PRECISIONS); None: this
        kind leaves it as it was."""
        return None


KINDS: list[type[SideKind]] = []
K = TypeVar("K", bound=type[SideKind])


def register(kind: K) -> K:
    """Add a side kind to the grammar (after the kinds registered before it)."""
    if kind not in KINDS:
        KINDS.append(kind)
    return kind


def side_help() -> str:
    """The side grammar, from the registered kinds."""
    return ", ".join(k.help for k in KINDS) + "; joined with commas"


# ---------------------------------------------------------------- the built-in kinds

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


@register
@dataclass(frozen=True, slots=True)
class DType(SideKind):
    """The model's parameters and its floating-point input in another dtype."""

    dtype: torch.dtype
    help: ClassVar[str] = "float32|float64|float16|bfloat16"
    changes_module: ClassVar[bool] = True
    changes_weights: ClassVar[bool] = True

    @classmethod
    def parse(cls, key: str, value: str | None, raw: str, option: str) -> SideKind | None:
        return cls(DTYPES[key]) if key in DTYPES and value is None else None

    def prepare(self, prepared: Prepared) -> None:
        prepared.loaded.module.to(self.dtype)

    def cast(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.dtype)

    @property
    def precision(self) -> str | None:
        return str(self.dtype).removeprefix("torch.")

    def adapt_twin(self, twin: nn.Module, side: Side, calibrate: Callable[[], None]) -> None:
        if not side.has(Quantized):  # an int8 twin keeps its own dtypes
            twin.to(self.dtype)


@register
@dataclass(frozen=True, slots=True)
class Autocast(SideKind):
    """The pass under torch.autocast (the parameters stay float32)."""

    dtype: torch.dtype
    help: ClassVar[str] = "autocast[:DTYPE]"

    @classmethod
    def parse(cls, key: str, value: str | None, raw: str, option: str) -> SideKind | None:
        if not key.startswith("autocast") or value is not None:
            return None
        name = key.partition(":")[2].lower() or "bfloat16"
        if name not in ("bfloat16", "float16"):
            raise UsageError(
                f"{option} {raw!r}: autocast has no dtype {name!r}; "
                "its dtypes are bfloat16 and float16.",
                f"e.g. {option} autocast:bfloat16 (or {option} quantized for int8).",
            )
        return cls(DTYPES[name])

    def context(self, device: torch.device) -> AbstractContextManager[None]:
        return torch.autocast(device.type, dtype=self.dtype)

    @property
    def precision(self) -> str | None:
        return str(self.dtype).removeprefix("torch.")


@register
@dataclass(frozen=True, slots=True)
class ChannelsLast(SideKind):
    """The model and its 4-D inputs in channels-last memory format."""

    help: ClassVar[str] = "channels_last"
    changes_module: ClassVar[bool] = True

    @classmethod
    def parse(cls, key: str, value: str | None, raw: str, option: str) -> SideKind | None:
        return cls() if key in ("channels_last", "nhwc") and value is None else None

    def prepare(self, prepared: Prepared) -> None:
        prepared.loaded.module.to(memory_format=torch.channels_last)

    def cast(self, t: torch.Tensor) -> torch.Tensor:
        return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t


@register
@dataclass(frozen=True, slots=True)
class Quantized(SideKind):
    """torchvision's int8 twin, calibrated on the run's input (CPU). Every side of the diff
    then runs the fused twin, so that both have the same modules under the same names."""

    help: ClassVar[str] = "quantized"
    needs_twin: ClassVar[bool] = True
    changes_weights: ClassVar[bool] = True

    @classmethod
    def parse(cls, key: str, value: str | None, raw: str, option: str) -> SideKind | None:
        return cls() if key in ("quantized", "int8") and value is None else None

    @property
    def precision(self) -> str | None:
        return "int8"

    def adapt_twin(self, twin: nn.Module, side: Side, calibrate: Callable[[], None]) -> None:
        from torch.ao import quantization as tq

        from hookcli.sources import quiet_warnings

        with quiet_warnings():  # torch.ao.quantization's deprecation notices: not the user's
            twin.qconfig = tq.get_default_qconfig("x86")  # type: ignore[no-untyped-call]
            tq.prepare(twin, inplace=True)  # type: ignore[no-untyped-call]
            with torch.no_grad():
                calibrate()
            tq.convert(twin, inplace=True)  # type: ignore[no-untyped-call]


@register
@dataclass(frozen=True, slots=True)
class Compile(SideKind):
    """Each selected leaf module's forward through torch.compile (inductor), its hooks left
    outside the compiled code, so each row shows that layer's compiled numerics. (A
    whole-model torch.compile would break its graph at every hook anyway.) The first run
    compiles: seconds per distinct layer."""

    help: ClassVar[str] = "compile"
    changes_module: ClassVar[bool] = True

    @classmethod
    def parse(cls, key: str, value: str | None, raw: str, option: str) -> SideKind | None:
        return cls() if key == "compile" and value is None else None

    def prepare(self, prepared: Prepared) -> None:
        for t in prepared.targets:
            if next(t.module.children(), None) is None:
                t.module.forward = torch.compile(t.module.forward)


@register
@dataclass(frozen=True, slots=True)
class Onnx(SideKind):
    """Exported with torch.onnx (dynamo) and run by ONNX Runtime on the CPU: no hooks inside,
    so it can be neither the reference nor fed the reference's inputs (--isolate)."""

    help: ClassVar[str] = "onnx"

    @classmethod
    def parse(cls, key: str, value: str | None, raw: str, option: str) -> SideKind | None:
        return cls() if key in ("onnx", "onnxruntime", "ort") and value is None else None

    def check_role(self, *, reference: bool, isolate: bool) -> None:
        if reference:
            raise UsageError(
                "the onnx side cannot be the reference (its layers are not hooked).",
                "put it on --b, e.g. --a float32 --b onnx.",
            )
        if isolate:
            raise UsageError(
                "--isolate cannot feed layers inside ONNX Runtime.",
                "drop --isolate for the onnx side (its rows are accumulated error).",
            )

    def pass_runner(self) -> PassRunner | None:
        return onnx_pass


@register
@dataclass(frozen=True, slots=True)
class Setting(SideKind):
    """Another load of the model: `weights=W`, `seed=N` or `device=D`."""

    name: str  # a field of ModelOptions: weights, seed or device
    value: str | int
    help: ClassVar[str] = "weights=W, seed=N, device=D"

    @classmethod
    def parse(cls, key: str, value: str | None, raw: str, option: str) -> SideKind | None:
        if key in ("weights", "device") and value:
            return cls(key, value)
        if key == "seed" and value is not None and value.strip().lstrip("-").isdigit():
            seed = bounds.integer(
                value.strip(), f"{option} seed", low=0, high=bounds.SEED_MAX, example="seed=1"
            )
            return cls(key, seed)
        return None

    @property
    def slot(self) -> object:
        return (type(self), self.name)

    def model_options(self, options: ModelOptions) -> ModelOptions:
        changes: dict[str, Any] = {self.name: self.value}
        return dataclasses.replace(options, **changes)


# ---------------------------------------------------------------- a side: its kinds together


def _rank(part: SideKind) -> int:
    """A kind's place: its registration's (a kind not registered acts last)."""
    return KINDS.index(type(part)) if type(part) in KINDS else len(KINDS)


@dataclass(frozen=True, slots=True)
class Side:
    """One variant of the model: its spec and its kinds, which act in registration order
    whatever the order they are given in."""

    spec: str
    parts: tuple[SideKind, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", tuple(sorted(self.parts, key=_rank)))

    def describe(self) -> str:
        return self.spec or "as loaded"

    def has(self, kind: type[SideKind]) -> bool:
        return any(isinstance(p, kind) for p in self.parts)

    def find(self, kind: type[SideKind]) -> SideKind | None:
        return next((p for p in self.parts if isinstance(p, kind)), None)

    # what the side is, for reading (each kind acts itself; side_copy reads the dtype)
    @property
    def dtype(self) -> torch.dtype | None:
        p = self.find(DType)
        return p.dtype if isinstance(p, DType) else None

    @property
    def autocast(self) -> torch.dtype | None:
        p = self.find(Autocast)
        return p.dtype if isinstance(p, Autocast) else None

    @property
    def channels_last(self) -> bool:
        return self.has(ChannelsLast)

    @property
    def quantized(self) -> bool:
        return self.has(Quantized)

    @property
    def compile(self) -> bool:
        return self.has(Compile)

    @property
    def onnx(self) -> bool:
        return self.has(Onnx)

    def _setting(self, name: str) -> Any:
        found = [p.value for p in self.parts if isinstance(p, Setting) and p.name == name]
        return found[-1] if found else None

    @property
    def weights(self) -> str | None:
        value: str | None = self._setting("weights")
        return value

    @property
    def seed(self) -> int | None:
        value: int | None = self._setting("seed")
        return value

    @property
    def device(self) -> str | None:
        value: str | None = self._setting("device")
        return value

    # the steps of a diff, each the kinds' own in turn
    @property
    def changes_module(self) -> bool:
        return any(p.changes_module for p in self.parts)

    @property
    def changes_weights(self) -> bool:
        """Whether the side's weights may differ from the as-loaded model's (another dtype,
        file, quantization, weights= or seed=)."""
        return any(
            p.changes_weights or (isinstance(p, Setting) and p.name in ("weights", "seed"))
            for p in self.parts
        )

    @property
    def needs_twin(self) -> bool:
        return any(p.needs_twin for p in self.parts)

    def model_options(self, options: ModelOptions) -> ModelOptions:
        for p in self.parts:
            options = p.model_options(options)
        return options

    def prepare(self, prepared: Prepared) -> None:
        for p in self.parts:
            p.prepare(prepared)

    def cast_tensor(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        t = t.to(device)
        if t.is_floating_point():
            for p in self.parts:
                t = p.cast(t)
        return t

    def cast(self, model_input: ModelInput, device: torch.device) -> ModelInput:
        """The run's input for this side: on its device, its floating-point tensors cast."""

        return model_input.map(lambda _path, t: self.cast_tensor(t, device))

    @contextlib.contextmanager
    def context(self, device: torch.device) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for p in self.parts:
                stack.enter_context(p.context(device))
            yield

    def adapt_twin(self, twin: nn.Module, calibrate: Callable[[], None]) -> None:
        for p in self.parts:
            p.adapt_twin(twin, self, calibrate)

    def check_role(self, *, reference: bool, isolate: bool) -> None:
        for p in self.parts:
            p.check_role(reference=reference, isolate=isolate)

    def pass_runner(self) -> PassRunner | None:
        return next((r for p in self.parts if (r := p.pass_runner()) is not None), None)

    @property
    def precisions(self) -> list[str]:
        """The precisions its kinds compute in; float32 when none changes it."""
        return [p.precision for p in self.parts if p.precision is not None] or ["float32"]

    def isolatable(self) -> str | None:
        """Why this side cannot be fed the reference's inputs (None: it can)."""
        try:
            self.check_role(reference=False, isolate=True)
        except UsageError as exc:
            return exc.message
        return None


def ran_in(run: SideRun) -> str:
    """The dtype a prepared side runs in: its parameters' (engine.selection.dtype_of) — the
    checkpoint's own for a side that sets none — under autocast where it asks; int8 for the
    quantized twin."""
    from hookcli.engine.selection import dtype_of

    side = run.side
    if side.quantized:
        return "int8"
    held = dtype_of(run.prepared.loaded.module)
    auto = side.autocast
    return held if auto is None else f"autocast {str(auto).removeprefix('torch.')} over {held}"


def precisions_of(run: SideRun) -> list[str]:
    """The precisions a side computes in, for its default tolerance: those its kinds set, else
    the dtype it was loaded in (a bfloat16 checkpoint as loaded is bfloat16's)."""
    from hookcli.engine.selection import dtypes_held

    own = [p.precision for p in run.side.parts if p.precision is not None]
    return own or [dtypes_held(run.prepared.loaded.module)[0]]


def parse_side(raw: str, option: str) -> Side:
    """A side from its spec (`float16,channels_last`), with the registered kinds."""
    parts: dict[object, SideKind] = {}
    for part in (p.strip() for p in raw.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        head, colon, rest = key.partition(":")
        key = head.lower() + colon + rest  # `gguf:Path/To.gguf`: a path after ':' keeps its case
        found = None
        for kind in KINDS:
            found = kind.parse(key, value if sep else None, raw, option)
            if found is not None:
                break
        if found is None:
            raise UsageError(
                f"{option} {raw!r}: {part!r} is not a side.", f"a side is made of: {side_help()}."
            )
        parts.pop(found.slot, None)
        parts[found.slot] = found
    given = list(parts.values())
    for one in given:
        for other in given:
            why = one.refuses(other) if other is not one else None
            if why is not None:
                raise UsageError(f"{option} {raw!r}: {why}.", f"give {option} one or the other.")
    return Side(raw.strip(), tuple(given))


SIDE_HELP = side_help()  # the built-in kinds' grammar


# ---------------------------------------------------------------- a side, loaded


@dataclass(slots=True)
class SideRun:
    """A side and its prepared model; `fused`: each Identity the twin's fusion left → the
    module it was fused into."""

    side: Side
    prepared: Prepared
    fused: dict[str, str] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)  # what its kinds did, said


def prepare_side(
    model: ModelOptions, selection: Selection, side: Side, *, with_input: InputOptions | None
) -> SideRun:
    """The model loaded and changed as the side says."""
    base = model.model
    if isinstance(base, nn.Module) and side.changes_module:
        base = side_copy(base, side.dtype)  # the Python API's own module: never changed in place
    elif isinstance(base, LoadedModel):  # each side its own record (a side may swap its module)
        module = side_copy(base.module, side.dtype) if side.changes_module else base.module
        base = dataclasses.replace(base, module=module, notes=list(base.notes))
    options = side.model_options(dataclasses.replace(model, model=base))
    prepared = prepare(options, selection, with_input)
    before = len(prepared.notes)
    side.prepare(prepared)
    return SideRun(side, prepared, notes=prepared.notes[before:])


def side_copy(module: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """`copy.deepcopy(module)` for a side that changes its module, made the cheap way where
    the result is the same: each module's empty hook tables (a dozen per module, which
    deepcopy rebuilds one by one through pickling's protocol: most of its time) made new
    directly; and for a side in another `dtype`, each plain floating-point parameter copied
    straight into it — the copy in the original dtype, which the side's `.to(dtype)` would
    replace, is never made. A parameter, because `.to` converts one in place (`param.data`):
    whatever else holds it follows it into the dtype either way. Not a buffer: `.to` puts a
    new tensor in the module's buffers and leaves any other holder (a plain attribute, a
    list) with the original dtype's copy, which deepcopy gives it; nor a parameter when torch
    is told to replace parameters on conversion instead. Everything else goes through deepcopy
    as before; the side's `prepare` converts what is left."""
    memo: dict[int, Any] = {}
    modules = all_modules(module)
    for m in modules:
        for value in vars(m).values():
            if type(value) in _TABLES and not value:
                memo[id(value)] = type(value)()
    if dtype is not None and not torch.__future__.get_overwrite_module_params_on_conversion():
        for t in held(module, modules)[0]:
            if type(t) is nn.Parameter and t.is_floating_point():
                memo[id(t)] = nn.Parameter(t.detach().to(dtype, copy=True), t.requires_grad)
    return copy.deepcopy(module, memo)


_TABLES = (dict, OrderedDict)


def quantizable_twin(run: SideRun, selection: Selection, calibration: ModelInput) -> None:
    """torchvision's quantizable version of the model, with this side's weights and conv+bn
    (+relu) fused, so that every side has the same modules under the same names; then changed
    by the side's kinds (a `quantized` side: prepared, calibrated on the run's first input and
    converted to int8 on the CPU)."""
    from hookcli.engine.selection import module_entries, select
    from hookcli.sources import quiet_warnings
    from hookcli.sources.torchvision import registry_names

    p = run.prepared
    name = f"quantized_{p.loaded.name}"
    if name not in registry_names():
        twins = [n.removeprefix("quantized_") for n in registry_names() if n.startswith("quant")]
        raise UsageError(
            f"{p.loaded.spec} has no quantized twin in torchvision.",
            f"the quantized side works with: {', '.join(twins)}.",
        )
    if p.device.type != "cpu":
        raise UsageError("the quantized side runs on the CPU only.", "add --device cpu.")
    import torchvision

    with quiet_warnings():  # torch.ao.quantization's deprecation notices: not the user's
        twin = torchvision.models.get_model(name, weights=None, quantize=False)
        twin.load_state_dict(p.loaded.module.float().state_dict())
        twin.eval()
        before = dict(twin.named_modules())
        twin.fuse_model()
        run.fused = fused_into(before, twin)

    def calibrate() -> None:
        x = Side("").cast(calibration, p.device)
        twin(*x.args, **x.kwargs)

    run.side.adapt_twin(twin, calibrate)
    p.loaded.module = twin
    p.entries = module_entries(twin)
    p.targets = select(
        p.entries,
        layers=selection.layers,
        types=selection.types,
        depth=selection.depth,
        model_label=p.loaded.spec,
    )
