"""The routing kernel (``cute_fp4.sorting``, one CTA) against torch's ``route`` on the GPU:
equal bit for bit on every (T, top_k, E) of decode and up to the limits, int32 and int64
ids, ties, one expert, outputs poisoned before each call; no write outside the outputs for
ids out of range; no host sync; a CUDA graph replayed with new ids in the same buffers;
``route``'s automatic choice. Skipped without a GPU (``conftest``)."""

from __future__ import annotations

import pytest
import torch

from cute_fp4 import sorting
from cute_fp4.bench import capture_graph
from cute_fp4.layers import routing

pytestmark = pytest.mark.gpu("sm90", "sm120")

WATCHDOG_S = 300
POISON = -7
TOKENS = (1, 2, 3, 16, 64, 255)
TOP_K = (1, 2, 4, 8)
EXPERTS = (1, 4, 32, 128, 256)
DTYPES = (torch.int32, torch.int64)


def _poisoned(n: int, e: int, guard: int = 0):
    """The four outputs, filled with POISON, each inside a buffer ``guard`` elements longer
    on both sides (also POISON): (outputs, buffers)."""
    bufs = [torch.full((n + 2 * guard,), POISON, dtype=torch.int64, device="cuda")
            for _ in range(3)]
    bufs.append(torch.full((e + 1 + 2 * guard,), POISON, dtype=torch.int32, device="cuda"))
    return [b[guard:guard + b.numel() - 2 * guard] for b in bufs], bufs


