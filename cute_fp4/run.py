"""The launch path: everything a GEMM call does between ``cute_fp4.gemm`` (``mm``,
``mm_packed``) and the kernel's TVM-FFI entry, in the order a call takes it:

1. a binding an earlier call like this one left (:func:`bound_gemm`, :func:`bound_op`):
   one validity test, then the launch;
2. else the operand checks (``operands.check_operands``), the schedule (:func:`resolve_schedule`:
   a Schedule, or a name that ``tuning.pick`` turns into one: a catalogue name's, or for
   "auto" the tuning store's, else the heuristic's; :func:`_resolve_packed` for a packed
   weight) and its compiled
   kernel (:meth:`GemmPath.kernel`, through ``compile.kernel_for``'s memo);
3. the checked launch (:func:`run_checked`: the plan check per shape, the output, the
   split-K workspace of :func:`split_workspace`, the arguments of :func:`launch_args`);
4. then the first call's validation (``check=True``) or a binding for the next call
   (:func:`bind`, kept under :func:`gemm_key` or :func:`op_key`).

:class:`GemmPath` runs these steps for ``gemm`` and the custom ops' bodies; the API layer
holds one (``cute_fp4.api``) and calls it once per call. ``compile`` imports this module
(``CompiledGemm.__call__`` is :func:`run_compiled`; ``compile.clear_cache`` drops the
bindings), so the two services above it that the path uses, the compiled-kernel memo
(``compile.kernel_for``) and the activation decoder (``quant.w4a16_operands``), are given
to :class:`GemmPath` instead of imported. A new launch operand (a fused epilogue's bias)
goes into :func:`launch_args` and the binding keys, :func:`gemm_key` and :func:`op_key`.
:func:`poisoned_check` runs into a NaN-filled output and compares with the exact reference.
"""

from __future__ import annotations

import functools
import math
import threading
import time
import weakref

import torch

from cute_fp4 import reference
from cute_fp4.errors import InputError, InputTypeError
from cute_fp4.nvfp4 import NVFP4Tensor
from cute_fp4.operands import (
    alpha_tensor,
    as_e4m3,
    check_fused_operands,
    check_operands,
    epilogue_ops,
    nvfp4_out_tensor,
    out_dtype_of,
)
from cute_fp4.packed import PackedNVFP4Weight
from cute_fp4.schedule import OutDtype, Schedule
from cute_fp4.targets import reference_mode
from cute_fp4.tuning import heuristic, pick, with_ops

# ----------------------------------------------------------------------------- the schedule

AUTO_RECHECK_S = 1.0  # how often "auto" is resolved again (a tuning stored meanwhile)


def resolution_deadline(schedule) -> float:
    """Until when (``time.monotonic()``) what ``schedule`` resolved to holds:
    :data:`AUTO_RECHECK_S` from now for "auto" (a tuning stored meanwhile is picked up),
    forever for a catalogue name or a Schedule. A binding expires then; ``compile.kernel_for``'s
    memo keeps the same period (``compile.AUTO_RECHECK_S``)."""
    if isinstance(schedule, str) and schedule == "auto":
        return time.monotonic() + AUTO_RECHECK_S
    return math.inf


def resolve_schedule(schedule, m: int, n: int, k: int, a_format: str,
                     out_dtype: torch.dtype) -> Schedule:
    """A Schedule from a Schedule, a catalogue name, or "auto" (tuned, else heuristic:
    ``tuning.pick``), with ``out_dtype``."""
    if isinstance(schedule, str):
        schedule = pick(schedule, m, n, k, a_format)
    if not isinstance(schedule, Schedule):
        raise InputTypeError(f"schedule must be a Schedule, a catalogue name or 'auto', "
                             f"got {type(schedule).__name__}")
    return _with_out_dtype(schedule, out_dtype)


def _with_out_dtype(s: Schedule, out_dtype: torch.dtype) -> Schedule:
    want = OutDtype.of(out_dtype)
    return s if s.epilogue.out_dtype is want else s.replace(out_dtype=want)


_AUTO_PACKED = "auto:packed"  # kernel_for's memo key of "auto" with a packed weight


