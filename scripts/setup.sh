#!/usr/bin/env bash
# Create .venv (if absent) and install cute_fp4 with its test, inspect, plot and hf extras.
# torch: an existing torch >= 2.9 is kept. Without one, torch 2.13.0 is installed on its
# own first (set CUTE_FP4_TORCH to another pip requirement, e.g. a CPU index option), so
# that resolving the package never pulls a multi-GB CUDA build by accident. The CuTe DSL:
# 4.8.1 (CUTE_FP4_DSL picks another release of the supported range, 4.8.0 or 4.8.1).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
if ! "$VPY" -c "import torch" 2>/dev/null; then
  "$VPY" -m pip install -q ${CUTE_FP4_TORCH:-torch==2.13.0}
fi
"$VPY" -m pip install -q -e ".[test,inspect,plot,hf]" \
  "nvidia-cutlass-dsl[cu13]==${CUTE_FP4_DSL:-4.8.1}"
"$VPY" -c "import torch, cutlass; print('setup ok: torch', torch.__version__)"
