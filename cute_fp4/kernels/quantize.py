"""Fused activation quantization: BF16/FP16 ``[M, K]`` -> NVFP4 (packed E2M1 + UE4M3 scales).

Bit-identical to :func:`cute_fp4.nvfp4.quantize` (CPU or CUDA) with the same global
scale (``gs``, the decode form ``amax / 2688``), per 16-element block::

    bamax = max |x|                              (exact)
    t     = bamax * fl32(1/6)                    (nvfp4's rule on every device: a product
                                                  with float32(1/6), never a division)
    sf    = e4m3_rne(min(t / gs, 448)); sf = 2^-9 if sf == 0 and bamax > 0
    d     = sf * gs                              (float32)
    code  = e2m1_rne(x / d) (saturating), sign = x / d < 0; all codes 0 when d == 0

Work split. One thread owns whole 16-element blocks ("items", ``QuantSpec.items`` of them,
``threads`` apart so that a warp's accesses are consecutive): two 16-byte loads straight
into registers, one 8-byte store of packed codes, one scale byte written straight into the
128x4 blocked layout (:func:`cute_fp4.nvfp4.scale_offset`). ``ctas_per_sm = 0``: one CTA
per chunk of ``threads * items`` blocks, one register set (42 registers at 2 items), so
many CTAs fit per SM and their loads overlap each other's arithmetic. Otherwise a
persistent grid of ``ctas_per_sm`` CTAs per SM loops over the chunks with two register
sets in turn, chunk i + 1's loads in flight while chunk i computes. (An earlier version
staged the input through shared memory by cp.async: 25.2 us against 14.6 us for this one
on 4096^2 BF16 on an H200, its MIO queue the top stall.)

Item order (``QuantSpec.order``):
* ``"atoms"``: item g writes scale byte g of the padded scale buffer, so a warp writes one
  whole 32-byte sector of a 512-byte atom, reads 8 rows x 128 bytes and writes 8 rows x 32
  bytes of codes; items of padding rows or columns write their zero scale byte and nothing
  else. Every item of a decode-sized input is mostly padding (128 rows per atom).
* ``"rows"``: items enumerate (row, padded column) row-major over the ``M`` rows, padding
  columns get their zero bytes from the thread of that column, and padding rows (``M`` up to
  a multiple of 128) are zeroed by extra CTAs at the end of the grid, 16 bytes per thread
  where a 16-byte chunk of an atom holds only padding rows, 4 bytes otherwise. Fewer items
  for small ``M``: the order of decode-sized inputs and of the dynamic "fused" variant, whose
  every CTA reads the whole input first.

Arithmetic (float32, every rounding explicit in PTX: the DSL would contract ``a * b + c``).
The block scale divides by ``gs`` with two Markstein corrections of ``t * RN(1/gs)``; each
element computes ``RN(x / d)`` as ``q = x * r`` with ``r = RN(1/d)`` and one correction
``q += (x - q d) r``. For 8- and 11-bit significands (BF16, FP16) one correction gives the
code of the exactly rounded quotient: the only inputs where ``q`` can differ from
``RN(x / d)`` lie within 2^-23 ulp of a float midpoint, and the E2M1 decision points are
such midpoints; exhaustively checked for every significand (see ``tests/quantize_model.py``).
This "fast" path needs ``2^-80 <= gs <= 64`` (no underflow in the residuals, no quotient
that rounds to -0); any other global scale takes the general path (IEEE ``div.rn`` per
element), a uniform branch. Codes saturate at 6: a block whose ``bamax <= RN(6.5 d)``
(every block with a normal, unsaturated UE4M3 scale: its quotients stay below 6.375)
encodes its words as they are, every quotient at most 6.5; any other block (a saturated or
subnormal scale) first clamps its words to ``RZ(6 d)``, a branch around eight packed
instructions, so that a warp mixing both kinds diverges only that long.

E2M1 encoding: on SM120/SM121 the hardware ``cvt.rn.satfinite.e2m1x2.f32`` of ``|q|`` (sign
from a compare, so that -0 gives code 0 as ``quantize`` does); on SM90 in software, by one
float add per element: with ``em = max(exponent(q), 127)``, the float ``M2`` of bits ``em *
(2^23 + 2) + (22 << 23) - 254`` is ``2^(em - 105)`` plus ``2 (em - 127)`` ulps, its ulp the
E2M1 spacing of q's binade, so ``RN(q + M2)`` carries the code ``RNE(q / spacing) + 2 (em -
127)`` in its low mantissa bits (ties stay even: the offset is even). Checked for every
float32 ``q`` in [0, 6.5] (2026-12-02) and sampled in ``tests/test_quantize_kernel.py``.
The sums go into the packed word by shifted multiply-adds; the first three carry their
exponent bits above bit 11, masked once, the other five shift them out of the word.

Variants (``QuantSpec.scale``):
* ``"static"``: ``gs`` is read from a one-element float32 tensor; one kernel.
* ``"dynamic"``: an amax kernel writes one partial maximum per CTA, the quantize kernel
  reduces them (every CTA, no host sync), derives ``gs = amax / 2688`` (1 if amax is 0) and
  CTA 0 stores it; two kernels in one launch function.
* ``"dynamic_fused"``: one kernel whose CTAs each reduce the whole input first (for small
  decode-sized inputs, where a second launch costs more than re-reading from L2).

Output (``QuantSpec.output``): ``"codes"`` (the NVFP4 tensor: packed codes and blocked
scales) or ``"values"``: each element's exact block value ``e2m1 * scale`` as BF16 ``[M,
K]`` (static scale, row order), what a W4A4 product run by the W4A16 kernel reads, in one
pass instead of quantizing and decoding: ``RN(q + M2) - M2`` is the E2M1 magnitude
(Sterbenz: exact), times the UE4M3 value exact (at most 6 significant bits), negated for
a negative element (so -0 stays +0, as its code does); two 16-byte stores per block.

Tried and not kept: staging the input through shared memory, first by per-thread cp.async
(25.2 us against 14.6 us at 4096^2 BF16 on an H200, its MIO queue the top stall), then by a
producer warp streaming chunks with bulk copies into an mbarrier ring (2026-12-02: 54-69%
of 4.8 TB/s against 63-81% for this kernel; its consumer warps, 16-32 per SM, could not
issue the arithmetic fast enough: ``perf/results/2026-12-02-h200-encoder.md``). Deeper
rings for the persistent loop (2026-12-02, ``perf/results/2026-12-02-h200-ring.md``): more
than two register sets do not pipeline deeper, because ptxas tracks every 16-byte load on
one scoreboard and the first use of a set waits for all of them (51-58%). A ring of
shared-memory slots filled by cp.async does wait partially (``DEPBAR.LE``), but it
executes 23% more instructions and ran at 36-68%.

Constraints (checked by the host layer, ``cute_fp4.quant``): K a multiple of 16, input
contiguous and 16-byte aligned, ``M * K < 2^31``, scale buffer 16-byte aligned, packed
output 8-byte aligned (values: 16-byte aligned, the scale pointer never read). NaN/Inf
inputs give unspecified codes (``quantize`` rejects them).
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass.cute.runtime import make_ptr

from cute_fp4.formats import NVFP4, sf_offset_shifts
from cute_fp4.kernels import roles
from cute_fp4.kernels.e2m1 import m2_sum

_GMEM = cute.AddressSpace.gmem
_I32 = cutlass.Int32
_U32 = cutlass.Uint32
PARTIALS_MAX = 512  # amax partials (CTAs of the amax kernel), read by every quantize CTA
_PAD_CTAS_MAX = 16
_FAST_GS_MIN = 2.0 ** -80  # global scales outside [min, max] take the general path
_FAST_GS_MAX = 64.0
SCALES = ("static", "dynamic", "dynamic_fused")
ORDERS = ("rows", "atoms")
OUTPUTS = ("codes", "values")


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """Static choices of one compiled quantization kernel."""

    target: str = "sm_90a"  # sm_90a (software E2M1) or sm_120a / sm_121a (hardware E2M1)
    in_dtype: str = "bf16"  # "bf16" or "fp16"
    scale: str = "static"  # see the module docstring
    threads: int = 256  # per CTA
    items: int = 2  # 16-element blocks per thread
    amax_vectors: int = 8  # 16-byte loads per thread per amax loop iteration (in flight)
    ctas_per_sm: int = 4  # a persistent grid of this many CTAs per SM looping over chunks of
    # threads * items blocks (the host passes max_ctas = n * SMs); 0: one CTA per chunk
    force_general: bool = False  # always take the general (div.rn) path: tests, benchmarks
    order: str = "rows"  # item order: "rows" (row-major over the padded scale columns, pad
    # rows zeroed by extra CTAs) or "atoms" (item g writes scale byte g: a warp writes one
    # 32-byte sector of the 128x4 layout; pad rows are items of their own)
    output: str = "codes"  # "codes": packed E2M1 and blocked UE4M3 scales; "values": each
    # element's exact block value e2m1 * scale as BF16 [M, K] (static scale, row order)

    def __post_init__(self):
        if self.in_dtype not in ("bf16", "fp16"):
            raise ValueError(f"in_dtype must be 'bf16' or 'fp16', got {self.in_dtype!r}")
        if self.scale not in SCALES:
            raise ValueError(f"scale must be one of {SCALES}, got {self.scale!r}")
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"threads must be a multiple of 32 in 32..1024, got {self.threads}")
        if PARTIALS_MAX % self.threads and self.threads % PARTIALS_MAX:
            raise ValueError(f"threads ({self.threads}) and {PARTIALS_MAX} must divide")
        if not 0 <= self.ctas_per_sm <= 32:
            raise ValueError(f"ctas_per_sm must be 0..32, got {self.ctas_per_sm}")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")
        if self.output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {self.output!r}")
        if self.output == "values" and (self.scale != "static" or self.order != "rows"):
            raise ValueError(f"output='values' takes scale='static' and order='rows', got "
                             f"{self.scale!r}, {self.order!r}")
        if not 1 <= self.items <= 8 or not 1 <= self.amax_vectors <= 8:
            raise ValueError(f"items and amax_vectors must be 1..8, got {self.items}, "
                             f"{self.amax_vectors}")

    @property
    def hw_e2m1(self) -> bool:
        return self.target.startswith("sm_12")

    def label(self) -> str:
        general = "-general" if self.force_general else ""
        grid = f"p{self.ctas_per_sm}"
        path = "" if self.order == "rows" else "-atoms"
        path += "-values" if self.output == "values" else ""
        return (f"quantize-{self.in_dtype}-{self.scale}-t{self.threads}i{self.items}"
                f"v{self.amax_vectors}{grid}{path}{general}@{self.target}")

    def max_ctas(self, sm_count: int) -> int:
        """The ``max_ctas`` launch argument for a GPU of ``sm_count`` SMs."""
        return self.ctas_per_sm * sm_count if self.ctas_per_sm else (1 << 31) - 1


# ----------------------------------------------------------------------------- PTX


def _pow16(k: int, mult: int = 1) -> str:
    return f"{(mult * 16 ** k) & 0xFFFFFFFF:#x}"


def _unpack(half: str, word: str, hi: bool, dst: str) -> list[str]:
    """One element of a packed 16-bit pair as float32 (exact)."""
    if half == "bf16":
        return [f"and.b32 {dst}, {word}, 0xFFFF0000;" if hi else f"shl.b32 {dst}, {word}, 16;"]
    return [f"mov.b32 {{hl, hh}}, {word};", f"cvt.f32.f16 {dst}, {'hh' if hi else 'hl'};"]


def _encode_sw(q: str, k: int, acc: str, sign: str) -> list[str]:
    """Software E2M1 of ``q`` (0 <= q <= 6.5) added into ``acc`` as nibble ``k``. Nibbles 0..2
    go into ``acc`` with the exponent bits of their sums above bit 22 (masked off by
    :func:`_mask_low`), nibbles 3..7 shift them out of the word."""
    add = f"mov.b32 {acc}, fm;" if k == 0 else f"mad.lo.u32 {acc}, fm, {_pow16(k)}, {acc};"
    return [*m2_sum(q), add, f"@{sign} add.u32 {acc}, {acc}, {_pow16(k, 8)};"]


def _mask_low(acc: str) -> list[str]:
    """After nibble 2: drop the exponent bits that nibbles 0..2 left above bit 11."""
    return [f"and.b32 {acc}, {acc}, 0xFFF;"]


def _value(j: int, h: int) -> list[str]:
    """Element ``j``'s exact value ``e2m1(q) * scale`` into ``v{h}``: ``RN(q + M2) - M2``
    is q rounded to its binade's E2M1 spacing (Sterbenz: exact), the E2M1 magnitude; times
    the UE4M3 value ``sfv`` (at most 2 x 4 significant bits: exact); negated where the
    element is negative (``pe{j}``: x < 0, so -0 stays +0 as its code does)."""
    return [*m2_sum("q"), "sub.rn.f32 fm, fm, mg;", f"mul.rn.f32 v{h}, fm, sfv;",
            f"@pe{j} neg.f32 v{h}, v{h};"]


def _block_scale_fast() -> list[str]:
    """``u = min(RN(t / gs), 448)`` with ``t`` clamped to ``RN(449 gs)``; $r8 gs, $r9 RN(1/gs),
    $r10 RN(449 gs)."""
    return [
        "min.f32 t, t, {$r10};",
        "mul.rn.f32 qa, t, {$r9};",
        "neg.f32 nq, qa;", "fma.rn.f32 er, nq, {$r8}, t;", "fma.rn.f32 qa, er, {$r9}, qa;",
        "neg.f32 nq, qa;", "fma.rn.f32 er, nq, {$r8}, t;", "fma.rn.f32 u, er, {$r9}, qa;",
        "min.f32 u, u, 0f43E00000;",
    ]


# RN(1/dd) for 2^-126 <= dd < 2^126: the fast path of ``rcp.rn.f32`` as ptxas emits it
# for sm_90a and sm_120a (MUFU.RCP, FFMA, FADD.FTZ, FFMA; tests/test_quantize_kernel.py
# checks that it still does), without its out-of-range test and branch.
_RCP_RN_LINES = ("rcp.approx.ftz.f32 r, dd;", "fma.rn.f32 er, dd, r, 0fBF800000;",
                 "neg.f32 er, er;", "fma.rn.f32 r, r, er, r;")


def _elements(half: str, hw: bool, mode: str, values: bool = False) -> list[str]:
    """PTX for the 16 elements of a block into acc0, acc1 (codes; signs from pe0..pe15).
    ``mode``: "general" (IEEE division of the input words, d in ``d``, ``pd``: d > 0) or
    "fast" (the quotient ``x * r`` with one correction, of the words in ``c0..c7``).
    ``values``: instead, each pair's exact values ``e2m1 * scale`` (``sfv``, sign from
    ``pe``) as BF16 into $w0..$w7."""
    x2 = f"{half}x2"
    body = []
    for i in range(8):
        src = "{$r" + str(i) + "}" if mode == "general" else f"c{i}"
        if mode != "general":
            body.append(f"setp.lt.{x2} pe{2 * i}|pe{2 * i + 1}, {src}, z;")
        for h in range(2):
            j = 2 * i + h
            body += _unpack(half, src, h == 1, "a")
            if mode == "general":
                body += ["@pd div.rn.f32 q, a, d;", "@!pd mov.b32 q, 0;",
                         f"setp.lt.f32 pe{j}, q, 0f00000000;",
                         "abs.f32 q, q;", "min.f32 q, q, 0f40C00000;"]
            else:
                body += ["abs.f32 aa, a;", "mul.rn.f32 qa, aa, r;", "neg.f32 nq, qa;",
                         "fma.rn.f32 er, nq, d, aa;", "fma.rn.f32 q, er, r, qa;"]
            acc = "acc0" if j < 8 else "acc1"
            if values:
                body += _value(j, h)
                if h == 1:
                    body.append(f"cvt.rn.bf16x2.f32 {{$w{i}}}, v1, v0;")
            elif hw:
                if h == 0:
                    body.append("mov.b32 flo, q;")
                else:
                    body += ["mov.b32 fhi, q;", f"cvt.rn.satfinite.e2m1x2.f32 eb{i}, fhi, flo;"]
            else:
                body += _encode_sw("q", j % 8, acc, f"pe{j}")
                if j % 8 == 2:
                    body += _mask_low(acc)
    if hw and not values:
        body += ["mov.b32 acc0, {eb0, eb1, eb2, eb3};", "mov.b32 acc1, {eb4, eb5, eb6, eb7};"]
        for j in range(NVFP4.block):
            acc = "acc0" if j < 8 else "acc1"
            body.append(f"@pe{j} or.b32 {acc}, {acc}, {_pow16(j % 8, 8)};")
    return body


def _block_ptx(half: str, hw: bool, general: bool, values: bool = False) -> str:
    """PTX for one 16-element block: $r0..$r7 the packed input words, $r8 gs, $r9 RN(1/gs),
    $r10 RN(449 gs); $w0, $w1 the packed codes, $w2 the UE4M3 scale byte (twice: low byte
    and the next, the store keeps the low one); ``values``: $w0..$w7 the block's exact
    values ``e2m1 * scale`` as BF16 pairs."""
    x2 = f"{half}x2"
    regs = ("m, ua, ub, bamax, t, qa, nq, er, u, sfb, nz, sfv, d, dd, r, lim, limw, z, "
            "c0, c1, c2, c3, c4, c5, c6, c7, a, aa, q, ex, em, mg, fm, acc0, acc1")
    body = ["{", f".reg .b32 {regs};", ".reg .b16 s16, hl, hh;", ".reg .b8 eb<8>;",
            ".reg .f32 v0, v1;",
            ".reg .pred pe<16>, pd;", ".reg .f32 flo, fhi;", "mov.b32 z, 0;"]
    # block amax: max |x| over the 8 words (sign bits of the result are garbage)
    body.append(f"max.xorsign.abs.{x2} m, {{$r0}}, {{$r1}};")
    body += [f"max.xorsign.abs.{x2} m, m, {{$r{i}}};" for i in range(2, 8)]
    body += _unpack(half, "m", False, "ua") + _unpack(half, "m", True, "ub")
    body += ["abs.f32 ua, ua;", "abs.f32 ub, ub;", "max.f32 bamax, ua, ub;",
             "mul.rn.f32 t, bamax, 0f3E2AAAAB;"]  # the rule: bamax * fl32(1/6)
    if general:
        body += ["div.rn.f32 u, t, {$r8};", "min.f32 u, u, 0f43E00000;"]
    else:
        body += _block_scale_fast()
    body += [
        # both bytes hold the code (code * 257); a non-zero block gets at least code 1
        # (2^-9): the float32 bits of a non-zero 16-bit |x| are >= 2^16 > 257
        "cvt.rn.satfinite.e4m3x2.f32 s16, u, u;", "cvt.u32.u16 sfb, s16;",
        "min.u32 nz, bamax, 257;", "max.u32 sfb, sfb, nz;", "cvt.u16.u32 s16, sfb;",
        "cvt.rn.f16x2.e4m3x2 sfv, s16;", "mov.b32 {hl, hh}, sfv;", "cvt.f32.f16 sfv, hl;",
        "mul.rn.f32 d, sfv, {$r8};",
    ]
    if general:
        body.append("setp.gt.f32 pd, d, 0f00000000;")
        body += _elements(half, hw, "general", values)
    else:
        # The words are clamped to RZ(6 d) (codes saturate) only in blocks that need it:
        # where bamax <= RN(6.5 d) every quotient is <= 6.5 and encodes to at most 6 as it
        # is. Other blocks (a scale rounded far down: subnormal or saturated UE4M3) branch
        # around nothing but the clamp, so a warp whose blocks differ diverges briefly.
        body += ["max.f32 dd, d, 0f00800000;", *_RCP_RN_LINES,
                 *[f"mov.b32 c{i}, {{$r{i}}};" for i in range(8)],
                 "mul.rn.f32 lim, d, 0f40D00000;", "setp.gt.f32 pd, bamax, lim;",
                 "@!pd bra L_CLAMPED;", "mul.rn.f32 lim, d, 0f40C00000;",
                 f"cvt.rz.{x2}.f32 limw, lim, lim;",
                 *[f"min.xorsign.abs.{x2} c{i}, c{i}, limw;" for i in range(8)],
                 "L_CLAMPED:", *_elements(half, hw, "fast", values)]
    if values:
        body.append("}")
    else:
        body += ["mov.b32 {$w0}, acc0;", "mov.b32 {$w1}, acc1;", "mov.b32 {$w2}, sfb;", "}"]
    return "\n".join(body)


def _amax_words_ptx(half: str, n: int) -> str:
    """$r0 the running packed max, $r1..$rn words -> $w0 packed max |x| (garbage signs)."""
    lines = [f"max.xorsign.abs.{half}x2 {{$w0}}, {{$r0}}, {{$r1}};"]
    lines += [f"max.xorsign.abs.{half}x2 {{$w0}}, {{$w0}}, {{$r{i}}};" for i in range(2, n + 1)]
    return "\n".join(lines)


def _pair_max_ptx(half: str) -> str:
    """Packed max -> float32 bits of max(|lo|, |hi|)."""
    body = ["{", ".reg .b32 ua, ub;", ".reg .b16 hl, hh;"]
    body += _unpack(half, "{$r0}", False, "ua") + _unpack(half, "{$r0}", True, "ub")
    body += ["abs.f32 ua, ua;", "abs.f32 ub, ub;", "max.f32 {$w0}, ua, ub;", "}"]
    return "\n".join(body)


_CONSTS_PTX = "\n".join([
    "rcp.rn.f32 {$w0}, {$r0};",
    "mul.rn.f32 {$w1}, {$r0}, 0f43E08000;",  # 449
])
# gs = amax / 2688 (round to nearest, as float32(float(amax) / 2688) in quantize), 1 if 0
_DYN_GS_PTX = "\n".join([
    "{", ".reg .pred p;",
    "setp.gt.f32 p, {$r0}, 0f00000000;",
    "@p div.rn.f32 {$w0}, {$r0}, 0f45280000;",
    "@!p mov.b32 {$w0}, 0f3F800000;", "}",
])


def _ptx(code: str, outs: int, *args):
    res = cute.arch.inline_ptx(code, write_only_types=[_U32] * outs, read_only_args=list(args))
    return res


def _ptxf(code: str, outs: int, *args):
    return cute.arch.inline_ptx(code, write_only_types=[cutlass.Float32] * outs,
                                read_only_args=list(args))


# ----------------------------------------------------------------------------- kernel


@dataclasses.dataclass(frozen=True)
class _Grid:
    """The launch-time sizes every quantize thread reads: M, K / 16 and its multiple of 4,
    the item and chunk counts, the chunk stride (CTAs quantizing) and the divisor of
    :meth:`QuantizeKernel._coords`."""

    m: cutlass.Int32
    kb: cutlass.Int32
    kbp: cutlass.Int32
    n_items: cutlass.Int32
    n_chunks: cutlass.Int32
    stride: cutlass.Int32
    fdd: cute.FastDivmodDivisorV2


class QuantizeKernel:
    """BF16/FP16 -> NVFP4 quantization; see the module docstring.

    Entry point ``(pX, pQ, pSF, pGS, pPart, m, k, max_ctas, stream)``: input words, packed output
    (uint8 [M, K/2]), blocked scales (uint8, ``scale_shape(M, K)`` bytes), the global scale
    (read for ``static``, written for the dynamic variants), the amax partials
    (``PARTIALS_MAX`` float32, ``dynamic`` only), M, K, the most CTAs quantizing (the rest
    of the grid zeroes padding rows): :meth:`QuantSpec.max_ctas`.
    """

    def __init__(self, spec: QuantSpec):
        self.spec = spec
        self.half = "bf16" if spec.in_dtype == "bf16" else "f16"
        self.threads, self.items = spec.threads, spec.items
        self.dynamic = spec.scale != "static"
        self.fused = spec.scale == "dynamic_fused"
        self.atoms = spec.order == "atoms"
        self.values = spec.output == "values"
        self._fast = _block_ptx(self.half, spec.hw_e2m1, False, self.values)
        self._general = _block_ptx(self.half, spec.hw_e2m1, True, self.values)
        self._q_align = 16 if self.values else 8  # 16-byte stores of values, 8 of codes

    # ------------------------------------------------------------------ host side
    def fake_args(self) -> tuple:
        from cutlass.cute.runtime import make_fake_stream

        return (make_ptr(_U32, 0, _GMEM, assumed_align=16),
                make_ptr(_U32, 0, _GMEM, assumed_align=self._q_align),
                make_ptr(cutlass.Uint8, 0, _GMEM, assumed_align=16),
                make_ptr(cutlass.Float32, 0, _GMEM, assumed_align=4),
                make_ptr(_U32, 0, _GMEM, assumed_align=self._part_align),
                _I32(0), _I32(0), _I32(0), make_fake_stream())

    @property
    def _part_align(self) -> int:
        """The partials pointer's alignment (part of the compiled signature): without
        partials the launcher passes the global scale's pointer (never read)."""
        return 16 if self.spec.scale == "dynamic" else 4

    def runtime_args(self, x, q, sf, gs, partials, max_ctas: int, stream) -> tuple:
        """The entry point's arguments from torch tensors (checked by the caller): ``x``
        [M, K] 16-bit, ``q`` uint8 [M, K/2], ``sf`` the blocked scales, ``gs`` float32 of one
        element, ``partials`` float32 [PARTIALS_MAX] or None, ``max_ctas`` an int."""
        m, k = x.shape
        part = partials if self.spec.scale == "dynamic" else gs
        return (make_ptr(_U32, x.data_ptr(), _GMEM, assumed_align=16),
                make_ptr(_U32, q.data_ptr(), _GMEM, assumed_align=self._q_align),
                make_ptr(cutlass.Uint8, sf.data_ptr(), _GMEM, assumed_align=16),
                make_ptr(cutlass.Float32, gs.data_ptr(), _GMEM, assumed_align=4),
                make_ptr(_U32, part.data_ptr(), _GMEM, assumed_align=self._part_align),
                _I32(m), _I32(k), _I32(max_ctas), stream)

    def raw_args(self, x, q, sf, gs, partials, max_ctas: int, stream: int) -> tuple:
        """:meth:`runtime_args` as plain ints (addresses, sizes, the raw stream handle),
        for a kernel compiled with ``--enable-tvm-ffi``."""
        m, k = x.shape
        part = partials if self.spec.scale == "dynamic" else gs
        return (x.data_ptr(), q.data_ptr(), sf.data_ptr(), gs.data_ptr(), part.data_ptr(), m,
                k, max_ctas, stream)

    @cute.jit
    def __call__(self, pX: cute.Pointer, pQ: cute.Pointer, pSF: cute.Pointer,
                 pGS: cute.Pointer, pPart: cute.Pointer, m: cutlass.Int32, k: cutlass.Int32,
                 max_ctas: cutlass.Int32, stream: cuda.CUstream):
        t, u = self.threads, self.items
        kb, kbp, mp, words, (mX, mQ, mSF, mSF4, mGS) = self._views(pX, pQ, pSF, pGS, m, k)
        mPart = cute.make_tensor(pPart, cute.make_layout((PARTIALS_MAX,)))
        n_items = (mp if cutlass.const_expr(self.atoms) else m) * kbp
        n_chunks = (n_items + t * u - 1) // (t * u)
        n_item_ctas = cutlass.min(n_chunks, max_ctas)
        n_pad_ctas = 0  # "atoms": the pad rows are items; "values": no scales
        if cutlass.const_expr(not self.atoms and not self.values):
            n_pad_ctas = self._pad_ctas(m, mp, kbp)
        n_vec = words // 4
        per_amax_cta = t * self.spec.amax_vectors
        n_amax = cutlass.min((n_vec + per_amax_cta - 1) // per_amax_cta, PARTIALS_MAX)
        if cutlass.const_expr(self.spec.scale == "dynamic"):
            self.amax_kernel(mX, mPart, n_vec).launch(
                grid=[n_amax, 1, 1], block=[t, 1, 1], stream=stream, use_pdl=roles.PDL)
        # rows: g -> (row, column) = divmod(g, kbp); atoms: g >> 9 -> (row block, column
        # group) = divmod(g >> 9, kbp / 4)
        fdd = cute.fast_divmod_create_divisor_v2(kbp // 4 if cutlass.const_expr(self.atoms)
                                                 else kbp)
        self.quant_kernel(mX, mQ, mSF, mSF4, mGS, mPart, m, kb, kbp, n_items, n_chunks,
                          n_item_ctas, n_pad_ctas, n_amax, n_vec, fdd).launch(
            grid=[n_item_ctas + n_pad_ctas, 1, 1], block=[t, 1, 1], stream=stream,
            use_pdl=roles.PDL)

    @cute.jit
    def _views(self, pX, pQ, pSF, pGS, m, k):
        """(K / 16, its multiple of 4, M up to a multiple of 128, input words, (input words,
        packed codes as words, scale bytes, scale words, global scale)): the tensors every
        quantize kernel addresses."""
        kk = cute.assume(k, divby=NVFP4.block)
        kb = kk // NVFP4.block
        kbp = (kb + 3) // 4 * 4
        mp = (m + 127) // 128 * 128
        words = m * (kk // 2)
        mX = cute.make_tensor(pX, cute.make_layout((cute.assume(words, divby=8),)))
        q_words = m * (kk // 2) if cutlass.const_expr(self.values) else m * (kk // 8)
        mQ = cute.make_tensor(pQ, cute.make_layout((cute.assume(q_words, divby=2),)))
        sf_len = cute.assume(mp * kbp, divby=512)
        mSF = cute.make_tensor(pSF, cute.make_layout((sf_len,)))
        mSF4 = cute.make_tensor(cute.recast_ptr(pSF, dtype=_U32),
                                cute.make_layout((cute.assume(sf_len // 4, divby=128),)))
        mGS = cute.make_tensor(pGS, cute.make_layout((1,)))
        return kb, kbp, mp, words, (mX, mQ, mSF, mSF4, mGS)

    def _pad_ctas(self, m, mp, kbp):
        """CTAs at the end of the grid that zero the padding rows' scales (:meth:`_pad_rows`;
        none when M is a multiple of 128)."""
        has_pad = (mp - m + 127) // 128
        return has_pad * cutlass.min((kbp * 8 + self.threads - 1) // self.threads,
                                     _PAD_CTAS_MAX)

    # ------------------------------------------------------------------ amax
    @cute.jit
    def _amax_range(self, mX: cute.Tensor, first, stride, n_vec) -> cutlass.Uint32:
        """Packed running max |x| over 16-byte vectors ``first, first + stride, ...``."""
        nv = self.spec.amax_vectors
        acc = _U32(0)
        step = stride * nv
        for base in cutlass.range(first, n_vec, step, unroll=1):
            r = [cute.make_rmem_tensor((4,), _U32) for _ in range(nv)]
            for v in cutlass.range_constexpr(nv):
                vi = base + v * stride
                r[v].fill(0)
                if vi < n_vec:
                    cute.autovec_copy(cute.local_tile(mX, (4,), (vi,)), r[v])
            for v in cutlass.range_constexpr(nv):
                acc = _ptx(_amax_words_ptx(self.half, 4), 1, acc, r[v][0], r[v][1], r[v][2],
                           r[v][3])
        return _ptx(_pair_max_ptx(self.half), 1, acc)

    @cute.jit
    def _cta_max(self, v: cutlass.Uint32, red: cute.Tensor) -> cutlass.Uint32:
        """Maximum of ``v`` (float32 bits, non-negative) over the CTA, in every thread."""
        tidx, _, _ = cute.arch.thread_idx()
        lane = tidx % 32
        warp = tidx // 32
        n_warps = self.threads // 32
        v = cute.arch.warp_redux_sync(v, "umax")
        if lane == 0:
            red[warp] = v
        cute.arch.sync_threads()
        w = _U32(0)
        if lane < n_warps:
            w = red[lane]
        w = cute.arch.warp_redux_sync(w, "umax")
        cute.arch.sync_threads()
        return w

    @cute.kernel
    def amax_kernel(self, mX: cute.Tensor, mPart: cute.Tensor, n_vec: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        n_ctas, _, _ = cute.arch.grid_dim()
        red = cutlass.memory.SmemAllocator().allocate_tensor(
            _U32, cute.make_layout(self.threads // 32), byte_alignment=16)
        roles.wait_for_inputs()
        roles.release_dependents()
        v = self._amax_range(mX, bid * self.threads + tidx, n_ctas * self.threads, n_vec)
        v = self._cta_max(v, red)
        if tidx == 0:
            mPart[bid] = v

    # ------------------------------------------------------------------ quantize
    @cute.kernel
    def quant_kernel(self, mX: cute.Tensor, mQ: cute.Tensor, mSF: cute.Tensor,
                     mSF4: cute.Tensor, mGS: cute.Tensor, mPart: cute.Tensor,
                     m: cutlass.Int32, kb: cutlass.Int32, kbp: cutlass.Int32,
                     n_items: cutlass.Int32, n_chunks: cutlass.Int32,
                     n_item_ctas: cutlass.Int32,
                     n_pad_ctas: cutlass.Int32, n_amax: cutlass.Int32, n_vec: cutlass.Int32,
                     fdd: cute.FastDivmodDivisorV2):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        roles.wait_for_inputs()
        roles.release_dependents()  # the dequantize or GEMM after it launches during it
        if bid < n_item_ctas:
            grid = _Grid(m, kb, kbp, n_items, n_chunks, n_item_ctas, fdd)
            # The first chunk's loads go out before the global scale is known: the branch
            # below waits for it. Issued inside the branch, they waited for the scale's load,
            # and ptxas sank all but the first block's past that block's arithmetic (three
            # load latencies in a row per CTA instead of one).
            iA = cute.make_rmem_tensor((self.items, 2), _I32)
            rA = [cute.make_rmem_tensor((8,), _U32) for _ in range(self.items)]
            self._load(mX, rA, iA, bid, tidx, grid)
            gs = self._global_scale(mX, mGS, mPart, n_amax, n_vec, bid, tidx)
            args = (mX, mQ, mSF, rA, iA, gs, grid, bid, tidx)
            if cutlass.const_expr(self.spec.force_general):
                self._quantize_chunks(self._general, *args)
            else:
                if (gs >= _FAST_GS_MIN) & (gs <= _FAST_GS_MAX):  # uniform: one loop or other
                    self._quantize_chunks(self._fast, *args)
                else:
                    self._quantize_chunks(self._general, *args)
        elif cutlass.const_expr(not self.atoms):  # "atoms" launches no pad CTAs
            self._pad_rows(mSF4, m, kbp, (bid - n_item_ctas) * self.threads + tidx,
                           n_pad_ctas * self.threads)

    @cute.jit
    def _quantize_chunks(self, code: str, mX, mQ, mSF, rA, iA, gs, grid, first, tidx):
        """Chunks ``first, first + stride, ...`` with the input loaded straight into
        registers one chunk ahead (chunk ``first`` is in ``rA``, its coordinates in ``iA``):
        two register sets (A, B) in turn, so that chunk i + 1's loads are in flight while
        chunk i computes, with no copies between the sets. With ``ctas_per_sm == 0`` (one
        chunk per CTA) one set, and more CTAs fit per SM."""
        consts = _ptxf(_CONSTS_PTX, 2, gs)
        if cutlass.const_expr(self.spec.ctas_per_sm == 0):  # one chunk per CTA: one set
            self._items(code, mQ, mSF, rA, iA, gs, consts, grid, first, tidx)
        else:
            self._chunk_pairs(code, mX, mQ, mSF, rA, iA, gs, consts, grid, first, tidx)

    @cute.jit
    def _chunk_pairs(self, code: str, mX, mQ, mSF, rA, iA, gs, consts, grid, first, tidx):
        """The persistent loop of :meth:`_quantize_chunks`, set A loaded."""
        u, stride, n = self.items, grid.stride, grid.n_chunks
        iB = cute.make_rmem_tensor((u, 2), _I32)
        rB = [cute.make_rmem_tensor((8,), _U32) for _ in range(u)]
        for chunk in cutlass.range(first, n, 2 * stride, unroll=1):
            if chunk + stride < n:
                self._load(mX, rB, iB, chunk + stride, tidx, grid)
            self._items(code, mQ, mSF, rA, iA, gs, consts, grid, chunk, tidx)
            if chunk + stride < n:
                if chunk + 2 * stride < n:
                    self._load(mX, rA, iA, chunk + 2 * stride, tidx, grid)
                self._items(code, mQ, mSF, rB, iB, gs, consts, grid, chunk + stride, tidx)

    def _item_index(self, chunk, j: int, tidx):
        """The index g of this thread's item ``j`` of ``chunk``: items ``threads`` apart."""
        return (chunk * self.items + j) * self.threads + tidx

    @cute.jit
    def _coords(self, chunk, j: int, tidx, grid):
        """(item index g, row, padded column) of item ``j`` of ``chunk`` (see ``order``)."""
        g = self._item_index(chunk, j, tidx)
        if cutlass.const_expr(self.atoms):
            a = g & 511  # the byte in a 512-byte atom: (row % 32) * 16 + (row / 32 % 4) * 4
            rb, cg = divmod(g >> 9, grid.fdd)  # + column % 4 (nvfp4.scale_offset)
            return g, rb * 128 + ((a >> 2) & 3) * 32 + (a >> 4), cg * 4 + (a & 3)
        r, c = divmod(g, grid.fdd)
        return g, r, c

    @cute.jit
    def _item_flags(self, g, r, c, grid):
        """(in range, has data, data block index, scale byte offset) of item ``g`` at (row
        ``r``, column ``c``) of the scale columns padded to ``kbp``."""
        ok = g < grid.n_items
        if cutlass.const_expr(self.atoms):
            return ok, ok & (c < grid.kb) & (r < grid.m), r * grid.kb + c, g
        return ok, ok & (c < grid.kb), g - r * (grid.kbp - grid.kb), sf_offset_shifts(
            r, c, grid.kbp)

    @cute.jit
    def _load(self, mX, rW, idx, chunk, tidx, grid):
        """16-byte loads of this thread's blocks of ``chunk`` into ``rW``, their (row,
        column) into ``idx``; items without data load block 0 instead (their codes are not
        stored, their scale byte is zeroed)."""
        for j in cutlass.range_constexpr(self.items):
            g, r, c = self._coords(chunk, j, tidx, grid)
            idx[j, 0] = r
            idx[j, 1] = c
            _, data, gd, _ = self._item_flags(g, r, c, grid)
            src_block = cutlass.select_(data, gd, 0)
            for h in cutlass.range_constexpr(2):
                cute.autovec_copy(cute.local_tile(mX, (4,), (src_block * 2 + h,)),
                                  cute.local_tile(rW[j], (4,), (h,)))

    @cute.jit
    def _global_scale(self, mX, mGS, mPart, n_amax, n_vec, bid, tidx) -> cutlass.Float32:
        """Static: the given scale. Dynamic: amax over the partials (or the whole input)
        -> amax / 2688; CTA 0 stores it."""
        if cutlass.const_expr(not self.dynamic):
            return mGS[0]
        red = cutlass.memory.SmemAllocator().allocate_tensor(
            _U32, cute.make_layout(self.threads // 32), byte_alignment=16)
        v = _U32(0)
        if cutlass.const_expr(self.fused):
            v = self._amax_range(mX, tidx, self.threads, n_vec)
        else:
            for i in cutlass.range_constexpr(max(1, PARTIALS_MAX // self.threads)):
                idx = tidx + i * self.threads
                if idx < n_amax:
                    v = cutlass.max(v, mPart[idx])
        amax = self._cta_max(v, red)
        gs = _ptxf(_DYN_GS_PTX, 1, amax)
        if bid == 0 and tidx == 0:
            mGS[0] = gs
        return gs

    @cute.jit
    def _block_codes(self, code: str, rW, gs, consts) -> list:
        """The block PTX on each of this thread's ``items`` blocks (input words in ``rW``):
        per block a register tensor of (codes, codes, scale byte), or ("values") of its
        eight BF16 pairs."""
        n = 8 if self.values else 3
        rO = [cute.make_rmem_tensor((n,), _U32) for _ in range(self.items)]
        for j in cutlass.range_constexpr(self.items):
            out = _ptx(code, n, *(rW[j][i] for i in range(8)), gs, consts[0], consts[1])
            for i in cutlass.range_constexpr(n):
                rO[j][i] = out[i]
        return rO

    @cute.jit
    def _items(self, code: str, mQ, mSF, rW, idx, gs, consts, grid, chunk, tidx):
        """Quantize this thread's ``items`` blocks of ``chunk`` (input words in ``rW``)."""
        u = self.items
        rO = self._block_codes(code, rW, gs, consts)
        for j in cutlass.range_constexpr(u):
            g = self._item_index(chunk, j, tidx)
            ok, data, gd, off = self._item_flags(g, idx[j, 0], idx[j, 1], grid)
            if cutlass.const_expr(self.values):
                if data:  # the block's 16 values: two 16-byte stores
                    for h in cutlass.range_constexpr(2):
                        cute.autovec_copy(cute.local_tile(rO[j], (4,), (h,)),
                                          cute.local_tile(mQ, (4,), (gd * 2 + h,)))
            else:
                if data:
                    cute.autovec_copy(cute.local_tile(rO[j], (2,), (0,)),
                                      cute.local_tile(mQ, (2,), (gd,)))
                if ok:
                    mSF[off] = cutlass.Uint8(cutlass.select_(data, rO[j][2], _U32(0)))

    @cute.jit
    def _pad_rows(self, mSF4, m, kbp, first, stride):
        """Zero the scale words of rows M..round_up(M, 128) (the last row block)."""
        rb = (m - 1) // 128
        m_local = m - rb * 128
        base = rb * kbp * 32  # words
        zero = cute.make_rmem_tensor((4,), _U32)
        zero.fill(0)
        for p in cutlass.range(first, kbp * 8, stride, unroll=1):
            cg = p // 32
            i = p % 32
            w = base + cg * 128 + i * 4
            if i >= m_local:
                cute.autovec_copy(zero, cute.local_tile(mSF4, (4,), (w // 4,)))
            else:
                for jj in cutlass.range_constexpr(1, 4):
                    if i + 32 * jj >= m_local:
                        mSF4[w + jj] = _U32(0)


__all__ = ["QuantSpec", "QuantizeKernel", "PARTIALS_MAX", "SCALES"]
