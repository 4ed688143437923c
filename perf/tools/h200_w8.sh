#!/usr/bin/env bash
# The eight-warp stream kernel and the gpt-oss decode step in one device call: the GPU tests
# it touches (parallel pytest processes) beside a one-replay pass of the sweep (compiles its
# kernels), then perf/tools/gpt_oss_sweep.py at one token, each GEMM alone, and
# perf/gpt_oss.py's decode section (masks made once: the step captured in a CUDA graph).
# The routing kernel's GPU tests and perf/tools/route_bench.py too.
# Everything in $OUT/all.tgz; $OUT/log.txt the summary. EXTRA_TESTS: more test files.
set -u
cd "$(dirname "$0")/../.."
final=$OUT
R=$(mktemp -d)
OUT=$R; budget=${TEST_S:-200}
source perf/tools/h200_common.sh
export PYTHONUNBUFFERED=1
t=tests/gpu
group stream $t/test_stream.py &
group mxfp4 $t/test_mxfp4.py &
group gptoss $t/test_gpt_oss.py ${EXTRA_TESTS:-} &
group routing $t/test_routing.py $t/test_moe.py &
( timeout "$budget" python3 perf/tools/gpt_oss_sweep.py --out "$R/sweep_warm.json" --tokens 1 \
    --experts 32 --stages --iters 1 --reps 1 > "$R/sweep_warm.txt" 2>&1 ) &
wait
timeout "${SWEEP_S:-100}" python3 perf/tools/gpt_oss_sweep.py --out "$R/sweep.json" --tokens 1 \
  --stages --per-gemm > "$R/sweep.txt" 2>&1; echo "rc=$?" >> "$R/sweep.txt"
timeout 60 python3 perf/tools/route_bench.py --out "$R/route.json" > "$R/route.txt" 2>&1
echo "rc=$?" >> "$R/route.txt"
timeout "${DECODE_S:-150}" python3 perf/gpt_oss.py --out "$R/decode" --sections decode --quick \
  --vocab 32768 > "$R/decode.txt" 2>&1; echo "rc=$?" >> "$R/decode.txt"
{ cat "$R/env.txt"; for f in "$R"/pytest-*.txt; do echo "## $f"; tail -4 "$f"; done
  grep -v "Warning\|hit = " "$R/sweep.txt"; tail -25 "$R/route.txt"
  grep -v "Warning\|hit = \|Loading" "$R/decode.txt" | tail -12; } > "$final/log.txt" 2>&1
tar czf "$final/all.tgz" -C "$R" .
cat "$final/log.txt"
