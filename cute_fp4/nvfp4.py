"""NVFP4: E2M1 elements in blocks of 16 with UE4M3 block scales and an FP32 global scale.

Conventions (see ``shared/notes/nvfp4-format.md``):

* ``global_scale`` is the *decode* form, ``amax / (448 * 6)`` (ModelOpt ``weight_scale_2``,
  torchao ``per_tensor_scale``): ``x ~= e2m1 * float(block_scale) * global_scale``.
* Two elements per byte; the element with the even K index is the low nibble.
* ``.scale`` holds the block scales in the 128x4 blocked layout that cuBLASLt, CUTLASS and
  FlashInfer expect: shape ``[round_up(R, 128), round_up(K/16, 4)]`` whose flat bytes are in
  the order of :func:`scale_offset`; padding is zero.

Quantization (round to nearest, ties to even, on the E2M1 grid), the one rule of every
device: ``t = block_amax * fl32(1/6)`` (a float32 product with the float32 reciprocal of 6,
never a division by 6), ``s = e4m3(min(t / global_scale, 448))`` (IEEE float32 division;
subnormal scales allowed; a non-zero block whose scale would round to 0 gets the smallest
subnormal, 2^-9), then ``q = e2m1(x / (float(s) * global_scale))`` (float32 product, IEEE
float32 division) saturating at +-6. Every operation is one correctly rounded float32
operation, so the CPU, CUDA and the fused kernel (``cute_fp4.kernels.quantize``) produce the
same bytes for every input (``docs/correctness.md``). (torch divides by a Python scalar on
the CPU but multiplies by its reciprocal on CUDA; the rule multiplies explicitly.)

The format is data (:data:`cute_fp4.formats.NVFP4`, a :class:`~cute_fp4.formats.BlockFormat`):
the block size, the scale type and its layout rules are read from it, never written here.
"""

from __future__ import annotations

import math
import operator

import torch

from cute_fp4.errors import DeviceError, FormatError, InputError, InputTypeError
from cute_fp4.formats import (
    E2M1,
    NVFP4,
    SF_ATOM_COLS,
    SF_ATOM_ROWS,
    UE4M3,
    BlockFormat,
    round_up,
)

E2M1_VALUES = E2M1.magnitudes  # codes 0..7; 8..15 are negatives
E2M1_MAX = E2M1.max
E4M3_MAX = UE4M3.max
E4M3_MIN_SUBNORMAL = UE4M3.min_positive
# float32(1/6) exactly, as a Python float: ``bamax * RCP6`` rounds once to float32 on every
# device (the fused kernel's ``mul.rn.f32 t, bamax, 0f3E2AAAAB``)
RCP6 = 0.1666666716337204
# Midpoints between consecutive E2M1 magnitudes. A tie between codes i and i+1 goes to
# the even code: down when i is even, up when i is odd.
_E2M1_BOUNDS = tuple((a + b) / 2 for a, b in zip(E2M1_VALUES, E2M1_VALUES[1:]))


# ----------------------------------------------------------------------------- codecs

