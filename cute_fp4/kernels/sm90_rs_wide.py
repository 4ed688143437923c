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
* walks the tile in groups of two K blocks (32 K): ``wait_group(1)`` (the WGMMAs of the
  group before last are done, so the A buffer of this group is free), decodes the group
  into one of two A-fragment buffers, ``fence``, issues its WGMMAs (``64 x tile.m x 16``
  per M block and K block) and commits. Decoding group g + 1 overlaps the WGMMAs of group
  g; the group count per tile is even, so buffers alternate across tiles too;
* releases the stage of the previous K tile at the second group's wait (every WGMMA that
  read it is done); the last stage of a unit after ``wait_group(0)``.

Decode (exact, :func:`fragment_ptx`): fragment register ``a_j`` of a K block is one packed
byte; byte ``j`` of the 32-bit word ``4 kb .. 4 kb + 3`` (see cute_fp4.packed) becomes two
16-bit values looked up by PRMT in 8-entry tables of ``v * 2^e``, its signs set by one LOP3,
times the row's raw scale ``s * 2^-e`` (one HMUL2, BF16 or FP16 as the activation): ``v * s``
exactly, in the true units (no offset in the accumulator; W4A4's activation conversion
leaves its ``2^-7``, which the epilogue multiplies back with alpha). Rows ``g`` (``j``
even) and ``g + 8`` (``j`` odd) take their own scale.

