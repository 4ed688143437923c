"""Fused activation quantization on the GPU: ``quantize_activation(x) -> NVFP4Tensor``.

One CuTe DSL kernel (``cute_fp4.kernels.quantize``) turns a bf16/fp16 ``[M, K]`` tensor into
packed E2M1 codes and UE4M3 scales in the 128x4 blocked layout, bit-identical to
:func:`cute_fp4.quantize` on the same device with the same global scale. No host
synchronisation and no allocation beyond the outputs, so it can be captured in a CUDA graph:

* static global scale (a calibrated ``input_scale``, float32 tensor of one element): one
  kernel;
* dynamic (``global_scale=None``): ``amax / 2688`` computed on the GPU, either by an amax
  kernel and the quantize kernel ("two_pass") or by one kernel whose CTAs each reduce the
  whole input ("fused", for decode-sized inputs up to :data:`FUSED_MAX_ELEMENTS`).

:func:`quantize_values` is the static variant that writes the exact block values (``e2m1 *
scale``, BF16) instead of the NVFP4 tensor, what a W4A4 product run by the W4A16 kernel
reads, in one pass. :class:`BoundActivation` launches either for ``NVFP4Linear``'s bound
W4A4 forward.

Kernels compile once per (target, dtype, variant, decode-sized or not: :func:`default_spec`)
with symbolic M and K and go through the package's disk cache (``cute_fp4.cache``) like the
GEMMs.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import torch

from cute_fp4.errors import CompileError, DeviceError, InputError, InputTypeError
from cute_fp4.nvfp4 import NVFP4Tensor, quantize, scale_shape
from cute_fp4.operands import A_FORMATS
from cute_fp4.targets import reference_mode

# dynamic scale: one fused kernel up to this many elements (H200, 2026-12-01: fused 2.9-3.7 us
# against two passes' 3.9-4.0 up to 32K elements, 4.3-6.0 against 4.1-4.2 at 64K-128K)
FUSED_MAX_ELEMENTS = 1 << 15
MAX_ELEMENTS = (1 << 31) - 1  # 32-bit element indices inside the kernel
DYNAMIC_MODES = ("auto", "two_pass", "fused")


# ----------------------------------------------------------------------------- checks

def _check_x(x, require_cuda: bool = True) -> tuple[int, int]:
    if not isinstance(x, torch.Tensor):
        raise InputTypeError(f"quantize_activation() takes a torch.Tensor, got "
                             f"{type(x).__name__}")
    if x.dtype not in A_FORMATS:
        raise InputError(f"quantize_activation() needs a bfloat16 or float16 tensor, got "
                         f"{x.dtype} (cute_fp4.quantize takes float32/float64)")
    if x.dim() != 2:
        raise InputError(f"quantize_activation() needs a 2-D tensor [M, K], got shape "
                         f"{tuple(x.shape)} (reshape to [-1, K] first)")
    m, k = x.shape
    if m == 0 or k == 0:
        raise InputError(f"cannot quantize an empty tensor of shape {tuple(x.shape)}")
    if k % 16:
        raise InputError(f"K = {k} is not a multiple of 16 (the NVFP4 block size)")
    if require_cuda and x.device.type != "cuda":
        raise DeviceError(f"quantize_activation() runs on a CUDA device, x is on {x.device}")
    if not x.is_contiguous():
        raise InputError(f"x must be contiguous (row-major); got strides {x.stride()} for "
                         f"shape {tuple(x.shape)}")
    if x.data_ptr() % 16:
        raise InputError(f"x's data pointer 0x{x.data_ptr():x} is not 16-byte aligned "
                         f"(offset {x.data_ptr() % 16}); the kernel loads 16 bytes at a time")
    if m * k > MAX_ELEMENTS:
        raise InputError(f"x has {m * k:,} elements; the kernel indexes at most "
                         f"{MAX_ELEMENTS:,}")
    return m, k


def _check_scale_tensor(gs: torch.Tensor, device: torch.device, name: str) -> None:
    if gs.dtype != torch.float32:
        raise InputError(f"{name} must be float32, got {gs.dtype}")
    if gs.numel() != 1:
        raise InputError(f"{name} must have one element, got {gs.numel()} (shape "
                         f"{tuple(gs.shape)})")
    if gs.device != device:
        raise InputError(f"{name} is on {gs.device} but x is on {device}")


def _static_scale(global_scale, device: torch.device) -> torch.Tensor:
    """The global scale as a one-element float32 tensor on ``device`` (no host sync: a
    tensor's value cannot be checked here, a Python number is)."""
    if isinstance(global_scale, torch.Tensor):
        _check_scale_tensor(global_scale, device, "global_scale")
        return global_scale
    if isinstance(global_scale, bool) or not isinstance(global_scale, (int, float)):
        raise InputTypeError(f"global_scale must be a float32 tensor of one element, a "
                             f"number or None, got {type(global_scale).__name__}")
    v = float(global_scale)
    if not math.isfinite(v) or v <= 0:
        raise InputError(f"global_scale must be finite and > 0, got {v:g}")
    return torch.full((), v, dtype=torch.float32, device=device)


def _check_out(out, m: int, k: int, device: torch.device, dynamic: bool) -> None:
    if not isinstance(out, NVFP4Tensor):
        raise InputTypeError(f"out must be an NVFP4Tensor, got {type(out).__name__}")
    if tuple(out.shape) != (m, k):
        raise InputError(f"out has shape {tuple(out.shape)} but x is [{m}, {k}]")
    rp, cp = scale_shape(m, k)
    for t, name, shape, align in ((out.data, "out.data", (m, k // 2), 8),
                                  (out.scale, "out.scale", (rp, cp), 16)):
        if t.device != device:
            raise InputError(f"{name} is on {t.device} but x is on {device}")
        if tuple(t.shape) != shape or not t.is_contiguous():
            raise InputError(f"{name} must be contiguous with shape {shape}, got shape "
                             f"{tuple(t.shape)} and strides {t.stride()}")
        if t.data_ptr() % align:
            raise InputError(f"{name}'s data pointer 0x{t.data_ptr():x} is not {align}-byte "
                             "aligned")
    _check_scale_tensor(out.global_scale, device, "out.global_scale")  # written either way


# ----------------------------------------------------------------------------- compile

class CompiledSpecKernel:
    """A compiled kernel made from a spec (quantize, dequantize, the routing sort of
    ``cute_fp4.sorting``): the DSL function (its TVM-FFI entry when built with one, which
    takes the kernel object's ``raw_args``: ints), the kernel object that builds its
    arguments, and the CUstream object of each torch stream (the DSL call path)."""

    def __init__(self, spec, fn, kernel, compile_s: float, source: str):
        from cute_fp4.compile import ffi_function, stream_getter

        self.spec, self._fn, self._kernel = spec, fn, kernel
        self.compile_s, self.source = compile_s, source  # source: built / loaded / uncached
        self._ffi = ffi_function(fn)
        self.call_path = "dsl" if self._ffi is None else "tvm-ffi"
        self._streams: dict[int, object] = {}
        self._stream_handle = stream_getter()  # device index -> raw current stream handle

    def _stream(self):
        handle = torch.cuda.current_stream().cuda_stream
        stream = self._streams.get(handle)
        if stream is None:
            from cuda.bindings import driver

            if len(self._streams) >= 64:
                self._streams.clear()
            stream = self._streams[handle] = driver.CUstream(handle)
        return stream

    def _call(self, index: int, *args) -> None:
        """Launch on device ``index``'s current stream with the kernel object's arguments
        ``args`` (the stream added last): its ``raw_args`` through the TVM-FFI entry, else
        its ``runtime_args`` through the DSL's call path."""
        if self._ffi is not None:
            self._ffi(*self._kernel.raw_args(*args, self._stream_handle(index)))
        else:
            self._fn(*self._kernel.runtime_args(*args, self._stream()))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.spec.label()}, {self.source} in "
                f"{self.compile_s:.2f} s, {self.call_path})")


class CompiledQuantize(CompiledSpecKernel):
    """One compiled quantization kernel; ``launch`` takes checked torch tensors."""

    def __init__(self, spec, fn, kernel, compile_s: float, source: str, sm_count: int):
        super().__init__(spec, fn, kernel, compile_s, source)
        self.max_ctas = spec.max_ctas(sm_count)

    def launch(self, x, q, sf, gs, partials) -> None:
        self._call(x.device.index, x, q, sf, gs, partials, self.max_ctas)


class CompiledDequantize(CompiledSpecKernel):
    """The compiled NVFP4 -> BF16 kernel (``cute_fp4.kernels.dequantize``)."""

    def launch(self, q, sf, out, scales=None) -> None:
        """``scales``: None, or (ga, gb, alpha) float32 one-element tensors: the kernel
        also stores ``ga * gb`` into ``alpha``."""
        self._call(out.device.index, q, sf, out, scales)


_CACHE: dict = {}
_LOCK = threading.Lock()


def compile_quantize(spec) -> CompiledQuantize:
    """The compiled kernel of ``spec`` (a ``QuantSpec`` for the present GPU), from the
    memory cache, the disk cache, or built."""
    from cute_fp4.targets import require_device

    dev = require_device()
    if dev.target.name != spec.target:
        raise DeviceError(f"{spec.label()} is for {spec.target}; this GPU is "
                          f"{dev.target.name}")
    with _LOCK:
        hit = _CACHE.get((spec, dev.index))
        if hit is None:
            hit = _CACHE[(spec, dev.index)] = _build(spec, dev.sm_count)
    return hit


def spec_compile(kernel, options: str | None = None):
    """``cute.compile`` of a spec kernel on its fake arguments (``options``: the DSL's
    compile options); a CompileError naming the spec otherwise."""
    import cutlass.cute as cute

    kwargs = {"options": options} if options else {}
    try:
        return cute.compile(kernel, *kernel.fake_args(), **kwargs)
    except Exception as e:  # the DSL raises many types; keep the message
        raise CompileError(f"CuTe DSL failed on {kernel.spec.label()}: {e}") from e


def quantize_kernel(spec):
    """The kernel object of ``spec`` (imported on first use: no DSL import at import time)."""
    from cute_fp4.kernels.quantize import QuantizeKernel

    return QuantizeKernel(spec)


def cross_compile_quantize(spec, dump_dir: str | None = None):
    """Compile for ``spec.target`` without a GPU (CI); returns (compiled, seconds). With
    ``dump_dir``, through the build cache as GEMMs are (``compile.cross_build``: compiled
    is None when the cubin and PTX were copied from there)."""
    return cross_compile_spec(quantize_kernel(spec), dump_dir)


REPORT_OPCODES = ("LDGSTS.E.BYPASS.LTC128B.128", "LDS.128", "LDG.E.128", "STG.E.64",
                  "STG.E.128", "STG.E.U8", "HMNMX2",
                  "F2FP.SATFINITE.E2M1", "F2FP.SATFINITE.E4M3", "MUFU.RCP", "REDUX")


def quantize_compile_report(spec) -> dict:
    """Cross-compile ``spec`` (no GPU needed) and read its cubin: kernels, registers,
    spills, instruction count and how often each of :data:`REPORT_OPCODES` occurs."""
    import re
    import tempfile

    from cute_fp4.inspect import cubin_sass, inspect_cubin

    with tempfile.TemporaryDirectory(prefix="cute_fp4_quant_") as d:
        _, secs = cross_compile_quantize(spec, dump_dir=d)
        cubins = sorted(Path(d).glob("*.cubin"))
        if not cubins:
            raise CompileError(f"the DSL wrote no cubin for {spec.label()} to {d}")
        rep = inspect_cubin(cubins[-1], ())
        sass = cubin_sass(cubins[-1])
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]+)", sass)
    return {"spec": spec.label(), "target": spec.target, "registers": rep.registers,
            "spills": rep.spills, "kernels": len(re.findall(r"Function : ", sass)),
            "instructions": len(ops), "compile_s": round(secs, 2),
            "opcodes": {p: sum(op.startswith(p) for op in ops) for p in REPORT_OPCODES}}


