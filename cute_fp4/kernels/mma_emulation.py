"""Exact emulation of SM120's block-scaled FP4 MMA on SM90, for running the SM120 kernel on
an H200 (``Sm120Gemm(..., emulate=True)``, ``cute_fp4.compile.compile_emulated``).

One ``mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X.f32.e2m1
.e2m1.f32.ue4m3`` (SASS ``OMMA.SF``) becomes four ``mma.sync.aligned.m16n8k16.row.col.f32
.bf16.bf16.f32`` (SASS ``HMMA.16816.F32.BF16``) on the very registers the OMMA would read:

* Every E2M1 x UE4M3 product is exact in BF16 (at most 6 significant bits, magnitudes
  2^-10 .. 2688), and BF16 x BF16 products are exact in FP32, so the emulation equals the
  block-scaled MMA up to the FP32 summation order.
* K order. FP4 A registers (PTX ISA, m16n8k64 ``.e2m1``; groupID g = lane / 4, t = lane % 4)
  hold 8 nibbles each: a0 row g and a1 row g+8 at K = 8t + j, a2 row g and a3 row g+8 at
  K = 32 + 8t + j (j = 0..7); B b0 at K = 8t + j, b1 at 32 + 8t + j, column g. BF16
  m16n8k16 registers hold 2 elements: A reg0 (row g) / reg1 (row g+8) at K' = 2t + i, reg2 /
  reg3 at K' = 8 + 2t + i (i = 0, 1); B reg0 at K' = 2t + i, reg1 at 8 + 2t + i. Sub-MMA s
  (0..3) feeds BF16 register r with nibbles 2s, 2s+1 of FP4 register r, for A and for B:
  K' = 2t + i is K = 8t + 2s + i and K' = 8 + 2t + i is K = 32 + 8t + 2s + i, the same
  bijection in every lane and for both operands, and the four sub-MMAs cover K = 0..63
  once. Rows, columns and the FP32 C/D fragment are those of the OMMA.
* Scales (``scale_vec::4X``, thread-id-a = thread-id-b = 0 as the kernel issues it): the
  OMMA reads the A scale register of lane 4g (row g) and of lane 4g+1 (row g+8), the B
  one of lane 4g (column g); byte j is the scale of K block j (16 elements). So FP4
  register r is scaled by byte ``t // 2 + 2 * (r // 2)`` (A) / ``t // 2 + 2 * r`` (B) of
  the register shuffled from lane ``4g + r % 2`` (A) / ``4g`` (B): :func:`sf_source` and
  :func:`sf_byte`, plain integer functions the kernel and the CPU tests share
  (``cute_fp4/kernels/sf_layout.py`` ``mma_sf_fragment`` has the ISA table;
  tests/test_mma_emulation.py checks this derivation against an independent ISA model,
  with the PTX here run by a small interpreter).
* Conversion, per FP4 register and scale byte (:data:`CONVERT_PTX`): the nibble ``s e1 e0 m``
  at FP16 bits 15 and 11..9 is ``v * 2^-14``; times 2^14 it is ``v``; the scale byte at FP16
  bits 13..7 is ``s * 2^-8``, times 2^8 it is ``s``; ``v * s`` in FP16 is exact (>= 2^-10,
  normal), widened to FP32 and rounded to BF16, exact again. FP16 arithmetic keeps
  subnormals (no ``.ftz``). The scale byte's bit 7 is ignored (UE4M3 has no sign). About 14
  instructions per pair of elements: the emulation is for checking, not speed (the
  pingpong build, 128 accumulators per thread, spills).

What an emulated run checks: everything of the SM120 kernel but the MMA instruction (TMA
descriptors and boxes, barriers and their phases, the stage ring, ldmatrix addresses and
swizzle, scale copies, the tile scheduler, pingpong turns, setmaxnreg, split-K, the
epilogue and its stores, hangs). What it does not check: the OMMA itself (its operand and
scale model is the CPU trace, tests/sm120_mainloop_trace.py), the sm_120a binary's own
register allocation and scheduling (sm_90a is compiled separately), and the 99 KiB shared
memory limit of SM120 (the H200 allows 227 KiB; ``plan()`` and the compile checks cover it).

The SM120 MMA atom (:class:`LayoutMXF4NVF4Op`) is still built, for its thread-value layouts
(fragments, ldmatrix and scale copies, the accumulator): the DSL only admits it on SM12x,
so the emulated build uses a subclass that also admits sm_90a and never issues its MMA.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import base_dsl
from cutlass.cute.nvgpu import warp

from cute_fp4.formats import MMA_K, NVFP4, BlockFormat

SUB_MMAS = 4  # m16n8k16 BF16 MMAs per m16n8k64 block-scaled MMA
REGS = {"A": 4, "B": 2}  # 32-bit FP4 registers per lane and MMA


class LayoutMXF4NVF4Op(warp.MmaMXF4NVF4Op):
    """The SM120 block-scaled atom, admitted on sm_90a too, used only for its layouts.

    Its MMA is never issued: an emulated kernel's ``mma_k_block`` calls :func:`mma_k_block`
    here instead of ``cute.gemm``. Issuing it on sm_90a would fail in the compiler.
    """

    admissible_archs = [*warp.MmaMXF4NVF4Op.admissible_archs, base_dsl.Arch.sm_90a]


class LayoutMXF4Op(warp.MmaMXF4Op):
    """:class:`LayoutMXF4NVF4Op` for MXFP4's ``kind::mxf4`` (UE8M0 scales per 32)."""

    admissible_archs = [*warp.MmaMXF4Op.admissible_archs, base_dsl.Arch.sm_90a]


