"""`hookcli calib` memory over many sequences: peak RSS of a calib run over N lines of text
(a tiny random Llama saved here, passes of 64 sequences), each N in a fresh subprocess; flat
memory means the per-channel numbers merge as the passes go, nothing kept per sequence.

Usage: python benchmarks/calib_memory.py [--lines 1000 10000]
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json, resource, sys, time
from hookcli.commands.calib import calib_report
from hookcli.options import CalibOptions, InputOptions, ModelOptions, Selection
t0 = time.perf_counter()
r = calib_report(ModelOptions("hf:" + sys.argv[1], device="cpu"), Selection(),
                 InputOptions(text_file=sys.argv[2]), CalibOptions(batch_size=64))
print(json.dumps({"rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "seconds": time.perf_counter() - t0, "input": r.input.description}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, nargs="+", default=[1000, 10000])
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    tiny = importlib.import_module("tests.support.llm")  # the tests' tiny Llama and its lines
    LINES, save = tiny.LINES, tiny.save

    with tempfile.TemporaryDirectory() as tmp:
        folder = save(Path(tmp) / "llama", "llama")
        for n in args.lines:
            text = Path(tmp) / f"lines{n}.txt"
            text.write_text("\n".join(LINES[i % len(LINES)] + f" {i}" for i in range(n)) + "\n")
            out = subprocess.run(
                [sys.executable, "-c", CHILD, str(folder), str(text)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            got = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{n:>6} lines: peak RSS {got['rss_mb']:7.1f} MB, {got['seconds']:6.1f} s "
                  f"({got['input']})")  # fmt: skip


if __name__ == "__main__":
    main()
