#!/usr/bin/env bash
# hookcli's GPU path, checked in one go on a lent GPU machine (issue 33): under 8 minutes, it
#   1. installs hookcli and what the machine lacks from .gpu_wheels/ (benchmarks/gpu_wheels.sh
#      prepares them where PyPI is; never from the network),
#   2. runs every CUDA test (tests/engine/test_gpu.py),
#   3. runs benchmarks/gpu_figures.py: the sync-debug check over hooked passes of resnet50, a
#      ViT and a tiny Llama, and inspect/grads/diff/torchinfo ÷ plain passes by CUDA events,
#      float32 and bfloat16,
#   4. runs benchmarks/memory.py --device cuda: --memory's predicted step peak of resnet50,
#      vit_b_16 and GPT-2 small against torch.cuda.max_memory_allocated (goal: within 5%),
#   5. runs benchmarks/host_cost.py on the machine's CPU: the host's cost per hooked call
#      (issue 52 item 1) where a GPU's host is, beside torchinfo's in the same rounds,
#   6. runs benchmarks/gpu_figures.py --llm: a Qwen2.5-0.5B-shaped model's 2,048-token prefill
#      and a --generate step, every block hooked, ÷ the plain ones (issue 52 item 5; last, so
#      that a call that runs out of time loses this step and no other),
# and writes everything to $OUT/gpu_check.txt (the device tool brings $OUT back).
# On a machine without CUDA it says so and exits 0.
#
#   run(command="bash benchmarks/gpu_check.sh", carry=[".gpu_wheels"], timeout_s=540)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
report="$OUT/gpu_check.txt"
PY=${PYTHON:-python3}
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False): nothing to check" \
    | tee "$report"
  exit 0
fi
{
  echo "# gpu_check $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
  "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__)"
} > "$report"
status=0
if [ -d .gpu_wheels ]; then
  "$PY" -m pip install --quiet --no-index --find-links .gpu_wheels .gpu_wheels/hookcli-*.whl \
    greenlet torchinfo pytest >> "$report" 2>&1 || { echo "install failed" >> "$report"; status=1; }
else
  echo "no .gpu_wheels/: run benchmarks/gpu_wheels.sh first and carry it" >> "$report"
  status=1
fi
echo "## CUDA tests" >> "$report"
timeout 300 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/engine/test_gpu.py >> "$report" 2>&1 \
  || status=1
echo "## figures" >> "$report"
timeout 240 "$PY" benchmarks/gpu_figures.py --rounds 7 --profile-out "$OUT/gpu_profile.txt" \
  >> "$report" 2>&1 || status=1
echo "## memory (issue 39): a training step's predicted peak against max_memory_allocated" \
  >> "$report"
timeout 240 "$PY" benchmarks/memory.py --device cuda --batch 8 --skip-offload >> "$report" 2>&1 \
  || status=1
echo "## host cost per hooked call (issue 52 item 1), this machine's CPU" >> "$report"
timeout 90 "$PY" benchmarks/host_cost.py --rounds 5 >> "$report" 2>&1 || status=1
echo "## language model: prefill and a --generate step (issue 52 item 5)" >> "$report"
timeout 150 "$PY" benchmarks/gpu_figures.py --llm --rounds 5 >> "$report" 2>&1 || status=1
cat "$report"
exit $status