# ----------------------------------------------------------------------------- lane tables
# Plain integer arithmetic: the kernel calls these with the DSL lane index, the CPU tests
# with Python ints.

def sf_source(lane, operand: str, reg: int):
    """Lane whose scale register the OMMA reads for FP4 register ``reg`` of ``lane``."""
    quad = lane - lane % 4
    return quad + (reg % 2 if operand == "A" else 0)


def sf_byte(lane, operand: str, reg: int, block: int = NVFP4.block):
    """Byte (``block``-element K block) of that scale register for FP4 register ``reg``:
    the register's K ``8 (lane % 4) + j`` (+ 32 for the upper half) over the block."""
    upper = reg // 2 if operand == "A" else reg  # K 32..63 of the MMA
    if block == NVFP4.block:
        return lane % 4 // 2 + 2 * upper
    return 8 * (lane % 4) // block + (32 // block) * upper


# ----------------------------------------------------------------------------- PTX

def _pair_ptx(j: int, out: str) -> list[str]:
    """Nibbles 2j (low half) and 2j+1 (high half) of ``q`` -> BF16x2 ``out`` (x scale)."""
    lo = f"shl.b32 lo, {{$r0}}, {12 - 8 * j};" if j < 2 else \
        f"shr.b32 lo, {{$r0}}, {8 * j - 12};"
    hi = f"shl.b32 hi, {{$r0}}, {24 - 8 * j};" if j < 3 else "mov.b32 hi, {$r0};"
    return [
        lo, hi,
        "and.b32 lo, lo, 0x0000F000;",  # nibble 2j at bits 15..12
        "and.b32 hi, hi, 0xF0000000;",  # nibble 2j+1 at bits 31..28
        "or.b32 x, lo, hi;",
        "and.b32 sg, x, 0x80008000;",  # signs to bits 15 / 31
        "shr.b32 mg, x, 3;",
        "and.b32 mg, mg, 0x0E000E00;",  # e1 e0 m to bits 11..9 / 27..25
        "or.b32 x, sg, mg;",  # FP16x2 (v * 2^-14)
        "mul.rn.f16x2 x, x, c;",  # (v)
        "mul.rn.f16x2 x, x, s;",  # (v * s), exact
        "mov.b32 {h0, h1}, x;",
        "cvt.f32.f16 f0, h0;",
        "cvt.f32.f16 f1, h1;",
        f"cvt.rn.bf16x2.f32 {out}, f1, f0;",
    ]


