#!/usr/bin/env bash
# Perf scripts on the lent GPU in one device call, one after another on an otherwise idle
# GPU (run tests in another call: h200_validate.sh). From the tree's root, $OUT set.
# JOBS: space-separated names, in order, each with its own time limit (seconds, <NAME>_S):
#   mxfp4     perf/mxfp4_decode.py: MXFP4 against NVFP4 W4A16 at M 1, 4, 16
#   gptoss    perf/gpt_oss.py (GPTOSS_ARGS): issue 43's bars
#   shards    perf/shards.py (SHARDS_ARGS): the layer API at TP shard shapes against BF16
# Every job's stdout (JSON lines where the script prints them) and its output folder land
# in $OUT/perf.tgz; $OUT/log.txt has each job's last lines and exit status.
set -u
cd "$(dirname "$0")/../.."
final=$OUT
OUT=$(mktemp -d)
budget=600
source perf/tools/h200_common.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/perf:$PYTHONPATH
job() {  # name, limit, command...
  local name=$1 limit=$2; shift 2
  mkdir -p "$OUT/$name"
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name/stdout.txt" 2>&1
  echo "rc=$? seconds=$(( $(date +%s) - t0 ))" >> "$OUT/$name/stdout.txt"
}
for j in ${JOBS:-mxfp4 gptoss shards}; do
  case $j in
    mxfp4) job mxfp4 "${MXFP4_S:-90}" python3 perf/mxfp4_decode.py --out "$OUT/mxfp4" ;;
    gptoss) job gptoss "${GPTOSS_S:-120}" python3 perf/gpt_oss.py --out "$OUT/gptoss" \
      ${GPTOSS_ARGS:-} ;;
    shards) job shards "${SHARDS_S:-180}" python3 perf/shards.py --out "$OUT/shards" \
      ${SHARDS_ARGS:-} ;;
    *) echo "unknown job $j" >> "$OUT/log.txt" ;;
  esac
done
for f in "$OUT"/*/stdout.txt; do
  echo "## $f"; tail -4 "$f"
done | sed "s|$OUT/||" | tee "$final/log.txt"
cp "$OUT/env.txt" "$final/env.txt"
tar czf "$final/perf.tgz" -C "$OUT" .
