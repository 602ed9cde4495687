"""Project config: `hookcli.toml`, or `[tool.hookcli]` in `pyproject.toml`, in the working
directory or a parent. Keys are the long option names (`model`, `input`, `weights`, `layer`,
`target`, `loss`, …); a table named after a command (`[grads]`, `[tool.hookcli.grads]`)
overrides for that command. Command-line flags override the file. Relative paths in the file
are relative to the file's folder, so `hookcli grads` works from anywhere in the project.

A config file found by walking up (not one named with --config) must belong to the current user
or root, as git's safe.directory asks of a repository: a file another user can plant in a
shared parent folder could otherwise choose the files a run writes.
"""

from __future__ import annotations

import difflib
import os
import re
import stat
import tomllib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hookcli.errors import UsageError
from hookcli.io.output import note_read

# the commands that read the config (--config): each may have a table of its own
COMMANDS = ("inspect", "grads", "check", "diff", "maps", "cam", "attn", "lens", "calib", "layers")


@dataclass(frozen=True, slots=True)
class Key:
    """What a config key feeds: the command parameter's name, the kind of value it takes, and
    for a choice the values allowed. The CLI derives the keys from its own options (one key
    per long option name), so an option needs no second declaration here."""

    param: str
    kind: str  # str, path (a file, relative to the config's folder), int, float, bool, list
    choices: tuple[str, ...] = ()


_SPEC = re.compile(r"^(randn|rand|ones|zeros|randint):")
_KEYWORD = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.+)$")  # input_ids=randint:… (a keyword)
_TENSOR_FILE = (".pt", ".pth", ".npy")


@dataclass(slots=True)
class Config:
    path: Path
    values: dict[str, Any] = field(default_factory=dict)  # parameter name → value
    text: str = ""  # the file as read (a pipe can be read only once)
    paths: list[str] = field(default_factory=list)  # parameters naming files to write or read

    @property
    def folder(self) -> Path:
        """What relative paths in the file are relative to: its folder; for a pipe
        (`--config <(…)`), the working directory."""
        try:
            regular = stat.S_ISREG(self.path.stat().st_mode)
        except OSError:
            regular = False
        return self.path.parent if regular else Path.cwd()


def _owner(path: Path) -> int:
    return path.stat().st_uid


def _trusted(path: Path) -> None:
    """A found config must be the user's own (or root's): refuse another user's file."""
    getuid = getattr(os, "getuid", None)
    if getuid is None:  # no owners to compare (Windows)
        return
    owner = _owner(path)
    if owner not in (0, getuid()):
        raise UsageError(
            f"config {path} belongs to another user (uid {owner}); hookcli does not apply a "
            "config it found that it cannot trust (it can name files to overwrite).",
            f"pass --config {path} if you trust it, or --no-config to ignore it.",
        )


