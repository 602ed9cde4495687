"""The Typer app and the console script. Commands register on `app` from the modules of this
package (hookcli.cli imports them all); `main` runs them in a supervised worker."""

from __future__ import annotations

import contextlib
import inspect as _inspect
import os
import sys
from collections.abc import Callable, Iterator, MutableMapping
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup

from hookcli._version import __version__
from hookcli.cli import calib, diff, inspect, lens, listing, pictures, replay, runlog
from hookcli.cli.console import err
from hookcli.cli.params import build, register, registered
from hookcli.errors import HookcliError

# click's usage error (typer's BadParameter derives from it; typer may vendor click)
_USAGE_ERROR: type[Exception] = next(
    c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError"
)


def _one_line(exc: Exception) -> None:
    """A usage error (unknown option, missing argument, bad value) shown as every other hookcli
    error: one line on stderr with a next step, not click's usage block (issue 32)."""
    if type(exc).__name__ == "NoArgsIsHelpError":
        return  # `hookcli` alone: the help, as click shows it
    ctx = getattr(exc, "ctx", None)
    where = getattr(ctx, "command_path", None) or "hookcli"

    def show(file: object = None) -> None:
        text = str(exc.format_message()).rstrip(".")  # type: ignore[attr-defined]
        err(f"error: {text}. Hint: `{where} -h` shows the usage, with an example.")

    exc.show = show  # type: ignore[attr-defined]


class Commands(MutableMapping[str, Any]):
    """The app's commands by name, each built only when it is looked up: Typer reads a command's
    whole signature to build it (~6 ms each here), and a run uses one command, so `hookcli
    inspect` builds one and `hookcli --help` none (it lists `stand_ins`)."""

    def __init__(self, functions: dict[str, tuple[Callable[..., None], bool]]) -> None:
        self._functions = functions
        self._built: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._built:
            function, config = self._functions[name]
            self._built[name] = build(function, config)
        return self._built[name]

    def __setitem__(self, name: str, command: Any) -> None:
        self._built[name] = command
        self._functions.setdefault(name, (command.callback, False))

    def __delitem__(self, name: str) -> None:
        del self._functions[name]
        self._built.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._functions)

    def __len__(self) -> int:
        return len(self._functions)

    def stand_ins(self) -> dict[str, Any]:
        """Every command as the command list of --help needs it (name, help, hidden): the
        built command where there is one, else one without parameters."""
        return {
            name: self._built.get(name)
            or TyperCommand(name=name, help=_inspect.getdoc(function), rich_markup_mode=None)
            for name, (function, _) in self._functions.items()
        }


class _OneLineGroup(TyperGroup):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.commands = Commands(registered())

    def list_commands(self, ctx: Any) -> list[str]:
        return list(self.commands)  # names only: Typer's own reads (builds) every command

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        lazy = self.commands
        if isinstance(lazy, Commands):
            self.commands = lazy.stand_ins()
        try:
            super().format_commands(ctx, formatter)
        finally:
            self.commands = lazy

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().make_context(*args, **kwargs)
        except _USAGE_ERROR as exc:
            _one_line(exc)
            raise

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except _USAGE_ERROR as exc:
            _one_line(exc)
            raise


app = typer.Typer(
    cls=_OneLineGroup,
    name="hookcli",
    help="Hook any torchvision or custom PyTorch model and see what every layer does.",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"hookcli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Show the version and exit."
        ),
    ] = False,
) -> None:
    """Hook any torchvision or custom PyTorch model and see what every layer does.

    Example: hookcli inspect resnet34 sample_images/cat.jpeg
    """
    from hookcli.cli.console import config_values
    from hookcli.io import output

    output.begin()  # a new command: no file read, no output claimed yet
    config_values(None, {})  # nor a config's values (params.configured sets them)


# The commands, in the order --help lists them; those that read the project config take it
# through params.ConfigCommand.
register(listing.models, config=False)
register(listing.layers, config=True)
register(inspect.inspect, config=True)
register(inspect.grads, config=True)
register(inspect.check, config=True)
register(diff.diff, config=True)
register(listing.show, config=False)
register(pictures.maps, config=True)
register(pictures.cam, config=True)
register(pictures.attn, config=True)
register(lens.lens, config=True)
register(calib.calib, config=True)
register(replay.replay, config=False)
register(runlog.report, config=False)


