"""GEMM operands: the checks every call goes through, alpha, output dtypes, test operands.

:func:`check_operands` runs before anything is launched or written: a bad input raises a
typed error naming the problem and the numbers, and the output tensor is left untouched.
Host metadata only (shapes, dtypes, devices, strides, pointers): no GPU synchronisation.
A signature that passed is remembered, so a repeated call re-checks only its pointers.
This module sits under the host layer (``run``) and the API (``api``), which both use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from cute_fp4.blockscaled import BlockTensor
from cute_fp4.errors import DeviceError, FormatError, InputError, InputTypeError, OffsetsError
from cute_fp4.formats import FORMATS, NVFP4, BlockFormat, Operand, get_format
from cute_fp4.mxfp4 import MXFP4Tensor
from cute_fp4.nvfp4 import NVFP4Tensor, quantize
from cute_fp4.packed import UNIT_K, PackedWeight, packed_rows
from cute_fp4.schedule import OutDtype, Schedule, gated_op

_TORCH_OUT = {OutDtype.BF16: torch.bfloat16, OutDtype.FP16: torch.float16,
              OutDtype.FP32: torch.float32}
ALIGN = 16  # bytes: TMA needs 16-byte aligned base addresses and row pitches
_MEMO_TYPES = frozenset({NVFP4Tensor, MXFP4Tensor})  # the formats' tensor classes
_BINDABLE_A = (torch.Tensor, NVFP4Tensor)  # activations a gemm binding takes (W4A16, W4A4)
K_MULTIPLE = 32  # K: packed FP4 rows of whole 16-byte units
N_MULTIPLE = 8  # N: bf16/fp16 output rows of whole 16-byte units


class Operands(NamedTuple):
    """What one GEMM launch passes its kernel, checked (``check_operands`` or
    ``check_grouped_operands``): torch tensors, None for an absent operand. The kernels'
    launch code (``kernels.launch``) turns them into the compiled signature's arguments."""

    a: torch.Tensor  # A's data: packed FP4 bytes [M, K/2] or 16-bit [M, K]
    a_scale: torch.Tensor | None  # A's blocked scales (None: 16-bit A, W4A16)
    b: torch.Tensor  # B's data: [N, K/2] (plain or fragment order), a stack [E, rows, K/2]
    b_scale: torch.Tensor  # B's blocked scales
    out: torch.Tensor | NVFP4Tensor  # the output [M, N'] (an NVFP4Tensor: "nvfp4_out")
    alpha: torch.Tensor  # float32 on the device: one value, or one per expert (grouped)
    workspace: tuple | None = None  # split-K (counters, partials) of a dense launch
    offsets: torch.Tensor | None = None  # int32 [E + 1] of a grouped launch
    bias: torch.Tensor | None = None  # the fused bias: float32 [N] ([E, N] grouped)
    # the stream kernel may read the weight before waiting for the kernel before it (only
    # for a weight no kernel still in flight on the stream writes: kernels/stream.py)
    early: bool = False


@dataclass(slots=True, eq=False)
class GemmCall:
    """One dense GEMM call as a front end states it (``cute_fp4.gemm``'s arguments, a custom
    op's wrapped tensors, a prepared layer's call), handed down the launch path as one
    record (``api.run_call`` -> ``bindings.gemm`` -> ``run.gemm_call``). Nothing is checked
    when it is made: the launch path checks it before anything is launched or written."""

    a: torch.Tensor | BlockTensor  # 16-bit [M, K] (W4A16) or a block tensor (W4A4)
    b: BlockTensor | PackedWeight  # the weight [N, K], plain or fragment-order packed
    schedule: str | Schedule = "auto"  # a catalogue name, "auto" or a Schedule
    out: torch.Tensor | NVFP4Tensor | None = None  # written when given
    out_dtype: torch.dtype = torch.bfloat16
    alpha: torch.Tensor | float | None = None  # None: the product of the global scales
    bias: torch.Tensor | None = None  # fused: float32 [N], added before the rounding
    silu_mul: bool = False  # fused: F.silu(gate) * up of b's interleaved gate/up rows
    swiglu_oai: bool = False  # fused: gpt-oss's clamped SwiGLU of them
    nvfp4_out: torch.Tensor | float | None = None  # fused: the output quantized to NVFP4
    check: bool = False  # the first call of its kernel held to the exact reference
    # a 16-bit ``a`` that the call quantizes to b's format first (W4A4 from the model's
    # activations, ``quant.quantize_activation``) with this global scale (None: per call)
    quantize_a: bool = False
    input_scale: torch.Tensor | None = None
    group: int | None = None  # b's gate/up rows per group (None: its kernels' group)
    early: bool = False  # ``Operands.early``: nothing in flight on the stream writes b

    @property
    def ops(self) -> tuple[str, ...]:
        """The fused epilogue operations it asks for (:func:`epilogue_ops`)."""
        return epilogue_ops(self.bias, self.silu_mul, self.nvfp4_out, self.swiglu_oai)

    @property
    def packed(self) -> bool:
        """Whether the weight is in the fragment-order packed layout."""
        return isinstance(self.b, PackedWeight)

    @property
    def bindable(self) -> bool:
        """Whether a binding can repeat it (``cute_fp4.bindings``): a call on a 16-bit
        tensor (W4A16) or an NVFP4Tensor (W4A4), no fused operation, nothing quantized or
        validated on the way."""
        return (type(self.a) in _BINDABLE_A and not self.quantize_a and not self.check
                and self.bias is None and not self.silu_mul and not self.swiglu_oai
                and self.nvfp4_out is None)

    def replace(self, **changes) -> GemmCall:
        """A copy with ``changes`` (the launch path's own steps: the activation quantized,
        its values decoded)."""
        return replace(self, **changes)


