#!/usr/bin/env bash
# Reliability checks on the lent H200 in one device call, in order of importance, each under
# a timeout, everything under $OUT: the new GPU tests (bad grouped offsets with guard rows,
# the one quantize rule over 11.5M blocks, the selection-driven tests), compute-sanitizer
# memcheck of every grouped kernel on bad offset tables (and of the unclamped scheduler, a
# control that must fail), the clamp's cost timed against the unclamped scheduler, then as
# much of the whole tests/gpu as the remaining time allows. BUDGET_S (default 320): the
# whole script's seconds.
set -u
cd "$(dirname "$0")/../.."
start=$(date +%s)
budget=${BUDGET_S:-320}
left() { echo $(( budget - ($(date +%s) - start) )); }
source perf/tools/h200_common.sh
log="$OUT/log.txt"
echo "## pytest: new and changed GPU tests (left $(left) s)" | tee -a "$log"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_grouped.py \
  -k "bad_offsets or validate_offsets or check_true or not test_grouped" \
  tests/gpu/test_quantize_rule.py tests/gpu/test_api.py tests/gpu/test_pdl.py \
  tests/gpu/test_launch_path.py "tests/gpu/test_kernels.py::test_other_output_dtypes" \
  "tests/gpu/test_kernels.py::test_deterministic_including_split_k" >> "$log" 2>&1
echo "rc=$?" >> "$log"; tail -3 "$log"
san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
echo "## memcheck ($san, left $(left) s)" | tee -a "$log"
memcheck() {  # seconds, log file, args: API-error reports off (the DSL's driver probes)
  local secs=$1 file=$2; shift 2
  timeout "$secs" "$san" --tool memcheck --report-api-errors no "$@" > "$file" 2>&1
  local rc=$?
  if grep -qi "unknown option\|unrecognized option" "$file"; then  # an older sanitizer
    timeout "$secs" "$san" --tool memcheck "$@" > "$file" 2>&1; rc=$?
  fi
  echo "rc=$rc" >> "$file"
}
export PYTORCH_NO_CUDA_MEMORY_CACHING=1  # every tensor its own allocation
memcheck 75 "$OUT/memcheck.txt" python3 perf/tools/grouped_offsets_check.py sanitize
memcheck 40 "$OUT/memcheck-unclamped.txt" python3 perf/tools/grouped_offsets_check.py sanitize \
  --unclamped
unset PYTORCH_NO_CUDA_MEMORY_CACHING
grep -h "ERROR SUMMARY\|^done\|rc=" "$OUT"/memcheck*.txt | tee -a "$log"
echo "## timing: clamped vs unclamped scheduler (left $(left) s)" | tee -a "$log"
timeout 60 python3 perf/tools/grouped_offsets_check.py time --out "$OUT/grouped-clamp-times.json" \
  >> "$log" 2>&1
echo "rc=$?" >> "$log"
rest=$(( $(left) - 5 ))
echo "## pytest tests/gpu (whole suite, ${rest} s left)" | tee -a "$log"
if [ "$rest" -gt 20 ]; then
  timeout "$rest" python3 -m pytest -q -p no:cacheprovider tests/gpu > "$OUT/pytest-all.txt" 2>&1
  echo "rc=$?" >> "$OUT/pytest-all.txt"
  tail -4 "$OUT/pytest-all.txt" | tee -a "$log"
fi
