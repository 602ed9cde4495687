"""A user's model: `path/to/file.py:Name` (imported from the file) or `package.module:Name`
(imported by name), Name an nn.Module subclass or a factory returning one; or an nn.Module
passed through the Python API. Weights: as constructed, or a local state dict."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import io
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from hookcli.errors import HookcliError, ModelError, UsageError, not_a_file, one_line
from hookcli.io.output import note_read, user_path
from hookcli.sources.base import Source, kwargs_text
from hookcli.sources.model import LoadedModel
from hookcli.sources.registry import unknown_model
from hookcli.sources.statedict import load_state_dict_file
from hookcli.sources.tasks import CUSTOM, Task, task_named


class FileSource(Source):
    """`path/to/file.py:Name`."""

    name = "file"

    def claims(self, spec: str) -> bool:
        return spec.rpartition(":")[0].endswith(".py")

    def load(
        self, spec: str, *, weights: str, seed: int, model_args: dict[str, Any]
    ) -> LoadedModel:
        return load_custom(spec, weights, seed, model_args, import_file)


class ModuleSource(Source):
    """`package.module:Name` (any other spec with a colon: it reports what is wrong)."""

    name = "module"

    def claims(self, spec: str) -> bool:
        return ":" in spec

    def load(
        self, spec: str, *, weights: str, seed: int, model_args: dict[str, Any]
    ) -> LoadedModel:
        return load_custom(spec, weights, seed, model_args, import_module)


def _read_model_file(source: str) -> Path:
    """The model's source file, checked readable: a file hookcli cannot read is an input
    problem (exit 2); what the file does when imported is the model's (exit 3)."""
    path = user_path(source, "model file")
    if path.is_dir():
        raise UsageError(
            f"model file {source} is a folder.", "give the .py file (path/to/file.py:Name)."
        )
    if not path.exists():
        raise UsageError(
            f"model file {source} not found.", "check the path in MODEL (path/to/file.py:Name)."
        )
    try:
        with io.open_code(str(path)) as f:  # as the import will read it
            f.read(1)
    except OSError as exc:
        raise UsageError(
            f"cannot read model file {source}: {exc.strerror or exc}.",
            "check the file's permissions (ls -l), or copy it somewhere readable.",
        ) from exc
    note_read(path)
    return path


def import_file(source: str, wanted: str = "") -> ModuleType:
    """The module of a model file, its definitions executed with its folder first on sys.path.
    Only definitions (sources.script): a training script that defines the model is read, not
    run. `__skipped__` on the module lists the top-level statements left out."""
    from hookcli.sources.script import definitions

    path = _read_model_file(source)
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]
    module_name = f"_hookcli_user_{path.stem}_{digest}"  # two files of one name: two modules
    try:
        with io.open_code(str(path)) as f:
            text = importlib.util.decode_source(f.read())
        defs = definitions(text, str(path), wanted)
    except SyntaxError as exc:
        raise UsageError(
            f"{source} line {exc.lineno}: syntax error: {exc.msg}.", "fix the model file."
        ) from exc
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise UsageError(
            f"cannot read model file {source}: {one_line(exc)}.", "give a Python source file."
        ) from exc
    module = ModuleType(module_name)
    module.__file__ = str(path)
    module.__skipped__ = defs  # type: ignore[attr-defined]
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
    with models_own(
        f"importing {source} failed:",
        "fix the model file (its definitions fail as the file's imports run them).",
    ):
        try:
            exec(compile(defs.module, str(path), "exec"), module.__dict__)
        except NameError as exc:  # a default value, decorator or class body needs skipped code
            sys.modules.pop(module_name, None)
            said = skipped_name(defs, exc, source, source)
            if said is None:
                raise
            raise said from exc
        except BaseException:
            sys.modules.pop(module_name, None)
            raise
        finally:
            sys.path.remove(folder)
    return module


