#!/usr/bin/env bash
# The package as a user installs it: the wheel of the working tree (scripts/build_wheel.py:
# built once per state of the sources, tests/test_packaging.py reuses it), installed without
# dependencies into a fresh venv that sees the packages of .venv (torch and the CuTe DSL are
# not downloaded again), and the CLI run from there. Fails when the installed catalogue is
# empty, when the package is imported from anywhere but the fresh venv, or when a command
# fails. The catalogue's compile goes through the build cache the tests use (.cache/builds:
# CUTE_FP4_BUILD_CACHE, see tests/conftest.py), so CI compiles each kernel once.
# Needs .venv (scripts/setup.sh). Takes well under a minute.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VPY=$ROOT/.venv/bin/python
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

WHEEL=$("$VPY" scripts/build_wheel.py)
echo "wheel $WHEEL"

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
CUTE_FP4_BUILD_CACHE=${CUTE_FP4_BUILD_CACHE:-$ROOT/.cache/builds} \
  venv/bin/cute-fp4 compile --all --target sm_120a
echo "wheel check ok"
