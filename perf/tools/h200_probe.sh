#!/usr/bin/env bash
# Decode and quantizer probe on the lent H200 (one device call): the decode variant sweep
# (perf/tools/decode_probe.py) and Nsight Compute profiles of the decode kernels, QuACK's, and the
# activation quantizer, with warp stall reasons. Writes under $OUT. Environment (all optional):
#   PYTEST="tests/gpu/..." PYTEST_K=expr PYTEST_S=240   pytest first, under a timeout
#   SWEEP=1 (0: none) MS="1 16" ONLY=labels SHAPES=...  perf/tools/decode_probe.py
#   PROFILES="name m n k;..." ("": none)                 ncu of decode_probe launches
#     (e.g. "auto_packed 8192 8192 8192;quack 8192 8192 8192": the large-M profile)
#   W4A4="--shapes 4096,14336" W4A4_S=120                perf/tools/w4a4_routes.py
#   PHOST=1                                              perf/tools/profile_host.py
#   HOST=1                                               perf/host_overhead.py (GPU mode)
#   QCEIL="--shapes 4096x4096"                           perf/tools/quantize_ceiling.py
#   QPROF=1 QSPECS="field=value ...;..."               ncu of quantizer specs at 4096^2
#   QPIPE=1                                            ncu also counts instructions per pipe
#   QBENCH="--quick --sweep" QBENCH_S=200              perf/quantize_bench.py
#   MODEL="--modes w4a16 --step torch,compiled" MODEL_S perf/model_decode.py
set -u
cd "$(dirname "$0")/../.."
source .gpu/activate.sh >/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/wheels/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site:$PYTHONPATH CUTE_FP4_CACHE_DIR=/tmp/cute_fp4_cache
OUT=${OUT:-probe-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt"
if [ -n "${PYTEST:-}" ]; then
  timeout "${PYTEST_S:-240}" python3 -m pytest -q -p no:cacheprovider $PYTEST \
    ${PYTEST_K:+-k "$PYTEST_K"} > "$OUT/pytest.txt" 2>&1
  tail -3 "$OUT/pytest.txt"
fi
if [ "${SWEEP:-1}" = 1 ]; then
  timeout "${SWEEP_S:-300}" python3 perf/tools/decode_probe.py --out "$OUT" --budget-s "${SWEEP_B:-260}" \
    --ms ${MS:-1 16} ${ONLY:+--only $ONLY} ${SHAPES:+--shapes $SHAPES} > "$OUT/sweep.txt" 2>&1
fi
# QPIPE=1: instructions per pipe and each pipe's busy share (which pipe bounds a kernel)
PIPES='regex:^sm__inst_executed_pipe_(alu|fma|fmaheavy|fmalite|fp16|xu|lsu|uniform)\.sum$,regex:^sm__pipe_(alu|fma|fmaheavy|fmalite|fp16|xu)_cycles_active\.avg\.pct_of_peak_sustained_active$'
NCU="ncu --profile-from-start off --clock-control none --section SpeedOfLight \
 --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
 --section Occupancy --section LaunchStats --section InstructionStats \
 --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio${QPIPE:+,$PIPES}"
DEFAULT_PROFILES='d4_s1 1 28672 4096;quack 1 28672 4096;auto_plain 1 8192 8192;d4_s4 1 8192 8192'
IFS=';' read -ra specs <<< "${PROFILES-$DEFAULT_PROFILES}"  # PROFILES="" profiles nothing
for spec in "${specs[@]}"; do
  set -- $spec
  timeout 120 $NCU python3 perf/tools/decode_probe.py --launch "$@" > "$OUT/ncu_$1_$3x$4.txt" 2>&1
done
# QSPECS: ';'-separated QuantSpec field lists ("ctas_per_sm=0 order=atoms"), one profile each
if [ "${QPROF:-1}" = 1 ]; then
  IFS=';' read -ra qspecs <<< "${QSPECS:-}"
  [ ${#qspecs[@]} -eq 0 ] && qspecs=("")
  i=0
  for q in "${qspecs[@]}"; do
    timeout 120 $NCU python3 perf/tools/profile_quantize.py 4096 4096 $q \
      > "$OUT/ncu_quantize_4096x4096_$i.txt" 2>&1
    i=$((i + 1))
  done
fi
if [ -n "${QBENCH:-}" ]; then
  timeout "${QBENCH_S:-200}" python3 perf/quantize_bench.py "$OUT/quant.json" $QBENCH \
    > "$OUT/quant.txt" 2>&1
  tail -5 "$OUT/quant.txt"
fi
if [ -n "${W4A4:-}" ]; then
  timeout "${W4A4_S:-120}" python3 perf/tools/w4a4_routes.py --out "$OUT" $W4A4 \
    > "$OUT/w4a4_routes.txt" 2>&1
  tail -10 "$OUT/w4a4_routes.txt"
fi
if [ "${PHOST:-0}" = 1 ]; then
  timeout 120 python3 perf/tools/profile_host.py --out "$OUT" > /dev/null 2>&1
  grep "M=" "$OUT/profile_host.txt"
fi
if [ "${HOST:-0}" = 1 ]; then
  timeout 150 python3 perf/host_overhead.py --out "$OUT" > "$OUT/host_overhead.txt" 2>&1
  grep -E "^M=|host" "$OUT/host_overhead.txt" | head -20
fi
if [ -n "${QCEIL+set}" ]; then
  timeout 150 python3 perf/tools/quantize_ceiling.py "$OUT/quantize_ceiling.json" $QCEIL \
    > "$OUT/quantize_ceiling.txt" 2>&1
  cat "$OUT/quantize_ceiling.txt" | tail -6
fi
if [ -n "${MODEL:-}" ]; then
  timeout "${MODEL_S:-260}" python3 perf/model_decode.py --out "$OUT" $MODEL > "$OUT/model.txt" 2>&1
  tail -20 "$OUT/model.txt"
fi
ls -la "$OUT"
