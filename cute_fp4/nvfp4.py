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

import torch

from cute_fp4.blockscaled import (
    BlockTensor,
    as_bytes,
    check_finite,
    check_quantizable,
    check_scale_type,
    count_values,
    e2m1_decode,
    e2m1_encode,
    e2m1_table,
    expert_index,
    pack_e2m1,
    per_expert_scales,
    scale_offset,
    scale_shape,
    swizzle_scales,
    unpack_e2m1,
    unswizzle_scales,
)
from cute_fp4.errors import FormatError, InputError, InputTypeError
from cute_fp4.formats import E2M1, NVFP4, UE4M3, BlockFormat, get_format

E2M1_VALUES = E2M1.magnitudes  # codes 0..7; 8..15 are negatives
E2M1_MAX = E2M1.max
E4M3_MAX = UE4M3.max
E4M3_MIN_SUBNORMAL = UE4M3.min_positive
# float32(1/6) exactly, as a Python float: ``bamax * RCP6`` rounds once to float32 on every
# device (the fused kernel's ``mul.rn.f32 t, bamax, 0f3E2AAAAB``)
RCP6 = 0.1666666716337204


def e4m3_decode(code: int) -> float:
    """The value of an E4M3 (fn) code from its bit fields: bias 7, no infinities,
    0x7F/0xFF are NaN, exponent 0 is subnormal (``m/8 * 2^-6``)."""
    sign = -1.0 if code & 0x80 else 1.0
    return sign * UE4M3.decode(code & 0x7F)


class NVFP4Tensor(BlockTensor):
    """An NVFP4 tensor (:class:`BlockTensor` of :data:`~cute_fp4.formats.NVFP4`): UE4M3
    scales (float8_e4m3fn) per 16 elements and a float32 global scale (decode form), one
    per expert for an expert stack."""

    fmt: BlockFormat = NVFP4

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, global_scale, shape=None):
        super().__init__(data, scale, global_scale, shape)

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
        raw = as_bytes(weight_scale)
        bad = int(((raw & 0x7F) == 0x7F).sum())
        if bad:
            raise FormatError(f"weight_scale holds {bad} NaN bytes (0x7F/0xFF); NVFP4 block "
                              "scales are finite UE4M3")
        neg = int(((raw & 0x80) != 0).sum())
        if neg:
            raise FormatError(f"weight_scale holds {neg} negative bytes; NVFP4 block scales "
                              "are unsigned (UE4M3)")
        return cls(weight, swizzle_scales(weight_scale.contiguous()), weight_scale_2, (n, k))


# ----------------------------------------------------------------------------- quantize

def quantize(x: torch.Tensor, global_scale=None, *, format="nvfp4") -> BlockTensor:
    """Quantize a 2-D float tensor ``[R, K]`` (CPU or CUDA) to a block format (``format``:
    its name or :class:`~cute_fp4.formats.BlockFormat`; NVFP4 by default), or a 3-D expert
    stack ``[E, R, K]`` to a tensor with a leading expert mode.

    NVFP4 (an :class:`NVFP4Tensor`): ``global_scale`` is the decode form (``amax / 2688``),
    computed from ``x`` when None (for a stack, from each expert's own amax). For a stack
    it may be a scalar or hold ``E`` values; expert ``e`` of the result is bit-identical to
    ``quantize(x[e], global_scale[e])``. MXFP4 (an :class:`~cute_fp4.mxfp4.MXFP4Tensor`,
    the OCP Microscaling rule, :mod:`cute_fp4.mxfp4`): no global scale (``global_scale``
    must be None).
    Raises ValueError subclasses for K not a multiple of the block size, NaN/Inf, or a bad
    scale.
    """
    fmt = get_format(format)
    if not isinstance(x, torch.Tensor):
        raise InputTypeError(f"quantize() takes a torch.Tensor, got {type(x).__name__}")
    check_scale_type(global_scale)
    if x.dim() == 2 and global_scale is not None and count_values(global_scale) != 1:
        raise InputError(f"quantize(): global_scale of a 2-D tensor {list(x.shape)} must be "
                         f"one value, got {count_values(global_scale)} (one per expert goes "
                         "with a 3-D stack [E, R, K])")
    if not x.is_floating_point() or x.element_size() == 1:
        raise InputError(f"quantize() needs a float32/float16/bfloat16/float64 tensor, "
                         f"got {x.dtype}")
    if x.is_meta:
        raise InputError(f"quantize() reads x's values: x {list(x.shape)} is on the meta "
                         "device (no data)")
    if x.dim() not in (2, 3):
        raise InputError(f"quantize() needs a 2-D tensor [R, K], got shape {tuple(x.shape)} "
                         "(or a 3-D expert stack [E, R, K])")
    if fmt is not NVFP4:
        if global_scale is not None:
            raise InputError(f"{fmt} has no global scale: quantize(x, format={fmt.name!r}) "
                             f"takes none, got global_scale={global_scale!r}")
        from cute_fp4.mxfp4 import QUANTIZERS

        return QUANTIZERS[fmt.name](x)
    if x.dim() == 3:
        return _quantize_experts(x, global_scale)
    rows, k = x.shape
    check_quantizable(x)
    xf = x.float()
    check_finite(xf, source=x)
    if global_scale is None:
        global_scale = _amax_scale(xf)
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device).reshape(())
    if not torch.isfinite(gs) or gs <= 0:
        raise InputError(f"global_scale must be finite and > 0, got {float(gs):g}")
    data, sf = _encode(xf, gs)
    return NVFP4Tensor(data, sf, gs, (rows, k))


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
    check_quantizable(x)
    bad = sum(int((~torch.isfinite(x[e].float())).sum()) for e in range(n_exp))
    check_finite(x, bad)
    if global_scale is None:
        global_scale = [_amax_scale(x[e].float()) for e in range(n_exp)]
    gs = per_expert_scales(torch.as_tensor(global_scale, dtype=torch.float32,
                                           device=x.device), n_exp, InputError)
    rp, cp = NVFP4.scale_shape(rows, k)
    data = torch.empty((n_exp, rows, k // 2), dtype=torch.uint8, device=x.device)
    scale = torch.empty((n_exp, rp, cp), dtype=NVFP4.scale.torch_dtype, device=x.device)
    for e in range(n_exp):
        data[e], scale[e] = _encode(x[e].float().contiguous(), gs[e])
    return NVFP4Tensor._unchecked(data, scale, gs, (n_exp, rows, k))


# the shared codecs and container, under the names callers have imported from here
__all__ = ["E2M1_MAX", "E2M1_VALUES", "E4M3_MAX", "E4M3_MIN_SUBNORMAL", "RCP6", "BlockTensor",
           "NVFP4Tensor", "e2m1_decode", "e2m1_encode", "e2m1_table", "e4m3_decode",
           "expert_index", "pack_e2m1", "quantize", "scale_offset", "scale_shape",
           "swizzle_scales", "unpack_e2m1", "unswizzle_scales"]
