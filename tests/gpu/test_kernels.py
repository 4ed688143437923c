"""Every catalogue schedule of the present GPU's family against the exact reference.

Outputs are poisoned (NaN) before each run, so an unwritten tile fails. Shapes cover
M = 1, M around the tile (127, 128, 129), N not a multiple of the tile, K = 64 x odd, K
not a multiple of 128, and long K; operands have awkward scales (rows spanning 2^-12..2^12,
zero and saturated blocks). Skipped unless the GPU is SM90 or SM12x; runs unchanged on
either (the schedules are those of the present family).
"""

from __future__ import annotations

import pytest
import torch

from cute_fp4 import catalogue, reference
from cute_fp4.api import make_operands, out_dtype_of, poisoned_check, run_compiled
from cute_fp4.compile import Signature, compile
from cute_fp4.plan import plan
from cute_fp4.schedule import Problem

SHAPES = [(1, 264, 320), (7, 136, 4096), (16, 512, 8256), (127, 136, 320), (128, 256, 448),
          (129, 264, 832), (1000, 136, 4096), (256, 392, 8256), (4096, 256, 4096)]


def _family():
    if not torch.cuda.is_available():
        return None
    major = torch.cuda.get_device_capability()[0]
    return {9: "sm90", 12: "sm120"}.get(major)


def _cases():
    fam = _family() or "sm120"
    out = []
    for s in catalogue.all_schedules(fam, grouped=False):
        if s.name.startswith("sm100_style"):
            continue
        for fmt in (["nvfp4", "bf16"] if fam == "sm90" else ["nvfp4"]):
            if plan(s, Problem(a_format=fmt)).ok:  # e.g. 16-row rs_packed tiles: W4A16 only
                out.append(pytest.param(s, fmt, id=f"{s.name}-{fmt}"))
    return out


@pytest.mark.gpu("sm90", "sm120")
@pytest.mark.parametrize("s, fmt", _cases())
def test_schedule_matches_reference(s, fmt):
    kern = compile(s, Signature(fmt))
    for i, (m, n, k) in enumerate(SHAPES):
        a, b = make_operands(m, n, k, fmt, seed=i)
        poison = torch.full((m, n), float("nan"), dtype=out_dtype_of(s), device="cuda")
        assert not reference.check(poison, a, b).passed  # the poison is detectable
        res = poisoned_check(kern, a, b)
        assert res.passed, f"{s.name} {fmt}: {res}"


@pytest.mark.gpu("sm90", "sm120")
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_other_output_dtypes(out_dtype):
    s = catalogue.all_schedules(_family(), grouped=False)[0].replace(out_dtype=out_dtype)
    kern = compile(s)
    a, b = make_operands(129, 264, 832)
    assert poisoned_check(kern, a, b).passed


@pytest.mark.gpu("sm90", "sm120")
def test_deterministic_including_split_k():
    for s in catalogue.all_schedules(_family(), grouped=False):
        if s.split_k == 1 or s.name.startswith("sm100_style"):
            continue
        kern = compile(s)
        a, b = make_operands(16, 1024, 8192)
        outs = [run_compiled(kern, a, b).clone() for _ in range(3)]
        assert all(torch.equal(outs[0], o) for o in outs[1:]), s.name
