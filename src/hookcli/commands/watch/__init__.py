"""The training-run recorder (`hookcli.watch`) and what reads its output.

recorder.py  the session over optimizer steps: hooks on watched steps, the JSONL log, the
             ring buffer and the cheap non-finite check on every step
bundle.py    the repro bundle written on the first NaN/Inf, and the hooked re-run of that step
runlog.py    reading logs back: rank logs merged, rules over a run (`hookcli check run.jsonl`),
             per-layer series (`hookcli report run.jsonl`)
"""

# A bundle's files (bundle.py writes them; `hookcli replay` protects them from its own outputs
# before importing torch, hence here)
BUNDLE_FILES = ("bundle.json", "state.pt", "batch.pt", "records.jsonl")
PICKLED_MODEL = "model.pt"