def _convert_ptx() -> str:
    body = [
        "{",
        ".reg .b32 s, c, x, lo, hi, sg, mg;",
        ".reg .b16 h0, h1;",
        ".reg .f32 f0, f1;",
        "shl.b32 x, {$r2}, 3;",
        "shr.b32 s, {$r1}, x;",  # scale byte {$r2} of the scale word
        "and.b32 s, s, 0x7F;",
        "mul.lo.u32 s, s, 0x00800080;",  # FP16x2 (s * 2^-8)
        "mov.b32 c, 0x5C005C00;",
        "mul.rn.f16x2 s, s, c;",  # (s)
        "mov.b32 c, 0x74007400;",  # (2^14)
    ]
    for j in range(SUB_MMAS):
        body += _pair_ptx(j, "{$w" + str(j) + "}")
    body.append("}")
    return "\n".join(body)


CONVERT_PTX = _convert_ptx()
"""``{$r0}`` 8 E2M1 nibbles, ``{$r1}`` a UE4M3 scale register, ``{$r2}`` the byte of it to
use -> ``{$w0..3}``: word s holds nibbles 2s, 2s+1 times the scale, as BF16x2 (low half =
lower K)."""


def _ue8m0_pair_ptx(j: int, out: str) -> list[str]:
    """Nibbles 2j, 2j+1 -> BF16x2 ``out``: the magnitude bits ``e1 e0 m`` at BF16 bits 8..6
    are the BF16 number ``v * 2^-126`` (subnormal for codes 0, 1), times 2^125 it is ``v /
    2``, times the scale word ``2^(e - 126)`` it is ``v * 2^(e - 127)``, each product
    exact (a BF16 number for every scale code up to 252)."""
    return [*_pair_ptx(j, out)[:5],  # the nibbles at bits 15..12 / 31..28 in x
            "and.b32 sg, x, 0x80008000;", "shr.b32 mg, x, 6;",
            "and.b32 mg, mg, 0x01C001C0;", "or.b32 x, sg, mg;",  # BF16x2 (v * 2^-126)
            "mul.rn.bf16x2 x, x, c;",  # (v / 2)
            f"mul.rn.bf16x2 {out}, x, s;"]  # (v * 2^(e - 127)), exact


def _convert_ue8m0_ptx() -> str:
    body = ["{", ".reg .b32 s, c, x, lo, hi, sg, mg;",
            "shl.b32 x, {$r2}, 3;", "shr.b32 s, {$r1}, x;",  # scale byte {$r2}
            "and.b32 s, s, 0xFF;", "add.u32 s, s, 1;",
            "mul.lo.u32 s, s, 0x00800080;",  # BF16x2 (2^(e - 126))
            "mov.b32 c, 0x7E007E00;"]  # BF16x2 (2^125)
    for j in range(SUB_MMAS):
        body += _ue8m0_pair_ptx(j, "{$w" + str(j) + "}")
    body.append("}")
    return "\n".join(body)


CONVERT_UE8M0_PTX = _convert_ue8m0_ptx()
""":data:`CONVERT_PTX` for a UE8M0 scale register (MXFP4, ``kind::mxf4``)."""

# the conversion of each scale type
CONVERTS = {"ue4m3": CONVERT_PTX, "ue8m0": CONVERT_UE8M0_PTX}


def _operands(prefix: str, first: int, count: int) -> str:
    return "{" + ", ".join("{$" + f"{prefix}{i}" + "}" for i in range(first, first + count)) + "}"


HMMA_PTX = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            f"{_operands('w', 0, 4)}, {_operands('r', 0, 4)}, {_operands('r', 4, 2)}, "
            f"{_operands('r', 6, 4)};")


# ----------------------------------------------------------------------------- DSL

def _convert(q, scale, byte, fmt: BlockFormat):
    return cute.arch.inline_ptx(CONVERTS[fmt.scale.name],
                                write_only_types=[cutlass.Uint32] * SUB_MMAS,
                                read_only_args=[q, scale, byte])


def _hmma(a, b, c):
    return cute.arch.inline_ptx(HMMA_PTX, write_only_types=[cutlass.Float32] * 4,
                                read_only_args=[*a, *b, *c])