def _resolve_packed(schedule, m: int, n: int, k: int, a_format: str,
                    out_dtype: torch.dtype) -> Schedule:
    """resolve_schedule for a PackedNVFP4Weight: "auto" is the packed heuristic (the tuning
    store holds plain-weight schedules), anything else must be ``mainloop=rs_packed``."""
    from cute_fp4.targets import gemm_device

    if schedule == _AUTO_PACKED:
        t = gemm_device().target
        s = heuristic(t.family, m, n, k, packed=True, a_format=a_format, target=t.name)
        return _with_out_dtype(s, out_dtype)
    s = resolve_schedule(schedule, m, n, k, a_format, out_dtype)
    if not s.mainloop.reads_packed:
        raise InputError(f"schedule {s.name or s.label()} reads the plain weight layout, but "
                         "b is a PackedNVFP4Weight: use a mainloop=rs_packed or stream "
                         "schedule, 'auto', or b.unpack()")
    return s


def _resolve_with_ops(resolve, ops: tuple[str, ...], schedule, m: int, n: int, k: int,
                      a_format: str, out_dtype: torch.dtype) -> Schedule:
    """"auto" for a call with fused epilogue ``ops`` (``tuning.with_ops``)."""
    return with_ops(resolve(schedule, m, n, k, a_format, out_dtype), ops, m, n, k, a_format)


# ----------------------------------------------------------------------------- a call

