#!/usr/bin/env bash
# A CI step that gates a model on hookcli's checks. Run it from any CI system:
#
#   examples/ci/check.sh                     # resnet18, random weights, seed 0
#   MODEL=path/to/model.py:Net INPUT=randn:8x3x64x64 examples/ci/check.sh
#
# The first run records a baseline (commit it); later runs fail the build (exit 1) when the
# forward or backward pass makes NaN/Inf, a ReLU layer dies, gradients vanish or explode, or
# any layer's statistics drift from the baseline. Exit 2/3 mean hookcli could not run.
set -u

here=$(cd "$(dirname "$0")" && pwd)
model=${MODEL:-resnet18}
input=${INPUT:-randn:2x3x64x64}
seed=${SEED:-0}
baseline=${BASELINE:-$here/baseline.json}
hookcli=${HOOKCLI:-hookcli}

if [ ! -f "$baseline" ]; then
  echo "no baseline yet: recording $baseline"
  $hookcli inspect "$model" --input "$input" --seed "$seed" --no-config --format json \
    --output "$baseline" || exit $?
fi

$hookcli check "$model" --input "$input" --seed "$seed" --no-config \
  --fail-on nonfinite --fail-on dead --grad-norm 1e-12:1e6 \
  --baseline "$baseline" --rtol 1e-3 --atol 1e-6 \
  --quiet
status=$?

case $status in
  0) echo "hookcli: model checks passed" ;;
  1) echo "hookcli: model checks FAILED (see above)" >&2 ;;
  *) echo "hookcli: could not run the checks (exit $status)" >&2 ;;
esac
exit $status