def _build(spec, sm_count: int) -> CompiledQuantize:
    kernel = quantize_kernel(spec)
    fn, secs, how = cached_spec_build(kernel, type(kernel).__name__)
    return CompiledQuantize(spec, fn, kernel, secs, how, sm_count)


def cached_spec_build(kernel, name: str):
    """(DSL function, seconds, how) of ``kernel`` (``.spec.label()`` names it) from the
    disk cache, or built (and stored): with the TVM-FFI entry when
    ``compile.tvm_ffi_enabled()`` (a launch then takes plain ints), falling back to the
    DSL's own call path if that build fails, as the GEMMs do."""
    from cute_fp4.compile import tvm_ffi_enabled

    if tvm_ffi_enabled():
        try:
            return _spec_build_with(kernel, name, True)
        except CompileError:
            pass
    return _spec_build_with(kernel, name, False)


def cross_compile_spec(kernel, dump_dir: str | None = None):
    """A spec kernel (``kernel.spec``: its target and label) compiled for its target
    without a GPU (CI), through the build cache with ``dump_dir`` (``compile.cross_build``:
    compiled is None when the cubin and PTX were copied from there). Returns (compiled or
    None, seconds)."""
    from cute_fp4.compile import cross_build

    spec = kernel.spec
    return cross_build(kernel, lambda opts: spec_compile(kernel, opts), spec.target, dump_dir,
                       spec.label())


