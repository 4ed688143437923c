#!/usr/bin/env bash
# gpt-oss (issue 43) on the lent GPU in one device call, after the tree's validation:
#   1. perf/tools/h200_validate.sh (BUDGET_S, default 270) beside a one-replay pass of
#      perf/tools/gpt_oss_sweep.py (compiles its kernels into the disk cache) and
#      perf/tools/gpt_oss_step_syncs.py (what keeps a decode step out of a CUDA graph);
#   2. Nsight Compute of the experts' two grouped GEMMs at each of NCU_TOKENS (default
#      none; e.g. "1 4": perf/tools/profile_gpt_oss.py), on an idle GPU;
#   3. perf/tools/gpt_oss_sweep.py (SWEEP_ARGS: candidate schedules and ring depths);
#   4. perf/gpt_oss.py (GPTOSS_ARGS, default every section, --quick, a 32,768 vocabulary).
# Everything lands in $OUT/all.tgz (a device call returns few files); $OUT/log.txt has the
# summary lines.
set -u
cd "$(dirname "$0")/../.."
final=$OUT
R=$(mktemp -d)
mkdir -p "$R/val" "$R/perf"
sweep=${SWEEP_ARGS:---tokens 1 --stages 6 --per-gemm}
( OUT=$R/val BUDGET_S=${BUDGET_S:-270} bash perf/tools/h200_validate.sh > "$R/val.txt" 2>&1 ) &
(
  OUT=$(mktemp -d); budget=${BUDGET_S:-270}
  source perf/tools/h200_common.sh
  timeout "$budget" python3 perf/tools/gpt_oss_sweep.py --out "$R/sweep_warm.json" \
    --experts 32 --iters 1 --reps 1 $sweep > "$R/sweep_warm.txt" 2>&1
  timeout 120 python3 perf/tools/gpt_oss_step_syncs.py > "$R/step_syncs.txt" 2>&1
  echo "rc=$?" >> "$R/step_syncs.txt"
) &
wait
(
  OUT=$(mktemp -d); budget=120
  source perf/tools/h200_common.sh
  for t in ${NCU_TOKENS-}; do
    timeout 90 ncu --clock-control none -k regex:kernel_cutlass --launch-skip 4 \
      --launch-count 2 --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section WarpStateStats --section MemoryWorkloadAnalysis \
      python3 perf/tools/profile_gpt_oss.py "$t" 32 > "$R/ncu_T$t.txt" 2>&1
    echo "rc=$?" >> "$R/ncu_T$t.txt"
  done
  timeout "${SWEEP_S:-90}" python3 perf/tools/gpt_oss_sweep.py --out "$R/sweep.json" $sweep \
    > "$R/sweep.txt" 2>&1; echo "rc=$?" >> "$R/sweep.txt"
)
OUT=$R/perf JOBS=gptoss GPTOSS_S=${GPTOSS_S:-200} \
  GPTOSS_ARGS="${GPTOSS_ARGS:---quick --vocab 32768}" bash perf/tools/h200_perf.sh \
  > "$R/perf.txt" 2>&1
{ cat "$R/val/log.txt"; grep -h "^##\|^x[0-9]" "$R/step_syncs.txt" | head -20
  grep -h "rc=\|Duration\|DRAM Th\|Achieved Occ\|Grid Size" "$R"/ncu_T*.txt 2>/dev/null
  grep -v "Warning\|hit = " "$R/sweep.txt"; cat "$R/perf/log.txt"; } > "$R/log.txt" 2>&1
cp "$R/log.txt" "$final/log.txt"
tar czf "$final/all.tgz" -C "$R" .
cat "$final/log.txt"