def e2m1_table(dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The 16 E2M1 values indexed by code (code 8 is -0.0)."""
    return torch.tensor(E2M1.values(), dtype=dtype, device=device)


def e4m3_decode(code: int) -> float:
    """The value of an E4M3 (fn) code from its bit fields: bias 7, no infinities,
    0x7F/0xFF are NaN, exponent 0 is subnormal (``m/8 * 2^-6``)."""
    sign = -1.0 if code & 0x80 else 1.0
    return sign * UE4M3.decode(code & 0x7F)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round a float tensor to E2M1 codes (uint8 0..15), nearest-even, saturating at 6."""
    mag = x.abs().float()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for i, bound in enumerate(_E2M1_BOUNDS):
        code += (mag > bound if i % 2 == 0 else mag >= bound).to(torch.uint8)
    return code | ((x < 0).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return e2m1_table(dtype, codes.device)[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[R, K] codes -> [R, K/2] bytes, even K index in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_e2m1(data: torch.Tensor) -> torch.Tensor:
    """[R, K/2] bytes -> [R, K] codes."""
    lo, hi = data & 0xF, data >> 4
    return torch.stack((lo, hi), dim=-1).reshape(data.shape[0], 2 * data.shape[1])


# ----------------------------------------------------------------------------- layout

def scale_shape(rows: int, k: int, fmt: BlockFormat = NVFP4) -> tuple[int, int]:
    """Padded shape of the blocked scale tensor for ``rows`` x ``k`` elements."""
    return fmt.scale_shape(rows, k)


def scale_offset(r, c, k: int, fmt: BlockFormat = NVFP4):
    """Byte offset of the scale of (row r, scale column c) for ``k`` elements per row in
    the 128x4 blocked layout (:func:`~cute_fp4.formats.sf_offset`). Works on ints and
    integer tensors."""
    return fmt.scale_offset(r, c, k)


def swizzle_scales(sf_linear: torch.Tensor) -> torch.Tensor:
    """[R, C] row-major scales -> the blocked layout, shape [round_up(R,128), round_up(C,4)],
    zero padded. Works for any 1-byte dtype (float8_e4m3fn, uint8)."""
    if sf_linear.dim() != 2:
        raise FormatError(f"scales must be 2-D [rows, K/16] (NVFP4; [rows, K / block] of "
                          f"a block format), got shape {tuple(sf_linear.shape)}")
    rows, cols = sf_linear.shape
    rp, cp = round_up(rows, SF_ATOM_ROWS), round_up(cols, SF_ATOM_COLS)
    raw = _as_bytes(sf_linear)
    padded = torch.zeros((rp, cp), dtype=torch.uint8, device=raw.device)
    padded[:rows, :cols] = raw
    blocked = padded.view(rp // 128, 4, 32, cp // 4, 4).permute(0, 3, 2, 1, 4).reshape(rp, cp)
    return blocked.contiguous().view(sf_linear.dtype)


def unswizzle_scales(blocked: torch.Tensor, rows: int, k: int,
                     fmt: BlockFormat = NVFP4) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`: the blocked scales of ``rows`` x ``k`` elements
    -> [rows, ceil(k / block)] row-major."""
    cols = fmt.scale_cols(k)
    rp, cp = fmt.scale_shape(rows, k)
    if blocked.numel() != rp * cp:
        raise FormatError(f"blocked scales for {rows} rows and K = {k} need {rp} x {cp} = "
                          f"{rp * cp} bytes, got {blocked.numel()} (shape "
                          f"{tuple(blocked.shape)})")
    raw = _as_bytes(blocked.contiguous()).reshape(rp // 128, cp // 4, 32, 4, 4)
    linear = raw.permute(0, 3, 2, 1, 4).reshape(rp, cp)
    return linear[:rows, :cols].contiguous().view(blocked.dtype)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    if t.element_size() != 1:
        raise FormatError(f"scales must be a 1-byte dtype (float8_e4m3fn or uint8), "
                          f"got {t.dtype}")
    return t.view(torch.uint8)


# ----------------------------------------------------------------------------- container

def _scale_size_message(lead, rows: int, k: int, rp: int, cp: int, scale) -> str:
    if lead:
        e = lead[0]
        need = f"{e} experts of [{rows}, {k}] need {e} x {rp} x {cp} = {e * rp * cp}"
    else:
        need = f"[{rows}, {k}] need {rp} x {cp} = {rp * cp}"
    return (f"blocked scales for {need} bytes, got {scale.numel()} (shape "
            f"{tuple(scale.shape)}); linear [R, K/16] scales go through swizzle_scales()")


def _global_scales(global_scale, lead) -> torch.Tensor:
    """The global scale(s) as float32: 0-d for a 2-D tensor, [E] for an expert stack (a
    single value is repeated for every expert); finite and > 0 (reads the values)."""
    _check_scale_type(global_scale, "NVFP4Tensor")
    gs = torch.as_tensor(global_scale, dtype=torch.float32)
    if not lead:
        if gs.numel() != 1:
            raise FormatError(f"global_scale must be a scalar, got {gs.numel()} elements")
        if not torch.isfinite(gs).all() or (gs <= 0).any():
            raise FormatError(f"global_scale must be finite and > 0, got {float(gs):g}")
        return gs.reshape(())
    e = lead[0]
    if gs.numel() not in (1, e):
        raise FormatError(f"global_scale of {e} experts must have {e} elements (one per "
                          f"expert) or 1, got {gs.numel()}")
    gs = gs.reshape(-1).expand(e).contiguous()
    bad = ~torch.isfinite(gs) | (gs <= 0)
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        raise FormatError(f"global_scale must be finite and > 0, got {float(gs[i]):g} "
                          f"for expert {i}")
    return gs



def expert_index(shape: tuple[int, ...], e, what: str, form: str) -> int:
    """``e`` as an index into the leading expert mode of ``shape`` (negative ones count from
    the end); typed errors for a 2-D ``what`` or an index out of range."""
    if len(shape) != 3:
        raise FormatError(f"expert({e!r}) needs {what} with a leading expert mode {form}; "
                          f"this one is 2-D {shape}")
    n, i = shape[0], operator.index(e)
    if not -n <= i < n:
        raise InputError(f"expert {i} is out of range for {n} experts")
    return i


class NVFP4Tensor:
    """An NVFP4 tensor ``[R, K]``: packed elements, blocked scales, global scale; or, with a
    leading expert mode, a stack of ``E`` such tensors ``[E, R, K]`` (the experts' weights of
    a mixture-of-experts layer, for ``grouped_gemm``).

    Attributes: ``data`` uint8 [R, K/2]; ``scale`` float8_e4m3fn, blocked layout (see the
    module docstring); ``global_scale`` float32 scalar tensor (decode form); ``shape``.
    With the expert mode: ``data`` [E, R, K/2], ``scale`` [E, round_up(R, 128),
    round_up(K/16, 4)] (each expert's blocked scales, contiguous, expert-major),
    ``global_scale`` float32 [E] (one per expert), ``shape`` (E, R, K), ``experts`` E
    (None for a 2-D tensor); :meth:`expert` is one expert as a 2-D tensor (views).
    """

    fmt: BlockFormat = NVFP4

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, global_scale, shape=None):
        if not isinstance(data, torch.Tensor) or not isinstance(scale, torch.Tensor):
            raise InputTypeError("NVFP4Tensor(data, scale, ...) takes torch tensors, got "
                                 f"{type(data).__name__} and {type(scale).__name__}")
        if data.dtype != torch.uint8 or data.dim() not in (2, 3):
            raise FormatError(f"data must be uint8 [R, K/2], got {data.dtype} with shape "
                              f"{tuple(data.shape)} (an expert stack is [E, R, K/2])")
        if shape is not None and not isinstance(shape, tuple | list | torch.Size):
            raise InputTypeError(f"shape must be a tuple (R, K) or (E, R, K), got "
                                 f"{type(shape).__name__}")
        natural = (*data.shape[:-1], data.shape[-1] * 2)
        dims = natural if shape is None else tuple(shape)
        if dims != natural:
            want = "[R, K/2]" if data.dim() == 2 else "[E, R, K/2]"
            raise FormatError(f"shape {dims} does not match data {tuple(data.shape)} "
                              f"(expected {want})")
        *lead, rows, k = dims
        if k == 0 or 0 in lead:
            raise FormatError(f"an NVFP4 tensor needs K > 0 (and E > 0 experts), got shape "
                              f"{dims}")
        if k % self.fmt.block:
            raise FormatError(f"K = {k} is not a multiple of the block size {self.fmt.block}")
        sdt = self.fmt.scale.torch_dtype
        if scale.dtype not in (sdt, torch.uint8):
            raise FormatError(f"scale must be {sdt}, got {scale.dtype}")
        rp, cp = self.fmt.scale_shape(rows, k)
        if scale.numel() != math.prod(lead) * rp * cp:
            raise FormatError(_scale_size_message(lead, rows, k, rp, cp, scale))
        if not scale.is_contiguous():
            raise FormatError("scale must be contiguous (the blocked layout is a flat order)")
        if scale.device != data.device:
            raise FormatError(f"data is on {data.device} but scale is on {scale.device}")
        gs = _global_scales(global_scale, lead)
        self.data = data
        self.scale = scale.view(sdt).reshape(*lead, rp, cp)
        self.global_scale = gs.to(data.device)
        self.shape = dims

    @classmethod
    def _unchecked(cls, data: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                   shape: tuple[int, ...]) -> NVFP4Tensor:
        """Wrap buffers a kernel has just written, skipping ``__init__``'s checks (whose
        global-scale check synchronises with the GPU). ``scale`` float8_e4m3fn of the
        blocked shape, ``global_scale`` a 0-d float32 tensor ([E] for an expert stack):
        the caller guarantees it."""
        t = cls.__new__(cls)
        t.data, t.scale, t.global_scale, t.shape = data, scale, global_scale, tuple(shape)
        return t

    @classmethod
    def stack(cls, tensors) -> NVFP4Tensor:
        """One tensor with a leading expert mode from ``E`` 2-D tensors of one shape and
        device (copies; e.g. experts loaded one by one with :meth:`from_modelopt`)."""
        tensors = list(tensors)
        if not tensors or not all(isinstance(t, NVFP4Tensor) for t in tensors):
            raise InputTypeError("NVFP4Tensor.stack() takes a non-empty sequence of "
                                 "NVFP4Tensors")
        first = tensors[0]
        for e, t in enumerate(tensors):
            if t.experts is not None or t.shape != first.shape or t.device != first.device:
                raise FormatError(f"NVFP4Tensor.stack(): expert {e} is {t.shape} on "
                                  f"{t.device}; expert 0 is {first.shape} on {first.device} "
                                  "(all must be 2-D, of one shape and device)")
        gs = torch.stack([t.global_scale.to(torch.float32).reshape(()) for t in tensors])
        return cls._unchecked(torch.stack([t.data for t in tensors]),
                              torch.stack([t.scale for t in tensors]), gs,
                              (len(tensors), *first.shape))

    @property
    def experts(self) -> int | None:
        """E for a tensor with a leading expert mode, None for a 2-D tensor."""
        return self.shape[0] if len(self.shape) == 3 else None

    def expert(self, e: int) -> NVFP4Tensor:
        """Expert ``e`` of an expert stack as a 2-D tensor ``[R, K]`` (views, no copies)."""
        i = expert_index(self.shape, e, "a tensor", "[E, R, K]")
        return NVFP4Tensor._unchecked(self.data[i], self.scale[i], self.global_scale[i],
                                      self.shape[1:])

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device) -> NVFP4Tensor:
        try:
            target = torch.device(device)
        except (RuntimeError, TypeError):
            raise InputError(f"NVFP4Tensor.to(): {device!r} is not a device") from None
        if self.device.type == "meta" and target.type != "meta":
            raise InputError(f"an NVFP4Tensor on the meta device has no data to move to "
                             f"{device}")
        if target.type == "cuda" and not torch.cuda.is_available():
            raise DeviceError(f"NVFP4Tensor.to({str(device)!r}): CUDA is not available")
        # the parts were checked when this tensor was made: moving them keeps them valid
        return NVFP4Tensor._unchecked(self.data.to(target), self.scale.to(target),
                                      self.global_scale.to(target), self.shape)

    def cuda(self) -> NVFP4Tensor:
        return self.to("cuda")

    def scale_linear(self) -> torch.Tensor:
        """Block scales as [R, K/16] float8_e4m3fn in row-major order ([E, R, K/16] for an
        expert stack)."""
        rows, k = self.shape[-2:]
        if self.experts is None:
            return unswizzle_scales(self.scale, rows, k, self.fmt)
        return torch.stack([unswizzle_scales(s, rows, k, self.fmt) for s in self.scale])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``e2m1 * block_scale * global_scale``, computed in float64 (one rounding, to
        ``dtype``); an expert stack uses each expert's global scale."""
        gs = self.global_scale.double()
        if self.experts is not None:
            gs = gs.view(-1, 1, 1)
        return (self.block_values(torch.float64) * gs).to(dtype)

    def block_values(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """``e2m1 * block_scale`` without the global scale: what the tensor cores see."""
        codes = unpack_e2m1(self.data.reshape(-1, self.data.shape[-1]))
        vals = e2m1_decode(codes, dtype).reshape(self.shape)
        return vals * self.scale_linear().to(dtype).repeat_interleave(self.fmt.block, dim=-1)

    @classmethod
    def from_modelopt(cls, weight: torch.Tensor, weight_scale: torch.Tensor,
                      weight_scale_2) -> NVFP4Tensor:
        """From a ModelOpt NVFP4 checkpoint: ``weight`` uint8 [N, K/2], ``weight_scale``
        e4m3 [N, K/16] (linear layout), ``weight_scale_2`` FP32 global (decode form)."""
        if not isinstance(weight, torch.Tensor) or not isinstance(weight_scale, torch.Tensor):
            raise InputTypeError(f"from_modelopt(weight, weight_scale, ...) takes torch "
                                 f"tensors, got {type(weight).__name__} and "
                                 f"{type(weight_scale).__name__}")
        if weight.is_meta or weight_scale.is_meta:
            raise InputError("from_modelopt reads the scales (NaN and sign checks): weight "
                             "and weight_scale must hold data, not be on the meta device")
        if weight.dim() != 2 or weight_scale.dim() != 2:
            raise FormatError(f"weight and weight_scale must be 2-D, got shapes "
                              f"{tuple(weight.shape)} and {tuple(weight_scale.shape)}")
        n, k = weight.shape[0], weight.shape[1] * 2
        cols, block = cls.fmt.scale_cols(k), cls.fmt.block
        if tuple(weight_scale.shape) != (n, cols):
            raise FormatError(f"weight_scale must be [N, K/{block}] = [{n}, {cols}] for weight "
                              f"[{n}, {k // 2}], got {tuple(weight_scale.shape)}")
        raw = _as_bytes(weight_scale)
        bad = int(((raw & 0x7F) == 0x7F).sum())
        if bad:
            raise FormatError(f"weight_scale holds {bad} NaN bytes (0x7F/0xFF); NVFP4 block "
                              "scales are finite UE4M3")
        neg = int(((raw & 0x80) != 0).sum())
        if neg:
            raise FormatError(f"weight_scale holds {neg} negative bytes; NVFP4 block scales "
                              "are unsigned (UE4M3)")
        return cls(weight, swizzle_scales(weight_scale.contiguous()), weight_scale_2, (n, k))

    def __repr__(self) -> str:
        if self.experts is not None or self.device.type == "meta":  # meta: no value to show
            e = "" if self.experts is None else f", experts={self.experts}"
            return f"NVFP4Tensor(shape={self.shape}{e}, device={self.device})"
        return (f"NVFP4Tensor(shape={self.shape}, device={self.device}, "
                f"global_scale={float(self.global_scale):.6g})")


# ----------------------------------------------------------------------------- quantize

def quantize(x: torch.Tensor, global_scale=None) -> NVFP4Tensor:
    """Quantize a 2-D float tensor ``[R, K]`` (CPU or CUDA) to NVFP4, or a 3-D expert stack
    ``[E, R, K]`` to an NVFP4Tensor with a leading expert mode.

    ``global_scale`` is the decode form (``amax / 2688``), computed from ``x`` when None
    (for a stack, from each expert's own amax). For a stack it may be a scalar or hold
    ``E`` values; expert ``e`` of the result is bit-identical to
    ``quantize(x[e], global_scale[e])``.
    Raises ValueError subclasses for K not a multiple of 16, NaN/Inf, or a bad scale.
    """
    if not isinstance(x, torch.Tensor):
        raise InputTypeError(f"quantize() takes a torch.Tensor, got {type(x).__name__}")
    _check_scale_type(global_scale)
    if x.dim() == 2 and global_scale is not None and _count(global_scale) != 1:
        raise InputError(f"quantize(): global_scale of a 2-D tensor {list(x.shape)} must be "
                         f"one value, got {_count(global_scale)} (one per expert goes with "
                         "a 3-D stack [E, R, K])")
    if not x.is_floating_point() or x.element_size() == 1:
        raise InputError(f"quantize() needs a float32/float16/bfloat16/float64 tensor, "
                         f"got {x.dtype}")
    if x.is_meta:
        raise InputError(f"quantize() reads x's values: x {list(x.shape)} is on the meta "
                         "device (no data)")
    if x.dim() == 3:
        return _quantize_experts(x, global_scale)
    if x.dim() != 2:
        raise InputError(f"quantize() needs a 2-D tensor [R, K], got shape {tuple(x.shape)} "
                         "(or a 3-D expert stack [E, R, K])")
    rows, k = x.shape
    _check_quantizable(x)
    xf = x.float()
    _check_finite(xf, source=x)
    if global_scale is None:
        global_scale = _amax_scale(xf)
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device).reshape(())
    if not torch.isfinite(gs) or gs <= 0:
        raise InputError(f"global_scale must be finite and > 0, got {float(gs):g}")
    data, sf = _encode(xf, gs)
    return NVFP4Tensor(data, sf, gs, (rows, k))


def _check_quantizable(x: torch.Tensor) -> None:
    k = x.shape[-1]
    if k % NVFP4.block:
        raise InputError(f"K = {k} is not a multiple of {NVFP4.block} (the {NVFP4} block "
                         "size)")
    if x.numel() == 0:
        raise InputError(f"cannot quantize an empty tensor of shape {tuple(x.shape)}")


def _check_scale_type(global_scale, who: str = "quantize()") -> None:
    """A global scale is None (``quantize`` only), a real number, a real tensor with data
    or a list/tuple of numbers (one per expert); anything else is a typed error."""
    def number(v) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    if isinstance(global_scale, torch.Tensor):
        if global_scale.is_complex() or global_scale.dtype == torch.bool:
            raise InputTypeError(f"{who}: global_scale must be a real tensor, got "
                                 f"{global_scale.dtype}")
        if global_scale.is_meta:
            raise InputError(f"{who}: global_scale is on the meta device (no value to read)")
        return
    ok = ((global_scale is None and who == "quantize()") or number(global_scale)
          or (isinstance(global_scale, list | tuple) and all(map(number, global_scale))))
    if not ok:
        none = "None, " if who == "quantize()" else ""
        raise InputTypeError(f"{who}: global_scale must be {none}a float, a float "
                             "tensor or a list of floats, "
                             f"got {type(global_scale).__name__} {global_scale!r}")


def _count(global_scale) -> int:
    """How many values a global scale that passed :func:`_check_scale_type` holds."""
    if isinstance(global_scale, torch.Tensor):
        return global_scale.numel()
    return len(global_scale) if isinstance(global_scale, list | tuple) else 1


def _check_finite(xf: torch.Tensor, bad: int | None = None,
                  source: torch.Tensor | None = None) -> None:
    """Refuse NaN/Inf in ``xf`` (the float32 copy of ``source``); values that were finite
    in ``source`` but overflow float32 are named as such."""
    if bad is None and torch.isfinite(xf).all():
        return
    bad = int((~torch.isfinite(xf)).sum()) if bad is None else bad
    if not bad:
        return
    if source is not None and source.dtype == torch.float64:
        overflow = int((torch.isfinite(source) & ~torch.isfinite(xf)).sum())
        if overflow:
            raise InputError(f"x has {overflow} finite float64 values beyond float32's range "
                             f"(|x| > {torch.finfo(torch.float32).max:.4g}; largest "
                             f"{float(source[torch.isfinite(source)].abs().max()):.4g}); "
                             "scale the input down before quantizing")
    raise InputError(f"x has {bad} NaN/Inf values; NVFP4 has no encoding for them")


def _amax_scale(xf: torch.Tensor) -> float:
    """The default global scale of ``xf``: its amax / (448 * 6), 1.0 for all zeros."""
    amax = float(xf.abs().max())
    return amax / (E4M3_MAX * E2M1_MAX) if amax > 0 else 1.0


def _encode(xf: torch.Tensor, gs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [R, K] and a 0-d float32 global scale -> (packed codes [R, K/2], blocked
    scales). The one quantization rule (module docstring)."""
    rows, k = xf.shape
    blocks = xf.view(rows, k // NVFP4.block, NVFP4.block)
    bamax = blocks.abs().amax(dim=-1)
    sf = NVFP4.scale.encode((bamax * RCP6 / gs).clamp(max=NVFP4.scale.max))
    tiny = (sf.float() == 0) & (bamax > 0)
    sf = torch.where(tiny, torch.full_like(sf, NVFP4.scale.min_positive), sf)
    denom = (sf.float() * gs).unsqueeze(-1)
    q = torch.where(denom > 0, blocks / torch.where(denom > 0, denom, 1.0), 0.0)
    codes = e2m1_encode(q).view(rows, k)
    return pack_e2m1(codes), swizzle_scales(sf)


def _quantize_experts(x: torch.Tensor, global_scale) -> NVFP4Tensor:
    """:func:`quantize` of a stack ``[E, R, K]``: each expert by the 2-D rule with its own
    global scale, one expert at a time (one float32 copy of an expert in memory)."""
    n_exp, rows, k = x.shape
    _check_quantizable(x)
    bad = sum(int((~torch.isfinite(x[e].float())).sum()) for e in range(n_exp))
    _check_finite(x, bad)
    if global_scale is None:
        global_scale = [_amax_scale(x[e].float()) for e in range(n_exp)]
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    if gs.numel() not in (1, n_exp):
        raise InputError(f"global_scale for {n_exp} experts must be a scalar or hold "
                         f"{n_exp} values, got {gs.numel()}")
    gs = gs.reshape(-1).expand(n_exp).contiguous()
    wrong = ~torch.isfinite(gs) | (gs <= 0)
    if wrong.any():
        e = int(wrong.nonzero()[0, 0])
        raise InputError(f"global_scale must be finite and > 0, got {float(gs[e]):g} for "
                         f"expert {e}")
    rp, cp = NVFP4.scale_shape(rows, k)
    data = torch.empty((n_exp, rows, k // 2), dtype=torch.uint8, device=x.device)
    scale = torch.empty((n_exp, rp, cp), dtype=NVFP4.scale.torch_dtype, device=x.device)
    for e in range(n_exp):
        data[e], scale[e] = _encode(x[e].float().contiguous(), gs[e])
    return NVFP4Tensor._unchecked(data, scale, gs, (n_exp, rows, k))