_SPEC_LOCK = threading.Lock()
_TARGETS: dict[int, str | None] = {}  # device index -> its target's name (None: none)


def target_of(index: int) -> str | None:
    """The target name of CUDA device ``index`` where this package has kernels for it, else
    None; detected once per device (the spec kernels' host sides ask it per call)."""
    name = _TARGETS.get(index, "?")
    if name == "?":
        from cute_fp4.targets import detect_device

        dev = detect_device(index)
        name = _TARGETS[index] = None if dev is None or dev.target is None else \
            dev.target.name
    return name


def memo_spec_kernel(memo: dict, key, index: int, make_kernel, compiled: type):
    """``memo[key]``, else the compiled spec kernel of ``make_kernel(target)`` for device
    ``index``'s target (:func:`target_of`; built or loaded once, :func:`cached_spec_build`,
    wrapped in ``compiled``, a :class:`CompiledSpecKernel`); a DeviceError for a device
    without kernels here."""
    kern = memo.get(key)
    if kern is None:
        target = target_of(index)
        if target is None:
            raise DeviceError(f"cuda:{index} has no kernels here (see cute_fp4.targets)")
        kernel = make_kernel(target)
        with _SPEC_LOCK:
            fn, secs, how = cached_spec_build(kernel, type(kernel).__name__)
            kern = memo[key] = compiled(kernel.spec, fn, kernel, secs, how)
    return kern