class GemmPath:
    """The eager bodies of ``gemm`` and of the custom ops ``cute_fp4::mm`` /
    ``mm_packed``, each one call from ``cute_fp4.api``: the binding, else checks, schedule,
    kernel, checked launch, then validation or a binding (the module docstring's steps).
    ``kernel_for``: ``compile.kernel_for``; ``w4a16_operands``: ``quant.w4a16_operands``
    (both above this module, so given, not imported)."""

    __slots__ = ("_kernel_for", "_w4a16_operands")

    def __init__(self, kernel_for, w4a16_operands):
        self._kernel_for, self._w4a16_operands = kernel_for, w4a16_operands

    def kernel(self, schedule, dims: tuple[int, int, int, str], out_dtype: torch.dtype,
               device_index: int, packed: bool = False, ops: tuple[str, ...] = ()):
        """The compiled kernel for ``schedule`` at ``dims`` = (M, N, K, a_format), memoised
        per (schedule argument, dims, out dtype, device, ops) by ``compile.kernel_for``
        ("auto" resolved again every :data:`AUTO_RECHECK_S`); ``packed``: for a
        fragment-order weight ("auto" memoised under its own key, resolved by the packed
        heuristic); ``ops``: fused epilogue operations."""
        auto = isinstance(schedule, str) and schedule == "auto"
        resolve = _resolve_packed if packed else resolve_schedule
        if auto and ops:  # the ops given here: "auto" may take another tile for them
            resolve = functools.partial(_resolve_with_ops, resolve, ops)
        key = _AUTO_PACKED if packed and auto else schedule
        return self._kernel_for(key, dims, out_dtype, device_index, resolve, ops)

    def run_gemm(self, a, b: NVFP4Tensor, schedule, out, out_dtype, alpha, check: bool,
                 bind: bool = True, key: tuple | None = None, bias=None,
                 silu_mul: bool = False, nvfp4_out=None) -> torch.Tensor:
        """``gemm``'s eager body. ``bind``: launch through (and keep) a binding for calls
        like this one on the same weight object (:func:`bound_gemm`); the custom ops'
        bodies, which wrap fresh weight objects per call, pass False and their ``key``
        (:func:`op_key`). ``bias``/``silu_mul``: fused epilogue operations
        (:meth:`run_fused`)."""
        if reference_mode():
            return reference_call(a, b, out, out_dtype, alpha,
                                  bias, epilogue_ops(bias, silu_mul, nvfp4_out), nvfp4_out)
        if bias is not None or silu_mul or nvfp4_out is not None:
            return self.run_fused(a, b, schedule, out, out_dtype, alpha, check, bias,
                                  epilogue_ops(bias, silu_mul, nvfp4_out), nvfp4_out)
        if bind and not check:  # a W4A16 call like an earlier one on this weight
            result = bound_gemm(a, b, schedule, out, out_dtype, alpha)
            if result is not None:
                return result
        if isinstance(b, PackedNVFP4Weight):
            return self._gemm_packed(a, b, schedule, out, out_dtype, alpha, check, bind, key)
        dims = check_operands(a, b, out, alpha, out_dtype)
        kern = self.kernel(schedule, dims, out_dtype, b.data.get_device())
        result = run_checked(kern, a, b, out, alpha, dims)  # checked once, above
        self._after(kern, a, b, result, schedule, out_dtype, alpha, dims, check, bind, key)
        return result

    def _gemm_packed(self, a, b: PackedNVFP4Weight, schedule, out, out_dtype, alpha, check,
                     bind: bool, key: tuple | None) -> torch.Tensor:
        """gemm with a fragment-order packed weight: the plain checks on a view of its
        first N rows (same bytes count per row, same scales), then an rs_packed or stream
        kernel (W4A4 with ``schedule="auto"``: :meth:`_w4a4_via_bf16`)."""
        view = _plain_view(b)
        dims = check_operands(a, view, out, alpha, out_dtype)
        if dims[3] == "nvfp4" and isinstance(schedule, str) and schedule == "auto":
            result = self._w4a4_via_bf16(a, b, view, out, out_dtype, alpha, dims)
            if check:
                reference.assert_close(result, a, b.unpack(), alpha)
            return result
        kern = self.kernel(schedule, dims, out_dtype, b.data.get_device(), packed=True)
        result = run_checked(kern, a, b, out, alpha, dims)
        self._after(kern, a, b, result, schedule, out_dtype, alpha, dims, check, bind, key)
        return result

    def run_fused(self, a, b, schedule, out, out_dtype, alpha, check: bool, bias,
                  ops: tuple[str, ...], nvfp4_out=None) -> torch.Tensor:
        """A call with fused epilogue ``ops`` (bias, silu_mul): the schedule resolved as
        without them, then given them; the operand checks, then ``bias`` and the output's
        shape ([M, N / 2] with silu_mul). No binding (each call takes the full path).
        ``check=True``: :meth:`_validate` with the ops."""
        packed = isinstance(b, PackedNVFP4Weight)
        view = _plain_view(b) if packed else b
        dims = check_operands(a, view, None, alpha, out_dtype)
        m, n, k, a_format = dims
        dev = b.data.device
        check_fused_operands(bias, out, m, n, out_dtype, ops, dev)
        if packed and a_format == "nvfp4" and isinstance(schedule, str) and schedule == "auto":
            given = None if alpha is None else alpha_tensor(a, view, alpha)
            a, alpha = self._w4a16_operands(a, b.global_scale, given)
            dims = (m, n, k, "bf16")
        kern = self.kernel(schedule, dims, out_dtype, b.data.get_device(), packed, ops)
        result = run_checked(kern, a, b, out, alpha, dims, bias, nvfp4_out)
        if check:
            self._validate(kern, result, a, b, alpha, dims, ops, bias, out_dtype)
        return result

    def _after(self, kern, a, b, result, schedule, out_dtype, alpha, dims, check: bool,
               bind: bool, key: tuple | None) -> None:
        """Validate the first call of ``kern`` (``check``: :meth:`_validate`) or, with
        ``bind`` (or an op's ``key``), keep this call's launch for the next like it."""
        if check:
            self._validate(kern, result, a, b, alpha, dims)
        elif key is not None:
            remember_op(key, kern, a, b, result, alpha, dims, resolution_deadline(schedule))
        elif bind:
            remember_gemm(kern, a, b, result, schedule, out_dtype, alpha, dims,
                          resolution_deadline(schedule))

    def _validate(self, kern, result, a, b, alpha, dims, ops: tuple[str, ...] = (),
                  bias=None, out_dtype=None) -> None:
        """``check=True``: the first call of ``kern`` held to the exact reference (a packed
        ``b`` in its plain layout). With fused epilogue ``ops``, the unfused pipeline runs
        too (the same schedule without ops, FP32 output, bias added in FP32, rounded, then
        ``F.silu(gate) * up``: ``cute_fp4.fused``): its GEMM is held to the reference and
        ``result`` must have its bits."""
        if kern.validated:
            return
        packed = isinstance(b, PackedNVFP4Weight)
        gemm = result
        if ops:  # the GEMM of the unfused pipeline: the same schedule, no ops, FP32 output
            unfused = self.kernel(kern.unfused_schedule, dims, torch.float32,
                                  b.data.get_device(), packed)
            gemm = run_checked(unfused, a, b, None, alpha, dims)
        reference.assert_close(gemm, a, b.unpack() if packed else b, alpha)
        if ops:
            reference.assert_fused(result, gemm, bias, ops, kern.silu_group,
                                   kern.schedule.name or kern.schedule.label(), out_dtype)
        kern.validated = True

    def _w4a4_via_bf16(self, a: NVFP4Tensor, b: PackedNVFP4Weight, view: NVFP4Tensor, out,
                       out_dtype, alpha, dims) -> torch.Tensor:
        """W4A4 on a fragment-order weight with ``schedule="auto"``: the activation decoded
        to its exact BF16 block values (one pass, ``quant.dequantize_activation``), then
        the W4A16 kernel with alpha = the two global scales' product (written by the same
        launch: no multiply kernel) or the given alpha. The same exact products as a W4A4
        kernel; measured faster than the rs_packed mainloop's own W4A4 route, which
        converts each activation stage without overlap, and than the plain-layout W4A4
        kernels (perf/results/2026-12-01-h200-bound.md)."""
        m, n, k, _ = dims
        kern = self.kernel("auto", (m, n, k, "bf16"), out_dtype, b.data.get_device(),
                           packed=True)
        given = None if alpha is None else alpha_tensor(a, view, alpha)
        a16, alpha_t = self._w4a16_operands(a, b.global_scale, given)
        return run_checked(kern, a16, b, out, alpha_t, (m, n, k, "bf16"))

    def run_mm(self, a, a_scale, b, b_scale, alpha, k, out_dtype, schedule) -> torch.Tensor:
        """The ``cute_fp4::mm`` op's body. The operands are wrapped without
        ``NVFP4Tensor``'s checks: its global-scale check reads the value back from the
        GPU, and that sync inside a CUDA-graph capture (torch.compile's
        ``mode="reduce-overhead"``) invalidates the capture
        (``cudaErrorStreamCaptureInvalidated``). ``alpha`` is explicit, so the global
        scales the wrappers carry (alpha itself, a placeholder) are never read."""
        key = None
        if isinstance(b, torch.Tensor) and b.dim() == 2:
            key = _op_bound_key("mm", a, a_scale, b, b_scale, alpha, b.shape[0], k,
                                out_dtype, schedule)
        if key is not None:
            result = bound_op(key, a, b)
            if result is not None:
                return result
        at, gs = _op_activation(a, a_scale, b, b_scale, alpha, k)
        if b.dim() != 2:
            raise InputTypeError(f"b must be the packed weight [N, K/2], got shape "
                                 f"{tuple(b.shape)}")
        bt = NVFP4Tensor._unchecked(b, as_e4m3(b_scale), gs, (b.shape[0], k))
        return self.run_gemm(at, bt, schedule, None, out_dtype, alpha, False, bind=False,
                             key=key)

    def run_mm_packed(self, a, a_scale, b, b_scale, alpha, n, k, out_dtype,
                      schedule) -> torch.Tensor:
        """The ``cute_fp4::mm_packed`` op's body: as :meth:`run_mm` (no value checks, no
        sync)."""
        key = _op_bound_key("mm_packed", a, a_scale, b, b_scale, alpha, n, k, out_dtype,
                            schedule)
        if key is not None:
            result = bound_op(key, a, b)
            if result is not None:
                return result
        at, gs = _op_activation(a, a_scale, b, b_scale, alpha, k)
        bt = PackedNVFP4Weight(b, as_e4m3(b_scale), gs, (n, k))
        return self.run_gemm(at, bt, schedule, None, out_dtype, alpha, False, bind=False,
                             key=key)


