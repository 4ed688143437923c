"""A block-scaled weight (NVFP4, MXFP4) repacked offline into WGMMA A-fragment order
(sm_90a ``rs_packed``, and the ``stream`` kernels of both families).

Hopper has no FP4 tensor cores: the ``rs_packed`` mainloop (kernels/sm90_rs_wide.py) makes
the weight WGMMA's A operand, loads each thread's packed bytes from shared memory into
registers and decodes them there into the A fragment (E2M1 x scale -> BF16/FP16, exact).
With the plain ``[N, K/2]`` layout a thread's fragment bytes are scattered over 16 rows;
repacked once, they are 16 contiguous bytes per 64 K elements (one ``ld.shared.v4``,
bank-conflict free), so the K order of the activations stays natural (no conversion pass
over the activations).

Layout. The weight is cut into units of 64 rows x 64 K elements (2,048 bytes), stored
row-block major: unit ``(rb, ku)`` at byte ``(rb * K/64 + ku) * 2048``. Inside a unit,
thread ``t`` of the consumer warpgroup (warp ``w = t // 32``, lane ``l``, ``g = l // 4``,
``c = l % 4``) owns bytes ``16 t .. 16 t + 15``; byte ``4 kb + j`` (K block ``kb`` = 0..3 of
16 elements, fragment register ``j`` = 0..3) is the packed byte (two E2M1 elements, the
even K index in the low nibble, as in the plain layout) of

* row ``64 rb + 16 w + g + 8 (j % 2)``,
* packed column ``32 ku + 8 kb + c + 4 (j // 2)`` (elements ``2 c, 2 c + 1`` of the K
  block for ``j < 2``, ``2 c + 8, 2 c + 9`` for ``j >= 2``),

which is WGMMA's A-fragment register ``a_j`` of K block ``kb`` (PTX ISA, wgmma 16-bit A
fragment: rows ``g`` / ``g + 8`` of the warp's 16, K pairs ``2c`` / ``2c + 8``). Rows are
padded to a multiple of 64 with zeros; K must be a multiple of 64.

Sign bits. The four bytes ``4 kb .. 4 kb + 3`` are one little-endian 32-bit word, eight
codes: nibble ``i`` (bits ``4i .. 4i + 3`` of the plain bytes) is the low (``i`` even) or
high nibble of byte ``i // 2``. In the packed word nibble ``i`` keeps its three magnitude
bits, and its sign moves to bit ``8i + 7`` (``i < 4``) or ``8 (i - 4) + 3`` (``i >= 4``):
the decode looks nibbles 0-3 and 4-7 up in two groups, one table byte per code, and
with this placement each group's signs already sit on the sign bits of its bytes (in the
word, and in the word shifted left by 4), so no instruction gathers them
(:func:`move_signs`, :func:`restore_signs`, :func:`fragment_code`). The scale factors keep
the 128x4 blocked layout of :class:`~cute_fp4.nvfp4.NVFP4Tensor` unchanged (each thread
reads one 32-bit word per row and 64 K elements). :func:`pack` and :func:`unpack` are exact
inverses (a permutation of bits plus zero padding).

The layout belongs to this version of the kernels (the sign placement above changed on
2026-12-01): store the plain NVFP4Tensor, as ``NVFP4Linear.state_dict`` does, and repack
after loading.
"""

from __future__ import annotations

import torch

from cute_fp4.blockscaled import BlockTensor, expert_index
from cute_fp4.errors import FormatError, InputTypeError
from cute_fp4.mxfp4 import MXFP4Tensor
from cute_fp4.nvfp4 import NVFP4Tensor

UNIT_ROWS = 64  # weight rows per packed unit (one WGMMA M)
UNIT_K = 64  # K elements per packed unit
UNIT_BYTES = UNIT_ROWS * UNIT_K // 2  # 2,048: 128 threads x 16 bytes

# where the sign of nibble i of a fragment word goes (see the module docstring)
SIGN_BIT = tuple(8 * i + 7 if i < 4 else 8 * (i - 4) + 3 for i in range(8))
_MAGNITUDES = 0x77777777