def _spec_build_with(kernel, name: str, ffi: bool):
    from cute_fp4.compile import cached_build

    fn, secs, how, _ = cached_build(lambda opts: spec_compile(kernel, opts), ffi, name,
                                    kernel.spec.label())
    return fn, secs, how


SMALL_ELEMENTS = 1 << 17  # inputs up to this many elements (decode) take 1 block per thread


def default_spec(target: str, in_dtype: str = "bf16", scale: str = "static",
                 small: bool = False, output: str = "codes", **changes):
    """The ``QuantSpec`` that ``quantize_activation`` uses on ``target`` for an input of at
    most :data:`SMALL_ELEMENTS` elements (``small``) or more (``changes`` override fields:
    benchmarks and tests).

    Measured on an H200 (2026-12-01, ``perf/quantize_bench.py --sweep``, 4096^2 and decode
    sizes, CUDA-graph device time), every default one CTA per chunk: large inputs in the
    atom order, 128 threads x 4 blocks, 14.6 us at 4096^2 (61% of 4.8 TB/s; 256 x 2: 16.0
    us); decode sizes (M <= 16) in the row order (no items for the 127 padding rows), 128
    threads x 1 block, 2.0-2.2 us at K = 4096 (the atom order 2.3-2.5 us). The fused
    dynamic variant reads the whole input in every CTA, so it takes few CTAs (256 x 2).
    ``output="values"`` (:func:`quantize_values`) keeps 16 output registers per block, so
    large inputs take 2 blocks per thread (43 registers; 4 would take 106), row order."""
    from cute_fp4.kernels.quantize import QuantSpec
    from cute_fp4.targets import get_target

    if scale == "dynamic_fused":
        fields = {"threads": 256, "items": 2, "order": "rows"}
    elif output == "values":
        fields = {"threads": 128, "items": 1 if small else 2, "order": "rows"}
    elif small:
        fields = {"threads": 128, "items": 1, "order": "rows"}
    else:
        fields = {"threads": 128, "items": 4, "order": "atoms"}
    fields = {"target": get_target(target).name, "in_dtype": in_dtype, "scale": scale,
              "ctas_per_sm": 0, "output": output, **fields, **changes}
    return QuantSpec(**fields)


