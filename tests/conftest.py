"""Shared fixtures and the session's plumbing.

* GPU tests are gated by the physical architecture of the device (``@pytest.mark.gpu``).
* Cross-compiles go through the build cache (``cute_fp4.cache.BuildCache``):
  ``CUTE_FP4_BUILD_CACHE`` defaults to ``.cache/builds`` in the checkout (git-ignored), so a
  kernel that several tests compile (or ``scripts/check_wheel.sh`` compiled before) is
  built once, and each cubin disassembled once. Entries are keyed by the kernel modules'
  sources, so an edit there rebuilds. ``CUTE_FP4_BUILD_CACHE=0`` compiles everything
  afresh. The session's count is printed at the end ("build cache: N built, M loaded").
* Side process: the modules in :data:`SIDE_MODULES` (CPU-bound traces that share nothing
  with other tests) run in a second pytest process, started as soon as the session has
  collected, in parallel with the rest on the second core. Here their tests run last and
  report that process's outcome for each of them (passed, skipped with its reason, or
  failed with its text); their fixtures are set up in both processes, so keep them
  cheap. ``CUTE_FP4_SIDE_PROCESS=0`` runs them in this process instead (e.g. to debug one
  with ``--pdb``). A module belongs there when it takes long, compiles nothing another
  test compiles (the two processes share the build cache, but not its work in flight)
  and needs no order with other modules.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# CPU work that shares nothing with the rest, ~3.5 of the suite's ~8 minutes on a 2-core
# machine: the mainloop and epilogue traces, the fragment-layout probes (cute.compile of
# probes, nothing cached) and the harness watchdog (child processes, a 3 s hang)
SIDE_MODULES = ("test_sm120_mainloop.py", "test_epilogue.py", "test_sf_layout.py",
                "test_sm120_harness.py", "test_docs.py")
SIDE_ENV = "CUTE_FP4_SIDE_PROCESS"  # "0": no side process; in the side process: its JSON
SIDE_TIMEOUT_S = 1800
_SIDE = pytest.StashKey()
_STATS = pytest.StashKey()


def _cc():
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def pytest_configure(config):
    os.environ.setdefault("CUTE_FP4_BUILD_CACHE", str(ROOT / ".cache" / "builds"))


def pytest_collection_modifyitems(config, items):
    gpu = [(item, item.get_closest_marker("gpu")) for item in items]
    gpu = [(item, want) for item, want in gpu if want is not None]
    cc = _cc() if gpu else None
    for item, want in gpu:
        families = want.args or ("sm90", "sm120")
        have = None if cc is None else ("sm90" if cc[0] == 9 else "sm120" if cc[0] == 12 else "x")
        if have not in families:
            why = "no CUDA GPU" if cc is None else f"GPU is sm_{cc[0]}{cc[1]}"
            item.add_marker(pytest.mark.skip(reason=f"{why}; needs {'/'.join(families)}"))
    if _side_mode() == "main":
        items.sort(key=_is_side)  # stable: the side modules' tests last


# ----------------------------------------------------------------------------- side process

def _side_mode() -> str:
    """"main" (this session starts a side process), "side" (this is one) or "off"."""
    env = os.environ.get(SIDE_ENV, "")
    return "off" if env == "0" else "side" if env else "main"


def _is_side(item) -> bool:
    return item.path.name in SIDE_MODULES


class SideProcess:
    """``python -m pytest NODEIDS`` in the background, its outcomes in a JSON file."""

    def __init__(self, nodeids: list[str], rootdir: Path):
        fd, name = tempfile.mkstemp(prefix="cute_fp4_side_", suffix=".json")
        os.close(fd)
        self.out = Path(name)
        self.log = tempfile.TemporaryFile()
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *nodeids]
        self.proc = subprocess.Popen(cmd, cwd=rootdir, env={**os.environ, SIDE_ENV: name},
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.results: dict | None = None
        self.builds: dict[str, int] = {}
        self.side_s = self.wait_s = None  # its session's seconds; how long the main one waited

    def stop(self) -> None:
        """End the process if it still runs (the session stopped early, e.g. ``-x``)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.out.unlink(missing_ok=True)

    def result(self, nodeid: str) -> dict:
        if self.results is None:
            t0 = time.monotonic()
            try:
                self.proc.wait(timeout=SIDE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.wait_s = time.monotonic() - t0
            text = self.out.read_text()
            data = json.loads(text) if text else {}
            self.results, self.builds = data.get("results", {}), data.get("builds", {})
            self.side_s = data.get("seconds")
            self.out.unlink(missing_ok=True)
        hit = self.results.get(nodeid)
        if hit is None:
            self.log.seek(0)
            tail = self.log.read().decode(errors="replace")[-6000:]
            return {"outcome": "failed", "text": f"the side process (exit "
                    f"{self.proc.returncode}) reported nothing for this test:\n{tail}"}
        return hit


def pytest_collection_finish(session):
    if _side_mode() != "main" or session.config.option.collectonly:
        return
    side = [i.nodeid for i in session.items if _is_side(i)]
    if side:
        session.config.stash[_SIDE] = SideProcess(side, session.config.rootpath)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    side = pyfuncitem.config.stash.get(_SIDE, None)
    if side is None or not _is_side(pyfuncitem):
        return None
    res = side.result(pyfuncitem.nodeid)
    if res["outcome"] == "skipped":
        pytest.skip(res["text"])
    if res["outcome"] != "passed":
        pytest.fail(f"(in the side process)\n{res['text']}", pytrace=False)
    return True


_RESULTS: dict[str, dict] = {}


def pytest_runtest_logreport(report):
    """In the side process: each test's outcome (its first phase that did not pass)."""
    if _side_mode() != "side" or _RESULTS.get(report.nodeid, {}).get("outcome") not in (
            None, "passed"):
        return
    if report.when == "call" or not report.passed:
        text = report.longrepr[2] if report.skipped and isinstance(report.longrepr, tuple) \
            else report.longreprtext
        _RESULTS[report.nodeid] = {"outcome": report.outcome, "text": text}


def _build_stats():
    """This process's build-cache counts (empty when nothing was compiled)."""
    cache = sys.modules.get("cute_fp4.cache")
    return cache.BUILD_STATS if cache is not None else collections.Counter()


def pytest_sessionfinish(session):
    BUILD_STATS = _build_stats()
    if _side_mode() == "side":
        Path(os.environ[SIDE_ENV]).write_text(json.dumps(
            {"results": _RESULTS, "builds": dict(BUILD_STATS),
             "seconds": round(time.monotonic() - _START, 1)}))
    side = session.config.stash.get(_SIDE, None)
    if side is not None:
        side.stop()
        session.config.stash[_STATS] = BUILD_STATS + collections.Counter(side.builds)


_START = time.monotonic()  # this process's start, near enough (conftest imports first)


def pytest_terminal_summary(terminalreporter):
    BUILD_STATS = terminalreporter.config.stash.get(_STATS, None) or _build_stats()
    if BUILD_STATS:
        terminalreporter.write_line("build cache (both processes): " + ", ".join(
            f"{n} {how}" for how, n in sorted(BUILD_STATS.items())))
    side = terminalreporter.config.stash.get(_SIDE, None)
    if side is not None and side.side_s is not None:  # what balances the two processes
        terminalreporter.write_line(
            f"side process: {side.side_s:.0f} s; this one waited {side.wait_s:.0f} s for it "
            f"after {time.monotonic() - _START - side.wait_s:.0f} s of its own")


@pytest.fixture
def rng():
    import torch

    return torch.Generator().manual_seed(1234)