def out_dtype_of(schedule: Schedule) -> torch.dtype:
    """The torch dtype a schedule's epilogue writes."""
    return _TORCH_OUT[schedule.epilogue.out_dtype]


def _check_tensor(t: torch.Tensor, name: str, dtypes, shape, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise InputError(f"{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise InputError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise InputError(f"{name} is on {t.device} but the operands are on {device}")
    if not t.is_contiguous():
        raise InputError(f"{name} must be contiguous (row-major); got strides {t.stride()} "
                         f"for shape {tuple(t.shape)}")
    if t.data_ptr() % ALIGN:
        raise InputError(f"{name}'s data pointer 0x{t.data_ptr():x} is not {ALIGN}-byte "
                         f"aligned (offset {t.data_ptr() % ALIGN}); TMA needs {ALIGN} bytes")


A_FORMATS = {torch.bfloat16: Operand.BF16, torch.float16: Operand.FP16}  # 16-bit A (W4A16)
_TENSOR_NAMES = "an NVFP4Tensor or MXFP4Tensor"


def format_of_scale(scale: torch.Tensor) -> BlockFormat:
    """The block format whose scale type is stored in ``scale``'s dtype (float8_e8m0fnu:
    MXFP4's UE8M0; float8_e4m3fn and uint8 bytes: NVFP4's UE4M3): how the custom ops,
    which take plain tensors, know an operand's format."""
    for fmt in FORMATS.values():
        if fmt is not NVFP4 and scale.dtype == fmt.scale.torch_dtype:
            return fmt
    return NVFP4


def as_scale(scale: torch.Tensor, fmt: BlockFormat = NVFP4) -> torch.Tensor:
    """Scales in ``fmt``'s storage dtype (uint8 bytes, as the custom ops may take them, are
    viewed, not copied)."""
    return scale.view(fmt.scale.torch_dtype) if scale.dtype == torch.uint8 else scale


def _a_format(a, rows: str = "M", note: str = "") -> tuple[int, int, Operand]:
    """(rows, K, format) of the A operand; raises on anything but a 2-D block tensor
    (NVFP4Tensor, MXFP4Tensor) or a 2-D bf16/fp16 tensor (``rows``, ``note``: how the
    messages name A's rows: ``M`` for gemm, ``total_M`` and the sort order for
    grouped_gemm)."""
    if isinstance(a, BlockTensor):
        if a.experts is not None:
            raise InputError(f"a must be 2-D [{rows}, K]{note}, got an expert stack of "
                             f"shape {a.shape}")
        return *a.shape, Operand.of(a.fmt)
    if not isinstance(a, torch.Tensor):
        raise InputTypeError(f"a must be {_TENSOR_NAMES} or a torch.Tensor, "
                             f"got {type(a).__name__}")
    if a.dim() != 2:
        raise InputError(f"a must be 2-D [{rows}, K], got shape {tuple(a.shape)}")
    fmt = A_FORMATS.get(a.dtype)
    if fmt is None:
        raise InputError(f"a must be {_TENSOR_NAMES} (W4A4) or bfloat16/float16 (W4A16), "
                         f"got {a.dtype}")
    return *a.shape, fmt


def _check_a_against_b(a_dims: tuple[int, int, Operand], fmt: BlockFormat, k: int,
                       b_dims: str) -> None:
    """A (``(rows, K, format)`` from :func:`_a_format`) against the weight: one block format
    or a 16-bit one it decodes to (:func:`check_formats`), and the same K (``b_dims``: how
    the message shows B's shape)."""
    rows, ka, a_format = a_dims
    check_formats(a_format, fmt)
    if ka != k:
        raise InputError(f"K mismatch: a is [{rows}, {ka}] and b is [{b_dims}]")


def check_formats(a_format: Operand, fmt: BlockFormat) -> None:
    """The activation's format against the weight's block format ``fmt``: W4A4 takes both in
    one block format, and a weight whose scales exceed FP16's range (MXFP4's UE8M0)
    decodes to BF16 only. A FormatError naming both formats otherwise."""
    if not a_format.sixteen_bit and a_format.block_format is not fmt:
        raise FormatError(f"a is {a_format} and b is {fmt}: W4A4 takes both operands in one "
                          f"block format; quantize the activations with format='{fmt}' "
                          "(cute_fp4.quantize) or pass bfloat16 activations (W4A16)")
    if a_format is Operand.FP16 and fmt.scale.max > torch.finfo(torch.float16).max:
        raise FormatError(f"a is fp16 and b is {fmt}: {fmt} weights decode to BF16 only "
                          f"({fmt.scale.name} scales reach {fmt.scale.max:.3g}, beyond FP16's "
                          "range); pass bfloat16 activations")


# Signatures of operands that passed every check, mapped to their (M, N, K, a_format). Only
# successes are stored, so a refused input runs the full checks (and raises) every time.
_PASSED: dict[tuple, tuple[int, int, int, str]] = {}
_PASSED_MAX = 4096  # distinct signatures kept; the table is emptied when it is full


def signature(a, b, out, out_dtype: torch.dtype, require_cuda: bool = True) -> tuple | None:
    """The key of :func:`check_operands`' memo: every shape, dtype, device and contiguity the
    checks read (the NVFP4 containers' ``shape`` included), or None for inputs the memo
    does not handle (anything but a block tensor ``b`` of its format's own class, a block
    tensor or tensor ``a``, a tensor or None ``out``): those always take the full checks.
    Written out attribute by attribute: it runs on every call, and a helper per tensor
    doubled its cost."""
    tb = type(b)
    if tb not in _MEMO_TYPES:
        return None
    if out is None:
        o = None
    elif type(out) is torch.Tensor:
        o = (out.shape, out.dtype, out.device, out.is_contiguous())
    else:
        return None
    bd, bs = b.data, b.scale
    rest = (tb, b.shape, bd.shape, bd.dtype, bd.device, bd.is_contiguous(), bs.shape,
            bs.dtype, bs.device, bs.is_contiguous(), o, out_dtype, require_cuda)
    if type(a) is torch.Tensor:  # W4A16: 5 fields, W4A4: 10, so the two never collide
        return a.shape, a.dtype, a.device, a.is_contiguous(), rest
    if type(a) in _MEMO_TYPES:
        ad, asc = a.data, a.scale
        return (a.shape, ad.shape, ad.dtype, ad.device, ad.is_contiguous(), asc.shape,
                asc.dtype, asc.device, asc.is_contiguous(), rest)
    return None


def _pointers_aligned(a, b, out) -> bool:
    """Whether every base address the kernels read or write is ALIGN-byte aligned."""
    p = b.data.data_ptr() | b.scale.data_ptr()
    p |= (a.data.data_ptr() | a.scale.data_ptr()) if type(a) in _MEMO_TYPES else a.data_ptr()
    if out is not None:
        p |= out.data_ptr()
    return not p % ALIGN


def check_operands(a, b, out, alpha, out_dtype: torch.dtype,
                   require_cuda: bool = True) -> tuple[int, int, int, str]:
    """Validate operands; returns (M, N, K, a_format). Raises before anything is written.
    ``require_cuda=False`` skips only the device-type check (CPU tests of the rest).

    Every check but the pointer alignment depends only on the operands' metadata, so a
    signature (:func:`signature`) that passed once is remembered: later calls with it test
    only the alignment of the data pointers and alpha's size, a few microseconds instead
    of tens. Anything not seen before, and any misaligned pointer, runs the full checks,
    so each bad input raises the same error as without the memo."""
    key = signature(a, b, out, out_dtype, require_cuda)
    dims = _PASSED.get(key) if key is not None else None
    if dims is None or not _pointers_aligned(a, b, out):
        dims = check_all(a, b, out, alpha, out_dtype, require_cuda)
        if key is not None:
            if len(_PASSED) >= _PASSED_MAX:
                _PASSED.clear()
            _PASSED[key] = dims
    elif alpha is not None and isinstance(alpha, torch.Tensor) and alpha.numel() != 1:
        raise InputError(f"alpha must be a scalar, got {alpha.numel()} elements")
    return dims


def check_all(a, b, out, alpha, out_dtype: torch.dtype,
              require_cuda: bool = True) -> tuple[int, int, int, str]:
    """:func:`check_operands` without its memo: every check, every call."""
    if not isinstance(b, BlockTensor):
        raise InputTypeError(f"b (the weight) must be {_TENSOR_NAMES} [N, K], got "
                             f"{type(b).__name__}; use cute_fp4.quantize() (format=...), "
                             "NVFP4Tensor.from_modelopt() or MXFP4Tensor.from_blocks()")
    if len(b.shape) != 2:
        raise InputError(f"b is a stack of {b.shape[0]} experts {list(b.shape)}: gemm takes "
                         "one [N, K] weight; cute_fp4.grouped_gemm(a, b, offsets) runs stacks")
    n, k = b.shape
    dev = b.device
    if require_cuda and dev.type != "cuda":
        raise DeviceError(f"operands must be on a CUDA device, b is on {dev}")
    m, _, a_format = a_dims = _a_format(a)
    fmt = b.fmt
    _check_a_against_b(a_dims, fmt, k, f"{n}, {k}")
    if m == 0 or n == 0 or k == 0:
        raise InputError(f"empty GEMM: M = {m}, N = {n}, K = {k}; all must be > 0")
    if k % K_MULTIPLE:
        raise InputError(f"K = {k} is not a multiple of {K_MULTIPLE}: packed FP4 rows must "
                         "be a multiple of 16 bytes")
    _check_block(b, "b", n, k, (n, fmt.data_row_bytes(k)), dev)
    if not a_format.sixteen_bit:
        _check_block(a, "a", m, k, (m, fmt.data_row_bytes(k)), dev)
    else:
        _check_tensor(a, "a", (a.dtype,), (m, k), dev)
    _check_out(out, m, n, out_dtype, dev, f"N = {n} gives output")
    if alpha is not None and isinstance(alpha, torch.Tensor) and alpha.numel() != 1:
        raise InputError(f"alpha must be a scalar, got {alpha.numel()} elements")
    return m, n, k, a_format


def _check_block(t: BlockTensor, name: str, rows: int, k: int, data_shape, dev) -> None:
    """A block tensor's data (uint8 ``data_shape``) and blocked scales (its format's dtype
    and padded shape) as a kernel reads them."""
    fmt = t.fmt
    _check_tensor(t.data, f"{name}.data", (torch.uint8,), data_shape, dev)
    _check_tensor(t.scale, f"{name}.scale", (fmt.scale.torch_dtype,),
                  fmt.scale_shape(rows, k), dev)


def epilogue_ops(bias, silu_mul: bool, nvfp4_out=None, swiglu_oai: bool = False
                 ) -> tuple[str, ...]:
    """The fused epilogue operations (``Epilogue.ops``) a call's arguments ask for:
    ``swiglu_oai`` is gpt-oss's clamped SwiGLU (``schedule.EPILOGUE_OPS``)."""
    for flag, what in ((silu_mul, "silu_mul"), (swiglu_oai, "swiglu_oai")):
        if not isinstance(flag, bool):
            raise InputTypeError(f"{what} must be a bool, got {type(flag).__name__}")
    if silu_mul and swiglu_oai:
        raise InputError("silu_mul and swiglu_oai are both gated activations of the gate/up "
                         "columns: ask for one")
    return ((("bias",) if bias is not None else ()) + (("silu_mul",) if silu_mul else ())
            + (("swiglu_oai",) if swiglu_oai else ())
            + (("nvfp4_out",) if nvfp4_out is not None else ()))


def nvfp4_out_tensor(out, global_scale, rows: int, cols: int, device) -> NVFP4Tensor:
    """The ``NVFP4Tensor`` a ``"nvfp4_out"`` launch writes: ``out`` (checked: uint8 codes
    ``[rows, cols / 2]``, blocked scales of ``rows x cols``, on ``device``) or a new one
    with ``global_scale`` (a float, or a float32 tensor of one element: the next layer's
    static input scale, decode form; a device tensor's value is not read here: it must be
    finite and > 0)."""
    if out is not None:
        if not isinstance(out, NVFP4Tensor) or out.experts is not None:
            raise InputTypeError(f"out must be a 2-D NVFP4Tensor with nvfp4_out, got "
                                 f"{type(out).__name__}")
        if out.shape != (rows, cols) or out.device != device:
            raise InputError(f"out must be an NVFP4Tensor of shape {(rows, cols)} on {device}, "
                             f"got {out.shape} on {out.device}")
        if not out.data.is_contiguous():
            raise InputError("out.data must be contiguous")
        return out
    if isinstance(global_scale, torch.Tensor):
        if global_scale.numel() != 1 or global_scale.dtype != torch.float32:
            raise InputError(f"nvfp4_out's global scale must be one float32 value, got "
                             f"{global_scale.dtype} with {global_scale.numel()} elements")
        gs = global_scale.to(device).reshape(())
    else:
        gs = float(global_scale)
        if not math.isfinite(gs) or gs <= 0:
            raise InputError(f"nvfp4_out's global scale must be finite and > 0, got {gs:g}")
        gs = torch.tensor(gs, dtype=torch.float32, device=device)
    rp, cp = NVFP4.scale_shape(rows, cols)
    return NVFP4Tensor._unchecked(torch.empty((rows, NVFP4.data_row_bytes(cols)),
                                              dtype=torch.uint8, device=device),
                                  torch.empty((rp, cp), dtype=NVFP4.scale.torch_dtype,
                                              device=device), gs, (rows, cols))


def check_fused_operands(bias, out, rows: int, n: int, out_dtype: torch.dtype,
                         ops: tuple[str, ...], device, experts: int = 0) -> int:
    """Checks of a call with fused epilogue ``ops``: ``bias`` float32 ``[N]`` (``[E, N]``
    for ``experts`` > 0: one row per expert), ``out`` ``[rows, N / 2]`` with a gated
    activation (``silu_mul``, ``swiglu_oai``: gate/up halves, ``cute_fp4.fused``) else
    ``[rows, N]``. Returns the output's columns. (Whether N splits into the kernel's gate/up
    groups is plan()'s check.)"""
    gated = gated_op(ops)
    if gated and n % 2:
        raise InputError(f"{gated} takes N = {n} GEMM columns (gate and up): N must be even")
    cols = n // 2 if gated else n
    if bias is not None:
        shape = (experts, n) if experts else (n,)
        _check_tensor(bias, "bias", (torch.float32,), shape, device)
    if "nvfp4_out" in ops:
        unit = 2 * ALIGN  # 16-byte rows of packed codes
        if cols % unit:
            raise InputError(f"nvfp4_out: the output's {cols} columns must be a multiple of "
                             f"{unit} (blocks of {NVFP4.block}, rows of codes in "
                             f"{ALIGN}-byte multiples)")
        return cols
    _check_out(out, rows, cols, out_dtype, device, f"the output's {cols} columns give")
    return cols


def _check_out(out, rows: int, cols: int, out_dtype: torch.dtype, device, what: str) -> None:
    """``out`` (when given) ``[rows, cols]`` of ``out_dtype``; rows of whole 16-byte units
    (``what``: the message's subject and verb)."""
    if out is not None:
        _check_tensor(out, "out", (out_dtype,), (rows, cols), device)
    if (cols * out_dtype.itemsize) % ALIGN:
        raise InputError(f"{what} rows of {cols * out_dtype.itemsize} bytes; they must "
                         f"be a multiple of {ALIGN} (a multiple of "
                         f"{ALIGN // out_dtype.itemsize} columns)")


def alpha_tensor(a, b: BlockTensor, alpha) -> torch.Tensor:
    """alpha as a one-element float32 tensor on b's device (0-d when it comes from the
    global scales: the kernels read only its data pointer). No copy when the global scale
    already is float32 on b's device; W4A4 multiplies the two (one elementwise op per call:
    not memoised, since a dynamic quantizer rewrites its global scale in place). A format
    without global scales (MXFP4) has alpha 1. A Python number is made into a device tensor
    once per value (:func:`_scalar_alpha`)."""
    if alpha is None:
        dev = b.device
        gs = b.global_scale
        if gs is None:  # no per-tensor scales: MXFP4
            return _scalar_alpha(1.0, dev)
        if gs.dtype != torch.float32 or gs.device != dev:
            gs = gs.to(dev, torch.float32)
        if isinstance(a, NVFP4Tensor):
            ga = a.global_scale
            if ga.dtype != torch.float32 or ga.device != dev:
                ga = ga.to(dev, torch.float32)
            gs = gs * ga
        return gs if gs.dim() == 0 or gs.shape == (1,) else gs.reshape(1)
    if isinstance(alpha, torch.Tensor):
        if alpha.dtype == torch.float32 and alpha.numel() == 1 and alpha.device == b.device:
            return alpha  # the kernels read its data pointer only
    elif (isinstance(alpha, (int, float)) and not isinstance(alpha, bool)
            and not torch.compiler.is_compiling()):
        return _scalar_alpha(float(alpha), b.device)
    return torch.as_tensor(alpha, dtype=torch.float32, device=b.device).reshape(1)


_ALPHAS: dict[tuple[float, int, torch.device], torch.Tensor] = {}  # Python alphas
_ALPHAS_MAX = 256


def _scalar_alpha(value: float, device: torch.device, count: int = 1) -> torch.Tensor:
    """A Python-number alpha as a float32 tensor of ``count`` values (one per expert of a
    grouped call), made once per (value, count, device): without the memo each call copied
    it to the GPU (a host-to-device copy per launch, which a CUDA-graph capture also
    refuses). Made with ``torch.full`` (a fill kernel, no copy), which rounds to float32 as
    ``torch.as_tensor`` does. Not kept when made during a CUDA-graph capture (its memory
    would belong to the graph's pool) or while torch.compile traces."""
    key = (value, count, device)
    t = _ALPHAS.get(key)
    if t is None:
        t = torch.full((count,), value, dtype=torch.float32, device=device)
        if (device.type != "cuda" or not torch.cuda.is_current_stream_capturing()) and \
                not torch.compiler.is_compiling():
            if len(_ALPHAS) >= _ALPHAS_MAX:
                _ALPHAS.clear()
            _ALPHAS[key] = t
    return t


# ----------------------------------------------------------------------------- grouped

class GroupedDims(NamedTuple):
    """What the checks found: sizes, A's format, whether B is the packed layout."""

    total_m: int
    n: int
    k: int
    experts: int
    a_format: Operand  # a block format (W4A4), "bf16" / "fp16" (W4A16)
    packed: bool  # b is a packed weight stack (fragment order, rs_packed/stream schedules)
    b_format: Operand = Operand.NVFP4  # the weight's block format


def torch_out(out_dtype) -> torch.dtype:
    """The output dtype as a torch dtype (an OutDtype, its value or a dtype name also go)."""
    if isinstance(out_dtype, torch.dtype) and out_dtype in _TORCH_OUT.values():
        return out_dtype  # the common case, without OutDtype.of's string handling
    return _TORCH_OUT[OutDtype.of(out_dtype)]


def b_stack(b) -> tuple[int, int, int, bool]:
    """(E, N, K, packed) of the weight stack; typed errors for anything else."""
    if not isinstance(b, (BlockTensor, PackedWeight)):
        raise InputTypeError(f"b (the experts' weights) must be {_TENSOR_NAMES} [E, N, K] or "
                             f"a packed weight stack, got {type(b).__name__}; "
                             "cute_fp4.quantize() takes a 3-D [E, N, K] tensor")
    if b.experts is None:
        raise InputError(f"b must have a leading expert mode [E, N, K], got shape {b.shape}; "
                         "a single weight goes through gemm()")
    e, n, k = b.shape
    return e, n, k, isinstance(b, PackedWeight)


def _a_operand(a) -> tuple[int, int, str]:
    """(total_M, K, format) of the activations (``operands._a_format``'s rules)."""
    return _a_format(a, "total_M", " (tokens sorted by expert)")


def check_call(a, b, out, alpha, out_dtype: torch.dtype, ops: tuple[str, ...] = (),
               bias=None, require_cuda: bool = True) -> tuple[int, int, int, str]:
    """The checks of a dense call: :func:`check_operands` (``out`` there only without
    fused ops), then with fused epilogue ``ops`` :func:`check_fused_operands`."""
    dims = check_operands(a, b, None if ops else out, alpha, out_dtype, require_cuda)
    if ops:
        check_fused_operands(bias, out, dims[0], dims[1], out_dtype, ops, b.data.device)
    return dims


def check_grouped_operands(a, b, offsets, out, alpha, out_dtype=torch.bfloat16,
                           require_cuda: bool = True) -> GroupedDims:
    """Validate the operands of :func:`grouped_gemm` (metadata only: no GPU sync, the
    offsets' values are not read). Shapes, dtypes, layouts and alignment first, then
    whether everything is on one device, then (``require_cuda``) whether that is a GPU."""
    n_exp, n, k, packed = b_stack(b)
    m, _, a_format = a_dims = _a_operand(a)
    fmt = b.fmt
    _check_a_against_b(a_dims, fmt, k, f"{n_exp}, {n}, {k}")
    if n_exp == 0 or n == 0 or k == 0:
        raise InputError(f"empty grouped GEMM: E = {n_exp}, N = {n}, K = {k}; all must be > 0 "
                         "(total_M = 0 is fine)")
    k_unit = UNIT_K if packed else K_MULTIPLE
    if k % k_unit:
        raise InputError(f"K = {k} is not a multiple of {k_unit}: "
                         + (f"the packed layout cuts K into {UNIT_K}-element units" if packed
                            else f"packed FP4 rows must be a multiple of {ALIGN} bytes"))
    if n % N_MULTIPLE:
        raise InputError(f"N = {n} is not a multiple of {N_MULTIPLE} (each expert's output "
                         "rows must be whole 16-byte units)")
    dt = torch_out(out_dtype)
    dev = b.data.device
    rows = packed_rows(n) if packed else n
    half = fmt.data_row_bytes(k)
    _check_tensor(b.data, "b.data", (torch.uint8,), (n_exp, rows, half), dev)
    _check_tensor(b.scale, "b.scale", (fmt.scale.torch_dtype,),
                  (n_exp, *fmt.scale_shape(n, k)), dev)
    if not a_format.sixteen_bit:
        _check_block(a, "a", m, k, (m, half), dev)
    else:
        _check_tensor(a, "a", (a.dtype,), (m, k), dev)
    _check_offsets(offsets, n_exp, dev)
    _check_alpha(a, b, alpha, n_exp, dev)
    if out is not None:
        _check_tensor(out, "out", (dt,), (m, n), dev)
    if require_cuda:
        require_cuda_operands(b)
    return GroupedDims(m, n, k, n_exp, a_format, packed, Operand.of(fmt))


def _check_offsets(offsets, n_exp: int, dev: torch.device) -> None:
    if not isinstance(offsets, torch.Tensor):
        raise InputTypeError(f"offsets must be an int32 tensor [E + 1] on the operands' device, "
                             f"got {type(offsets).__name__}")
    if offsets.dim() != 1 or offsets.numel() != n_exp + 1:
        raise InputError(f"offsets must be [E + 1] = [{n_exp + 1}] for the {n_exp} experts of "
                         f"b, got shape {tuple(offsets.shape)}")
    _check_small(offsets, "offsets", torch.int32, n_exp + 1, dev)


def check_offsets(offsets: torch.Tensor, total_m: int) -> None:
    """The offsets' values against the contract (``offsets[0] = 0``, non-decreasing,
    ``offsets[E] = total_m``), computed where they are (torch ops on the device) and read
    back once (one GPU sync): :class:`OffsetsError` naming the first bad entry, its value
    and the rule it breaks. Not allowed while a CUDA graph is being captured."""
    if offsets.is_cuda and torch.cuda.is_current_stream_capturing():
        raise InputError("validating the offsets reads them back (a GPU sync), which a "
                         "CUDA-graph capture cannot do: validate them before capturing")
    o = offsets.reshape(-1).to(torch.int64)
    last = o.numel() - 1
    idx = torch.arange(last + 1, device=o.device)
    prev = torch.cat([o[:1], o[:-1]])
    bad = ((o < 0) | (o > total_m) | (o < prev) | ((idx == 0) & (o != 0))
           | ((idx == last) & (o != total_m)))
    first = torch.where(bad, idx, last + 1).min()
    at = first.clamp(max=last)
    i, v, p = torch.stack([first, o[at], o[(at - 1).clamp(min=0)]]).tolist()
    if i > last:
        return
    if v < 0:
        why = "is negative"
    elif v > total_m:
        why = f"is past the end: a has total_M = {total_m} rows"
    elif i == 0:
        why = "must be 0"
    elif v < p:
        why = f"< offsets[{i - 1}] = {p}: offsets must be non-decreasing"
    else:
        why = f"must equal total_M = {total_m} (the rows of a)"
    raise OffsetsError(f"offsets[{i}] = {v} {why} (E = {last} experts; nothing was "
                       "launched)", i, v)


def _check_alpha(a, b, alpha, n_exp: int, dev: torch.device) -> None:
    if alpha is None:
        if b.global_scale is not None:
            _check_small(b.global_scale, "b.global_scale", torch.float32, n_exp, dev)
        if isinstance(a, BlockTensor) and a.global_scale is not None:
            _check_small(a.global_scale, "a.global_scale", torch.float32, 1, dev)
        return
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float, torch.Tensor)):
        raise InputTypeError(f"alpha must be a float32 tensor of E = {n_exp} values or a "
                             f"number, got {type(alpha).__name__}")
    if isinstance(alpha, torch.Tensor):
        if alpha.numel() != n_exp:
            raise InputError(f"alpha must hold one value per expert: E = {n_exp} (b has "
                             f"{n_exp} experts), got {alpha.numel()} elements")
        _check_small(alpha, "alpha", torch.float32, n_exp, dev)


