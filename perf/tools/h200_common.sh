# Sourced by the h200_*.sh drivers (from the repository root, $OUT set): the GPU host's
# environment (the DSL bundle, the wheels beside it, this tree on PYTHONPATH, a compile
# cache), what the run ran on in $OUT/env.txt, and group NAME ARGS...: one pytest process
# under $budget seconds writing $OUT/pytest-NAME.txt (run several with & and wait).
source .gpu/activate.sh > "$OUT/env.txt" 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/wheels/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site:${PYTHONPATH:-} CUTE_FP4_CACHE_DIR=/tmp/cute_fp4_cache
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  git log -1 --format='%h %s' 2>/dev/null || true; } >> "$OUT/env.txt" 2>&1
group() {  # name, pytest arguments...
  local name=$1; shift
  timeout "$budget" python3 -m pytest -q -p no:cacheprovider -rfs "$@" \
    > "$OUT/pytest-$name.txt" 2>&1
  echo "rc=$?" >> "$OUT/pytest-$name.txt"
}
