"""Block-scaled 4-bit formats as data: one frozen descriptor per format.

A :class:`BlockFormat` says everything the codecs, the exact reference, planning and the
kernels need to know about a block-scaled format, so that none of them writes a block size,
a scale type or a format name of its own:

* the element type (:class:`ElementType`: E2M1, two per byte, the even K index in the low
  nibble);
* the scale type (:class:`ScaleType`) with its decode (code -> value, exact) and encode
  (value -> code, the type's own rounding), its torch storage dtype and the CuTe DSL
  type's name;
* the block size (elements along K per scale) and whether a per-tensor global scale exists;
* the scale layout rules: every format stores its scales in the cuBLAS "128x4 blocked"
  layout, rows padded to a multiple of 128 and scale columns to a multiple of 4, 512-byte
  atoms of 128 rows x 4 columns (:func:`sf_offset`); padding is zero. One atom column group
  covers :attr:`BlockFormat.atom_k` elements of K (64 for blocks of 16, 128 for 32);
* byte counts per row (packed data, padded scales) and of a whole padded scale tensor;
* the SM120 block-scaled MMA that consumes it (``mma.sync ... kind::<mma_kind>
  .block_scale.scale_vec::<scale_vec>``) and the SASS opcode that instruction becomes;
* its name, the string the API edge accepts (``"nvfp4"``).

:class:`Operand` is the format of a GEMM operand: a block format or a 16-bit dtype. It is a
``str`` enum, so ``Operand.NVFP4 == "nvfp4"`` and the strings the host passes keep working.

NVFP4 is the first instance. Adding a format is adding an instance here (and the kernel
instructions that decode its scales).

Pure Python: importing it loads neither torch (the tensor codecs import it when called;
planning runs without it) nor the CuTe DSL (the kernels look the DSL types up by name).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math

from cute_fp4.errors import InputError, InputTypeError

# ----------------------------------------------------------------------------- scale layout
# The 128x4 blocked layout every format's scales use (cuBLAS "Block Scaling Factors
# Layout"; PyTorch ``to_blocked``; CuTe ``BlockScaledBasicChunk``).

SF_ATOM_ROWS = 128  # rows of one atom
SF_ATOM_COLS = 4  # scale columns of one atom
SF_ATOM_BYTES = SF_ATOM_ROWS * SF_ATOM_COLS  # 512


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def sf_atom_offset(r, c):
    """Byte offset of (row ``r`` < 128, scale column ``c`` < 4) inside one 128x4 atom."""
    return (r % 32) * 16 + (r // 32) * 4 + c


def sf_offset(r, c, col_blocks):
    """Byte offset of the scale of (row ``r``, scale column ``c``) in the 128x4 blocked
    layout with ``col_blocks`` 4-column blocks per 128-row atom row.

    The one definition of the layout: 512-byte atoms of 128 rows x 4 scale columns
    (:func:`sf_atom_offset`), row-atom major. Plain integer arithmetic, so it serves Python
    ints, integer tensors and the kernels' DSL integers alike.
    """
    return ((r // SF_ATOM_ROWS) * (col_blocks * SF_ATOM_BYTES)
            + (c // SF_ATOM_COLS) * SF_ATOM_BYTES
            + sf_atom_offset(r % SF_ATOM_ROWS, c % SF_ATOM_COLS))


def sf_offset_shifts(r, c, padded_cols):
    """:func:`sf_offset` for non-negative ``r`` and ``c`` in shifts and masks, with
    ``padded_cols`` the scale columns rounded up to a multiple of 4: what the kernels use
    (the DSL divides Int32 signed, so ``//`` and ``%`` cost more there)."""
    return ((r >> 7) * (padded_cols * 128) + ((c >> 2) << 9) + ((r & 31) << 4)
            + (((r >> 5) & 3) << 2) + (c & 3))


# ----------------------------------------------------------------------------- types

@dataclasses.dataclass(frozen=True)
class ElementType:
    """A packed element type: its name, bits, the magnitudes of its non-negative codes (the
    sign is the top bit of a code) and the CuTe DSL type's name."""

    name: str
    bits: int
    magnitudes: tuple[float, ...]  # code -> value for codes 0 .. 2^(bits-1) - 1
    dsl_name: str

    @property
    def max(self) -> float:
        return self.magnitudes[-1]

    @property
    def per_byte(self) -> int:
        return 8 // self.bits

    def values(self) -> tuple[float, ...]:
        """Every code's value (the negatives follow the positives; the first is -0.0)."""
        return (*self.magnitudes, *(-v for v in self.magnitudes))


E2M1 = ElementType("e2m1", 4, (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0), "Float4E2M1FN")


def _ue4m3_decode(code: int) -> float:
    """E4M3 (fn) bit fields, sign ignored: bias 7, no infinities, 0x7F is NaN, exponent 0
    is subnormal (``m/8 * 2^-6``)."""
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0xF and man == 0x7:
        return float("nan")
    if exp == 0:
        return man / 8.0 * 2.0**-6
    return (1.0 + man / 8.0) * 2.0 ** (exp - 7)


@dataclasses.dataclass(frozen=True)
class ScaleType:
    """An unsigned 8-bit block-scale type: decode (code -> value) and encode (value ->
    code, the type's rounding), its torch storage dtype and its CuTe DSL type's name."""

    name: str
    torch_name: str  # the torch storage dtype's name (``torch.float8_e4m3fn``)
    dsl_name: str
    max: float  # largest finite value
    min_positive: float  # smallest positive value
    bias: int  # exponent bias

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.torch_name)

    def decode(self, code: int) -> float:
        """The value of one scale byte (``code`` 0..255), exact: UE4M3's bit fields (sign
        ignored, 0x7F NaN), UE8M0's ``2^(code - 127)`` (255 NaN)."""
        code = int(code)
        if not 0 <= code <= 255:
            raise InputError(f"{self.name} codes are bytes 0..255, got {code}")
        if self.name == "ue4m3":
            return _ue4m3_decode(code & 0x7F)  # the sign bit is ignored
        if self.name == "ue8m0":
            return float("nan") if code == 255 else math.ldexp(1.0, code - self.bias)
        raise AssertionError(f"no decode for scale type {self.name}")

    def decode_tensor(self, codes, dtype=None):
        """The values of a tensor of scale bytes (uint8 or the storage dtype) as ``dtype``
        (default float64)."""
        import torch

        dtype = dtype or torch.float64
        raw = codes.view(torch.uint8) if codes.dtype != torch.uint8 else codes
        if self.name == "ue4m3":
            return (raw & 0x7F).view(torch.float8_e4m3fn).to(dtype)
        if self.name == "ue8m0":
            one = torch.ones(raw.shape, dtype=torch.float64, device=raw.device)
            val = torch.ldexp(one, raw.to(torch.int32) - self.bias)
            return torch.where(raw == 255, torch.nan, val).to(dtype)
        raise AssertionError(f"no decode for scale type {self.name}")

    def encode(self, values):
        """float32 values -> codes in the storage dtype, by the type's rounding: UE4M3 round
        to nearest even (values beyond ``max`` must be clamped by the caller); UE8M0 down to
        a power of two, ``floor(log2 v)`` (the OCP MX rule's shared exponent), clamped to
        the finite codes 0..254 (``2^-127`` .. ``2^127``; 0 and values below ``2^-127``
        give code 0)."""
        import torch

        if self.name == "ue4m3":
            return values.to(torch.float8_e4m3fn)
        if self.name == "ue8m0":
            _, e = torch.frexp(values.float())  # v = m 2^e, m in [0.5, 1): floor(log2) e - 1
            code = torch.where(values > 0, e - 1 + self.bias, 0).clamp(0, 254)
            return code.to(torch.uint8).view(self.torch_dtype)
        raise AssertionError(f"no encode for scale type {self.name}")


