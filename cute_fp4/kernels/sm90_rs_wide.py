"""SM90 register-sourced WGMMA mainloop on a fragment-order packed weight (``rs_packed``).

``D^T[N, M] = B[N, K] @ A[M, K]^T`` for every M: the NVFP4 weight B (repacked offline,
:mod:`cute_fp4.packed`) is WGMMA's A operand, decoded in registers; the activation A is
WGMMA's B operand, TMA'd straight into WGMMA's 128-byte-swizzled K-major layout in its
natural K order (W4A16: no conversion pass). D^T is stored from registers through a
transposed view of D (the shared masked store). A mainloop choice of
:class:`~cute_fp4.kernels.sm90.Sm90Gemm`: loads, work units (persistent, grouped raster,
split-K), warp roles and the epilogue are the kernel's shared components.

Tile: ``tile.n`` weight rows (128 or 256) over ``Warps.mma = (W, 1)`` consumer warpgroups
of 64 or 128 rows (one or two WGMMA M blocks of 64), ``tile.m`` activation rows (WGMMA's N,
8..256), ``tile.k`` 64 or 128 per stage. Per stage the producer warp TMAs the activation
tile, the packed weight tile (``tile.n / 64`` x ``tile.k / 64`` units of 2,048 bytes) and
its 128x4 scale atoms. A consumer warpgroup, per K tile:

* loads its fragment bytes (one 16-byte ``ld.shared`` per M block and 64 K elements) and its
  scales (one 32-bit word per row and 64 K elements) into registers;
* walks the tile in groups of K blocks (:func:`group_k_blocks`: four, 64 K, with one M
  block per warpgroup and K tiles of 128; else two): ``wait_group(1)`` (the WGMMAs of the
  group before last are done, so the A buffer of this group is free), decodes the group
  into one of two A-fragment buffers, ``fence``, issues its WGMMAs (``64 x tile.m x 16``
  per M block and K block) and commits. Decoding group g + 1 overlaps the WGMMAs of group
  g; the group count per tile is even, so buffers alternate across tiles too;
* releases the stage of the previous K tile at the second group's wait (every WGMMA that
  read it is done); the last stage of a unit after ``wait_group(0)``.

Decode (exact, :func:`fragment_ptx`): fragment register ``a_j`` of a K block is one packed
byte; byte ``j`` of the 32-bit word ``4 kb .. 4 kb + 3`` (see cute_fp4.packed) becomes two
16-bit values looked up by PRMT in 8-entry tables of ``v * 2^e`` (table words pinned in
registers, :func:`decode_tables`), their signs merged from where the repack put them (on
the table bytes' sign bits, ``cute_fp4.packed.SIGN_BIT``: one LOP3 per four codes), times
the row's raw scale ``s * 2^-e`` (one HMUL2, BF16 or FP16 as the activation, the scale
broadcast from one half of a :func:`scale_halves` word, or of a :func:`scale_byte_half`
one in the stream kernel's MXFP4): ``v * s`` exactly, in the true
units (no offset in the accumulator; W4A4's activation conversion leaves its ``2^-7``,
which the epilogue multiplies back with alpha). Rows ``g`` (``j`` even) and ``g + 8``
(``j`` odd) take their own scale. Per K block and thread (8 codes): 13 integer
instructions and 4 HMUL2 (BF16), plus 2 per row and 64 K for the scale words.

W4A4: the packed activation stage is converted once per stage by every consumer thread
into one FP16 buffer (Sm90Gemm.convert, the shared-memory sourced mainloop's conversion)
after ``wait_group(0)`` and a barrier of all consumers; the weight path is unchanged.
Correct but not overlapped across the stage boundary (W4A16 is the target of this path).
"""

from __future__ import annotations

import functools
import struct
from typing import TYPE_CHECKING, NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import warpgroup

from cute_fp4.formats import E2M1, SF_ATOM_BYTES, SF_ATOM_ROWS, BlockFormat, sf_atom_offset
from cute_fp4.kernels.epilogue import d_tile, fused_tile, store_direct
from cute_fp4.kernels.roles import WARPGROUP, Barrier
from cute_fp4.kernels.scheduler import WorkTile, for_each_unit
from cute_fp4.packed import UNIT_BYTES, UNIT_K, UNIT_ROWS