# [rb, w, h, g, ku, kb, hi, c] (plain) -> [rb, ku, w, g, c, kb, hi, h] (packed)
_TO_PACKED = (0, 4, 1, 3, 7, 5, 6, 2)
_TO_PLAIN = tuple(_TO_PACKED.index(i) for i in range(8))


def packed_rows(n: int) -> int:
    """Rows of the packed data: ``n`` rounded up to whole 64-row units."""
    return -(-n // UNIT_ROWS) * UNIT_ROWS


def _check_k(k: int) -> None:
    if k % UNIT_K:
        raise FormatError(f"K = {k} is not a multiple of {UNIT_K}: the fragment-order "
                          f"layout cuts K into {UNIT_K}-element units; keep the plain "
                          "NVFP4Tensor for this weight")


def _lead_perm(lead: int, perm: tuple[int, ...]) -> tuple[int, ...]:
    """``perm`` of the unit modes behind ``lead`` leading (expert) modes kept in place."""
    return (*range(lead), *(lead + i for i in perm))


_NIBBLE_SIGN = tuple(4 * i + 3 for i in range(8))  # a nibble's own sign bit (plain layout)


def _move_sign_bits(data: torch.Tensor, src: tuple[int, ...], dst: tuple[int, ...]
                    ) -> torch.Tensor:
    """Each 32-bit word's sign bits from positions ``src`` to ``dst`` (magnitudes kept):
    int32 words (an arithmetic shift then ``& 1`` reads bit 31 as any other; ``1 << 31``
    wraps onto it), so the working set is the data's size, not twice it."""
    w = data.contiguous().view(torch.int32)
    out = w & _MAGNITUDES
    for a, b in zip(src, dst):
        out |= ((w >> a) & 1) << b
    return out.view(torch.uint8).reshape(data.shape)


def move_signs(data: torch.Tensor) -> torch.Tensor:
    """Each fragment word's sign bits from their nibbles to :data:`SIGN_BIT` (bytes in,
    bytes out; the shape is kept)."""
    return _move_sign_bits(data, _NIBBLE_SIGN, SIGN_BIT)


def restore_signs(data: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`move_signs`."""
    return _move_sign_bits(data, SIGN_BIT, _NIBBLE_SIGN)


def fragment_code(word: int, i: int) -> int:
    """The E2M1 code (sign in bit 3) of nibble ``i`` of a packed fragment word, as the
    decode reads it."""
    return (word >> (4 * i)) & 7 | ((word >> SIGN_BIT[i]) & 1) << 3


# rows packed or unpacked at a time: a few times this many bytes is the transient (the
# model loaders pack every weight on the GPU it lands on; the weight's own size would be)
_CHUNK_BYTES = 1 << 23


def chunk_rows(row_bytes: int) -> int:
    """Rows per chunk: whole 64-row units, about :data:`_CHUNK_BYTES` of them."""
    return max(1, _CHUNK_BYTES // max(1, row_bytes * UNIT_ROWS)) * UNIT_ROWS


def _pack_units(data: torch.Tensor, rows: int) -> torch.Tensor:
    """Plain rows (``[..., n, K/2]``, n <= rows) -> ``rows`` (whole units) in fragment order."""
    *lead, n, half_k = data.shape
    padded = data
    if rows != n:
        padded = torch.zeros((*lead, rows, half_k), dtype=torch.uint8, device=data.device)
        padded[..., :n, :] = data
    units = padded.reshape(*lead, rows // 64, 4, 2, 8, half_k // 32, 4, 2, 4)
    order = units.permute(_lead_perm(len(lead), _TO_PACKED)).reshape(*lead, rows, half_k)
    return move_signs(order)


def _unpack_units(packed: torch.Tensor) -> torch.Tensor:
    """Whole units in fragment order (``[..., rows, K/2]``) -> plain rows."""
    *lead, rows, half_k = packed.shape
    units = restore_signs(packed).reshape(*lead, rows // 64, half_k // 32, 4, 8, 4, 4, 2, 2)
    return units.permute(_lead_perm(len(lead), _TO_PLAIN)).reshape(*lead, rows, half_k)


def pack(data: torch.Tensor) -> torch.Tensor:
    """Plain packed E2M1 bytes ``[N, K/2]`` -> fragment order ``[packed_rows(N), K/2]``
    (an expert stack ``[E, N, K/2]`` -> ``[E, packed_rows(N), K/2]``, each expert packed
    alone). Works through the rows in chunks of whole units (:data:`_CHUNK_BYTES`), so
    beside the input and the result it holds only a chunk's temporaries."""
    if data.dtype != torch.uint8 or data.dim() not in (2, 3):
        raise FormatError(f"data must be uint8 [N, K/2], got {data.dtype} with shape "
                          f"{tuple(data.shape)} (an expert stack is [E, N, K/2])")
    *lead, n, half_k = data.shape
    _check_k(2 * half_k)
    rows = packed_rows(n)
    out = torch.empty((*lead, rows, half_k), dtype=torch.uint8, device=data.device)
    step = chunk_rows(half_k * (lead[0] if lead else 1))
    for r in range(0, rows, step):
        r1 = min(r + step, rows)
        out[..., r:r1, :] = _pack_units(data[..., r:min(r1, n), :], r1 - r)
    return out


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack`: fragment order -> plain ``[n, K/2]`` bytes (``[E, n, K/2]``
    for an expert stack), in chunks of whole units as :func:`pack`."""
    if packed.dtype != torch.uint8 or packed.dim() not in (2, 3):
        raise FormatError(f"packed data must be uint8 [rows, K/2], got {packed.dtype} with "
                          f"shape {tuple(packed.shape)} (an expert stack is [E, rows, K/2])")
    *lead, rows, half_k = packed.shape
    _check_k(2 * half_k)
    if rows != packed_rows(n):
        raise FormatError(f"packed data of {n} rows must have {packed_rows(n)} rows, "
                          f"got {rows}")
    out = torch.empty((*lead, n, half_k), dtype=torch.uint8, device=packed.device)
    step = chunk_rows(half_k * (lead[0] if lead else 1))
    for r in range(0, n, step):
        r1 = min(r + step, rows)
        out[..., r:min(r1, n), :] = _unpack_units(packed[..., r:r1, :])[..., :min(r1, n) - r, :]
    return out


def source_of(t: int, kb: int, j: int) -> tuple[int, int]:
    """(row, packed column) inside a unit of the byte thread ``t`` holds as fragment
    register ``j`` of K block ``kb`` (the layout's definition before the sign bits move,
    for tests and readers)."""
    w, lane = divmod(t, 32)
    g, c = divmod(lane, 4)
    return 16 * w + g + 8 * (j % 2), 8 * kb + c + 4 * (j // 2)


class PackedWeight:
    """A block-scaled weight ``[N, K]`` in fragment order, for ``mainloop=rs_packed`` and
    ``stream`` kernels; its format ``fmt`` is its plain tensor's (the packing moves only the
    E2M1 codes: the scales keep the blocked layout). The formats' own classes are
    :class:`PackedNVFP4Weight` and :class:`PackedMXFP4Weight`.

    Attributes: ``data`` uint8 ``[packed_rows(N), K/2]`` (see the module docstring),
    ``scale`` (the blocked scales, as in the plain tensor), ``global_scale`` (None for a
    format without one), ``shape`` ``(N, K)``. Made once from a plain tensor
    (:meth:`from_tensor`, or :func:`repack`); :meth:`unpack` gives it back, bit for bit.
    With a leading expert mode (from an expert stack, for ``grouped_gemm``): ``data``
    ``[E, packed_rows(N), K/2]``, ``scale`` ``[E, ...]``, ``global_scale`` [E], ``shape``
    ``(E, N, K)``; :meth:`expert` is one expert's packed weight (views).
    """

    tensor_class: type[BlockTensor] = NVFP4Tensor  # the plain tensor's class

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, global_scale, shape):
        if len(shape) not in (2, 3):
            raise FormatError(f"shape must be (N, K) or (E, N, K), got {tuple(shape)}")
        *lead, n, k = shape
        _check_k(k)
        want = (*lead, packed_rows(n), k // 2)
        if data.dtype != torch.uint8 or tuple(data.shape) != want:
            dims = ", ".join(map(str, shape))
            raise FormatError(f"packed data for [{dims}] must be uint8 "
                              f"[{', '.join(map(str, want))}], got {data.dtype} "
                              f"{tuple(data.shape)}")
        self.data, self.scale, self.global_scale = data, scale, global_scale
        self.shape = tuple(shape)

    @property
    def fmt(self):
        """The block format (:class:`~cute_fp4.formats.BlockFormat`)."""
        return self.tensor_class.fmt

    @classmethod
    def from_tensor(cls, w: BlockTensor) -> PackedWeight:
        """Repack a plain weight (its scales and global scale are shared, not copied), in
        the packed class of its format."""
        if not isinstance(w, BlockTensor):
            raise InputTypeError(f"from_tensor() takes an NVFP4Tensor or MXFP4Tensor, got "
                                 f"{type(w).__name__}")
        packed_class = _PACKED_CLASS[type(w)]
        if cls is not PackedWeight and cls is not packed_class:
            raise InputTypeError(f"{cls.__name__}.from_tensor() takes a "
                                 f"{cls.tensor_class.__name__}, got {type(w).__name__}")
        return packed_class(pack(w.data.contiguous()), w.scale, w.global_scale, w.shape)

    def unpack(self) -> BlockTensor:
        """The plain cuBLAS-layout tensor this weight was packed from."""
        n = self.shape[-2]
        return self.tensor_class._checked(unpack(self.data, n), self.scale, self.global_scale,
                                          self.shape)

    @property
    def experts(self) -> int | None:
        """E for a weight with a leading expert mode, None for a 2-D one."""
        return self.shape[0] if len(self.shape) == 3 else None

    def expert(self, e: int) -> PackedWeight:
        """Expert ``e`` of a packed expert stack as a 2-D packed weight (views, no copies)."""
        i = expert_index(self.shape, e, "a weight", "[E, N, K]")
        gs = None if self.global_scale is None else self.global_scale[i]
        return type(self)(self.data[i], self.scale[i], gs, self.shape[1:])

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device) -> PackedWeight:
        gs = None if self.global_scale is None else self.global_scale.to(device)
        return type(self)(self.data.to(device), self.scale.to(device), gs, self.shape)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, device={self.device})"


class PackedNVFP4Weight(PackedWeight):
    """An NVFP4 weight in fragment order (:class:`PackedWeight`; UE4M3 scales, a global
    scale)."""

    tensor_class = NVFP4Tensor


class PackedMXFP4Weight(PackedWeight):
    """An MXFP4 weight in fragment order (:class:`PackedWeight`; UE8M0 scales per 32, no
    global scale: ``global_scale`` is None)."""

    tensor_class = MXFP4Tensor


_PACKED_CLASS = {NVFP4Tensor: PackedNVFP4Weight, MXFP4Tensor: PackedMXFP4Weight}


def tensor_class(fmt) -> type[BlockTensor]:
    """The plain tensor class of a block format (a BlockFormat or its name)."""
    from cute_fp4.formats import get_format

    fmt = get_format(fmt)
    return next(c for c in _PACKED_CLASS if c.fmt is fmt)


def packed_class(fmt) -> type[PackedWeight]:
    """The packed weight class of a block format (a BlockFormat or its name)."""
    return _PACKED_CLASS[tensor_class(fmt)]


def repack(w: BlockTensor) -> PackedWeight:
    """The function ``cute_fp4.nn`` (or any caller) uses once per weight: ``w`` in fragment
    order for the ``rs_packed`` and ``stream`` kernels (an expert stack: every expert, for
    the grouped ones), a :class:`PackedNVFP4Weight` or :class:`PackedMXFP4Weight` by its
    format. Raises FormatError when K is not a multiple of 64."""
    return PackedWeight.from_tensor(w)


__all__ = ["SIGN_BIT", "UNIT_BYTES", "UNIT_K", "UNIT_ROWS", "PackedMXFP4Weight",
           "PackedNVFP4Weight", "PackedWeight", "chunk_rows", "fragment_code", "move_signs",
           "pack", "packed_class", "packed_rows", "repack", "restore_signs", "source_of",
           "tensor_class", "unpack"]
