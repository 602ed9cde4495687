"""The training-run recorder (`hookcli.watch`) and what reads its output.

recorder.py  `Watch`, the session over optimizer steps: the model's root hooks, the context,
             the ring buffer; it composes the four below
clock.py     the step clock: which optimizer step, whether it is watched, when its gradients
             are complete and when it ends (optimizer step hooks, a GradScaler's update())
capture.py   what a watched step measures (hooks on the selected layers, the parameters'
             gradients and updates, memory) and its log line
nonfinite.py the first NaN/Inf: what every step keeps to run again, the cheap check on every
             step, the hooked re-run and the bundle
sinks.py     where the lines go: the JSONL log, TensorBoard
steptools.py what the recorder reads around a step: a padded batch's mask, the optimizer's
             parameters, the rank and its log's name, a call as a log line carries it
compiled.py  reaching a wrapped or compiled model: its inner module, eager code on watched steps
logfile.py   the log file as the recorder writes it (locked, never hurting the training)
bundle.py    the repro bundle written on the first NaN/Inf, and the hooked re-run of that step
replay.py    `hookcli replay`: a bundle's step run again, hooked
logread.py   reading one log back, validated line by line; its lines as records
runmerge.py  rank logs merged into one run
runseries.py per-layer series over the steps (`hookcli report run.jsonl`)
runrules.py  rules over a run (`hookcli check run.jsonl`)
"""

# A bundle's files (bundle.py writes them; `hookcli replay` protects them from its own outputs
# before importing torch, hence here)
BUNDLE_FILES = ("bundle.json", "state.pt", "batch.pt", "records.jsonl")
PICKLED_MODEL = "model.pt"
