"""The sm_90a ``rs_packed`` mainloop on the CPU: packed layout, K order, decode, plan, SASS.

* the fragment-order repack (cute_fp4.packed) round-trips exactly and matches its
  definition byte by byte; K not a multiple of 64 is refused;
* a pure-Python model of the kernel's register fragments (which packed word each thread
  loads per K unit, which scale word, how a byte becomes a register) checked against the
  PTX ISA's WGMMA A-fragment layout and the activation's natural K order: a wrong byte,
  register or scale in the layout or in the kernel's indexing changes the modelled GEMM;
* the decode PTX interpreted for every E2M1 code, every finite UE4M3 scale and both row
  scales, BF16 and FP16: exact ``v * s * 2^-7``;
* plan: regions, refusals with reasons, the schedule key;
* one catalogue schedule compiled for sm_90a: HGMMA, 0 spills, smem == plan, the WGMMAs
  pipelined (``WARPGROUP.DEPBAR.LE gsb0, 0x1``: ptxas did not serialise them) and the
  fragments loaded with 16-byte shared loads.
"""

from __future__ import annotations

import random
import re

import pytest
import torch
from ptx_model import bf16 as _bf16
from ptx_model import f16 as _f16
from ptx_model import run_ptx

import cute_fp4 as cf
from cute_fp4 import catalogue, packed
from cute_fp4.errors import FormatError, InputError
from cute_fp4.formats import MXFP4, NVFP4, sf_atom_offset
from cute_fp4.kernels.sm90_rs_wide import (
    fragment_ptx,
    prepare_scale_word,
    scale_halves,
    scale_select,
    sf_word_offset,
)
from cute_fp4.nvfp4 import E2M1_VALUES, NVFP4Tensor, quantize
from cute_fp4.schedule import Mainloop, Problem, Schedule, Tile, Warps

RS = [s for s in catalogue.all_schedules("sm90", grouped=False)
      if s.mainloop is Mainloop.RS_PACKED]


# ----------------------------------------------------------------------------- packing

