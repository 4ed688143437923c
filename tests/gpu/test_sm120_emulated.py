"""The SM120 kernel on a GPU: emulated MMA on SM90 (``compile.compile_emulated``), natively
on SM12x (``compile.compile``), the same tests unchanged.

A subset of perf/tools/sm120_emulated.py's matrix: every SM120 catalogue schedule on awkward
shapes (M = 1, tails, K = 32) with NaN-poisoned outputs; one persistent CTA walking every
work unit; stages forced to 1 and 2; TMA and cp.async scale loads bit-identical; pingpong
with 1, 2, 3 and 5 units per CTA; long K bit-identical over reruns; FP16 and FP32 outputs;
``cute-fp4 validate`` saying it runs emulated. Every test runs under a watchdog: a hang
ends the whole run with a message (``os._exit``), a failure either way.
"""

from __future__ import annotations

import pytest
import torch

from cute_fp4 import catalogue, reference
from cute_fp4.api import make_operands, run_compiled
from cute_fp4.compile import capped, compile, compile_emulated  # noqa: A004
from cute_fp4.operands import out_dtype_of
from cute_fp4.plan import plan
from cute_fp4.schedule import Problem
from gpu import selection

pytestmark = pytest.mark.gpu("sm90", "sm120")

WATCHDOG_S = 240
SHAPES = [(1, 264, 320), (129, 264, 832), (5, 136, 32), (1000, 136, 4096)]
# Sm120Gemm's schedules: the stream kernel has no emulated build (it runs as itself on sm_90a
# and sm_120a alike: tests/gpu/test_stream.py)
SCHEDULES = [s for s in catalogue.all_schedules("sm120", grouped=False) if plan(s).ok
             and s.mainloop.value != "stream"]


def _emulated() -> bool:
    return selection.family() == "sm90"


def _kernel(s):
    return compile_emulated(s) if _emulated() else compile(s)


def _run(kern, shape, seed=0):
    """(output, CheckResult) of one run into a NaN-filled output."""
    a, b = make_operands(*shape, seed=seed)
    out = torch.full(shape[:2], float("nan"), dtype=out_dtype_of(kern.schedule), device="cuda")
    run_compiled(kern, a, b, out=out)
    torch.cuda.synchronize()
    return out, reference.check(out, a, b)


@pytest.mark.parametrize("s", SCHEDULES, ids=lambda s: s.name)
def test_schedule_matches_reference(s):
    kern = _kernel(s)
    for i, shape in enumerate(SHAPES):
        p = plan(s, Problem(m=shape[0], n=shape[1], k=shape[2]))
        if not p.ok:  # split-K past the K tiles: refused up front (the API does the same)
            assert s.split_k > 1 and "split_k" in p.reasons[0], p.reasons
            continue
        _, res = _run(kern, shape, i)
        assert res.passed, f"{s.name}: {res}"


@pytest.mark.parametrize("name", ["sm120_default", "sm120_pingpong", "sm120_decode_splitk4"])
def test_one_cta_walks_every_unit(name):
    kern = _kernel(catalogue.get(name))
    shape = (300, 264, 1024)
    full, res = _run(kern, shape, 3)
    one, res1 = _run(capped(kern, 1), shape, 3)
    assert res.passed and res1.passed, (res, res1)
    assert torch.equal(full, one)


@pytest.mark.parametrize("name", ["sm120_default", "sm120_k256_epi64x32"])
@pytest.mark.parametrize("stages", [1, 2])
def test_forced_stages(name, stages):
    """One and two stages, also for the 4-K-block tile whose early next-stage wait once
    deadlocked with a single stage."""
    base = catalogue.get(name)
    s = base.replace(stages=stages)
    assert plan(s).ok and plan(s).stages == stages
    out, res = _run(_kernel(s), (129, 264, 832), 4)
    assert res.passed and torch.equal(out, _run(_kernel(base), (129, 264, 832), 4)[0])


def test_sf_load_paths_identical():
    tma = catalogue.get("sm120_default")
    cp = tma.replace(sf_load="cp_async")
    for shape in ((129, 264, 832), (1, 136, 4096)):
        a, ra = _run(_kernel(tma), shape, 5)
        b, rb = _run(_kernel(cp), shape, 5)
        assert ra.passed and rb.passed and torch.equal(a, b), shape


@pytest.mark.parametrize("ctas, units", [(1, 1), (1, 2), (1, 3), (1, 5), (2, 5)])
def test_pingpong_units_per_cta(ctas, units):
    kern = _kernel(catalogue.get("sm120_pingpong"))
    shape = (128 * units - 5, 128, 512)
    out, res = _run(capped(kern, ctas), shape, units)
    assert res.passed, res
    assert torch.equal(out, _run(kern, shape, units)[0])


def test_long_k_bit_identical():
    kern = _kernel(catalogue.get("sm120_pingpong"))
    runs = [_run(kern, (256, 256, 16384), 6) for _ in range(2)]
    assert all(r.passed for _, r in runs)
    assert torch.equal(runs[0][0], runs[1][0])


@pytest.mark.parametrize("out_dtype", ["fp16", "fp32"])
def test_other_output_dtypes(out_dtype):
    s = catalogue.get("sm120_epi64x32").replace(out_dtype=out_dtype)
    for i, shape in enumerate(SHAPES[:2]):
        _, res = _run(_kernel(s), shape, i)
        assert res.passed, res


@pytest.mark.gpu("sm90")
def test_cli_validate_runs_emulated(capsys):
    from cute_fp4.cli import main

    assert main(["validate", "sm120_default", "--shapes", "1,264,320", "5,136,32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("emulated: the SM120 kernel") and "[emulated MMA] sm120_default" in out
