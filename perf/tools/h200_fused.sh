#!/usr/bin/env bash
# The fused epilogue operations on the lent H200 in one device call: their GPU tests in
# parallel groups (bit-identity with the unfused pipeline for every kernel flavour, SiLU over
# every finite BF16/FP16 input, NVFP4MoE and the stream kernels), then the MoE layer fused
# vs unfused (perf/moe_bench.py --ops layer) and the dense gated MLP (perf/mlp_bench.py).
# $OUT gets log.txt and fused.tgz (every output). BUDGET_S: the tests' seconds (default 240).
set -u
cd "$(dirname "$0")/../.."
final=$OUT; OUT=$(mktemp -d)
budget=${BUDGET_S:-240}
source perf/tools/h200_common.sh
f=tests/gpu/test_fused_epilogue.py
group rs $f -k "sm90_rs_packed" &
group default $f -k "sm90_default" &
group decode $f -k "sm90_decode" &
group grouped90 $f -k "sm90_grouped or sm90_stream" &
group sm120a $f -k "sm120_default or sm120_pingpong or sm120_128x64" &
group sm120b $f -k "sm120_decode or sm120_grouped or sm120_stream" &
group api $f -k "silu_is or checks_itself or refuse" tests/gpu/test_moe.py &
group stream tests/gpu/test_stream.py &
wait
echo "## benches" > "$OUT/bench.txt"
timeout 230 python3 perf/moe_bench.py --out "$OUT" --stem moe-fused --ops layer \
  --tokens 16,64,4096 --routings uniform --providers torch_bf16,cute_w4a16 --budget-s 220 \
  >> "$OUT/bench.txt" 2>&1
echo "rc=$?" >> "$OUT/bench.txt"
timeout 100 python3 perf/mlp_bench.py --out "$OUT" >> "$OUT/bench.txt" 2>&1
echo "rc=$?" >> "$OUT/bench.txt"
for x in "$OUT"/pytest-*.txt; do echo "## $(basename "$x")"; tail -2 "$x"; done \
  > "$final/log.txt"
grep -h "x_unfused\|rc=" "$OUT/bench.txt" >> "$final/log.txt"
tar czf "$final/fused.tgz" -C "$OUT" .
