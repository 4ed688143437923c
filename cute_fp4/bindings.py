"""Launches kept between calls: a call like an earlier one launches through a binding of
it (:class:`BoundLaunch`: one validity test, then the kernel's TVM-FFI entry on raw
addresses), else takes the launch path's full path (``cute_fp4.run``) and binds what it
launched for the next. Three kinds of callers keep them:

* ``gemm``'s eager body (:func:`gemm`): per weight object, per (M, dtypes), for W4A16
  calls and W4A4 calls on an ``NVFP4Tensor`` (its codes, scales and alpha per call);
* the custom ops' bodies (:func:`mm`: ``cute_fp4::mm`` / ``mm_packed``), whose weight
  wrappers are new every call: keyed by the buffers' addresses (:func:`op_key`);
* a prepared layer (:class:`Launcher`, ``cute_fp4.layers.Linear``): its W4A16 launch, and
  its W4A4 launches with the activation quantizer bound too (``quant.BoundActivation``).

A binding holds only what it fixed (the kernel, the weight's addresses, alpha, sizes, a
split-K workspace) and gives way (launching nothing) when any of it no longer holds: its
time is up ("auto" is resolved again), the weight moved, or for split-K the stream, its
workspace or a capture (``cute_fp4.workspaces``). ``compile.clear_cache`` drops them all.
"""

from __future__ import annotations

import time
import weakref

import torch

from cute_fp4 import quant, run, workspaces
from cute_fp4.compile import on_clear
from cute_fp4.formats import Operand
from cute_fp4.nvfp4 import NVFP4Tensor
from cute_fp4.operands import GemmCall, alpha_tensor
from cute_fp4.tuning import resolution_deadline
from cute_fp4.workspaces import generation, may_keep, split_workspace

_BOUND_MAX = 64  # bindings per weight or layer: many distinct M (prefill) clear the table


class BoundLaunch:
    """A GEMM kernel's launch with its weight, alpha, sizes and split-K workspace fixed
    (W4A16; W4A4 with A's block scales given per call): ``run.run_checked``'s checks and
    argument building done once, so a repeated call (a layer's forward at one M) pays one
    validity test and the TVM-FFI call (:func:`bind`). The caller checks the activation
    and allocates the output as before; :meth:`launch` returns False, launching nothing,
    when the binding no longer holds (module docstring)."""

    __slots__ = ("kernel", "key", "_ffi", "_stream_of", "_dev", "_args", "_split",
                 "_generation", "_expires")

    def __init__(self, kernel, key, raw: tuple[int, ...], dev: int, expires: float):
        """``raw``: the kernel's raw arguments of the launch being bound
        (``CompiledGemm.raw_args``); A's, its scales', C's and alpha's addresses and the
        stream are the call's (``kernels.launch.BoundArgs``)."""
        self.kernel, self.key = kernel, key
        self._ffi, self._stream_of, self._dev = kernel.ffi, kernel.stream_handle, dev
        self._args = kernel.bound_args(raw)
        self._split = kernel.schedule.split_k > 1
        self._generation, self._expires = generation(), expires

    def launch(self, a: torch.Tensor, b, out: torch.Tensor) -> bool:
        """Launch on ``a`` (the checked activation, [M, K] memory) and ``b`` (the weight it
        was bound to: its data must still be where it was) into ``out`` ([M, N] memory)
        on the current stream, or return False (nothing launched)."""
        return self.launch_ptrs(a.data_ptr(), None, b.data.data_ptr(), out.data_ptr())

    def accepts(self, b_ptr: int) -> int | None:
        """The current stream's handle if a launch on the weight data at ``b_ptr`` would go
        through now, else None (what :meth:`launch_ptrs` tests first; a W4A4 call asks
        before launching its activation kernels, which the full path would repeat)."""
        if b_ptr != self._args.b:
            return None
        stream = self._stream_of(self._dev)
        if self._split and (stream != self._args.stream or self._generation != generation()
                            or workspaces.capturing_now() or not may_keep(stream)):
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
        self._ffi(*self._args(a_ptr, a_scale_ptr, out_ptr, alpha_ptr, stream))
        return True