def reference_call(a, b, out, out_dtype, alpha, bias=None, ops: tuple[str, ...] = (),
                   nvfp4_out=None):
    """A ``gemm`` call under ``targets.reference_mode``: the same operand checks on any
    device, then the exact reference instead of a kernel (``reference.gemm``, the fused ops
    by their definition, ``reference.fused``, with the gate/up group of the kernels that
    read ``b``'s layout on its device: ``fused.device_group``); written into ``out`` when
    given."""
    from cute_fp4.fused import device_group

    packed = isinstance(b, PackedNVFP4Weight)
    view = _plain_view(b) if packed else b
    m, n, _, _ = check_operands(a, view, None if ops else out, alpha, out_dtype,
                                require_cuda=False)
    dev = b.data.device
    if ops:
        check_fused_operands(bias, out, m, n, out_dtype, ops, dev)
    w = b.unpack() if packed else b
    if not ops:
        y = reference.gemm(a, w, alpha, out_dtype=out_dtype)
    else:
        raw = reference.gemm(a, w, alpha, out_dtype=torch.float32)
        scale = out.global_scale if isinstance(out, NVFP4Tensor) else nvfp4_out
        y = reference.fused(raw, bias, ops, device_group(dev, "packed" if packed else "plain"),
                            out_dtype, scale)
    if out is None:
        return y
    if isinstance(y, NVFP4Tensor):
        out.data.copy_(y.data)
        out.scale.copy_(y.scale)
        return out
    return out.copy_(y)


