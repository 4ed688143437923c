"""Hopper decode path (``Schedule.swap_ab``): the weight is WGMMA's A operand, in registers.

``D^T[N, M] = B[N, K] @ A[M, K]^T``: the NVFP4 weight B plays WGMMA's M (64 rows per CTA) and
the few activation rows play WGMMA's N (``tile.m`` = 8, 16, 32 or 64 columns). N = 8192 gives
128 CTAs of 64 weight rows, one per SM, with no split-K and no host reduction.

Per CTA: warp 0 TMA-loads ``stages`` K tiles (256 K each) of packed weight (64 x 128 bytes),
its scale atoms and the activation tile (packed NVFP4 + scales, or 16-bit) into an mbarrier
pipeline. ``Warps.mma = (1, W)``: W consumer warpgroups take K tiles round-robin (intra-CTA
split-K; their FP32 accumulators are summed through shared memory at the end). A consumer
warpgroup, per K tile:

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
converted into four FP16x2 words, word ``i`` pairing nibbles ``i`` and ``i + 4`` (a shift,
a shift, two logic ops and one HMUL2 each); word ``i`` is the fragment register of K block
``2w + i // 2``, half ``i % 2``. The activation buffer holds the same permutation: logical
``16 kb + 8 h + 2c + e`` <- physical ``64c + 8 (kb // 2) + 2 (kb % 2) + h + 4e``.

Epilogue: the accumulator tile is ``D^T``; it is scaled (alpha and the conversion's 2^-7 per
converted operand) and stored transposed into ``out[M, N]`` from registers, rows past M and
columns past N masked. With ``split_k > 1`` FP32 partials go to ``workspace[split, M, N]``
(the host reduces). One CTA per (N tile, M tile, split); no persistent loop.

Constraints (checked by ``plan``): tile N 64, tile K 256, tile M 8/16/32/64, ``Warps.mma =
(1, W)`` with W in 1..4; K a multiple of 32 (tails zero-filled by TMA); N a multiple of 8.

Status: W <= 2 (two WGMMA groups per tile, 64 A-fragment registers) was validated and timed
on an H200 (see schedules/sm90_decode_swapab.py). W = 3/4 (four WGMMA groups per tile that
alternate between two 16-register A buffers, for more warps per SM) compile without spills
for tile M 16 (W = 4 spills at tile M 8) but have NOT been run on a GPU yet.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.tensor_utils as tensor_utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup

from cute_fp4.kernels.sm90 import _ALIGN, _PRODUCER_REGS, _SF_ATOM_BYTES, _WG, Sm90Gemm
from cute_fp4.kernels.sm90_convert import scale_word

_TK = 256  # K per tile: 64 per thread column c


def _pair_ptx(bf16: bool) -> str:
    """q (8 E2M1 nibbles) x scale -> 4 words; word i = (nibble i, nibble i + 4)."""
    body = ["{", ".reg .b32 x, t, y;", ".reg .b16 hl, hh;", ".reg .f32 fl, fh;"]
    for i in range(4):
        sh = 12 - 4 * i
        body.append(f"shl.b32 x, {{$r0}}, {sh};" if sh else "mov.b32 x, {$r0};")
        body += ["and.b32 t, x, 0x80008000;", "shr.u32 y, x, 3;",
                 "and.b32 y, y, 0x0E000E00;", "or.b32 t, t, y;"]
        out = "{$w" + str(i) + "}"
        if bf16:
            body += ["mul.rn.f16x2 t, t, {$r1};", "mov.b32 {hl, hh}, t;",
                     "cvt.f32.f16 fl, hl;", "cvt.f32.f16 fh, hh;",
                     f"cvt.rn.bf16x2.f32 {out}, fh, fl;"]
        else:
            body.append(f"mul.rn.f16x2 {out}, t, {{$r1}};")
    body.append("}")
    return "\n".join(body)


_PAIR_F16 = _pair_ptx(False)
_PAIR_BF16 = _pair_ptx(True)


def convert_pairs(q, scale, bf16: bool):
    return cute.arch.inline_ptx(
        _PAIR_BF16 if bf16 else _PAIR_F16,
        write_only_types=[cutlass.Uint32] * 4,
        read_only_args=[q, scale],
    )


def _prmt(a, b, sel: int):
    return cute.arch.inline_ptx(
        f"prmt.b32 {{$w0}}, {{$r0}}, {{$r1}}, {sel:#x};",
        write_only_types=[cutlass.Uint32],
        read_only_args=[a, b],
    )


class Sm90SwapAB(Sm90Gemm):
    """Swap-AB decode GEMM (weight in WGMMA's A operand, from registers)."""

    def __init__(self, schedule, problem):
        super().__init__(schedule, problem)
        self.num_wg = self.wn  # consumer warpgroups, K tiles round-robin
        self.num_mma_threads = self.num_wg * _WG
        self.threads = self.num_mma_threads + _WG
        launch_regs = min(255, 65536 // self.threads) // 8 * 8
        self.mma_regs = min(240, (launch_regs * self.threads - _PRODUCER_REGS * _WG)
                            // self.num_mma_threads // 8 * 8)
        self.direct_store = True
        self.epi_dtype = cutlass.Float32 if self.split_k > 1 else self.out_dtype

    # ------------------------------------------------------------------ setup (traced)
    def _setup(self):
        tm, tn, tk = self.tile_m, self.tile_n, self.tile_k
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.mma_dtype, self.mma_dtype, OperandMajorMode.K, OperandMajorMode.K,
            cutlass.Float32, (1, 1, 1), tiler_mn=(64, tm),
            a_source=warpgroup.OperandSource.RMEM)
        row = tensor_utils.LayoutEnum.ROW_MAJOR
        a_cols = tk if self.w4a16 else tk // 2
        self.sA_layout = cute.make_layout((tm, a_cols, self.stages),
                                          stride=(a_cols, 1, tm * a_cols))
        # the activation is WGMMA's B operand: (tile.m, K), two buffers per warpgroup
        self.sA16_layout = sm90_utils.make_smem_layout_b(row, (tn, tm, tk), self.mma_dtype,
                                                         2 * self.num_wg)
        self.sB_layout = cute.make_layout((tn, tk // 2, self.stages),
                                          stride=(tk // 2, 1, tn * tk // 2))
        kcb = self.sf_cols_blocks
        self.sSFA_layout = cute.make_layout((16, 32, kcb, self.sfa_row_blocks, self.stages))
        self.sSFB_layout = cute.make_layout((16, 32, kcb, self.sfb_row_blocks, self.stages))

    def _shared_storage(self):
        a_type = self.mma_dtype if self.w4a16 else cutlass.Uint8
        w4a4 = not self.w4a16
        nbar = 2 * self.stages

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, nbar]
            sA: cute.struct.Align[
                cute.struct.MemRange[a_type, cute.cosize(self.sA_layout)], _ALIGN]
            sB: cute.struct.Align[
                cute.struct.MemRange[cutlass.Uint8, cute.cosize(self.sB_layout)], _ALIGN]
            if w4a4:
                sSFA: cute.struct.Align[
                    cute.struct.MemRange[cutlass.Uint8, cute.cosize(self.sSFA_layout)], _ALIGN]
            sSFB: cute.struct.Align[
                cute.struct.MemRange[cutlass.Uint8, cute.cosize(self.sSFB_layout)], _ALIGN]
            sA16: cute.struct.Align[
                cute.struct.MemRange[self.mma_dtype, cute.cosize(self.sA16_layout)], _ALIGN]

        return SharedStorage

    # ------------------------------------------------------------------ host launcher
    @cute.jit
    def _launch(self, mA: cute.Tensor, mSFA: cute.Tensor, mB: cute.Tensor,
                mSFB: cute.Tensor, mC: cute.Tensor, mAlpha: cute.Tensor,
                mWork: cute.Tensor, stream: cuda.CUstream):
        self._setup()
        tm, tn, tk = self.tile_m, self.tile_n, self.tile_k
        m = mC.shape[0]
        n = mC.shape[1]
        k_bytes = mB.shape[1]
        k_tiles = (k_bytes * 2 + tk - 1) // tk
        n_cb = (k_bytes + 31) // 32

        tma_a, gA, tma_b, gB, tma_sfa, gSFA, tma_sfb, gSFB = self._make_load_atoms(
            mA, mSFA, mB, mSFB, m, n, n_cb)
        # D^T views: (N, M, split)
        if cutlass.const_expr(self.split_k > 1):
            gD = cute.make_tensor(mWork.iterator, cute.make_layout(
                (n, m, self.split_k), stride=(1, mWork.stride[1], mWork.stride[0])))
        else:
            gD = cute.make_tensor(mC.iterator, cute.make_layout(
                (n, m, 1), stride=(1, mC.stride[0], mC.stride[0] * m)))

        storage_t = self._shared_storage()
        self.shared_storage = storage_t
        self.smem_bytes = storage_t.size_in_bytes()
        num_n = (n + tn - 1) // tn
        num_m = (m + tm - 1) // tm
        self.kernel_swap(
            tma_a, gA, tma_b, gB, tma_sfa, gSFA, tma_sfb, gSFB, gD, mAlpha, self.tiled_mma,
            self.sA_layout, self.sB_layout, self.sSFA_layout, self.sSFB_layout,
            self.sA16_layout, m, n, k_tiles,
        ).launch(grid=[num_n, num_m, self.split_k], block=[self.threads, 1, 1],
                 smem=self.smem_bytes, stream=stream)

    # ------------------------------------------------------------------ kernel
    @cute.kernel
    def kernel_swap(self, tma_a: cute.CopyAtom, gA: cute.Tensor, tma_b: cute.CopyAtom,
                    gB: cute.Tensor, tma_sfa: cute.CopyAtom, gSFA: cute.Tensor,
                    tma_sfb: cute.CopyAtom, gSFB: cute.Tensor, gD: cute.Tensor,
                    mAlpha: cute.Tensor, tiled_mma: cute.TiledMma, sA_layout, sB_layout,
                    sSFA_layout, sSFB_layout, sA16_layout, m: cutlass.Int32,
                    n: cutlass.Int32, k_tiles: cutlass.Int32):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        tma_atoms = [tma_a, tma_b, tma_sfb]
        if cutlass.const_expr(not self.w4a16):
            tma_atoms.append(tma_sfa)
        storage, mainloop = self._prologue(warp_idx, tma_atoms, sA_layout, sB_layout,
                                           sSFA_layout, sSFB_layout, 4)

        sA = storage.sA.get_tensor(sA_layout)
        sSFA = None
        if cutlass.const_expr(not self.w4a16):
            sSFA = storage.sSFA.get_tensor(sSFA_layout)
        sB = storage.sB.get_tensor(sB_layout)
        sSFB = storage.sSFB.get_tensor(sSFB_layout)
        sA16 = storage.sA16.get_tensor(sA16_layout.outer, swizzle=sA16_layout.inner)
        red_ptr = cute.recast_ptr(storage.sA16.data_ptr(), dtype=cutlass.Float32)

        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        nt, mt, split = cute.arch.block_idx()
        k_begin, k_cnt = self._k_range(split, k_tiles)
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(_PRODUCER_REGS)
            if warp_idx == 0:
                self.load_swap(mainloop, tma_a, gA, sA, tma_b, gB, sB, tma_sfa, gSFA, sSFA,
                               tma_sfb, gSFB, sSFB, nt, mt, k_begin, k_cnt)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self.consume_swap(mainloop, tiled_mma, sA, sB, sSFA, sSFB, sA16, red_ptr, gD,
                              mAlpha, tidx - _WG, m, n, nt, mt, split, k_cnt)

    @cute.jit
    def load_swap(self, mainloop, tma_a, gA, sA, tma_b, gB, sB, tma_sfa, gSFA, sSFA,
                  tma_sfb, gSFB, sSFB, nt, mt, k_begin, k_cnt):
        tm, tn, tk = self.tile_m, self.tile_n, self.tile_k
        a_cols = tk if self.w4a16 else tk // 2
        gA_t = cute.local_tile(gA, (tm, a_cols), (None, None))
        gB_t = cute.local_tile(gB, (tn, tk // 2), (None, None))
        tAsA, tAgA = cpasync.tma_partition(tma_a, 0, cute.make_layout(1),
                                           cute.group_modes(sA, 0, 2),
                                           cute.group_modes(gA_t, 0, 2))
        tBsB, tBgB = cpasync.tma_partition(tma_b, 0, cute.make_layout(1),
                                           cute.group_modes(sB, 0, 2),
                                           cute.group_modes(gB_t, 0, 2))
        tSFBs, tSFBg = self._sf_partition(tma_sfb, gSFB, sSFB, self.sfb_row_blocks)
        if cutlass.const_expr(not self.w4a16):
            tSFAs, tSFAg = self._sf_partition(tma_sfa, gSFA, sSFA, self.sfa_row_blocks)
        rb_a = (mt * tm) // 128
        rb_b = (nt * tn) // 128
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        for kt in cutlass.range(k_cnt, unroll=1):
            kk = k_begin + kt
            mainloop.producer_acquire(state)
            bar = mainloop.producer_get_barrier(state)
            cute.copy(tma_b, tBgB[(None, nt, kk)], tBsB[(None, state.index)], tma_bar_ptr=bar)
            cute.copy(tma_sfb, tSFBg[(None, 0, 0, kk, rb_b)], tSFBs[(None, state.index)],
                      tma_bar_ptr=bar)
            cute.copy(tma_a, tAgA[(None, mt, kk)], tAsA[(None, state.index)], tma_bar_ptr=bar)
            if cutlass.const_expr(not self.w4a16):
                cute.copy(tma_sfa, tSFAg[(None, 0, 0, kk, rb_a)], tSFAs[(None, state.index)],
                          tma_bar_ptr=bar)
            mainloop.producer_commit(state)
            state.advance()
        mainloop.producer_tail(state)

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def consume_swap(self, mainloop, tiled_mma, sA, sB, sSFA, sSFB, sA16, red_ptr, gD,
                     mAlpha, ctid, m, n, nt, mt, split, k_cnt):
        tm, tn = self.tile_m, self.tile_n
        nwg = self.num_wg
        wg = ctid // _WG
        t = ctid % _WG
        lane = t % 32
        c = lane % 4
        r0 = (t // 32) * 16 + lane // 4  # weight rows r0 and r0 + 8 of the fragment
        thr_mma = tiled_mma.get_slice(t)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(
            cute.make_identity_tensor((tn, self.tile_k))).shape)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sA16))
        gD_t = cute.local_tile(gD, (tn, tm), (None, None, None))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(gD_t[(None, None, 0, 0, 0)]).shape,
                                    cutlass.Float32)
        tCrA32 = cute.recast_tensor(tCrA, cutlass.Uint32)
        num_k_blocks = cute.size(tCrA, mode=[2])
        wg_bar = pipeline.NamedBarrier(barrier_id=1 + wg, num_threads=_WG)
        bf16 = self.mma_dtype is cutlass.BFloat16

        # 32-bit offsets of this thread's four scales (one word) for its two weight rows
        row_base = (nt * tn) % 128
        sfb_off = []
        for h in cutlass.range_constexpr(2):
            rr = row_base + r0 + 8 * h
            sfb_off.append(((rr % 32) * 16 + (rr // 32) * 4 + c * _SF_ATOM_BYTES) // 4)

        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for _ in cutlass.range(wg, unroll=1):
            read.advance()
        acc.fill(0.0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        groups = 2 if nwg <= 2 else 4
        n_mine = (k_cnt - wg + nwg - 1) // nwg
        for j in cutlass.range(n_mine, unroll=1):
            buf = wg * 2 + j % 2
            mainloop.consumer_wait(read)
            stage = read.index
            # weight bytes and scales of this thread -> registers
            q_stage = cute.recast_tensor(sB[(None, None, stage)], cutlass.Uint32)
            sf_stage = sSFB[(None, None, None, None, stage)]
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
            self._convert_act(sA, sSFA, sA16, stage, buf, t, mt, bf16)
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
                    for s in cutlass.range_constexpr(g * 4 // groups, (g + 1) * 4 // groups):
                        sc = scale_word((rS[h] >> (8 * s)) & 0xFF)
                        for ww in cutlass.range_constexpr(2):
                            w = 2 * s + ww
                            o = convert_pairs(rQ[h, w], sc, bf16)
                            for i in cutlass.range_constexpr(4):
                                kb = 2 * w + i // 2
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

        # sum the warpgroups' accumulators through shared memory (the A16 buffers)
        if cutlass.const_expr(nwg > 1):
            all_bar = pipeline.NamedBarrier(barrier_id=1 + nwg, num_threads=self.num_mma_threads)
            n_acc = cute.size(acc)
            red = cute.make_tensor(red_ptr, cute.make_layout((_WG, n_acc, nwg),
                                                             stride=(1, _WG, _WG * n_acc)))
            all_bar.arrive_and_wait()
            if wg > 0:
                for i in cutlass.range_constexpr(n_acc):
                    red[t, i, wg] = acc[i]
            all_bar.arrive_and_wait()
            if wg == 0:
                for g in cutlass.range_constexpr(1, nwg):
                    for i in cutlass.range_constexpr(n_acc):
                        acc[i] = acc[i] + red[t, i, g]
        if wg == 0:
            scale = cutlass.Float32(self.acc_scale)
            if cutlass.const_expr(self.split_k == 1):
                scale = scale * mAlpha[0]
            tCcD = thr_mma.partition_C(cute.make_identity_tensor((tn, tm)))
            tCgD = thr_mma.partition_C(gD_t[(None, None, nt, mt, split)])
            rows = n - nt * tn
            cols = m - mt * tm
            for i in cutlass.range_constexpr(cute.size(acc)):
                r, cc = tCcD[i]
                if r < rows and cc < cols:
                    tCgD[i] = (acc[i] * scale).to(self.epi_dtype)

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
        per = tm * 32 // _WG  # units per thread
        chunk = min(per, 4)  # units loaded before converting (bounds live registers)
        h_buf = sA16[(None, None, buf)]
        if cutlass.const_expr(self.w4a16):
            a32 = cute.recast_tensor(sA[(None, None, stage)], cutlass.Uint32)  # (tm, 128)
            raw = cute.make_rmem_tensor((chunk, 4), cutlass.Uint32)
            for p0 in cutlass.range_constexpr(0, per, chunk):
                for p in cutlass.range_constexpr(chunk):
                    u = t + (p0 + p) * _WG
                    cute.autovec_copy(cute.local_tile(a32, (1, 4), (u // 32, u % 32)),
                                      cute.local_tile(raw, (1, 4), (p, 0)))
                for p in cutlass.range_constexpr(chunk):
                    u = t + (p0 + p) * _WG
                    o = (_prmt(raw[p, 0], raw[p, 2], 0x5410),
                         _prmt(raw[p, 0], raw[p, 2], 0x7632),
                         _prmt(raw[p, 1], raw[p, 3], 0x5410),
                         _prmt(raw[p, 1], raw[p, 3], 0x7632))
                    self._store_pairs(h_buf, u // 32, (u % 32) // 8, u % 8, o)
        else:
            q32 = cute.recast_tensor(sA[(None, None, stage)], cutlass.Uint32)  # (tm, 32)
            sf_stage = sSFA[(None, None, None, None, stage)]
            sf_flat = cute.make_tensor(sf_stage.iterator, cute.make_layout(2048))
            row_base = (mt * tm) % 128
            rq = cute.make_rmem_tensor((chunk,), cutlass.Uint32)
            rs = cute.make_rmem_tensor((chunk,), cutlass.Uint8)
            for p0 in cutlass.range_constexpr(0, per, chunk):
                for p in cutlass.range_constexpr(chunk):
                    u = t + (p0 + p) * _WG
                    cw = u % 32
                    rr = row_base + u // 32
                    rq[p] = q32[u // 32, cw]
                    rs[p] = sf_flat[(rr % 32) * 16 + (rr // 32) * 4
                                    + (cw // 8) * _SF_ATOM_BYTES + (cw % 8) // 2]
                for p in cutlass.range_constexpr(chunk):
                    u = t + (p0 + p) * _WG
                    o = convert_pairs(rq[p], scale_word(rs[p]), bf16)
                    self._store_pairs(h_buf, u // 32, (u % 32) // 8, u % 8, o)

    @cute.jit
    def _store_pairs(self, h_buf, row, cc, w, o):
        for i in cutlass.range_constexpr(4):
            k = 16 * (2 * w + i // 2) + 8 * (i % 2) + 2 * cc
            r2 = cute.make_rmem_tensor((1, 2), self.mma_dtype)
            cute.recast_tensor(r2, cutlass.Uint32)[0] = o[i]
            cute.autovec_copy(r2, cute.local_tile(h_buf, (1, 2), (row, k // 2)))


__all__ = ["Sm90SwapAB"]