def _spec_for(x: torch.Tensor, scale: str, output: str = "codes"):
    from cute_fp4.targets import require_device

    return default_spec(require_device().target.name, A_FORMATS[x.dtype], scale,
                        small=x.numel() <= SMALL_ELEMENTS, output=output)


_KERNELS: dict[tuple, CompiledQuantize] = {}


def _kernel_for(x: torch.Tensor, scale: str, output: str = "codes") -> CompiledQuantize:
    """The default kernel for ``x`` (memoised per device, dtype and variant: no device
    query per call). ``x`` must be on the current device (the launch uses its stream)."""
    cur = torch.cuda.current_device()
    if x.device.index != cur:
        raise InputError(f"x is on {x.device} but the current CUDA device is cuda:{cur}; "
                         f"call under torch.cuda.device({x.device.index})")
    key = (cur, x.dtype, scale, x.numel() <= SMALL_ELEMENTS, output)
    kern = _KERNELS.get(key)
    if kern is None:
        kern = _KERNELS[key] = compile_quantize(_spec_for(x, scale, output))
    return kern


def _scale_variant(global_scale, numel: int, dynamic_mode: str) -> str:
    if dynamic_mode not in DYNAMIC_MODES:
        raise InputError(f"dynamic_mode must be one of {DYNAMIC_MODES}, got {dynamic_mode!r}")
    if global_scale is not None:
        return "static"
    if dynamic_mode == "auto":
        dynamic_mode = "fused" if numel <= FUSED_MAX_ELEMENTS else "two_pass"
    return "dynamic_fused" if dynamic_mode == "fused" else "dynamic"


# ----------------------------------------------------------------------------- public

def quantize_activation(x: torch.Tensor, global_scale: torch.Tensor | float | None = None,
                        out: NVFP4Tensor | None = None, *, dynamic_mode: str = "auto"
                        ) -> NVFP4Tensor:
    """Quantize a bf16/fp16 ``[M, K]`` tensor on the current CUDA device to NVFP4 in one
    fused GPU pass (two kernels for a dynamic scale of a large tensor), on the current
    stream.

    ``global_scale`` (decode form, ``amax / 2688``): a float32 tensor of one element on
    ``x``'s device (e.g. a calibrated ModelOpt ``input_scale``; its value is not checked,
    that would synchronise: it must be finite and > 0), a positive number, or None to
    compute it from ``x`` on the GPU (``dynamic_mode``: "auto", "two_pass" or "fused").
    ``out``: an NVFP4Tensor of shape ``[M, K]`` whose ``data`` and ``scale`` (and, for a
    dynamic scale, ``global_scale``) are overwritten; otherwise they are allocated.

    The result equals ``cute_fp4.quantize(x, global_scale)`` bit for bit, padding included.
    Every check happens before anything is written; NaN/Inf inputs are not detected (that
    would synchronise) and give unspecified codes. Under ``targets.reference_mode``:
    ``cute_fp4.quantize`` on any device (:func:`_reference_quantize`).
    """
    if reference_mode():
        return _reference_quantize(x, global_scale, out, dynamic_mode)
    m, k = _check_x(x)
    variant = _scale_variant(global_scale, m * k, dynamic_mode)
    dynamic = variant != "static"
    gs = None if dynamic else _static_scale(global_scale, x.device)
    if out is not None:
        _check_out(out, m, k, x.device, dynamic)
    kern = _kernel_for(x, variant)
    if out is not None:
        data, scale = out.data, out.scale
        gs_out = out.global_scale
        if not dynamic and gs_out.data_ptr() != gs.data_ptr():
            gs_out.copy_(gs.reshape(gs_out.shape))  # ``out`` is then a whole NVFP4 tensor
    else:
        data = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
        scale = torch.empty(scale_shape(m, k), dtype=torch.float8_e4m3fn, device=x.device)
        gs_out = torch.empty((), dtype=torch.float32, device=x.device) if dynamic else gs
    partials = None
    if variant == "dynamic":
        from cute_fp4.kernels.quantize import PARTIALS_MAX

        partials = torch.empty(PARTIALS_MAX, dtype=torch.float32, device=x.device)
    kern.launch(x, data, scale, gs_out, partials)
    return NVFP4Tensor._unchecked(data, scale, gs_out.reshape(()), (m, k))