@pytest.mark.parametrize("chunk", [None, 1], ids=["whole", "unit_chunks"])
@pytest.mark.parametrize("n, k", [(64, 64), (8, 64), (200, 128), (1000, 192), (64, 4096)])
def test_pack_round_trip_and_definition(n, k, chunk, monkeypatch):
    """The definition byte by byte; ``unit_chunks``: pack and unpack one 64-row unit at a
    time (as they do through a large weight), a wrong chunk offset moves bytes."""
    if chunk is not None:
        monkeypatch.setattr(packed, "_CHUNK_BYTES", chunk)
    data = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    p = packed.pack(data)
    assert p.shape == (packed.packed_rows(n), k // 2)
    assert torch.equal(packed.unpack(p, n), data)
    flat = p.reshape(-1)
    rng = random.Random(n * k)
    for _ in range(3000):
        rb, ku = rng.randrange(p.shape[0] // 64), rng.randrange(k // 64)
        t, kb, j = rng.randrange(128), rng.randrange(4), rng.randrange(4)
        r, c = packed.source_of(t, kb, j)
        r, c = r + 64 * rb, c + 32 * ku
        want = int(data[r, c]) if r < n else 0  # padding rows are zero
        at = ((rb * (k // 64) + ku) * 128 + t) * 16 + 4 * kb
        word = int.from_bytes(bytes(flat[at:at + 4].tolist()), "little")
        got = packed.fragment_code(word, 2 * j) | packed.fragment_code(word, 2 * j + 1) << 4
        assert got == want, (rb, ku, t, kb, j)


def test_packed_weight_round_trip_and_refusals():
    w = quantize(torch.randn(136, 192))
    pw = packed.repack(w)
    back = pw.unpack()
    assert torch.equal(back.data, w.data) and back.shape == w.shape
    assert torch.equal(back.scale.view(torch.uint8), w.scale.view(torch.uint8))
    assert torch.equal(back.global_scale, w.global_scale)
    assert pw.data.shape == (192, 96)
    with pytest.raises(FormatError, match="multiple of 64"):
        packed.repack(quantize(torch.randn(64, 96)))
    with pytest.raises(FormatError, match="must have 192 rows"):
        packed.unpack(pw.data[:64], 136)


def test_a_stack_packs_in_chunks_to_the_same_bytes(monkeypatch):
    stack = torch.randint(0, 256, (3, 200, 64), dtype=torch.uint8)
    whole = packed.pack(stack)
    assert torch.equal(whole[1], packed.pack(stack[1]))
    monkeypatch.setattr(packed, "_CHUNK_BYTES", 1)
    assert torch.equal(packed.pack(stack), whole)
    assert torch.equal(packed.unpack(whole, 200), stack)


def test_pack_is_a_permutation():
    """Every byte of a unit lands once: the packed unit is a permutation of the plain one."""
    data = torch.arange(64 * 32, dtype=torch.int64).reshape(64, 32)
    src = {packed.source_of(t, kb, j) for t in range(128) for kb in range(4) for j in range(4)}
    assert len(src) == 64 * 32 and src == {(r, c) for r in range(64) for c in range(32)}
    p = packed.restore_signs(packed.pack((data % 251).to(torch.uint8)))
    assert sorted(p.flatten().tolist()) == sorted((data % 251).flatten().tolist())


def test_sign_moves_are_inverse_and_place_each_sign_once():
    assert sorted(packed.SIGN_BIT) == [3 + 4 * i for i in range(8)]
    data = torch.randint(0, 256, (64, 32), dtype=torch.uint8)
    moved = packed.move_signs(data)
    assert torch.equal(packed.restore_signs(moved), data)
    assert torch.equal(moved & 0x77, data & 0x77)  # magnitudes stay in their nibbles
    words = moved.view(torch.int32).flatten().tolist()
    plain = data.view(torch.int32).flatten().tolist()
    for w, q in zip(words[:200], plain[:200]):
        for i in range(8):
            assert packed.fragment_code(w & 0xFFFFFFFF, i) == (q >> 4 * i) & 0xF


# ----------------------------------------------------------------------------- K order

def isa_a_fragment(t: int, j: int, h: int) -> tuple[int, int]:
    """PTX ISA, wgmma 16-bit A in registers (m64 x k16): thread ``t`` register ``j`` half
    ``h`` holds (row, k) of the 64 x 16 A tile."""
    w, lane = divmod(t, 32)
    g, c = divmod(lane, 4)
    return 16 * w + g + 8 * (j % 2), 2 * c + 8 * (j // 2) + h


def kernel_fragments(w: NVFP4Tensor, tile_k: int, k_tile: int, t: int, row_block: int):
    """What the kernel puts in thread ``t``'s A registers for K tile ``k_tile`` of the
    weight's 64-row block ``row_block`` (tile N = 128, this block at ``row_block % 2``):
    ``{(kb, j, h): value}`` with ``kb`` the K block inside the tile. Mirrors
    PackedRegisterMainloop: words ``4t .. 4t+3`` of unit (ku, block), scale word
    ``sf_word_offset(row) + 128 ku`` of the stage, byte ``j`` of word ``kq`` -> register ``j``
    with the scale of row ``r0`` (j even) or ``r0 + 8`` (j odd)."""
    n, k = w.shape
    stage_k_units = tile_k // 64
    pdata = packed.pack(w.data).reshape(-1)
    sf = w.scale.view(torch.uint8).reshape(-1)
    tile_row0 = (row_block // 2) * 128
    b = row_block % 2  # the 64-row block inside the 128-row tile (wg * m_blocks + b)
    col_blocks = -(-k // 64)
    # the stage's scale atoms: (16, 32, ku, row_atom) bytes copied from the blocked layout
    stage_sf = {}
    for ra in range(1):
        for ku in range(stage_k_units):
            cb = k_tile * stage_k_units + ku
            base = ((tile_row0 // 128 + ra) * col_blocks + cb) * 512
            for i in range(512):
                stage_sf[(ra * stage_k_units + ku) * 512 + i] = int(sf[base + i])
    lane = t % 32
    r0 = (t // 32) * 16 + lane // 4
    out = {}
    for kb in range(tile_k // 16):
        ku, kq = divmod(kb, 4)
        unit = (tile_row0 // 64 + b) * (k // 64) + k_tile * stage_k_units + ku
        at = unit * 2048 + 16 * t + 4 * kq
        word = int.from_bytes(bytes(pdata[at:at + 4].tolist()), "little")
        for j in range(4):
            row = b * 64 + r0 + 8 * (j % 2)  # row inside the weight tile
            wo = sf_word_offset(row, stage_k_units) + ku * 128
            scale_byte = stage_sf[4 * wo + kq]
            s = float(torch.tensor([scale_byte], dtype=torch.uint8).view(torch.float8_e4m3fn)
                      .float())
            for h in range(2):
                code = packed.fragment_code(word, 2 * j + h)
                v = E2M1_VALUES[code & 7] * (-1 if code & 8 else 1)
                out[(kb, j, h)] = v * s
    return out


@pytest.mark.parametrize("tile_k, k_tile, row_block", [(64, 0, 0), (64, 2, 1), (128, 1, 3),
                                                       (128, 0, 2)])
def test_register_fragments_follow_the_activation_k_order(tile_k, k_tile, row_block):
    """Thread t's register (kb, j, h) holds W[row, K] exactly where the ISA says WGMMA
    multiplies it with the activation's K element 16 kb + k (natural order) of K tile
    ``k_tile``: the modelled kernel fragments equal the block values W = e2m1 x scale."""
    torch.manual_seed(tile_k + row_block)
    w = quantize(torch.randn(256, 384) * torch.logspace(-3, 3, 384))
    vals = w.block_values(torch.float64)
    for t in range(0, 128, 5):
        frag = kernel_fragments(w, tile_k, k_tile, t, row_block)
        for (kb, j, h), v in frag.items():
            r, kk = isa_a_fragment(t, j, h)
            assert v == float(vals[row_block * 64 + r, k_tile * tile_k + 16 * kb + kk]), \
                (t, kb, j, h)


def test_fragment_model_catches_a_swapped_register():
    w = quantize(torch.randn(128, 128))
    vals = w.block_values(torch.float64)
    frag = kernel_fragments(w, 64, 0, 7, 0)
    wrong = 0
    for (kb, j, h), v in frag.items():
        r, kk = isa_a_fragment(7, j ^ 1, h)  # rows g and g + 8 swapped
        wrong += v != float(vals[r, 16 * kb + kk])
    assert wrong > 0


def test_scale_word_offsets_match_the_blocked_layout():
    for k_units in (1, 2):
        for row in range(256):
            for ku in range(k_units):
                for kq in range(4):
                    byte = 4 * (sf_word_offset(row, k_units) + 128 * ku) + kq
                    c = 4 * ku + kq
                    want = ((row // 128) * k_units * 512 + (c // 4) * 512
                            + sf_atom_offset(row % 128, c % 4))
                    assert byte == want


def test_groups_alternate_buffers_across_tiles():
    """The A buffers alternate g % 2: an even group count per tile keeps them alternating
    across the K-tile boundary, which the wait_group(1) reuse argument needs."""
    from cute_fp4.kernels.sm90_rs_wide import group_k_blocks

    for tile_k in (64, 128, 192, 256):
        for m_blocks in (1, 2):
            assert (tile_k // (16 * group_k_blocks(tile_k, m_blocks))) % 2 == 0
    assert group_k_blocks(128, 1) == 4 and group_k_blocks(64, 1) == group_k_blocks(128, 2) == 2


# ----------------------------------------------------------------------------- decode PTX



@pytest.mark.parametrize("fmt, bf16", [(NVFP4, True), (NVFP4, False), (MXFP4, True)],
                         ids=["nvfp4-bf16", "nvfp4-fp16", "mxfp4-bf16"])
def test_tables_and_scale_words_meet_at_the_lut_exponent(fmt, bf16):
    """The decode tables hold each E2M1 magnitude times 2^e and a raw scale word holds each
    scale times 2^-e (e = the scale type's lut_exponent), both halves: their product,
    the decode's one multiply, is the exact value v * s."""
    from cute_fp4.kernels.sm90_rs_wide import lut_words, raw_scale_word, scale_decode

    half = torch.bfloat16 if bf16 else torch.float16
    e = scale_decode(fmt, bf16).lut_exponent

    def halves(words):  # little-endian 16-bit halves of 32-bit words, as the 16-bit type
        return torch.tensor([(w >> s) & 0xFFFF for w in words for s in (0, 16)],
                            dtype=torch.int32).to(torch.int16).view(half).double()

    (lo0, lo1), (hi0, hi1) = lut_words(bf16, e)
    lo = (lo0 | lo1 << 32).to_bytes(8, "little")
    hi = (hi0 | hi1 << 32).to_bytes(8, "little")
    table = halves([lo[i] | hi[i] << 8 | lo[i + 1] << 16 | hi[i + 1] << 24
                    for i in range(0, 8, 2)])
    assert (table * 2.0**-e).tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    scales = _scale_codes(fmt)
    words = halves([raw_scale_word(b, bf16, fmt) for b in scales]) * 2.0**e
    assert words.tolist() == [fmt.scale.decode(b) for b in scales for _ in range(2)]


def _scale_codes(fmt) -> list[int]:
    """The finite scale codes the kernels take: UE4M3's but NaN 0x7F, UE8M0's up to 252."""
    return [b for b in range(128) if b != 0x7F] if fmt is NVFP4 else list(range(253))


def test_lut_words_are_the_tables_of_2026_12_01():
    """The computed tables are the constants the decode was written with (so the compiled
    decode, and its SASS, stayed the same when the tables became data)."""
    from cute_fp4.kernels.sm90_rs_wide import lut_words, scale_decode

    assert lut_words(True, scale_decode(NVFP4, True).lut_exponent) == (
        (0xC0800000, 0xC0804000), (0x7B7B7B00, 0x7C7C7C7C))
    assert lut_words(False, scale_decode(NVFP4, False).lut_exponent) == (
        (0x00000000, 0x00000000), (0x5E5C5800, 0x66646260))


def _tables(bf16: bool, fmt=NVFP4) -> list[int]:
    from cute_fp4.kernels.sm90_rs_wide import lut_words, scale_decode

    (lo0, _), (hi0, _) = lut_words(bf16, scale_decode(fmt, bf16).lut_exponent)
    return [hi0, lo0] if bf16 else [hi0]


def _decode(q: int, row_words: tuple[int, int], kq: int, bf16: bool, ptx=None, fmt=NVFP4,
            parity: int = 0) -> list[int]:
    """The kernel's decode of K block ``kq`` of a unit (of ``parity`` in its scale word,
    MXFP4): packed word ``q``, the raw 4-byte scale words of rows g and g + 8."""
    odd, half = scale_select(fmt, kq, parity)
    s = [scale_halves(prepare_scale_word(w, bf16, fmt), odd, bf16, fmt) for w in row_words]
    return run_ptx(ptx or fragment_ptx(bf16, half, fmt), [q, *s, *_tables(bf16, fmt)], 4)


def _ue4m3(b: int) -> float:
    return float(torch.tensor([b], dtype=torch.uint8).view(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("fmt, bf16", [(NVFP4, True), (NVFP4, False), (MXFP4, True)],
                         ids=["nvfp4-bf16", "nvfp4-fp16", "mxfp4-bf16"])
def test_decode_is_exact_for_every_code_and_scale(fmt, bf16):
    """Every E2M1 code in every nibble, every finite scale (UE4M3; UE8M0 0..252) in the
    byte each K block reads (NVFP4: byte kq; MXFP4: 2 parity + kq // 2 for a unit of either
    parity) of both rows' scale words, the other bytes random (UE4M3: sign bits included;
    UE8M0: any code a tensor holds): ``v * s`` exactly (BF16 subnormals included)."""
    to_float = _bf16 if bf16 else _f16
    bad = []
    scales = _scale_codes(fmt)
    for i, sb in enumerate(scales):
        other = scales[(i * 37 + 11) % len(scales)]
        for parity in range(1 if fmt is NVFP4 else 2):
            for kq in range(4):
                byte = kq if fmt is NVFP4 else 2 * parity + kq // 2
                rng = random.Random(8 * i + 4 * parity + kq)
                junk = [rng.getrandbits(32) if fmt is NVFP4
                        else sum(rng.randrange(253) << 8 * x for x in range(4))
                        for _ in range(2)]
                w_lo = (junk[0] & ~(0xFF << 8 * byte)) | sb << 8 * byte
                w_hi = (junk[1] & ~(0xFF << 8 * byte)) | other << 8 * byte
                for c in range(0, 16, 1 if kq == i % 4 else 5):
                    plain = sum(((c + r) % 16) << 4 * r for r in range(8))
                    q = packed.move_signs(torch.tensor(list(plain.to_bytes(4, "little")),
                                                       dtype=torch.uint8)).tolist()
                    out = _decode(int.from_bytes(bytes(q), "little"), (w_lo, w_hi), kq, bf16,
                                  fmt=fmt, parity=parity)
                    for j in range(4):
                        s = fmt.scale.decode(sb if j % 2 == 0 else other)
                        for h in range(2):
                            code = (plain >> (8 * j + 4 * h)) & 0xF
                            want = E2M1_VALUES[code & 7] * (-1 if code & 8 else 1) * s
                            got = to_float(out[j] >> 16 * h)
                            if got != want:
                                bad.append((hex(plain), parity, kq, j, h, sb, got, want))
    assert bad[:5] == []


@pytest.mark.parametrize("bf16", [True, False])
def test_scale_halves_are_the_raw_scales_of_each_byte(bf16):
    from cute_fp4.kernels.sm90_rs_wide import raw_scale_word, scale_halves

    rng = random.Random(5)
    for word in [rng.getrandbits(32) for _ in range(300)] + [0, 0xFFFFFFFF, 0x7F7F7F7F]:
        for kq in range(4):
            got = (scale_halves(word, bool(kq % 2), bf16, NVFP4) >> 16 * (kq // 2)) & 0xFFFF
            want = raw_scale_word((word >> 8 * kq) & 0xFF, bf16, NVFP4) & 0xFFFF
            assert got == want, (hex(word), kq)


def test_mxfp4_byte_scale_is_the_prepared_half_for_every_code():
    """The stream kernel's MXFP4 scales (``scale_byte_half``: the PRMT string the kernel
    inlines, run by tests/ptx_model.py, then ``byte_scale``) equal the half the decode read
    before (``prepare_scale_word`` of the word shifted to the unit's half, then
    ``scale_halves``) and the raw scale, for every UE8M0 code the kernels take (0..252,
    code 0 being 2^-127, not zero) at every byte of the word, the other bytes arbitrary;
    the high half is zero (the decode reads half 0)."""
    from cute_fp4.kernels.sm90_rs_wide import (
        BYTE_SELECT_PTX,
        byte_scale,
        byte_selector,
        raw_scale_word,
    )
    from cute_fp4.mxfp4 import MAX_KERNEL_CODE

    rng = random.Random(7)
    for code in range(MAX_KERNEL_CODE + 1):
        for parity, odd in ((0, 0), (0, 1), (1, 0), (1, 1)):
            pos = 2 * parity + odd
            rest = [rng.randrange(MAX_KERNEL_CODE + 1) for _ in range(4)]
            rest[pos] = code
            word = sum(b << 8 * i for i, b in enumerate(rest))
            (b,) = run_ptx(BYTE_SELECT_PTX, [word, byte_selector(pos)], 1)
            got = byte_scale(b, True, MXFP4)
            before = scale_halves(prepare_scale_word(word >> 16 * parity, True, MXFP4),
                                  bool(odd), True, MXFP4)
            assert got == before & 0xFFFF == raw_scale_word(code, True, MXFP4) & 0xFFFF, \
                (code, pos)
            assert got >> 16 == 0


def test_scale_select_reads_the_right_byte():
    # NVFP4: K block kq reads byte kq of its unit's word; MXFP4: byte 2 p + kq // 2
    assert [scale_select(NVFP4, kq) for kq in range(4)] == [(False, 0), (True, 0),
                                                           (False, 1), (True, 1)]
    assert [scale_select(MXFP4, kq, p) for p in range(2) for kq in range(4)] == [
        (False, 0), (False, 0), (True, 0), (True, 0), (False, 1), (False, 1), (True, 1),
        (True, 1)]


def test_decode_check_catches_a_swapped_scale():
    swapped = fragment_ptx(True, 0, NVFP4).replace("{$r2}", "{$rX}").replace("{$r1}", "{$r2}") \
        .replace("{$rX}", "{$r1}")
    words = (0x38, 0x40)
    assert _decode(0x22222222, words, 0, True) != _decode(0x22222222, words, 0, True, swapped)


def test_decode_check_catches_an_unmoved_sign():
    """The plain nibble signs read through the packed decode are wrong: the sign move is
    what the decode relies on (a pack that forgot it would fail the GEMM tests, too)."""
    plain = 0x1A3C5E7F  # signs alternate across the nibbles
    moved = int.from_bytes(bytes(packed.move_signs(torch.tensor(
        list(plain.to_bytes(4, "little")), dtype=torch.uint8)).tolist()), "little")
    words = (0x38, 0x38)
    assert _decode(plain, words, 0, True) != _decode(moved, words, 0, True)


# ----------------------------------------------------------------------------- plan

def _rs(**kw) -> Schedule:
    base = dict(target="sm_90a", tile=Tile(256, 128, 64), warps=Warps(mma=(2, 1)),
                mainloop="rs_packed")
    base.update(kw)
    return Schedule(**base)


def test_catalogue_has_rs_packed_schedules_that_plan():
    assert len(RS) >= 3
    for s in RS:
        for fmt in ("bf16", "fp16", "nvfp4"):
            p = cf.plan(s, Problem(4096, 8192, 8192, fmt))
            if fmt == "nvfp4" and s.tile.m % 64:  # W4A4's activation tiles: 64 or 128k rows
                assert not p.ok and "tile M" in "; ".join(p.reasons), (s.name, p.reasons)
                continue
            assert p.ok, (s.name, fmt, p.reasons)
            assert p.stages >= 2
            names = [r.name for r in p.regions]
            assert ("A16" in names) == (fmt == "nvfp4") and "B16" not in names


def test_rs_packed_regions_count_the_stages():
    p = cf.plan(_rs(stages=3), Problem(256, 4096, 4096, "bf16"))
    by = {r.name: r.bytes for r in p.regions}
    assert by["A"] == 3 * 256 * 64 * 2 and by["B"] == 3 * 128 * 32 and by["SFB"] == 3 * 512
    assert by["C"] == 0 and "SFA" not in by


@pytest.mark.parametrize("kw, reason", [
    (dict(swap_ab=True, scheduler=cf.schedule.Scheduler(persistent=False)), "swap_ab False"),
    (dict(tile=Tile(256, 64, 64)), "tile N"),
    (dict(warps=Warps(mma=(1, 2))), "Warps.mma"),
    (dict(tile=Tile(256, 256, 64)), "accumulator registers"),
    (dict(tile=Tile(260, 128, 64)), "multiple of 8"),
    (dict(tile=Tile(256, 128, 256)), "tile K"),
])
def test_rs_packed_refusals(kw, reason):
    p = cf.plan(_rs(**kw), Problem(256, 4096, 4096, "bf16"))
    assert not p.ok and any(reason in r for r in p.reasons), p.reasons


def test_rs_packed_refuses_k_tails_and_other_targets():
    p = cf.plan(_rs(), Problem(256, 4096, 4128, "bf16"))
    assert not p.ok and any("multiple of 64" in r for r in p.reasons)
    p = cf.plan(_rs(target="sm_120a"), Problem(256, 4096, 4096))
    assert not p.ok and any("sm_90a only" in r for r in p.reasons)
    w4a4 = cf.plan(_rs(tile=Tile(200, 128, 64)), Problem(256, 4096, 4096, "nvfp4"))
    assert not w4a4.ok and any("W4A4" in r for r in w4a4.reasons)


def test_key_changes_with_the_mainloop():
    std = _rs(mainloop="standard")
    assert "mainloop" not in std.key() and "mainloop" in _rs().key()
    assert std.key() != _rs().key()
    assert _rs().mainloop is Mainloop.RS_PACKED and "rs_packed" in _rs().label()
    with pytest.raises(InputError, match="mainloop"):
        _rs(mainloop="bogus")


def test_packed_heuristic_and_resolution():
    from cute_fp4.api import heuristic
    from cute_fp4.tuning import resolve_packed

    for m in (1, 8, 9, 64, 65, 512, 513, 8192):
        s = heuristic("sm90", m, 8192, 8192, packed=True)
        want = Mainloop.STREAM if m <= 8 else Mainloop.RS_PACKED  # the decode kernel
        assert s.mainloop is want and cf.plan(s, (m, 8192, 8192, "bf16")).ok
    assert heuristic("sm90", 4096, 8192, 8192).mainloop is Mainloop.STANDARD
    assert heuristic("sm120", 1, 8192, 8192, packed=True).mainloop is Mainloop.STREAM
    with pytest.raises(InputError, match="16-bit activations"):
        heuristic("sm120", 1, 8192, 8192, packed=True, a_format="nvfp4")
    with pytest.raises(InputError, match="plain weight layout"):
        resolve_packed("sm90_default", 16, 4096, 4096, "bf16", torch.bfloat16)


def test_run_refuses_a_layout_mismatch():
    from cute_fp4.run import run_checked

    class Kern:
        schedule = RS[0]

    w = quantize(torch.randn(64, 64))
    with pytest.raises(InputError, match="rs_packed schedules take"):
        run_checked(Kern(), torch.zeros(1, 64), w, None, None, (1, 64, 64, "bf16"))

    class Plain:
        schedule = catalogue.get("sm90_default")

    with pytest.raises(InputError, match="rs_packed schedules take"):
        run_checked(Plain(), torch.zeros(1, 64), packed.repack(w), None, None,
                    (1, 64, 64, "bf16"))


# ----------------------------------------------------------------------------- compile

@pytest.mark.compile
def test_rs_packed_compiles_pipelined(tmp_path):
    from cute_fp4.compile import compile_report

    s = catalogue.get("sm90_rs_packed")
    row = compile_report(s, "sm_90a", Problem(a_format="bf16"), dump_dir=tmp_path)
    assert row["ok"], row.get("reason")
    assert row["spills"] == 0 and row["kernel_smem_bytes"] == row["smem_bytes"]
    assert any(op.startswith("HGMMA.64x256x16") for op in row["mma_instructions"])
    sass = next(tmp_path.glob("*.sass")).read_text()
    # WGMMAs in flight while the next group decodes (serialised ones wait at 0 after each)
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass
    assert len(re.findall(r"\bLDS\.128\b", sass)) >= 1
    assert row["kloop"]["mma"] == 4


# the decode K loop's SASS as measured (sm_90a, 2026-12-01, sm90_rs_packed_decode_128 at
# M = 1, K tile 128, one WGMMA per K block): 217 instructions per K tile (324 before the
# decode rework), PRMT 8 and LOP3 4 per K block; the budget leaves a few for ptxas noise.
# A regression guard (docs/testing.md, "Frozen figures").
KLOOP_BUDGET = {"instructions": 232, "PRMT": 8, "LOP3": 4, "HMUL2": 4}


@pytest.mark.compile
def test_decode_kloop_stays_inside_its_instruction_budget(tmp_path):
    """The decode's K loop is ALU-bound on the H200 (perf/results/2026-12-01-h200-decode*):
    its size per K tile and its PRMT/LOP3/HMUL2 per K block may not grow, and no decode
    constant is re-materialised from a uniform register inside it (the pinned tables)."""
    from collections import Counter

    from cute_fp4.compile import compile_report
    from cute_fp4.inspect import find_kloop, parse_sass

    row = compile_report("sm90_rs_packed_decode_128", "sm_90a", Problem(1, 8192, 8192, "bf16"),
                         dump_dir=tmp_path)
    assert row["ok"] and row["spills"] == 0, row.get("reason")
    sass = next(tmp_path.glob("*.sass")).read_text()
    k = find_kloop(sass)
    body = [i for i in parse_sass(sass)[k.function] if k.head <= i.addr <= k.tail]
    ops = Counter(i.opcode.split(".")[0] for i in body)
    assert k.mma == 8 and k.instructions <= KLOOP_BUDGET["instructions"], (k, ops)
    for op in ("PRMT", "LOP3", "HMUL2"):
        assert ops[op] <= KLOOP_BUDGET[op] * k.mma, (op, ops)
    remat = [i for i in body if i.opcode == "IMAD.U32" and i.operands[1:3] == ("RZ", "RZ")
             and i.operands[3].startswith("UR")]
    assert len(remat) <= 2, remat


@pytest.mark.compile
@pytest.mark.parametrize("name", ["sm90_rs_packed", "sm90_rs_packed_w256"])
def test_fragment_registers_are_where_the_decode_writes_them(name):
    """Traced (no GPU): the kernel's A fragment of one group (64 rows x 32 K) holds, at
    32-bit word ``4 j + i`` half ``h`` (what ``_decode_group`` writes: register ``i`` of
    K block ``j``), the (row, K) the PTX ISA gives register ``i`` of K block ``j`` — CuTe's
    partition of the RS tiled MMA agrees with the byte order of cute_fp4.packed."""
    import cutlass.cute as cute

    from cute_fp4.compile import kernel_class
    s = catalogue.get(name)
    k = kernel_class(s)(s, Problem(a_format="bf16"))
    out = {}
    group = k.rs_group

    def walk():
        k._setup()
        bad = 0
        for t in range(128):
            part = k.tiled_mma.get_slice(t).partition_A(
                cute.make_identity_tensor((64, 16 * group)))
            assert cute.size(part) == 8 * group
            for j in range(group):
                for i in range(4):
                    for h in range(2):
                        r, kk = isa_a_fragment(t, i, h)
                        bad += tuple(part[2 * (4 * j + i) + h]) != (r, 16 * j + kk)
        # the activation (WGMMA's B): K block kb of a tile is K columns 16 kb .. 16 kb + 15
        tm, tk = s.tile.m, s.tile.k
        pb = k.tiled_mma.get_slice(0).partition_B(cute.make_identity_tensor((tm, tk)))
        for kb in range(tk // 16):
            blk = pb[(None, None, kb)]
            cols = {blk[v][1] for v in range(cute.size(blk))}
            bad += cols != set(range(16 * kb, 16 * kb + 16))
        out["bad"] = bad

    @cute.jit
    def probe():
        walk()

    cute.compile(probe, options="--gpu-arch sm_90a")
    assert out == {"bad": 0}
