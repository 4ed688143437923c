"""Host side: run a compiled kernel on torch tensors.

:func:`run_compiled` checks the operands (``cute_fp4.operands``), checks the plan for the
shape, allocates the output, finds the split-K workspace (:func:`split_workspace`) and
launches (split-K partials are reduced by the kernel itself); :func:`poisoned_check`
runs into a NaN-filled output and compares with the exact reference.
``CompiledGemm.__call__`` is :func:`run_compiled`; the API layer (``gemm``, ``validate``,
``bench``, ``tune``) builds on these and nothing here imports it.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

from cute_fp4 import reference
from cute_fp4.errors import InputError
from cute_fp4.nvfp4 import NVFP4Tensor
from cute_fp4.operands import alpha_tensor, check_operands, out_dtype_of
from cute_fp4.packed import PackedNVFP4Weight
from cute_fp4.schedule import Mainloop, Problem, Schedule

_WORKSPACES: dict[tuple[int, int], tuple[torch.Tensor, int, int]] = {}
_TEMPLATES: dict[tuple[int, int], torch.Tensor] = {}  # (device, counter capacity) -> header
_PRIVATE = threading.local()  # .on: launches get workspaces of their own (private_workspaces)


@contextlib.contextmanager
def private_workspaces():
    """Launches inside get a split-K workspace of their own, not the stream's cached one:
    for the custom ops' bodies, which torch.compile's CUDA graphs (cudagraph trees) run
    with allocations going to their own memory pool, where a buffer kept past the call is
    refused ("tensors in the cudagraph pool not tracked as outputs")."""
    before = getattr(_PRIVATE, "on", False)
    _PRIVATE.on = True
    try:
        yield
    finally:
        _PRIVATE.on = before


def split_workspace(kernel, m: int, n: int, device: torch.device) -> torch.Tensor:
    """The split-K workspace of ``kernel`` for an ``m x n`` output on ``device``
    (``epilogue.store_split_k``'s layout): word 0 = where the partials start, then int32
    arrival counters that every launch leaves at zero, then FP32 partials. One buffer per
    (device, stream), so that launches on one stream share it in stream order and
    launches on two streams never do; it is replaced by a larger one (counters and
    partials at least doubled) when a launch needs more (the old one goes back to torch's
    allocator in stream order). No device access unless a buffer is made (so no sync); a
    launch being captured into a CUDA graph gets a buffer of its own, which no other launch
    shares and whose header and counters the graph copies in on every replay (its partials
    need no initialisation)."""
    from cute_fp4.kernels.launch import split_workspace_needs

    s = kernel.schedule
    counters, partials = split_workspace_needs(s.split_k, m, n, (s.tile.m, s.tile.n),
                                               kernel.split_slots, kernel.split_values)
    private = getattr(_PRIVATE, "on", False)
    if private or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        # a CUDA-graph capture (and a custom op's body) gets its own workspace, set up by
        # a node of the graph and not kept here (see private_workspaces)
        return _private_workspace(counters, partials, device)
    key = (device.index, kernel.stream_handle(device.index))
    held = _WORKSPACES.get(key)
    if held is not None:
        ws, n_counters, n_partials = held
        if n_counters >= counters and n_partials >= partials:
            _header_template(n_counters, device)
            return ws
        counters = max(counters, 2 * n_counters)
        partials = max(partials, 2 * n_partials)
    made = _WORKSPACES[key] = _new_workspace(counters, partials, device)
    _header_template(made[1], device)
    return made[0]


def _counter_capacity(counters: int) -> int:
    """Counters rounded up to a power of two (>= 64): few distinct header templates."""
    return max(64, 1 << (counters - 1).bit_length())


def _header_template(counters: int, device) -> torch.Tensor | None:
    """The first ``SPLIT_HEADER + capacity`` words of a fresh workspace (word 0 = where the
    partials start, zero counters), kept per (device, capacity) and made only outside
    CUDA-graph captures and custom-op bodies (their allocations belong to the graph's
    pool); None when there is none for that capacity. An eager launch makes the one its
    own capture would need, as the warm-up run before a capture does."""
    cap = _counter_capacity(counters)
    key = (device.index, cap)
    tpl = _TEMPLATES.get(key)
    if tpl is None and not getattr(_PRIVATE, "on", False) and not (
            device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        tpl = _TEMPLATES[key] = _new_workspace(cap, 0, device)[0]
    return tpl


def _private_workspace(counters: int, partials: int, device) -> torch.Tensor:
    """A workspace of its own: its partials uninitialised (the kernel writes them before it
    reads them), its header and counters copied from the template (one memory-copy node in
    a CUDA graph instead of two fill kernels), or filled when there is no template."""
    tpl = _TEMPLATES.get((device.index, _counter_capacity(counters)))
    if tpl is None:
        return _new_workspace(counters, partials, device)[0]
    ws = torch.empty(tpl.numel() + partials, dtype=torch.int32, device=device)
    ws[:tpl.numel()].copy_(tpl)
    return ws


def _new_workspace(counters: int, partials: int, device) -> tuple[torch.Tensor, int, int]:
    """(buffer, counter capacity, partial capacity): zeroed, word 0 = where partials start
    (a device fill, not a host copy: allowed while a graph is captured)."""
    from cute_fp4.kernels.epilogue import SPLIT_HEADER

    counters = -(-counters // 4) * 4  # partials 16-byte aligned
    first = SPLIT_HEADER + counters
    ws = torch.zeros(first + partials, dtype=torch.int32, device=device)
    ws[:1].fill_(first)
    return ws, counters, partials


def run_compiled(kernel, a, b: NVFP4Tensor, out=None, alpha=None) -> torch.Tensor:
    """Validate, allocate, launch ``kernel`` (a CompiledGemm).

    A ``mainloop=rs_packed`` kernel reads a fragment-order PackedNVFP4Weight: a plain
    NVFP4Tensor ``b`` is packed here on every call (so validation harnesses run those
    schedules unchanged; ``gemm`` users pack once, cute_fp4.packed.repack)."""
    check_b = b
    if isinstance(b, PackedNVFP4Weight):
        check_b = NVFP4Tensor._unchecked(b.data[:b.shape[0]], b.scale, b.global_scale, b.shape)
    elif kernel.schedule.mainloop is Mainloop.RS_PACKED and isinstance(b, NVFP4Tensor):
        b = PackedNVFP4Weight.from_tensor(b)
    dims = check_operands(a, check_b, out, alpha, kernel.out_dtype)
    return run_checked(kernel, a, b, out, alpha, dims)


def run_checked(kernel, a, b: NVFP4Tensor, out, alpha, dims) -> torch.Tensor:
    """:func:`run_compiled` after :func:`check_operands` returned ``dims``. The plan check
    is remembered per kernel and shape (``CompiledGemm.check_plan``)."""
    m, n, k, a_format = dims
    if kernel.schedule.scheduler.grouped:
        raise InputError(f"schedule {kernel.schedule.name or kernel.schedule.label()} is a "
                         "grouped (MoE) schedule: call cute_fp4.grouped_gemm(a, b, offsets)")
    if (kernel.schedule.mainloop is Mainloop.RS_PACKED) != isinstance(b, PackedNVFP4Weight):
        raise InputError(f"schedule {kernel.schedule.name or kernel.schedule.label()} reads "
                         f"{'a packed' if isinstance(b, NVFP4Tensor) else 'the plain'} weight "
                         f"layout but b is a {type(b).__name__}: rs_packed schedules take "
                         "cute_fp4.packed.repack(w), the others the plain NVFP4Tensor")
    if a_format != kernel.signature.a_format:
        raise InputError(f"kernel was compiled for A in {kernel.signature.a_format}, "
                         f"got {a_format}")
    kernel.check_plan(dims)
    alpha_t = alpha_tensor(a, b, alpha)
    dev = b.data.device
    result = out if out is not None else torch.empty((m, n), dtype=kernel.out_dtype, device=dev)
    a_data, a_scale = (a, None) if a_format != "nvfp4" else (a.data, a.scale)
    ws = split_workspace(kernel, m, n, dev) if kernel.schedule.split_k > 1 else None
    kernel.launch(a_data, a_scale, b.data, b.scale, result, alpha_t, ws)
    return result


@functools.lru_cache(maxsize=4096)
def check_plan(s: Schedule, p: Problem) -> None:
    """``plan(s, p).raise_if_invalid()``, memoised: plan() is pure but costs ~150 us of
    Python, which at decode sizes is several times the kernel. Refusals are not cached
    (the exception propagates), so they are re-raised with their message every call.
    (The launch path uses the cheaper per-kernel ``CompiledGemm.check_plan``.)"""
    from cute_fp4.plan import plan

    plan(s, p).raise_if_invalid()


def poisoned_check(kernel, a, b: NVFP4Tensor) -> reference.CheckResult:
    """Run ``kernel`` into an output filled with NaN (so an unwritten element fails) and
    compare it with the exact reference."""
    m, n = a.shape[0], b.shape[0]
    out = torch.full((m, n), float("nan"), dtype=out_dtype_of(kernel.schedule),
                     device=b.device)
    run_compiled(kernel, a, b, out=out)
    torch.cuda.synchronize()
    return reference.check(out, a, b)