def _reference_quantize(x, global_scale, out, dynamic_mode: str) -> NVFP4Tensor:
    """:func:`quantize_activation` under ``targets.reference_mode``: the same checks (any
    device), then ``cute_fp4.quantize`` of the exact values (bit for bit the kernels')."""
    m, k = _check_x(x, require_cuda=False)
    variant = _scale_variant(global_scale, m * k, dynamic_mode)
    gs = None if variant != "static" else _static_scale(global_scale, x.device)
    if out is not None:
        _check_out(out, m, k, x.device, gs is None)
    q = quantize(x.float(), gs)
    if out is None:
        return q
    out.data.copy_(q.data)
    out.scale.copy_(q.scale)
    out.global_scale.copy_(q.global_scale.reshape(out.global_scale.shape))
    return out


def quantize_values(x: torch.Tensor, global_scale: torch.Tensor | float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """The exact block values (``e2m1 * block_scale``, without the global scale) of
    ``quantize_activation(x, global_scale)`` as a BF16 ``[M, K]`` tensor, in one GPU pass
    without the NVFP4 tensor in between: bit for bit
    ``dequantize_activation(quantize_activation(x, global_scale))`` (a negative element
    that rounds to zero is -0, a -0 element +0). What a W4A4 product with a static global
    scale runs through the W4A16 kernel takes (``NVFP4Linear`` on SM90's packed weight),
    the global scales' product as alpha. ``out``: a contiguous, 16-byte aligned BF16
    ``[M, K]`` tensor on ``x``'s device to write, else allocated."""
    m, k = _check_x(x, require_cuda=not reference_mode())
    if global_scale is None:
        raise InputError("quantize_values() takes a static global scale (a tensor or a "
                         "number); a dynamic one: quantize_activation, then "
                         "dequantize_with_alpha")
    gs = _static_scale(global_scale, x.device)
    if out is None:
        out = torch.empty((m, k), dtype=torch.bfloat16, device=x.device)
    elif (not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16
            or tuple(out.shape) != (m, k) or not out.is_contiguous() or out.data_ptr() % 16
            or out.device != x.device):
        raise InputError(f"out must be a contiguous, 16-byte aligned bfloat16 [{m}, {k}] "
                         f"tensor on {x.device}")
    if reference_mode():
        return out.copy_(quantize(x.float(), gs).block_values(torch.bfloat16))
    _kernel_for(x, "static", "values").launch(x, out, out, gs, None)
    return out


_DEQUANT: dict[int, CompiledDequantize] = {}


def _dequant_kernel() -> CompiledDequantize:
    """The dequantize kernel of the current device (memoised per device index)."""
    cur = torch.cuda.current_device()
    kern = _DEQUANT.get(cur)
    if kern is None:
        from cute_fp4.kernels.dequantize import DequantizeKernel, DequantSpec
        from cute_fp4.targets import require_device

        kernel = DequantizeKernel(DequantSpec(require_device().target.name))
        with _LOCK:
            fn, secs, how = cached_spec_build(kernel, "DequantizeKernel")
        kern = _DEQUANT[cur] = CompiledDequantize(kernel.spec, fn, kernel, secs, how)
    return kern


def _check_nvfp4_activation(a) -> tuple[int, int]:
    if not isinstance(a, NVFP4Tensor):
        raise InputTypeError(f"dequantize_activation() takes an NVFP4Tensor, got "
                             f"{type(a).__name__}")
    if a.experts is not None or len(a.shape) != 2:
        raise InputError(f"dequantize_activation() takes one [M, K] tensor, got shape "
                         f"{list(a.shape)}")
    m, k = a.shape
    dev = a.data.device
    if not reference_mode() and (dev.type != "cuda"
                                 or dev.index != torch.cuda.current_device()):
        where = "a CUDA device" if dev.type != "cuda" else \
            f"the current CUDA device (cuda:{torch.cuda.current_device()})"
        raise DeviceError(f"dequantize_activation() runs on {where}, a is on {dev}")
    if m * k > MAX_ELEMENTS:
        raise InputError(f"a has {m * k:,} elements; the kernel indexes at most "
                         f"{MAX_ELEMENTS:,}")
    for t, name, align in ((a.data, "a.data", 8), (a.scale, "a.scale", 16)):
        if not t.is_contiguous() or t.data_ptr() % align:
            raise InputError(f"{name} must be contiguous and {align}-byte aligned (pointer "
                             f"0x{t.data_ptr():x}, strides {t.stride()})")
    return m, k


def dequantize_activation(a: NVFP4Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """An NVFP4 ``[M, K]`` tensor's exact block values ``e2m1 * block_scale`` (without the
    global scale: ``a.block_values(torch.bfloat16)``, bit for bit) as a BF16 ``[M, K]``
    tensor, in one GPU pass on the current stream (``out``: a contiguous, 16-byte aligned
    BF16 [M, K] tensor to write, else allocated). ``gemm`` runs a W4A4 product on an SM90
    fragment-order weight as this and the W4A16 kernel, the global scales in alpha."""
    out = _dequant_out(a, out)
    if reference_mode():
        return out.copy_(a.block_values(torch.bfloat16))
    _dequant_kernel().launch(a.data, a.scale, out)
    return out


def dequantize_with_alpha(a: NVFP4Tensor, other_scale: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dequantize_activation` and, from the same launch, ``a.global_scale *
    other_scale`` as a new float32 0-d tensor (the float32 product torch computes), for a
    W4A4 product through the W4A16 kernel; ``other_scale``: a float32 tensor of one element
    on ``a``'s device (the weight's global scale). Any other scale: the product is
    computed by torch instead."""
    out = _dequant_out(a, None)
    ga, dev = a.global_scale, a.data.device
    if reference_mode():
        out.copy_(a.block_values(torch.bfloat16))
        return out, (ga.to(dev, torch.float32) * other_scale.to(dev, torch.float32)).reshape(())
    if not all(t.dtype == torch.float32 and t.numel() == 1 and t.device == dev
               for t in (ga, other_scale)):
        _dequant_kernel().launch(a.data, a.scale, out)
        return out, (ga.to(dev, torch.float32) * other_scale.to(dev, torch.float32)
                     ).reshape(())
    alpha = torch.empty((), dtype=torch.float32, device=dev)
    _dequant_kernel().launch(a.data, a.scale, out, (ga, other_scale, alpha))
    return out, alpha


def w4a16_operands(a: NVFP4Tensor, weight_scale: torch.Tensor, alpha=None):
    """(activation, alpha) for a W4A4 product run by the W4A16 kernel: ``a``'s exact BF16
    block values and, when ``alpha`` is None, the two global scales' product from the same
    launch (:func:`dequantize_with_alpha`); a given ``alpha`` is kept."""
    if alpha is None:
        return dequantize_with_alpha(a, weight_scale)
    return dequantize_activation(a), alpha


class BoundActivation:
    """The activation side of a W4A4 forward at one M, bound once (as ``run.BoundLaunch``
    binds a GEMM) and launched through TVM-FFI entries on raw addresses inside one scratch
    allocation per call, on the current stream:

    * a static global scale: the quantizer (codes and scales), or for a product run by the
      W4A16 kernel (``decode``) the quantizer to values (:func:`quantize_values`);
    * a dynamic one (``global_scale`` None): the quantizer computing the scale (one or two
      kernels, as :func:`quantize_activation` picks them) and alpha, the two global
      scales' product (``other_scale``: the weight's), for the GEMM to read per call:
      ``decode``, the decoder writes the exact BF16 block values and alpha
      (:func:`dequantize_with_alpha`); else torch multiplies the scales into the scratch
      (as ``gemm`` does for a W4A4 call without alpha).

    The caller has checked the activation (contiguous, 16-byte aligned, [M, K] of the bound
    dtype on the bound device) and matches the binding on the scale tensors (``key``); the
    results equal the unbound functions' on the same input, bit for bit.

    Build with :meth:`make` (None where a kernel has no TVM-FFI entry)."""

    __slots__ = ("key", "_q", "_dq", "_decode", "_dynamic", "_tail", "_gs", "_other",
                 "_stream_of", "_dev", "_offsets", "_words", "_mk", "_two_pass")

    @classmethod
    def make(cls, x: torch.Tensor, global_scale: torch.Tensor | None, decode: bool, key=None,
             other_scale: torch.Tensor | None = None) -> BoundActivation | None:
        if global_scale is None:
            if other_scale is None:
                raise InputError("a dynamic-scale binding takes the weight's global scale "
                                 "(other_scale) for alpha")
            q = _kernel_for(x, _scale_variant(None, x.numel(), "auto"))
            dq = _dequant_kernel() if decode else None
            if q._ffi is None or (decode and dq._ffi is None):
                return None
        else:
            q, dq = _kernel_for(x, "static", "values" if decode else "codes"), None
            if q._ffi is None:
                return None
        return cls(q, dq, x, global_scale, other_scale, key, decode)

    def __init__(self, q: CompiledQuantize, dq: CompiledDequantize | None, x: torch.Tensor,
                 gs: torch.Tensor | None, other: torch.Tensor | None, key, decode: bool):
        from cute_fp4.kernels.quantize import PARTIALS_MAX

        m, k = x.shape
        self.key, self._q, self._dq, self._decode = key, q, dq, decode
        self._dynamic = gs is None
        self._two_pass = q.spec.scale == "dynamic"  # an amax kernel writes partials first
        self._gs = 0 if gs is None else gs.data_ptr()
        self._other = None if other is None else other.reshape(1)  # follows in-place writes
        self._dev, self._stream_of = x.device.index, q._stream_handle
        self._tail, self._mk = (m, k, q.max_ctas), (m, k)
        rows, cols = scale_shape(m, k)
        sizes = {"codes": m * k // 2, "scales": rows * cols}  # every part 256-byte aligned
        if self._dynamic:  # the global scale, the amax partials, [values,] alpha
            sizes.update(gs=4, partials=4 * PARTIALS_MAX if self._two_pass else 0,
                         values=2 * m * k if decode else 0, alpha=4)
        elif decode:
            sizes = {"values": 2 * m * k}
        self._offsets, at = {}, 0
        for name, size in sizes.items():
            self._offsets[name] = at
            at += -(-size // 256) * 256
        self._words = at // 4  # a float32 scratch: alpha's slot is a tensor for torch

    def launch(self, x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
        """Quantize ``x`` (to values, ``decode``): (the scratch tensor, which must outlive
        the GEMM's launch on this stream, A's address for the GEMM, its block scales'
        address (codes) or 0 (values: the GEMM reads BF16), alpha's address (a dynamic
        scale) or 0 (the bound alpha holds))."""
        scratch = torch.empty(self._words, dtype=torch.float32, device=x.device)
        base, off = scratch.data_ptr(), self._offsets
        stream = self._stream_of(self._dev)
        if self._decode and not self._dynamic:  # the scale pointer is never read there
            values = base + off["values"]
            self._q._ffi(x.data_ptr(), values, values, self._gs, self._gs, *self._tail,
                         stream)
            return scratch, values, 0, 0
        codes, scales = base + off["codes"], base + off["scales"]
        if not self._dynamic:
            self._q._ffi(x.data_ptr(), codes, scales, self._gs, self._gs, *self._tail,
                         stream)
            return scratch, codes, scales, 0
        gs, alpha = base + off["gs"], base + off["alpha"]
        part = base + off["partials"] if self._two_pass else gs  # never read: fused
        self._q._ffi(x.data_ptr(), codes, scales, gs, part, *self._tail, stream)
        if self._decode:
            values = base + off["values"]
            self._dq._ffi(codes, scales, values, gs, self._other.data_ptr(), alpha,
                          *self._mk, 1, stream)
            return scratch, values, 0, alpha
        g, a = off["gs"] // 4, off["alpha"] // 4
        torch.mul(self._other, scratch[g:g + 1], out=scratch[a:a + 1])  # as gemm: w * a
        return scratch, codes, scales, alpha


def _dequant_out(a, out) -> torch.Tensor:
    m, k = _check_nvfp4_activation(a)
    if out is None:
        return torch.empty((m, k), dtype=torch.bfloat16, device=a.data.device)
    if (not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16
            or tuple(out.shape) != (m, k) or not out.is_contiguous() or out.data_ptr() % 16
            or out.device != a.data.device):
        raise InputError(f"out must be a contiguous, 16-byte aligned bfloat16 [{m}, {k}] "
                         f"tensor on {a.data.device}")
    return out


__all__ = ["quantize_activation", "quantize_values", "dequantize_activation",
           "dequantize_with_alpha", "w4a16_operands", "BoundActivation",
           "compile_quantize",
           "cross_compile_quantize", "default_spec", "CompiledQuantize", "CompiledDequantize",
           "CompiledSpecKernel", "cached_spec_build", "cross_compile_spec",
           "memo_spec_kernel", "spec_compile", "target_of",
           "FUSED_MAX_ELEMENTS", "DYNAMIC_MODES"]
