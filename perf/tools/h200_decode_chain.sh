#!/usr/bin/env bash
# Issue 44 (decode chain) on the lent GPU, in one device call: run from the tree's root
# (the helper's copy under .wt/NAME works too), $OUT set; PHASES picks what runs, in order:
#   tests     tests/gpu/test_stream.py, test_pdl.py, test_kernels.py -k stream (two pytest
#             processes at once), while the probe's variants compile on the CPU beside them
#   probe     perf/tools/stream_probe.py (LABELS, REPS) with the read floors
#   timeline  perf/tools/pdl_timeline.py: 8 chained GEMMs per graph, profiled
#   floor     perf/read_floor.py: every decode shape and the 1 GiB read
#   bench     perf/decode_bench.py (BENCH_ARGS)
#   model     perf/model_decode.py, dense then MoE (MODEL_ARGS)
#   ncu       Nsight Compute of the stream kernel at NCU_SHAPES (early flag off and on)
# Each phase has its own time limit (seconds, *_S); everything lands in $OUT/out.tgz
# (logs, JSON), a short summary on stdout.
set -u
final=$OUT
OUT=$(mktemp -d)
cd "$(dirname "$0")/../.."
root=$PWD
gpu=${GPU_DIR:-$root/.gpu}
[ -f "$gpu/activate.sh" ] || gpu=$root/../../.gpu
source "$gpu/activate.sh" > "$OUT/env.txt" 2>&1
export PYTHONPATH=$root:$root/perf:$root/tests:${PYTHONPATH:-}
export CUTE_FP4_CACHE_DIR=/tmp/cute_fp4_cache PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  which ncu nsys; } >> "$OUT/env.txt" 2>&1
LABELS=${LABELS:-base norelease l2_4 ctas4 load_only compute_only null}
say() { echo "$*" | tee -a "$OUT/summary.txt"; }
t0=$(date +%s)
for phase in ${PHASES:-tests probe timeline}; do
  s=$(date +%s)
  case $phase in
    tests)
      python3 perf/tools/stream_probe.py --out "$OUT/probe" --compile-only --jobs 6 \
        --labels $LABELS > "$OUT/probe-compile.txt" 2>&1 &
      pids="$!"
      group() {  # name, pytest arguments...
        local name=$1; shift
        timeout "${TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider -rfs "$@" \
          > "$OUT/pytest-$name.txt" 2>&1
      }
      group stream-ref tests/gpu/test_stream.py -k "reference or early_weights_match" &
      pids="$pids $!"
      group stream-rest tests/gpu/test_stream.py -k "not (reference or early_weights_match)" &
      pids="$pids $!"
      group pdl tests/gpu/test_pdl.py &
      pids="$pids $!"
      group kernels tests/gpu/test_kernels.py -k stream
      for p in $pids; do wait "$p"; done
      for f in "$OUT"/pytest-*.txt; do say "$(basename "$f"): $(tail -1 "$f")"; done;;
    probe)
      timeout "${PROBE_S:-150}" python3 perf/tools/stream_probe.py --out "$OUT/probe" \
        --budget-s "$(( ${PROBE_S:-150} - 10 ))" --jobs 6 --reps "${REPS:-1}" \
        --labels $LABELS > "$OUT/probe-log.txt" 2>&1
      say "probe rc=$? $(grep -c cold_us "$OUT/probe-log.txt") rows";;
    timeline)
      timeout "${TIMELINE_S:-60}" python3 perf/tools/pdl_timeline.py --out "$OUT/timeline" \
        > "$OUT/timeline-log.txt" 2>&1
      say "timeline rc=$? $(grep -o '"early": [a-z]*\|"us_per_gemm": [0-9.]*\|"overlapping_pairs": [0-9]*' "$OUT/timeline-log.txt" | tr '\n' ' ')";;
    floor)
      timeout "${FLOOR_S:-60}" python3 perf/read_floor.py --out "$OUT/floor" \
        > "$OUT/floor-log.txt" 2>&1
      say "floor rc=$?";;
    bench)
      timeout "${BENCH_S:-200}" python3 perf/decode_bench.py --out "$OUT/bench" \
        ${BENCH_ARGS:-} > "$OUT/bench-log.txt" 2>&1
      say "bench rc=$?"; tail -30 "$OUT/bench/decode_bench.md" 2>/dev/null;;
    model)
      for kind in ${MODELS:-dense moe}; do
        timeout "${MODEL_S:-150}" python3 perf/model_decode.py --out "$OUT/model-$kind" \
          --model "$kind" ${MODEL_ARGS:-} > "$OUT/model-$kind-log.txt" 2>&1
        say "model $kind rc=$?"; grep -E "^\| (bf16|w4a16)" "$OUT/model-$kind/model_decode.md" 2>/dev/null
      done;;
    ncu)
      for shape in ${NCU_SHAPES:-8192,8192 4096,4096}; do
        for early in "" "--early"; do
          timeout 60 ncu --profile-from-start off --clock-control none \
            --section SpeedOfLight --section Occupancy --section WarpStateStats \
            --section LaunchStats --section MemoryWorkloadAnalysis \
            python3 perf/tools/stream_probe.py --launch base 1 ${shape/,/ } $early \
            > "$OUT/ncu-${shape/,/x}${early}.txt" 2>&1
          say "ncu $shape $early rc=$? $(grep -E 'Duration|DRAM Throughput|Achieved Occupancy' "$OUT/ncu-${shape/,/x}${early}.txt" | tr -s ' ' | tr '\n' ';')"
        done
      done;;
  esac
  say "phase $phase: $(( $(date +%s) - s )) s"
  tar czf "$final/out.tgz" -C "$OUT" .  # what is done so far, should a later phase be cut
done
say "total $(( $(date +%s) - t0 )) s"
grep -hE "FAILED|Error|error" "$OUT"/pytest-*.txt 2>/dev/null | head -20
tar czf "$final/out.tgz" -C "$OUT" .
