"""What every block-scaled 4-bit format shares: the E2M1 codecs, the 128x4 blocked scale
layout's swizzle, the tensor container (:class:`BlockTensor`) and the input checks of
quantization.

A format (:class:`~cute_fp4.formats.BlockFormat`) is data; its tensor class is a subclass
of :class:`BlockTensor` that fixes ``fmt`` (``cute_fp4.nvfp4.NVFP4Tensor``,
``cute_fp4.mxfp4.MXFP4Tensor``) and its quantization rule lives with it
(:mod:`cute_fp4.nvfp4`, :mod:`cute_fp4.mxfp4`; ``cute_fp4.nvfp4.quantize`` takes either).

* Two elements per byte; the element with the even K index is the low nibble.
* ``.scale`` holds the block scales in the 128x4 blocked layout that cuBLASLt, CUTLASS and
  FlashInfer expect: shape ``[round_up(R, 128), round_up(K / block, 4)]`` whose flat bytes
  are in the order of :func:`~cute_fp4.formats.sf_offset`; padding is zero.
"""

from __future__ import annotations

import math
import operator

import torch

from cute_fp4.errors import DeviceError, FormatError, InputError, InputTypeError
from cute_fp4.formats import E2M1, NVFP4, SF_ATOM_COLS, SF_ATOM_ROWS, BlockFormat, round_up

# Midpoints between consecutive E2M1 magnitudes. A tie between codes i and i+1 goes to
# the even code: down when i is even, up when i is odd.
_E2M1_BOUNDS = tuple((a + b) / 2 for a, b in zip(E2M1.magnitudes, E2M1.magnitudes[1:]))


# ----------------------------------------------------------------------------- codecs

