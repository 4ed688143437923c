"""A NumPy model of what each thread of ``cute_fp4.kernels.quantize`` computes, op by op.

Not a test module (no ``test_`` prefix): ``tests/test_quantize_kernel.py`` drives it. It
follows the kernel's PTX with float32 arithmetic rounded exactly as the GPU rounds it
(``fma32`` is a correctly rounded fused multiply-add), and its thread-to-address mapping:
items over the padded scale columns, the blocked scale offsets, the pad-row CTAs. Running it
against ``cute_fp4.quantize`` on the CPU checks the tricks (one Markstein correction per
element, the one-add E2M1 encoding, the masked packed-word accumulation, the clamp at
``6 d`` of the blocks that need it, the zero-padding) without a GPU.

``div6``: the one quantization rule (``cute_fp4.nvfp4``) computes ``bamax * float32(1/6)``
on every device, as the kernel does (``"recip"``, the default); ``div6="true"`` models a
division by 6 instead, which rounds differently for some blocks: the tests use it to show
that the comparison would notice.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import torch

from cute_fp4.formats import sf_offset_shifts
from cute_fp4.nvfp4 import E2M1_VALUES, e2m1_encode, scale_offset, scale_shape

F32 = np.float32
M2_BIAS = (22 << 23) - 254  # kernels/e2m1.py M2_BIAS
FAST_GS = (2.0**-80, 64.0)


def bits(a) -> np.ndarray:
    return np.asarray(a, dtype=F32).view(np.uint32)


def from_bits(b) -> np.ndarray:
    return np.asarray(b, dtype=np.uint32).view(F32)


def fma32(a, b, c) -> np.ndarray:
    """Correctly rounded float32 ``a * b + c`` (no overflow, which the kernel never has)."""
    a, b, c = (np.asarray(v, dtype=F32) for v in (a, b, c))
    p = a.astype(np.float64) * b.astype(np.float64)  # exact: 48 bits
    c64 = c.astype(np.float64)
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)  # TwoSum: p + c == s + err exactly
    r = s.astype(F32)
    r64 = r.astype(np.float64)
    other = np.where(s > r64, np.nextafter(r, F32(np.inf)), np.nextafter(r, F32(-np.inf)))
    mid = (s != r64) & ((s - r64) == (other.astype(np.float64) - s))
    up = np.maximum(r, other)
    down = np.minimum(r, other)
    fixed = np.where(err > 0, up, down)
    return np.where(mid & (err != 0), fixed, r).astype(F32)


def e4m3_rne(u: np.ndarray) -> np.ndarray:
    """Float32 in [0, 448] -> UE4M3 byte, round to nearest even (``cvt.rn.satfinite``)."""
    t = torch.from_numpy(np.ascontiguousarray(u, dtype=F32)).to(torch.float8_e4m3fn)
    return t.view(torch.uint8).numpy().astype(np.uint32)


def e4m3_value(code: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(np.ascontiguousarray(code, dtype=np.uint8)).view(torch.float8_e4m3fn)
    return t.float().numpy()


def e2m1_rne(q: np.ndarray) -> np.ndarray:
    """What ``cvt.rn.satfinite.e2m1x2.f32`` is taken to do for q >= 0 (RNE, saturate)."""
    return e2m1_encode(torch.from_numpy(np.ascontiguousarray(q, dtype=F32))).numpy().astype(
        np.uint32)


def to_f32(h: np.ndarray, half: str) -> np.ndarray:
    """16-bit patterns -> float32 (exact)."""
    if half == "bf16":
        return from_bits(h.astype(np.uint32) << 16)
    return h.astype(np.uint16).view(np.float16).astype(F32)


def rz_half(v: np.ndarray, half: str) -> np.ndarray:
    """float32 >= 0 -> 16-bit pattern rounded toward zero (``cvt.rz``), clamped to max."""
    if half == "bf16":
        return (bits(v) >> 16).astype(np.uint16)
    h = np.minimum(v, F32(65504.0)).astype(np.float16)
    h = np.where(h.astype(F32) > v, np.nextafter(h, np.float16(0)), h)
    return h.view(np.uint16)


def _encode_sw(q: np.ndarray, neg: np.ndarray) -> np.ndarray:
    """The software encoding's per-element terms: bits(RN(q + M2(em))) + 8 sign, where
    M2's bits are em * (2^23 + 2) + M2_BIAS (the code sits in the low mantissa bits)."""
    em = np.maximum(bits(q) >> 23, 127).astype(np.uint64)
    mg = from_bits(((em * (2**23 + 2) + M2_BIAS) & 0xFFFFFFFF).astype(np.uint32))
    fm = (q.astype(F32) + mg).astype(F32)  # float32 addition: correctly rounded
    return (bits(fm) + 8 * neg.astype(np.uint32)).astype(np.uint32)


