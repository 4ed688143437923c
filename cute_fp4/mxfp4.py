"""MXFP4 (OCP Microscaling): E2M1 elements in blocks of 32 along K with one UE8M0 scale.

The format is :data:`cute_fp4.formats.MXFP4`: the elements as NVFP4's (two per byte, the
even K index in the low nibble), one scale byte ``e`` per 32 elements meaning ``2^(e -
127)`` (255 is NaN), no per-tensor global scale. The blocked scales use the same 128x4
layout as NVFP4's (:mod:`cute_fp4.formats`), over ``K / 32`` scale columns.

Quantization, the OCP MX specification v1.0 (section 6.3, "conversion of a vector of FP32
to an MX format") for E2M1 (``emax_elem`` = 2): per block of 32,

    shared = floor(log2(amax)) - 2, clamped to [-127, 127]   (amax = 0: -127)
    scale  = 2^shared  (UE8M0 code shared + 127)
    q      = e2m1(x / scale)  round to nearest, ties to even, saturating at +-6

``x / scale`` is a multiplication by a power of two: exact wherever the code depends on it
(a quotient below 2^-126 has code 0 whatever its rounding), so CPU and CUDA give the same
bytes. From float32 input ``shared`` is at most 125 (code 252). Note the rule lets a block
clip: an amax in ``[6, 8) * scale`` saturates to 6 (the spec's choice). OpenAI's
``triton_kernels.downcast_to_mxfp`` (what transformers' ``quantize_to_mxfp4`` calls)
rounds the scale up instead (``2^ceil(log2(amax / 6))``, no clipping) and its elements
differently; gpt-oss checkpoints are loaded as stored, never re-quantized, so their bytes
do not depend on either rule.

Checkpoints (transformers ``GptOss``, ``quantization_config.quant_method == "mxfp4"``): a
weight ``[N, K]`` is stored as ``*_blocks`` uint8 ``[..., N, K/32, 16]`` (the packed bytes
of each block) and ``*_scales`` uint8 ``[..., N, K/32]`` (the UE8M0 codes, row-major):
:meth:`MXFP4Tensor.from_blocks` and :meth:`MXFP4Tensor.to_blocks`, exact inverses.

The kernels' range. Every scale code up to 252 (every one a float32 tensor quantizes to)
decodes exactly in every kernel, the SM90 ones included (BF16: ``v * 2^(e - 127)`` is a
BF16 number for ``e`` <= 252); :meth:`MXFP4Tensor.from_blocks` refuses the NaN code 255
and codes 253, 254 (values of ``2^126`` and beyond, which those decodes would overflow).
"""

from __future__ import annotations

import torch

from cute_fp4.blockscaled import (
    BlockTensor,
    check_finite,
    check_quantizable,
    e2m1_encode,
    pack_e2m1,
    swizzle_scales,
)
from cute_fp4.errors import FormatError
from cute_fp4.formats import MXFP4, BlockFormat

E2M1_EMAX = 2  # the largest E2M1 exponent (6 = 1.5 x 2^2): the OCP rule's emax_elem
MAX_KERNEL_CODE = 252  # the largest scale code every kernel decodes exactly


