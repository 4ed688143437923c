"""The emulated block-scaled MMA (kernels/mma_emulation.py) equals the OMMA's ISA model, on
the CPU, bit for bit.

* The conversion PTX (``CONVERT_PTX``, the very string the kernel inlines) is run by a small
  interpreter of the instructions it uses (an unknown instruction fails the test) for every
  E2M1 code at every nibble position, every finite UE4M3 scale and every scale byte; each
  BF16 result must be exactly ``e2m1 x ue4m3``.
* One m16n8k64 MMA: the 32 lanes' FP4 registers and scale registers are laid out by the PTX
  ISA fragment model of ``mma.m16n8k64 .kind::mxf4nvf4 .scale_vec::4X`` (the model the
  CPU mainloop trace checks the kernel's fragments against; scale lanes from
  ``sf_layout.mma_sf_fragment``, the lanes the OMMA does not read hold garbage). The
  emulation's lane routing (``sf_source``/``sf_byte``, the interpreter for the conversion)
  builds each sub-MMA's BF16 registers, which the independent m16n8k16 BF16 fragment model
  turns back into matrices; four such MMAs must give exactly the block-scaled product
  (every product and these sums are exact in float64).
* Slips a derivation could make (scale of the wrong lane, wrong K block, halves swapped)
  are caught.
"""

from __future__ import annotations

import random

import pytest
import torch
from ptx_model import bf16 as _bf16
from ptx_model import run_ptx

from cute_fp4.formats import MXFP4, NVFP4
from cute_fp4.kernels import mma_emulation as emu
from cute_fp4.kernels import sf_layout
from cute_fp4.nvfp4 import E2M1_VALUES

# ----------------------------------------------------------------------------- conversion
# (the PTX runs through tests/ptx_model.py)

def convert(q: int, scale_word: int, byte: int, ptx: str = emu.CONVERT_PTX) -> list[int]:
    """What the kernel computes for one FP4 register: sub-MMA s's BF16x2 register, s = 0..3."""
    return run_ptx(ptx, [q, scale_word, byte], emu.SUB_MMAS)


# ----------------------------------------------------------------------------- values

def e2m1(code: int) -> float:
    v = E2M1_VALUES[code & 7]
    return -v if code & 8 else v


def ue4m3(byte: int) -> float:
    return torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item()


FINITE_SCALES = [b for b in range(128) if b != 0x7F]  # 0x7F is NaN in E4M3


