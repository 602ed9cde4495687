"""CPUs that advertise an ISA they cannot run: find out once, then keep oneDNN below it.

Some machines advertise AMX (amx_bf16, amx_tile) and the kernel grants the permission, yet any
bfloat16 matmul or convolution that oneDNN dispatches to AMX dies with SIGILL (docs/traps.md §16).
No `except` sees that. Where the CPU advertises AMX, a tiny probe — bfloat16 and float16 linear
and convolution, autocast included — runs in a child process at oneDNN's default ISA; if it dies
of a signal, again under `ONEDNN_MAX_CPU_ISA` limits from the highest down, and the first that
survives is the answer. It is cached per machine (CPU model and flags, kernel) and torch version,
so the probe's second or two is paid once. The limit must be in the environment before oneDNN
first runs: the CLI's supervisor sets it before it forks the worker; the Python API sets it on
its first run (a process that already ran oneDNN keeps its ISA: set it before importing torch).

A user's own ONEDNN_MAX_CPU_ISA always wins. No torch here (the probe imports it in its child).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform as _host
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

ENV = "ONEDNN_MAX_CPU_ISA"
# oneDNN's ISA names, highest first: each one a limit to try when the one above it dies
LIMITS = (
    "AVX512_CORE_FP16",
    "AVX512_CORE_BF16",
    "AVX512_CORE_VNNI",
    "AVX512_CORE",
    "AVX2",
    "SSE41",
)
PROBE_CODE = """
import torch
import torch.nn.functional as F
x, w, k = torch.randn(4, 64), torch.randn(32, 64), torch.randn(8, 8, 3, 3)
img = torch.randn(2, 8, 16, 16)
for dtype in (torch.bfloat16, torch.float16):
    F.linear(x.to(dtype), w.to(dtype))
    F.conv2d(img.to(dtype), k.to(dtype))
    with torch.autocast("cpu", dtype=dtype):
        F.linear(x, w)
        F.conv2d(img, k)
print("ok")
"""
_CACHE_VERSION = 1
# the deaths that say an ISA does not run here (a kernel's instruction refused, or faulting)
_ISA_FAULTS = frozenset(
    getattr(signal, n) for n in ("SIGILL", "SIGSEGV", "SIGBUS") if hasattr(signal, n)
)


@dataclass(frozen=True, slots=True)
class IsaLimit:
    """The probe's answer: the limit to run under (None: none needed) and why."""

    limit: str | None
    died: str | None = None  # the signal the default ISA died of, e.g. "SIGILL"

    @property
    def note(self) -> str | None:
        if self.died is None:
            return None
        if self.limit is None:
            return (
                f"this CPU advertises AMX, but bfloat16/float16 kernels died with {self.died} "
                "at every oneDNN ISA tried; such layers may crash this run"
            )
        return (
            f"oneDNN limited to {self.limit} ({ENV}): this CPU advertises AMX, but bfloat16 "
            f"kernels died with {self.died} at oneDNN's default ISA"
        )


_decided: IsaLimit | None = None


def cpu_flags() -> set[str]:
    """The CPU flags the kernel reports (Linux; elsewhere none)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return _host.processor()


def _torch_version() -> str:
    from importlib import metadata  # 10 ms: not on `hookcli --help`'s path

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "none"


def cache_path(flags: set[str] | None = None) -> Path:
    """Where the answer for this machine and torch version is kept."""
    base = os.environ.get("HOOKCLI_CACHE_DIR")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "hookcli")
    key = "|".join(
        (
            _cpu_model(),
            " ".join(sorted(cpu_flags() if flags is None else flags)),
            _host.machine(),
            _host.release(),
            _torch_version(),
        )
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(base) / f"onednn-{digest}.json"


def run_probe(limit: str | None, timeout: float = 300.0) -> int:
    """The probe's return code in a child (negative: the signal it died of)."""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if limit is not None:
        env[ENV] = limit
    try:
        done = subprocess.run(
            [sys.executable, "-P", "-c", PROBE_CODE],  # -P: no torch.py of the cwd imported
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return 1
    return done.returncode


def probe(run: Callable[[str | None], int] | None = None) -> IsaLimit | None:
    """Try the default ISA, then each limit down; None when the probe could not tell (it
    failed without a signal — no torch, say — or was stopped by one that says nothing of the
    CPU: Ctrl-C, SIGTERM, the OOM killer) and nothing should be cached."""
    run = run or run_probe
    died = None
    for limit in (None, *LIMITS):
        code = run(limit)
        if code == 0:
            return IsaLimit(limit, died)
        if code > 0 or -code not in _ISA_FAULTS:
            return None
        if died is None:
            died = _signal_name(-code)
    return IsaLimit(None, died)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


_CACHE_MAX = 4096  # the cache file is one short JSON line; anything larger is not one


def _read(path: Path) -> IsaLimit | None:
    """The cached answer, or None for anything else: a missing file, one that is not a regular
    file (a link to /dev/zero would never end), too large, not JSON (however deeply nested),
    or with fields of the wrong kind — the probe then runs again."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
        with open(path, "rb") as f:
            raw = f.read(_CACHE_MAX + 1)
        if len(raw) > _CACHE_MAX:
            return None
        data = json.loads(raw.decode("utf-8"))
        if not isinstance(data, dict) or data.get("version") != _CACHE_VERSION:
            return None
        limit, died = data.get("limit"), data.get("died")
        if (limit is None or limit in LIMITS) and (died is None or died in _SIGNAL_NAMES):
            return IsaLimit(limit, died)
    except (OSError, ValueError, RecursionError):
        pass
    return None


_SIGNAL_NAMES = frozenset(s.name for s in signal.Signals)


def _write(path: Path, answer: IsaLimit) -> None:
    """Best effort: an unwritable cache only means probing again next time."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {"version": _CACHE_VERSION, "limit": answer.limit, "died": answer.died}
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(body) + "\n")
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def decide(
    environ: Mapping[str, str] | None = None,
    *,
    flags: set[str] | None = None,
    run: Callable[[str | None], int] | None = None,
) -> IsaLimit | None:
    """This machine's answer: the user's own setting wins (None), then the cache, then — only
    where the CPU advertises AMX — the probe (cached)."""
    env = os.environ if environ is None else environ
    if env.get(ENV) or env.get("HOOKCLI_NO_PROBE"):
        return None
    flags = cpu_flags() if flags is None else flags
    if not any(f.startswith("amx") for f in flags):
        return None  # no AMX: nothing to probe, and no cached answer can claim otherwise
    path = cache_path(flags)
    cached = _read(path)
    if cached is not None:
        return cached
    answer = probe(run)
    if answer is not None:
        _write(path, answer)
    return answer


def ensure(environ: MutableMapping[str, str] | None = None) -> IsaLimit | None:
    """Decide once per process and put the limit in the environment (before oneDNN runs)."""
    global _decided  # noqa: PLW0603 — one answer per process, like the environment it sets
    if _decided is not None:
        return _decided
    env = os.environ if environ is None else environ
    answer = decide(env)
    if answer is not None and answer.limit is not None:
        env[ENV] = answer.limit
    _decided = answer if answer is not None else IsaLimit(None)
    return _decided


def notes() -> list[str]:
    """What a report says about the platform (empty when nothing was changed)."""
    note = _decided.note if _decided is not None else None
    return [note] if note else []
