"""Run `hookcli inspect` on every torchvision registry model; write docs/models.md.

Each model runs in its own subprocess (random weights, the default input of the right shape,
CPU, statistics of every leaf call) so that its peak memory is its own. The table lists status,
seconds (the whole run: build, forward, statistics) and peak memory; a failure shows its
one-line hookcli message. Nothing may fail without a specific message.

Usage: python benchmarks/sweep_models.py [--only GLOB] [--out docs/models.md] [--timeout S]
"""

from __future__ import annotations

import argparse
import fnmatch
import platform
import sys
import time
from pathlib import Path

from _common import run_child

CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
import hookcli
from hookcli.errors import HookcliError
from hookcli.sources.torchvision import task_of
name = sys.argv[1]
out = {"name": name, "task": task_of(name)}
try:
    r = hookcli.inspect(name, device="cpu", topk=1)
    out.update(status="ok", calls=len(r.layers), never=len(r.never_called),
               input=", ".join("x".join(map(str, s)) for s in r.input.shapes),
               nonfinite=sum(t.nonfinite for c in r.layers for t in c.outputs))
except HookcliError as exc:
    out.update(status=f"exit {exc.exit_code}", message=str(exc))
out["seconds"] = time.perf_counter() - t0
out["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""


def table(rows: list[dict[str, object]], took: float) -> str:
    import torch
    import torchvision

    ok = sum(r["status"] == "ok" for r in rows)
    head = [
        "# Every torchvision registry model under `hookcli inspect`",
        "",
        f"Made by `python benchmarks/sweep_models.py`: {ok} of {len(rows)} models ran. "
        f"torch {torch.__version__}, torchvision {torchvision.__version__}, "
        f"{platform.machine()} CPU, 2 threads; random weights, the default input of the shape each "
        f"model expects, statistics of every leaf call. Seconds: the whole run in a fresh process "
        f"(import, build, forward, statistics); peak: the process's peak resident memory. "
        f"Sweep time {took / 60:.0f} min.",
        "",
        "timm and Hugging Face models: [models_timm_hf.md](models_timm_hf.md).",
        "",
        "| model | task | status | input | layer calls | never called | seconds | peak MiB |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        status = (
            str(r["status"]) if r["status"] == "ok" else f"{r['status']}: {r.get('message', '')}"
        )
        head.append(
            f"| {r['name']} | {r.get('task', '')} | {status.replace('|', '/')} "
            f"| {r.get('input', '')} "
            f"| {r.get('calls', '')} | {r.get('never', '')} | {float(str(r['seconds'])):.1f} "
            f"| {float(str(r.get('peak_mib') or 0)):.0f} |"
        )
    return "\n".join(head) + "\n"


def _refresh(old: str, new: str) -> str:
    """The old table with the rows of the models in `new` replaced, and its count updated."""
    fresh = {
        line.split("|")[1].strip(): line
        for line in new.splitlines()
        if line.startswith("| ") and not line.startswith("| model")
    }
    lines = [
        fresh.get(line.split("|")[1].strip(), line) if line.startswith("| ") else line
        for line in old.splitlines()
    ]
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| model")]
    ok = sum(" | ok | " in line for line in rows)
    import re

    lines = [
        re.sub(r"\d+ of \d+ models ran", f"{ok} of {len(rows)} models ran", line) for line in lines
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="*", help="glob on model names")
    parser.add_argument(
        "--out", default=str(Path(__file__).resolve().parent.parent / "docs" / "models.md")
    )
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    import torchvision

    names = [n for n in torchvision.models.list_models() if fnmatch.fnmatchcase(n, args.only)]
    rows = []
    t0 = time.perf_counter()
    for i, name in enumerate(names, 1):
        row = run_child(CHILD, [name], name, args.timeout)
        rows.append(row)
        seconds = float(str(row["seconds"]))
        print(f"[{i}/{len(names)}] {name}: {row['status']} {seconds:.1f} s", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = table(rows, time.perf_counter() - t0)
    if args.only != "*" and out.exists():  # refresh those rows in the existing table
        text = _refresh(out.read_text(), text)
    out.write_text(text)
    print(f"wrote {out}")
    if any(str(r["status"]).startswith(("crashed", "timeout")) for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
