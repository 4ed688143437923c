"""Shared fixtures. GPU tests are gated by the physical architecture of the device."""

from __future__ import annotations

import pytest
import torch


def _cc():
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def pytest_collection_modifyitems(config, items):
    cc = _cc()
    for item in items:
        want = item.get_closest_marker("gpu")
        if want is None:
            continue
        families = want.args or ("sm90", "sm120")
        have = None if cc is None else ("sm90" if cc[0] == 9 else "sm120" if cc[0] == 12 else "x")
        if have not in families:
            why = "no CUDA GPU" if cc is None else f"GPU is sm_{cc[0]}{cc[1]}"
            item.add_marker(pytest.mark.skip(reason=f"{why}; needs {'/'.join(families)}"))


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)