def e2m1_table(dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The 16 E2M1 values indexed by code (code 8 is -0.0)."""
    return torch.tensor(E2M1.values(), dtype=dtype, device=device)


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
    raw = as_bytes(sf_linear)
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
    raw = as_bytes(blocked.contiguous()).reshape(rp // 128, cp // 4, 32, 4, 4)
    linear = raw.permute(0, 3, 2, 1, 4).reshape(rp, cp)
    return linear[:rows, :cols].contiguous().view(blocked.dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    if t.element_size() != 1:
        raise FormatError(f"scales must be a 1-byte dtype (float8_e4m3fn or uint8), "
                          f"got {t.dtype}")
    return t.view(torch.uint8)


# ----------------------------------------------------------------------------- container

def _scale_size_message(lead, rows: int, k: int, rp: int, cp: int, scale,
                        fmt: BlockFormat) -> str:
    if lead:
        e = lead[0]
        need = f"{e} experts of [{rows}, {k}] need {e} x {rp} x {cp} = {e * rp * cp}"
    else:
        need = f"[{rows}, {k}] need {rp} x {cp} = {rp * cp}"
    return (f"blocked scales for {need} bytes, got {scale.numel()} (shape "
            f"{tuple(scale.shape)}); linear [R, K/{fmt.block}] scales go through "
            "swizzle_scales()")


def check_scale_type(global_scale, who: str = "quantize()") -> None:
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


def count_values(global_scale) -> int:
    """How many values a global scale that passed :func:`check_scale_type` holds."""
    if isinstance(global_scale, torch.Tensor):
        return global_scale.numel()
    return len(global_scale) if isinstance(global_scale, list | tuple) else 1


def _global_scales(global_scale, lead, who: str) -> torch.Tensor:
    """The global scale(s) as float32: 0-d for a 2-D tensor, [E] for an expert stack (a
    single value is repeated for every expert); finite and > 0 (reads the values)."""
    check_scale_type(global_scale, who)
    gs = torch.as_tensor(global_scale, dtype=torch.float32)
    if not lead:
        if gs.numel() != 1:
            raise FormatError(f"global_scale must be a scalar, got {gs.numel()} elements")
        if not torch.isfinite(gs).all() or (gs <= 0).any():
            raise FormatError(f"global_scale must be finite and > 0, got {float(gs):g}")
        return gs.reshape(())
    return per_expert_scales(gs, lead[0], FormatError)


def per_expert_scales(gs: torch.Tensor, e: int, error: type[Exception] = FormatError
                      ) -> torch.Tensor:
    """Global scales ``gs`` of ``e`` experts (one value, or one per expert) as a float32
    ``[e]``, every value finite and > 0 (reads the values); ``error`` naming the count or
    the first bad expert otherwise."""
    if gs.numel() not in (1, e):
        raise error(f"global_scale for {e} experts must be a scalar or hold {e} values, got "
                    f"{gs.numel()}")
    gs = gs.reshape(-1).expand(e).contiguous()
    bad = ~torch.isfinite(gs) | (gs <= 0)
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        raise error(f"global_scale must be finite and > 0, got {float(gs[i]):g} for "
                    f"expert {i}")
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


class BlockTensor:
    """A block-scaled 4-bit tensor ``[R, K]`` of the format ``fmt`` (a
    :class:`~cute_fp4.formats.BlockFormat`): packed elements, blocked scales and, where the
    format has one, a global scale; or, with a leading expert mode, a stack of ``E`` such
    tensors ``[E, R, K]`` (the experts' weights of a mixture-of-experts layer, for
    ``grouped_gemm``). The formats' own classes are :class:`NVFP4Tensor` and
    :class:`~cute_fp4.mxfp4.MXFP4Tensor`, siblings: a check for one never accepts the other.

    Attributes: ``data`` uint8 [R, K/2]; ``scale`` in the scale type's storage dtype,
    blocked layout (see the module docstring); ``global_scale`` float32 scalar tensor
    (decode form), None for a format without one; ``shape``. With the expert mode:
    ``data`` [E, R, K/2], ``scale`` [E, round_up(R, 128), round_up(K / block, 4)] (each
    expert's blocked scales, contiguous, expert-major), ``global_scale`` float32 [E] (one
    per expert), ``shape`` (E, R, K), ``experts`` E (None for a 2-D tensor); :meth:`expert`
    is one expert as a 2-D tensor (views).
    """

    fmt: BlockFormat = NVFP4

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, global_scale=None,
                 shape=None):
        name = type(self).__name__
        if not isinstance(data, torch.Tensor) or not isinstance(scale, torch.Tensor):
            raise InputTypeError(f"{name}(data, scale, ...) takes torch tensors, got "
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
            raise FormatError(f"an {self.fmt.name.upper()} tensor needs K > 0 (and E > 0 "
                              f"experts), got shape {dims}")
        if k % self.fmt.block:
            raise FormatError(f"K = {k} is not a multiple of the block size {self.fmt.block}")
        sdt = self.fmt.scale.torch_dtype
        if scale.dtype not in (sdt, torch.uint8):
            raise FormatError(f"scale must be {sdt}, got {scale.dtype}")
        rp, cp = self.fmt.scale_shape(rows, k)
        if scale.numel() != math.prod(lead) * rp * cp:
            raise FormatError(_scale_size_message(lead, rows, k, rp, cp, scale, self.fmt))
        if not scale.is_contiguous():
            raise FormatError("scale must be contiguous (the blocked layout is a flat order)")
        if scale.device != data.device:
            raise FormatError(f"data is on {data.device} but scale is on {scale.device}")
        if self.fmt.global_scale:
            gs = _global_scales(global_scale, lead, name).to(data.device)
        elif global_scale is not None:
            raise FormatError(f"{self.fmt} has no global scale; {name} takes none")
        else:
            gs = None
        self.data = data
        self.scale = scale.view(sdt).reshape(*lead, rp, cp)
        self.global_scale = gs
        self.shape = dims

    @classmethod
    def _unchecked(cls, data: torch.Tensor, scale: torch.Tensor, global_scale,
                   shape: tuple[int, ...]):
        """Wrap buffers a kernel has just written, skipping ``__init__``'s checks (whose
        global-scale check synchronises with the GPU). ``scale`` in the storage dtype of the
        blocked shape, ``global_scale`` a 0-d float32 tensor ([E] for an expert stack; None
        without one): the caller guarantees it."""
        t = cls.__new__(cls)
        t.data, t.scale, t.global_scale, t.shape = data, scale, global_scale, tuple(shape)
        return t

    @classmethod
    def _checked(cls, data, scale, global_scale, shape):
        """``__init__``'s checks for any subclass (whose own ``__init__`` may take no global
        scale)."""
        t = cls.__new__(cls)
        BlockTensor.__init__(t, data, scale, global_scale, shape)
        return t

    @classmethod
    def stack(cls, tensors):
        """One tensor with a leading expert mode from ``E`` 2-D tensors of one shape and
        device (copies; e.g. experts loaded one by one)."""
        tensors = list(tensors)
        name = cls.__name__
        if not tensors or not all(isinstance(t, cls) for t in tensors):
            raise InputTypeError(f"{name}.stack() takes a non-empty sequence of {name}s")
        first = tensors[0]
        for e, t in enumerate(tensors):
            if t.experts is not None or t.shape != first.shape or t.device != first.device:
                raise FormatError(f"{name}.stack(): expert {e} is {t.shape} on "
                                  f"{t.device}; expert 0 is {first.shape} on {first.device} "
                                  "(all must be 2-D, of one shape and device)")
        gs = None
        if cls.fmt.global_scale:
            gs = torch.stack([t.global_scale.to(torch.float32).reshape(()) for t in tensors])
        return cls._unchecked(torch.stack([t.data for t in tensors]),
                              torch.stack([t.scale for t in tensors]), gs,
                              (len(tensors), *first.shape))

    @property
    def experts(self) -> int | None:
        """E for a tensor with a leading expert mode, None for a 2-D tensor."""
        return self.shape[0] if len(self.shape) == 3 else None

    def expert(self, e: int):
        """Expert ``e`` of an expert stack as a 2-D tensor ``[R, K]`` (views, no copies)."""
        i = expert_index(self.shape, e, "a tensor", "[E, R, K]")
        gs = None if self.global_scale is None else self.global_scale[i]
        return type(self)._unchecked(self.data[i], self.scale[i], gs, self.shape[1:])

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device):
        name = type(self).__name__
        try:
            target = torch.device(device)
        except (RuntimeError, TypeError):
            raise InputError(f"{name}.to(): {device!r} is not a device") from None
        if self.device.type == "meta" and target.type != "meta":
            raise InputError(f"an {name} on the meta device has no data to move to {device}")
        if target.type == "cuda" and not torch.cuda.is_available():
            raise DeviceError(f"{name}.to({str(device)!r}): CUDA is not available")
        # the parts were checked when this tensor was made: moving them keeps them valid
        gs = None if self.global_scale is None else self.global_scale.to(target)
        return type(self)._unchecked(self.data.to(target), self.scale.to(target), gs,
                                     self.shape)

    def cuda(self):
        return self.to("cuda")

    def scale_linear(self) -> torch.Tensor:
        """Block scales as [R, K / block] in row-major order ([E, R, K / block] for an
        expert stack), in the scale type's storage dtype."""
        rows, k = self.shape[-2:]
        if self.experts is None:
            return unswizzle_scales(self.scale, rows, k, self.fmt)
        return torch.stack([unswizzle_scales(s, rows, k, self.fmt) for s in self.scale])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``e2m1 * block_scale (* global_scale)``, computed in float64 (one rounding, to
        ``dtype``); an expert stack uses each expert's global scale."""
        vals = self.block_values(torch.float64)
        if self.global_scale is None:
            return vals.to(dtype)
        gs = self.global_scale.double()
        if self.experts is not None:
            gs = gs.view(-1, 1, 1)
        return (vals * gs).to(dtype)

    def block_values(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """``e2m1 * block_scale`` without the global scale: what the tensor cores see."""
        codes = unpack_e2m1(self.data.reshape(-1, self.data.shape[-1]))
        vals = e2m1_decode(codes, dtype).reshape(self.shape)
        return vals * self.scale_linear().to(dtype).repeat_interleave(self.fmt.block, dim=-1)

    def __repr__(self) -> str:
        name = type(self).__name__
        if self.experts is not None or self.device.type == "meta":  # meta: no value to show
            e = "" if self.experts is None else f", experts={self.experts}"
            return f"{name}(shape={self.shape}{e}, device={self.device})"
        gs = ("" if self.global_scale is None
              else f", global_scale={float(self.global_scale):.6g}")
        return f"{name}(shape={self.shape}, device={self.device}{gs})"


# ----------------------------------------------------------------------------- checks

def check_quantizable(x: torch.Tensor, fmt: BlockFormat = NVFP4) -> None:
    k = x.shape[-1]
    if k % fmt.block:
        raise InputError(f"K = {k} is not a multiple of {fmt.block} (the {fmt} block "
                         "size)")
    if x.numel() == 0:
        raise InputError(f"cannot quantize an empty tensor of shape {tuple(x.shape)}")


def check_finite(xf: torch.Tensor, bad: int | None = None,
                  source: torch.Tensor | None = None, fmt: BlockFormat = NVFP4) -> None:
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
    raise InputError(f"x has {bad} NaN/Inf values; {fmt} has no encoding for them")



__all__ = ["BlockTensor", "as_bytes", "check_finite", "check_quantizable", "check_scale_type",
           "count_values", "e2m1_decode",
           "e2m1_encode", "e2m1_table", "expert_index", "pack_e2m1", "scale_offset",
           "scale_shape", "swizzle_scales", "unpack_e2m1", "unswizzle_scales"]
