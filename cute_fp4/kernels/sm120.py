"""SM120/SM121 NVFP4 block-scaled GEMM: ``D = alpha * (A * SFA) @ (B * SFB)^T`` (TN).

One warp-specialized kernel class for RTX 5090 / RTX PRO 6000 (sm_120a) and GB10 (sm_121a).
A producer warp moves A, B (TMA) and the scale factors (TMA or cp.async) into a ring of
shared-memory stages; MMA warps read them with ``ldmatrix``, issue warp-level
``mma.sync ... kind::mxf4nvf4.block_scale.scale_vec::4X`` (SASS ``OMMA.SF``) into FP32
registers, then store the tile through shared memory with TMA. Every variant is a field
of the :class:`~cute_fp4.schedule.Schedule`, chosen while tracing; no code is copied per
variant.

Constraints
-----------
* A [M, K] and B [N, K]: Float4E2M1FN packed two per byte (even K in the low nibble),
  K-major (TN only); passed as uint8 [rows, K/2] and reinterpreted in the launcher.
* Scale factors: Float8E4M3FN (UE4M3), one per 16 K elements, in the cuBLAS 128x4 blocked
  layout, padded to rows -> multiple of 128 and K/16 -> multiple of 4, padding zero-filled
  (or at least not NaN: padded scales multiply zero-filled data). Passed flat as uint8.
* K a multiple of 32 (16-byte rows for TMA); M, N arbitrary >= 1 with N % 8 == 0
  (16-byte output rows). Partial tiles: TMA zero-fills loads and clips stores.
* Tile: M, N in {32, 64, 128} (dividing the 128-row scale atom), M a multiple of 16 x
  warps along M, 2 or 4 warps along N, N a multiple of 8 x warps along N (the SM120 N
  permutation interleaves 2 x 16 columns); K in {64, 128, 192, 256}. Epilogue tiles are
  whole MMA sub-tiles. plan() refuses everything else. Tiles under 128 rows load the
  whole 128-row scale atom and the MMA reads their sub-block through an offset view
  (sf_layout.py), as plan() counts it.
* Scale factors by TMA (Int16 bulk tensor copies) or by cp.async (the producer warp's 32
  lanes copy 16-byte chunks of the same bytes into the same layout and arrive, no-inc, on
  the stage's full barrier, whose count is then 1 + 32).
* Accumulation FP32; output BF16, FP16 or FP32 with alpha (1-element float32 device
  tensor) applied. ``split_k > 1`` writes FP32 partials without alpha to a workspace
  [split_k, M, N]; the host reduces ``workspace.sum(0) * alpha``.
* Shared memory: exactly ``plan(schedule, problem).smem_bytes`` (regions barriers | A | B |
  SFA | SFB | C, each 1024-byte aligned); at most 101,376 B. Cluster 1x1x1 (SM120 has no
  multicast).
* Pingpong: two MMA groups alternate work units; their mainloops and their epilogues are
  each serialized by a pair of mbarriers (the groups share the one C buffer). The CTA is
  padded to whole warpgroups so setmaxnreg can hand the producer's registers to the MMA
  warps (168 -> 232 per thread with 2 x 4 MMA warps).
* Compiled signature: ``(pA, pSFA, pB, pSFB, pC, pAlpha, M, N, K, L, max_ctas, stream)``:
  raw global pointers (``pC`` = out, seen as [1, M, N], or the split-K workspace) and Int32
  sizes; ``__call__`` builds the compact row-major tensors (``_launch`` is the launcher).
  See :meth:`Sm120Gemm.runtime_args`.
  M = 0 or N = 0 would launch an empty grid: the host layer must skip those.
"""

import functools

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm120_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warp

from cute_fp4.kernels import sf_layout
from cute_fp4.kernels.sm120_parts import (
    WorkUnits,
    c_dtype_of,
    epilogue_store,
    load_sf_cp_async,
    skip_stages,
    turn_arrive,
    turn_wait,
)
from cute_fp4.plan import plan
from cute_fp4.schedule import Problem, Raster, Schedule, SFLoad, WarpRoles