def _ids(kind: str, t: int, k: int, e: int, dtype, g: torch.Generator) -> torch.Tensor:
    if kind == "random":  # many ties where T * k > E
        ids = torch.randint(0, e, (t, k), generator=g, device="cuda")
    elif kind == "hot":  # a few hot experts, the others empty
        ids = torch.randint(0, min(e, 3), (t, k), generator=g, device="cuda") * (e // 3 or 1)
        ids = ids.clamp(max=e - 1)
    elif kind == "topk":  # distinct per token, as a router gives them
        logits = torch.randn(t, e, generator=g, device="cuda")
        ids = logits.topk(min(k, e), dim=-1).indices.repeat(1, -(-k // e))[:, :k]
    else:  # every pair on the last expert
        ids = torch.full((t, k), e - 1, device="cuda")
    return ids.to(dtype)


def _check(ids: torch.Tensor, e: int, what: str) -> None:
    t, k = ids.shape
    want = routing.route(ids, e, method="torch")
    out, _ = _poisoned(t * k, e)
    got = sorting.sort_pairs(ids, k, e, out=out)
    for name, a, b in zip(want._fields, want, got, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), (what, name, a.tolist(), b.tolist())


@pytest.mark.parametrize("k", TOP_K)
@pytest.mark.parametrize("t", TOKENS)
def test_kernel_equals_torch_route(t, k):
    n = t * k
    g = torch.Generator(device="cuda").manual_seed(100 * t + k)
    if n > sorting.MAX_PAIRS:  # route keeps torch's path there
        assert not sorting.kernel_applies(_ids("random", t, k, 8, torch.int64, g), 8)
        return
    for e in EXPERTS:
        for dtype in DTYPES:
            for kind in ("random", "hot", "topk", "one"):
                _check(_ids(kind, t, k, e, dtype, g), e, (t, k, e, dtype, kind))


@pytest.mark.parametrize("t, k, e", [(sorting.MAX_PAIRS // 8, 8, 256),
                                     (sorting.MAX_PAIRS, 1, sorting.MAX_EXPERTS),
                                     (sorting.MAX_PAIRS // 4, 4, 1),
                                     (257, 3, 7), (33, 8, sorting.MAX_EXPERTS),
                                     (sorting.MAX_PAIRS // 2 - 1, 2, 1000)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_at_the_limits(t, k, e, dtype):
    """n = MAX_PAIRS exactly (four rounds per warp), E = MAX_EXPERTS, one expert, sizes
    that fill no round or warp evenly."""
    g = torch.Generator(device="cuda").manual_seed(t + k + e)
    for kind in ("random", "hot", "one"):
        _check(_ids(kind, t, k, e, dtype, g), e, (t, k, e, dtype, kind))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ids_out_of_range_write_only_inside_the_outputs(dtype):
    """Negative ids and ids >= E: nothing written outside the four outputs (guards stay
    POISON), every output written, offsets torch's, the pairs a stable sort of the ids
    clamped to [-1, E] (the kernel's documented order)."""
    t, k, e = 40, 4, 16
    g = torch.Generator(device="cuda").manual_seed(5)
    ids = torch.randint(-4, e + 4, (t, k), generator=g, device="cuda")
    if dtype == torch.int64:
        ids[0, 0], ids[1, 1] = 1 << 40, -(1 << 40)
    ids = ids.to(dtype)
    guard = 64
    out, bufs = _poisoned(t * k, e, guard)
    order, inverse, token, offsets = sorting.sort_pairs(ids, k, e, out=out)
    for b in bufs:
        assert (b[:guard] == POISON).all() and (b[-guard:] == POISON).all()
    flat = ids.reshape(-1).long()
    want = routing.route(ids, e, method="torch")
    assert torch.equal(offsets, want.offsets)
    assert torch.equal(order, torch.sort(flat.clamp(-1, e), stable=True).indices)
    assert torch.equal(inverse[order], torch.arange(t * k, device="cuda"))
    assert torch.equal(token, order // k)


def test_route_picks_the_kernel_without_a_host_sync():
    g = torch.Generator(device="cuda").manual_seed(9)
    ids = torch.randint(0, 32, (4, 4), generator=g, device="cuda")
    assert sorting.kernel_applies(ids, 32)
    big = torch.randint(0, 32, (sorting.MAX_PAIRS + 1, 1), generator=g, device="cuda")
    assert not sorting.kernel_applies(big, 32)
    routing.route(ids, 32)  # compiled or loaded outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        auto = routing.route(ids, 32)
        kern = routing.route(ids, 32, method="kernel")
        over = routing.route(big, 32)  # torch's path
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = routing.route(ids, 32, method="torch")
    for a, b, c in zip(auto, kern, want, strict=True):
        assert torch.equal(a, c) and torch.equal(b, c)
    assert torch.equal(over.offsets, routing.route(big, 32, method="torch").offsets)


def test_non_contiguous_ids():
    g = torch.Generator(device="cuda").manual_seed(3)
    wide = torch.randint(0, 8, (12, 8), generator=g, device="cuda")
    for ids in (wide[:, ::2], wide[:, :1], wide.t()):
        _check(ids, 8, tuple(ids.stride()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_graph_replays_with_new_ids_in_the_same_buffers(dtype):
    t, k, e = 16, 8, 128
    g = torch.Generator(device="cuda").manual_seed(11)
    ids = torch.randint(0, e, (t, k), generator=g, device="cuda").to(dtype)
    out, _ = _poisoned(t * k, e)
    graph, got = capture_graph(lambda: sorting.sort_pairs(ids, k, e, out=out), warmups=2)
    auto_graph, auto = capture_graph(lambda: routing.route(ids, e), warmups=2)
    for seed in (12, 13):
        new = torch.randint(0, min(e, 5 * seed - 50), (t, k), generator=g, device="cuda")
        ids.copy_(new.to(dtype))
        for o in out:
            o.fill_(POISON)
        graph.replay()
        auto_graph.replay()
        torch.cuda.synchronize()
        want = routing.route(ids, e, method="torch")
        for name, a, b, c in zip(want._fields, want, got, auto, strict=True):
            assert torch.equal(a, b) and torch.equal(a, c), (seed, name)
        assert all(b.data_ptr() == o.data_ptr() for b, o in zip(got, out, strict=True))
