"""In-kernel NVFP4 -> 16-bit conversion for the SM90 GEMM (shared memory to shared memory).

SM90 has no FP4 tensor cores, so each consumer thread turns 16 packed E2M1 elements (one
scale-factor block: 8 bytes) into 16 FP16 or BF16 values and stores them, 32 bytes, into the
128-byte-swizzled K-major buffer that WGMMA reads.

The arithmetic, exact for every E2M1 x UE4M3 pair:
* E2M1 nibble ``s e1 e0 m`` placed at FP16 bits 15 and 11..9 is the FP16 number ``v * 2^-14``
  (code 1, 0.5, becomes the FP16 subnormal 2^-15; FP16 arithmetic keeps subnormals).
* The UE4M3 scale byte shifted left by 7 is the FP16 number ``s * 2^-8``; one HMUL2 by 2^15
  gives ``S = s * 2^7`` (at most 448 * 128 = 57,344 < 65,504).
* ``v * 2^-14 * S = v * s * 2^-7``, exact in FP16 (6 significant bits, at least 2^-17).
  The GEMM therefore accumulates ``2^-7`` per converted operand; the epilogue multiplies by
  ``2^7`` (W4A16) or ``2^14`` (W4A4), which is exact.
* For BF16 (W4A16 with a BF16 activation) the FP16 product is widened to FP32 and rounded to
  BF16, both exact.

Per 8 elements: one PRMT, two shifts, one LOP3 and one HMUL2 per output word after two
shared LOP3/SHF; about 3 instructions per element (FP16), 5 (BF16).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

# Byte selectors: word j takes the low nibbles of byte j (from qe) into byte 0 and the
# high nibbles of byte j (from qo) into byte 2; bytes 1 and 3 are don't-care copies.
SELECT = (0x4400, 0x5511, 0x6622, 0x7733)

FP4_MASK = 0x8E008E00  # sign bit 15 and magnitude bits 11..9 of each FP16 half


def scaled_out(out: str, scale: str, bf16: bool) -> list[str]:
    """PTX lines: the FP16x2 word ``t`` (E2M1 bits in place) times the scale word ``scale``
    into ``out``, as FP16x2, or widened to FP32 and rounded to BF16x2 (both exact); uses
    the registers ``hl``, ``hh`` (b16) and ``fl``, ``fh`` (f32) for BF16."""
    if not bf16:
        return [f"mul.rn.f16x2 {out}, t, {scale};"]
    return [f"mul.rn.f16x2 t, t, {scale};", "mov.b32 {hl, hh}, t;", "cvt.f32.f16 fl, hl;",
            "cvt.f32.f16 fh, hh;", f"cvt.rn.bf16x2.f32 {out}, fh, fl;"]


def _word_ptx(j: int, out: str, bf16: bool) -> str:
    lines = [
        f"prmt.b32 w, qe, qo, {SELECT[j]:#x};",
        "shl.b32 t, w, 9;",
        "shl.b32 u, w, 12;",
        "or.b32 t, t, u;",
        f"and.b32 t, t, {FP4_MASK:#x};",
    ]
    return "\n".join(lines + scaled_out(out, "{$r1}", bf16))


def _convert_ptx(bf16: bool) -> str:
    body = [
        "{",
        ".reg .b32 qe, qo, w, t, u;",
        ".reg .b16 hl, hh;",
        ".reg .f32 fl, fh;",
        "and.b32 qe, {$r0}, 0x0F0F0F0F;",
        "shr.u32 qo, {$r0}, 4;",
        "and.b32 qo, qo, 0x0F0F0F0F;",
    ]
    for j in range(4):
        body.append(_word_ptx(j, "{$w" + str(j) + "}", bf16))
    body.append("}")
    return "\n".join(body)


_PTX_F16 = _convert_ptx(False)
_PTX_BF16 = _convert_ptx(True)

_SCALE_PTX = "\n".join([
    "{",
    ".reg .b32 t, c;",
    "and.b32 t, {$r0}, 0x7F;",
    "mul.lo.u32 t, t, 0x00800080;",
    "mov.b32 c, 0x78007800;",
    "mul.rn.f16x2 {$w0}, t, c;",
    "}",
])


def scale_word(sf: cutlass.Uint8) -> cutlass.Uint32:
    """UE4M3 scale byte -> FP16x2 word holding ``s * 2^7`` in both halves."""
    return cute.arch.inline_ptx(
        _SCALE_PTX,
        write_only_types=[cutlass.Uint32],
        read_only_args=[cutlass.Uint32(sf)],
    )


def convert_word(q: cutlass.Uint32, scale: cutlass.Uint32, bf16: bool):
    """8 packed E2M1 elements (one uint32, element 0 in the low nibble) times the scale
    word -> four 32-bit words of two 16-bit values each (``v * s * 2^-7``)."""
    return cute.arch.inline_ptx(
        _PTX_BF16 if bf16 else _PTX_F16,
        write_only_types=[cutlass.Uint32] * 4,
        read_only_args=[q, scale],
    )


def _pair_ptx(bf16: bool) -> str:
    """q (8 E2M1 nibbles) x scale -> 4 words; word i = (nibble i, nibble i + 4)."""
    body = ["{", ".reg .b32 x, t, y;", ".reg .b16 hl, hh;", ".reg .f32 fl, fh;"]
    for i in range(4):
        sh = 12 - 4 * i
        body.append(f"shl.b32 x, {{$r0}}, {sh};" if sh else "mov.b32 x, {$r0};")
        body += ["and.b32 t, x, 0x80008000;", "shr.u32 y, x, 3;",
                 "and.b32 y, y, 0x0E000E00;", "or.b32 t, t, y;"]
        out = "{$w" + str(i) + "}"
        body += scaled_out(out, "{$r1}", bf16)
    body.append("}")
    return "\n".join(body)


_PAIR_F16 = _pair_ptx(False)
_PAIR_BF16 = _pair_ptx(True)


def convert_pairs(q, scale, bf16: bool):
    """8 packed E2M1 elements x the scale word -> four words, word ``i`` pairing elements
    ``i`` and ``i + 4`` (the K order of the register-sourced mainloop, sm90_rs.py)."""
    return cute.arch.inline_ptx(
        _PAIR_BF16 if bf16 else _PAIR_F16,
        write_only_types=[cutlass.Uint32] * 4,
        read_only_args=[q, scale],
    )


def permute_bytes(a, b, sel: int):
    """``prmt.b32``: four bytes picked from ``a:b`` by the selector nibbles of ``sel``."""
    return cute.arch.inline_ptx(
        f"prmt.b32 {{$w0}}, {{$r0}}, {{$r1}}, {sel:#x};",
        write_only_types=[cutlass.Uint32],
        read_only_args=[a, b],
    )