def skipped_name(defs: Any, exc: NameError, source: str, who: str) -> UsageError | None:
    """The one line for a NameError whose name the script sets by code hookcli did not run
    (sources.script), or None when it is not such a name."""
    binder = defs.binder(exc.name) if defs is not None and exc.name else None
    if binder is None:
        return None
    return UsageError(
        f"{who} needs {exc.name!r}, set at line {binder.line} of {source} by code hookcli does "
        f"not run ({binder.text}): a script's definitions are read, not its top-level code.",
        f"make {exc.name} a constant or a definition, or move the model into a module of its own.",
    )


@contextlib.contextmanager
def models_own(what: str, hint: str) -> Iterator[None]:
    """What the model's own code raises — any exception, SystemExit, GeneratorExit, its own
    BaseException subclass — is the model's failure (exit 3), said as `what Type: message`;
    hookcli's own errors and Ctrl-C pass through as they are."""
    try:
        yield
    except (KeyboardInterrupt, HookcliError):
        raise
    except BaseException as exc:
        raise ModelError(f"{what} {one_line(exc)}", hint) from exc


def import_module(source: str, wanted: str = "") -> ModuleType:
    """An installed (or importable) module by its dotted name, imported as Python imports it
    (`wanted` is not needed). The console script puts the current directory on sys.path
    (cli.app.main), as `python -m` has it."""
    with models_own(
        f"importing {source} failed:",
        f"fix the module; python -c 'import {source}' shows the traceback.",
    ):
        try:
            return importlib.import_module(source)
        except ModuleNotFoundError as exc:
            raise _not_found(source, exc, os.getcwd()) from exc
        except SyntaxError as exc:  # the file's text, as FILE.py:Name says it (exit 2)
            raise UsageError(
                f"cannot import module {source}: {one_line(exc)}",
                f"fix the file; python -c 'import {source}' shows where.",
            ) from exc


def _not_found(source: str, exc: ModuleNotFoundError, cwd: str) -> UsageError:
    """The module itself is missing, or something it imports is."""
    missing = exc.name or ""
    if missing and not (source == missing or source.startswith(missing + ".")):
        return UsageError(
            f"module {source} imports {missing}, which is not installed.",
            f"install it (pip install {missing.partition('.')[0]}) in this environment.",
        )
    return UsageError(
        f"cannot import module {source!r}: no {missing or source} in {cwd} or the installed "
        "packages.",
        "run hookcli from the folder that holds the package, or install it (pip install -e .).",
    )