UE8M0_SCALES = list(range(253))  # every code the kernels take (253..255 are refused)


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=["nvfp4", "mxfp4"])
def test_conversion_is_exact_for_every_code_and_scale(fmt):
    """The conversion of ``fmt``'s scale type (``CONVERTS``): every E2M1 code at every
    nibble times every finite scale code (UE4M3; UE8M0 0..252) in every byte: ``v * s`` as
    BF16, exactly (BF16 subnormals for the smallest UE8M0 codes), signs of zeros kept."""
    words = [sum(((w + i) % 16) << (4 * i) for i in range(8)) for w in range(16)]
    ptx = emu.CONVERTS[fmt.scale.name]
    bad = []
    for sb in FINITE_SCALES if fmt is NVFP4 else UE8M0_SCALES:
        s = fmt.scale.decode(sb)
        for byte in range(4):
            junk = random.Random(sb * 4 + byte).getrandbits(32) & ~(0xFF << (8 * byte))
            for q in words[:: 1 if fmt is NVFP4 or sb % 16 == byte else 5]:
                out = convert(q, junk | sb << (8 * byte), byte, ptx)
                for j in range(8):
                    want = e2m1((q >> (4 * j)) & 15) * s
                    half = out[j // 2] >> (16 * (j % 2))
                    got = _bf16(half)
                    if got != want or (got == 0 and (half >> 15 & 1) != (q >> (4 * j + 3) & 1)):
                        bad.append((hex(q), j, sb, byte, got, want))
    assert bad[:5] == []


def test_conversion_check_catches_swapped_halves():
    swapped = emu.CONVERT_PTX.replace("f1, f0;", "f0, f1;")
    assert swapped != emu.CONVERT_PTX
    q, word = 0x00000021, 0x38  # elements 1.0 and 0.5, scale 1.0
    assert convert(q, word, 0) != convert(q, word, 0, swapped)


# ----------------------------------------------------------------------------- ISA model
# mma.m16n8k64 .e2m1 (PTX ISA; CUTLASS SM120_16x8x64_TN_VS traits): g = lane // 4,
# t = lane % 4; FP4 element i of a lane is nibble i % 8 of register i // 8.

def isa_fp4_a(lane: int, i: int) -> tuple[int, int]:
    """(row, k) of A element i (32 per lane)."""
    g, t = divmod(lane, 4)
    return g + 8 * ((i // 8) % 2), 8 * t + i % 8 + 32 * (i // 16)


def isa_fp4_b(lane: int, i: int) -> tuple[int, int]:
    """(k, col) of B element i (16 per lane)."""
    g, t = divmod(lane, 4)
    return 8 * t + i % 8 + 32 * (i // 8), g


# mma.m16n8k16 .bf16: element i of a lane is half i % 2 of register i // 2.
def isa_bf16_a(lane: int, i: int) -> tuple[int, int]:
    g, t = divmod(lane, 4)
    return g + 8 * ((i // 2) % 2), 2 * t + i % 2 + 8 * (i // 4)


def isa_bf16_b(lane: int, i: int) -> tuple[int, int]:
    g, t = divmod(lane, 4)
    return 2 * t + i % 2 + 8 * (i // 2), g


def _random_mma(seed: int, fmt=NVFP4):
    rng = random.Random(seed)
    n_sf = 64 // fmt.block
    # UE8M0 codes 2^-9 .. 2^9: every product and the sums stay exact in float64
    codes = FINITE_SCALES if fmt is NVFP4 else list(range(118, 137))
    a = [[rng.randrange(16) for _ in range(64)] for _ in range(16)]
    b = [[rng.randrange(16) for _ in range(64)] for _ in range(8)]
    sfa = [[rng.choice(codes) for _ in range(n_sf)] for _ in range(16)]
    sfb = [[rng.choice(codes) for _ in range(n_sf)] for _ in range(8)]
    return rng, a, b, sfa, sfb


def _lane_registers(rng, a, b, sfa, sfb):
    """Each lane's FP4 registers and scale register, as the OMMA would read them (the
    scale_vec::2X register of MXFP4: bytes 0 and 1, K blocks of 32, from the same lanes as
    4X's: CUTLASS's SM120 SFA/SFB layouts serve both kinds)."""
    """Each lane's FP4 registers and scale register, as the OMMA would read them."""
    lanes = []
    for lane in range(32):
        ra = [0] * 4
        for i in range(32):
            r, k = isa_fp4_a(lane, i)
            ra[i // 8] |= a[r][k] << (4 * (i % 8))
        rb = [0] * 2
        for i in range(16):
            k, c = isa_fp4_b(lane, i)
            rb[i // 8] |= b[c][k] << (4 * (i % 8))

        def scale(op, table, lane=lane):
            pairs = sf_layout.mma_sf_fragment(lane, op, 0)
            if not pairs:  # not read by the OMMA (selector 0): garbage
                return rng.getrandbits(32)
            row = pairs[0][0]
            return sum(code << (8 * kb) for kb, code in enumerate(table[row]))

        lanes.append((ra, rb, scale("A", sfa), scale("B", sfb)))
    return lanes


def reference_mma(a, b, sfa, sfb, fmt=NVFP4) -> list[list[float]]:
    s, bl = fmt.scale.decode, fmt.block
    return [[sum(e2m1(a[r][k]) * s(sfa[r][k // bl]) * e2m1(b[c][k]) * s(sfb[c][k // bl])
                 for k in range(64)) for c in range(8)] for r in range(16)]


def emulated_mma(lanes, source=emu.sf_source, byte=emu.sf_byte, fmt=NVFP4
                 ) -> list[list[float]]:
    """The emulation's routing + conversion, then 4 BF16 MMAs by the m16n8k16 ISA model."""
    words = []
    ptx = emu.CONVERTS[fmt.scale.name]
    for lane, (ra, rb, _, _) in enumerate(lanes):
        wa = [convert(ra[r], lanes[source(lane, "A", r)][2], byte(lane, "A", r, fmt.block),
                      ptx) for r in range(emu.REGS["A"])]
        wb = [convert(rb[r], lanes[source(lane, "B", r)][3], byte(lane, "B", r, fmt.block),
                      ptx) for r in range(emu.REGS["B"])]
        words.append((wa, wb))
    d = [[0.0] * 8 for _ in range(16)]
    for s in range(emu.SUB_MMAS):
        am, bm = {}, {}
        for lane, (wa, wb) in enumerate(words):
            for i in range(8):
                am.setdefault(isa_bf16_a(lane, i), []).append(
                    _bf16(wa[i // 2][s] >> (16 * (i % 2))))
            for i in range(4):
                bm.setdefault(isa_bf16_b(lane, i), []).append(
                    _bf16(wb[i // 2][s] >> (16 * (i % 2))))
        assert sorted(am) == [(r, k) for r in range(16) for k in range(16)]
        assert sorted(bm) == [(k, c) for k in range(16) for c in range(8)]
        assert all(len(v) == 1 for v in (*am.values(), *bm.values()))
        for r in range(16):
            for c in range(8):
                d[r][c] += sum(am[r, k][0] * bm[k, c][0] for k in range(16))
    return d


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=["nvfp4", "mxfp4"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_emulated_mma_equals_block_scaled_mma(seed, fmt):
    rng, a, b, sfa, sfb = _random_mma(seed, fmt)
    lanes = _lane_registers(rng, a, b, sfa, sfb)
    assert emulated_mma(lanes, fmt=fmt) == reference_mma(a, b, sfa, sfb, fmt)


def test_mxfp4_scale_bytes_are_the_32_element_blocks():
    # register r of lane 4g + t covers K 8t .. 8t + 7 (+ 32 for the upper registers)
    assert [emu.sf_byte(lane, "A", r, 32) for lane in range(4) for r in range(4)] == \
        [0, 0, 1, 1] * 4
    assert [emu.sf_byte(lane, "B", r, 32) for lane in (0, 3) for r in range(2)] == [0, 1] * 2
    rng, a, b, sfa, sfb = _random_mma(9, MXFP4)
    lanes = _lane_registers(rng, a, b, sfa, sfb)
    nvfp4_bytes = emulated_mma(lanes, byte=lambda lane, op, r, block: emu.sf_byte(lane, op, r),
                               fmt=MXFP4)
    assert nvfp4_bytes != reference_mma(a, b, sfa, sfb, MXFP4)


def test_sub_mmas_cover_k_once_with_one_bijection():
    """Sub-MMA s gives K' = 2t + i the K 8t + 2s + i (A and B alike): K 0..63 once."""
    ks = []
    for s in range(emu.SUB_MMAS):
        seen_a, seen_b = {}, {}
        for lane in range(32):
            for i in range(8):  # BF16 A element i comes from FP4 register i // 2, nibble 2s+i%2
                row, kp = isa_bf16_a(lane, i)
                r, k = isa_fp4_a(lane, 8 * (i // 2) + 2 * s + i % 2)
                assert r == row
                seen_a.setdefault(kp, set()).add(k)
            for i in range(4):
                kp, col = isa_bf16_b(lane, i)
                k, c = isa_fp4_b(lane, 8 * (i // 2) + 2 * s + i % 2)
                assert c == col
                seen_b.setdefault(kp, set()).add(k)
        assert seen_a == seen_b and all(len(v) == 1 for v in seen_a.values())
        ks += [next(iter(v)) for v in seen_a.values()]
    assert sorted(ks) == list(range(64))


@pytest.mark.parametrize("slip", ["lane 4g+2", "A rows swapped", "block of K 0..31 only",
                                  "B from lane 4g+1"])
def test_emulation_check_catches_slips(slip):
    def source(lane, op, r):
        s = emu.sf_source(lane, op, r)
        if slip == "lane 4g+2" and op == "A":
            return s + 2
        if slip == "A rows swapped" and op == "A":
            return s ^ 1
        if slip == "B from lane 4g+1" and op == "B":
            return s + 1
        return s

    def byte(lane, op, r, block):
        return lane % 4 // 2 if slip == "block of K 0..31 only" else emu.sf_byte(lane, op, r)

    rng, a, b, sfa, sfb = _random_mma(7)
    lanes = _lane_registers(rng, a, b, sfa, sfb)
    assert emulated_mma(lanes, source, byte) != reference_mma(a, b, sfa, sfb)


def test_mxfp4_paired_scale_word_halves():
    """The SM120 mainloop hands MXFP4's MMAs a whole 32-bit scale word per row, two MMA K
    blocks' scales (bytes 0, 1 and 2, 3), with the selector ``byte-id`` 0 or 2 (PTX ISA,
    "Block Scaling for mma.sync": for ``.scale_vec::2X`` 2 selects the upper two bytes);
    the emulation reads byte ``byte_id + sf_byte``: the upper half must give the MMA of
    the scales there, whatever the lower half holds, and the lower half does not."""
    rng, a, b, sfa, sfb = _random_mma(11, MXFP4)
    lanes = _lane_registers(rng, a, b, sfa, sfb)
    # the MMA's scales moved to bytes 2, 3; bytes 0, 1 another K block's
    upper = [(ra, rb, (sa & 0xFFFF) << 16 | rng.getrandbits(16),
              (sb & 0xFFFF) << 16 | rng.getrandbits(16)) for ra, rb, sa, sb in lanes]
    want = reference_mma(a, b, sfa, sfb, MXFP4)
    assert emulated_mma(upper, byte=lambda lane, op, r, block: 2 + emu.sf_byte(
        lane, op, r, block), fmt=MXFP4) == want
    assert emulated_mma(upper, fmt=MXFP4) != want