def _plain_view(b: PackedNVFP4Weight) -> NVFP4Tensor:
    """The plain-weight checks' view of a packed weight's first N rows (same bytes per row,
    same scales)."""
    if len(b.shape) != 2:
        raise InputError(f"b is a stack of {b.shape[0]} packed experts {list(b.shape)}: "
                         "gemm takes one [N, K] weight; cute_fp4.grouped_gemm runs stacks")
    n, k = b.shape
    return NVFP4Tensor._unchecked(b.data[:n], b.scale, b.global_scale, (n, k))


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensor types the ops' bindings accept


def _op_bound_key(kind, a, a_scale, b, b_scale, alpha, n, k, out_dtype, schedule):
    """:func:`op_key` of a W4A16 op call whose operands are all tensors (else None: the
    full path, which raises on bad types). The ops' bodies get fresh weight wrappers every
    call, so their bindings are keyed by the weight's buffers instead (:func:`bound_op`)."""
    if (a_scale is not None or not isinstance(schedule, str)
            or not all(type(t) in _PLAIN for t in (a, b, b_scale, alpha))):
        return None
    return op_key(kind, a, b, b_scale, alpha, n, k, out_dtype, schedule)


def _op_activation(a, a_scale, b, b_scale, alpha, k):
    """The ops' common part: the tensor-type checks, and ``(A, alpha as a scalar)`` with
    A wrapped without checks when it is NVFP4 (see :meth:`GemmPath.run_mm`)."""
    for t, name in ((b, "b"), (b_scale, "b_scale"), (alpha, "alpha")):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    gs = alpha.reshape(())
    if a_scale is None:
        return a, gs
    return NVFP4Tensor._unchecked(a, as_e4m3(a_scale), gs, (a.shape[0], k)), gs


# ----------------------------------------------------------------------------- the launch

def run_compiled(kernel, a, b: NVFP4Tensor, out=None, alpha=None, bias=None,
                 nvfp4_out=None) -> torch.Tensor:
    """Validate, allocate, launch ``kernel`` (a CompiledGemm).

    A kernel whose mainloop reads the packed weight (rs_packed, stream) takes a
    fragment-order PackedNVFP4Weight: a plain NVFP4Tensor ``b`` is packed here on every
    call (so validation harnesses run those
    schedules unchanged; ``gemm`` users pack once, cute_fp4.packed.repack). A schedule
    with ``"nvfp4_out"`` takes the output's global scale as ``nvfp4_out`` (or an
    ``NVFP4Tensor`` ``out`` to write) and returns the ``NVFP4Tensor``."""
    check_b = b
    if isinstance(b, PackedNVFP4Weight):
        check_b = _plain_view(b)
    elif kernel.schedule.mainloop.reads_packed and isinstance(b, NVFP4Tensor):
        b = PackedNVFP4Weight.from_tensor(b)
    ops = kernel.schedule.epilogue.ops
    dims = check_operands(a, check_b, None if ops else out, alpha, kernel.out_dtype)
    if ops:
        check_fused_operands(bias, out, dims[0], dims[1], kernel.out_dtype, ops,
                             b.data.device)
    return run_checked(kernel, a, b, out, alpha, dims, bias, nvfp4_out)


def run_checked(kernel, a, b: NVFP4Tensor, out, alpha, dims, bias=None,
                nvfp4_out=None) -> torch.Tensor:
    """:func:`run_compiled` after :func:`check_operands` returned ``dims`` (and, with fused
    epilogue ops, :func:`check_fused_operands`). The plan check is remembered per kernel and
    shape (``CompiledGemm.check_plan``)."""
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
    cols = n // 2 if kernel.schedule.epilogue.has("silu_mul") else n
    if kernel.schedule.epilogue.has("nvfp4_out"):
        result = nvfp4_out_tensor(out, nvfp4_out, m, cols, dev)
    else:
        result = out if out is not None else torch.empty((m, cols), dtype=kernel.out_dtype,
                                                         device=dev)
    ws = split_workspace(kernel, m, n, dev) if kernel.schedule.split_k > 1 else None
    kernel.launch(*launch_args(a, b, result, alpha_t, ws, a_format, bias))
    return result


