"""Host side: run a compiled kernel on torch tensors.

:func:`run_compiled` checks the operands (``cute_fp4.operands``), checks the plan for the
shape, allocates the output, finds the split-K workspace (:func:`split_workspace`) and
launches (split-K partials are reduced by the kernel itself); :func:`poisoned_check`
runs into a NaN-filled output and compares with the exact reference.
``CompiledGemm.__call__`` is :func:`run_compiled`; the API layer (``gemm``, ``validate``,
``bench``, ``tune``) builds on these and nothing here imports it.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref

import torch

from cute_fp4 import reference
from cute_fp4.errors import InputError
from cute_fp4.nvfp4 import NVFP4Tensor
from cute_fp4.operands import alpha_tensor, check_operands, out_dtype_of
from cute_fp4.packed import PackedNVFP4Weight
from cute_fp4.schedule import Problem, Schedule

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
    if _capturing(device):
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


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and _capturing_now()


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


def run_compiled(kernel, a, b: NVFP4Tensor, out=None, alpha=None) -> torch.Tensor:
    """Validate, allocate, launch ``kernel`` (a CompiledGemm).

    A kernel whose mainloop reads the packed weight (rs_packed, stream) takes a
    fragment-order PackedNVFP4Weight: a plain NVFP4Tensor ``b`` is packed here on every
    call (so validation harnesses run those
    schedules unchanged; ``gemm`` users pack once, cute_fp4.packed.repack)."""
    check_b = b
    if isinstance(b, PackedNVFP4Weight):
        check_b = NVFP4Tensor._unchecked(b.data[:b.shape[0]], b.scale, b.global_scale, b.shape)
    elif kernel.schedule.mainloop.reads_packed and isinstance(b, NVFP4Tensor):
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
    if kernel.schedule.mainloop.reads_packed != isinstance(b, PackedNVFP4Weight):
        raise InputError(f"schedule {kernel.schedule.name or kernel.schedule.label()} reads "
                         f"{'a packed' if isinstance(b, NVFP4Tensor) else 'the plain'} weight "
                         f"layout but b is a {type(b).__name__}: rs_packed schedules take "
                         "cute_fp4.packed.repack(w) (so do stream schedules), the others "
                         "the plain NVFP4Tensor")
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


class BoundLaunch:
    """A GEMM kernel's launch with its weight, alpha, sizes and split-K workspace fixed
    (W4A16; W4A4 with A's block scales given per call):
    :func:`run_checked`'s checks and argument building done once, so a repeated call
    (a module's forward at one M) pays one validity test and the TVM-FFI call
    (:func:`bind`). The caller checks the activation and allocates the output as before;
    :meth:`launch` returns False, launching nothing, when the binding no longer holds: its
    time is up (``expires``, ``schedule="auto"`` is resolved again), or, for a split-K
    kernel, the stream differs, the stream's workspace was replaced or a reserve block was
    taken (:data:`_GENERATION`), a CUDA graph is being captured or a custom op's body runs
    off the default stream (those take workspaces of their own: :func:`may_keep`)."""

    __slots__ = ("kernel", "key", "_ffi", "_stream_of", "_dev", "_head", "_tail", "_b",
                 "_stream", "_split", "_generation", "_expires")

    def __init__(self, kernel, key, args: tuple, dev: int, expires: float):
        """``args``: the kernel's raw arguments of the launch being bound
        (``CompiledGemm.raw_args``); A's and C's addresses and the stream are the call's."""
        from cute_fp4.kernels.launch import RAW_A, RAW_OUT, RAW_STREAM

        self.kernel, self.key = kernel, key
        self._ffi, self._stream_of, self._dev = kernel._ffi, kernel._stream_of, dev
        self._head, self._tail = args[RAW_A + 1:RAW_OUT], args[RAW_OUT + 1:RAW_STREAM]
        self._b, self._stream = args[RAW_A + 2], args[RAW_STREAM]  # B's data, the stream
        self._split = kernel.schedule.split_k > 1
        self._generation, self._expires = _GENERATION[0], expires

    def launch(self, a: torch.Tensor, b, out: torch.Tensor) -> bool:
        """Launch on ``a`` (the checked activation, [M, K] memory) and ``b`` (the weight it
        was bound to: its data must still be where it was) into ``out`` ([M, N] memory)
        on the current stream, or return False (nothing launched)."""
        return self.launch_at(a, b.data.data_ptr(), out)

    def launch_at(self, a: torch.Tensor, b_ptr: int, out: torch.Tensor) -> bool:
        """:meth:`launch` with the weight's data given by its address."""
        return self.launch_ptrs(a.data_ptr(), None, b_ptr, out.data_ptr())

    def accepts(self, b_ptr: int) -> int | None:
        """The current stream's handle if a launch on the weight data at ``b_ptr`` would go
        through now, else None (what :meth:`launch_ptrs` tests first; a W4A4 forward asks
        before launching its activation kernels, which the full path would repeat)."""
        if b_ptr != self._b:
            return None
        stream = self._stream_of(self._dev)
        if self._split and (stream != self._stream or self._generation != _GENERATION[0]
                            or _capturing_now() or not may_keep(stream)):
            return None
        if time.monotonic() >= self._expires:
            return None
        return stream

    def launch_ptrs(self, a_ptr: int, a_scale_ptr: int | None, b_ptr: int, out_ptr: int,
                    alpha_ptr: int | None = None) -> bool:
        """:meth:`launch` on raw addresses: A's data, A's block scales (W4A4 bindings,
        :func:`bind` with ``a_scale_per_call``; None: the bound slot), the weight's data,
        C's, and alpha's (a float32 device scalar computed per call, as a dynamic activation
        scale gives it; None: the bound alpha)."""
        stream = self.accepts(b_ptr)
        if stream is None:
            return False
        head = self._head if a_scale_ptr is None else (a_scale_ptr, *self._head[1:])
        tail = self._tail
        if alpha_ptr is not None:  # unsplit kernels pass alpha's address in the workspace
            tail = ((alpha_ptr, *tail[1:]) if self._split  # slots too (never read there)
                    else (alpha_ptr, alpha_ptr, alpha_ptr, *tail[3:]))
        self._ffi(a_ptr, *head, out_ptr, *tail, stream)
        return True


def _capturing_now() -> bool:
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


def bind(kernel, a, b, out, alpha, dims, key, expires: float,
         a_scale_per_call: bool = False) -> BoundLaunch | None:
    """A :class:`BoundLaunch` of ``kernel`` for B = ``b`` and ``dims`` (= (M, N, K,
    a_format), the activation's, as :func:`run_checked` takes them), after
    :func:`run_checked` launched the same call on ``a`` into ``out``; None where there is
    nothing to fix (no TVM-FFI entry; W4A4 unless ``a_scale_per_call``: A's block scales
    change with every call, so its caller passes their address to
    :meth:`BoundLaunch.launch_ptrs`; an alpha that is not already a float32 device scalar,
    whose copy would not follow the original) or, for split-K, while capturing. ``key``:
    what the caller matches it on (kept as ``.key``)."""
    w4a4 = dims[3] == "nvfp4"
    if getattr(kernel, "_ffi", None) is None or (w4a4 and not a_scale_per_call):
        return None
    dev = b.data.device
    split = kernel.schedule.split_k > 1
    if split and (_capturing(dev) or not may_keep(kernel.stream_handle(dev.index))):
        return None
    alpha_t = alpha_tensor(None, b, alpha)
    if alpha_t is not alpha and alpha_t is not b.global_scale:
        return None  # a converted copy: the binding would not see the scale change
    ws = split_workspace(kernel, dims[0], dims[1], dev) if split else None
    a_data, a_scale = (a.data, a.scale) if w4a4 else (a, None)
    args = kernel.raw_args(a_data, a_scale, b.data, b.scale, out, alpha_t, ws)
    return BoundLaunch(kernel, key, args, dev.index, expires)


# gemm's bindings, per weight object (held weakly): (M, A's dtype, out dtype) -> BoundLaunch
_GEMM_BOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_GEMM_BOUND_MAX = 64  # per weight: many distinct M (prefill) clear the table


def bound_gemm(a, b, schedule, out, out_dtype, alpha) -> torch.Tensor | None:
    """``gemm(a, b, schedule=..., out=..., out_dtype=..., alpha=...)`` through the binding an
    earlier W4A16 call on the same weight object left (:func:`remember_gemm`), or None:
    nothing launched and nothing written, and the caller takes the full path, which raises
    on bad input. Tested here: what the binding fixed (the weight's shape, scale and alpha
    buffers, the schedule, alpha); for A and the output, what can differ between
    calls that the full path's memo would pass (shape, dtype, contiguity, 16-byte
    alignment, device). The rest (B's data, split-K's stream and workspace, a capture,
    expiry) is :meth:`BoundLaunch.launch`'s."""
    table = _GEMM_BOUND.get(b)
    if table is None or type(a) is not torch.Tensor or a.dim() != 2:
        return None
    m, k = a.shape
    bound = table.get((m, a.dtype, out_dtype))
    if bound is None:
        return None
    sched, alpha0, scale_p, alpha_p, shape = bound.key
    if alpha is not alpha0 or not (sched is schedule or (
            isinstance(schedule, str) and sched == schedule)):
        return None
    n, dev = shape[0], b.data.get_device()
    if (k != shape[1] or tuple(b.shape) != shape or b.scale.data_ptr() != scale_p
            or (b.global_scale if alpha is None else alpha).data_ptr() != alpha_p
            or not a.is_contiguous() or a.data_ptr() % 16 or a.get_device() != dev):
        return None
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    elif (type(out) is not torch.Tensor or out.dtype != out_dtype or out.shape != (m, n)
          or not out.is_contiguous() or out.data_ptr() % 16 or out.get_device() != dev):
        return None
    return out if bound.launch(a, b, out) else None


def clear_gemm_bindings() -> None:
    """Drop every binding of :func:`bound_gemm` and :func:`bound_op`
    (``compile.clear_cache`` does)."""
    _GEMM_BOUND.clear()
    _OP_BOUND.clear()


# the custom ops' bindings (their bodies get fresh weight wrappers every call): keyed by
# everything the launch depends on, the weight's buffers by address (op_key); they hold
# addresses only, so a stale entry can only match a call whose buffers are where the
# bound ones were: the launch then reads the call's own buffers
_OP_BOUND: dict = {}
_OP_BOUND_MAX = 512


def op_key(kind: str, a, b, b_scale, alpha, n: int, k: int, out_dtype, schedule) -> tuple:
    """The binding key of a W4A16 ``cute_fp4::mm`` / ``mm_packed`` call (``kind``): A's
    row count, dtype and device, the weight's, scales' and alpha's addresses, shapes,
    dtypes and contiguity, N, K, the output dtype and the schedule name."""
    return (kind, a.shape[0], a.dtype, a.get_device(), n, k, out_dtype, schedule,
            b.data_ptr(), b.shape, b.dtype, b.is_contiguous(), b_scale.data_ptr(),
            b_scale.shape, b_scale.dtype, b_scale.is_contiguous(), alpha.data_ptr(),
            alpha.dtype, alpha.numel())


def bound_op(key: tuple, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """The op call of ``key`` (:func:`op_key` of this call) through the binding an
    earlier call with the same key left (:func:`remember_op`), into a new output; or None:
    nothing launched, and the caller takes the full path (which raises on bad input).
    Tested here beyond the key: A is a plain 2-D tensor of K columns, contiguous and
    16-byte aligned."""
    bound = _OP_BOUND.get(key)
    if (bound is None or type(a) is not torch.Tensor or a.dim() != 2 or a.shape[1] != key[5]
            or not a.is_contiguous() or a.data_ptr() % 16):
        return None
    out = torch.empty((key[1], key[4]), dtype=key[6], device=a.device)
    return out if bound.launch_at(a, b.data_ptr(), out) else None


def remember_op(key: tuple, kernel, a, b, out, alpha, dims, expires: float) -> None:
    """After the op call of ``key`` ran ``run_checked(kernel, a, b, out, alpha, dims)``
    (``b`` the body's weight wrapper): keep its binding for :func:`bound_op`."""
    if type(a) is not torch.Tensor:
        return
    bound = bind(kernel, a, b, out, alpha, dims, key, expires)
    if bound is None:
        return
    if len(_OP_BOUND) >= _OP_BOUND_MAX:
        _OP_BOUND.clear()
    _OP_BOUND[key] = bound


def remember_gemm(kernel, a, b, out, schedule, out_dtype, alpha, dims,
                  expires: float) -> None:
    """After ``run_checked(kernel, a, b, out, alpha, dims)`` ran a W4A16 ``gemm``: keep its
    binding for :func:`bound_gemm` (nothing for W4A4 or an alpha :func:`bind` cannot
    fix)."""
    src = b.global_scale if alpha is None else alpha
    if type(a) is not torch.Tensor or not isinstance(src, torch.Tensor):
        return
    key = (schedule, alpha, b.scale.data_ptr(), src.data_ptr(), tuple(b.shape))
    bound = bind(kernel, a, b, out, alpha, dims, key, expires)
    if bound is None:
        return
    table = _GEMM_BOUND.get(b)
    if table is None:
        table = _GEMM_BOUND[b] = {}
    if len(table) >= _GEMM_BOUND_MAX:
        table.clear()
    table[(dims[0], a.dtype, out_dtype)] = bound


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
