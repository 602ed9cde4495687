#!/usr/bin/env bash
# Prepares what benchmarks/gpu_check.sh installs on a lent GPU machine, which reaches no package
# registry: hookcli's own wheel and the few packages that machine lacks (its Python 3.12 has
# torch, torchvision, transformers, timm, numba, typer, rich), as wheels in .gpu_wheels/
# (ignored by git; carried with `run`'s carry=[".gpu_wheels"]). Run it here, where PyPI is.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu_wheels && mkdir -p .gpu_wheels
python3 -m pip wheel --quiet --no-deps --wheel-dir .gpu_wheels .
python3 -m pip download --quiet --no-deps --dest .gpu_wheels --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  greenlet torchinfo pytest pluggy iniconfig
du -sh .gpu_wheels
ls .gpu_wheels
