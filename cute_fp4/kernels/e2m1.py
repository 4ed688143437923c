"""PTX text of the E2M1 encode by one float add, shared by the activation quantizer
(kernels/quantize.py) and the NVFP4 epilogue (kernels/epilogue.py), so both round with the
same instructions.

E2M1 by one float add: M2(em) = 2^(em - 105) + (2 em - 254) ulps (em = max(exponent(q),
127)) has a grid of 2^(em - 128) (the E2M1 spacing of q's binade) and a mantissa offset of
2 (em - 127), so RN(q + M2) = M2 + n ulps with n = RNE(q / spacing): its mantissa field is
the code n + 2 (em - 127) (offset even: ties keep E2M1's even codes). Bits of M2: em *
(2^23 + 2) + M2_BIAS.
"""

from __future__ import annotations

M2_BIAS = (22 << 23) - 254


def m2_sum(q: str) -> list[str]:
    """``fm = RN(q + M2(em))`` and ``mg`` = M2's bits, for ``0 <= q <= 6.5`` (registers
    ``ex``, ``em``, ``mg``, ``fm`` declared by the caller)."""
    return [f"shr.u32 ex, {q}, 23;", "max.u32 em, ex, 127;",
            f"mad.lo.u32 mg, em, 0x800002, {M2_BIAS:#x};", f"add.rn.f32 fm, {q}, mg;"]


__all__ = ["M2_BIAS", "m2_sum"]
