#!/usr/bin/env bash
# The package as a user installs it: build the wheel from the working tree (in a temporary
# copy, so no stale build/ folder leaks into it), install it without dependencies into a
# fresh venv that sees the packages of .venv (torch and the CuTe DSL are not downloaded
# again), and run the CLI from there. Fails when the installed catalogue is empty, when
# the package is imported from anywhere but the fresh venv, or when a command fails.
# Needs .venv (scripts/setup.sh). Takes well under a minute plus the compile step.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VPY=$ROOT/.venv/bin/python
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# tracked and untracked-but-not-ignored files, as a clean clone would have them
git ls-files -co --exclude-standard -z | "$VPY" -c '
import shutil, sys
from pathlib import Path
dst = Path(sys.argv[1])
for name in sys.stdin.read().split("\0"):
    if name and Path(name).is_file():
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(name, dst / name)
' "$TMP/src"
"$VPY" -m pip wheel -q --no-deps --no-build-isolation -w "$TMP/dist" "$TMP/src"
WHEEL=$(ls "$TMP"/dist/cute_fp4-*.whl)
echo "built $(basename "$WHEEL")"

"$VPY" -m venv --without-pip "$TMP/venv"
purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
echo "import site; site.addsitedir('$(purelib "$VPY")')" \
  > "$(purelib "$TMP/venv/bin/python")/_cute_fp4_deps.pth"
"$VPY" -m pip --python "$TMP/venv/bin/python" install -q --no-deps --no-index "$WHEEL"

cd "$TMP"  # away from the checkout: nothing may come from it
N_SRC=$(ls "$ROOT"/schedules/*.py | grep -vc '/_')
venv/bin/python - "$N_SRC" <<'EOF'
import sys
from pathlib import Path

import cute_fp4
from cute_fp4 import catalogue

venv = Path(sys.prefix).resolve()
where = Path(cute_fp4.__file__).resolve()
assert venv in where.parents, f"cute_fp4 imported from {where}, not from the venv {venv}"
folder = catalogue.builtin_dir()
assert folder is not None and venv in folder.parents, f"catalogue folder {folder}"
n = len(catalogue.names())
assert n == int(sys.argv[1]), f"installed catalogue has {n} schedules, schedules/ {sys.argv[1]}"
print(f"installed package ok: {where.parent}, {n} schedules in {folder}")
EOF
venv/bin/cute-fp4 schedules > schedules.txt
grep -q sm120_default schedules.txt || { echo "cute-fp4 schedules: no sm120_default"; exit 1; }
venv/bin/cute-fp4 compile --all --target sm_120a
echo "wheel check ok"
