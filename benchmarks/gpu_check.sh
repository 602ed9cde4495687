#!/usr/bin/env bash
# hookcli's GPU path, checked in one go on a lent GPU machine (issue 33), within a budget of
# GPU_CHECK_BUDGET seconds (default 520; each step's own limit is cut to what is left), it
#   1. installs hookcli and what the machine lacks from .gpu_wheels/ (benchmarks/gpu_wheels.sh
#      prepares them where PyPI is; never from the network),
#   2. runs every CUDA test (tests/engine/test_gpu.py),
#   3. runs benchmarks/gpu_figures.py: the sync-debug check over hooked passes of resnet50, a
#      ViT and a tiny Llama, and inspect/grads/diff/torchinfo ÷ plain passes by CUDA events,
#      float32 and bfloat16,
#   4. beside 2, in the background (neither times the GPU), runs benchmarks/memory.py --device
#      cuda: --memory's predicted step peak of resnet50, vit_b_16 and GPT-2 small against
#      torch.cuda.max_memory_allocated (goal: within 5%),
#   5. runs benchmarks/gpu_figures.py --llm: a Qwen2.5-0.5B-shaped model's 2,048-token prefill
#      and a --generate step, every block hooked, ÷ the plain ones (issue 52 item 5), and a
#      profile of one prefill's host time ($OUT/llm_profile.txt),
#   6. runs benchmarks/host_cost.py alone, the model on the CPU and then on the GPU: the host's
#      cost per hooked call (issue 52 item 1) where a GPU's host is, beside torchinfo's in the
#      same rounds (and a profile of the GPU's, $OUT/host_profile.txt),
# and writes everything to $OUT/gpu_check.txt (the device tool brings $OUT back), each step's
# seconds beside its heading, each figure as soon as it is measured. GPU_CHECK_STEPS (default
# "tests figures llm memory host") names the steps to run; GPU_CHECK_TESTS narrows the tests
# (a pytest -k expression) for a rerun.
# On a machine without CUDA it says so and exits 0.
#
#   run(command="bash benchmarks/gpu_check.sh", carry=[".gpu_wheels"], timeout_s=540)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
report="$OUT/gpu_check.txt"
PY=${PYTHON:-python3}
budget=${GPU_CHECK_BUDGET:-520}
steps=" ${GPU_CHECK_STEPS:-tests figures llm memory host} "
t0=$SECONDS
status=0
# limit WANT: WANT seconds, or what is left of the budget if less (0 when nothing is)
limit() { local left=$((budget - (SECONDS - t0))); echo $((left < $1 ? (left > 0 ? left : 0) : $1)); }
wanted() { [[ $steps == *" $1 "* ]]; }
# step NAME WANT FILE CMD...: runs CMD under its limit into FILE, the seconds beside the heading
step() {
  local name=$1 want=$2 file=$3; shift 3
  local lim; lim=$(limit "$want")
  if [ "$lim" -lt 10 ]; then
    echo "## $name: skipped, the budget of ${budget} s is spent" > "$file"
    return 1
  fi
  local s=$SECONDS
  timeout "$lim" "$@" > "$file.body" 2>&1
  local rc=$?
  { echo "## $name ($((SECONDS - s)) s, rc $rc$([ $rc -eq 124 ] && echo ", stopped at its ${lim} s limit"))"
    cat "$file.body"; } > "$file"
  rm -f "$file.body"
  return $rc
}
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False): nothing to check" \
    | tee "$report"
  exit 0
fi
{
  echo "# gpu_check $(date -u +%FT%TZ), steps:$steps budget ${budget} s"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
  "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__)"
  "$PY" -c "import triton; print('triton', triton.__version__)" 2>&1 || true
} > "$report"
if [ -d .gpu_wheels ]; then
  "$PY" -m pip install --quiet --no-index --find-links .gpu_wheels .gpu_wheels/hookcli-*.whl \
    greenlet torchinfo pytest >> "$report" 2>&1 || { echo "install failed" >> "$report"; status=1; }
else
  echo "no .gpu_wheels/: run benchmarks/gpu_wheels.sh first and carry it" >> "$report"
  status=1
fi
parts=()
# the memory figures time no GPU work: they run beside the tests
if wanted memory; then
  parts+=("$OUT/.memory.txt")
  step "memory (issue 39): a training step's predicted peak against max_memory_allocated" 240 \
    "$OUT/.memory.txt" "$PY" benchmarks/memory.py --device cuda --batch 8 --skip-offload &
fi
if wanted tests; then
  step "CUDA tests" 300 "$OUT/.tests.txt" "$PY" -m pytest -q -p no:cacheprovider -m cuda \
    --tb=short -rfE ${GPU_CHECK_TESTS:+-k "$GPU_CHECK_TESTS"} tests/engine/test_gpu.py || status=1
  cat "$OUT/.tests.txt" >> "$report"
fi
wait  # (each part's heading says its rc: read below)
for part in "${parts[@]}"; do grep -q "rc 0)" "$part" || status=1; cat "$part" >> "$report"; done
rm -f "${parts[@]}" "$OUT/.tests.txt"
# the timed steps run alone on the machine, streaming their lines into the report
if wanted figures; then
  step "figures" 240 "$OUT/.figures.txt" "$PY" -u benchmarks/gpu_figures.py --rounds 5 \
    --profile-out "$OUT/gpu_profile.txt" || status=1
  cat "$OUT/.figures.txt" >> "$report"
fi
if wanted llm; then
  step "language model: prefill and a --generate step (issue 52 item 5)" 180 "$OUT/.llm.txt" \
    "$PY" -u benchmarks/gpu_figures.py --llm --rounds 5 --profile-out "$OUT/llm_profile.txt" \
    || status=1
  cat "$OUT/.llm.txt" >> "$report"
fi
if wanted host; then  # (alone: a busy CPU would slow one side of its ratio more than the other)
  step "host cost per hooked call (issue 52 item 1), this machine's CPU" 90 "$OUT/.host.txt" \
    "$PY" benchmarks/host_cost.py --rounds 5 --device cpu || status=1
  cat "$OUT/.host.txt" >> "$report"
  step "host cost per hooked call, the model on the GPU" 90 "$OUT/.host.txt" \
    "$PY" benchmarks/host_cost.py --rounds 5 --device cuda --profile-out "$OUT/host_profile.txt" \
    || status=1
  cat "$OUT/.host.txt" >> "$report"
fi
rm -f "$OUT"/.*.txt
echo "# done in $((SECONDS - t0)) s, status $status" >> "$report"
cat "$report"
exit $status