def bind(kernel, a, b, out, alpha, dims, key, expires: float,
         a_scale_per_call: bool = False, early: bool = False) -> BoundLaunch | None:
    """A :class:`BoundLaunch` of ``kernel`` for B = ``b`` and ``dims`` (= (M, N, K,
    a_format), the activation's, as ``run.run_checked`` takes them), after that launched
    the same call on ``a`` into ``out``; None where there is nothing to fix (no TVM-FFI
    entry; W4A4 unless ``a_scale_per_call``: A's block scales change with every call, so
    its caller passes their address to :meth:`BoundLaunch.launch_ptrs`; an alpha that is
    not already a float32 device scalar, whose copy would not follow the original) or, for
    split-K, while capturing. ``key``: what the caller matches it on (kept as ``.key``)."""
    w4a4 = not Operand.of(dims[3]).sixteen_bit
    if getattr(kernel, "ffi", None) is None or (w4a4 and not a_scale_per_call):
        return None
    dev = b.data.device
    split = kernel.schedule.split_k > 1
    if split and (workspaces.capturing(dev) or not may_keep(kernel.stream_handle(dev.index))):
        return None
    alpha_t = alpha_tensor(None, b, alpha)
    if alpha_t is not alpha and alpha_t is not b.global_scale:
        return None  # a converted copy: the binding would not see the scale change
    ws = split_workspace(kernel, dims[0], dims[1], dev) if split else None
    raw = kernel.raw_args(run.operands(a, b, out, alpha_t, dims[3], ws, early=early))
    return BoundLaunch(kernel, key, raw, dev.index, expires)


# ----------------------------------------------------------------------------- gemm

# gemm's bindings, per weight object (held weakly): (M, A's dtype, out dtype) -> BoundLaunch
_GEMM_BOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def gemm(call: GemmCall) -> torch.Tensor:
    """``cute_fp4.gemm``'s eager body: a call like an earlier one on the same weight object
    through its binding (:func:`bound_gemm`), else ``run.gemm_call``, whose launch is
    bound for the next (:func:`remember_gemm`) where it can be (``GemmCall.bindable``)."""
    if not call.bindable:
        return run.gemm_call(call)
    result = bound_gemm(call)
    if result is not None:
        return result

    def keep(kern, a_, b_, result, alpha_, dims):  # the key holds the call's own alpha
        if a_ is call.a:  # not a W4A4 call run on its activation's values
            remember_gemm(kern, a_, b_, result, call.schedule, call.out_dtype, call.alpha,
                          dims)

    return run.gemm_call(call, keep)


def bound_gemm(call: GemmCall) -> torch.Tensor | None:
    """``call`` (bindable: ``GemmCall.bindable``) through the binding an earlier call on the
    same weight object left (:func:`remember_gemm`), or None: nothing launched and nothing
    written, and the caller takes the full path, which raises on bad input. Tested here:
    what the binding fixed (:func:`gemm_key`: the schedule, alpha, the weight's shape,
    scale and alpha buffers); for A (W4A4: its codes and block scales) and the output, what
    can differ between calls that the full path's memo would pass (shape, dtype,
    contiguity, 16-byte alignment, device). A W4A4 call without ``alpha`` passes the product
    of the two global scales made per call (the activation's changes with every
    quantization). The rest (B's data, split-K's stream and workspace, a capture, expiry)
    is :meth:`BoundLaunch.launch_ptrs`'s."""
    a, b, out, out_dtype = call.a, call.b, call.out, call.out_dtype
    table = _GEMM_BOUND.get(b)
    if table is None or len(a.shape) != 2:
        return None
    m, k = a.shape
    w4a4 = type(a) is NVFP4Tensor
    bound = table.get((m, Operand.NVFP4 if w4a4 else a.dtype, out_dtype))
    key = gemm_key(call.schedule, call.alpha, b)
    if bound is None or bound.key != key:
        return None
    (n, kb), dev = key[4], b.data.get_device()
    data = a.data if w4a4 else a
    if (k != kb or not data.is_contiguous() or data.data_ptr() % 16
            or data.get_device() != dev or (w4a4 and not _scales_like(a, b, m, k, dev))):
        return None
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=data.device)
    elif (type(out) is not torch.Tensor or out.dtype != out_dtype or out.shape != (m, n)
          or not out.is_contiguous() or out.data_ptr() % 16 or out.get_device() != dev):
        return None
    if not w4a4:
        return out if bound.launch(a, b, out) else None
    alpha = None if call.alpha is not None else alpha_tensor(a, b, None)
    ok = bound.launch_ptrs(data.data_ptr(), a.scale.data_ptr(), b.data.data_ptr(),
                           out.data_ptr(), None if alpha is None else alpha.data_ptr())
    return out if ok else None


def _scales_like(a, b, m: int, k: int, dev: int) -> bool:
    """A W4A4 activation's block scales as the bound launch reads them: the weight's scale
    dtype, the blocked shape of [m, k], contiguous, 16-byte aligned, on the device."""
    sf = a.scale
    return (sf.dtype == b.scale.dtype and tuple(sf.shape) == b.fmt.scale_shape(m, k)
            and sf.is_contiguous() and sf.data_ptr() % 16 == 0 and sf.get_device() == dev)


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


