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
group() {  # name, pytest arguments...
  local name=$1; shift
  timeout "$t" python3 -m pytest -q -p no:cacheprovider -rfs "$@" > "$OUT/pytest-$name.txt" 2>&1
  echo "rc=$?" >> "$OUT/pytest-$name.txt"
}
g=tests/gpu
group stream $g/test_stream.py -k "grouped or nvfp4moe" &
group grouped $g/test_grouped.py -k "stream_grouped" &
group routes $g/test_moe.py $g/test_grouped.py -k "not stream_grouped and (auto or packed_stack or syncs or moe or torch_compile)" &
( timeout "$t" python3 perf/moe_bench.py --models qwen3-30b-a3b --tokens 1 --reps 2 \
    --routings uniform --ops gate_up --out "$OUT/warmup" > "$OUT/warmup.txt" 2>&1 ) &
wait
timeout "${BENCH_S:-170}" python3 perf/moe_bench.py --routings uniform --reps 20 --warm \
  --out "$OUT" --stem grouped-decode --budget-s "$(( ${BENCH_S:-170} - 15 ))" ${BENCH_ARGS:-} \
  > "$OUT/bench.txt" 2>&1
echo "bench rc=$?" >> "$OUT/bench.txt"
for f in "$OUT"/pytest-*.txt "$OUT"/bench.txt; do echo "## $(basename "$f")"; tail -4 "$f"; done \
  | tee "$final/log.txt"
cp "$OUT/grouped-decode.md" "$final/" 2>/dev/null
tar czf "$final/grouped_decode.tgz" -C "$OUT" .
