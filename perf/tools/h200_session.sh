#!/usr/bin/env bash
# The lent H200's whole session in one call (see perf/README.md). Writes $OUT/*.json and
# $OUT/log.txt (pytest's GPU tests and the CLI's validate/bench/tune output).
# SECTIONS=validate,fuzz (say) runs only those sections of perf/gpu_session.py.
set -u
cd "$(dirname "$0")/../.."
source .gpu/activate.sh >/dev/null
export PYTHONPATH=$PWD:$PYTHONPATH CUTE_FP4_CACHE_DIR=/tmp/cute_fp4_cache CUTE_FP4_TUNING=/tmp/tuning.json
OUT=${OUT:-perf-out}
mkdir -p "$OUT"
log="$OUT/log.txt"
{
  echo "## nvidia-smi"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 perf/gpu_session.py --out "$OUT" \
    --only "${SECTIONS:-env,checks,validate,fuzz,determinism,cache,bench}"
  echo "## pytest tests/gpu"; timeout 150 python3 -m pytest -q -x tests/gpu -p no:cacheprovider
  echo "## cute-fp4 validate sm90_default --formats nvfp4 bf16"
  timeout 60 python3 -m cute_fp4 validate sm90_default --formats nvfp4 bf16
  echo "## cute-fp4 tune --shapes 16,8192,8192 4096,4096,4096"
  timeout 120 python3 -m cute_fp4 tune --shapes 16,8192,8192 4096,4096,4096
  echo "## cute-fp4 bench --shapes 1,8192,8192 16,8192,8192 --formats nvfp4 bf16"
  timeout 60 python3 -m cute_fp4 bench --shapes 1,8192,8192 16,8192,8192 --formats nvfp4 bf16
} 2>&1 | tee "$log"
