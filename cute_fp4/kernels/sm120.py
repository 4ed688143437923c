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
  K-major (TN only); passed as uint8 [rows, K/2]. Their TMA moves bytes: built on the
  uint8 tensors with a byte-typed swizzled stage layout (``s*_tma_layout``, K/2 columns)
  whose image is the FP4 layout's (the same bytes at the same addresses,
  tests/test_sm120_tma_bytes.py), while ldmatrix and the MMA read the same storage through
  the FP4 layout (``s*_layout``). Hopper's TMA rejects 4-bit types, so this one load path
  also serves the emulated build; never ``internal_type=Uint8`` on an FP4 tensor (the DSL
  then picks an unpacking TMA format that doubles the bytes).
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
* Scale factors by TMA (byte boxes of whole 512-byte atoms, kernels/loads.py) or by
  cp.async (the producer warp's 32 lanes copy 16-byte chunks of the same bytes into the
  same layout and arrive, no-inc, on the stage's full barrier, whose count is then 1 + 32).
* Accumulation FP32; output BF16, FP16 or FP32 with alpha (1-element float32 device
  tensor) applied. ``split_k > 1``: each split stores its FP32 partial from registers into
  the split-K workspace, and the last split of a tile to arrive adds them in split order
  and stores the output (``epilogue.store_split_k``; no host reduction).
* Shared memory: exactly ``plan(schedule, problem).smem_bytes`` (regions barriers | A | B |
  SFA | SFB | C, each 1024-byte aligned); at most 101,376 B. Cluster 1x1x1 (SM120 has no
  multicast).
* Pingpong: two MMA groups alternate work units; their mainloops and their epilogues are
  each serialized by a pair of mbarriers (the groups share the one C buffer). The CTA is
  padded to whole warpgroups so setmaxnreg can hand the producer's registers to the MMA
  warps (168 -> 232 per thread with 2 x 4 MMA warps).
* Compiled signature: the one of every GEMM kernel (kernels/launch.py); ``_launch``
  builds the TMA atoms and launches. Work units come from kernels/scheduler.py, warp
  roles, named barriers and pingpong turns from kernels/roles.py, the epilogue from
  kernels/epilogue.py.
  M = 0 or N = 0 would launch an empty grid: the host layer must skip those.
* Grouped (``Scheduler.grouped``, :class:`Sm120GroupedGemm`, the grouped launch signature
  of kernels/launch.py): work units from ``GroupedScheduler`` (device offsets, at most 256
  groups); B ``(N, K/2, group)`` and its scales per group by TMA (a group mode); A's scale
  factors copied row by row with 4-byte cp.async (``loads.load_sf_rows_cp_async``: a group
  starts at any row of A's ordinary 128x4 layout) into local rows 0.. of the stage's atom;
  alpha per group; no C staging buffer: the tile is stored from registers, masked at the
  group's last row (the tile's later rows belong to the next group) and at N. Not with
  split-K or ``sf_load=cp_async`` (plan() refuses them).
* ``emulate=True`` (``compile.compile_emulated``): the same kernel for sm_90a with only
  :meth:`Sm120Gemm.mma_k_block` changed, each OMMA replaced by 4 exact BF16 ``mma.sync``
  on the same registers (kernels/mma_emulation.py), so it runs on an H200. Such a run checks
  the data path (TMA, barriers, ldmatrix, scale copies, scheduler, pingpong, split-K,
  epilogue, hangs); it does not check the OMMA itself (the CPU trace
  tests/sm120_mainloop_trace.py covers its operand model), the sm_120a binary's register
  allocation (sm_90a is compiled apart), nor the 99 KiB limit (the H200 has 227 KiB;
  ``plan()`` and the compile checks cover it).
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.tensor_utils as tensor_utils
import cutlass.utils
import cutlass.utils.blackwell_helpers as sm120_utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warp

from cute_fp4.kernels import loads, mma_emulation, roles, sf_layout
from cute_fp4.kernels.epilogue import smem_epilogue, store_direct, store_smem_tma, store_split_k
from cute_fp4.kernels.launch import (
    GemmLaunch,
    GemmTensors,
    GroupedLaunch,
    PointerTypes,
    out_dtype,
)
from cute_fp4.kernels.roles import WARP, Barrier
from cute_fp4.kernels.scheduler import GroupedScheduler, TileScheduler
from cute_fp4.plan import plan
from cute_fp4.schedule import Problem, Raster, Schedule, SFLoad, WarpRoles

SF_VEC = sf_layout.SF_VEC
ALIGN = 1024


class MmaFragments(NamedTuple):
    """What an MMA warp holds for the mainloop: register fragments, the smem -> register
    copies feeding them, and the accumulator. The stable seam the CPU traces read."""

    acc: object  # FP32 accumulator (V, MMA rows, MMA cols)
    copy_a: object  # ldmatrix tiled copies of A and B
    copy_b: object
    copy_sfa: object  # scale-factor tiled copies (universal byte copies)
    copy_sfb: object
    tCsA: object  # (V, rows, k block, stage) smem sources of this thread
    tCrA_v: object  # A fragment as the copy sees it
    tCrA: object  # A fragment as the MMA sees it (V, MMA rows, k block)
    tCsB: object
    tCrB_v: object
    tCrB: object
    thr_sfa: object  # this thread's slices of the scale copies
    thr_sfb: object
    tCrSFA: object  # scale fragments (V, MMA rows, k block)
    tCrSFB: object
    sfa_ptr: object  # start of the staged scales (UE4M3 view)
    sfb_ptr: object


class Sm120Gemm(GemmLaunch):
    """NVFP4 x NVFP4 -> BF16/FP16/FP32 GEMM for SM120, configured by a :class:`Schedule`."""

    def __init__(self, schedule: Schedule, problem: Problem | None = None,
                 emulate: bool = False):
        self.schedule = schedule
        # emulate: the MMA as 4 BF16 mma.sync per block-scaled one (kernels/mma_emulation.py),
        # to run this kernel on SM90; nothing else changes
        self.emulate = emulate
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
        # Pingpong with whole warpgroups of MMA warps gets a producer warpgroup, so that
        # setmaxnreg can move its registers to the MMA warps.
        mma_warps = self.group_warps * self.groups
        self.warps = roles.warp_layout(mma_warps, self.pingpong and mma_warps % 4 == 0, pl)
        self.producer_warp = self.warps.producer_warp
        self.threads = self.warps.threads
        self.sf_cp_async = schedule.sf_load is SFLoad.CP_ASYNC
        # grouped (MoE): GroupedScheduler units, B/SFB with a group mode, SFA row by row
        # (cp.async: a group starts at any row), alpha per group, masked register store
        self.grouped = schedule.scheduler.grouped
        self.split_k = schedule.split_k
        self.sched = schedule.scheduler
        self.along_m = schedule.scheduler.raster is Raster.ALONG_M
        self.c_dtype = cutlass.Float32 if self.split_k > 1 else out_dtype(schedule)
        self.out_dtype = out_dtype(schedule)
        self.split_slots = self.group_threads  # split-K counters per tile (one per thread)
        self.split_values = t.m * t.n // self.group_threads  # accumulator values per thread
        self.w4a16 = False
        self.ptr_types = PointerTypes(cutlass.Uint8, out_dtype(schedule))
        self.sm_count = schedule.arch.sm_count
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
        op_class = mma_emulation.LayoutMXF4NVF4Op if self.emulate else warp.MmaMXF4NVF4Op
        op = op_class(cutlass.Float4E2M1FN, cutlass.Float32, cutlass.Float8E4M3FN)
        perm = sm120_utils.get_permutation_mnk(self.tile_mnk, SF_VEC, False)
        self.tiled_mma = cute.make_tiled_mma(
            op, cute.make_layout((*self.warps_mn, 1)), permutation_mnk=perm)
        self.sA_layout = self._operand_layout(tm, tk, cutlass.Float4E2M1FN, self.stages)
        self.sB_layout = self._operand_layout(tn, tk, cutlass.Float4E2M1FN, self.stages)
        # what TMA writes: the same bytes at the same addresses, typed as bytes (K / 2 per
        # row), because Hopper's TMA refuses 4-bit element types (tests/test_sm120_tma_bytes)
        self.sA_tma_layout = self._operand_layout(tm, tk // 2, cutlass.Uint8, self.stages)
        self.sB_tma_layout = self._operand_layout(tn, tk // 2, cutlass.Uint8, self.stages)
        # scales: MMA-order views (UE4M3) and the byte stages the loads fill, same bytes
        self.sSFA_layout = sf_layout.sf_smem_layout(self.sf_rows[0], tk, self.stages)
        self.sSFB_layout = sf_layout.sf_smem_layout(self.sf_rows[1], tk, self.stages)
        self.sSFA_view = sf_layout.sf_smem_layout(tm, tk, self.stages)
        self.sSFB_view = sf_layout.sf_smem_layout(tn, tk, self.stages)
        k_blocks = tk // sf_layout.MMA_K
        self.sSFA_bytes = loads.sf_stage_layout(k_blocks, self.sf_rows[0] // 128, self.stages)
        self.sSFB_bytes = loads.sf_stage_layout(k_blocks, self.sf_rows[1] // 128, self.stages)
        self.sC_layout = self._operand_layout(*self.epi_tile, self.c_dtype, self.epi_stages)
        self.tx_bytes = (tm + tn) * tk // 2
        if not self.sf_cp_async:
            self.tx_bytes += self.sf_rows[1] * tk // SF_VEC
            if not self.grouped:
                self.tx_bytes += self.sf_rows[0] * tk // SF_VEC
        self.shared_storage = self._storage_struct()
        self.smem_bytes = self.shared_storage.size_in_bytes()
        if self.smem_bytes != self.plan_smem_bytes:
            raise AssertionError(f"kernel allocates {self.smem_bytes} B of shared memory, "
                                 f"plan() counted {self.plan_smem_bytes} B")

    @staticmethod
    def _operand_layout(rows, cols, dtype, stages):
        """Swizzled row-major (K- or N-major) staged shared-memory layout."""
        kind = sm90_utils.get_smem_layout_atom(tensor_utils.LayoutEnum.ROW_MAJOR, dtype, cols)
        atom = cute.nvgpu.warpgroup.make_smem_layout_atom(kind, dtype)
        return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))

    def _storage_struct(self):
        u8 = cutlass.Uint8

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, self.num_barriers]
            sA: cute.struct.Align[cute.struct.MemRange[
                cutlass.Float4E2M1FN, cute.cosize(self.sA_layout)], ALIGN]
            sB: cute.struct.Align[cute.struct.MemRange[
                cutlass.Float4E2M1FN, cute.cosize(self.sB_layout)], ALIGN]
            sSFA: cute.struct.Align[cute.struct.MemRange[
                u8, cute.cosize(self.sSFA_bytes)], ALIGN]
            sSFB: cute.struct.Align[cute.struct.MemRange[
                u8, cute.cosize(self.sSFB_bytes)], ALIGN]
            if not self.grouped:  # grouped tiles are stored from registers
                sC: cute.struct.Align[cute.struct.MemRange[
                    self.c_dtype, cute.cosize(self.sC_layout)], ALIGN]

        return SharedStorage

    # ------------------------------------------------------------------ host launcher

    @cute.jit
    def _launch(self, t: GemmTensors, max_ctas: cutlass.Int32, stream):
        self._setup()
        tm, tn, tk = self.tile_mnk
        mA = self._byte_view(t.mA)
        mB = self._byte_view(t.mB)
        m, half_k = mA.shape[0], mA.shape[1]
        n = mB.shape[0]
        k = half_k * 2

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_a, tma_mA = cpasync.make_tiled_tma_atom(
            g2s, mA, cute.slice_(self.sA_tma_layout, (None, None, 0)), (tm, tk // 2))
        tma_b, tma_mB = cpasync.make_tiled_tma_atom(
            g2s, mB, cute.slice_(self.sB_tma_layout, (None, None, 0)), (tn, tk // 2))
        mSFA = loads.sf_global_view(t.mSFA, m, half_k)
        mSFB = loads.sf_global_view(t.mSFB, n, half_k)
        tma_sfa, tma_mSFA = loads.sf_tma_atom(mSFA, self.sSFA_bytes)
        tma_sfb, tma_mSFB = loads.sf_tma_atom(mSFB, self.sSFB_bytes)
        if cutlass.const_expr(self.grouped or self.split_k > 1):
            tma_c, tma_mC = tma_a, t.mD  # no TMA store: masked from registers
        if cutlass.const_expr(self.grouped):
            tma_sfa, tma_mSFA = tma_sfb, tma_mSFB  # SFA goes row by row (cp.async)
            offsets = t.mOffsets
            units = GroupedScheduler.create(offsets.shape[0] - 1, m, n, k, self.tile_mnk)
        else:
            if cutlass.const_expr(self.split_k == 1):
                tma_c, tma_mC = cpasync.make_tiled_tma_atom(
                    cpasync.CopyBulkTensorTileS2GOp(), t.mD,
                    cute.slice_(self.sC_layout, (None, None, 0)), self.epi_tile)
            offsets = t.mAlpha
            units = TileScheduler.create(m, n, k, self.tile_mnk, self.split_k,
                                         self.sched.group_size, self.along_m)
        split_out = (t.mAlpha, t.mAlpha)  # grouped: unused
        if cutlass.const_expr(not self.grouped):
            split_out = (t.mWork, t.mCount)
        self.kernel(
            tma_a, tma_mA, tma_b, tma_mB, tma_sfa, tma_mSFA, tma_sfb, tma_mSFB, tma_c, tma_mC,
            t.mSFA, t.mSFB, t.mAlpha, units, (half_k + 31) // 32, offsets, m, *split_out,
        ).launch(grid=[units.grid(self.sched.persistent, max_ctas), 1, 1],
                 block=[self.threads, 1, 1], cluster=[1, 1, 1],
                 smem=self.smem_bytes, stream=stream,
                 max_number_threads=[self.threads, 1, 1], min_blocks_per_mp=1,
                 use_pdl=roles.PDL)

    @staticmethod
    def _byte_view(t: cute.Tensor) -> cute.Tensor:
        """uint8 [rows, K/2] -> uint8 [rows, K/2, 1]: what the A/B TMA loads, as bytes
        (a grouped weight is (rows, K/2, group) already).

        Never ``internal_type=Uint8`` on a Float4E2M1FN tensor instead: the DSL then picks
        a TMA unpacking format that doubles the bytes."""
        if cutlass.const_expr(cute.rank(t) == 3):
            return t
        rows, half_k = t.shape
        return cute.make_tensor(t.iterator, cute.make_layout(
            (rows, half_k, 1), stride=(t.stride[0], 1, 0)))

    # ------------------------------------------------------------------ kernel

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom,
               mB: cute.Tensor, tma_sfa: cute.CopyAtom, mSFA: cute.Tensor,
               tma_sfb: cute.CopyAtom, mSFB: cute.Tensor, tma_c: cute.CopyAtom,
               mC: cute.Tensor, sfa_bytes: cute.Tensor, sfb_bytes: cute.Tensor,
               alpha: cute.Tensor, units, k_blocks: cutlass.Int32,
               offsets: cute.Tensor, m_rows: cutlass.Int32, mWork: cute.Tensor,
               mCount: cute.Tensor):
        self._setup()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == self.producer_warp:
            for atom in (tma_a, tma_b, tma_sfa, tma_sfb, tma_c):
                cpasync.prefetch_descriptor(atom)
        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        bars = storage.barriers.data_ptr()
        mainloop = self._make_mainloop_pipeline(bars)
        roles.init_turns(self.pingpong, bars + 2 * self.stages, self.group_threads, warp_idx)
        cute.arch.sync_threads()
        roles.wait_for_inputs()  # nothing above touches global memory
        units = units.prepare(offsets)
        if warp_idx < self.warps.first_mma_warp:
            roles.producer_registers(self.warps)
            if warp_idx == self.producer_warp:
                self.load_tiles(storage, mainloop, units, tma_a, mA, tma_b, mB, tma_sfa,
                                mSFA, tma_sfb, mSFB, sfa_bytes, sfb_bytes, k_blocks, m_rows)
        else:
            roles.consumer_registers(self.warps)
            self.mma_and_store(storage, mainloop, units, bars + 2 * self.stages, tma_c, mC,
                               alpha, warp_idx, mWork, mCount)

    def _make_mainloop_pipeline(self, bars):
        # cp.async scale loads add one no-increment arrival per producer lane.
        producers = 1 + (WARP if self.sf_cp_async or self.grouped else 0)
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

    # ------------------------------------------------------------------ producer warp

    @staticmethod
    def _tma_smem(region, layout):
        """A/B stages as the TMA writes them: bytes in ``layout`` (``s*_tma_layout``) over
        the FP4 storage ``region`` that ldmatrix reads through ``s*_layout``."""
        return region.get_tensor(layout.outer, swizzle=layout.inner, dtype=cutlass.Uint8)

    @cute.jit
    def load_tiles(self, storage, mainloop, units, tma_a, mA, tma_b, mB, tma_sfa, mSFA,
                   tma_sfb, mSFB, sfa_bytes, sfb_bytes, k_blocks, m_rows):
        """Producer warp: for each work unit, its K tiles of A, B, SFA, SFB into the ring."""
        tm, tn, tk = self.tile_mnk
        tAsA, tAgA = loads.tma_views(tma_a, self._tma_smem(storage.sA, self.sA_tma_layout),
                                     mA, (tm, tk // 2))
        tBsB, tBgB = loads.tma_views(tma_b, self._tma_smem(storage.sB, self.sB_tma_layout),
                                     mB, (tn, tk // 2))
        sSFA = storage.sSFA.get_tensor(self.sSFA_bytes)
        sSFB = storage.sSFB.get_tensor(self.sSFB_bytes)
        sf_box = cute.shape(cute.slice_(self.sSFA_bytes, (None,) * 4 + (0,)))
        tAsSFA, tAgSFA = loads.tma_views(tma_sfa, sSFA, mSFA, sf_box)
        tBsSFB, tBgSFB = loads.tma_views(tma_sfb, sSFB, mSFB, sf_box)
        ratio_a = self.sf_rows[0] // tm
        ratio_b = self.sf_rows[1] // tn
        lane = cute.arch.lane_idx()
        def per_unit(w):
            if cutlass.const_expr(self.grouped):  # A's rows from the group's offset
                _, tAgA_u = loads.tma_views(
                    tma_a, self._tma_smem(storage.sA, self.sA_tma_layout),
                    cute.domain_offset((w.row0, 0, 0), mA), (tm, tk // 2))
                return tAgA_u, w.n, w.row0, w.n // ratio_b, w.l
            return w.m, w.n, w.m // ratio_a, w.n // ratio_b  # 128-row scale atoms too

        def issue(u, kt, s, bar):
            if cutlass.const_expr(self.grouped):
                tAgA_u, cn, row0, rb, g = u
                cute.copy(tma_a, tAgA_u[(None, 0, kt, 0)], tAsA[(None, s)], tma_bar_ptr=bar)
                cute.copy(tma_b, tBgB[(None, cn, kt, g)], tBsB[(None, s)], tma_bar_ptr=bar)
                cute.copy(tma_sfb, tBgSFB[(None, 0, 0, kt, rb, g)], tBsSFB[(None, s)],
                          tma_bar_ptr=bar)
                loads.load_sf_rows_cp_async(sfa_bytes, sSFA, s, row0, m_rows, kt, k_blocks,
                                            tm, tk, lane)
                cute.arch.cp_async_mbarrier_arrive_noinc(bar)
                return
            cm, cn, ra, rb = u
            cute.copy(tma_a, tAgA[(None, cm, kt, 0)], tAsA[(None, s)], tma_bar_ptr=bar)
            cute.copy(tma_b, tBgB[(None, cn, kt, 0)], tBsB[(None, s)], tma_bar_ptr=bar)
            if cutlass.const_expr(self.sf_cp_async):
                loads.load_sf_cp_async(sfa_bytes, sSFA, s, ra, kt, k_blocks, tk, lane)
                loads.load_sf_cp_async(sfb_bytes, sSFB, s, rb, kt, k_blocks, tk, lane)
                cute.arch.cp_async_mbarrier_arrive_noinc(bar)
            else:
                cute.copy(tma_sfa, tAgSFA[(None, 0, 0, kt, ra)], tAsSFA[(None, s)],
                          tma_bar_ptr=bar)
                cute.copy(tma_sfb, tBgSFB[(None, 0, 0, kt, rb)], tBsSFB[(None, s)],
                          tma_bar_ptr=bar)

        loads.producer_loop(mainloop, self.stages, units, per_unit, issue)

    # ------------------------------------------------------------------ MMA warps

    @cute.jit
    def mma_and_store(self, storage, mainloop, units, turn_bars, tma_c, mC, alpha, warp_idx,
                      mWork, mCount):
        """MMA warps: per work unit, the K mainloop into registers, then the epilogue."""
        tidx, _, _ = cute.arch.thread_idx()
        mma_warp = warp_idx - self.warps.first_mma_warp
        group = mma_warp // self.group_warps
        gtid = (tidx - self.warps.first_mma_thread) % self.group_threads
        frags = self._mma_fragments(storage, gtid)
        if cutlass.const_expr(not self.grouped):
            sC = storage.sC.get_tensor(self.sC_layout.outer, swizzle=self.sC_layout.inner)
            gC = cute.local_tile(mC, self.tile_mnk[:2], (None, None, None))
            epi = smem_epilogue(self._r2s_copy(), self.tiled_mma, gtid, sC, frags.acc,
                                self.c_dtype, self.tile_mnk[:2], self.epi_tile)
        bar = pipeline.NamedBarrier(barrier_id=int(Barrier.MMA_GROUP) + group,
                                    num_threads=self.group_threads)
        scale = cutlass.Float32(1.0)
        if cutlass.const_expr(not self.grouped):
            scale = alpha[0]
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        unit, nctas = units.first_unit()
        turn = cutlass.Int32(0)
        step = cutlass.Int32(0)
        while unit < units.total:
            w = units.coords(unit)
            if step % self.groups == group:
                roles.turn_wait(self.pingpong, turn_bars, group, turn, 0)
                frags.acc.fill(0.0)
                # grouped tiles keep their scale rows at the start of the stage's atom
                cm = 0 if cutlass.const_expr(self.grouped) else w.m
                state = self.mainloop(mainloop, state, frags, w.k_count, cm, w.n)
                roles.turn_arrive(self.pingpong, turn_bars, group, 0)
                roles.turn_wait(self.pingpong, turn_bars, group, turn, 2)
                if cutlass.const_expr(self.grouped):
                    self._store_grouped(frags.acc, alpha, mC, w, gtid)
                elif cutlass.const_expr(self.split_k > 1):
                    self._store_split(frags.acc, scale, mC, mWork, mCount, units, w, unit,
                                      gtid)
                else:
                    store_smem_tma(epi, tma_c, gC[(None, None, w.m, w.n, w.split)], sC,
                                   scale, self.epi_tile, self.epi_stages, bar,
                                   mma_warp % self.group_warps == 0, self.c_dtype)
                roles.turn_arrive(self.pingpong, turn_bars, group, 2)
                turn += 1
            else:
                state = roles.skip_stages(state, w.k_count)
            step += 1
            unit += nctas

    @cute.jit
    def _store_split(self, acc, scale, mD, mWork, mCount, units, w, unit, gtid):
        """A split-K partial from registers; the tile's last split stores the sum."""
        tm, tn, _ = self.tile_mnk
        assert cute.size(acc) == self.split_values, (cute.size(acc), self.split_values)
        gD = cute.local_tile(mD, (tm, tn), (None, None, None))
        store_split_k(self.tiled_mma.get_slice(gtid), acc, scale, mWork, mCount,
                      units.total // self.split_k, unit // self.split_k, gtid,
                      self.split_slots, w.split, self.split_k, gD[(None, None, w.m, w.n, 0)],
                      (tm, tn), mD.shape[0] - w.m * tm, mD.shape[1] - w.n * tn,
                      self.out_dtype)

    @cute.jit
    def _store_grouped(self, acc, alpha, mD, w, gtid):
        """A grouped tile from registers: rows ``w.row0 ..`` of D, masked at the group's
        last row (the rows after it belong to the next group) and at N."""
        tm, tn, _ = self.tile_mnk
        gD = cute.local_tile(cute.domain_offset((w.row0, 0, 0), mD), (tm, tn),
                             (None, None, None))
        store_direct(self.tiled_mma.get_slice(gtid), acc, alpha[w.l],
                     gD[(None, None, 0, w.n, 0)], (tm, tn), w.rows, mD.shape[1] - w.n * tn,
                     self.c_dtype)

    def _r2s_copy(self):
        """Register -> shared copy of the accumulator, matching the tiled MMA's C layout.

        The tiler always comes from the 16-bit stmatrix atom: tiled from a one-value
        universal atom (FP32 output, split-K partials) the copy's (V, M, N) modes no longer
        line up with the accumulator's, and the epilogue would store the wrong elements.
        """
        tiler_atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 2), cutlass.BFloat16)
        if cutlass.const_expr(self.c_dtype.width == 16):
            atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 2), self.c_dtype)
        else:
            atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.c_dtype)
        return cute.make_tiled_copy_S(atom,
                                      cute.make_tiled_copy_C_atom(tiler_atom, self.tiled_mma))

    def _k_slots(self) -> int:
        """K blocks of register fragments: the tile's K blocks, or two register buffers
        when a cooperative tile has a single one (tile K 64), so that the next stage's
        fragments load while the current ones feed the MMAs."""
        n_kb = self.tile_mnk[2] // sf_layout.MMA_K
        return 2 if n_kb == 1 and not self.pingpong else n_kb

    def _copy_b(self, tiled_mma):
        """ldmatrix copy of B. An ``.x4`` loads two MMAs' B (16 columns x 64 K): with 2
        warps along N a warp's columns of one MMA permutation step (32 columns, SM120's
        (8, 2, 2):(1, 16, 8)) are 16 contiguous rows, the MMA's own tiling. With 4 warps
        they are 8 rows: tiled like the MMA, an ``.x4`` loaded the same 8 rows twice (half
        its registers never read), so its two halves take two consecutive steps instead
        (``.x2`` where the tile has a single step)."""
        def atom(matrices):
            return cute.make_copy_atom(
                warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=matrices),
                cutlass.Float4E2M1FN)

        perm_n = cute.size(tiled_mma.permutation_mnk[1])
        if perm_n // self.warps_mn[1] >= 16:
            return cute.make_tiled_copy_B(atom(4), tiled_mma)
        if self.tile_mnk[1] % (2 * perm_n):
            return cute.make_tiled_copy_B(atom(2), tiled_mma)
        # the MMA's (thread, value) -> n + perm_n * k, re-indexed into a tile of two steps
        # (n + 2 perm_n * k), with the step as the last value mode
        two_steps = cute.make_layout((perm_n, sf_layout.MMA_K), stride=(1, 2 * perm_n))
        tv = cute.composition(two_steps, tiled_mma.tv_layout_B_tiled)
        tv = cute.make_layout((tv.shape[0], (tv.shape[1], 2)),
                              stride=(tv.stride[0], (tv.stride[1], perm_n)))
        return cute.make_tiled_copy(atom(4), tv, (2 * perm_n, sf_layout.MMA_K))

    @cute.jit
    def _mma_fragments(self, storage, gtid) -> MmaFragments:
        """Register fragments and smem->register copies of A, B, SFA, SFB; the accumulator.

        The fragments' K mode has :meth:`_k_slots` K blocks (register buffers)."""
        tiled_mma = self.tiled_mma
        thr_mma = tiled_mma.get_slice(gtid)
        tm, tn, _ = self.tile_mnk
        k_regs = self._k_slots() * sf_layout.MMA_K
        sA = storage.sA.get_tensor(self.sA_layout.outer, swizzle=self.sA_layout.inner)
        sB = storage.sB.get_tensor(self.sB_layout.outer, swizzle=self.sB_layout.inner)
        # register fragments of K = k_regs, K-major like the stages (only the layouts of
        # these views are used: nothing is read through them)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(cute.make_tensor(
            sA.iterator, cute.make_layout((tm, k_regs), stride=(k_regs, 1)))))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(cute.make_tensor(
            sB.iterator, cute.make_layout((tn, k_regs), stride=(k_regs, 1)))))
        sfa_ptr = cute.recast_ptr(storage.sSFA.data_ptr(), dtype=cutlass.Float8E4M3FN)
        sfb_ptr = cute.recast_ptr(storage.sSFB.data_ptr(), dtype=cutlass.Float8E4M3FN)
        sfa0 = cute.make_tensor(sfa_ptr, sf_layout.sf_smem_layout(tm, k_regs, 1))
        sfb0 = cute.make_tensor(sfb_ptr, sf_layout.sf_smem_layout(tn, k_regs, 1))
        tCrSFA = sm120_utils.partition_fragment_SFA(sfa0[None, None, 0], thr_mma, gtid)
        tCrSFB = sm120_utils.partition_fragment_SFB(sfb0[None, None, 0], thr_mma, gtid)
        ldsm_a = warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4)
        copy_a = cute.make_tiled_copy_A(
            cute.make_copy_atom(ldsm_a, cutlass.Float4E2M1FN), tiled_mma)
        copy_b = self._copy_b(tiled_mma)
        perm = tiled_mma.permutation_mnk
        sf_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Float8E4M3FN)
        copy_sfa = cute.make_tiled_copy(
            sf_atom, sm120_utils.get_layoutSFA_TV(tiled_mma),
            (cute.size(perm[0]), cute.size(perm[2])))
        copy_sfb = cute.make_tiled_copy(
            sf_atom, sm120_utils.get_layoutSFB_TV(tiled_mma),
            (cute.size(perm[1]), cute.size(perm[2])))
        thr_a, thr_b = copy_a.get_slice(gtid), copy_b.get_slice(gtid)
        acc_shape = tiled_mma.partition_shape_C(self.tile_mnk[:2])
        return MmaFragments(
            acc=cute.make_rmem_tensor(acc_shape, cutlass.Float32),
            copy_a=copy_a, copy_b=copy_b, copy_sfa=copy_sfa, copy_sfb=copy_sfb,
            tCsA=thr_a.partition_S(sA), tCrA_v=thr_a.retile(tCrA), tCrA=tCrA,
            tCsB=thr_b.partition_S(sB), tCrB_v=thr_b.retile(tCrB), tCrB=tCrB,
            thr_sfa=copy_sfa.get_slice(gtid), thr_sfb=copy_sfb.get_slice(gtid),
            tCrSFA=self._sf_fragment_vmk(tCrSFA), tCrSFB=self._sf_fragment_vmk(tCrSFB),
            sfa_ptr=sfa_ptr, sfb_ptr=sfb_ptr)

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
    def _sf_sources(self, f: MmaFragments, cm, cn):
        """(smem view, register view) pairs of the scale factors of this work unit."""
        tm, tn, _ = self.tile_mnk
        sfa = cute.make_tensor(self._sub_atom(f.sfa_ptr, cm, tm), self.sSFA_view)
        sfb = cute.make_tensor(self._sub_atom(f.sfb_ptr, cn, tn), self.sSFB_view)
        return (cute.filter_zeros(f.thr_sfa.partition_S(sfa)),
                cute.filter_zeros(f.thr_sfa.retile(f.tCrSFA)),
                cute.filter_zeros(f.thr_sfb.partition_S(sfb)),
                cute.filter_zeros(f.thr_sfb.retile(f.tCrSFB)))

    @staticmethod
    def _kb_sources(f: MmaFragments, sf, n_kb):
        """Per K block of a stage: the A, B, SFA, SFB shared-memory sources (V, rows, stage).

        Sliced at the (static) K block first, so that the stage is the only dynamic offset
        left: it is a multiple of the swizzle period, which the DSL then adds after the
        swizzle, to a per-thread address computed once (sliced stage first, the K block's
        offset joins the stage's and the swizzle is redone per load: 97 against 82
        instructions per 128x128x128 K tile, sm_120a, 2026-12-01)."""
        tCsSFA, _, tCsSFB, _ = sf
        return [(f.tCsA[None, None, kb, None], f.tCsB[None, None, kb, None],
                 tCsSFA[None, None, kb, None], tCsSFB[None, None, kb, None])
                for kb in range(n_kb)]

    @cute.jit
    def _load_k_block(self, f: MmaFragments, sf, srcs, s, kb, slot):
        """K block ``kb`` of stage ``s`` into register K block ``slot``."""
        _, tCrSFA_v, _, tCrSFB_v = sf
        src = srcs[kb]
        cute.copy(f.copy_a, src[0][None, None, s], f.tCrA_v[None, None, slot])
        cute.copy(f.copy_b, src[1][None, None, s], f.tCrB_v[None, None, slot])
        cute.copy(f.copy_sfa, src[2][None, None, s], tCrSFA_v[None, None, slot])
        cute.copy(f.copy_sfb, src[3][None, None, s], tCrSFB_v[None, None, slot])

    def mma_k_block(self, f: MmaFragments, slot):
        """The MMAs of one 64-wide K block (register K block ``slot``): OMMA.SF, or its
        exact emulation (SM90 runs).

        Plain Python, run while tracing (``emulate`` is a static choice), so the CPU trace
        records the ``cute.gemm`` of the shipping build through its stand-ins."""
        if self.emulate:
            mma_emulation.mma_k_block(f.tCrA[None, None, slot], f.tCrSFA[None, None, slot],
                                      f.tCrB[None, None, slot], f.tCrSFB[None, None, slot],
                                      f.acc)
        else:
            cute.gemm(self.tiled_mma, f.acc,
                      [f.tCrA[None, None, slot], f.tCrSFA[None, None, slot]],
                      [f.tCrB[None, None, slot], f.tCrSFB[None, None, slot]], f.acc)

    def _tile(self, mainloop, state, f, sf, srcs, more):
        """One K tile of a cooperative mainloop with two or more K blocks, whose first K
        block is in registers: each K block's MMAs run while the next K block loads; at the
        last, the stage is released and, when ``more`` tiles follow, the next stage waited
        for and its first K block loaded before the last MMAs (which use registers loaded
        before that wait). Plain Python (static control flow); returns the state."""
        n_kb = len(srcs)
        for kb in range(n_kb):
            if kb + 1 < n_kb:
                self._load_k_block(f, sf, srcs, state.index, kb + 1, kb + 1)
            else:
                mainloop.consumer_release(state)
                state.advance()
                if more:
                    mainloop.consumer_wait(state)
                    self._load_k_block(f, sf, srcs, state.index, 0, 0)
            self.mma_k_block(f, kb)
        return state

    def _tile_buffered(self, mainloop, state, f, sf, srcs, slot, more):
        """One K tile of a single K block, held in register buffer ``slot``: the stage is
        released, the next one (``more``) waited for and loaded into the other buffer, then
        this tile's MMAs run. Plain Python; returns the state."""
        mainloop.consumer_release(state)
        state.advance()
        if more:
            mainloop.consumer_wait(state)
            self._load_k_block(f, sf, srcs, state.index, 0, 1 - slot)
        self.mma_k_block(f, slot)
        return state

    @cute.jit
    def mainloop(self, mainloop, state, f: MmaFragments, k_count, cm, cn):
        """K tiles of one work unit: ldmatrix + OMMA.SF per 64-wide K block, software
        pipelined across stages.

        K block ``kb + 1`` is loaded while the MMAs of ``kb`` run. Cooperative tiles
        release the current stage after loading its last K block, then wait for the next
        stage and load its first K block before the current stage's last K block's MMAs,
        whose fragments are in registers already, so those MMAs hide the next stage's
        latency (release before wait: with a single stage that is the same buffer). The
        last K tile is peeled off the loop, which is then free of conditions. Tiles of one
        K block (tile K 64) alternate two register buffers, the loop unrolled by two so
        that the buffers stay static. Pingpong keeps the stage-at-a-time order: the other
        group's MMAs hide its waits, and in the order above the first K block's fragments
        stay live across the loop's back edge with its 128 accumulators, which spills at
        its 168 registers (54 words, sm_120a, 2026-12-01).
        """
        sf = self._sf_sources(f, cm, cn)
        n_kb = self.tile_mnk[2] // sf_layout.MMA_K
        srcs = self._kb_sources(f, sf, n_kb)
        if cutlass.const_expr(self.pingpong):
            for _ in cutlass.range(k_count, unroll=1):
                mainloop.consumer_wait(state)
                s = state.index
                self._load_k_block(f, sf, srcs, s, 0, 0)
                for kb in cutlass.range_constexpr(n_kb):
                    if cutlass.const_expr(kb + 1 < n_kb):
                        self._load_k_block(f, sf, srcs, s, kb + 1, kb + 1)
                    else:
                        mainloop.consumer_release(state)
                    self.mma_k_block(f, kb)
                state.advance()
        elif cutlass.const_expr(n_kb == 1):
            if k_count > 0:
                mainloop.consumer_wait(state)
                self._load_k_block(f, sf, srcs, state.index, 0, 0)
            for _ in cutlass.range((k_count - 1) // 2, unroll=1):
                state = self._tile_buffered(mainloop, state, f, sf, srcs, 0, True)
                state = self._tile_buffered(mainloop, state, f, sf, srcs, 1, True)
            if k_count > 0:
                if k_count % 2 == 0:
                    state = self._tile_buffered(mainloop, state, f, sf, srcs, 0, True)
                    state = self._tile_buffered(mainloop, state, f, sf, srcs, 1, False)
                else:
                    state = self._tile_buffered(mainloop, state, f, sf, srcs, 0, False)
        else:
            # Where the loop sits is ptxas' register allocation, measured (sm_120a, DSL
            # 4.8.1, 2026-12-01): inside the ``k_count > 0`` block, 4 MOVs copy an
            # accumulator at the block's end; outside, with 4 K blocks, ptxas keeps the stage
            # index in a uniform register and moves it back per address (14 MOVs). Inside
            # for 4 K blocks (128x128x256: 145 against 155 instructions per K tile),
            # outside for 2 (128x128x128: 82 against 87).
            inside = n_kb > 2
            if k_count > 0:
                mainloop.consumer_wait(state)
                self._load_k_block(f, sf, srcs, state.index, 0, 0)
                if cutlass.const_expr(inside):
                    for _ in cutlass.range(k_count - 1, unroll=1):
                        state = self._tile(mainloop, state, f, sf, srcs, True)
                    state = self._tile(mainloop, state, f, sf, srcs, False)
            if cutlass.const_expr(not inside):
                for _ in cutlass.range(k_count - 1, unroll=1):
                    state = self._tile(mainloop, state, f, sf, srcs, True)
                if k_count > 0:
                    state = self._tile(mainloop, state, f, sf, srcs, False)
        return state


class Sm120GroupedGemm(GroupedLaunch, Sm120Gemm):
    """Grouped (MoE) NVFP4 GEMM for SM120: :class:`Sm120Gemm` with a
    :class:`~cute_fp4.kernels.scheduler.GroupedScheduler` (``Scheduler.grouped``), launched
    through the grouped signature (kernels/launch.py ``GroupedLaunch``)."""

    b_row_align = 1  # plain [N, K/2] weights per group


__all__ = ["MmaFragments", "Sm120Gemm", "Sm120GroupedGemm"]