@cute.jit
def _scale_word(sf, block: cutlass.Constexpr):
    """The 32-bit scale register of one MMA: byte j = scale of K block j (value block x j)."""
    sf8 = cute.recast_tensor(sf, cutlass.Uint8)
    word = cutlass.Uint32(sf8[0])
    for j in cutlass.range_constexpr(1, MMA_K // block):
        word = word | (cutlass.Uint32(sf8[block * j]) << (8 * j))
    return word


def fp4_registers(frag, operand: str):
    """One MMA's FP4 fragment ``frag`` (A: 32 values, B: 16) as the 32-bit registers the
    block-scaled MMA reads: value ``i`` must be nibble ``i % 8`` of register ``i // 8``."""
    flat = cute.coalesce(frag.layout)
    regs = REGS[operand]
    if flat.shape != 8 * regs or flat.stride != 1:
        raise AssertionError(f"{operand} fragment {frag.layout}: expected {8 * regs} "
                             f"consecutive values")
    return cute.recast_tensor(frag, cutlass.Uint32)


@cute.jit
def _operand_words(frag, sf, lane, operand: cutlass.Constexpr, fmt: cutlass.Constexpr,
                   word=None, byte_id: cutlass.Constexpr = 0):
    """BF16 registers of the 4 sub-MMAs, ``[s][r]``, from one MMA's FP4 fragment ``frag``
    (32 or 16 values) and scale fragment ``sf`` (64 values) of this lane; or, with ``word``
    (paired scales, ``Sm120Mainloop._paired_scales``), from that whole scale word with the
    MMA's selector ``byte_id``: bytes ``byte_id``, ``byte_id + 1`` are the K block's."""
    regs = REGS[operand]
    q = fp4_registers(frag, operand)
    if cutlass.const_expr(word is None):
        word = _scale_word(sf, fmt.block)
    # one shuffle per distinct source lane: A registers r and r + 2 share row g + 8 (r % 2)
    sources = [cute.arch.shuffle_sync(word, sf_source(lane, operand, r))
               for r in range(2 if operand == "A" else 1)]
    out = [[None] * regs for _ in range(SUB_MMAS)]
    for r in cutlass.range_constexpr(regs):
        ws = _convert(q[r], sources[r % len(sources)],
                      cutlass.Uint32(byte_id + sf_byte(lane, operand, r, fmt.block)), fmt)
        for s in cutlass.range_constexpr(SUB_MMAS):
            out[s][r] = ws[s]
    return out


@cute.jit
def mma_k_block(tCrA, tCrSFA, tCrB, tCrSFB, acc, fmt: cutlass.Constexpr, words=None,
                byte_id: cutlass.Constexpr = 0):
    """The MMAs of one 64-wide K block, emulated: ``acc += A x B`` block-scaled.

    ``tCrA`` (values, MMA rows), ``tCrB`` (values, MMA columns), ``tCrSFA``/``tCrSFB``
    (64 values, rows / columns) are one K block of the kernel's fragments (``MmaFragments``
    sliced at ``kb``), ``acc`` (4, rows, columns) the FP32 accumulator. Paired scales
    (``Sm120Mainloop._paired_scales``): ``words`` the scale words ``(per row, per column)``
    and ``byte_id`` the selector the native MMA is issued with, in place of the scale
    fragments. Must be issued by the whole warp (shuffles and ``mma.sync``)."""
    lane = cute.arch.lane_idx()
    n_m = cute.size(tCrA, mode=[1])
    n_n = cute.size(tCrB, mode=[1])
    paired = words is not None
    for mi in cutlass.range_constexpr(n_m):
        a = _operand_words(tCrA[None, mi], None if paired else tCrSFA[None, mi], lane, "A",
                           fmt, words[0][mi] if paired else None, byte_id)
        for ni in cutlass.range_constexpr(n_n):
            b = _operand_words(tCrB[None, ni], None if paired else tCrSFB[None, ni], lane,
                               "B", fmt, words[1][ni] if paired else None, byte_id)
            c = [acc[i, mi, ni] for i in range(4)]
            for s in cutlass.range_constexpr(SUB_MMAS):
                c = _hmma(a[s], b[s], c)
            for i in cutlass.range_constexpr(4):
                acc[i, mi, ni] = c[i]


__all__ = ["CONVERTS", "CONVERT_PTX", "CONVERT_UE8M0_PTX", "HMMA_PTX", "LayoutMXF4NVF4Op",
           "fp4_registers",
           "LayoutMXF4Op", "REGS", "SUB_MMAS", "mma_k_block",
           "sf_byte", "sf_source"]