if TYPE_CHECKING:  # sm90 imports this module
    from cute_fp4.kernels.sm90 import SmemTensors

GROUP_K_BLOCKS = 2  # K blocks (16 elements) decoded and issued per WGMMA commit group...
WIDE_GROUP_K_BLOCKS = 4  # ... or this many with one M block per warpgroup and K tiles of 128


def group_k_blocks(tile_k: int, m_blocks: int) -> int:
    """K blocks per WGMMA commit group: four (four decode chains in flight per thread, one
    wait and fence per 64 K) where the A buffers stay small (one 64-row M block) and a K
    tile still holds an even number of groups, else two."""
    wide = m_blocks == 1 and tile_k % (2 * 16 * WIDE_GROUP_K_BLOCKS) == 0
    return WIDE_GROUP_K_BLOCKS if wide else GROUP_K_BLOCKS



class ScaleDecode(NamedTuple):
    """How the decode turns a scale byte into its 16-bit multiplier ``s * 2^-e``: the
    tables hold the E2M1 magnitudes times ``2^e`` (``lut_exponent``); the byte, masked to
    ``mask`` and plus ``offset``, lands on the 16-bit type's exponent field at bit ``shift``
    (UE4M3: its 7 bits at bit 4 read as the BF16 number ``s * 2^-120``, at bit 7 as the
    FP16 ``s * 2^-8``, subnormal for small scales, exact; UE8M0 ``e``: ``e + 1`` at bit 7,
    the BF16 number ``2^(e - 126)``, normal for every code up to 253, against tables of
    ``v / 2``: ``v * 2^(e - 127)``, a BF16 number for every code up to 252)."""

    lut_exponent: int
    mask: int
    shift: int
    offset: int = 0


# (scale type, BF16?) -> its decode; a format whose scale type has no entry has no decode
# (UE8M0 into FP16: its range is beyond FP16's; plan() refuses it)
SCALE_DECODE = {("ue4m3", True): ScaleDecode(120, 0x7F, 4),
                ("ue4m3", False): ScaleDecode(8, 0x7F, 7),
                ("ue8m0", True): ScaleDecode(-1, 0xFF, 7, 1)}


def scale_decode(fmt: BlockFormat, bf16: bool) -> ScaleDecode:
    """The :class:`ScaleDecode` of ``fmt``'s scale type into BF16 (``bf16``) or FP16."""
    dec = SCALE_DECODE.get((fmt.scale.name, bf16))
    if dec is None:
        raise AssertionError(f"no {'BF16' if bf16 else 'FP16'} decode of {fmt.scale.name} "
                             f"scales ({fmt.name}): plan() must refuse it")
    return dec