def _check_small(t, name: str, dtype: torch.dtype, count: int, dev: torch.device) -> None:
    """A contiguous ``dtype`` tensor of ``count`` elements on ``dev`` (the kernels read it
    element by element: its natural alignment suffices)."""
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.numel() != count:
        raise InputError(f"{name} must hold {count} value(s), got {t.numel()}")
    if t.dtype != dtype:
        raise InputError(f"{name} must be {dtype}, got {t.dtype}")
    if t.device != dev:
        raise InputError(f"{name} is on {t.device} but the operands are on {dev}"
                         + ("; group offsets are read on the GPU, never on the host"
                            if name == "offsets" else ""))
    if not t.is_contiguous():
        raise InputError(f"{name} must be contiguous, got strides {t.stride()}")


def require_cuda_operands(b) -> None:
    dev = b.data.device
    if dev.type != "cuda":
        raise DeviceError(f"operands must be on a CUDA device, b is on {dev}")


def grouped_alpha(a, b, alpha, experts: int) -> torch.Tensor:
    """alpha as a float32 ``[E]`` tensor on b's device, made with device ops only (a
    product of global scales, or a fill for a Python number; no host-to-device copy)."""
    if alpha is None:
        if b.global_scale is None:  # no per-tensor scales (MXFP4): alpha 1 per expert
            return _scalar_alpha(1.0, b.data.device, experts)
        gs = b.global_scale.reshape(experts)
        return gs * a.global_scale.reshape(()) if isinstance(a, NVFP4Tensor) else gs
    if isinstance(alpha, torch.Tensor):
        return alpha.reshape(experts)
    return _scalar_alpha(float(alpha), b.data.device, experts)