def _parse(path: Path) -> tuple[dict[str, Any], str]:
    """The TOML of a config file, and its text; one-line errors naming the file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise UsageError(
            f"cannot read config {path}: {exc.strerror}.", "check the --config path."
        ) from exc
    note_read(path)
    try:
        text = data.decode("utf-8")  # TOML is UTF-8, whatever the locale
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"config {path} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
            f"{exc.start}).",
            "save it as UTF-8 (TOML files must be).",
        ) from exc
    try:
        return tomllib.loads(text), text
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"config {path}: {exc}.", "fix the TOML syntax there.") from exc


def _has_table(path: Path) -> bool:
    """pyproject.toml configures hookcli only with a real [tool.hookcli] table (a comment
    mentioning one is not); an unparsable file counts when it names the table, so its error
    is shown rather than the file silently skipped."""
    try:
        data, _ = _parse(path)
    except UsageError:
        try:
            return b"[tool.hookcli" in path.read_bytes()
        except OSError:
            return False
    tool = data.get("tool")
    return isinstance(tool, dict) and isinstance(tool.get("hookcli"), dict)


def find(start: Path) -> Path | None:
    """The nearest hookcli.toml, or pyproject.toml with [tool.hookcli], from start upwards
    (refused when another user owns it)."""
    for folder in (start, *start.parents):
        own = folder / "hookcli.toml"
        if own.is_file():
            _trusted(own)
            return own
        pyproject = folder / "pyproject.toml"
        if pyproject.is_file() and _has_table(pyproject):
            _trusted(pyproject)
            return pyproject
    return None


def _read(path: Path) -> tuple[dict[str, Any], str]:
    data, text = _parse(path)
    if path.name == "pyproject.toml":
        table = data.get("tool", {}).get("hookcli")
        if not isinstance(table, dict):
            raise UsageError(
                f"{path} has no [tool.hookcli] table.", "add one, or pass --no-config."
            )
        return table, text
    return data, text


def _line_of(path: Path, key: str, text: str | None = None) -> str:
    """`path:line` of a key, for messages (TOML parsers do not keep positions)."""
    pattern = re.compile(rf"^\s*[\"']?{re.escape(key)}[\"']?\s*=")
    if text is None:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return str(path)
    for n, line in enumerate(text.splitlines(), 1):
        if pattern.match(line):
            return f"{path}:{n}"
    return str(path)


def load(path: Path, command: str, keys: Mapping[str, Key], given: Collection[str] = ()) -> Config:
    """The values of a config file for one command, checked and with paths resolved; `keys`
    are every command's (a key at the top level may be meant for another command); `given`
    are the parameters the command line sets, whose values here are neither checked nor
    kept (the flag wins)."""
    table, text = _read(path)
    merged: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            if key not in COMMANDS:
                raise UsageError(
                    f"{_line_of(path, key, text)}: unknown table [{key}].",
                    f"command tables are {', '.join(COMMANDS)}.",
                )
            continue
        merged[key] = value
    section = table.get(command)
    if isinstance(section, dict):
        merged.update(section)
    config = Config(path, text=text)
    for key, value in merged.items():
        norm = key.replace("_", "-")
        if norm not in keys:
            close = difflib.get_close_matches(norm, list(keys), n=2)
            near = f" Did you mean {' or '.join(close)}?" if close else ""
            raise UsageError(
                f"{_line_of(path, key, text)}: unknown key {key!r}.{near}",
                f"keys are the long option names: {', '.join(keys)}.",
            )
        spec = keys[norm]
        if spec.param in given:
            continue
        config.values[spec.param] = _check(path, key, value, spec, text)
        if spec.kind == "path":
            config.paths.append(spec.param)
    _resolve_paths(config)
    return config


def _check(path: Path, key: str, value: Any, spec: Key, text: str) -> Any:
    kind = spec.kind
    ok = {
        "str": isinstance(value, str),
        "path": isinstance(value, str),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, int | float) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "list": isinstance(value, str)
        or (isinstance(value, list) and all(isinstance(v, str) for v in value)),
    }[kind]
    if not ok:
        want = {
            "str": "a string",
            "path": "a path (a string)",
            "int": "an integer",
            "float": "a number",
            "bool": "true or false",
            "list": "a string or a list of strings",
        }[kind]
        raise UsageError(
            f"{_line_of(path, key, text)}: {key} must be {want}, not {value!r}.",
            "fix the value in the config file.",
        )
    if spec.choices and value not in spec.choices:
        raise UsageError(
            f"{_line_of(path, key, text)}: {key} {value!r} is not one of "
            f"{', '.join(spec.choices)}.",
            f"fix the {key} key.",
        )
    if kind == "float":
        return float(value)
    return [value] if kind == "list" and isinstance(value, str) else value


def _relative(folder: Path, raw: str) -> str:
    p = Path(os.path.expanduser(raw))  # ~nouser stays as written: its reader reports it
    return raw if p.is_absolute() else str(folder / p)


def _resolve_paths(config: Config) -> None:
    v, folder = config.values, config.folder
    model = v.get("model")
    if isinstance(model, str) and ":" in model:
        source, _, name = model.rpartition(":")
        if source.endswith(".py"):
            v["model"] = f"{_relative(folder, source)}:{name}"
    if "input_spec" in v:  # `input`: images and tensor specs alike
        images, specs = [], []
        for item in v.pop("input_spec"):
            keyword = _KEYWORD.match(item)
            name, rest = (f"{keyword.group(1)}=", keyword.group(2)) if keyword else ("", item)
            if _SPEC.match(rest):
                specs.append(item)
            elif rest.lower().endswith(_TENSOR_FILE):
                specs.append(name + _relative(folder, rest))
            elif keyword and not (folder / item).exists():
                specs.append(item)  # NAME=… that is no file: the spec parser says what is wrong
            else:
                images.append(_relative(folder, item))
        if images:
            v["inputs"] = images
        if specs:
            v["input_spec"] = specs
    weights = v.get("weights")
    if isinstance(weights, str) and weights.lower() != "none" and weights.upper() != "DEFAULT":
        candidate = folder / weights
        if Path(weights).suffix or candidate.exists():
            v["weights"] = _relative(folder, weights)
    loss = v.get("loss")
    if isinstance(loss, str) and ":" in loss:
        kind, _, arg = loss.partition(":")
        if arg.lower().endswith(_TENSOR_FILE):
            v["loss"] = f"{kind}:{_relative(folder, arg)}"
    for key in config.paths:
        if isinstance(v.get(key), str):
            v[key] = Path(_relative(folder, v[key]))