def remember_gemm(kernel, a, b, out, schedule, out_dtype, alpha, dims) -> None:
    """After ``run.run_checked(kernel, a, b, out, alpha, dims)`` ran a ``gemm`` on its own
    activation (a 16-bit tensor, or W4A4 an NVFP4Tensor whose codes and scales a bound call
    passes): keep its binding for :func:`bound_gemm` (nothing for an alpha :func:`bind`
    cannot fix)."""
    key = gemm_key(schedule, alpha, b)
    w4a4 = type(a) is NVFP4Tensor
    if not (w4a4 or type(a) is torch.Tensor) or key is None:
        return
    bound = bind(kernel, a, b, out, alpha, dims, key, resolution_deadline(schedule),
                 a_scale_per_call=w4a4)
    if bound is None:
        return
    table = _GEMM_BOUND.get(b)
    if table is None:
        table = _GEMM_BOUND[b] = {}
    if len(table) >= _BOUND_MAX:
        table.clear()
    table[(dims[0], Operand.NVFP4 if w4a4 else a.dtype, out_dtype)] = bound


# ----------------------------------------------------------------------------- the ops

# the custom ops' bindings (their bodies get fresh weight wrappers every call): keyed by
# everything the launch depends on, the weight's buffers by address (op_key); they hold
# addresses only, so a stale entry can only match a call whose buffers are where the
# bound ones were: the launch then reads the call's own buffers
_OP_BOUND: dict = {}
_OP_BOUND_MAX = 512
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensor types the ops' bindings accept


def mm(a, a_scale, b, b_scale, alpha, n: int, k: int, out_dtype, schedule,
       packed: bool) -> torch.Tensor:
    """The body of ``cute_fp4::mm`` (``packed`` False, ``n`` = B's rows) and ``mm_packed``:
    a W4A16 call like an earlier one through its binding (:func:`bound_op`), else
    ``run.op_call``, whose launch is bound for the next (:func:`remember_op`)."""
    key = None
    if (a_scale is None and isinstance(schedule, str)
            and all(type(t) in _PLAIN for t in (a, b, b_scale, alpha))):
        key = op_key("mm_packed" if packed else "mm", a, b, b_scale, alpha, n, k,
                     out_dtype, schedule)
        result = bound_op(key, a, b)
        if result is not None:
            return result

    def keep(kern, a_, b_, result, alpha_, dims):
        remember_op(key, kern, a_, b_, result, alpha_, dims, resolution_deadline(schedule))

    return run.op_call(a, a_scale, b, b_scale, alpha, n, k, out_dtype, schedule, packed,
                       keep=keep if key is not None else None)


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
    ok = bound.launch_ptrs(a.data_ptr(), None, b.data_ptr(), out.data_ptr())
    return out if ok else None


def remember_op(key: tuple, kernel, a, b, out, alpha, dims, expires: float) -> None:
    """After the op call of ``key`` ran ``run.run_checked(kernel, a, b, out, alpha, dims)``
    (``b`` the body's weight wrapper): keep its binding for :func:`bound_op`."""
    if type(a) is not torch.Tensor:
        return
    bound = bind(kernel, a, b, out, alpha, dims, key, expires)
    if bound is None:
        return
    if len(_OP_BOUND) >= _OP_BOUND_MAX:
        _OP_BOUND.clear()
    _OP_BOUND[key] = bound


def clear_bindings() -> None:
    """Drop every binding of :func:`bound_gemm` and :func:`bound_op` (``compile.clear_cache``
    does, through ``compile.on_clear``; a layer's go with its kernels' expiry or a new
    weight)."""
    _GEMM_BOUND.clear()
    _OP_BOUND.clear()


on_clear(clear_bindings)


# ----------------------------------------------------------------------------- a layer's