def load_custom(
    spec: str,
    weights: str,
    seed: int,
    kwargs: dict[str, Any],
    importer: Callable[[str, str], ModuleType],
) -> LoadedModel:
    source, _, attr = spec.rpartition(":")
    if not source or not attr.isidentifier():
        raise unknown_model(spec)
    module = importer(source, attr)
    skipped = getattr(module, "__skipped__", None)
    obj = getattr(module, attr, None)
    if obj is None and skipped is not None and (binder := skipped.binder(attr)) is not None:
        raise UsageError(
            f"{attr!r} is set at line {binder.line} of {source} by code hookcli does not run "
            f"({binder.text}): a script's definitions are read, not its top-level code.",
            f"define {attr} with class or def, or move it into a module of its own.",
        )
    if obj is None:
        names = [
            n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, nn.Module)
        ]
        near = f" It defines: {', '.join(names)}." if names else ""
        raise UsageError(
            f"{source} has no {attr!r}.{near}", "name a class or factory defined in that file."
        )
    if not callable(obj):
        raise UsageError(
            f"{source}:{attr} is a {type(obj).__name__}, not a class or factory.",
            "name an nn.Module subclass or a function returning one.",
        )
    instance = isinstance(obj, nn.Module)  # `model = Net()` in the script: the model itself
    if instance and kwargs:
        raise UsageError(
            f"{source}:{attr} is a model already built (a {type(obj).__name__}), so "
            f"--model-arg {', '.join(kwargs)} has nothing to construct.",
            "drop --model-arg, or name the class or factory that builds it.",
        )
    torch.manual_seed(seed)
    with models_own(
        f"{source}:{attr}({kwargs_text(kwargs)}) raised", "fix the model's constructor."
    ):
        try:
            model = obj if instance else obj(**kwargs)
        except NameError as exc:
            said = skipped_name(skipped, exc, source, attr)
            if said is None:
                raise
            raise said from exc
        except TypeError as exc:
            raise UsageError(
                f"{source}:{attr}({kwargs_text(kwargs)}) failed: {one_line(exc, with_type=False)}",
                "pass constructor arguments with --model-arg key=value.",
            ) from exc
    if not isinstance(model, nn.Module):
        raise UsageError(
            f"{source}:{attr} gave a {type(model).__name__}, not an nn.Module.",
            "name an nn.Module subclass or a function returning one.",
        )
    from hookcli.engine.selection import walk

    for _ in walk(model):  # a module cycle is named here, not hit as a RecursionError in eval()
        pass
    with models_own(f"{source}:{attr}'s eval() raised", "fix the model's train()/eval() method."):
        model.eval()
    loaded = wrap_module(model, "none")
    loaded.spec = spec
    loaded.name = attr
    if skipped is not None and skipped.skipped:
        loaded.notes.append(
            f"{source}: its definitions were read; top-level code at {skipped.summary()} was not "
            "run (a script is read, never run)"
        )
    if weights.strip().lower() not in ("none", ""):
        path = user_path(weights.strip(), "--weights")
        if not path.is_file():
            raise UsageError(
                f"weights file {weights} {not_a_file(path)}.",
                "custom models take --weights PATH to a state dict, or none.",
            )
        load_state_dict_file(model, path, spec)
        loaded.weights_label = str(path)
        loaded.pretrained = True
    elif instance:  # built as the script's import ran, before any seed of hookcli's
        loaded.weights_label = f"none (as {source} built it)"
    else:
        loaded.weights_label = f"none (as constructed, seed {seed})"
    return loaded


def _language_model(model: nn.Module) -> LoadedModel | None:
    """A transformers causal or seq2seq LM built by the user's code keeps its task (next tokens
    out, the next-token loss); its tokenizer is looked for where it was loaded from."""
    if not type(model).__module__.startswith("transformers."):
        return None
    from hookcli.sources.hf import class_head
    from hookcli.sources.lm import lm_task, max_tokens

    head = class_head(model)
    if head not in ("causal-lm", "seq2seq-lm"):
        return None
    config = getattr(model, "config", None)
    where = str(getattr(config, "_name_or_path", "") or "")
    return LoadedModel(
        module=model,
        name=type(model).__name__,
        spec=type(model).__name__,
        kind=lm_task(model, head),
        weights_label="as given",
        pretrained=True,
        input_size=(224, 224),  # unused: a text model's default input is token ids
        tokenizer_from=where if where and Path(where).is_dir() else None,
        max_tokens=max_tokens(config),
    )


def _torchvision_task(model: nn.Module) -> Task:
    """A torchvision detection or segmentation model passed in keeps its task (its outputs
    are boxes or per-pixel scores); any other module is a custom one."""
    package = type(model).__module__
    for part in ("detection", "segmentation"):
        if package.startswith(f"torchvision.models.{part}."):
            return task_named(part)
    return CUSTOM


def wrap_module(model: nn.Module, weights: str) -> LoadedModel:
    if isinstance(model, torch.jit.ScriptModule):
        raise UsageError(
            "TorchScript modules do not run Python hooks (scripted ones refuse them, traced ones "
            "never fire them).",
            "inspect the original nn.Module instead of the scripted/traced one.",
        )
    # No eval() here: the run sets eval for the pass and restores every module's mode after.
    lm = _language_model(model)
    if lm is not None:
        return lm
    return LoadedModel(
        module=model,
        name=type(model).__name__,
        spec=type(model).__name__,
        kind=_torchvision_task(model),
        weights_label="as given",
        pretrained=weights != "none",
        preprocess=None,
        preprocess_label="ImageNet: resize 256, center crop 224, ImageNet mean/std",
        input_size=None,
    )
