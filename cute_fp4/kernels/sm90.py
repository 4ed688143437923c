"""Hopper (sm_90a) NVFP4 GEMM: TMA loads packed FP4, warpgroups dequantise, BF16/FP16 WGMMA.

``D[M, N] = alpha * A[M, K] @ B[N, K]^T`` with B NVFP4 and A either NVFP4 (W4A4) or 16-bit
(W4A16). SM90 has no FP4 tensor cores, but every E2M1 x UE4M3 product is exact in 16 bits,
so the kernel converts in shared memory and runs 16-bit WGMMA with FP32 accumulation.

Warp roles (one CTA): warpgroup 0 is the producer (warp 0 issues TMA for A, B and the scale
factors of each K tile into a ``stages``-deep mbarrier pipeline; the other three warps idle
with few registers); warpgroups 1.. are the consumers (``Warps.mma`` = warpgroups along M
and N, cooperative on one tile). Per K tile the consumers convert the packed stage into one
of two 16-bit buffers (the conversion of tile k overlaps the WGMMA of tile k-1), release the
stage, wait for the WGMMA of tile k-1, synchronise on a named barrier and issue the WGMMA of
tile k. The epilogue scales by alpha (and the conversion's power-of-two offset); 16-bit
outputs are staged through shared memory and stored with TMA, 32-bit results (FP32 output,
split-K partials) are stored from registers with bounds checks. With ``split_k > 1`` each
CTA of a tile writes its FP32 partial (without alpha) to ``workspace[split]``; the host
reduces. Persistent CTAs (one per SM) walk the work list in a grouped raster order.

Constraints:
* A, B K-major (TN); K a multiple of 32 (packed rows of 16-byte multiples); N a multiple of 8.
* Scale factors: UE4M3 (sign bit ignored) in the 128x4 blocked layout, padding zero-filled.
* Tile M and N: 64 or a multiple of 128 (scale atoms cover 128 rows); tile M a multiple of
  64 x warpgroups along M; at most 256 columns per warpgroup; tile K 64, 128 or 256 with
  the consumer threads splitting each tile into whole passes of 16-element chunks.
* 16-bit epilogue tiles: M a multiple of 64 x warpgroups along M; with more than one
  warpgroup along N, the whole tile N.
* Cooperative warp roles only (pingpong is refused by ``plan``); cluster 1x1; one CTA/SM.
* W4A4 runs FP16 WGMMA (exact: products are at least 2^-17 after the 2^-7 offset);
  W4A16 runs the activation's dtype (BF16 or FP16).
* The dynamic shared memory equals ``plan(schedule, problem).smem_bytes``.

``Schedule.swap_ab`` selects the decode variant in ``sm90_swapab.py`` (a subclass of this
class): the weight is WGMMA's A operand, converted in registers, and the kernel stores D^T.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.tensor_utils as tensor_utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.cute.runtime import make_ptr

from cute_fp4.kernels.sm90_convert import convert_word, scale_word
from cute_fp4.plan import plan
from cute_fp4.schedule import OutDtype, Problem, Raster, Schedule

_OUT = {OutDtype.BF16: cutlass.BFloat16, OutDtype.FP16: cutlass.Float16,
        OutDtype.FP32: cutlass.Float32}
_WG = 128  # threads per warpgroup
_SF_ATOM_BYTES = 512  # 128 rows x 4 scale columns
_PRODUCER_REGS = 40
_ALIGN = 1024
_GMEM = cute.AddressSpace.gmem
_I32 = cutlass.Int32


class Sm90Gemm:
    """NVFP4 x NVFP4 (W4A4) or 16-bit x NVFP4 (W4A16) GEMM for sm_90a."""

    def __init__(self, schedule: Schedule, problem: Problem):
        pl = plan(schedule, problem).raise_if_invalid()
        t = schedule.tile
        self.schedule, self.problem = schedule, problem
        self.tile_m, self.tile_n, self.tile_k = t.m, t.n, t.k
        self.stages = pl.stages
        self.epi_tile = tuple(pl.epi_tile)
        self.epi_stages = pl.epi_stages
        self.w4a16 = problem.w4a16
        self.mma_dtype = cutlass.BFloat16 if problem.a_format == "bf16" else cutlass.Float16
        self.split_k = schedule.split_k
        self.out_dtype = _OUT[schedule.epilogue.out_dtype]
        self.epi_dtype = cutlass.Float32 if self.split_k > 1 else self.out_dtype
        # 32-bit results (split-K partials, FP32 output) are stored from registers.
        self.direct_store = self.epi_dtype.width == 32
        self.wm, self.wn = schedule.warps.mma
        self.num_mma_wg = self.wm * self.wn
        self.num_mma_threads = self.num_mma_wg * _WG
        self.threads = self.num_mma_threads + _WG
        # One CTA per SM (the stage count fills shared memory); the producer warpgroup
        # gives registers to the consumers.
        launch_regs = min(255, 65536 // self.threads) // 8 * 8
        self.mma_regs = min(240, (launch_regs * self.threads - _PRODUCER_REGS * _WG)
                            // self.num_mma_threads // 8 * 8)
        sch = schedule.scheduler
        self.persistent = sch.persistent
        self.raster_m = sch.raster is Raster.ALONG_M
        self.group_size = sch.group_size
        self.sm_count = schedule.arch.sm_count
        # The conversion leaves 2^-7 per converted operand in the accumulator.
        self.acc_scale = float(2 ** (7 if self.w4a16 else 14))
        self.sf_cols_blocks = t.k // 64  # 512-byte scale atoms per K tile
        self.sfa_row_blocks = max(1, t.m // 128)
        self.sfb_row_blocks = max(1, t.n // 128)
        self.plan_smem_bytes = pl.smem_bytes
        self.smem_bytes: int | None = None
        # element types of the pointers pA, pSFA, pB, pSFB, pC (see runtime_args)
        a_t = self.mma_dtype if self.w4a16 else cutlass.Uint8
        self._ptr_types = (a_t, cutlass.Uint8, cutlass.Uint8, cutlass.Uint8, self.out_dtype)

    # ------------------------------------------------------------------ setup (traced)
    def _setup(self):
        tm, tn, tk = self.tile_m, self.tile_n, self.tile_k
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.mma_dtype, self.mma_dtype, OperandMajorMode.K, OperandMajorMode.K,
            cutlass.Float32, (self.wm, self.wn, 1), tiler_mn=(64, tn // self.wn))
        row = tensor_utils.LayoutEnum.ROW_MAJOR
        mnk = (tm, tn, tk)
        if self.w4a16:
            # A is TMA-loaded as 16-bit straight into WGMMA's swizzled layout.
            self.sA_layout = sm90_utils.make_smem_layout_a(row, mnk, self.mma_dtype, self.stages)
            self.sA16_layout = self.sA_layout
        else:
            self.sA_layout = cute.make_layout((tm, tk // 2, self.stages),
                                              stride=(tk // 2, 1, tm * tk // 2))
            self.sA16_layout = sm90_utils.make_smem_layout_a(row, mnk, self.mma_dtype, 2)
        self.sB_layout = cute.make_layout((tn, tk // 2, self.stages),
                                          stride=(tk // 2, 1, tn * tk // 2))
        self.sB16_layout = sm90_utils.make_smem_layout_b(row, mnk, self.mma_dtype, 2)
        kcb = self.sf_cols_blocks
        self.sSFA_layout = cute.make_layout((16, 32, kcb, self.sfa_row_blocks, self.stages))
        self.sSFB_layout = cute.make_layout((16, 32, kcb, self.sfb_row_blocks, self.stages))
        self.sC_layout = None
        if cutlass.const_expr(not self.direct_store):
            self.sC_layout = sm90_utils.make_smem_layout_epi(
                self.epi_dtype, row, self.epi_tile, self.epi_stages)

    def _shared_storage(self):
        a_type = self.mma_dtype if self.w4a16 else cutlass.Uint8
        w4a4 = not self.w4a16
        staged_c = not self.direct_store
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
            if w4a4:
                sA16: cute.struct.Align[
                    cute.struct.MemRange[self.mma_dtype, cute.cosize(self.sA16_layout)],
                    _ALIGN]
            sB16: cute.struct.Align[
                cute.struct.MemRange[self.mma_dtype, cute.cosize(self.sB16_layout)], _ALIGN]
            if staged_c:
                sC: cute.struct.Align[
                    cute.struct.MemRange[self.epi_dtype, cute.cosize(self.sC_layout)], _ALIGN]

        return SharedStorage

    # ------------------------------------------------------------------ host launcher
    @cute.jit
    def __call__(self, pA: cute.Pointer, pSFA: cute.Pointer, pB: cute.Pointer,
                 pSFB: cute.Pointer, pC: cute.Pointer, pAlpha: cute.Pointer,
                 pWork: cute.Pointer, m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32,
                 stream: cuda.CUstream):
        """Entry point: raw global pointers and M, N, K (cheap to pass from the host; see
        :meth:`runtime_args`). Builds the row-major global tensors and launches."""
        self._launch(*self._global_tensors(pA, pSFA, pB, pSFB, pC, pAlpha, pWork, m, n, k),
                     stream)

    @cute.jit
    def _global_tensors(self, pA, pSFA, pB, pSFB, pC, pAlpha, pWork, m, n, k):
        """Compact row-major tensors over the pointers, with the divisibility the host
        layer guarantees (N % 8, K % 32; 16-byte aligned bases, see ``cute_fp4.api``)."""
        n = cute.assume(n, divby=8)
        half_k = cute.assume(k // 2, divby=16)
        ld_b = cute.assume(cutlass.Int64(half_k), divby=16)
        if cutlass.const_expr(self.w4a16):
            kk = cute.assume(k, divby=32)
            mA = cute.make_tensor(pA, cute.make_layout(
                (m, kk), stride=(cute.assume(cutlass.Int64(kk), divby=8), 1)))
        else:
            mA = cute.make_tensor(pA, cute.make_layout((m, half_k), stride=(ld_b, 1)))
        mB = cute.make_tensor(pB, cute.make_layout((n, half_k), stride=(ld_b, 1)))
        n_cb = (half_k + 31) // 32
        sfa_len = cute.assume((m + 127) // 128 * n_cb * _SF_ATOM_BYTES, divby=_SF_ATOM_BYTES)
        sfb_len = cute.assume((n + 127) // 128 * n_cb * _SF_ATOM_BYTES, divby=_SF_ATOM_BYTES)
        mSFA = cute.make_tensor(pSFA, cute.make_layout((sfa_len,), stride=(1,)))
        mSFB = cute.make_tensor(pSFB, cute.make_layout((sfb_len,), stride=(1,)))
        ld_c = cute.assume(cutlass.Int64(n), divby=8)
        mC = cute.make_tensor(pC, cute.make_layout((m, n), stride=(ld_c, 1)))
        mAlpha = cute.make_tensor(pAlpha, cute.make_layout((1,), stride=(1,)))
        if cutlass.const_expr(self.split_k > 1):
            mWork = cute.make_tensor(pWork, cute.make_layout(
                (self.split_k, m, n), stride=(cute.assume(ld_c * m, divby=8), ld_c, 1)))
        else:
            mWork = cute.make_tensor(pWork, cute.make_layout((1,), stride=(1,)))
        return mA, mSFA, mB, mSFB, mC, mAlpha, mWork

    @cute.jit
    def _launch(self, mA: cute.Tensor, mSFA: cute.Tensor, mB: cute.Tensor,
                mSFB: cute.Tensor, mC: cute.Tensor, mAlpha: cute.Tensor,
                mWork: cute.Tensor, stream: cuda.CUstream):
        self._setup()
        tm, tn, tk = self.tile_m, self.tile_n, self.tile_k
        m = mC.shape[0]
        n = mC.shape[1]
        k_bytes = mB.shape[1]  # K / 2
        k_tiles = (k_bytes * 2 + tk - 1) // tk
        n_cb = (k_bytes + 31) // 32  # 4-column scale blocks along K

        tma_a, gA, tma_b, gB, tma_sfa, gSFA, tma_sfb, gSFB = self._make_load_atoms(
            mA, mSFA, mB, mSFB, m, n, n_cb)

        if cutlass.const_expr(self.split_k > 1):
            # workspace [split, M, N] seen as (M, N, split)
            mD = cute.make_tensor(mWork.iterator, cute.make_layout(
                (m, n, self.split_k), stride=(mWork.stride[1], 1, mWork.stride[0])))
        else:
            mD = cute.make_tensor(mC.iterator, cute.make_layout(
                (m, n, 1), stride=(mC.stride[0], 1, mC.stride[0] * m)))
        if cutlass.const_expr(self.direct_store):
            tma_c, gD = tma_b, mD  # tma_c unused
        else:
            tma_c, gD = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mD,
                cute.slice_(self.sC_layout, (None, None, 0)), self.epi_tile)

        storage_t = self._shared_storage()
        self.shared_storage = storage_t
        self.smem_bytes = storage_t.size_in_bytes()

        num_m = (m + tm - 1) // tm
        num_n = (n + tn - 1) // tn
        total = num_m * num_n * self.split_k
        grid_x = total
        if cutlass.const_expr(self.persistent):
            grid_x = cutlass.min(total, self.sm_count)

        self.kernel(
            tma_a, gA, tma_b, gB, tma_sfa, gSFA, tma_sfb, gSFB, tma_c, gD, mAlpha,
            self.tiled_mma, self.sA_layout, self.sB_layout, self.sSFA_layout,
            self.sSFB_layout, self.sA16_layout, self.sB16_layout, self.sC_layout,
            m, n, k_tiles, num_m, num_n, total,
        ).launch(grid=[grid_x, 1, 1], block=[self.threads, 1, 1], smem=self.smem_bytes,
                 stream=stream)

    def _make_load_atoms(self, mA, mSFA, mB, mSFB, m, n, n_cb):
        """TMA load atoms (and the tensors they partition) of A, B and both scale tensors,
        for the tile and stage layouts of ``_setup`` (shared by both SM90 kernels)."""
        tm, tn, tk = self.tile_m, self.tile_n, self.tile_k
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        a_tile_k = tk if self.w4a16 else tk // 2
        tma_a, gA = cpasync.make_tiled_tma_atom(
            g2s, mA, cute.slice_(self.sA_layout, (None, None, 0)), (tm, a_tile_k))
        tma_b, gB = cpasync.make_tiled_tma_atom(
            g2s, mB, cute.slice_(self.sB_layout, (None, None, 0)), (tn, tk // 2))
        tma_sfb, gSFB = self._make_sf_tma(mSFB, n, n_cb, self.sSFB_layout, self.sfb_row_blocks)
        if cutlass.const_expr(self.w4a16):
            tma_sfa, gSFA = tma_sfb, gSFB
        else:
            tma_sfa, gSFA = self._make_sf_tma(mSFA, m, n_cb, self.sSFA_layout,
                                              self.sfa_row_blocks)
        return tma_a, gA, tma_b, gB, tma_sfa, gSFA, tma_sfb, gSFB

    def _make_sf_tma(self, mSF, rows, n_cb, s_layout, row_blocks):
        """TMA over the blocked scale layout viewed as (16, 32, col block, row block)."""
        n_rb = (rows + 127) // 128
        view = cute.make_tensor(mSF.iterator, cute.make_layout(
            (16, 32, n_cb, n_rb), stride=(1, 16, _SF_ATOM_BYTES, n_cb * _SF_ATOM_BYTES)))
        return cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), view,
            cute.slice_(s_layout, (None, None, None, None, 0)),
            (16, 32, self.sf_cols_blocks, row_blocks))

    @cute.jit
    def _prologue(self, warp_idx, tma_atoms, sA_layout, sB_layout, sSFA_layout, sSFB_layout,
                  consumer_warps: int):
        """Shared by every SM90 kernel body: prefetch the TMA descriptors, allocate the
        shared storage, create the TMA -> consumers mainloop pipeline (one transaction of
        A, B and the scale atoms per stage) and arrive on its init barrier."""
        if warp_idx == 0:
            for atom in tma_atoms:
                cpasync.prefetch_descriptor(atom)
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        tx_bytes = (cute.size_in_bytes(self._a_type(), cute.slice_(sA_layout, (None, None, 0)))
                    + cute.size_in_bytes(cutlass.Uint8, cute.slice_(sB_layout, (None, None, 0)))
                    + cute.size_in_bytes(cutlass.Uint8,
                                         cute.slice_(sSFB_layout, (None,) * 4 + (0,))))
        if cutlass.const_expr(not self.w4a16):
            tx_bytes += cute.size_in_bytes(cutlass.Uint8,
                                           cute.slice_(sSFA_layout, (None,) * 4 + (0,)))
        mainloop = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
            tx_count=tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        return storage, mainloop

    # ------------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, gA: cute.Tensor, tma_b: cute.CopyAtom,
               gB: cute.Tensor, tma_sfa: cute.CopyAtom, gSFA: cute.Tensor,
               tma_sfb: cute.CopyAtom, gSFB: cute.Tensor, tma_c: cute.CopyAtom,
               gD: cute.Tensor, mAlpha: cute.Tensor, tiled_mma: cute.TiledMma,
               sA_layout, sB_layout, sSFA_layout, sSFB_layout, sA16_layout, sB16_layout,
               sC_layout, m: cutlass.Int32, n: cutlass.Int32, k_tiles: cutlass.Int32,
               num_m: cutlass.Int32, num_n: cutlass.Int32, total: cutlass.Int32):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        tma_atoms = [tma_a, tma_b, tma_sfb]
        if cutlass.const_expr(not self.w4a16):
            tma_atoms.append(tma_sfa)
        if cutlass.const_expr(not self.direct_store):
            tma_atoms.append(tma_c)
        storage, mainloop = self._prologue(warp_idx, tma_atoms, sA_layout, sB_layout,
                                           sSFA_layout, sSFB_layout, self.num_mma_wg * 4)

        if cutlass.const_expr(self.w4a16):
            sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
            sA16 = sA
            sSFA = None
        else:
            sA = storage.sA.get_tensor(sA_layout)
            sA16 = storage.sA16.get_tensor(sA16_layout.outer, swizzle=sA16_layout.inner)
            sSFA = storage.sSFA.get_tensor(sSFA_layout)
        sB = storage.sB.get_tensor(sB_layout)
        sSFB = storage.sSFB.get_tensor(sSFB_layout)
        sB16 = storage.sB16.get_tensor(sB16_layout.outer, swizzle=sB16_layout.inner)
        sC = None
        if cutlass.const_expr(not self.direct_store):
            sC = storage.sC.get_tensor(sC_layout.outer, swizzle=sC_layout.inner)

        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(_PRODUCER_REGS)
            if warp_idx == 0:
                self.load(mainloop, tma_a, gA, sA, tma_b, gB, sB, tma_sfa, gSFA, sSFA,
                          tma_sfb, gSFB, sSFB, k_tiles, num_m, num_n, total)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self.consume(mainloop, tiled_mma, sA, sA16, sB, sB16, sSFA, sSFB, sC,
                         tma_c, gD, mAlpha, tidx - _WG, warp_idx,
                         m, n, k_tiles, num_m, num_n, total)

    def _a_type(self):
        return self.mma_dtype if self.w4a16 else cutlass.Uint8

    # ------------------------------------------------------------------ scheduling
    def _tile_coords(self, tile_id, num_m, num_n):
        """Linear work id -> (m tile, n tile, split): grouped raster, split outermost."""
        mn = num_m * num_n
        split = tile_id // mn
        r = tile_id - split * mn
        g = self.group_size
        if cutlass.const_expr(self.raster_m):
            # bands of g M-tiles; consecutive ids walk M inside the band (share a B column)
            band = r // (g * num_n)
            first = band * g
            size = cutlass.min(g, num_m - first)
            local = r - band * g * num_n
            mt = first + local % size
            nt = local // size
        else:
            band = r // (g * num_m)
            first = band * g
            size = cutlass.min(g, num_n - first)
            local = r - band * g * num_m
            nt = first + local % size
            mt = local // size
        return mt, nt, split

    def _k_range(self, split, k_tiles):
        per = (k_tiles + self.split_k - 1) // self.split_k
        begin = split * per
        cnt = cutlass.max(cutlass.min(per, k_tiles - begin), 0)
        return begin, cnt

    # ------------------------------------------------------------------ producer warp
    @cute.jit
    def load(self, mainloop, tma_a, gA, sA, tma_b, gB, sB, tma_sfa, gSFA, sSFA,
             tma_sfb, gSFB, sSFB, k_tiles, num_m, num_n, total):
        tm, tn = self.tile_m, self.tile_n
        a_tile_k = self.tile_k if self.w4a16 else self.tile_k // 2
        gA_t = cute.local_tile(gA, (tm, a_tile_k), (None, None))
        gB_t = cute.local_tile(gB, (tn, self.tile_k // 2), (None, None))
        tAsA, tAgA = cpasync.tma_partition(tma_a, 0, cute.make_layout(1),
                                           cute.group_modes(sA, 0, 2),
                                           cute.group_modes(gA_t, 0, 2))
        tBsB, tBgB = cpasync.tma_partition(tma_b, 0, cute.make_layout(1),
                                           cute.group_modes(sB, 0, 2),
                                           cute.group_modes(gB_t, 0, 2))
        tSFBs, tSFBg = self._sf_partition(tma_sfb, gSFB, sSFB, self.sfb_row_blocks)
        if cutlass.const_expr(not self.w4a16):
            tSFAs, tSFAg = self._sf_partition(tma_sfa, gSFA, sSFA, self.sfa_row_blocks)

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        tile_id = cute.arch.block_idx()[0]
        step = cute.arch.grid_dim()[0]
        while tile_id < total:
            mt, nt, split = self._tile_coords(tile_id, num_m, num_n)
            k_begin, k_cnt = self._k_range(split, k_tiles)
            rb_a = (mt * tm) // 128 // self.sfa_row_blocks
            rb_b = (nt * tn) // 128 // self.sfb_row_blocks
            for kt in cutlass.range(k_cnt, unroll=1):
                kk = k_begin + kt
                mainloop.producer_acquire(state)
                bar = mainloop.producer_get_barrier(state)
                cute.copy(tma_a, tAgA[(None, mt, kk)], tAsA[(None, state.index)],
                          tma_bar_ptr=bar)
                cute.copy(tma_b, tBgB[(None, nt, kk)], tBsB[(None, state.index)],
                          tma_bar_ptr=bar)
                cute.copy(tma_sfb, tSFBg[(None, 0, 0, kk, rb_b)],
                          tSFBs[(None, state.index)], tma_bar_ptr=bar)
                if cutlass.const_expr(not self.w4a16):
                    cute.copy(tma_sfa, tSFAg[(None, 0, 0, kk, rb_a)],
                              tSFAs[(None, state.index)], tma_bar_ptr=bar)
                mainloop.producer_commit(state)
                state.advance()
            tile_id += step
        mainloop.producer_tail(state)

    def _sf_partition(self, tma_sf, gSF, sSF, row_blocks):
        tile = (16, 32, self.sf_cols_blocks, row_blocks)
        gSF_t = cute.local_tile(gSF, tile, (None, None, None, None))
        return cpasync.tma_partition(tma_sf, 0, cute.make_layout(1),
                                     cute.group_modes(sSF, 0, 4),
                                     cute.group_modes(gSF_t, 0, 4))

    # ------------------------------------------------------------------ consumer warpgroups
    @cute.jit
    def consume(self, mainloop, tiled_mma, sA, sA16, sB, sB16, sSFA, sSFB, sC, tma_c, gD,
                mAlpha, ctid, warp_idx, m, n, k_tiles, num_m, num_n, total):
        tm, tn = self.tile_m, self.tile_n
        wg = ctid // _WG
        thr_mma = tiled_mma.get_slice(wg * _WG)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA16))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB16))
        gD_t = cute.local_tile(gD, (tm, tn), (None, None, None))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(gD_t[(None, None, 0, 0, 0)]).shape,
                                    cutlass.Float32)
        num_k_blocks = cute.size(tCrA, mode=[2])
        sync = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_mma_threads)

        if cutlass.const_expr(self.direct_store):
            tCcD = tiled_mma.get_slice(ctid).partition_C(cute.make_identity_tensor((tm, tn)))
        else:
            epi = self._epilogue_setup(tiled_mma, acc, sC, ctid)
            store_pipe = pipeline.PipelineTmaStore.create(
                num_stages=self.epi_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                         self.num_mma_threads))
        scale = cutlass.Float32(self.acc_scale)
        if cutlass.const_expr(self.split_k == 1):
            scale = scale * mAlpha[0]

        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        tile_id = cute.arch.block_idx()[0]
        step = cute.arch.grid_dim()[0]
        tiles_done = cutlass.Int32(0)
        while tile_id < total:
            mt, nt, split = self._tile_coords(tile_id, num_m, num_n)
            k_begin, k_cnt = self._k_range(split, k_tiles)
            rows_a = m - mt * tm
            rows_b = n - nt * tn
            sf_base_a = ((mt * tm) % 128) // 32 * 4
            sf_base_b = ((nt * tn) % 128) // 32 * 4
            acc.fill(0.0)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            for kt in cutlass.range(k_cnt, unroll=1):
                buf = kt % 2
                mainloop.consumer_wait(read)
                if cutlass.const_expr(not self.w4a16):
                    self.convert(sA, sSFA, sA16, read.index, buf, rows_a, sf_base_a, tm,
                                 self.sfa_row_blocks, ctid, True)
                self.convert(sB, sSFB, sB16, read.index, buf, rows_b, sf_base_b, tn,
                             self.sfb_row_blocks, ctid, False)
                if cutlass.const_expr(not self.w4a16):
                    mainloop.consumer_release(read)
                cute.arch.fence_proxy("async.shared", space="cta")
                warpgroup.wait_group(0)
                if cutlass.const_expr(self.w4a16):
                    if kt > 0:
                        mainloop.consumer_release(release)
                        release.advance()
                sync.arrive_and_wait()
                a_idx = read.index if self.w4a16 else buf
                warpgroup.fence()
                for kb in cutlass.range_constexpr(num_k_blocks):
                    cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, a_idx)],
                              tCrB[(None, None, kb, buf)], acc)
                warpgroup.commit_group()
                read.advance()
            warpgroup.wait_group(0)
            if cutlass.const_expr(self.w4a16):
                if k_cnt > 0:
                    mainloop.consumer_release(release)
                    release.advance()
            if cutlass.const_expr(self.direct_store):
                self.epilogue_direct(tiled_mma, ctid, tCcD, acc, scale,
                                     gD_t[(None, None, mt, nt, split)], rows_a, rows_b)
            else:
                self.epilogue(epi, acc, scale, tma_c, gD_t[(None, None, mt, nt, split)], sC,
                              store_pipe, sync, warp_idx, tiles_done)
            tiles_done += 1
            tile_id += step
        if cutlass.const_expr(not self.direct_store):
            store_pipe.producer_tail()

    @cute.jit
    def convert(self, sQ, sSF, sH, stage, buf, rows_valid, sf_base, rows, row_blocks, ctid,
                skip_rows: cutlass.Constexpr):
        """Packed FP4 stage + its scale factors -> 16-bit buffer ``buf`` (rows x tile_k).

        Thread ``t`` owns 16-element chunk ``t % kc`` of rows ``t // kc + i * per_pass``. All
        shared-memory loads are issued first so that their latencies overlap; rows past the
        matrix are zero-filled by TMA (harmless), and with ``skip_rows`` whole passes past
        ``rows_valid`` are not converted (their accumulator rows are never stored).
        """
        tk = self.tile_k
        kc = tk // 16  # 16-element chunks (one scale each) per row
        per_pass = self.num_mma_threads // kc
        n_pass = rows // per_pass
        r0 = ctid // kc
        c = ctid % kc
        q_stage = cute.recast_tensor(sQ[(None, None, stage)], cutlass.Uint32)
        sf_ptr = sSF[(None, None, None, None, stage)].iterator + sf_base
        if cutlass.const_expr(rows >= 128):
            sf_layout = cute.make_layout(((32, 4, row_blocks), (4, self.sf_cols_blocks)),
                                         stride=((16, 4, self.sf_cols_blocks * _SF_ATOM_BYTES),
                                                 (1, _SF_ATOM_BYTES)))
        else:
            sf_layout = cute.make_layout(((32, rows // 32), (4, self.sf_cols_blocks)),
                                         stride=((16, 4), (1, _SF_ATOM_BYTES)))
        sf = cute.make_tensor(sf_ptr, sf_layout)
        h_buf = sH[(None, None, buf)]
        rQ = cute.make_rmem_tensor((2, n_pass), cutlass.Uint32)
        rS = cute.make_rmem_tensor((n_pass,), cutlass.Uint8)
        for i in cutlass.range_constexpr(n_pass):
            r = r0 + i * per_pass
            rQ[0, i] = q_stage[(r, 2 * c)]
            rQ[1, i] = q_stage[(r, 2 * c + 1)]
            rS[i] = sf[(r, c)]
        for i in cutlass.range_constexpr(n_pass):
            if cutlass.const_expr(skip_rows):
                if i * per_pass < rows_valid:
                    self._convert_chunk(rQ, rS, i, h_buf, r0 + i * per_pass, c)
            else:
                self._convert_chunk(rQ, rS, i, h_buf, r0 + i * per_pass, c)

    @cute.jit
    def _convert_chunk(self, rQ, rS, i, h_buf, r, c):
        bf16 = self.mma_dtype is cutlass.BFloat16
        scale = scale_word(rS[i])
        rH = cute.make_rmem_tensor((1, 16), self.mma_dtype)
        rH32 = cute.recast_tensor(rH, cutlass.Uint32)
        for w in cutlass.range_constexpr(2):
            o = convert_word(rQ[w, i], scale, bf16)
            for j in cutlass.range_constexpr(4):
                rH32[4 * w + j] = o[j]
        cute.autovec_copy(rH, cute.local_tile(h_buf, (1, 16), (r, c)))

    # ------------------------------------------------------------------ epilogue
    @cute.jit
    def epilogue_direct(self, tiled_mma, ctid, tCcD, acc, scale, gD_tile, rows, cols):
        """32-bit results straight from the accumulators to global memory (bounds-checked)."""
        tCgD = tiled_mma.get_slice(ctid).partition_C(gD_tile)
        for i in cutlass.range_constexpr(cute.size(acc)):
            r, c = tCcD[i]
            if r < rows and c < cols:
                tCgD[i] = acc[i] * scale

    def _epilogue_setup(self, tiled_mma, acc, sC, ctid):
        row = tensor_utils.LayoutEnum.ROW_MAJOR
        atom_r2s = sm90_utils.sm90_get_smem_store_op(row, elem_ty_d=self.epi_dtype,
                                                     elem_ty_acc=cutlass.Float32)
        if cutlass.const_expr(self.epi_dtype.width == 16):
            atom_c = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4),
                                         self.epi_dtype)
        else:
            atom_c = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Float32)
        tiled_r2s = cute.make_tiled_copy_S(atom_r2s,
                                           cute.make_tiled_copy_C_atom(atom_c, tiled_mma))
        thr_r2s = tiled_r2s.get_slice(ctid)
        tRS_sD = thr_r2s.partition_D(sC)
        tRS_rAcc = tiled_r2s.retile(acc)
        rd_shape = cute.shape(thr_r2s.partition_S(sC))[:3]
        tRS_rD = cute.make_rmem_tensor(rd_shape, cutlass.Float32)
        tRS_rOut = cute.make_rmem_tensor(rd_shape, self.epi_dtype)
        return tiled_r2s, tRS_sD, tRS_rAcc, tRS_rD, tRS_rOut

    @cute.jit
    def epilogue(self, epi, acc, scale, tma_c, gD_tile, sC, store_pipe, sync, warp_idx,
                 tiles_done):
        tiled_r2s, tRS_sD, tRS_rAcc, tRS_rD, tRS_rOut = epi
        gD_epi = cute.zipped_divide(gD_tile, self.epi_tile)
        bSG_sD, bSG_gD = cpasync.tma_partition(tma_c, 0, cute.make_layout(1),
                                               cute.group_modes(sC, 0, 2), gD_epi)
        epi_num = cute.size(gD_epi, mode=[1])
        epi_shape = gD_epi.shape[1]
        epi_order = cute.make_layout(epi_shape, stride=(epi_shape[1], 1))
        n_vals = cute.size(tRS_rD)
        for e in cutlass.range_constexpr(epi_num):
            for v in cutlass.range_constexpr(n_vals):
                tRS_rD[v] = tRS_rAcc[e * n_vals + v]
            tRS_rOut.store((tRS_rD.load() * scale).to(self.epi_dtype))
            ebuf = (tiles_done * epi_num + e) % self.epi_stages
            cute.copy(tiled_r2s, tRS_rOut, tRS_sD[(None, None, None, ebuf)])
            cute.arch.fence_proxy("async.shared", space="cta")
            sync.arrive_and_wait()
            if warp_idx == 4:
                cute.copy(tma_c, bSG_sD[(None, ebuf)], bSG_gD[(None, epi_order.get_hier_coord(e))])
                store_pipe.producer_commit()
                store_pipe.producer_acquire()
            sync.arrive_and_wait()

    # ------------------------------------------------------------------ host-side arguments
    def fake_args(self) -> tuple:
        """Placeholder pointers and sizes for ``cute.compile`` (one compile serves all
        shapes: M, N, K are runtime Int32 arguments)."""
        from cutlass.cute.runtime import make_fake_stream

        t = self._ptr_types
        work_align = 16 if self.split_k > 1 else 4
        return (*(make_ptr(d, 0, _GMEM, assumed_align=16) for d in t),
                make_ptr(cutlass.Float32, 0, _GMEM, assumed_align=4),
                make_ptr(cutlass.Float32, 0, _GMEM, assumed_align=work_align),
                cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(0), make_fake_stream())

    def runtime_args(self, a, a_scale, b, b_scale, out, alpha, workspace, stream) -> tuple:
        """The same arguments from torch tensors: their data pointers (the API layer has
        checked shapes, contiguity and 16-byte alignment) and M, N, K. Reads only
        ``data_ptr()`` and ``shape``; no DLPack."""
        return _pointer_args(self, a, a_scale, b, b_scale, out, alpha, workspace, stream)


def _pointer_args(kernel, a, a_scale, b, b_scale, out, alpha, workspace, stream) -> tuple:
    """``(pA, pSFA, pB, pSFB, pC, pAlpha, pWork, M, N, K, stream)`` for the pointer-taking
    launchers (Sm90Gemm, Sm90SwapAB, Sm120Gemm). A W4A16 ``a`` has no scale: its scale
    pointer is B's (unused by the kernel)."""
    t = kernel._ptr_types
    m, n = out.shape
    k = b.shape[1] * 2
    sfb = b_scale.data_ptr()
    alpha_p = alpha.data_ptr()
    return (make_ptr(t[0], a.data_ptr(), _GMEM, assumed_align=16),
            make_ptr(t[1], sfb if a_scale is None else a_scale.data_ptr(), _GMEM,
                     assumed_align=16),
            make_ptr(t[2], b.data_ptr(), _GMEM, assumed_align=16),
            make_ptr(t[3], sfb, _GMEM, assumed_align=16),
            make_ptr(t[4], out.data_ptr(), _GMEM, assumed_align=16),
            make_ptr(cutlass.Float32, alpha_p, _GMEM, assumed_align=4),
            make_ptr(cutlass.Float32, workspace.data_ptr(), _GMEM, assumed_align=16)
            if kernel.split_k > 1 else make_ptr(cutlass.Float32, alpha_p, _GMEM,
                                                assumed_align=4),
            _I32(m), _I32(n), _I32(k), stream)


__all__ = ["Sm90Gemm"]