# ----------------------------------------------------------------------------- test operands

def make_operands(m: int, n: int, k: int, a_format: str = Operand.NVFP4, seed: int = 0,
                  dist: str = "awkward", device="cuda", b_format: str = Operand.NVFP4):
    """Random operands: ``awkward`` gives rows whose magnitudes span 2^-6..2^6 (block scales
    over ~14 binades of UE4M3's 18, subnormal scales included), 5% zero blocks and 2%
    blocks 16x larger, so scale handling bugs show up; ``normal`` is N(0, 1). ``b_format``:
    the weight's block format (W4A4 quantizes A to the same)."""
    fmt = get_format(b_format)
    block = fmt.block
    g = torch.Generator(device=device).manual_seed(seed)

    def mat(rows):
        x = torch.randn(rows, k, generator=g, device=device)
        if dist == "awkward":
            x *= torch.exp2(torch.randint(-6, 7, (rows, 1), generator=g, device=device).float())
            blocks = x.view(rows, k // block, block)
            blocks[torch.rand(rows, k // block, generator=g, device=device) < 0.05] = 0.0
            blocks[torch.rand(rows, k // block, generator=g, device=device) < 0.02] *= 16.0
        return x

    b = quantize(mat(n), format=fmt)
    a_raw = mat(m)
    if not Operand.of(a_format).sixteen_bit:
        return quantize(a_raw, format=fmt), b
    dt = torch.bfloat16 if a_format == "bf16" else torch.float16
    return (a_raw / a_raw.abs().max().clamp(min=1e-30)).to(dt), b


def check_grouped_call(a, b, offsets, out, alpha, out_dtype: torch.dtype,
                       ops: tuple[str, ...] = (), bias=None,
                       require_cuda: bool = True) -> GroupedDims:
    """The checks of a grouped call: :func:`check_grouped_operands` (``out`` there only
    without fused ops), then with fused epilogue ``ops`` :func:`check_fused_operands`
    (bias ``[E, N]``)."""
    dims = check_grouped_operands(a, b, offsets, None if ops else out, alpha, out_dtype,
                                  require_cuda)
    if ops:
        check_fused_operands(bias, out, dims.total_m, dims.n, out_dtype, ops,
                             b.data.device, dims.experts)
    return dims