def _quiet_libraries() -> None:
    """The libraries' chatter kept off the command line's stderr, which carries hookcli's own
    lines: deprecation notices (torch's _pytree when torchao is installed) and transformers'
    log (a tokenizer's "sequence length is longer than…": hookcli checks lengths itself).
    A user's -W/PYTHONWARNINGS or TRANSFORMERS_VERBOSITY wins; the Python API changes
    nothing (a program keeps its own warnings)."""
    import warnings

    if not sys.warnoptions:
        for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
            warnings.filterwarnings("ignore", category=category)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def main() -> None:
    """The console script: safe standard streams, then the command in a supervised worker
    (hookcli.runtime.supervise: a native crash becomes exit 3 naming the layer)."""
    from hookcli.runtime import beacon, gcpause, stdio
    from hookcli.runtime.supervise import supervise

    stdio.guard()
    _quiet_libraries()
    if "" not in sys.path and os.getcwd() not in sys.path:
        # docs/usage.md: the current directory is importable (pkg.mod:Name), as with `python -m`;
        # last, so a local torch.py cannot shadow the installed one
        sys.path.append(os.getcwd())
    code = supervise(sys.argv[1:])
    if code is None:  # the worker, or a light command run in-process
        if _is_entry_point():  # hookcli's own process: a program calling main() keeps its gc
            gcpause.pause()  # back on once the model is built (sources.load_model)
        held = _Held()
        try:
            app()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except HookcliError as exc:  # stdout failing outside a command (help to a closed stdout)
            err(f"error: {exc}")
            code = exc.exit_code
        finally:
            gcpause.end()
        held.end(shown=code != 2)  # (bad input: its one line says it all)
        code = stdio.finish(code)
        beacon.finish(code)  # a library dying at interpreter exit now cannot fail the run
        if "torch" in sys.modules and _is_entry_point():
            _quick_exit(code)
    sys.exit(code)


class _Held:
    """The libraries' warnings of a command, held until it ends: shown after its output, or
    after the error line of a model that failed (exit 3: they may say why), left out after
    bad input (exit 2), whose stderr is its one `error: … Hint: …` line (a torch warning on
    a bad file says nothing the error does not)."""

    def __init__(self) -> None:
        import warnings

        self.lines: list[str] = []
        self._shown = warnings.showwarning
        self._active = not sys.warnoptions  # (a user's -W/PYTHONWARNINGS: theirs, as it is)
        if self._active:
            warnings.showwarning = self._hold  # type: ignore[assignment]

    def _hold(self, message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        import warnings

        self.lines.append(warnings.formatwarning(message, category, filename, lineno))

    def end(self, *, shown: bool) -> None:
        import warnings

        if not self._active:
            return
        warnings.showwarning = self._shown
        if shown and self.lines:
            sys.stderr.write("".join(self.lines))
            sys.stderr.flush()


def _is_entry_point() -> bool:
    """Whether this process is hookcli's own (`hookcli …`, `python -m hookcli …`), not a
    program that called main() itself, and runs no other Python thread that a normal exit
    would wait for."""
    import threading

    main_module = sys.modules.get("__main__")
    spec = getattr(main_module, "__spec__", None)
    script = os.path.basename(getattr(main_module, "__file__", None) or "")
    ours = (spec is not None and spec.name == "hookcli.__main__") or script in (
        "hookcli",
        "hookcli.exe",
        "hookcli-script.py",
    )
    return ours and threading.active_count() == 1


def _quick_exit(code: int) -> None:
    """End a process that imported torch without the interpreter's teardown: freeing every
    object and module of torch, torchvision and dynamo one by one takes ~0.7 s, as long as the
    main job's forward pass, and nothing is left to write. What must run at exit still runs:
    the atexit handlers (logging, multiprocessing's children, temporary files), then a flush of
    both streams. Only hookcli's own process gets here (_is_entry_point), with no other Python
    thread alive; every file hookcli writes is closed before this."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