def launch_args(a, b, out, alpha_t: torch.Tensor, workspace, a_format: str,
                bias=None) -> tuple:
    """The tensors a launch passes, in the order of ``CompiledGemm.launch`` and
    ``raw_args``: A's data and block scales (None for W4A16), B's data and block scales,
    the output, alpha (a float32 device scalar), the split-K workspace (or None), the
    fused bias (or None). The one place for a new operand: :func:`run_checked` launches
    these and :func:`bind` fixes them."""
    a_data, a_scale = (a.data, a.scale) if a_format == "nvfp4" else (a, None)
    return a_data, a_scale, b.data, b.scale, out, alpha_t, workspace, bias


# ----------------------------------------------------------------------------- workspaces

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


# ----------------------------------------------------------------------------- bindings

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
    args = kernel.raw_args(*launch_args(a, b, out, alpha_t, ws, dims[3]))
    return BoundLaunch(kernel, key, args, dev.index, expires)


# gemm's bindings, per weight object (held weakly): (M, A's dtype, out dtype) -> BoundLaunch
_GEMM_BOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_GEMM_BOUND_MAX = 64  # per weight: many distinct M (prefill) clear the table


def bound_gemm(a, b, schedule, out, out_dtype, alpha) -> torch.Tensor | None:
    """``gemm(a, b, schedule=..., out=..., out_dtype=..., alpha=...)`` through the binding an
    earlier W4A16 call on the same weight object left (:func:`remember_gemm`), or None:
    nothing launched and nothing written, and the caller takes the full path, which raises
    on bad input. Tested here: what the binding fixed (:func:`gemm_key`: the schedule,
    alpha, the weight's shape, scale and alpha buffers); for A and the output, what can
    differ between calls that the full path's memo would pass (shape, dtype, contiguity,
    16-byte alignment, device). The rest (B's data, split-K's stream and workspace, a
    capture, expiry) is :meth:`BoundLaunch.launch`'s."""
    table = _GEMM_BOUND.get(b)
    if table is None or type(a) is not torch.Tensor or a.dim() != 2:
        return None
    m, k = a.shape
    bound = table.get((m, a.dtype, out_dtype))
    key = gemm_key(schedule, alpha, b)
    if bound is None or bound.key != key:
        return None
    (n, kb), dev = key[4], b.data.get_device()
    if k != kb or not a.is_contiguous() or a.data_ptr() % 16 or a.get_device() != dev:
        return None
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    elif (type(out) is not torch.Tensor or out.dtype != out_dtype or out.shape != (m, n)
          or not out.is_contiguous() or out.data_ptr() % 16 or out.get_device() != dev):
        return None
    return out if bound.launch(a, b, out) else None


def gemm_key(schedule, alpha, b) -> tuple | None:
    """What a ``gemm`` binding on the weight ``b`` is matched on besides M and the dtypes
    (its table's keys): the schedule argument (a name by value, a Schedule by identity),
    alpha (by identity), the addresses of the weight's block scales and of the alpha buffer
    (alpha, else the weight's global scale) and the weight's shape; None where that buffer
    is not a tensor (never bound). The objects follow their ids at the end: the binding
    keeps them alive, so a comparison reaches them only where the ids matched, and
    there finds the same object (a tensor is never compared by value)."""
    src = b.global_scale if alpha is None else alpha
    if not isinstance(src, torch.Tensor):
        return None
    return (schedule if type(schedule) is str else id(schedule), id(alpha),
            b.scale.data_ptr(), src.data_ptr(), tuple(b.shape), schedule, alpha)


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
    key = gemm_key(schedule, alpha, b)
    if type(a) is not torch.Tensor or key is None:
        return
    bound = bind(kernel, a, b, out, alpha, dims, key, expires)
    if bound is None:
        return
    table = _GEMM_BOUND.get(b)
    if table is None:
        table = _GEMM_BOUND[b] = {}
    if len(table) >= _GEMM_BOUND_MAX:
        table.clear()
    table[(dims[0], a.dtype, out_dtype)] = bound


def poisoned_check(kernel, a, b: NVFP4Tensor) -> reference.CheckResult:
    """Run ``kernel`` into an output filled with NaN (so an unwritten element fails) and
    compare it with the exact reference."""
    m, n = a.shape[0], b.shape[0]
    out = torch.full((m, n), float("nan"), dtype=out_dtype_of(kernel.schedule),
                     device=b.device)
    run_compiled(kernel, a, b, out=out)
    torch.cuda.synchronize()
    return reference.check(out, a, b)
