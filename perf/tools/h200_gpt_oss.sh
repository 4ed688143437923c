#!/usr/bin/env bash
# gpt-oss (issue 43) on the lent GPU in one device call, after the tree's validation:
#   1. perf/tools/h200_validate.sh (BUDGET_S, default 280) beside
#      perf/tools/gpt_oss_experts_error.py (one experts layer against float32);
#   2. Nsight Compute of the experts' two grouped GEMMs at each of NCU_TOKENS (default
#      "1 4", 32 experts: perf/tools/profile_gpt_oss.py), on an idle GPU;
#   3. perf/tools/gpt_oss_sweep.py (candidate schedules and ring depths; its kernels are
#      compiled into the disk cache during step 1 by a one-replay pass);
#   4. perf/gpt_oss.py (GPTOSS_ARGS, default the grouped section, --quick).
# $OUT gets val/ (validation.tgz, log.txt), experts_error.json, ncu_T*.txt, sweep.json,
# perf/ and log.txt.
set -u
cd "$(dirname "$0")/../.."
R=$OUT
mkdir -p "$R/val" "$R/perf"
( OUT=$R/val BUDGET_S=${BUDGET_S:-250} bash perf/tools/h200_validate.sh > "$R/val.txt" 2>&1 ) &
(
  OUT=$(mktemp -d); budget=${BUDGET_S:-250}
  source perf/tools/h200_common.sh
  timeout "$budget" python3 perf/tools/gpt_oss_experts_error.py --out "$R/experts_error.json" \
    > "$R/experts_error.txt" 2>&1; echo "rc=$?" >> "$R/experts_error.txt"
  timeout "$budget" python3 perf/tools/gpt_oss_sweep.py --out "$R/sweep_warm.json" \
    --experts 32 --tokens 1 --iters 1 --reps 1 > "$R/sweep_warm.txt" 2>&1
) &
wait
(
  OUT=$(mktemp -d); budget=120
  source perf/tools/h200_common.sh
  for t in ${NCU_TOKENS-1 4}; do
    timeout 90 ncu --clock-control none -k regex:kernel_cutlass --launch-skip 4 \
      --launch-count 2 --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section WarpStateStats --section MemoryWorkloadAnalysis \
      python3 perf/tools/profile_gpt_oss.py "$t" 32 > "$R/ncu_T$t.txt" 2>&1
    echo "rc=$?" >> "$R/ncu_T$t.txt"
  done
)
(
  OUT=$(mktemp -d); budget=120
  source perf/tools/h200_common.sh
  timeout "${SWEEP_S:-100}" python3 perf/tools/gpt_oss_sweep.py --out "$R/sweep.json" \
    > "$R/sweep.txt" 2>&1; echo "rc=$?" >> "$R/sweep.txt"
)
OUT=$R/perf JOBS=gptoss GPTOSS_S=${GPTOSS_S:-110} \
  GPTOSS_ARGS="${GPTOSS_ARGS:---sections grouped --quick}" bash perf/tools/h200_perf.sh \
  > "$R/perf.txt" 2>&1
{ cat "$R/val/log.txt"; tail -3 "$R/experts_error.txt"; grep -h "rc=\|Duration\|Memory Th\|DRAM Th\|Achieved Occ\|Grid Size\|Registers Per\|Waves Per" "$R"/ncu_T*.txt; cat "$R/sweep.txt"; cat "$R/perf/log.txt"; } > "$R/log.txt" 2>&1
cat "$R/log.txt"