SF_VEC = sf_layout.SF_VEC
WARP = 32
ALIGN = 1024
REG_FILE = 65536  # 32-bit registers per SM (one CTA per SM: ~89 KiB of shared memory)
LOAD_REGS, MMA_REGS_MAX = 40, 232  # setmaxnreg budgets of the producer / MMA warpgroups


def _register_split(threads: int, mma_threads: int):
    """(producer, MMA) registers per thread for setmaxnreg, or None when it cannot help.

    Pingpong with 2 x 4 MMA warps: 2 x 128 x 232 + 128 x 40 = 64,512 of 65,536 registers.
    """
    entry = REG_FILE // threads // 8 * 8
    mma = min(MMA_REGS_MAX,
              (REG_FILE - (threads - mma_threads) * LOAD_REGS) // mma_threads // 8 * 8)
    return (LOAD_REGS, mma) if mma > entry else None


class Sm120Gemm:
    """NVFP4 x NVFP4 -> BF16/FP16/FP32 GEMM for SM120, configured by a :class:`Schedule`."""

    def __init__(self, schedule: Schedule, problem: Problem | None = None):
        self.schedule = schedule
        self.problem = problem or Problem()
        pl = plan(schedule, self.problem).raise_if_invalid()
        t = schedule.tile
        self.tile_mnk = (t.m, t.n, t.k)
        self.stages = pl.stages
        self.epi_tile = pl.epi_tile
        self.epi_stages = pl.epi_stages
        self.plan_smem_bytes = pl.smem_bytes
        self.groups = schedule.warps.groups
        self.pingpong = schedule.warps.roles is WarpRoles.PINGPONG
        self.warps_mn = schedule.warps.mma
        self.group_warps = self.warps_mn[0] * self.warps_mn[1]
        self.group_threads = self.group_warps * WARP
        self.producer_warp = self.group_warps * self.groups
        self.threads = (self.producer_warp + 1) * WARP
        # Pingpong holds two accumulators' worth of warps: pad the CTA to whole warpgroups
        # so setmaxnreg can move registers from the producer warpgroup to the MMA warps.
        self.regs = None
        if self.pingpong and self.producer_warp % 4 == 0:
            self.threads = (self.producer_warp + 4) * WARP
            self.regs = _register_split(self.threads, self.producer_warp * WARP)
        self.sf_cp_async = schedule.sf_load is SFLoad.CP_ASYNC
        self.split_k = schedule.split_k
        self.sched = schedule.scheduler
        self.along_m = schedule.scheduler.raster is Raster.ALONG_M
        self.c_dtype = c_dtype_of(schedule)
        self.sf_rows = (sf_layout.sf_smem_rows(t.m), sf_layout.sf_smem_rows(t.n))
        self.smem_bytes = None  # set while tracing
        self.num_barriers = 2 * self.stages + 2 * self.groups

    # ------------------------------------------------------------------ setup (trace time)

    def _setup(self):
        """MMA atom, permutation, shared-memory layouts and the storage struct.

        Called in the host launcher and again at the top of the kernel: CuTe layout values
        belong to the function being traced, so the kernel builds its own copies.
        """
        tm, tn, tk = self.tile_mnk
        op = warp.MmaMXF4NVF4Op(cutlass.Float4E2M1FN, cutlass.Float32, cutlass.Float8E4M3FN)
        perm = sm120_utils.get_permutation_mnk(self.tile_mnk, SF_VEC, False)
        self.tiled_mma = cute.make_tiled_mma(
            op, cute.make_layout((*self.warps_mn, 1)), permutation_mnk=perm)
        self.sA_layout = self._operand_layout(tm, tk, cutlass.Float4E2M1FN, self.stages)
        self.sB_layout = self._operand_layout(tn, tk, cutlass.Float4E2M1FN, self.stages)
        self.sSFA_layout = sf_layout.sf_smem_layout(self.sf_rows[0], tk, self.stages)
        self.sSFB_layout = sf_layout.sf_smem_layout(self.sf_rows[1], tk, self.stages)
        self.sSFA_view = sf_layout.sf_smem_layout(tm, tk, self.stages)
        self.sSFB_view = sf_layout.sf_smem_layout(tn, tk, self.stages)
        self.sC_layout = self._operand_layout(*self.epi_tile, self.c_dtype, self.epi_stages)
        self.tx_bytes = (tm + tn) * tk // 2
        if not self.sf_cp_async:
            self.tx_bytes += (self.sf_rows[0] + self.sf_rows[1]) * tk // SF_VEC
        self.shared_storage = self._storage_struct()
        self.smem_bytes = self.shared_storage.size_in_bytes()
        if self.smem_bytes != self.plan_smem_bytes:
            raise AssertionError(f"kernel allocates {self.smem_bytes} B of shared memory, "
                                 f"plan() counted {self.plan_smem_bytes} B")

    @staticmethod
    def _operand_layout(rows, cols, dtype, stages):
        """Swizzled row-major (K- or N-major) staged shared-memory layout."""
        kind = sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, dtype, cols)
        atom = cute.nvgpu.warpgroup.make_smem_layout_atom(kind, dtype)
        return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))

    def _storage_struct(self):
        sf = cutlass.Float8E4M3FN

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, self.num_barriers]
            sA: cute.struct.Align[cute.struct.MemRange[
                cutlass.Float4E2M1FN, cute.cosize(self.sA_layout)], ALIGN]
            sB: cute.struct.Align[cute.struct.MemRange[
                cutlass.Float4E2M1FN, cute.cosize(self.sB_layout)], ALIGN]
            sSFA: cute.struct.Align[cute.struct.MemRange[
                sf, cute.cosize(cute.filter_zeros(self.sSFA_layout))], ALIGN]
            sSFB: cute.struct.Align[cute.struct.MemRange[
                sf, cute.cosize(cute.filter_zeros(self.sSFB_layout))], ALIGN]
            sC: cute.struct.Align[cute.struct.MemRange[
                self.c_dtype, cute.cosize(self.sC_layout)], ALIGN]

        return SharedStorage

    # ------------------------------------------------------------------ host launcher

    @cute.jit
    def __call__(self, pA: cute.Pointer, pSFA: cute.Pointer, pB: cute.Pointer,
                 pSFB: cute.Pointer, pC: cute.Pointer, pAlpha: cute.Pointer,
                 m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32, splits: cutlass.Int32,
                 max_ctas: cutlass.Int32, stream):
        """Entry point: raw global pointers (``pC`` = out, or the split-K workspace) and
        M, N, K, ``splits`` (= split_k, C's leading mode L: a runtime value so the C TMA
        stays 3-D as when C came from DLPack); builds the compact row-major tensors below
        and launches."""
        n = cute.assume(n, divby=8)
        half_k = cute.assume(k // 2, divby=16)
        a = cute.make_tensor(pA, cute.make_layout(
            (m, half_k), stride=(cute.assume(cutlass.Int64(half_k), divby=16), 1)))
        b = cute.make_tensor(pB, cute.make_layout(
            (n, half_k), stride=(cute.assume(cutlass.Int64(half_k), divby=16), 1)))
        n_cb = (half_k + 31) // 32  # 4-column (64 K) scale blocks
        sfa = cute.make_tensor(pSFA, cute.make_layout(
            (cute.assume((m + 127) // 128 * n_cb * 512, divby=512),), stride=(1,)))
        sfb = cute.make_tensor(pSFB, cute.make_layout(
            (cute.assume((n + 127) // 128 * n_cb * 512, divby=512),), stride=(1,)))
        ldc = cute.assume(cutlass.Int64(n), divby=8)
        c = cute.make_tensor(pC, cute.make_layout(
            (splits, m, n), stride=(cute.assume(ldc * m, divby=8), ldc, 1)))
        alpha = cute.make_tensor(pAlpha, cute.make_layout((1,), stride=(1,)))
        self._launch(a, sfa, b, sfb, c, alpha, max_ctas, stream)

    @cute.jit
    def _launch(self, a: cute.Tensor, sfa: cute.Tensor, b: cute.Tensor, sfb: cute.Tensor,
                c: cute.Tensor, alpha: cute.Tensor, max_ctas: cutlass.Int32, stream):
        """a/b: uint8 [rows, K/2]; sfa/sfb: uint8 flat blocked scales; c: [L, M, N]."""
        self._setup()
        tm, tn, tk = self.tile_mnk
        mA = self._fp4_view(a)
        mB = self._fp4_view(b)
        m, k = mA.shape[0], mA.shape[1]
        n = mB.shape[0]
        mSFA = self._sf_view(sfa, m, k)
        mSFB = self._sf_view(sfb, n, k)
        mC = cute.make_tensor(c.iterator, cute.make_layout(
            (c.shape[1], c.shape[2], c.shape[0]), stride=(c.stride[1], 1, c.stride[0])))

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_a, tma_mA = cpasync.make_tiled_tma_atom(
            g2s, mA, cute.slice_(self.sA_layout, (None, None, 0)), (tm, tk))
        tma_b, tma_mB = cpasync.make_tiled_tma_atom(
            g2s, mB, cute.slice_(self.sB_layout, (None, None, 0)), (tn, tk))
        tma_sfa, tma_mSFA = cpasync.make_tiled_tma_atom(
            g2s, mSFA, cute.slice_(self.sSFA_layout, (None, None, 0)),
            (self.sf_rows[0], tk), internal_type=cutlass.Int16)
        tma_sfb, tma_mSFB = cpasync.make_tiled_tma_atom(
            g2s, mSFB, cute.slice_(self.sSFB_layout, (None, None, 0)),
            (self.sf_rows[1], tk), internal_type=cutlass.Int16)
        tma_c, tma_mC = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mC,
            cute.slice_(self.sC_layout, (None, None, 0)), self.epi_tile)

        units = WorkUnits.create(m, n, k, self.tile_mnk, self.split_k)
        grid = units.total
        if cutlass.const_expr(self.sched.persistent):
            grid = cutlass.min(units.total, max_ctas)
        self.kernel(
            tma_a, tma_mA, tma_b, tma_mB, tma_sfa, tma_mSFA, tma_sfb, tma_mSFB, tma_c, tma_mC,
            sfa, sfb, alpha, units.tiles_m, units.tiles_n, units.k_tiles, units.k_blocks,
        ).launch(grid=[grid, 1, 1], block=[self.threads, 1, 1], cluster=[1, 1, 1],
                 smem=self.smem_bytes, stream=stream,
                 max_number_threads=[self.threads, 1, 1], min_blocks_per_mp=1)

    @staticmethod
    def _fp4_view(t: cute.Tensor) -> cute.Tensor:
        """uint8 [rows, K/2] -> Float4E2M1FN [rows, K, 1] (K-major)."""
        ptr = cute.recast_ptr(t.iterator, dtype=cutlass.Float4E2M1FN)
        rows, half_k = t.shape
        return cute.make_tensor(ptr, cute.make_layout(
            (rows, half_k * 2, 1), stride=(t.stride[0] * 2, 1, 0)))

    @staticmethod
    def _sf_view(t: cute.Tensor, rows, k) -> cute.Tensor:
        """Flat uint8 blocked scales -> UE4M3 ((32,4),R),((16,4),C),1 blocked layout."""
        ptr = cute.recast_ptr(t.iterator, dtype=cutlass.Float8E4M3FN)
        return cute.make_tensor(ptr, blockscaled_utils.tile_atom_to_shape_SF(
            (rows, k, 1), SF_VEC))

    # ------------------------------------------------------------------ device kernel

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom,
               mB: cute.Tensor, tma_sfa: cute.CopyAtom, mSFA: cute.Tensor,
               tma_sfb: cute.CopyAtom, mSFB: cute.Tensor, tma_c: cute.CopyAtom,
               mC: cute.Tensor, sfa_bytes: cute.Tensor, sfb_bytes: cute.Tensor,
               alpha: cute.Tensor, tiles_m: cutlass.Int32, tiles_n: cutlass.Int32,
               k_tiles: cutlass.Int32, k_blocks: cutlass.Int32):
        self._setup()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == self.producer_warp:
            for atom in (tma_a, tma_b, tma_sfa, tma_sfb, tma_c):
                cpasync.prefetch_descriptor(atom)
        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        bars = storage.barriers.data_ptr()
        mainloop = self._make_mainloop_pipeline(bars)
        self._init_turns(bars + 2 * self.stages, warp_idx)
        cute.arch.sync_threads()
        units = WorkUnits(tiles_m, tiles_n, k_tiles, k_blocks, self.split_k,
                          self.sched.group_size, self.along_m)
        if warp_idx >= self.producer_warp:
            if cutlass.const_expr(self.regs is not None):
                cute.arch.setmaxregister_decrease(self.regs[0])
            if warp_idx == self.producer_warp:
                self.load_tiles(storage, mainloop, units, tma_a, mA, tma_b, mB, tma_sfa,
                                mSFA, tma_sfb, mSFB, sfa_bytes, sfb_bytes)
        else:
            if cutlass.const_expr(self.regs is not None):
                cute.arch.setmaxregister_increase(self.regs[1])
            self.mma_and_store(storage, mainloop, units, bars + 2 * self.stages, tma_c, mC,
                               alpha, warp_idx)

    def _make_mainloop_pipeline(self, bars):
        # cp.async scale loads add one no-increment arrival per producer lane.
        producers = 1 + (WARP if self.sf_cp_async else 0)
        return pipeline.PipelineTmaAsync.create(
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, producers),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.group_warps),
            tx_count=self.tx_bytes,
            barrier_storage=bars,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )

    @cute.jit
    def _init_turns(self, turn_bars, warp_idx):
        """Pingpong: mbarriers [mma turn g0, g1, epilogue turn g0, g1]."""
        if cutlass.const_expr(self.pingpong):
            if warp_idx == 0:
                with cute.arch.elect_one():
                    for i in cutlass.range_constexpr(4):
                        cute.arch.mbarrier_init(turn_bars + i, self.group_threads)
        cute.arch.mbarrier_init_fence()

    def _work_units_of_cta(self):
        bid, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()
        return bid, nctas

    # ------------------------------------------------------------------ producer warp

    @cute.jit
    def load_tiles(self, storage, mainloop, units, tma_a, mA, tma_b, mB, tma_sfa, mSFA,
                   tma_sfb, mSFB, sfa_bytes, sfb_bytes):
        """Producer warp: for each work unit, its K tiles of A, B, SFA, SFB into the ring."""
        tm, tn, tk = self.tile_mnk
        tAsA, tAgA = self._tma_views(tma_a, storage.sA.get_tensor(
            self.sA_layout.outer, swizzle=self.sA_layout.inner), mA, (tm, tk))
        tBsB, tBgB = self._tma_views(tma_b, storage.sB.get_tensor(
            self.sB_layout.outer, swizzle=self.sB_layout.inner), mB, (tn, tk))
        sSFA = storage.sSFA.get_tensor(self.sSFA_layout)
        sSFB = storage.sSFB.get_tensor(self.sSFB_layout)
        tAsSFA, tAgSFA = self._tma_views(tma_sfa, sSFA, mSFA, (self.sf_rows[0], tk), True)
        tBsSFB, tBgSFB = self._tma_views(tma_sfb, sSFB, mSFB, (self.sf_rows[1], tk), True)
        ratio_a = self.sf_rows[0] // tm
        ratio_b = self.sf_rows[1] // tn
        lane = cute.arch.lane_idx()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        unit, nctas = self._work_units_of_cta()
        while unit < units.total:
            cm, cn, _, k0, k_count = units.coords(unit)
            for kk in cutlass.range(k_count, unroll=1):
                mainloop.producer_acquire(state)
                bar = mainloop.producer_get_barrier(state)
                kt = k0 + kk
                s = state.index
                cute.copy(tma_a, tAgA[(None, cm, kt, 0)], tAsA[(None, s)], tma_bar_ptr=bar)
                cute.copy(tma_b, tBgB[(None, cn, kt, 0)], tBsB[(None, s)], tma_bar_ptr=bar)
                if cutlass.const_expr(self.sf_cp_async):
                    load_sf_cp_async(sfa_bytes, sSFA, s, cm // ratio_a, kt, units.k_blocks,
                                     tk, lane)
                    load_sf_cp_async(sfb_bytes, sSFB, s, cn // ratio_b, kt, units.k_blocks,
                                     tk, lane)
                    cute.arch.cp_async_mbarrier_arrive_noinc(bar)
                else:
                    cute.copy(tma_sfa, tAgSFA[(None, cm // ratio_a, kt, 0)],
                              tAsSFA[(None, s)], tma_bar_ptr=bar)
                    cute.copy(tma_sfb, tBgSFB[(None, cn // ratio_b, kt, 0)],
                              tBsSFB[(None, s)], tma_bar_ptr=bar)
                mainloop.producer_commit(state)
                state.advance()
            unit += nctas
        mainloop.producer_tail(state)

    @staticmethod
    @cute.jit
    def _tma_views(atom, sX, mX, tile, filter_zeros=False):
        """TMA partition: (TMA, stage) smem view and (TMA, rest_rows, rest_k, L) gmem view."""
        gX = cute.local_tile(mX, tile, (None, None, None))
        tXsX, tXgX = cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
            cute.group_modes(gX, 0, 2))
        if cutlass.const_expr(filter_zeros):
            return cute.filter_zeros(tXsX), cute.filter_zeros(tXgX)
        return tXsX, tXgX

    # ------------------------------------------------------------------ MMA warps

    @cute.jit
    def mma_and_store(self, storage, mainloop, units, turn_bars, tma_c, mC, alpha, warp_idx):
        """MMA warps: per work unit, the K mainloop into registers, then the epilogue."""
        tidx, _, _ = cute.arch.thread_idx()
        group = warp_idx // self.group_warps
        gtid = tidx % self.group_threads
        frags = self._mma_fragments(storage, gtid)
        acc = frags["acc"]
        sC = storage.sC.get_tensor(self.sC_layout.outer, swizzle=self.sC_layout.inner)
        gC = cute.local_tile(mC, self.tile_mnk[:2], (None, None, None))
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        unit, nctas = self._work_units_of_cta()
        turn = cutlass.Int32(0)
        step = cutlass.Int32(0)
        while unit < units.total:
            cm, cn, split, k0, k_count = units.coords(unit)
            if step % self.groups == group:
                turn_wait(self.pingpong, turn_bars, group, turn, 0)
                acc.fill(0.0)
                state = self.mainloop(mainloop, state, frags, k_count, cm, cn)
                turn_arrive(self.pingpong, turn_bars, group, 0)
                turn_wait(self.pingpong, turn_bars, group, turn, 2)
                epilogue_store(self, acc, sC, tma_c, gC[(None, None, cm, cn, split)], alpha,
                               gtid, warp_idx % self.group_warps == 0, group)
                turn_arrive(self.pingpong, turn_bars, group, 2)
                turn += 1
            else:
                state = skip_stages(state, k_count)
            step += 1
            unit += nctas

    @cute.jit
    def _mma_fragments(self, storage, gtid):
        """Register fragments and smem->register copies of A, B, SFA, SFB; the accumulator."""
        tiled_mma = self.tiled_mma
        thr_mma = tiled_mma.get_slice(gtid)
        sA = storage.sA.get_tensor(self.sA_layout.outer, swizzle=self.sA_layout.inner)
        sB = storage.sB.get_tensor(self.sB_layout.outer, swizzle=self.sB_layout.inner)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA)[None, None, None, 0])
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB)[None, None, None, 0])
        sfa0 = cute.make_tensor(storage.sSFA.data_ptr(), self.sSFA_view)
        sfb0 = cute.make_tensor(storage.sSFB.data_ptr(), self.sSFB_view)
        tCrSFA = sm120_utils.partition_fragment_SFA(sfa0[None, None, 0], thr_mma, gtid)
        tCrSFB = sm120_utils.partition_fragment_SFB(sfb0[None, None, 0], thr_mma, gtid)
        tCrSFA = self._sf_fragment_vmk(tCrSFA)
        tCrSFB = self._sf_fragment_vmk(tCrSFB)
        ldsm = warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4)
        copy_a = cute.make_tiled_copy_A(
            cute.make_copy_atom(ldsm, cutlass.Float4E2M1FN), tiled_mma)
        copy_b = cute.make_tiled_copy_B(
            cute.make_copy_atom(ldsm, cutlass.Float4E2M1FN), tiled_mma)
        sf_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Float8E4M3FN)
        perm = tiled_mma.permutation_mnk
        copy_sfa = cute.make_tiled_copy(
            sf_atom, sm120_utils.get_layoutSFA_TV(tiled_mma),
            (cute.size(perm[0]), cute.size(perm[2])))
        copy_sfb = cute.make_tiled_copy(
            sf_atom, sm120_utils.get_layoutSFB_TV(tiled_mma),
            (cute.size(perm[1]), cute.size(perm[2])))
        thr_a, thr_b = copy_a.get_slice(gtid), copy_b.get_slice(gtid)
        acc_shape = tiled_mma.partition_shape_C(self.tile_mnk[:2])
        return {
            "acc": cute.make_rmem_tensor(acc_shape, cutlass.Float32),
            "copy_a": copy_a, "copy_b": copy_b, "copy_sfa": copy_sfa, "copy_sfb": copy_sfb,
            "tCsA": thr_a.partition_S(sA), "tCrA_v": thr_a.retile(tCrA), "tCrA": tCrA,
            "tCsB": thr_b.partition_S(sB), "tCrB_v": thr_b.retile(tCrB), "tCrB": tCrB,
            "thr_sfa": copy_sfa.get_slice(gtid), "thr_sfb": copy_sfb.get_slice(gtid),
            "tCrSFA": tCrSFA, "tCrSFB": tCrSFB,
            "sfa_ptr": storage.sSFA.data_ptr(), "sfb_ptr": storage.sSFB.data_ptr(),
        }

    @staticmethod
    def _sf_fragment_vmk(frag):
        """Scale fragment as (value, rest rows, K blocks), like the A/B fragments.

        The DSL helpers return the rest modes flattened differently per warp layout:
        (V, M, (K...)) for some, (V, (N, K)) when N has a single rest mode.
        """
        if cutlass.const_expr(cute.rank(frag) > 2):
            return cute.group_modes(frag, 2, cute.rank(frag))
        shape, stride = frag.layout.shape, frag.layout.stride
        if cutlass.const_expr(isinstance(shape[1], int)):
            layout = cute.make_layout((shape[0], shape[1], 1), stride=(stride[0], stride[1], 0))
        else:
            layout = cute.make_layout((shape[0], shape[1][0], shape[1][1]),
                                      stride=(stride[0], stride[1][0], stride[1][1]))
        return cute.make_tensor(frag.iterator, layout)

    @staticmethod
    def _sub_atom(ptr, tile_idx, tile_rows):
        """Start of a sub-128-row tile's rows inside the stage's 128-row scale atom."""
        if cutlass.const_expr(tile_rows >= sf_layout.ATOM_ROWS):
            return ptr
        step = sf_layout.sf_view_offset(tile_rows, 1)
        off = (tile_idx % (sf_layout.ATOM_ROWS // tile_rows)) * step
        return ptr + cute.assume(off, divby=step)

    @cute.jit
    def _sf_sources(self, f, cm, cn):
        """(smem view, register view) pairs of the scale factors of this work unit."""
        tm, tn, _ = self.tile_mnk
        sfa = cute.make_tensor(self._sub_atom(f["sfa_ptr"], cm, tm), self.sSFA_view)
        sfb = cute.make_tensor(self._sub_atom(f["sfb_ptr"], cn, tn), self.sSFB_view)
        return (cute.filter_zeros(f["thr_sfa"].partition_S(sfa)),
                cute.filter_zeros(f["thr_sfa"].retile(f["tCrSFA"])),
                cute.filter_zeros(f["thr_sfb"].partition_S(sfb)),
                cute.filter_zeros(f["thr_sfb"].retile(f["tCrSFB"])))

    @cute.jit
    def _load_k_block(self, f, sf, s, kb):
        tCsSFA, tCrSFA_v, tCsSFB, tCrSFB_v = sf
        cute.copy(f["copy_a"], f["tCsA"][None, None, kb, s], f["tCrA_v"][None, None, kb])
        cute.copy(f["copy_b"], f["tCsB"][None, None, kb, s], f["tCrB_v"][None, None, kb])
        cute.copy(f["copy_sfa"], tCsSFA[None, None, kb, s], tCrSFA_v[None, None, kb])
        cute.copy(f["copy_sfb"], tCsSFB[None, None, kb, s], tCrSFB_v[None, None, kb])

    @cute.jit
    def mainloop(self, mainloop, state, f, k_count, cm, cn):
        """K tiles of one work unit: wait stage, ldmatrix + OMMA.SF per 64-wide K block."""
        sf = self._sf_sources(f, cm, cn)
        n_kb = cute.size(f["tCrA"], mode=[2])
        acc = f["acc"]
        for _ in cutlass.range(k_count, unroll=1):
            mainloop.consumer_wait(state)
            s = state.index
            self._load_k_block(f, sf, s, 0)
            for kb in cutlass.range_constexpr(n_kb):
                if cutlass.const_expr(kb + 1 < n_kb):
                    self._load_k_block(f, sf, s, kb + 1)
                else:
                    mainloop.consumer_release(state)
                cute.gemm(self.tiled_mma, acc,
                          [f["tCrA"][None, None, kb], f["tCrSFA"][None, None, kb]],
                          [f["tCrB"][None, None, kb], f["tCrSFB"][None, None, kb]], acc)
            state.advance()
        return state

    # ------------------------------------------------------------------ host-side args

    def fake_args(self):
        """Compile-time arguments: placeholder pointers, M, N, K, max CTAs; fake stream."""
        from cutlass.cute.runtime import make_fake_stream, make_ptr

        gmem = cute.AddressSpace.gmem
        u8 = cutlass.Uint8
        ptrs = [make_ptr(t, 0, gmem, assumed_align=16) for t in (u8, u8, u8, u8, self.c_dtype)]
        return (*ptrs, make_ptr(cutlass.Float32, 0, gmem, assumed_align=4),
                cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(0),
                cutlass.Int32(self.schedule.arch.sm_count), make_fake_stream())

    def runtime_args(self, a, a_scale, b, b_scale, out, alpha, workspace, stream):
        """``(pA, pSFA, pB, pSFB, pC, pAlpha, M, N, K, L, max_ctas, stream)`` from torch
        tensors (see contract): data pointers and sizes only, no DLPack."""
        from cutlass.cute.runtime import make_ptr

        gmem = cute.AddressSpace.gmem
        u8 = cutlass.Uint8
        m, n = out.shape
        c = workspace if self.split_k > 1 else out
        sms = _sm_count(out.device.index) if out.is_cuda else self.schedule.arch.sm_count
        return (make_ptr(u8, a.data_ptr(), gmem, assumed_align=16),
                make_ptr(u8, a_scale.data_ptr(), gmem, assumed_align=16),
                make_ptr(u8, b.data_ptr(), gmem, assumed_align=16),
                make_ptr(u8, b_scale.data_ptr(), gmem, assumed_align=16),
                make_ptr(self.c_dtype, c.data_ptr(), gmem, assumed_align=16),
                make_ptr(cutlass.Float32, alpha.data_ptr(), gmem, assumed_align=4),
                cutlass.Int32(m), cutlass.Int32(n), cutlass.Int32(b.shape[1] * 2),
                cutlass.Int32(self.split_k), cutlass.Int32(sms), stream)


@functools.cache
def _sm_count(device_index) -> int:
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


__all__ = ["Sm120Gemm"]