W4A4: the packed activation stage is converted once per stage by every consumer thread
into one FP16 buffer (Sm90Gemm.convert, the shared-memory sourced mainloop's conversion)
after ``wait_group(0)`` and a barrier of all consumers; the weight path is unchanged.
Correct but not overlapped across the stage boundary (W4A16 is the target of this path).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import warpgroup

from cute_fp4.kernels.epilogue import store_direct
from cute_fp4.kernels.roles import WARPGROUP, Barrier
from cute_fp4.kernels.sm90_convert import permute_bytes
from cute_fp4.nvfp4 import SF_ATOM_BYTES, SF_ATOM_ROWS, sf_atom_offset
from cute_fp4.packed import UNIT_BYTES, UNIT_K, UNIT_ROWS

GROUP_K_BLOCKS = 2  # K blocks (16 elements) decoded and issued per WGMMA commit group



# E2M1 magnitudes 0, 0.5, ..., 6 times 2^120 (BF16) or 2^8 (FP16), as (low bytes, high
# bytes) tables of 8 entries in two 32-bit words each: the decode looks codes up with PRMT
_LUT = {True: ((0xC0800000, 0xC0804000), (0x7B7B7B00, 0x7C7C7C7C)),
        False: ((0x00000000, 0x00000000), (0x5E5C5800, 0x66646260))}
LUT_EXPONENT = {True: 120, False: 8}  # the tables' power of two; the scale word's is minus


def fragment_ptx(bf16: bool) -> str:
    """PTX: one 32-bit word of four packed bytes ({$r0}) and two raw scale words ({$r1} for
    bytes 0 and 2, {$r2} for bytes 1 and 3, :func:`raw_scale_word`) -> four 16-bit x 2
    words ({$w0}..{$w3}), word ``j`` = (low nibble, high nibble) of byte ``j`` times its
    scale.

    Table lookup, exact: the magnitude bits of the eight codes select, with PRMT, the bytes
    of ``v * 2^e`` (``e`` = :data:`LUT_EXPONENT`) from 8-entry tables, two PRMTs put the low
    and high bytes of each word together (FP16: the low bytes are all zero, one PRMT), one
    PRMT and one LOP3 put each code's sign bit on bit 15 / 31, and one multiply by the raw
    scale ``s * 2^-e`` gives ``v * s`` (6 significant bits, a normal number: exact). 23
    instructions per 8 elements for BF16 (the FP16-and-widen decode took 43), 21 for FP16.
    """
    (lo0, lo1), (hi0, hi1) = _LUT[bf16]
    mul = "mul.rn.bf16x2" if bf16 else "mul.rn.f16x2"
    body = ["{", ".reg .b32 r, rh, l0, h0, l1, h1, s4, v, g, ta, tb, tc, td;",
            f"mov.b32 tc, {hi0:#x};", f"mov.b32 td, {hi1:#x};",
            "and.b32 r, {$r0}, 0x77777777;", "shr.u32 rh, r, 16;",
            "prmt.b32 h0, tc, td, r;", "prmt.b32 h1, tc, td, rh;"]
    if bf16:
        body += [f"mov.b32 ta, {lo0:#x};", f"mov.b32 tb, {lo1:#x};",
                 "prmt.b32 l0, ta, tb, r;", "prmt.b32 l1, ta, tb, rh;"]
    else:
        body += ["mov.b32 l0, 0;", "mov.b32 l1, 0;"]
    body.append("shl.b32 s4, {$r0}, 4;")
    for j in range(4):
        lo, hi = ("l0", "h0") if j < 2 else ("l1", "h1")
        sel = 0x5140 if j % 2 == 0 else 0x7362
        sign_sel = j | j << 4 | (4 + j) << 8 | (4 + j) << 12
        scale = "{$r" + str(1 + j % 2) + "}"
        body += [f"prmt.b32 v, {lo}, {hi}, {sel:#x};",
                 f"prmt.b32 g, s4, {{$r0}}, {sign_sel:#x};",
                 "lop3.b32 v, v, g, 0x80008000, 0xF8;",  # v | (g & 0x80008000)
                 f"{mul} {{$w{j}}}, v, {scale};"]
    body.append("}")
    return "\n".join(body)


def raw_scale_word(sf, bf16: bool):
    """UE4M3 scale byte (sign ignored) -> its 7 bits in both 16-bit halves where they read
    as the BF16 number ``s * 2^-120`` (at bit 4: E4M3's exponent on BF16's low exponent
    bits) or the FP16 number ``s * 2^-8`` (at bit 7), subnormal for small scales, exact:
    the multiplier of :func:`fragment_ptx`."""
    return (sf & 0x7F) * (0x00100010 if bf16 else 0x00800080)


def scale_from_word(word, kq: int, bf16: bool, prmt=None):
    """:func:`raw_scale_word` of byte ``kq`` of a word of four scale bytes: the two even
    (or odd) bytes masked and shifted into place at once, then one PRMT copies byte ``kq``'s
    half into both halves (3 instructions per scale byte before, ~2 now). ``prmt(a, b,
    sel)`` defaults to the kernels' PRMT; the CPU tests pass their model of it."""
    shift = 4 if bf16 else 7
    if kq % 2 == 0:
        m = (word & 0x007F007F) << shift
    else:
        m = (word >> (8 - shift)) & (0x007F007F << shift)
    return (prmt or permute_bytes)(m, m, 0x1010 if kq < 2 else 0x3232)


_PTX = {True: fragment_ptx(True), False: fragment_ptx(False)}


def decode_fragment(q, scale_lo, scale_hi, bf16: bool):
    """Four A-fragment registers of one K block from their packed word and the scale words
    of rows ``g`` and ``g + 8``."""
    return cute.arch.inline_ptx(_PTX[bf16], write_only_types=[cutlass.Uint32] * 4,
                                read_only_args=[q, scale_lo, scale_hi])


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


class PackedRegisterMainloop:
    """Methods of :class:`~cute_fp4.kernels.sm90.Sm90Gemm` for ``mainloop=rs_packed``."""

    @cute.jit
    def consume_rs_packed(self, mainloop, p, s, ctid):
        """Consumer warpgroups: every work unit of this CTA (weight tile ``w.m``,
        activation tile ``w.n``, split ``w.split``)."""
        tm, tn, tk = self.tile_m, self.tile_n, self.tile_k
        mb_n = self.rs_m_blocks  # 64-row WGMMA M blocks per warpgroup
        k_units = tk // UNIT_K
        wg = ctid // WARPGROUP
        t = ctid % WARPGROUP
        lane = t % 32
        r0 = (t // 32) * 16 + lane // 4  # fragment rows r0 and r0 + 8 of each M block
        bf16 = self.mma_dtype is cutlass.BFloat16
        tiled_mma = self.tiled_mma
        thr_mma = tiled_mma.get_slice(t)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(s.sA16))  # (V, N, kb, stage)
        gD_t = cute.local_tile(p.gD, (UNIT_ROWS, tm), (None, None, None))
        acc_shape = thr_mma.partition_C(gD_t[(None, None, 0, 0, 0)]).shape
        frag_shape = thr_mma.partition_A(
            cute.make_identity_tensor((UNIT_ROWS, 16 * GROUP_K_BLOCKS))).shape
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
                sf_word.append(sf_word_offset(r, k_units))
        w4a4_sync = pipeline.NamedBarrier(barrier_id=int(Barrier.ALL_MMA),
                                          num_threads=self.num_mma_threads)
        scale = self._scale(p)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        unit, nctas = p.units.first_unit()
        while unit < p.units.total:
            w = p.units.coords(unit)
            nt, mt = w.m, w.n  # the scheduler's M tiles are the weight's rows
            gD_u, cols, scale_u = gD_t, p.m - mt * tm, scale
            if cutlass.const_expr(self.grouped):  # activation row tiles inside a group
                nt, mt = w.n, 0
                gD_u = cute.local_tile(cute.domain_offset((0, w.row0, 0), p.gD),
                                       (UNIT_ROWS, tm), (None, None, None))
                cols, scale_u = w.rows, scale * p.mAlpha[w.l]
            for b in cutlass.range_constexpr(mb_n):
                accs[b].fill(0.0)
            # the first K tile of a unit releases no earlier stage: peeled, so that no
            # branch sits between the WGMMAs in flight and their wait (ptxas serialises
            # the WGMMAs of a pipeline with a conditional release inside it)
            if w.k_count > 0:
                mainloop.consumer_wait(read)
                self._k_tile(mainloop, read, release, s, t, wg, mt, ctid, sf_word, frags, accs,
                             tCrB, w4a4_sync, bf16, False)
                read.advance()
            for _ in cutlass.range(1, w.k_count, unroll=1):
                mainloop.consumer_wait(read)
                self._k_tile(mainloop, read, release, s, t, wg, mt, ctid, sf_word, frags, accs,
                             tCrB, w4a4_sync, bf16, self.w4a16)
                if cutlass.const_expr(self.w4a16):
                    release.advance()
                read.advance()
            release = self._finish_unit(mainloop, release, w.k_count)
            for b in cutlass.range_constexpr(mb_n):
                rb = nt * (tn // UNIT_ROWS) + wg * mb_n + b  # 64-row block of D^T
                if cutlass.const_expr(self.grouped):
                    store_direct(thr_mma, accs[b], scale_u, gD_u[(None, None, rb, mt, 0)],
                                 (UNIT_ROWS, tm), p.n - rb * UNIT_ROWS, cols, self.epi_dtype)
                else:
                    self._store(thr_mma, accs[b], scale_u, p, (UNIT_ROWS, tm), rb, mt, w, unit,
                                b * self.num_mma_threads + ctid, p.n - rb * UNIT_ROWS, cols)
            unit += nctas

    @cute.jit
    def _k_tile(self, mainloop, read, release, s, t, wg, mt, ctid, sf_word, frags, accs, tCrB,
                w4a4_sync, bf16, release_prev: cutlass.Constexpr):
        """One K tile (stage ``read.index``, already full): fragments -> registers, then the
        WGMMA groups; ``release_prev``: release stage ``release`` (the previous K tile's) once
        its WGMMAs are done (W4A16; W4A4 releases each stage after converting it)."""
        mb_n = self.rs_m_blocks
        n_groups = self.tile_k // (16 * GROUP_K_BLOCKS)
        st = read.index
        b_idx = st
        if cutlass.const_expr(not self.w4a16):
            b_idx = 0
            self._convert_activation(s, st, mt, ctid, w4a4_sync)
        rQ, rS = self._load_fragments(s, st, t, wg * mb_n, sf_word)
        if cutlass.const_expr(not self.w4a16):
            mainloop.consumer_release(read)  # everything left is in registers or A16
        for g in cutlass.range_constexpr(n_groups):
            warpgroup.wait_group(1)
            if cutlass.const_expr(release_prev and g == 1):
                mainloop.consumer_release(release)  # every WGMMA of that tile is done
            for b in cutlass.range_constexpr(mb_n):
                self._decode_group(rQ, rS, b, g, frags[b][g % 2], bf16)
            warpgroup.fence()
            for b in cutlass.range_constexpr(mb_n):
                for j in cutlass.range_constexpr(GROUP_K_BLOCKS):
                    cute.gemm(self.tiled_mma, accs[b], frags[b][g % 2][(None, None, j)],
                              tCrB[(None, None, g * GROUP_K_BLOCKS + j, b_idx)], accs[b])
            warpgroup.commit_group()

    @cute.jit
    def _load_fragments(self, s, st, t, wg_rows, sf_word):
        """This thread's packed weight words ``rQ[b][ku][kb, 0]`` (16 bytes per M block and K
        unit) and scale words ``rS[b, h, ku]`` of stage ``st`` (``wg_rows``: the first
        64-row block of this warpgroup in the tile)."""
        mb_n = self.rs_m_blocks
        k_units = self.tile_k // UNIT_K
        q32 = cute.recast_tensor(s.sB[(None, None, None, None, st)], cutlass.Uint32)
        sf_stage = s.sSFB[(None, None, None, None, st)]
        n_sf = cute.cosize(sf_stage.layout) // 4
        sf32 = cute.make_tensor(cute.recast_ptr(sf_stage.iterator, dtype=cutlass.Uint32),
                                cute.make_layout(n_sf))
        rQ = []  # [M block][K unit]: (4, 1) words
        rS = cute.make_rmem_tensor((mb_n, 2, k_units), cutlass.Uint32)
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
                for ku in cutlass.range_constexpr(k_units):
                    rS[b, h, ku] = sf32[sf_word[2 * b + h] + ku * (SF_ATOM_BYTES // 4)]
        return rQ, rS

    @cute.jit
    def _decode_group(self, rQ, rS, b, g, frag, bf16):
        """K blocks ``2g, 2g + 1`` of M block ``b`` -> the A fragment ``frag``."""
        f32 = cute.recast_tensor(frag, cutlass.Uint32)
        for j in cutlass.range_constexpr(GROUP_K_BLOCKS):
            kb = g * GROUP_K_BLOCKS + j
            ku, kq = kb // 4, kb % 4
            s_lo = scale_from_word(rS[b, 0, ku], kq, bf16)
            s_hi = scale_from_word(rS[b, 1, ku], kq, bf16)
            o = decode_fragment(rQ[b][ku][kq, 0], s_lo, s_hi, bf16)
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


__all__ = ["GROUP_K_BLOCKS", "PackedRegisterMainloop", "decode_fragment", "fragment_ptx",
           "sf_word_offset", "weight_global_view", "weight_stage_layout"]
