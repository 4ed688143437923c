#!/usr/bin/env bash
# The stream decode kernel taken apart on the lent H200 in one device call:
# perf/tools/stream_probe.py (variants compiled in parallel, then timed REPS times
# interleaved), then Nsight Compute of the variants in NCU_LABELS at 1 x 8192 x 8192.
# $OUT gets probe.tgz (stream_probe.json, the compile logs, ncu-<label>.txt).
set -u
cd "$(dirname "$0")/../.."
final=$OUT; OUT=$(mktemp -d)
budget=${BUDGET_S:-300}
source perf/tools/h200_common.sh
python3 perf/tools/stream_probe.py --out "$OUT" --budget-s "$budget" --jobs 8 \
  --reps "${REPS:-2}" > "$OUT/log.txt" 2>&1
echo "probe rc=$?" | tee -a "$final/log.txt"
for label in ${NCU_LABELS:-base}; do
  timeout 90 ncu --profile-from-start off --clock-control none --section SpeedOfLight \
    --section SchedulerStats --section WarpStateStats --section Occupancy \
    --section MemoryWorkloadAnalysis --section LaunchStats \
    python3 perf/tools/stream_probe.py --launch "$label" 1 8192 8192 > "$OUT/ncu-$label.txt" 2>&1
  echo "ncu $label rc=$?" | tee -a "$final/log.txt"
done
cp "$OUT/env.txt" "$final/" 2>/dev/null
tar czf "$final/probe.tgz" -C "$OUT" .