class Launcher:
    """The launches of a prepared layer's GEMM on its weight (``cute_fp4.layers.Linear``):
    the first call at an M and dtype takes the launch path's full path (``run.gemm_call`` on
    a ``GemmCall``: checks, kernel, workspace; W4A4: the activation quantized as the route
    needs) and binds what it launched; the next launch through the binding. ``bound``:
    (M, dtype[, "w4a4"]) -> the binding(s), at most :data:`_BOUND_MAX`."""

    __slots__ = ("bound",)

    def __init__(self):
        # (M, dtype) -> BoundLaunch; (M, dtype, "w4a4") -> (BoundActivation, BoundLaunch)
        self.bound: dict[tuple, BoundLaunch | tuple[quant.BoundActivation, BoundLaunch]] = {}

    def w4a16(self, x: torch.Tensor, w, schedule, m: int, out: torch.Tensor,
              early: bool = False, alpha: torch.Tensor | None = None) -> None:
        """``out = x @ w^T`` (W4A16, alpha the weight's global scale, or ``alpha``: a
        float32 device scalar the layer holds, for a format without global scales) for a
        checked ``x`` (contiguous, 16-byte aligned, [..., K] of M rows on the weight's
        device ``dev``). ``early``: the stream kernel may read the weight before the kernel
        before it ends (``Operands.early``: the layer holds that no kernel writing it is in
        flight)."""
        bound = self.bound.get((m, x.dtype))
        if (bound is not None and bound.key[0] is w and bound.key[1] is schedule
                and bound.key[2] == early and bound.launch(x, w, out)):
            return
        k, n = w.shape[1], w.shape[0]
        alpha = w.global_scale if alpha is None else alpha
        key = (m, x.dtype)

        def keep(kern, a, b, result, alpha_, dims):
            self._keep(key, bind(kern, a, b, result, alpha_, dims, (w, schedule, early),
                                 resolution_deadline(schedule), early=early))

        run.gemm_call(GemmCall(x.view(m, k), w, schedule, out.view(m, n), x.dtype, alpha,
                               early=early), keep)

    def w4a4(self, x2: torch.Tensor, w, schedule, m: int, out: torch.Tensor, input_scale,
             alpha) -> None:
        """``out`` = the W4A4 product of ``x2`` ([M, K], checked) quantized by the fused
        kernel (``input_scale``: static, with ``alpha`` = its product with the weight's
        global scale made once; None: dynamic, per call) and ``w``: the launch path's full
        path (``run.gemm_call`` with ``quantize_a``: on a packed weight with
        ``schedule="auto"`` the W4A16 kernel on the activation's exact BF16 block values,
        ``run.via_values``). From the second call at an M and dtype both launches go through
        a binding (``quant.BoundActivation``, made for the route the first call took, and
        :class:`BoundLaunch`)."""
        bound = self.bound.get((m, x2.dtype, "w4a4"))
        if bound is not None and self._launch_bound_w4a4(bound, x2, w, schedule, out,
                                                         input_scale, alpha):
            return
        n = w.shape[0]
        gs, dynamic = w.global_scale, input_scale is None
        key = (m, x2.dtype, "w4a4")

        def keep(kern, a, b, result, alpha_, dims):
            if dynamic and not (gs.dtype == torch.float32 and gs.numel() == 1
                                and gs.device == x2.device):
                return  # alpha from a scale of another dtype or device: the full path
            decode = dims[3] != Operand.of(w.fmt)  # the kernel ran on the values
            gemm_ = bind(kern, a, b, result, alpha_, dims, (w, schedule, alpha),
                         resolution_deadline(schedule), a_scale_per_call=not decode)
            act = gemm_ and quant.BoundActivation.make(
                x2, input_scale, decode, (input_scale, gs), other_scale=gs if dynamic else None)
            self._keep(key, None if act is None else (act, gemm_))

        run.gemm_call(GemmCall(x2, w, schedule, out.view(m, n), x2.dtype, alpha,
                               quantize_a=True, input_scale=input_scale), keep)

    @staticmethod
    def _launch_bound_w4a4(bound, x2, w, schedule, out, input_scale, alpha) -> bool:
        act, gemm_ = bound
        if (act.key[0] is not input_scale or act.key[1] is not w.global_scale
                or gemm_.key[0] is not w or gemm_.key[1] is not schedule
                or gemm_.key[2] is not alpha):
            return False
        b_ptr = w.data.data_ptr()
        if gemm_.accepts(b_ptr) is None:  # e.g. split-K while capturing: the full path
            return False
        # scratch: held until the GEMM is queued behind the activation kernels on this stream
        scratch, a_ptr, sfa_ptr, alpha_ptr = act.launch(x2)  # noqa: F841
        return gemm_.launch_ptrs(a_ptr, sfa_ptr or None, b_ptr, out.data_ptr(),
                                 alpha_ptr or None)

    def _keep(self, key: tuple, binding) -> None:
        if len(self.bound) >= _BOUND_MAX:
            self.bound.clear()
        if binding is not None:
            self.bound[key] = binding


__all__ = ["BoundLaunch", "Launcher", "bind", "bound_gemm", "bound_op", "clear_bindings",
           "gemm", "gemm_key", "mm", "op_key", "remember_gemm", "remember_op"]