def lut_words(bf16: bool, exponent: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The decode's tables: the E2M1 magnitudes times ``2^exponent`` as 16-bit numbers
    (BF16 or FP16), as (low bytes, high bytes) tables of 8 entries in two 32-bit words
    each: the decode looks codes up with PRMT."""
    def bits16(v: float) -> int:  # exact: every table value is a BF16 and an FP16 number
        if bf16:
            return struct.unpack("<I", struct.pack("<f", v))[0] >> 16
        return struct.unpack("<H", struct.pack("<e", v))[0]

    bits = [bits16(v * 2.0**exponent) for v in E2M1.magnitudes]

    def words(byte_of):
        return tuple(sum(byte_of(bits[4 * w + i]) << (8 * i) for i in range(4))
                     for w in range(2))

    return words(lambda b: b & 0xFF), words(lambda b: b >> 8)


def raw_scale_word(sf, bf16: bool, fmt: BlockFormat):
    """A scale byte of ``fmt`` -> its multiplier ``s * 2^-e`` (:class:`ScaleDecode`) in
    both 16-bit halves: the multiplier of :func:`fragment_ptx`."""
    dec = scale_decode(fmt, bf16)
    return ((sf & dec.mask) + dec.offset) * (0x00010001 << dec.shift)


def prepare_scale_word(word, bf16: bool, fmt: BlockFormat):
    """A loaded word of four scale bytes of ``fmt`` with the decode's ``offset`` added to
    every byte (UE8M0: ``e + 1``, no carry for codes up to 252): one add per word, before
    :func:`scale_halves` (the word itself for UE4M3)."""
    dec = scale_decode(fmt, bf16)
    return word + dec.offset * 0x01010101 if dec.offset else word


def scale_halves(word, odd: bool, bf16: bool, fmt: BlockFormat):
    """A :func:`prepare_scale_word` word of four scale bytes of ``fmt`` (one row and
    ``fmt.atom_k`` K elements: one 64-K unit of NVFP4, two of MXFP4) -> the
    :func:`raw_scale_word` halves of bytes 0 and 2 (``odd`` False) or 1 and 3: one shift
    and one mask, the two words of a row shared by the K blocks that read them
    (:func:`scale_select`; plain integer arithmetic: the kernel and the CPU tests run it)."""
    dec = scale_decode(fmt, bf16)
    shift = dec.shift
    mask = (dec.mask * 0x00010001) << shift
    return ((word >> (8 - shift)) if odd else (word << shift)) & mask


def byte_selector(byte):
    """The PRMT selector (``prmt.b32 d, word, 0, sel``) that puts byte ``byte`` (0..3, may
    be a runtime value) of a word into byte 0 and zeros into bytes 1..3."""
    return byte + 0x4440


BYTE_SELECT_PTX = "prmt.b32 {$w0}, {$r0}, 0, {$r1};"
"""``{$r0}`` a word, ``{$r1}`` a :func:`byte_selector` -> ``{$w0}`` that byte, zero-extended."""


def byte_scale(b, bf16: bool, fmt: BlockFormat):
    """A scale byte ``b`` (zero-extended, a format whose byte needs no mask: UE8M0) -> its
    :func:`raw_scale_word` low half, ``(b + offset) << shift`` as one multiply-add (UE8M0:
    ``e + 1`` at bit 7, at most 253 << 7 for the codes up to 252 the kernels take; the high
    half stays zero). Plain integer arithmetic: the kernel and the CPU tests run it."""
    dec = scale_decode(fmt, bf16)
    if dec.mask != 0xFF:
        raise AssertionError(f"{fmt.scale.name} bytes need a mask; use scale_halves")
    return b * (1 << dec.shift) + (dec.offset << dec.shift)


def scale_byte_half(word, sel, bf16: bool, fmt: BlockFormat):
    """The :func:`raw_scale_word` low half of the scale byte of a raw loaded ``word`` that
    :func:`byte_selector` ``sel`` picks (:data:`BYTE_SELECT_PTX`, then :func:`byte_scale`):
    one PRMT and one shift-add, in place of :func:`prepare_scale_word` (an add per word)
    and :func:`scale_halves` where the byte is picked at run time (the stream kernel's
    MXFP4 unit parity: 800 -> 770 SASS instructions per loop of sm90_mxfp4_stream_decode,
    2026-12-06)."""
    b = cute.arch.inline_ptx(BYTE_SELECT_PTX, write_only_types=[cutlass.Uint32],
                             read_only_args=[word, sel])
    return byte_scale(b, bf16, fmt)


def scale_select(fmt: BlockFormat, kb: int, unit_parity: int = 0) -> tuple[bool, int]:
    """``(odd, half)``: where K block ``kb`` (0..3, 16 elements) of a 64-K unit finds its
    scale in its row's scale word: the :func:`scale_halves` word ``odd`` and its 16-bit
    ``half`` (byte ``2 half + odd``). NVFP4 (a word per unit, a scale per K block): byte
    ``kb``. MXFP4 (a word per two units, a scale per two K blocks): byte ``2 p + kb // 2``
    for the unit of parity ``p``."""
    if fmt.scales_per_mma == 4:
        return bool(kb % 2), kb // 2
    return bool(kb // 2), unit_parity


def fragment_ptx(bf16: bool, half: int, fmt: BlockFormat) -> str:
    """PTX of one K block: its packed word ``{$r0}`` (four bytes, one per A-fragment
    register), the :func:`scale_halves` words of rows ``g`` ({$r1}) and ``g + 8`` ({$r2})
    that hold its scale in their 16-bit ``half`` (:func:`scale_select`),
    the tables' first words ({$r3}: high bytes; {$r4}: low bytes, BF16 only; see
    :func:`decode_tables`) -> four 16-bit x 2 words ({$w0}..{$w3}), word ``j`` = (low
    nibble, high nibble) of byte ``j`` times the scale of row ``g`` (``j`` even) or
    ``g + 8`` (``j`` odd).

    Exact for every code and scale: the magnitude bits of the eight codes select, with
    PRMT, the bytes of ``v * 2^e`` (``e``: :class:`ScaleDecode`) from 8-entry tables (two
    PRMTs per table: codes 0-3 and 4-7); the repack put each group's sign bits on bit 7 of
    the word's bytes (codes 0-3) and of the word shifted left by 4 (codes 4-7,
    :data:`cute_fp4.packed.SIGN_BIT`), so two LOP3s merge them into the high bytes; one
    PRMT per word interleaves low and high bytes (FP16: the low bytes are zero). Each
    word's multiply takes its row's raw scale ``s * 2^-e`` (E4M3's exponent moved onto the
    16-bit type's, subnormal for small scales) from one half of the scale word, broadcast
    (an HMUL2 operand swizzle in SASS): ``v * s`` exactly (6 significant bits, a normal
    number). Per 8 elements 13 integer instructions (BF16; 11 FP16) and 4 multiplies, plus
    2 for the scale words (the decode before this took 23 + 5 + 4).
    """
    (_, lo1), (_, hi1) = lut_words(bf16, scale_decode(fmt, bf16).lut_exponent)
    mul = "mul.rn.bf16x2" if bf16 else "mul.rn.f16x2"
    body = ["{", ".reg .b32 r, rh, h0, h1, l0, l1, s4, sl, sh, v, tb, ub;",
            ".reg .b16 pl, ph;",
            "and.b32 r, {$r0}, 0x77777777;", "shr.u32 rh, r, 16;",
            f"mov.b32 tb, {hi1:#x};",
            "prmt.b32 h0, {$r3}, tb, r;", "prmt.b32 h1, {$r3}, tb, rh;"]
    if bf16:
        body += [f"mov.b32 ub, {lo1:#x};",
                 "prmt.b32 l0, {$r4}, ub, r;", "prmt.b32 l1, {$r4}, ub, rh;"]
    else:
        body += ["mov.b32 l0, 0;", "mov.b32 l1, 0;"]
    # the packed word holds the sign of nibble i < 4 at bit 8i + 7, of nibble i + 4 at
    # 8i + 3 (cute_fp4.packed.SIGN_BIT): the word and the word << 4 are the sign planes
    body += ["shl.b32 s4, {$r0}, 4;",
             "lop3.b32 h0, h0, {$r0}, 0x80808080, 0xF8;",  # h | (q & 0x80808080)
             "lop3.b32 h1, h1, s4, 0x80808080, 0xF8;"]
    half = "ph" if half else "pl"
    for reg, src in (("sl", "{$r1}"), ("sh", "{$r2}")):
        body += [f"mov.b32 {{pl, ph}}, {src};", f"mov.b32 {reg}, {{{half}, {half}}};"]
    for j in range(4):
        lo, hi = ("l0", "h0") if j < 2 else ("l1", "h1")
        sel = 0x5140 if j % 2 == 0 else 0x7362
        body += [f"prmt.b32 v, {lo}, {hi}, {sel:#x};",
                 f"{mul} {{$w{j}}}, v, {'sl' if j % 2 == 0 else 'sh'};"]
    body.append("}")
    return "\n".join(body)



# A constant in a per-thread register: the thread index has bit 31 clear, so
# ``(tid & 2^31) | v`` is ``v``, but ptxas cannot prove it uniform, so it neither keeps the
# value in a uniform register nor re-materialises it (one IMAD per use) inside the loop.
def pinned_word(value: int):
    """``value`` (a 32-bit constant) in a register of its own for the whole kernel."""
    tid = cute.arch.thread_idx()[0]
    return cute.arch.inline_ptx(f"lop3.b32 {{$w0}}, {{$r0}}, 0x80000000, {value:#x}, 0xEA;",
                                write_only_types=[cutlass.Uint32],
                                read_only_args=[cutlass.Uint32(tid)])  # (tid & 2^31) | v


def decode_tables(bf16: bool, fmt: BlockFormat) -> tuple:
    """The first words of the decode's high-byte (and, BF16, low-byte) tables, pinned in
    registers once per thread; the second words ride PRMT's immediate operand."""
    (lo0, _), (hi0, _) = lut_words(bf16, scale_decode(fmt, bf16).lut_exponent)
    return (pinned_word(hi0), pinned_word(lo0)) if bf16 else (pinned_word(hi0),)


@functools.cache
def _ptx(bf16: bool, half: int, fmt: BlockFormat) -> str:
    return fragment_ptx(bf16, half, fmt)


def decode_fragment(q, s_lo, s_hi, half: int, tables: tuple, bf16: bool, fmt: BlockFormat):
    """Four A-fragment registers of one K block from its packed word, the
    :func:`scale_halves` words of rows ``g`` and ``g + 8`` (their 16-bit ``half``:
    :func:`scale_select`) and :func:`decode_tables`."""
    return cute.arch.inline_ptx(_ptx(bf16, half, fmt), write_only_types=[cutlass.Uint32] * 4,
                                read_only_args=[q, s_lo, s_hi, *tables])


def sf_word_offset(row, k_units):
    """Offset in 32-bit words, in one stage of the weight tile's scale atoms (``(16, 32,
    k_units, row_atoms)`` bytes, as TMA copies them), of the four scales of tile row
    ``row`` for K unit 0; K unit ``u`` is ``u * 128`` words further. Plain integer
    arithmetic (the kernel and the CPU tests run it)."""
    return ((row // SF_ATOM_ROWS) * k_units * SF_ATOM_BYTES
            + sf_atom_offset(row % SF_ATOM_ROWS, 0)) // 4


def weight_stage_layout(tile_n: int, tile_k: int, stages: int):
    """Bytes ``(256, 8, K unit, row block, stage)`` of staged packed weight units (a unit:
    64 rows x 64 K = 2,048 contiguous bytes, 256 x 8 to keep TMA boxes <= 256)."""
    return cute.make_layout((256, UNIT_BYTES // 256, tile_k // UNIT_K, tile_n // UNIT_ROWS,
                             stages))


def weight_global_view(mB: cute.Tensor, n, k) -> cute.Tensor:
    """The packed weight's bytes as ``(256, 8, K unit, row block)`` (and the group mode of a
    grouped weight ``(rows, K/2, group)``)."""
    k_units = (k + UNIT_K - 1) // UNIT_K
    row_blocks = (n + UNIT_ROWS - 1) // UNIT_ROWS
    shape = (256, UNIT_BYTES // 256, k_units, row_blocks)
    stride = (1, 256, UNIT_BYTES, cute.assume(k_units * UNIT_BYTES, divby=UNIT_BYTES))
    if cutlass.const_expr(cute.rank(mB) == 3):  # grouped: (rows, K/2, group)
        shape, stride = (*shape, mB.shape[2]), (*stride, mB.stride[2])
    return cute.make_tensor(mB.iterator, cute.make_layout(shape, stride=stride))


class PackedConsumer(NamedTuple):
    """What a consumer thread's units share (:meth:`PackedRegisterMainloop.consume_rs_packed`)."""

    mainloop: pipeline.PipelineTmaAsync
    smem: SmemTensors
    ctid: cutlass.Int32  # this thread among the consumers
    t: cutlass.Int32  # this thread in its warpgroup
    wg: cutlass.Int32  # this warpgroup
    thr_mma: cute.ThrMma  # this thread's slice of the WGMMA
    tCrB: cute.Tensor  # (V, N, kb, stage) WGMMA B descriptors of the activation stages
    gD_t: cute.Tensor  # D^T cut into (64, tile.m) tiles
    accs: list  # [M block] FP32 accumulators
    frags: list  # [M block][buffer] A fragments of one group of K blocks
    sf_word: list  # [2 b + h] word offsets of this thread's scales in a stage
    sync: pipeline.NamedBarrier  # every consumer thread (W4A4's activation conversion)
    scale: cutlass.Float32
    tables: tuple  # decode_tables()


class PackedRegisterMainloop:
    """Methods of :class:`~cute_fp4.kernels.sm90.Sm90Gemm` for ``mainloop=rs_packed``."""

    @cute.jit
    def consume_rs_packed(self, mainloop, p, s, ctid):
        """Consumer warpgroups: every work unit of this CTA (weight tile ``w.m``,
        activation tile ``w.n``, split ``w.split``)."""
        tm = self.tile_m
        mb_n = self.rs_m_blocks  # 64-row WGMMA M blocks per warpgroup
        wg = ctid // WARPGROUP
        t = ctid % WARPGROUP
        lane = t % 32
        r0 = (t // 32) * 16 + lane // 4  # fragment rows r0 and r0 + 8 of each M block
        bf16 = self.mma_dtype is cutlass.BFloat16
        tiled_mma = self.tiled_mma
        thr_mma = tiled_mma.get_slice(t)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(s.sA16))  # (V, N, kb, stage)
        gD_t = cute.local_tile(p.gD, d_tile((UNIT_ROWS, tm), 0, self.ops), (None, None, None))
        acc_shape = thr_mma.partition_C(cute.make_identity_tensor((UNIT_ROWS, tm))).shape
        frag_shape = thr_mma.partition_A(
            cute.make_identity_tensor((UNIT_ROWS, 16 * self.rs_group))).shape
        accs = []
        frags = []  # [M block][buffer]: A fragments of one group
        for _ in cutlass.range_constexpr(mb_n):
            accs.append(cute.make_rmem_tensor(acc_shape, cutlass.Float32))
            frags.append([tiled_mma.make_fragment_A(frag_shape) for _ in range(2)])
        # this thread's 32-bit scale words: row block b, half h -> word offset in a stage
        sf_word = []
        for b in cutlass.range_constexpr(mb_n):
            for h in cutlass.range_constexpr(2):
                r = (wg * mb_n + b) * UNIT_ROWS + r0 + 8 * h  # row inside the weight tile
                sf_word.append(sf_word_offset(r, self.sf_cols_blocks))
        w4a4_sync = pipeline.NamedBarrier(barrier_id=int(Barrier.ALL_MMA),
                                          num_threads=self.num_mma_threads)
        scale = self._scale(p)
        tables = decode_tables(bf16, self.fmt)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        c = PackedConsumer(mainloop, s, ctid, t, wg, thr_mma, tCrB, gD_t, accs, frags, sf_word,
                           w4a4_sync, scale, tables)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for_each_unit(p.units, functools.partial(self._rs_packed_unit, p, c), (release, read))

    @cute.jit
    def _rs_packed_unit(self, p, c: PackedConsumer, w: WorkTile, unit, carry):
        """One work unit (weight tile ``w.m``, activation tile ``w.n``, split ``w.split``):
        its K tiles, then D^T; ``carry``: the (release, read) pipeline states."""
        release, read = carry
        tm, tn = self.tile_m, self.tile_n
        mb_n = self.rs_m_blocks
        bf16 = self.mma_dtype is cutlass.BFloat16
        mainloop, s, ctid, t, wg, accs = c.mainloop, c.smem, c.ctid, c.t, c.wg, c.accs
        nt, mt = w.m, w.n  # the scheduler's M tiles are the weight's rows
        gD_u, cols, scale_u = c.gD_t, p.m - mt * tm, c.scale
        if cutlass.const_expr(self.grouped):  # activation row tiles inside a group
            nt, mt = w.n, 0
            gD_u = cute.local_tile(cute.domain_offset((0, w.row0, 0), p.gD),
                                   d_tile((UNIT_ROWS, tm), 0, self.ops), (None, None, None))
            cols, scale_u = w.rows, c.scale * p.mAlpha[w.l]
        for b in cutlass.range_constexpr(mb_n):
            accs[b].fill(0.0)
        # the first K tile of a unit releases no earlier stage: peeled, so that no
        # branch sits between the WGMMAs in flight and their wait (ptxas serialises
        # the WGMMAs of a pipeline with a conditional release inside it)
        if w.k_count > 0:
            mainloop.consumer_wait(read)
            self._k_tile(mainloop, read, release, s, t, wg, mt, ctid, c.sf_word, c.frags, accs,
                         c.tCrB, c.sync, c.tables, bf16, False)
            read.advance()
        for _ in cutlass.range(1, w.k_count, unroll=1):
            mainloop.consumer_wait(read)
            self._k_tile(mainloop, read, release, s, t, wg, mt, ctid, c.sf_word, c.frags, accs,
                         c.tCrB, c.sync, c.tables, bf16, self.w4a16)
            if cutlass.const_expr(self.w4a16):
                release.advance()
            read.advance()
        release = self._finish_unit(mainloop, release, w.k_count)
        for b in cutlass.range_constexpr(mb_n):
            rb = nt * (tn // UNIT_ROWS) + wg * mb_n + b  # 64-row block of D^T
            if cutlass.const_expr(self.grouped):
                bias = p.mBias[(None, w.l)] if cutlass.const_expr("bias" in self.ops) else None
                store_direct(c.thr_mma, accs[b], scale_u, gD_u[(None, None, rb, mt, 0)],
                             (UNIT_ROWS, tm), p.n - rb * UNIT_ROWS, cols, self.epi_dtype,
                             fused_tile(self.schedule, 0, bias, rb * UNIT_ROWS))
            else:
                self._store(c.thr_mma, accs[b], scale_u, p, (UNIT_ROWS, tm), rb, mt, w, unit,
                            b * self.num_mma_threads + ctid, p.n - rb * UNIT_ROWS, cols)
        return release, read

    @cute.jit
    def _k_tile(self, mainloop, read, release, s, t, wg, mt, ctid, sf_word, frags, accs, tCrB,
                w4a4_sync, tables, bf16, release_prev: cutlass.Constexpr):
        """One K tile (stage ``read.index``, already full): fragments -> registers, then the
        WGMMA groups; ``release_prev``: release stage ``release`` (the previous K tile's) once
        its WGMMAs are done (W4A16; W4A4 releases each stage after converting it)."""
        mb_n = self.rs_m_blocks
        group = self.rs_group
        n_groups = self.tile_k // (16 * group)
        st = read.index
        b_idx = st
        if cutlass.const_expr(not self.w4a16):
            b_idx = 0
            self._convert_activation(s, st, mt, ctid, w4a4_sync)
        rQ, rS = self._load_fragments(s, st, t, wg * mb_n, sf_word, bf16)
        if cutlass.const_expr(not self.w4a16):
            mainloop.consumer_release(read)  # everything left is in registers or A16
        for g in cutlass.range_constexpr(n_groups):
            warpgroup.wait_group(1)
            if cutlass.const_expr(release_prev and g == 1):
                mainloop.consumer_release(release)  # every WGMMA of that tile is done
            for b in cutlass.range_constexpr(mb_n):
                self._decode_group(rQ, rS, b, g, frags[b][g % 2], tables, bf16)
            warpgroup.fence()
            for b in cutlass.range_constexpr(mb_n):
                for j in cutlass.range_constexpr(group):
                    cute.gemm(self.tiled_mma, accs[b], frags[b][g % 2][(None, None, j)],
                              tCrB[(None, None, g * group + j, b_idx)], accs[b])
            warpgroup.commit_group()

    @cute.jit
    def _load_fragments(self, s, st, t, wg_rows, sf_word, bf16):
        """This thread's packed weight words ``rQ[b][ku][kb, 0]`` (16 bytes per M block and K
        unit) and :func:`scale_halves` words ``rS[b, h, a, odd]`` of stage ``st``: one
        scale word per row and scale atom ``a`` (``fmt.atom_k`` of K: one K unit of NVFP4,
        two of MXFP4) (``wg_rows``: the first 64-row block of this warpgroup in the tile)."""
        mb_n = self.rs_m_blocks
        k_units = self.tile_k // UNIT_K
        k_atoms = self.sf_cols_blocks
        q32 = cute.recast_tensor(s.sB[(None, None, None, None, st)], cutlass.Uint32)
        sf_stage = s.sSFB[(None, None, None, None, st)]
        n_sf = cute.cosize(sf_stage.layout) // 4
        sf32 = cute.make_tensor(cute.recast_ptr(sf_stage.iterator, dtype=cutlass.Uint32),
                                cute.make_layout(n_sf))
        rQ = []  # [M block][K unit]: (4, 1) words
        rS = cute.make_rmem_tensor((mb_n, 2, k_atoms, 2), cutlass.Uint32)
        for b in cutlass.range_constexpr(mb_n):
            rQ.append([])
            for ku in cutlass.range_constexpr(k_units):
                # unit (ku, row block) holds 128 threads x 4 words; q32 is (64, 8, ku, rb)
                src = cute.local_tile(q32[(None, None, ku, wg_rows + b)], (4, 1),
                                      (t % 16, t // 16))
                words = cute.make_rmem_tensor((4, 1), cutlass.Uint32)
                cute.autovec_copy(src, words)
                rQ[b].append(words)
            for h in cutlass.range_constexpr(2):
                for a in cutlass.range_constexpr(k_atoms):
                    word = prepare_scale_word(sf32[sf_word[2 * b + h] + a * (SF_ATOM_BYTES // 4)],
                                              bf16, self.fmt)
                    for odd in cutlass.range_constexpr(2):
                        rS[b, h, a, odd] = scale_halves(word, bool(odd), bf16, self.fmt)
        return rQ, rS

    @cute.jit
    def _decode_group(self, rQ, rS, b, g, frag, tables, bf16):
        """K blocks ``G g .. G g + G - 1`` (``G`` = ``self.rs_group``) of M block ``b`` -> the
        A fragment ``frag``."""
        f32 = cute.recast_tensor(frag, cutlass.Uint32)
        per_atom = self.fmt.atom_k // UNIT_K  # K units per scale word
        for j in cutlass.range_constexpr(self.rs_group):
            kb = g * self.rs_group + j
            ku, kq = kb // 4, kb % 4
            odd, half = scale_select(self.fmt, kq, ku % per_atom)
            a = ku // per_atom
            o = decode_fragment(rQ[b][ku][kq, 0], rS[b, 0, a, int(odd)], rS[b, 1, a, int(odd)],
                                half, tables, bf16, self.fmt)
            for i in cutlass.range_constexpr(4):
                f32[j * 4 + i] = o[i]

    @cute.jit
    def _convert_activation(self, s, st, mt, ctid, sync):
        """W4A4: the packed activation stage -> the FP16 buffer, once every consumer's
        WGMMAs on the previous buffer contents are done."""
        tm = self.tile_m
        warpgroup.wait_group(0)
        sync.arrive_and_wait()
        sf_row = (mt * tm) % SF_ATOM_ROWS if tm < SF_ATOM_ROWS else 0
        self.convert(s.sA, s.sSFA, s.sA16, st, 0, tm, sf_row, tm, ctid, False)
        cute.arch.fence_proxy("async.shared", space="cta")
        sync.arrive_and_wait()


__all__ = ["GROUP_K_BLOCKS", "SCALE_DECODE", "WIDE_GROUP_K_BLOCKS", "PackedConsumer",
           "BYTE_SELECT_PTX", "byte_scale", "byte_selector", "scale_byte_half",
           "PackedRegisterMainloop", "ScaleDecode", "decode_fragment", "fragment_ptx",
           "group_k_blocks", "lut_words", "prepare_scale_word", "scale_decode",
           "scale_halves", "scale_select",
           "sf_word_offset", "weight_global_view", "weight_stage_layout"]
