"""NVFP4 ``[M, K]`` (packed E2M1 codes + UE4M3 scales in the 128x4 layout) -> its exact
BF16 block values ``e2m1 * block_scale`` (no global scale), in one pass.

What it is for: Hopper has no FP4 tensor cores, so a W4A4 GEMM decodes both operands to
16-bit values anyway. Decoding the activation once into BF16 and running the W4A16 kernel
(the global scales go to alpha) is exact and, with this kernel, costs one pass over the
activation: ``cute_fp4.quant.dequantize_activation``.

Exactness: ``e2m1 * scale`` has at most 2 + 4 significant bits and lies in
``[2^-10, 6 * 448]``, so it is a normal BF16 number and every step below is exact. A code's
magnitude bits go to float32 bits 22-24 (the value times ``2^-126``, subnormal for code 1),
its sign to bit 31; one multiply by ``2^126`` gives the value (no flush to zero: ``mul.rn``
without ``.ftz``), one by the scale (decoded by ``cvt.rn.f16x2.e4m3x2``) the product, and
``cvt.rn.bf16x2.f32`` packs two of them.

Alpha: with ``write_alpha`` set, thread 0 also stores ``ga * gb`` (``mul.rn.f32``: the
float32 product torch computes) of two global scales, so a W4A4 product through the W4A16
kernel needs no separate multiply launch.

Work split: one thread per 16-element block: one 8-byte load of codes, one scale byte
read from the blocked layout (:func:`cute_fp4.formats.sf_offset`), two 16-byte stores.
Consecutive threads own consecutive blocks of a row, so a warp reads 256 contiguous bytes
and writes 1,024.

Constraints (checked by the host layer, ``cute_fp4.quant``): K a multiple of 16, codes
8-byte aligned, output 16-byte aligned, ``M * K < 2^31``.
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_ptr

from cute_fp4.formats import NVFP4, sf_offset_shifts
from cute_fp4.kernels import roles

_GMEM = cute.AddressSpace.gmem
_U32 = cutlass.Uint32
_I32 = cutlass.Int32


@dataclasses.dataclass(frozen=True)
class DequantSpec:
    """Static choices of one compiled dequantization kernel."""

    target: str = "sm_90a"
    threads: int = 256  # per CTA; one 16-element block per thread

    def __post_init__(self):
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"threads must be a multiple of 32 in 32..1024, got {self.threads}")

    def label(self) -> str:
        return f"dequantize-bf16-t{self.threads}@{self.target}"


def _element_lines(word: str, i: int, dst: str) -> list[str]:
    """Float32 bits of element ``i`` (nibble ``i``) of ``word`` times 2^-126 -> ``dst``."""
    shift = 22 - 4 * i
    mag = f"shl.b32 {dst}, {word}, {shift};" if shift >= 0 else \
        f"shr.u32 {dst}, {word}, {-shift};"
    return [mag, f"and.b32 {dst}, {dst}, 0x01C00000;",
            f"shl.b32 sg, {word}, {28 - 4 * i};",
            f"lop3.b32 {dst}, {dst}, sg, 0x80000000, 0xF8;"]  # dst | (sg & 2^31)


def block_ptx() -> str:
    """PTX of one block: codes ``{$r0}``, ``{$r1}`` (elements 0-7, 8-15, low nibble first)
    and the scale byte ``{$r2}`` -> eight BF16x2 words ``{$w0}..{$w7}`` (elements 2j, 2j + 1
    in word j, the even one in the low half)."""
    body = ["{", ".reg .b32 t, sg, lo, hi;", ".reg .b16 s16, hl, hh;", ".reg .f32 sc, a, b;",
            "cvt.u16.u32 s16, {$r2};", "cvt.rn.f16x2.e4m3x2 t, s16;",
            "mov.b32 {hl, hh}, t;", "cvt.f32.f16 sc, hl;"]
    for j in range(8):
        word = "{$r0}" if j < 4 else "{$r1}"
        i = 2 * (j % 4)
        body += _element_lines(word, i, "lo") + _element_lines(word, i + 1, "hi")
        body += ["mul.rn.f32 a, lo, 0f7E800000;", "mul.rn.f32 a, a, sc;",  # * 2^126 * s
                 "mul.rn.f32 b, hi, 0f7E800000;", "mul.rn.f32 b, b, sc;",
                 f"cvt.rn.bf16x2.f32 {{$w{j}}}, b, a;"]
    body.append("}")
    return "\n".join(body)


class DequantizeKernel:
    """NVFP4 -> BF16 block values; see the module docstring.

    Entry point ``(pQ, pSF, pOut, pGA, pGB, pAlpha, m, k, write_alpha, stream)``: packed
    codes (uint8 [M, K/2] as 32-bit words), blocked scales (uint8), the BF16 output (as
    32-bit words, [M, K]), two float32 global scales and where their product goes (read
    and written only when ``write_alpha`` is 1; else any float32 pointer), M, K.
    """

    def __init__(self, spec: DequantSpec):
        self.spec = spec
        self.threads = spec.threads
        self._ptx = block_ptx()

    def fake_args(self) -> tuple:
        from cutlass.cute.runtime import make_fake_stream

        f32 = [make_ptr(cutlass.Float32, 0, _GMEM, assumed_align=4) for _ in range(3)]
        return (make_ptr(_U32, 0, _GMEM, assumed_align=8),
                make_ptr(cutlass.Uint8, 0, _GMEM, assumed_align=16),
                make_ptr(_U32, 0, _GMEM, assumed_align=16), *f32,
                _I32(0), _I32(0), _I32(0), make_fake_stream())

    def runtime_args(self, q, sf, out, scales, stream) -> tuple:
        """The entry point's arguments from checked torch tensors: ``q`` uint8 [M, K/2],
        ``sf`` the blocked scales, ``out`` bf16 [M, K], ``scales`` None or (ga, gb, alpha)
        float32 tensors of one element."""
        return self._args(q, sf, out, scales, stream,
                          lambda dt, t, a: make_ptr(dt, t.data_ptr(), _GMEM, assumed_align=a),
                          _I32)

    def raw_args(self, q, sf, out, scales, stream: int) -> tuple:
        """:meth:`runtime_args` as plain ints, for a kernel compiled with
        ``--enable-tvm-ffi``."""
        return self._args(q, sf, out, scales, stream, lambda dt, t, a: t.data_ptr(), int)

    @staticmethod
    def _args(q, sf, out, scales, stream, ptr, num) -> tuple:
        m, k = out.shape
        f32 = scales or (out, out, out)  # never read without write_alpha
        return (ptr(_U32, q, 8), ptr(cutlass.Uint8, sf, 16), ptr(_U32, out, 16),
                *(ptr(cutlass.Float32, t, 4) for t in f32), num(m), num(k),
                num(int(scales is not None)), stream)

    @cute.jit
    def __call__(self, pQ: cute.Pointer, pSF: cute.Pointer, pOut: cute.Pointer,
                 pGA: cute.Pointer, pGB: cute.Pointer, pAlpha: cute.Pointer,
                 m: cutlass.Int32, k: cutlass.Int32, write_alpha: cutlass.Int32,
                 stream: cuda.CUstream):
        kk = cute.assume(k, divby=NVFP4.block)
        kb = kk // NVFP4.block
        kbp = (kb + 3) // 4 * 4
        mp = (m + 127) // 128 * 128
        n_blocks = m * kb
        mQ = cute.make_tensor(pQ, cute.make_layout((cute.assume(n_blocks * 2, divby=2),)))
        mSF = cute.make_tensor(pSF, cute.make_layout((cute.assume(mp * kbp, divby=512),)))
        mO = cute.make_tensor(pOut, cute.make_layout((cute.assume(n_blocks * 8, divby=8),)))
        mG = [cute.make_tensor(p, cute.make_layout((1,))) for p in (pGA, pGB, pAlpha)]
        fdd = cute.fast_divmod_create_divisor_v2(kb)
        t = self.threads
        self.kernel(mQ, mSF, mO, *mG, n_blocks, kbp, write_alpha, fdd).launch(
            grid=[(n_blocks + t - 1) // t, 1, 1], block=[t, 1, 1], stream=stream,
            use_pdl=roles.PDL)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mSF: cute.Tensor, mO: cute.Tensor, mGA: cute.Tensor,
               mGB: cute.Tensor, mAlpha: cute.Tensor, n_blocks: cutlass.Int32,
               kbp: cutlass.Int32, write_alpha: cutlass.Int32, fdd: cute.FastDivmodDivisorV2):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        roles.wait_for_inputs()
        roles.release_dependents()  # the GEMM that reads this output launches during it
        g = bid * self.threads + tidx
        if (g == 0) & (write_alpha != 0):
            mAlpha[0] = cute.arch.inline_ptx("mul.rn.f32 {$w0}, {$r0}, {$r1};",
                                             write_only_types=[cutlass.Float32],
                                             read_only_args=[mGA[0], mGB[0]])
        if g < n_blocks:
            r, c = divmod(g, fdd)
            off = sf_offset_shifts(r, c, kbp)
            rQ = cute.make_rmem_tensor((2,), _U32)
            cute.autovec_copy(cute.local_tile(mQ, (2,), (g,)), rQ)
            sf = _U32(mSF[off])
            words = cute.arch.inline_ptx(self._ptx, write_only_types=[_U32] * 8,
                                         read_only_args=[rQ[0], rQ[1], sf])
            rO = cute.make_rmem_tensor((8,), _U32)
            for i in cutlass.range_constexpr(8):
                rO[i] = words[i]
            for h in cutlass.range_constexpr(2):
                cute.autovec_copy(cute.local_tile(rO, (4,), (h,)),
                                  cute.local_tile(mO, (4,), (g * 2 + h,)))


__all__ = ["DequantSpec", "DequantizeKernel", "block_ptx"]
