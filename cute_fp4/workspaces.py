"""Split-K workspaces: where a launch's partial sums and arrival counters live, and what a
launch may keep between calls (:func:`split_workspace`, :func:`may_keep`,
:class:`private_workspaces`). Eager launches share one buffer per stream (in stream order),
a CUDA-graph capture takes counters no other launch shares (from a reserve that eager
launches fill), a custom op's body under torch.compile's graphs allocates its own. The
launch path (``cute_fp4.run``) and the bindings (``cute_fp4.bindings``) use it; the layout
of a workspace is ``kernels.epilogue.store_split_k``'s."""

from __future__ import annotations

import threading

import torch

_WORKSPACES: dict[tuple[int, int], tuple[torch.Tensor, int, int]] = {}
# (device, counter capacity) -> zeroed counter blocks ready for captured launches, and the
# blocks captured launches took (their graphs may replay for the rest of the process)
_RESERVE: dict[tuple[int, int], list[torch.Tensor]] = {}
_CAPTURED: list[torch.Tensor] = []
# eager launches' answers, (stream, kernel, m, n) -> (generation, pair); the generation
# moves when a workspace is made or a reserve is drawn from, which voids them all
_EAGER: dict[tuple, tuple[int, tuple[torch.Tensor, torch.Tensor]]] = {}
_GENERATION = [0]
_PRIVATE = threading.local()  # .on: launches get workspaces of their own (private_workspaces)


class private_workspaces:  # noqa: N801 (used as a function: ``with private_workspaces():``)
    """Launches inside get a split-K workspace of their own, not the stream's cached one,
    off the default stream (:func:`may_keep`): for the custom ops' bodies, which
    torch.compile's CUDA graphs (cudagraph trees) run with allocations going to their own
    memory pool, where a buffer kept past the call is refused ("tensors in the cudagraph
    pool not tracked as outputs"). A class, not a generator: it wraps every op call."""

    __slots__ = ("_before",)

    def __enter__(self) -> None:
        self._before = _private()
        _PRIVATE.on = True

    def __exit__(self, *exc) -> None:
        _PRIVATE.on = self._before


