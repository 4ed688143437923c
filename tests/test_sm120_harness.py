"""perf/tools/sm120_emulated.py's watchdog on the CPU: a case that hangs, crashes its process,
fails, or raises a CUDA error is recorded as such and the cases after it still run.

The harness is driven with stand-in cases (no GPU: ``require_device`` and the case list are
replaced in a small driver script); the children are real processes, killed or restarted
by the real parent loop.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HARNESS = Path(__file__).resolve().parent.parent / "perf" / "tools" / "sm120_emulated.py"

DRIVER = f"""
import os, sys, time, types, importlib.util
spec = importlib.util.spec_from_file_location("harness", {str(HARNESS)!r})
h = importlib.util.module_from_spec(spec)
spec.loader.exec_module(h)
import cute_fp4.targets as targets
gpu = types.SimpleNamespace(family="sm90", name="sm_90a")
targets.require_device = lambda *a: types.SimpleNamespace(target=gpu, name="stand-in")

def ok(ctx): return {{"passed": True, "err_over_bound": 0.5}}
def wrong(ctx): return {{"passed": False, "detail": "wrong"}}
def hang(ctx): time.sleep(600)
def crash(ctx): os._exit(3)
def cuda_error(ctx): raise RuntimeError(f"CUDA error: illegal instruction in {{os.getpid()}}")
def pid(ctx): return {{"passed": True, "detail": str(os.getpid())}}

h.cases = lambda s, quick, t=90.0: [
    h.Case("a", ok, 30), h.Case("b", hang, 3), h.Case("c", wrong, 30), h.Case("d", crash, 30),
    h.Case("e", cuda_error, 30), h.Case("f", pid, 30), h.Case("g", pid, 30)]
h.schedules = lambda: [h.catalogue.get("sm120_default")]
h.env = lambda mode: {{"mode": mode, "gpu": "stand-in"}}
h.__file__ = __file__
sys.exit(h.main())
"""


def test_hangs_crashes_and_cuda_errors_are_recorded(tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(driver), "--out", str(out)], capture_output=True,
                       text=True, timeout=300, cwd=HARNESS.parents[2])
    assert r.returncode == 1, r.stdout + r.stderr  # not everything passed
    report = json.loads((out / "sm120_emulated.json").read_text())
    rows = report["rows"]["sm120_default"]
    assert [(x["case"], x["status"]) for x in rows] == [
        ("a", "pass"), ("b", "hang"), ("c", "fail"), ("d", "crash"), ("e", "fail"),
        ("f", "pass"), ("g", "pass")]
    assert rows[4]["detail"].startswith("RuntimeError: CUDA error")
    # after the CUDA error a fresh child ran the rest (f and g share it)
    assert rows[5]["detail"] == rows[6]["detail"] != rows[4]["detail"].split()[-1]
    assert report["summary"]["sm120_default"] == {
        "cases": 7, "passed": 3, "fail": 2, "hang": 1, "crash": 1, "not run": 0,
        "worst_err_over_bound": 0.5}
    assert "3/7 pass" in r.stdout and "b=hang" in r.stdout
