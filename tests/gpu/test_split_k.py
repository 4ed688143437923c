"""Split-K reduced inside the kernel (``epilogue.store_split_k``), on the present GPU family.

Every split stores its FP32 partial, the last split of a tile to arrive sums them in split
order and stores D; the arrival counters live in a per-stream workspace that every launch
leaves at zero. Checked here: poisoned outputs against the exact reference for split
counts 2-8 (more splits than K tiles included: empty splits), M = 1 and tails; the
counters back at zero after every launch; bit-identical reruns; CUDA-graph replay equal to
eager; two streams get two workspaces. Runs unchanged on SM90 and SM12x.
"""

from __future__ import annotations

import pytest
import torch

from cute_fp4 import catalogue, reference
from cute_fp4.api import make_operands, out_dtype_of, run_compiled
from cute_fp4.compile import Signature, compile
from cute_fp4.kernels.epilogue import SPLIT_HEADER
from cute_fp4.plan import plan
from cute_fp4.schedule import Problem
from cute_fp4.workspaces import split_workspace
from gpu import selection

WATCHDOG_S = 240
# small first and then larger, so that a later launch's counters lie where an earlier
# launch with fewer tiles put partials (the workspace layout must keep them apart)
SHAPES = [(1, 264, 320), (7, 136, 8256), (16, 1024, 4096), (129, 520, 2048), (1, 264, 320)]


def _bases():
    return selection.split_k_bases()


def _cases():
    return [pytest.param(name, fmt, sk, id=f"{name}-{fmt}-s{sk}")
            for name, fmt in _bases() for sk in (2, 3, 8)]


def _counters_zero(kern, m, n) -> bool:
    ws, _ = split_workspace(kern, m, n, torch.device("cuda", torch.cuda.current_device()))
    tiles = -(-m // kern.schedule.tile.m) * -(-n // kern.schedule.tile.n)
    return bool((ws[SPLIT_HEADER:SPLIT_HEADER + tiles * kern.split_slots] == 0).all())


@pytest.mark.gpu("sm90", "sm120")
@pytest.mark.parametrize("name, fmt, split_k", _cases())
def test_split_k_matches_reference(name, fmt, split_k):
    s = catalogue.get(name).replace(split_k=split_k)
    kern = compile(s, Signature(fmt))
    for i, (m, n, k) in enumerate(SHAPES):
        if not plan(s, Problem(m, n, k, fmt)).ok:  # more splits than K tiles: refused
            continue
        a, b = make_operands(m, n, k, fmt, seed=i, dist="awkward")
        out = torch.full((m, n), float("nan"), dtype=out_dtype_of(s), device="cuda")
        run_compiled(kern, a, b, out=out)
        torch.cuda.synchronize()
        res = reference.check(out, a, b)
        assert res.passed, f"{s.label()} {fmt} {m}x{n}x{k}: {res}"
        assert _counters_zero(kern, m, n), "a launch left split-K counters set"


@pytest.mark.gpu("sm90", "sm120")
def test_split_k_past_the_k_tiles():
    """Launched past plan() (as the validation harness does): splits with no K tile store a
    zero partial and still arrive."""
    name, fmt = _bases()[0]
    s = catalogue.get(name).replace(split_k=8)
    kern = compile(s, Signature(fmt))
    m, n, k = 16, 512, 2 * s.tile.k  # two K tiles, eight splits
    a, b = make_operands(m, n, k, fmt, seed=3)
    out = torch.full((m, n), float("nan"), dtype=out_dtype_of(s), device="cuda")
    kern._planned.add((m, n, k, fmt))  # past plan(), deliberately
    from cute_fp4.packed import PackedNVFP4Weight
    from cute_fp4.run import run_checked

    bb = PackedNVFP4Weight.from_tensor(b) if s.mainloop.value == "rs_packed" else b
    run_checked(kern, a, bb, out, None, (m, n, k, fmt))
    torch.cuda.synchronize()
    assert reference.check(out, a, b).passed
    assert _counters_zero(kern, m, n)


@pytest.mark.gpu("sm90", "sm120")
def test_split_k_deterministic_and_graph_replay():
    for name, fmt in _bases()[:2]:
        s = catalogue.get(name).replace(split_k=4)
        kern = compile(s, Signature(fmt))
        a, b = make_operands(16, 2048, 8192, fmt, seed=5)
        eager = [run_compiled(kern, a, b).clone() for _ in range(4)]
        assert all(torch.equal(eager[0], o) for o in eager[1:]), f"{name}: reruns differ"
        out = torch.empty_like(eager[0])
        run_compiled(kern, a, b, out=out)  # warm (fills the counter reserve); the capture
        # takes zeroed counters from the reserve and its partials from the graph's pool
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run_compiled(kern, a, b, out=out)
            run_compiled(kern, a, b, out=out)  # a second launch: counters of its own
        for _ in range(3):
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager[0]), f"{name}: graph replay differs from eager"


@pytest.mark.gpu("sm90", "sm120")
def test_split_k_workspace_per_stream():
    name, fmt = _bases()[0]
    kern = compile(catalogue.get(name).replace(split_k=2), Signature(fmt))
    dev = torch.device("cuda", torch.cuda.current_device())
    w0, _ = split_workspace(kern, 16, 1024, dev)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        w1, _ = split_workspace(kern, 16, 1024, dev)
        a, b = make_operands(16, 1024, 4096, fmt, seed=1)
        out = torch.full((16, 1024), float("nan"), dtype=out_dtype_of(kern.schedule),
                         device="cuda")
        run_compiled(kern, a, b, out=out)
    side.synchronize()
    assert w0.data_ptr() != w1.data_ptr()
    assert reference.check(out, a, b).passed
    assert split_workspace(kern, 16, 1024, dev)[0].data_ptr() == w0.data_ptr()