UE4M3 = ScaleType("ue4m3", "float8_e4m3fn", "Float8E4M3FN", 448.0, 2.0**-9, 7)
UE8M0 = ScaleType("ue8m0", "float8_e8m0fnu", "Float8E8M0FNU", 2.0**127, 2.0**-127, 127)


# ----------------------------------------------------------------------------- formats

MMA_K = 64  # K of SM120's block-scaled FP4 MMA (m16n8k64)


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """A block-scaled format: ``x ~= element * scale[block] (* global scale)``.

    ``block``: consecutive elements along K that share one scale; ``global_scale``: whether
    a per-tensor FP32 scale (decode form) multiplies every element; ``mma_kind`` and
    ``scale_vec``: the SM120 warp-level block-scaled MMA that takes it (``kind::mxf4nvf4``
    with ``scale_vec::4X``: 4 scales per 64 K); ``sass_mma``: the SASS opcode ptxas makes
    of that MMA (read off sm_120a cubins: ``...UE4M3.4X`` for NVFP4, ``...E8`` for MXFP4)."""

    name: str
    element: ElementType
    scale: ScaleType
    block: int
    global_scale: bool
    mma_kind: str
    scale_vec: str
    sass_mma: str

    def __str__(self) -> str:
        return self.name

    # ------------------------------------------------------------------ layout and sizes
    @property
    def atom_k(self) -> int:
        """Elements of K one 4-column atom group of the blocked scales covers."""
        return SF_ATOM_COLS * self.block

    @property
    def scales_per_mma(self) -> int:
        """Scales per row of one 64-wide K block of SM120's MMA (``scale_vec``'s X)."""
        return MMA_K // self.block

    def scale_cols(self, k: int) -> int:
        """Scale columns of a row of ``k`` elements (before padding)."""
        return -(-k // self.block)

    def scale_shape(self, rows: int, k: int) -> tuple[int, int]:
        """Padded shape of the blocked scale tensor of ``rows`` x ``k`` elements."""
        return round_up(rows, SF_ATOM_ROWS), round_up(self.scale_cols(k), SF_ATOM_COLS)

    def scale_bytes(self, rows: int, k: int) -> int:
        """Bytes of the padded blocked scales of ``rows`` x ``k`` elements."""
        return math.prod(self.scale_shape(rows, k))

    def data_row_bytes(self, k: int) -> int:
        """Bytes of one row of ``k`` packed elements."""
        return k // self.element.per_byte

    def scale_row_bytes(self, k: int) -> int:
        """Scale bytes of one row of ``k`` elements, padded (the blocked layout's columns)."""
        return self.scale_shape(1, k)[1]

    def atom_cols(self, half_k):
        """Atom column groups (4 scale columns, :attr:`atom_k` elements of K, each) of the
        blocked scales of rows of ``half_k`` packed bytes: plain integer arithmetic, so the
        kernels run it on their DSL integers."""
        h = self.atom_k // self.element.per_byte
        return (half_k + (h - 1)) // h

    def scale_offset(self, r, c, k: int):
        """Byte offset of the scale of (row ``r``, scale column ``c``) for ``k`` elements
        per row in the blocked layout (:func:`sf_offset`). Works on ints and integer
        tensors."""
        return sf_offset(r, c, self.scale_row_bytes(k) // SF_ATOM_COLS)


NVFP4 = BlockFormat("nvfp4", E2M1, UE4M3, block=16, global_scale=True, mma_kind="mxf4nvf4",
                    scale_vec="4X", sass_mma="OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X")
# OCP Microscaling MXFP4: E2M1 elements, one UE8M0 scale (2^(e - 127)) per 32 along K, no
# per-tensor scale (gpt-oss's experts; transformers' ``mxfp4`` quantization method)
MXFP4 = BlockFormat("mxfp4", E2M1, UE8M0, block=32, global_scale=False, mma_kind="mxf4",
                    scale_vec="2X", sass_mma="OMMA.SF.16864.F32.E2M1.E2M1.E8")

FORMATS: dict[str, BlockFormat] = {f.name: f for f in (NVFP4, MXFP4)}


def _unknown(what: str, value: object, known: list[str]) -> InputError:
    close = difflib.get_close_matches(str(value).lower(), known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return InputError(f"unknown {what} {value!r}: use one of {', '.join(map(repr, known))}"
                      f"{hint}")


def get_format(x: object) -> BlockFormat:
    """A block format from itself, its name (``"nvfp4"``, any case) or an :class:`Operand`
    naming one; an InputError (with "did you mean") otherwise."""
    if isinstance(x, BlockFormat):
        return x
    if not isinstance(x, str):
        raise InputTypeError(f"a block format is a BlockFormat or its name, got "
                             f"{type(x).__name__} {x!r}")
    fmt = FORMATS.get(str(x).lower())
    if fmt is None:
        raise _unknown("block format", x, list(FORMATS))
    return fmt


class Operand(enum.StrEnum):
    """The format of a GEMM operand: a block-scaled 4-bit format or a 16-bit float.

    A ``str`` enum: members equal their value strings (``Operand.BF16 == "bf16"``) and hash
    like them, and ``repr`` is the string's, so problems, keys and messages read as before.
    """

    NVFP4 = "nvfp4"
    MXFP4 = "mxfp4"
    BF16 = "bf16"
    FP16 = "fp16"

    def __repr__(self) -> str:
        return repr(self.value)

    @property
    def block_format(self) -> BlockFormat | None:
        """The block format, None for a 16-bit operand."""
        return FORMATS.get(self.value)

    @property
    def sixteen_bit(self) -> bool:
        return self.block_format is None

    @classmethod
    def of(cls, x: object, field: str = "format") -> Operand:
        """An Operand from itself, a BlockFormat, its value string (any case) or a torch
        dtype (``torch.bfloat16``); an InputError naming ``field`` otherwise."""
        if isinstance(x, cls):
            return x
        if isinstance(x, BlockFormat):
            x = x.name
        if type(x).__name__ == "dtype" and str(x).startswith("torch."):  # a torch dtype
            x = {"torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(str(x), str(x))
        if isinstance(x, str):
            for member in cls:
                if x.lower() in (member.value, member.name.lower()):
                    return member
        raise _unknown(field, x, [m.value for m in cls])


__all__ = ["E2M1", "FORMATS", "MMA_K", "MXFP4", "NVFP4", "SF_ATOM_BYTES", "SF_ATOM_COLS",
           "SF_ATOM_ROWS", "UE4M3", "UE8M0", "BlockFormat", "ElementType", "Operand", "ScaleType",
           "get_format", "round_up", "sf_atom_offset", "sf_offset", "sf_offset_shifts"]
