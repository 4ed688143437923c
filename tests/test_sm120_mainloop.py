"""Runs the SM120 mainloop trace (tests/sm120_mainloop_trace.py) in a fresh process.

The trace executes the kernel's own ``mainloop`` body on stand-ins for ``cute`` and
``cutlass``. Once the DSL has compiled that kernel in a process (tests/test_compile.py
does), the method it wraps is the DSL's rewritten one, which refuses stand-ins; a fresh
interpreter keeps the trace independent of test order.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TRACE = Path(__file__).with_name("sm120_mainloop_trace.py")


@pytest.mark.compile
def test_mainloop_trace_in_a_fresh_process():
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-W", "ignore::DeprecationWarning", str(TRACE)],
                       capture_output=True, text=True, cwd=TRACE.parent.parent)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout
