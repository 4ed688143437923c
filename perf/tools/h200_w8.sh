#!/usr/bin/env bash
# The eight-warp stream kernel, the routing kernel and the gpt-oss decode step in one device
# call, in phases (each packs $OUT/all.tgz and $OUT/log.txt, so a call cut short still
# returns what ran): 1. the GPU tests they touch (parallel pytest processes) beside a
# one-replay pass of the sweep (compiles its kernels); 2. perf/tools/route_bench.py;
# 3. perf/gpt_oss.py's decode section (masks made once: the step captured in a CUDA graph);
# 4. perf/tools/gpt_oss_sweep.py at one token, each GEMM alone. EXTRA_TESTS: more files.
set -u
cd "$(dirname "$0")/../.."
final=$OUT
R=$(mktemp -d)
OUT=$R; budget=${TEST_S:-200}
source perf/tools/h200_common.sh
export PYTHONUNBUFFERED=1
pack() {
  { cat "$R/env.txt"; for f in "$R"/pytest-*.txt; do echo "## $f"; tail -4 "$f"; done
    tail -25 "$R/route.txt" 2>/dev/null
    grep -v "Warning\|hit = \|Loading" "$R/decode.txt" 2>/dev/null | tail -12
    grep -v "Warning\|hit = " "$R/sweep.txt" 2>/dev/null; } > "$final/log.txt" 2>&1
  tar czf "$final/all.tgz" -C "$R" .
}
t=tests/gpu
group routing $t/test_routing.py $t/test_moe.py &
group stream $t/test_stream.py &
group mxfp4 $t/test_mxfp4.py &
group gptoss $t/test_gpt_oss.py ${EXTRA_TESTS:-} &
( timeout "$budget" python3 perf/tools/gpt_oss_sweep.py --out "$R/sweep_warm.json" --tokens 1 \
    --experts 32 --stages --iters 1 --reps 1 > "$R/sweep_warm.txt" 2>&1 ) &
wait
pack
timeout 40 python3 perf/tools/route_bench.py --out "$R/route.json" > "$R/route.txt" 2>&1
echo "rc=$?" >> "$R/route.txt"
pack
timeout "${DECODE_S:-150}" python3 perf/gpt_oss.py --out "$R/decode" --sections decode --quick \
  --vocab 32768 > "$R/decode.txt" 2>&1; echo "rc=$?" >> "$R/decode.txt"
pack
timeout "${SWEEP_S:-100}" python3 perf/tools/gpt_oss_sweep.py --out "$R/sweep.json" --tokens 1 \
  --stages --per-gemm > "$R/sweep.txt" 2>&1; echo "rc=$?" >> "$R/sweep.txt"
pack
cat "$final/log.txt"
