"""Every catalogue schedule of the present GPU's family against the exact reference.

Outputs are poisoned (NaN) before each run, so an unwritten tile fails. Shapes cover
M = 1, M around the tile (127, 128, 129), N not a multiple of the tile, K = 64 x odd, K
not a multiple of 128, and long K; operands have awkward scales (rows spanning 2^-12..2^12,
zero and saturated blocks). Skipped unless the GPU is SM90 or SM12x; runs unchanged on
either (the schedules and formats are those ``gpu.selection`` picks for the present family,
checked against plan() for every target by tests/test_gpu_selection.py).
"""

from __future__ import annotations

import pytest
import torch

from cute_fp4 import reference
from cute_fp4.api import make_operands, out_dtype_of, poisoned_check, run_compiled
from cute_fp4.compile import Signature, compile
from gpu import selection


def _cases():
    return [pytest.param(s, fmt, id=f"{s.name}-{fmt}") for s, fmt in selection.dense_cases()]


@pytest.mark.gpu("sm90", "sm120")
@pytest.mark.parametrize("s, fmt", _cases())
def test_schedule_matches_reference(s, fmt):
    kern = compile(s, Signature(fmt))
    for i, (m, n, k) in enumerate(selection.dense_shapes(s, fmt)):
        a, b = make_operands(m, n, k, fmt, seed=i)
        poison = torch.full((m, n), float("nan"), dtype=out_dtype_of(s), device="cuda")
        assert not reference.check(poison, a, b).passed  # the poison is detectable
        res = poisoned_check(kern, a, b)
        assert res.passed, f"{s.name} {fmt}: {res}"


@pytest.mark.gpu("sm90", "sm120")
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_other_output_dtypes(out_dtype):
    s = selection.default_schedule().replace(out_dtype=out_dtype)
    kern = compile(s)
    a, b = make_operands(129, 264, 832)
    assert poisoned_check(kern, a, b).passed


@pytest.mark.gpu("sm90", "sm120")
def test_deterministic_including_split_k():
    for s in selection.split_k_schedules():
        kern = compile(s)
        a, b = make_operands(16, 1024, 8192)
        outs = [run_compiled(kern, a, b).clone() for _ in range(3)]
        assert all(torch.equal(outs[0], o) for o in outs[1:]), s.name
