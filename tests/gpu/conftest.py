"""GPU-test fixtures: a watchdog for modules that run kernels which could hang."""

from __future__ import annotations

import os
import sys
import threading

import pytest


@pytest.fixture(autouse=True)
def watchdog(request):
    """Exit the process (status 70) when a test of a module that sets ``WATCHDOG_S`` runs
    longer than that many seconds: a hung kernel never returns, so a timeout inside the test
    could not fire; the exit names the test."""
    limit = getattr(request.module, "WATCHDOG_S", None)
    if limit is None:
        yield
        return

    def fire():
        print(f"\nWATCHDOG: {request.node.nodeid} still running after {limit} s "
              f"(a hang); exiting", file=sys.stderr, flush=True)
        os._exit(70)

    timer = threading.Timer(limit, fire)
    timer.daemon = True
    timer.start()
    yield
    timer.cancel()
