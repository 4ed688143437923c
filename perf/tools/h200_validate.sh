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
source .gpu/activate.sh > "$OUT/env.txt" 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/wheels/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site:$PYTHONPATH CUTE_FP4_CACHE_DIR=/tmp/cute_fp4_cache
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  git log -1 --format='%h %s' 2>/dev/null || true; } >> "$OUT/env.txt" 2>&1
group() {  # name, test files...
  local name=$1; shift
  timeout "$budget" python3 -m pytest -q -p no:cacheprovider -rfs "$@" \
    > "$OUT/pytest-$name.txt" 2>&1
  echo "rc=$?" >> "$OUT/pytest-$name.txt"
}
t=tests/gpu
group kernels $t/test_kernels.py &
group grouped $t/test_grouped.py &
group sm120 $t/test_sm120_emulated.py $t/test_stream.py &
group models $t/test_moe.py $t/test_nn.py $t/test_hf.py &
group rest $t/test_api.py $t/test_launch_path.py $t/test_pdl.py $t/test_split_k.py \
  $t/test_dequantize.py $t/test_quantize_kernel.py $t/test_quantize_rule.py \
  $t/test_sm90_rs_wide.py $t/test_bench_peers.py &
f=$t/test_fused_epilogue.py
group fused90 $f -k "sm90 and not grouped" &
group fusedgrouped $f -k "grouped" &
group fused120 $f -k "sm120 and not grouped or silu_is or checks_itself or refuse or gated" &
( timeout "$budget" python3 perf/gpu_session.py --out "$OUT" --only env,validate,determinism \
  > "$OUT/session.txt" 2>&1; echo "rc=$?" >> "$OUT/session.txt" ) &
wait
for f in "$OUT"/pytest-*.txt "$OUT"/session.txt; do
  echo "## $(basename "$f")"; tail -3 "$f"
done | tee "$final/log.txt"
tar czf "$final/validation.tgz" -C "$OUT" .
