"""The split-K workspace on the host (``cute_fp4.workspaces.split_workspace``), on the CPU: one
buffer per (device, stream), reused while it is large enough, replaced by a larger one
(counters and partials at least doubled) when not, its header word saying where the
partials start (past every counter, 16-byte aligned) and its counters zero."""

from __future__ import annotations

import torch

from cute_fp4 import catalogue, workspaces
from cute_fp4.kernels.epilogue import SPLIT_HEADER
from cute_fp4.kernels.launch import split_workspace_needs
from cute_fp4.workspaces import split_workspace


class _Kernel:
    def __init__(self, split_k: int, stream: int = 0):
        self.schedule = catalogue.get("sm90_decode_swapab").replace(split_k=split_k)
        self.split_slots, self.split_values, self.stream = 128, 4, stream

    def stream_handle(self, index) -> int:
        return self.stream


def test_workspace_reuse_growth_and_header():
    dev = torch.device("cpu")
    k = _Kernel(4, stream=11)
    a, a_work = split_workspace(k, 1, 1024, dev)
    assert a_work is a  # eager: one buffer, partials past the counters
    assert split_workspace(k, 1, 1024, dev)[0].data_ptr() == a.data_ptr()
    counters, partials = split_workspace_needs(4, 1, 1024, (8, 64), 128, 4)
    first = int(a[0])
    assert first % 4 == 0 and first - SPLIT_HEADER >= counters
    assert a.numel() - first >= partials and not a[SPLIT_HEADER:first].any()
    big, _ = split_workspace(k, 16, 8192, dev)  # more tiles: a new, larger buffer
    assert big.data_ptr() != a.data_ptr() and int(big[0]) >= 2 * (first - SPLIT_HEADER)
    assert split_workspace(k, 1, 1024, dev)[0].data_ptr() == big.data_ptr()  # fits: reused
    other, _ = split_workspace(_Kernel(4, stream=12), 1, 1024, dev)  # another stream
    assert other.data_ptr() != big.data_ptr()


def test_private_workspaces_reuse_but_never_keep():
    """A custom op's body reuses the stream's buffer made outside when it is large enough,
    and otherwise gets a zeroed buffer of its own, which is not kept."""
    from cute_fp4.workspaces import private_workspaces

    dev = torch.device("cpu")
    k = _Kernel(2, stream=21)
    counters, partials = split_workspace_needs(2, 1, 1024, (8, 64), 128, 4)
    with private_workspaces():  # no buffer on this stream yet
        own, own_work = split_workspace(k, 1, 1024, dev)
        again, _ = split_workspace(k, 1, 1024, dev)
    assert own_work is own and own.data_ptr() != again.data_ptr()
    for ws in (own, again):
        first = int(ws[0])
        assert first % 4 == 0 and first - SPLIT_HEADER >= counters
        assert ws.numel() - first >= partials and not ws[SPLIT_HEADER:first].any()
    kept, _ = split_workspace(k, 1, 1024, dev)  # eager: the stream's buffer
    assert kept.data_ptr() not in (own.data_ptr(), again.data_ptr())
    with private_workspaces():
        reused, reused_work = split_workspace(k, 1, 1024, dev)
        larger, _ = split_workspace(k, 16, 8192, dev)  # does not fit: its own, not kept
    assert reused.data_ptr() == kept.data_ptr() and reused_work is reused
    assert larger.data_ptr() != kept.data_ptr()
    assert split_workspace(k, 1, 1024, dev)[0].data_ptr() == kept.data_ptr()


def test_captured_launches_take_zeroed_counters_from_the_reserve(monkeypatch):
    """Under a capture (modelled: the capture test reads True), each launch takes a zeroed
    counter block of its own from the reserve eager launches fill, kept alive, with word 0
    = 0 (its partials are a buffer of their own); an empty reserve falls back to one
    zeroed buffer."""

    dev = torch.device("cpu")
    k = _Kernel(3, stream=31)
    m, n = 5, 64 * 700  # a counter capacity no other test uses
    counters, partials = split_workspace_needs(3, m, n, (8, 64), 128, 4)
    cap = workspaces._counter_capacity(counters)
    workspaces._RESERVE.pop((dev.index, cap), None)
    monkeypatch.setattr(workspaces, "capturing", lambda device: True)
    bare, bare_work = split_workspace(k, m, n, dev)  # no reserve yet: one zeroed buffer
    assert bare_work is bare and int(bare[0]) >= SPLIT_HEADER + counters
    monkeypatch.setattr(workspaces, "capturing", lambda device: False)
    split_workspace(k, m, n, dev)  # eager: fills the reserve
    assert len(workspaces._RESERVE[(dev.index, cap)]) == workspaces._RESERVE_BATCH
    monkeypatch.setattr(workspaces, "capturing", lambda device: True)
    got = [split_workspace(k, m, n, dev) for _ in range(3)]
    assert len({c.data_ptr() for c, _ in got}) == 3
    for c, w in got:
        assert c.numel() == SPLIT_HEADER + cap >= SPLIT_HEADER + counters and not c.any()
        assert w.numel() == partials and w.data_ptr() != c.data_ptr()
        assert any(c is kept for kept in workspaces._CAPTURED)
    assert len(workspaces._RESERVE[(dev.index, cap)]) == workspaces._RESERVE_BATCH - 3


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
