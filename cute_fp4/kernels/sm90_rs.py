"""SM90 register-sourced mainloop (``Schedule.swap_ab``): the weight is WGMMA's A operand.

``D^T[N, M] = B[N, K] @ A[M, K]^T``: the NVFP4 weight B plays WGMMA's M (64 rows per work
unit) and the few activation rows play WGMMA's N (``tile.m`` = 8, 16, 32 or 64 columns).
N = 8192 gives 128 units of 64 weight rows, one per SM, with no split-K.
This is a mainloop choice of :class:`~cute_fp4.kernels.sm90.Sm90Gemm` (the loads, work units,
warp roles and the masked epilogue are the kernel's shared components); the epilogue stores
through a transposed view of D.

``Warps.mma = (1, W)``: W consumer warpgroups take the unit's K tiles round-robin
(intra-CTA split-K; their FP32 accumulators are summed through shared memory at the end).
A consumer warpgroup, per K tile:

* loads its weight bytes straight from the packed stage into registers and converts them
  in the RS A-fragment layout (the 16-bit weight never goes through shared memory);
* converts (W4A4) or copies (W4A16) the activation tile into a 16-bit, 128-byte-swizzled
  buffer (two per warpgroup) in the K order the weight fragments imply;
* issues 16 RS WGMMAs ``64 x tile.m x 16`` into FP32 accumulators.

K order. WGMMA's A fragment gives thread ``t`` (lane ``l``, ``c = l % 4``) the K slots
``{2c, 2c+1, 2c+8, 2c+9}`` of each 16-wide K block. A sum over K may visit K in any order
as long as both operands agree, so thread ``c`` owns the physical K range
``[64c, 64c + 64)`` of each 256-wide tile (32 contiguous packed bytes per row: two 16-byte
shared loads and one 4-byte load of its four scales). Its packed word ``w`` (8 elements) is
converted into four FP16x2 words, word ``i`` pairing nibbles ``i`` and ``i + 4``; word ``i``
is the fragment register of K block ``2w + i // 2``, half ``i % 2``. The activation buffer
holds the same permutation: logical ``16 kb + 8 h + 2c + e`` <- physical
``64c + 8 (kb // 2) + 2 (kb % 2) + h + 4e``.

Constraints (checked by ``plan``): tile N 64, tile K 256, tile M 8/16/32/64, ``Warps.mma =
(1, W)`` with W in 1..4; one work unit per CTA (not persistent); K a multiple of 32 (tails
zero-filled by TMA); N a multiple of 8.

Status: W <= 2 (two WGMMA groups per tile, 64 A-fragment registers) was validated and timed
on an H200. W = 3/4 (four WGMMA groups per tile that alternate between two 16-register A
buffers, for more warps per SM) compile without spills for tile M 16 but have NOT been run
on a GPU yet.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import warpgroup

from cute_fp4.formats import SF_ATOM_BYTES, sf_atom_offset
from cute_fp4.kernels.roles import WARPGROUP, Barrier
from cute_fp4.kernels.scheduler import this_unit
from cute_fp4.kernels.sm90_convert import convert_pairs, permute_bytes, scale_word

RS_TILE_K = 256  # K per tile: 64 per thread column c


class RegisterSourcedMainloop:
    """Methods of :class:`~cute_fp4.kernels.sm90.Sm90Gemm` for ``swap_ab`` schedules."""

    @cute.jit
    def consume_rs(self, mainloop, p, s, ctid):
        """One work unit (weight tile ``w.m`` x activation tile ``w.n``) per CTA."""
        tm, tn = self.tile_m, self.tile_n
        nwg = self.num_wg
        wg = ctid // WARPGROUP
        t = ctid % WARPGROUP
        lane = t % 32
        c = lane % 4
        r0 = (t // 32) * 16 + lane // 4  # weight rows r0 and r0 + 8 of the fragment
        tiled_mma = self.tiled_mma
        thr_mma = tiled_mma.get_slice(t)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(
            cute.make_identity_tensor((tn, self.tile_k))).shape)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(s.sA16))
        acc = cute.make_rmem_tensor(
            thr_mma.partition_C(cute.make_identity_tensor((tn, tm))).shape, cutlass.Float32)
        tCrA32 = cute.recast_tensor(tCrA, cutlass.Uint32)
        num_k_blocks = cute.size(tCrA, mode=[2])
        wg_bar = pipeline.NamedBarrier(barrier_id=int(Barrier.MMA_GROUP) + wg,
                                       num_threads=WARPGROUP)
        bf16 = self.mma_dtype is cutlass.BFloat16
        unit, w = this_unit(p.units)  # one CTA per unit
        nt, mt = w.m, w.n

        # 32-bit offsets of this thread's four scales (one word) for its two weight rows
        row_base = (nt * tn) % 128
        sfb_off = []
        for h in cutlass.range_constexpr(2):
            sfb_off.append((sf_atom_offset(row_base + r0 + 8 * h, 0) + c * SF_ATOM_BYTES) // 4)

        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for _ in cutlass.range(wg, unroll=1):
            read.advance()
        acc.fill(0.0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        groups = 2 if nwg <= 2 else 4
        n_mine = (w.k_count - wg + nwg - 1) // nwg
        for j in cutlass.range(n_mine, unroll=1):
            buf = wg * 2 + j % 2
            mainloop.consumer_wait(read)
            stage = read.index
            # weight bytes and scales of this thread -> registers
            q_stage = cute.recast_tensor(s.sB[(None, None, stage)], cutlass.Uint32)
            sf_stage = s.sSFB[(None, None, None, None, stage)]
            sf32 = cute.make_tensor(cute.recast_ptr(sf_stage.iterator, dtype=cutlass.Uint32),
                                    cute.make_layout(512))
            rQ = cute.make_rmem_tensor((2, 8), cutlass.Uint32)
            rS = cute.make_rmem_tensor((2,), cutlass.Uint32)
            for h in cutlass.range_constexpr(2):
                cute.autovec_copy(cute.local_tile(q_stage, (1, 8), (r0 + 8 * h, c)),
                                  cute.local_tile(rQ, (1, 8), (h, 0)))
                rS[h] = sf32[sfb_off[h]]
            # activation tile -> 16-bit buffer in the permuted K order; the WGMMAs of the
            # previous tile that used this buffer completed at the last wait_group below
            self._convert_act(s.sA, s.sSFA, s.sA16, stage, buf, t, mt, bf16)
            mainloop.consumer_release(read)
            cute.arch.fence_proxy("async.shared", space="cta")
            wg_bar.arrive_and_wait()
            # WGMMA groups per tile: converting one group's K blocks overlaps the WGMMAs of
            # the previous group (wait_group(1)). Two groups (K blocks 0-7 from words 0-3,
            # 8-15 from words 4-7) for up to two warpgroups; with three or four warpgroups
            # (fewer registers per thread) four groups of 4 K blocks that alternate between
            # two 16-register A buffers.
            for g in cutlass.range_constexpr(groups):
                warpgroup.wait_group(1)
                for h in cutlass.range_constexpr(2):
                    for sb in cutlass.range_constexpr(g * 4 // groups, (g + 1) * 4 // groups):
                        sc = scale_word((rS[h] >> (8 * sb)) & 0xFF)
                        for ww in cutlass.range_constexpr(2):
                            wd = 2 * sb + ww
                            o = convert_pairs(rQ[h, wd], sc, bf16)
                            for i in cutlass.range_constexpr(4):
                                kb = 2 * wd + i // 2
                                reg = h + 2 * (i % 2)  # a0 (r0, lo), a1 (r0+8, lo), a2, a3
                                tCrA32[self._a_slot(kb, g, groups) * 4 + reg] = o[i]
                warpgroup.fence()
                per_g = num_k_blocks // groups
                for kb in cutlass.range_constexpr(g * per_g, g * per_g + per_g):
                    cute.gemm(tiled_mma, acc, tCrA[(None, None, self._a_slot(kb, g, groups))],
                              tCrB[(None, None, kb, buf)], acc)
                warpgroup.commit_group()
            for _ in cutlass.range_constexpr(nwg):
                read.advance()
        warpgroup.wait_group(0)
        self._reduce_warpgroups(acc, s.red_ptr, wg, t)
        if wg == 0:
            self._store(thr_mma, acc, self._scale(p), p, (tn, tm), nt, mt, w, unit, t,
                        p.n - nt * tn, p.m - mt * tm)

    @cute.jit
    def _reduce_warpgroups(self, acc, red_ptr, wg, t):
        """Sum the warpgroups' accumulators into warpgroup 0's, through shared memory."""
        nwg = self.num_wg
        if cutlass.const_expr(nwg > 1):
            all_bar = pipeline.NamedBarrier(barrier_id=int(Barrier.ALL_MMA),
                                            num_threads=self.num_mma_threads)
            n_acc = cute.size(acc)
            red = cute.make_tensor(red_ptr, cute.make_layout(
                (WARPGROUP, n_acc, nwg), stride=(1, WARPGROUP, WARPGROUP * n_acc)))
            all_bar.arrive_and_wait()
            if wg > 0:
                for i in cutlass.range_constexpr(n_acc):
                    red[t, i, wg] = acc[i]
            all_bar.arrive_and_wait()
            if wg == 0:
                for g in cutlass.range_constexpr(1, nwg):
                    for i in cutlass.range_constexpr(n_acc):
                        acc[i] = acc[i] + red[t, i, g]

    @staticmethod
    def _a_slot(kb: int, g: int, groups: int) -> int:
        """Register slot (K block of the A fragment) that holds K block ``kb``."""
        return kb if groups == 2 else (g % 2) * 4 + kb % 4

    @cute.jit
    def _convert_act(self, sA, sSFA, sA16, stage, buf, t, mt, bf16):
        """The activation tile of ``stage`` -> 16-bit buffer ``buf`` in the permuted K order.

        Work unit ``u = (row, c, w)``: 8 physical K elements ``64c + 8w .. + 7`` of one row
        become four 32-bit words (element pairs ``(i, i + 4)``) at logical K
        ``16 (2w + i // 2) + 8 (i % 2) + 2c``.
        """
        tm = self.tile_m
        per = tm * 32 // WARPGROUP  # units per thread
        chunk = min(per, 4)  # units loaded before converting (bounds live registers)
        h_buf = sA16[(None, None, buf)]
        if cutlass.const_expr(self.w4a16):
            a32 = cute.recast_tensor(sA[(None, None, stage)], cutlass.Uint32)  # (tm, 128)
            raw = cute.make_rmem_tensor((chunk, 4), cutlass.Uint32)
            for p0 in cutlass.range_constexpr(0, per, chunk):
                for q in cutlass.range_constexpr(chunk):
                    u = t + (p0 + q) * WARPGROUP
                    cute.autovec_copy(cute.local_tile(a32, (1, 4), (u // 32, u % 32)),
                                      cute.local_tile(raw, (1, 4), (q, 0)))
                for q in cutlass.range_constexpr(chunk):
                    u = t + (p0 + q) * WARPGROUP
                    o = (permute_bytes(raw[q, 0], raw[q, 2], 0x5410),
                         permute_bytes(raw[q, 0], raw[q, 2], 0x7632),
                         permute_bytes(raw[q, 1], raw[q, 3], 0x5410),
                         permute_bytes(raw[q, 1], raw[q, 3], 0x7632))
                    self._store_pairs(h_buf, u // 32, (u % 32) // 8, u % 8, o)
        else:
            q32 = cute.recast_tensor(sA[(None, None, stage)], cutlass.Uint32)  # (tm, 32)
            sf_stage = sSFA[(None, None, None, None, stage)]
            sf_flat = cute.make_tensor(sf_stage.iterator, cute.make_layout(2048))
            row_base = (mt * tm) % 128
            rq = cute.make_rmem_tensor((chunk,), cutlass.Uint32)
            rs = cute.make_rmem_tensor((chunk,), cutlass.Uint8)
            for p0 in cutlass.range_constexpr(0, per, chunk):
                for q in cutlass.range_constexpr(chunk):
                    u = t + (p0 + q) * WARPGROUP
                    cw = u % 32
                    rq[q] = q32[u // 32, cw]
                    rs[q] = sf_flat[sf_atom_offset(row_base + u // 32, (cw % 8) // 2)
                                    + (cw // 8) * SF_ATOM_BYTES]
                for q in cutlass.range_constexpr(chunk):
                    u = t + (p0 + q) * WARPGROUP
                    o = convert_pairs(rq[q], scale_word(rs[q]), bf16)
                    self._store_pairs(h_buf, u // 32, (u % 32) // 8, u % 8, o)

    @cute.jit
    def _store_pairs(self, h_buf, row, cc, w, o):
        for i in cutlass.range_constexpr(4):
            k = 16 * (2 * w + i // 2) + 8 * (i % 2) + 2 * cc
            r2 = cute.make_rmem_tensor((1, 2), self.mma_dtype)
            cute.recast_tensor(r2, cutlass.Uint32)[0] = o[i]
            cute.autovec_copy(r2, cute.local_tile(h_buf, (1, 2), (row, k // 2)))


__all__ = ["RS_TILE_K", "RegisterSourcedMainloop"]
