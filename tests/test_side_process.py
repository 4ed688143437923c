"""The side process of tests/conftest.py: a test of a side module reports the side
process's outcome (passed, skipped with its reason, failed with its text) and runs last;
its fixtures are set up here too (a broken one errors in both processes)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

SIDE = '''
import os
import pytest


@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")


def test_a_passes():
    assert os.environ["CUTE_FP4_SIDE_PROCESS"].endswith(".json")  # ran in the side process


def test_b_skips():
    pytest.skip("no reason to run")


@pytest.mark.parametrize("x", [1, 2])
def test_c_fails(x):
    assert x == 1, f"x is {x} in the side process"


def test_d_setup_error(broken):
    pass
'''

MAIN = '''
import os


def test_main():
    assert "CUTE_FP4_SIDE_PROCESS" not in os.environ
'''


def test_side_module_outcomes_are_reported_here(tmp_path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_epilogue.py").write_text(SIDE)  # a name in SIDE_MODULES
    (tmp_path / "test_main.py").write_text(MAIN)
    r = subprocess.run([sys.executable, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider",
                        str(tmp_path)], capture_output=True, text=True, cwd=tmp_path)
    out = r.stdout
    order = re.findall(r"::(test_\w+)(?:\[\d\])? (PASSED|FAILED|SKIPPED|ERROR)", out)
    assert order == [("test_main", "PASSED"), ("test_a_passes", "PASSED"),
                     ("test_b_skips", "SKIPPED"), ("test_c_fails", "PASSED"),
                     ("test_c_fails", "FAILED"), ("test_d_setup_error", "ERROR")], out
    assert "no reason to run" in out and "x is 2 in the side process" in out
    assert "fixture broke" in out and r.returncode == 1