def split_workspace(kernel, m: int, n: int, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K workspace of ``kernel`` for an ``m x n`` output on ``device``
    (``epilogue.store_split_k``'s layout), as the kernel's (counters, partials) pair: the
    counters' word 0 says where the partials start, then int32 arrival counters that every
    launch leaves at zero; FP32 partials (as int32 words) need no initialisation.

    Eager launches: one buffer (both of the pair) per (device, stream), so that launches on
    one stream share it in stream order and launches on two streams never do; replaced by
    a larger one (counters and partials at least doubled) when a launch needs more (the old
    one goes back to torch's allocator in stream order). No device access unless a buffer
    is made (so no sync). A launch being captured into a CUDA graph gets a workspace no
    other launch shares: zeroed counters taken from a reserve that eager launches fill (no
    node in the graph; kept for the life of the process, a few hundred bytes each) and
    partials from the graph's pool; without a reserve, one buffer zeroed by the graph on
    every replay. In a custom op's body (:func:`private_workspaces`, not capturing) the
    stream's buffer when one made outside is large enough (allocated outside any graph
    pool, shared in stream order as eagerly), else a zeroed buffer of its own; on the
    default stream it does as eager launches do (:func:`may_keep`)."""
    if capturing(device):
        return _own_workspace(*_needs(kernel, m, n), device, True)
    stream = (device.index, kernel.stream_handle(device.index))
    if not may_keep(stream[1]):  # reuse the stream's buffer, never make one to keep
        counters, partials = _needs(kernel, m, n)
        held = _WORKSPACES.get(stream)
        if _fits(held, counters, partials):
            return held[0], held[0]
        return _own_workspace(counters, partials, device, False)
    memo = _EAGER.get((stream, kernel, m, n))
    if memo is not None and memo[0] == _GENERATION[0]:
        return memo[1]
    counters, partials = _needs(kernel, m, n)
    held = _WORKSPACES.get(stream)
    if not _fits(held, counters, partials):
        grown = (counters, partials) if held is None else (
            max(counters, 2 * held[1]), max(partials, 2 * held[2]))
        held = _WORKSPACES[stream] = _new_workspace(*grown, device)
        _GENERATION[0] += 1
    _fill_reserve(counters, device)  # what a capture of this launch takes
    if len(_EAGER) >= 4096:
        _EAGER.clear()
    pair = _EAGER[(stream, kernel, m, n)] = (_GENERATION[0], (held[0], held[0]))
    return pair[1]


def _needs(kernel, m: int, n: int) -> tuple[int, int]:
    from cute_fp4.kernels.launch import split_workspace_needs

    s = kernel.schedule
    return split_workspace_needs(s.split_k, m, n, (s.tile.m, s.tile.n), kernel.split_slots,
                                 kernel.split_values)


def _fits(held, counters: int, partials: int) -> bool:
    """Whether a held (buffer, counters, partials) workspace serves a launch's needs."""
    return held is not None and held[1] >= counters and held[2] >= partials


def _own_workspace(counters: int, partials: int, device, capturing: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A captured launch's or a custom-op body's workspace (see :func:`split_workspace`)."""
    block = _reserved_counters(counters, device) if capturing else None
    if block is not None:
        return block, torch.empty(partials, dtype=torch.int32, device=device)
    ws = _new_workspace(counters, partials, device)[0]
    return ws, ws


_RESERVE_BATCH = 64  # counter blocks made at once when a reserve runs low


def capturing(device: torch.device) -> bool:
    """Whether a launch on ``device`` (a torch device) is being captured into a graph."""
    return device.type == "cuda" and capturing_now()


def _counter_capacity(counters: int) -> int:
    """Counters rounded up to a power of two (>= 64): a few reserves serve every launch."""
    return max(64, 1 << (counters - 1).bit_length())


def _fill_reserve(counters: int, device) -> None:
    """Eager launches keep :data:`_RESERVE_BATCH` / 2 or more zeroed counter blocks of
    their capacity ready for captures (called only where :func:`may_keep` allows: never
    while an allocation could belong to a graph's pool)."""
    from cute_fp4.kernels.epilogue import SPLIT_HEADER

    key = (device.index, _counter_capacity(counters))
    free = _RESERVE.setdefault(key, [])
    if len(free) >= _RESERVE_BATCH // 2:
        return
    width = SPLIT_HEADER + key[1]  # word 0 = 0: the partials are a buffer of their own
    blocks = torch.zeros(_RESERVE_BATCH, width, dtype=torch.int32, device=device)
    free.extend(blocks.unbind(0))


def _reserved_counters(counters: int, device) -> torch.Tensor | None:
    """A zeroed counter block for a captured launch, kept alive from now on (the graph
    may replay at any time), or None when the reserve is empty."""
    free = _RESERVE.get((device.index, _counter_capacity(counters)))
    if not free:
        return None
    block = free.pop()
    _CAPTURED.append(block)
    _GENERATION[0] += 1  # the next eager launch refills the reserve
    return block


def _new_workspace(counters: int, partials: int, device) -> tuple[torch.Tensor, int, int]:
    """(buffer, counter capacity, partial capacity): zeroed, word 0 = where partials start
    (a device fill, not a host copy: allowed while a graph is captured)."""
    from cute_fp4.kernels.epilogue import SPLIT_HEADER

    counters = -(-counters // 4) * 4  # partials 16-byte aligned
    first = SPLIT_HEADER + counters
    ws = torch.zeros(first + partials, dtype=torch.int32, device=device)
    ws[:1].fill_(first)
    return ws, counters, partials


def capturing_now() -> bool:
    """Whether torch's current CUDA stream is being captured into a graph."""
    return torch._C._cuda_isCurrentStreamCapturing()


def _private() -> bool:
    """Inside :func:`private_workspaces` (a custom op's body)."""
    return getattr(_PRIVATE, "on", False)


def may_keep(stream_handle: int) -> bool:
    """Whether a buffer made now on the stream ``stream_handle`` may be kept past the call
    (a split-K workspace, reserve blocks, a binding's): always outside custom-op bodies
    (captures are tested apart); inside one only on the legacy default stream (handle 0).
    torch.compile's CUDA graphs (cudagraph trees) warm up and record on a stream of their
    own, under which every allocation of the thread goes to the graphs' pool, where a
    buffer kept past the call is refused or overwritten; the same op body called on the
    default stream (torch.compile without CUDA graphs) allocates outside any pool."""
    return stream_handle == 0 or not _private()

def generation() -> int:
    """Moves whenever a workspace is made or a reserve block taken: a binding made at
    another generation no longer holds its workspace (``bindings.BoundLaunch``)."""
    return _GENERATION[0]


__all__ = ["capturing", "capturing_now", "generation", "may_keep", "private_workspaces",
           "split_workspace"]