def _pack(terms: np.ndarray) -> np.ndarray:
    """[..., 8] per-element terms -> packed words, as the kernel's multiply-adds do:
    nibbles 0..2 summed and masked to 12 bits, then nibbles 3..7 added."""
    acc = np.zeros(terms.shape[:-1], dtype=np.uint64)
    for k in range(8):
        acc = (acc + terms[..., k].astype(np.uint64) * (16**k)) & 0xFFFFFFFF
        if k == 2:
            acc &= 0xFFF
    return acc.astype(np.uint32)


def block_model(h: np.ndarray, gs: float, half: str = "bf16", hw: bool = False,
                general: bool | None = None, div6: str = "recip"):
    """Quantize blocks: ``h`` uint16 [B, 16] (element 0 first) -> (words uint32 [B, 2],
    scale bytes uint32 [B]). ``general`` None picks the path as the kernel does."""
    gs = F32(gs)
    if general is None:
        general = not (FAST_GS[0] <= gs <= FAST_GS[1])
    x = to_f32(h, half)
    bamax = np.abs(x).max(axis=1)
    t = (bamax * F32(1.0 / 6.0)).astype(F32) if div6 == "recip" else (bamax / F32(6)).astype(F32)
    if general:
        u = (t / gs).astype(F32)
    else:
        rgs = (F32(1) / gs).astype(F32)
        t = np.minimum(t, F32(gs * F32(449.0)))
        qa = (t * rgs).astype(F32)
        for _ in range(2):
            er = fma32(-qa, gs, t)
            qa = fma32(er, rgs, qa)
        u = qa
    u = np.minimum(u, F32(448.0))
    sfb = e4m3_rne(u) * 257  # cvt e4m3x2 of (u, u): the code in both bytes
    sfb = np.maximum(sfb, np.minimum(bits(bamax), 257)) & 0xFF
    d = (e4m3_value(sfb) * gs).astype(F32)[:, None]
    if general:
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            q = np.where(d > 0, (x / np.where(d > 0, d, F32(1))).astype(F32), F32(0))
        neg = q < 0
        q = np.minimum(np.abs(q), F32(6.0))
    else:
        r = (F32(1) / np.maximum(d, F32(2.0**-126))).astype(F32)
        # words clamped to RZ(6 d) only in blocks with bamax > RN(6.5 d)
        clamp = bamax[:, None] > (d * F32(6.5)).astype(F32)
        limw = rz_half((d * F32(6.0)).astype(F32), half)
        mag = h & 0x7FFF
        cw = np.where(clamp & (mag > limw), limw, mag) | (h & 0x8000)
        a = to_f32(cw, half)
        neg = a < 0
        aa = np.abs(a)
        qa = (aa * r).astype(F32)
        q = fma32(fma32(-qa, d, aa), r, qa)
    if hw:
        nib = e2m1_rne(q) | (neg.astype(np.uint32) << 3)
        words = np.zeros((len(h), 2), dtype=np.uint32)
        for k in range(16):
            words[:, k // 8] |= nib[:, k] << (4 * (k % 8))
    else:
        terms = _encode_sw(q, neg)
        words = np.stack([_pack(terms[:, :8]), _pack(terms[:, 8:])], axis=1)
    return words, sfb


def quantize_model(x16: torch.Tensor, gs: float | None = None, hw: bool = False,
                   general: bool | None = None, div6: str = "recip", threads: int = 256,
                   items: int = 2, poison: int = 0xAB, order: str = "rows"):
    """The whole kernel on a bf16/fp16 [M, K] tensor: returns (data uint8 [M, K/2], scale
    uint8 flat blocked, gs) with the kernel's addressing (``order`` as ``QuantSpec.order``);
    unwritten bytes keep ``poison``."""
    half = "bf16" if x16.dtype == torch.bfloat16 else "f16"
    m, k = x16.shape
    h = x16.contiguous().view(torch.int16).numpy().view(np.uint16)
    if gs is None:
        amax = float(np.abs(to_f32(h, half)).max())
        gs = float(F32(amax) / F32(2688.0)) if amax > 0 else 1.0
    kb = k // 16
    kbp = -(-kb // 4) * 4
    rp, cp = scale_shape(m, k)
    data = np.full(m * k // 2, poison, dtype=np.uint8)
    scale = np.full(rp * cp, poison, dtype=np.uint8)
    blocks = h.reshape(m * kb, 16)
    words, sfb = block_model(blocks, gs, half, hw, general, div6)
    if order == "atoms":
        # item g writes scale byte g: g >> 9 = (row block, column group), g & 511 the byte
        n_items = rp * cp
        g = np.arange(n_items)
        a = g & 511
        rb, cg = np.divmod(g >> 9, kbp // 4)
        r = rb * 128 + ((a >> 2) & 3) * 32 + (a >> 4)
        c = cg * 4 + (a & 3)
        has = (c < kb) & (r < m)
        gd = r * kb + c
        off = g
        assert np.array_equal(off, scale_offset(r, c, k)), "atom order != nvfp4.scale_offset"
    else:
        # items: every (row, padded column); grid order only changes who writes what
        n_items = m * kbp
        g = np.arange(n_items)
        r, c = g // kbp, g % kbp
        gd = g - r * (kbp - kb)
        has = c < kb
        off = sf_offset_shifts(r, c, kbp)  # what the kernel computes
        assert np.array_equal(off, scale_offset(r, c, k)), "kernel offsets != nvfp4.scale_offset"
    scale[off] = np.where(has, sfb[np.minimum(gd, len(sfb) - 1)], 0).astype(np.uint8)
    dw = data.view(np.uint32).reshape(-1, 2)
    dw[gd[has]] = words[gd[has]]
    if order != "atoms":
        _pad_rows(scale.view(np.uint32), m, kbp)
    return data.reshape(m, k // 2), scale, gs


def _pad_rows(words: np.ndarray, m: int, kbp: int) -> None:
    """The pad CTAs: zero the scale words of rows m..round_up(m, 128)."""
    if m % 128 == 0:
        return
    rb = (m - 1) // 128
    m_local = m - rb * 128
    base = rb * kbp * 32
    for p in range(kbp * 8):
        cg, i = divmod(p, 32)
        w = base + cg * 128 + i * 4
        for jj in range(4):
            if i + 32 * jj >= m_local:
                words[w + jj] = 0


# ----------------------------------------------------------------------------- exhaustive

_BOUNDS = [(Fraction(1, 4), ">"), (Fraction(3, 4), ">="), (Fraction(5, 4), ">"),
           (Fraction(7, 4), ">="), (Fraction(5, 2), ">"), (Fraction(7, 2), ">="),
           (Fraction(5), ">")]
assert [float(b) for b, _ in _BOUNDS] == [(E2M1_VALUES[i] + E2M1_VALUES[i + 1]) / 2
                                          for i in range(7)]


def hard_divisors(sig_bits: int, spread: int = 3):
    """(x, d) float32 pairs where ``x / d`` is closest to an E2M1 decision point: for every
    significand of ``sig_bits`` bits (x in [1, 2)) and every decision point (the bound and
    the float midpoints half an ulp either side of it), the floats d nearest to x / point."""
    xs, ds = [], []
    for b, _ in _BOUNDS:
        bf = F32(float(b))
        for tau in (b, (Fraction(float(np.nextafter(bf, F32(0)))) + b) / 2,
                    (Fraction(float(np.nextafter(bf, F32(8)))) + b) / 2):
            for mant in range(2 ** (sig_bits - 1), 2**sig_bits):
                x = Fraction(mant, 2 ** (sig_bits - 1))
                d0 = F32(float(x / tau))
                for s in range(-spread, spread + 1):
                    d = d0
                    for _ in range(abs(s)):
                        d = np.nextafter(d, F32(np.inf) if s > 0 else F32(0))
                    xs.append(float(x))
                    ds.append(d)
    return np.array(xs, dtype=F32), np.array(ds, dtype=F32)


def one_correction_codes(x: np.ndarray, d: np.ndarray):
    """(kernel's code, exact code) for ``x / d``: q = x RN(1/d) with one Markstein
    correction vs RN(x / d), both encoded by nvfp4.e2m1_encode."""
    r = (F32(1) / d).astype(F32)
    qa = (x * r).astype(F32)
    q = fma32(fma32(-qa, d, x), r, qa)
    exact = (x / d).astype(F32)
    return e2m1_rne(q), e2m1_rne(exact)


# ----------------------------------------------------------------------------- inputs

_TIES = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -2.5, -5.0, 0.5])
_UE4M3_MANT = torch.tensor([1.0, 1.125, 1.25, 1.5, 1.75])


def awkward_input(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A [m, k] bf16/fp16 tensor built to catch scale and rounding bugs: rows spanning
    2^-20..2^20; 10% of blocks whose elements sit exactly on E2M1 rounding ties of their
    block scale (for a global scale that is a power of two: the block's amax is 6 s for a
    UE4M3 value s); 5% zero blocks; 5% blocks 2^-12 smaller (subnormal UE4M3 scales under
    the tensor's own global scale); 2% blocks 64x larger (saturated scales under a
    calibrated one); 2% negative zeros. FP16 values are clamped to its range."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x *= torch.exp2(torch.randint(-20, 21, (m, 1), generator=g).float())
    nb = k // 16
    blocks = x.view(m, nb, 16)
    s = torch.exp2(torch.randint(-12, 8, (m, nb), generator=g).float())
    s *= _UE4M3_MANT[torch.randint(0, len(_UE4M3_MANT), (m, nb), generator=g)]
    tie = _TIES[torch.randint(0, len(_TIES), (m, nb, 16), generator=g)] * s[..., None]
    tie[..., 0] = 6 * s
    u = torch.rand(m, nb, generator=g)
    blocks[u < 0.10] = tie[u < 0.10]
    blocks[(u >= 0.10) & (u < 0.15)] = 0.0
    blocks[(u >= 0.15) & (u < 0.20)] *= 2.0**-12
    blocks[(u >= 0.20) & (u < 0.22)] *= 64.0
    if dtype == torch.float16:
        x = x.clamp(-65504.0, 65504.0)
    x = x.to(dtype)
    x[torch.rand(m, k, generator=g) < 0.02] = -0.0
    return x


def tie_case():
    """A block whose scale rounds differently under ``/ 6`` and ``* float32(1/6)``."""
    bamax = np.float32(5.0)
    t_true, t_recip = bamax / np.float32(6), bamax * np.float32(1 / 6)
    tie = np.float32(0.84375)  # between the UE4M3 values 0.8125 and 0.875
    gs = np.float32(t_recip / tie)
    while not (t_true / gs < tie <= t_recip / gs):  # step gs until tie separates them
        gs = np.nextafter(gs, np.float32(np.inf) if t_true / gs >= tie else np.float32(0))
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    x[0, 0] = 5.0
    return x, float(gs)


# ----------------------------------------------------------------------------- the rule

def _step16(v: torch.Tensor, dtype: torch.dtype, ulps: int) -> torch.Tensor:
    """``v`` (positive, 16-bit ``dtype``) moved ``ulps`` representable values up or down."""
    return (v.to(dtype).view(torch.int16) + ulps).view(dtype)


def e2m1_tie_blocks(dtype: torch.dtype, gs: float) -> torch.Tensor:
    """[<= 2 x 126, 16] ``dtype`` blocks, two per positive finite UE4M3 value ``s``: element 0 is
    ``6 s gs`` (the block amax that gives scale ``s``), the others sit on every E2M1
    decision point of ``d = s gs`` (the ties, exactly representable: a tie has at most 3
    significant bits, ``s`` at most 4) and one representable value above and below each,
    the negated ties, a zero and ``-6 s gs``. ``gs`` a power of two keeps ``d`` exact."""
    codes = torch.arange(1, 127, dtype=torch.uint8)
    s = codes.view(torch.float8_e4m3fn).float() * gs
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    ties = (bounds[None, :] * s[:, None]).to(dtype)
    first = (6 * s[:, None]).to(dtype)
    a = torch.cat([first, ties, _step16(ties, dtype, 1), torch.zeros_like(first)], dim=1)
    b = torch.cat([first, _step16(ties, dtype, -1), -ties, -first], dim=1)
    blocks = torch.cat([a, b])
    return blocks[blocks.isfinite().all(dim=1)]  # FP16: scales whose 6 s gs overflow go


def ue4m3_boundary_cases(dtype: torch.dtype) -> list[tuple[torch.Tensor, float]]:
    """(blocks, global scale) pairs whose block scales ``u = RN(amax fl(1/6)) / gs`` land on
    every UE4M3 rounding boundary: for each significand pattern ``P = 1 + i/16`` (odd ``i``:
    the midpoints between UE4M3 values, ties included; even ``i``: the values themselves)
    the global scales nearest ``t / P`` (two float32 steps either side) for a base amax
    ``b``, and blocks with amax ``b 2^j`` over every binade that fits the 16-bit type, so
    that ``u = P 2^j`` crosses the subnormal scales, the round-to-zero floor and the
    saturation at 448. Bases: small and large ones (the kernel's fast path for
    ``2^-80 <= gs <= 64``, the general path above 64), of significands that make a division
    by 6 round differently from the rule's product and of ones that do not. The other 15
    elements of a block are random multiples of its amax."""
    g = torch.Generator().manual_seed(17)
    rcp6 = np.float32(1.0 / 6.0)
    # significands where RN(b fl(1/6)) and RN(b / 6) differ (5, 1.25) and where not
    sigs = (1.0, 5.0, 1.25, 1.6875)
    bases = [m * e for m in sigs for e in ((1.0, 2.0**10) if dtype == torch.float16 else
                                          (1.0, 2.0**-20, 2.0**10))]
    limit = 65504.0 if dtype == torch.float16 else 3.0e38
    tiny = 2.0**-14 if dtype == torch.float16 else 2.0**-126
    out = []
    for b in bases:
        t = np.float32(b) * rcp6
        js = [j for j in range(-14, 10) if tiny <= b * 2.0**j <= limit]
        amax = torch.tensor([b * 2.0**j for j in js])
        for i in range(16):
            p = np.float32(1 + i / 16)
            gs0 = np.float32(t / p)
            for step in range(-2, 3):
                gs = gs0
                for _ in range(abs(step)):
                    gs = np.nextafter(gs, np.float32(np.inf) if step > 0 else np.float32(0))
                rest = (torch.rand(len(js), 15, generator=g) * 2 - 1) * amax[:, None]
                blocks = torch.cat([amax[:, None], rest], dim=1).to(dtype)
                out.append((blocks, float(gs)))
    return out


def random_blocks(n_blocks: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[n_blocks / 256, 4096] ``dtype``: random blocks with a random binade each (2^-24 ..
    2^14, FP16: its range), 3% zero blocks, 3% blocks with one non-zero element, 2% negative
    zeros, 1% blocks of one repeated value."""
    g = torch.Generator().manual_seed(seed)
    rows = n_blocks // 256
    x = torch.randn(rows, 256, 16, generator=g)
    lo = -10 if dtype == torch.float16 else -24
    x *= torch.exp2(torch.randint(lo, 15, (rows, 256, 1), generator=g).float())
    u = torch.rand(rows, 256, generator=g)
    x[u < 0.03] = 0.0
    one = (u >= 0.03) & (u < 0.06)
    x[one] = x[one] * (torch.arange(16) == 0)
    rep = (u >= 0.06) & (u < 0.07)
    x[rep] = x[rep][:, :1].expand(-1, 16)
    if dtype == torch.float16:
        x = x.clamp(-65504.0, 65504.0)
    x = x.to(dtype).reshape(rows, 4096)
    x[torch.rand(rows, 4096, generator=g) < 0.02] = -0.0
    return x
