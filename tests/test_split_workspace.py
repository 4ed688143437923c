"""The split-K workspace on the host (``cute_fp4.run.split_workspace``), on the CPU: one
buffer per (device, stream), reused while it is large enough, replaced by a larger one
(counters and partials at least doubled) when not, its header word saying where the
partials start (past every counter, 16-byte aligned) and its counters zero."""

from __future__ import annotations

import torch

from cute_fp4 import catalogue
from cute_fp4.kernels.epilogue import SPLIT_HEADER
from cute_fp4.kernels.launch import split_workspace_needs
from cute_fp4.run import split_workspace


class _Kernel:
    def __init__(self, split_k: int, stream: int = 0):
        self.schedule = catalogue.get("sm90_decode_swapab").replace(split_k=split_k)
        self.split_slots, self.split_values, self.stream = 128, 4, stream

    def stream_handle(self, index) -> int:
        return self.stream


def test_workspace_reuse_growth_and_header():
    dev = torch.device("cpu")
    k = _Kernel(4, stream=11)
    a = split_workspace(k, 1, 1024, dev)
    assert split_workspace(k, 1, 1024, dev).data_ptr() == a.data_ptr()
    counters, partials = split_workspace_needs(4, 1, 1024, (8, 64), 128, 4)
    first = int(a[0])
    assert first % 4 == 0 and first - SPLIT_HEADER >= counters
    assert a.numel() - first >= partials and not a[SPLIT_HEADER:first].any()
    big = split_workspace(k, 16, 8192, dev)  # more tiles: a new, larger buffer
    assert big.data_ptr() != a.data_ptr() and int(big[0]) >= 2 * (first - SPLIT_HEADER)
    assert split_workspace(k, 1, 1024, dev).data_ptr() == big.data_ptr()  # fits: reused
    other = split_workspace(_Kernel(4, stream=12), 1, 1024, dev)  # another stream
    assert other.data_ptr() != big.data_ptr()


def test_private_workspaces_are_not_kept():
    from cute_fp4.run import private_workspaces

    dev = torch.device("cpu")
    k = _Kernel(2, stream=21)
    kept = split_workspace(k, 1, 1024, dev)
    counters, partials = split_workspace_needs(2, 1, 1024, (8, 64), 128, 4)
    with private_workspaces():
        own = split_workspace(k, 1, 1024, dev)
        again = split_workspace(k, 1, 1024, dev)
    assert len({own.data_ptr(), again.data_ptr(), kept.data_ptr()}) == 3
    for ws in (own, again):
        first = int(ws[0])
        assert first % 4 == 0 and first - SPLIT_HEADER >= counters
        assert ws.numel() - first >= partials and not ws[SPLIT_HEADER:first].any()
    assert split_workspace(k, 1, 1024, dev).data_ptr() == kept.data_ptr()


def test_private_workspace_copies_the_template_an_eager_launch_made():
    """A private (captured) workspace is its header and counters copied from the template
    of its counter capacity, which only an eager launch makes; without one it is zeroed
    and filled (two kernels in a graph instead of one copy)."""
    from cute_fp4 import run

    dev = torch.device("cpu")
    k = _Kernel(3, stream=31)
    m, n = 5, 64 * 700  # a counter capacity no other test uses
    counters, partials = split_workspace_needs(3, m, n, (8, 64), 128, 4)
    cap = run._counter_capacity(counters)
    run._TEMPLATES.pop((dev.index, cap), None)
    with run.private_workspaces():
        bare = split_workspace(k, m, n, dev)  # no template yet: made and filled
        assert (dev.index, cap) not in run._TEMPLATES
    split_workspace(k, m, n, dev)  # eager: makes the template
    tpl = run._TEMPLATES[(dev.index, cap)]
    assert int(tpl[0]) == tpl.numel() == SPLIT_HEADER + cap and not tpl[1:].any()
    with run.private_workspaces():
        own = split_workspace(k, m, n, dev)
    assert torch.equal(own[:tpl.numel()], tpl) and own.numel() == tpl.numel() + partials
    assert int(bare[0]) >= SPLIT_HEADER + counters and not bare[SPLIT_HEADER:int(bare[0])].any()


def test_partial_layout_fills_the_workspace_past_the_counters():
    """store_split_k's layout (the kernel runs split_partial_offset): every (split, tile,
    slot, value) has its own word, all past the counters and inside what the host
    allocates; a thread's vectors are aligned; a warp's 32 slots write one contiguous run."""
    from cute_fp4.kernels.epilogue import split_partial_offset, split_vector

    for tiles, slots, nv, split_k in ((3, 128, 8, 3), (2, 256, 32, 2), (5, 64, 6, 4),
                                      (1, 32, 1, 8)):
        vec = split_vector(nv)
        counters, partials = split_workspace_needs(split_k, tiles, 1, (1, 1), slots, nv)
        first = SPLIT_HEADER + -(-counters // 4) * 4
        seen = set()
        for s in range(split_k):
            for t in range(tiles):
                for q in range(slots):
                    for i in range(nv):
                        o = split_partial_offset(first, tiles, t, q, slots, s, i, nv, vec)
                        assert first <= o < first + partials
                        if i % vec == 0:
                            assert o % vec == 0
                        seen.add(o)
                warp = [split_partial_offset(first, tiles, t, q, slots, s, 0, nv, vec)
                        for q in range(min(32, slots))]
                assert warp == list(range(warp[0], warp[0] + vec * len(warp), vec))
        assert len(seen) == partials == split_k * tiles * slots * nv