class MXFP4Tensor(BlockTensor):
    """An MXFP4 tensor (:class:`~cute_fp4.nvfp4.BlockTensor` of
    :data:`~cute_fp4.formats.MXFP4`): ``data`` uint8 [R, K/2], ``scale``
    float8_e8m0fnu in the blocked layout (K / 32 columns), no global scale
    (``global_scale`` is None); an expert stack ``[E, R, K]`` as NVFP4's. A sibling of
    :class:`~cute_fp4.nvfp4.NVFP4Tensor`, not a kind of it: code that takes NVFP4 refuses
    it instead of reading its UE8M0 scales as UE4M3."""

    fmt: BlockFormat = MXFP4

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, shape=None):
        super().__init__(data, scale, None, shape)

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, scales: torch.Tensor) -> MXFP4Tensor:
        """From a checkpoint's ``*_blocks`` (uint8 ``[N, K/32, 16]``, or ``[E, N, K/32,
        16]`` for an expert stack) and ``*_scales`` (uint8 ``[N, K/32]`` / ``[E, N, K/32]``,
        row-major UE8M0 codes). Refuses scale codes 253..255 (module docstring)."""
        if blocks.dtype != torch.uint8 or scales.dtype not in (torch.uint8,
                                                               MXFP4.scale.torch_dtype):
            raise FormatError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and "
                              f"{scales.dtype}")
        if blocks.dim() not in (3, 4) or blocks.shape[-1] != MXFP4.block // 2 or \
                tuple(scales.shape) != tuple(blocks.shape[:-1]):
            raise FormatError(f"MXFP4 blocks must be [..., N, K/32, 16] and scales [..., N, "
                              f"K/32] of the same leading shape, got {tuple(blocks.shape)} "
                              f"and {tuple(scales.shape)}")
        raw = scales.view(torch.uint8)
        over = int((raw > MAX_KERNEL_CODE).sum())
        if over:
            code = int(raw.max())
            raise FormatError(f"MXFP4 scales hold {over} codes above {MAX_KERNEL_CODE} (the "
                              f"largest is {code}: {'NaN' if code == 255 else f'2^{code - 127}'}"
                              "); 255 is NaN and 253/254 overflow the 16-bit decodes")
        *lead, n, k_blocks, _ = blocks.shape
        data = blocks.reshape(*lead, n, k_blocks * (MXFP4.block // 2))
        if lead:
            scale = torch.stack([swizzle_scales(s) for s in raw])
        else:
            scale = swizzle_scales(raw.contiguous())
        return cls(data.contiguous(), scale.view(MXFP4.scale.torch_dtype),
                   (*lead, n, k_blocks * MXFP4.block))

    def to_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The checkpoint form, ``(blocks [.., N, K/32, 16], scales [.., N, K/32])`` uint8:
        the inverse of :meth:`from_blocks`, bit for bit."""
        *lead, n, k = self.shape
        blocks = self.data.reshape(*lead, n, k // MXFP4.block, MXFP4.block // 2)
        return blocks.contiguous(), self.scale_linear().view(torch.uint8).contiguous()


def _encode(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``[R, K]`` -> (packed codes [R, K/2], blocked UE8M0 scales): the OCP rule
    (module docstring)."""
    rows, k = xf.shape
    blocks = xf.view(rows, k // MXFP4.block, MXFP4.block)
    amax = blocks.abs().amax(dim=-1)
    _, e = torch.frexp(amax)  # amax = m 2^e, m in [0.5, 1): floor(log2(amax)) = e - 1
    bias = MXFP4.scale.bias
    shared = torch.where(amax > 0, e - 1 - E2M1_EMAX, -bias).clamp(-bias, bias)
    q = blocks * torch.ldexp(torch.ones_like(amax), -shared).unsqueeze(-1)
    codes = e2m1_encode(q).view(rows, k)
    sf = (shared + bias).to(torch.uint8).view(MXFP4.scale.torch_dtype)
    return pack_e2m1(codes), swizzle_scales(sf)


def quantize_mxfp4(x: torch.Tensor) -> MXFP4Tensor:
    """``quantize(x, format="mxfp4")``: a 2-D ``[R, K]`` tensor or an expert stack
    ``[E, R, K]`` (each expert by the 2-D rule, one at a time) to MXFP4 (K a multiple of
    32). ``x`` is a float tensor (checked by :func:`cute_fp4.nvfp4.quantize`)."""
    check_quantizable(x, MXFP4)
    if x.dim() == 2:
        xf = x.float()
        check_finite(xf, source=x, fmt=MXFP4)
        data, scale = _encode(xf)
        return MXFP4Tensor(data, scale, tuple(x.shape))
    n_exp, rows, k = x.shape
    bad = sum(int((~torch.isfinite(x[e].float())).sum()) for e in range(n_exp))
    check_finite(x, bad, fmt=MXFP4)
    rp, cp = MXFP4.scale_shape(rows, k)
    data = torch.empty((n_exp, rows, k // 2), dtype=torch.uint8, device=x.device)
    scale = torch.empty((n_exp, rp, cp), dtype=MXFP4.scale.torch_dtype, device=x.device)
    for e in range(n_exp):
        data[e], scale[e] = _encode(x[e].float().contiguous())
    return MXFP4Tensor._unchecked(data, scale, None, (n_exp, rows, k))


# format name -> its quantize (cute_fp4.nvfp4.quantize dispatches here)
QUANTIZERS = {MXFP4.name: quantize_mxfp4}


__all__ = ["E2M1_EMAX", "MAX_KERNEL_CODE", "QUANTIZERS", "MXFP4Tensor", "quantize_mxfp4"]
