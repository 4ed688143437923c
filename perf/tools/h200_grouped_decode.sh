#!/usr/bin/env bash
# The grouped stream kernel on the lent H200 in one device call: its GPU tests (parallel
# pytest processes; a warm-up bench run compiles the bench's kernels into the disk cache
# meanwhile), then perf/moe_bench.py at decode (L2 cold and warm). $OUT gets log.txt and
# grouped_decode.tgz (pytest-*.txt, the bench's JSON/MD and logs: one file).
# TEST_S (default 150): seconds each test process gets; BENCH_ARGS: extra bench arguments.
set -u
cd "$(dirname "$0")/../.."
final=$OUT; OUT=$(mktemp -d)
source .gpu/activate.sh > "$OUT/env.txt" 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/wheels/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site:$PYTHONPATH CUTE_FP4_CACHE_DIR=/tmp/cute_fp4_cache
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  git log -1 --format='%h %s' 2>/dev/null || true; date -u; } >> "$OUT/env.txt" 2>&1
t=${TEST_S:-150}
pack() { tar czf "$final/grouped_decode.tgz" -C "$OUT" . ; }  # after every phase
group() {  # name, pytest arguments...
  local name=$1; shift
  timeout "$t" python3 -m pytest -q -p no:cacheprovider -rfs "$@" > "$OUT/pytest-$name.txt" 2>&1
  echo "rc=$?" >> "$OUT/pytest-$name.txt"
}
g=tests/gpu
group stream $g/test_stream.py -k "grouped or nvfp4moe" &
group dense $g/test_stream.py -k "not grouped and not nvfp4moe" &
group grouped $g/test_grouped.py -k "stream_grouped" &
group routes $g/test_moe.py $g/test_grouped.py -k "not stream_grouped and (auto or packed_stack or syncs or moe or torch_compile)" &
( timeout "$t" python3 perf/moe_bench.py --models qwen3-30b-a3b --tokens 1 --reps 2 \
    --routings uniform --ops gate_up --out "$OUT/warmup" > "$OUT/warmup.txt" 2>&1 ) &
wait
pack
timeout "${BENCH_S:-170}" python3 perf/moe_bench.py --routings uniform --reps 20 --warm \
  --out "$OUT" --stem grouped-decode --budget-s "$(( ${BENCH_S:-170} - 15 ))" ${BENCH_ARGS:-} \
  > "$OUT/bench.txt" 2>&1
echo "bench rc=$?" >> "$OUT/bench.txt"
pack
# NCU="name tokens experts n k;...": Nsight Compute of one launch each (perf/tools/profile_grouped.py)
IFS=';' read -ra specs <<< "${NCU-}"
for spec in "${specs[@]}"; do
  set -- $spec
  timeout "${NCU_S:-40}" ncu --clock-control none -k regex:kernel_cutlass --launch-skip 2 \
    --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats \
    python3 perf/tools/profile_grouped.py "$@" bf16 > "$OUT/ncu_$1_$2x$4x$5.txt" 2>&1
done
for f in "$OUT"/pytest-*.txt "$OUT"/bench.txt; do echo "## $(basename "$f")"; tail -4 "$f"; done \
  | tee "$final/log.txt"
cp "$OUT/grouped-decode.md" "$final/" 2>/dev/null
pack
