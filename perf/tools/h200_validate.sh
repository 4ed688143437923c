#!/usr/bin/env bash
# Validation of the whole tree on the lent H200 in one device call: tests/gpu split into
# groups run as parallel processes (the kernels compile on the host's CPU cores; the GPU is
# idle most of the time), beside perf/gpu_session.py's validation matrix and determinism
# sections (131 s on 2026-12-03). $OUT gets log.txt (each group's summary) and validation.tgz
# (pytest-<group>.txt, the session's JSON and log: one file, as the device call returns few).
# BUDGET_S (default 540): the seconds every process gets.
set -u
cd "$(dirname "$0")/../.."
final=$OUT; OUT=$(mktemp -d)
budget=${BUDGET_S:-540}
source perf/tools/h200_common.sh
t=tests/gpu
group kernels $t/test_kernels.py &
group grouped $t/test_grouped.py &
group sm120 $t/test_sm120_emulated.py $t/test_stream.py &
group models $t/test_moe.py $t/test_nn.py $t/test_hf.py &
group rest $t/test_api.py $t/test_launch_path.py $t/test_pdl.py $t/test_split_k.py \
  $t/test_dequantize.py $t/test_quantize_kernel.py $t/test_quantize_rule.py \
  $t/test_sm90_rs_wide.py $t/test_bench_peers.py &
group mxfp4 $t/test_mxfp4.py &
group gptoss $t/test_gpt_oss.py $t/test_shards.py &
f=$t/test_fused_epilogue.py
group fused90 $f -k "sm90 and not grouped" &
group fusedgrouped $f -k "grouped" &
group fused120 $f -k "sm120 and not grouped or silu_is or checks_itself or refuse or gated" &
listed=" test_kernels.py test_grouped.py test_sm120_emulated.py test_stream.py test_moe.py
  test_nn.py test_hf.py test_api.py test_launch_path.py test_pdl.py test_split_k.py
  test_dequantize.py test_quantize_kernel.py test_quantize_rule.py test_sm90_rs_wide.py
  test_bench_peers.py test_fused_epilogue.py test_mxfp4.py test_gpt_oss.py test_shards.py "
others=""  # test files no group above names: one more group, so nothing is left out
for x in "$t"/test_*.py; do
  case "$listed" in *" $(basename "$x")"[[:space:]]*) ;; *) others="$others $x" ;; esac
done
[ -n "$others" ] && group others $others &
( timeout "$budget" python3 perf/gpu_session.py --out "$OUT" --only env,validate,determinism \
  > "$OUT/session.txt" 2>&1; echo "rc=$?" >> "$OUT/session.txt" ) &
wait
for f in "$OUT"/pytest-*.txt "$OUT"/session.txt; do
  echo "## $(basename "$f")"; tail -3 "$f"
done | tee "$final/log.txt"
tar czf "$final/validation.tgz" -C "$OUT" .
