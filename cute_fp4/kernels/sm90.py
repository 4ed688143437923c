"""Hopper (sm_90a) NVFP4 GEMM: TMA loads packed FP4, consumers dequantise, BF16/FP16 WGMMA.

``D[M, N] = alpha * A[M, K] @ B[N, K]^T`` with B NVFP4 and A either NVFP4 (W4A4) or 16-bit
(W4A16). SM90 has no FP4 tensor cores, but every E2M1 x UE4M3 product is exact in 16 bits,
so the kernel converts in the mainloop and runs 16-bit WGMMA with FP32 accumulation.

One kernel class, two mainloops (a static choice of the schedule):

* shared-memory sourced (default): per K tile the consumer warpgroups (``Warps.mma`` =
  warpgroups along M and N, cooperative on one tile) convert the packed stage into one of
  two 16-bit buffers (the conversion of tile k overlaps the WGMMA of tile k-1), release the
  stage, wait for the WGMMA of tile k-1, synchronise on a named barrier and issue the WGMMA
  of tile k;
* register sourced (``swap_ab``, decode, kernels/sm90_rs.py): the weight is WGMMA's A
  operand, converted straight into registers, and D^T is stored;
* register sourced on a fragment-order packed weight (``mainloop=rs_packed``, every M,
  kernels/sm90_rs_wide.py): the packed weight is WGMMA's A operand decoded in registers,
  the activations TMA'd straight into WGMMA's B layout, D^T stored.

Shared components: work units (kernels/scheduler.py; persistent CTAs walk them in grouped
raster order), warp roles (kernels/roles.py: the producer warpgroup first, its first warp
issuing TMA for A, B and the scale factors of each K tile into a ``stages``-deep mbarrier
pipeline; setmaxnreg moves its registers to the consumer warpgroups after it), loads
(kernels/loads.py), the epilogue (kernels/epilogue.py: 16-bit outputs staged through shared
memory and stored with TMA, 32-bit results (FP32 output, split-K partials) and the
swap-AB's D^T stored from registers with bounds checks) and the launch signature
(kernels/launch.py). The epilogue scales by alpha and the conversion's power-of-two offset.
With ``split_k > 1`` each unit writes its FP32 partial to the workspace and the last split
of a tile to arrive sums them in split order and stores D (``epilogue.store_split_k``).

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
* Grouped (``Scheduler.grouped``, :class:`Sm90GroupedGemm`): the ``rs_packed`` mainloop
  only; units from ``GroupedScheduler``; the activation rows of a unit TMA'd from the
  group's row offset (a domain offset of the TMA coordinates; rows past the group are
  loaded and computed, then masked), the packed weight and its scales per group (a group
  mode); W4A4's activation scales copied row by row by the producer warp (cp.async, its
  lanes arriving no-inc on the stage barrier); alpha per group; D^T stored masked at the
  group's last row. No split-K.
"""

import functools
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.tensor_utils as tensor_utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup

from cute_fp4.formats import SF_ATOM_ROWS, sf_atom_offset
from cute_fp4.kernels import loads, roles, sf_layout
from cute_fp4.kernels.epilogue import (
    NvOut,
    NvTile,
    SmemEpilogue,
    d_tile,
    fused_tile,
    smem_epilogue,
    store_direct,
    store_smem_tma,
    store_split_k,
)
from cute_fp4.kernels.launch import (
    GemmLaunch,
    GemmTensors,
    GroupedLaunch,
    PointerTypes,
    out_dtype,
)
from cute_fp4.kernels.roles import WARPGROUP, Barrier
from cute_fp4.kernels.scheduler import GroupedScheduler, TileScheduler, WorkTile, for_each_unit
from cute_fp4.kernels.sm90_convert import convert_word, scale_word
from cute_fp4.kernels.sm90_rs import RegisterSourcedMainloop
from cute_fp4.kernels.sm90_rs_wide import (
    PackedRegisterMainloop,
    group_k_blocks,
    weight_global_view,
    weight_stage_layout,
)
from cute_fp4.plan import plan
from cute_fp4.schedule import Mainloop, Problem, Raster, Schedule

_ALIGN = 1024


class Sm90Params(NamedTuple):
    """Kernel arguments: TMA atoms with the tensors they partition, and the work."""

    tma_a: cute.CopyAtom
    gA: cute.Tensor
    tma_b: cute.CopyAtom
    gB: cute.Tensor
    tma_sfa: cute.CopyAtom | None  # None: W4A16, grouped (then by cp.async, row by row)
    gSFA: cute.Tensor | None  # grouped W4A4: A's flat scale bytes; W4A16: None
    tma_sfb: cute.CopyAtom
    gSFB: cute.Tensor
    tma_c: cute.CopyAtom | None  # the D store atom; None where D is stored from registers
    gD: cute.Tensor  # (M, N, L), or (N, M, L) = D^T for swap-AB
    mAlpha: cute.Tensor
    units: TileScheduler  # or a GroupedScheduler (grouped schedules)
    m: cutlass.Int32
    n: cutlass.Int32
    mOffsets: cute.Tensor | None  # grouped: int32 [groups + 1] row offsets; dense: None
    mWork: cute.Tensor | None  # split-K: the workspace (launch.global_tensors), flat FP32
    mCount: cute.Tensor | None  # split-K: the header and counters, flat int32
    mBias: cute.Tensor | None  # fused "bias": (N,) or (N, groups) FP32; None without it
    nv: NvOut | None = None  # fused "nvfp4_out" (normal orientation, no split-K: plan())


class SmemTensors(NamedTuple):
    """The shared-memory stages and buffers of one CTA (None where a mainloop has none)."""

    sA: cute.Tensor  # packed A stages (W4A4) or 16-bit A stages (W4A16)
    sA16: cute.Tensor  # converted A (W4A4), A itself (W4A16), or swap-AB's activation buffers
    sB: cute.Tensor  # packed B stages
    sB16: cute.Tensor | None  # converted B (shared-memory sourced mainloop)
    sSFA: cute.Tensor | None  # W4A16: None
    sSFB: cute.Tensor
    sC: cute.Tensor | None  # staged epilogue tiles, None when D is stored from registers
    red_ptr: cute.Pointer | None  # swap-AB: FP32 view of the activation buffers


class SsConsumer(NamedTuple):
    """What the shared-memory sourced mainloop's units share (:meth:`Sm90Gemm.consume_ss`)."""

    mainloop: pipeline.PipelineTmaAsync
    smem: SmemTensors
    ctid: cutlass.Int32  # this thread among the consumers
    mma_warp: cutlass.Int32  # this warp among the consumers
    tCrA: cute.Tensor  # WGMMA fragments (smem descriptors) of the 16-bit A and B buffers
    tCrB: cute.Tensor
    gD_t: cute.Tensor  # D cut into output tiles
    acc: cute.Tensor
    sync: pipeline.NamedBarrier  # every consumer thread
    epi: SmemEpilogue | None  # the staged epilogue (None: stored from registers)
    scale: cutlass.Float32


def _stage0(layout):
    """Stage 0 of a staged shared-memory layout (the stage is the last mode)."""
    return cute.slice_(layout, (None,) * (cute.rank(layout) - 1) + (0,))


class Sm90Gemm(PackedRegisterMainloop, RegisterSourcedMainloop, GemmLaunch):
    """NVFP4 x NVFP4 (W4A4) or 16-bit x NVFP4 (W4A16) GEMM for sm_90a."""

    def __init__(self, schedule: Schedule, problem: Problem):
        pl = plan(schedule, problem).raise_if_invalid()
        t = schedule.tile
        self.schedule, self.problem = schedule, problem
        self.fmt = problem.fmt  # the block format: block size, scale type, layout
        self.tile_m, self.tile_n, self.tile_k = t.m, t.n, t.k
        self.stages = pl.stages
        self.epi_tile = tuple(pl.epi_tile)
        self.epi_stages = pl.epi_stages
        self.swap_ab = schedule.swap_ab
        self.rs_packed = schedule.mainloop is Mainloop.RS_PACKED
        self.transposed = self.swap_ab or self.rs_packed  # D^T tiles, weight = WGMMA's A
        self.w4a16 = problem.w4a16
        self.mma_dtype = cutlass.BFloat16 if problem.a_format == "bf16" else cutlass.Float16
        self.split_k = schedule.split_k
        self.out_dtype = out_dtype(schedule)
        self.epi_dtype = cutlass.Float32 if self.split_k > 1 else self.out_dtype
        # 32-bit results (split-K partials, FP32 output), D^T and fused epilogue operations
        # are stored from registers.
        self.direct_store = (self.epi_dtype.width == 32 or self.transposed
                             or bool(schedule.epilogue.ops))
        self.n_mode = 0 if self.transposed else 1  # the mode of an output tile that is N
        self.wm, self.wn = schedule.warps.mma
        self.num_wg = self.wn if self.swap_ab else self.wm * self.wn
        self.rs_m_blocks = t.n // self.wm // 64  # rs_packed: 64-row M blocks per warpgroup
        self.rs_group = group_k_blocks(t.k, self.rs_m_blocks)  # rs_packed: K blocks per commit
        self.num_mma_threads = self.num_wg * WARPGROUP
        # split-K arrival counters per output tile: one per consumer thread and accumulator
        # (swap-AB: warpgroup 0 stores the CTA's sum) and accumulator values per thread
        self.split_slots = (WARPGROUP if self.swap_ab else self.num_mma_threads
                            * (self.rs_m_blocks if self.rs_packed else 1))
        self.split_values = (t.m // 2 if self.rs_packed else t.m * t.n // WARPGROUP
                             if self.swap_ab else t.m * t.n // self.num_mma_threads)
        self.warps = roles.warp_layout(self.num_wg * 4, True, pl)
        self.threads = self.warps.threads
        sch = schedule.scheduler
        self.persistent = sch.persistent
        # grouped (MoE, rs_packed): units from GroupedScheduler, B/SFB with a group mode,
        # alpha per group, D^T stored through a per-unit row offset
        self.grouped = sch.grouped
        self.raster_m = sch.raster is Raster.ALONG_M
        self.group_size = sch.group_size
        self.sm_count = schedule.arch.sm_count
        # The shared-memory conversion leaves 2^-7 per converted operand in the accumulator;
        # rs_packed's weight decode leaves none (its W4A4 activation conversion does).
        converted = (0 if self.w4a16 else 1) + (0 if self.rs_packed else 1)
        self.acc_scale = float(2 ** (7 * converted))
        self.sf_cols_blocks = t.k // self.fmt.atom_k  # 512-byte scale atoms per K tile
        self.sfa_row_blocks = max(1, t.m // SF_ATOM_ROWS)
        self.sfb_row_blocks = max(1, t.n // SF_ATOM_ROWS)
        self.plan_smem_bytes = pl.smem_bytes
        self.smem_bytes = None  # set while tracing
        self.ptr_types = PointerTypes(self.mma_dtype if self.w4a16 else cutlass.Uint8,
                                      self.out_dtype)

    # ------------------------------------------------------------------ setup (traced)
    def _setup(self):
        """MMA, shared-memory layouts and the storage struct (host launcher and kernel)."""
        tm, tn, tk = self.tile_m, self.tile_n, self.tile_k
        row = tensor_utils.LayoutEnum.ROW_MAJOR
        mnk = (tm, tn, tk)

        def packed(rows, cols):  # packed bytes (or 16-bit A), row-major, per stage
            return cute.make_layout((rows, cols, self.stages), stride=(cols, 1, rows * cols))

        a_cols = tk if self.w4a16 else tk // 2
        self.sB_layout = packed(tn, tk // 2)
        self.sB16_layout = None
        self.sC_layout = None
        if cutlass.const_expr(self.rs_packed):
            self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
                self.mma_dtype, self.mma_dtype, OperandMajorMode.K, OperandMajorMode.K,
                cutlass.Float32, (1, 1, 1), tiler_mn=(64, tm),
                a_source=warpgroup.OperandSource.RMEM)
            self.sB_layout = weight_stage_layout(tn, tk, self.stages)
            if cutlass.const_expr(self.w4a16):
                # the activation is TMA'd straight into WGMMA's B layout (natural K order)
                self.sA_layout = sm90_utils.make_smem_layout_b(row, (64, tm, tk),
                                                               self.mma_dtype, self.stages)
                self.sA16_layout = self.sA_layout
            else:
                self.sA_layout = packed(tm, a_cols)
                self.sA16_layout = sm90_utils.make_smem_layout_b(row, (64, tm, tk),
                                                                 self.mma_dtype, 1)
        elif cutlass.const_expr(self.swap_ab):
            self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
                self.mma_dtype, self.mma_dtype, OperandMajorMode.K, OperandMajorMode.K,
                cutlass.Float32, (1, 1, 1), tiler_mn=(64, tm),
                a_source=warpgroup.OperandSource.RMEM)
            self.sA_layout = packed(tm, a_cols)
            # the activation is WGMMA's B operand: (tile.m, K), two buffers per warpgroup
            self.sA16_layout = sm90_utils.make_smem_layout_b(row, (tn, tm, tk), self.mma_dtype,
                                                             2 * self.num_wg)
        else:
            self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
                self.mma_dtype, self.mma_dtype, OperandMajorMode.K, OperandMajorMode.K,
                cutlass.Float32, (self.wm, self.wn, 1), tiler_mn=(64, tn // self.wn))
            if cutlass.const_expr(self.w4a16):
                # A is TMA-loaded as 16-bit straight into WGMMA's swizzled layout.
                self.sA_layout = sm90_utils.make_smem_layout_a(row, mnk, self.mma_dtype,
                                                               self.stages)
                self.sA16_layout = self.sA_layout
            else:
                self.sA_layout = packed(tm, a_cols)
                self.sA16_layout = sm90_utils.make_smem_layout_a(row, mnk, self.mma_dtype, 2)
            self.sB16_layout = sm90_utils.make_smem_layout_b(row, mnk, self.mma_dtype, 2)
            if cutlass.const_expr(not self.direct_store):
                self.sC_layout = sm90_utils.make_smem_layout_epi(
                    self.epi_dtype, row, self.epi_tile, self.epi_stages)
        kcb = self.sf_cols_blocks
        self.sSFA_layout = loads.sf_stage_layout(kcb, self.sfa_row_blocks, self.stages)
        self.sSFB_layout = loads.sf_stage_layout(kcb, self.sfb_row_blocks, self.stages)
        self.shared_storage = self._shared_storage()
        self.smem_bytes = self.shared_storage.size_in_bytes()
        if self.smem_bytes != self.plan_smem_bytes:
            raise AssertionError(f"kernel allocates {self.smem_bytes} B of shared memory, "
                                 f"plan() counted {self.plan_smem_bytes} B")

    def _a_type(self):
        return self.mma_dtype if self.w4a16 else cutlass.Uint8

    def _shared_storage(self):
        a_type = self._a_type()
        w4a4 = not self.w4a16
        own_a16 = w4a4 or self.swap_ab  # W4A16's SS mainloop reads A where TMA put it
        has_b16 = not self.transposed
        staged_c = not self.direct_store
        nbar = 2 * self.stages

        def region(dtype, layout):
            return cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(layout)], _ALIGN]

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, nbar]
            sA: region(a_type, self.sA_layout)
            sB: region(cutlass.Uint8, self.sB_layout)
            if w4a4:
                sSFA: region(cutlass.Uint8, self.sSFA_layout)
            sSFB: region(cutlass.Uint8, self.sSFB_layout)
            if own_a16:
                sA16: region(self.mma_dtype, self.sA16_layout)
            if has_b16:
                sB16: region(self.mma_dtype, self.sB16_layout)
            if staged_c:
                sC: region(self.epi_dtype, self.sC_layout)

        return SharedStorage

    # ------------------------------------------------------------------ host launcher
    @cute.jit
    def _launch(self, t: GemmTensors, max_ctas: cutlass.Int32, stream):
        self._setup()
        tm, tn, tk = self.tile_m, self.tile_n, self.tile_k
        m, n = t.mD.shape[0], t.mB.shape[0]  # N: the weight's rows ("silu_mul": D has N / 2)
        nd = t.mD.shape[1]
        k = t.mB.shape[1] * 2
        tma_a, gA, tma_b, gB, tma_sfa, gSFA, tma_sfb, gSFB = self._make_load_atoms(t, m, n)
        # absent operands are None (the kernel branches on them with const_expr)
        gD = t.mD
        tma_c = None  # D stored from registers
        offsets = None  # dense: no group offsets
        if cutlass.const_expr(self.grouped):
            offsets = t.mOffsets
            gD = cute.make_tensor(t.mD.iterator, cute.make_layout(
                (nd, m, 1), stride=(1, t.mD.stride[0], 0)))
            units = GroupedScheduler.create(t.mOffsets.shape[0] - 1, m, n, k, (tm, tn, tk))
        elif cutlass.const_expr(self.transposed):
            gD = cute.make_tensor(t.mD.iterator, cute.make_layout(
                (nd, m, 1), stride=(1, t.mD.stride[0], t.mD.stride[2])))
            if cutlass.const_expr(self.rs_packed):
                units = TileScheduler.create(n, m, k, (tn, tm, tk), self.split_k,
                                             self.group_size, self.raster_m)
            else:
                units = TileScheduler.create(n, m, k, (tn, tm, tk), self.split_k)
        else:
            units = TileScheduler.create(m, n, k, (tm, tn, tk), self.split_k,
                                         self.group_size, self.raster_m)
            if cutlass.const_expr(not self.direct_store):
                tma_c, gD = cpasync.make_tiled_tma_atom(
                    cpasync.CopyBulkTensorTileS2GOp(), t.mD,
                    cute.slice_(self.sC_layout, (None, None, 0)), self.epi_tile)
        work = (t.mWork, t.mCount) if self.split_k > 1 else (None, None)
        bias = t.mBias if "bias" in self.ops else None
        params = Sm90Params(tma_a, gA, tma_b, gB, tma_sfa, gSFA, tma_sfb, gSFB, tma_c, gD,
                            t.mAlpha, units, m, n, offsets, *work, bias, t.nv)
        self.kernel(params).launch(grid=[units.grid(self.persistent, max_ctas), 1, 1],
                                   block=[self.threads, 1, 1], smem=self.smem_bytes,
                                   stream=stream, use_pdl=roles.PDL)

    def _make_load_atoms(self, t: GemmTensors, m, n):
        """TMA load atoms (and the tensors they partition) of A, B and both scale tensors."""
        tm, tn, tk = self.tile_m, self.tile_n, self.tile_k
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        a_tile_k = tk if self.w4a16 else tk // 2
        tma_a, gA = cpasync.make_tiled_tma_atom(
            g2s, t.mA, cute.slice_(self.sA_layout, (None, None, 0)), (tm, a_tile_k))
        if cutlass.const_expr(self.rs_packed):  # whole 2,048-byte packed units
            tma_b, gB = loads.sf_tma_atom(weight_global_view(t.mB, n, t.mB.shape[1] * 2),
                                          self.sB_layout)
            if cutlass.const_expr(self.grouped):
                tma_sfb, gSFB = loads.sf_tma_atom(
                    loads.sf_global_view(t.mSFB, n, t.mB.shape[1], self.fmt),
                    self.sSFB_layout)
                return tma_a, gA, tma_b, gB, None, t.mSFA, tma_sfb, gSFB
        else:
            tma_b, gB = cpasync.make_tiled_tma_atom(
                g2s, t.mB, cute.slice_(self.sB_layout, (None, None, 0)), (tn, tk // 2))
        half_k = t.mB.shape[1]
        tma_sfb, gSFB = loads.sf_tma_atom(loads.sf_global_view(t.mSFB, n, half_k, self.fmt),
                                          self.sSFB_layout)
        tma_sfa, gSFA = None, None  # W4A16: no activation scales
        if cutlass.const_expr(not self.w4a16):
            tma_sfa, gSFA = loads.sf_tma_atom(
                loads.sf_global_view(t.mSFA, m, half_k, self.fmt), self.sSFA_layout)
        return tma_a, gA, tma_b, gB, tma_sfa, gSFA, tma_sfb, gSFB

    # ------------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(self, p: Sm90Params):
        self._setup()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        storage, mainloop = self._prologue(warp_idx, p)
        roles.wait_for_inputs()  # the prologue above touches no global memory
        p = p._replace(units=p.units.prepare(p.mOffsets))
        s = self._smem_tensors(storage)
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))
        first = self.warps.first_mma_warp
        if warp_idx < first:
            roles.producer_registers(self.warps)
            if warp_idx == self.warps.producer_warp:
                self.load(mainloop, p, s)
        else:
            roles.consumer_registers(self.warps)
            ctid = tidx - self.warps.first_mma_thread
            if cutlass.const_expr(self.rs_packed):
                self.consume_rs_packed(mainloop, p, s, ctid)
            elif cutlass.const_expr(self.swap_ab):
                self.consume_rs(mainloop, p, s, ctid)
            else:
                self.consume_ss(mainloop, p, s, ctid, warp_idx - first)

    @cute.jit
    def _prologue(self, warp_idx, p: Sm90Params):
        """Prefetch the TMA descriptors, allocate the shared storage, create the TMA ->
        consumers mainloop pipeline (one transaction of A, B and the scale atoms per stage)
        and arrive on its init barrier."""
        if warp_idx == self.warps.producer_warp:
            atoms = [p.tma_a, p.tma_b, p.tma_sfb]
            if cutlass.const_expr(not self.w4a16 and not self.grouped):
                atoms.append(p.tma_sfa)
            if cutlass.const_expr(not self.direct_store):
                atoms.append(p.tma_c)
            for atom in atoms:
                cpasync.prefetch_descriptor(atom)
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sf_stage = (None,) * 4 + (0,)
        tx_bytes = (
            cute.size_in_bytes(self._a_type(), cute.slice_(self.sA_layout, (None, None, 0)))
            + cute.size_in_bytes(cutlass.Uint8, _stage0(self.sB_layout))
            + cute.size_in_bytes(cutlass.Uint8, cute.slice_(self.sSFB_layout, sf_stage)))
        if cutlass.const_expr(not self.w4a16 and not self.grouped):
            tx_bytes += cute.size_in_bytes(cutlass.Uint8,
                                           cute.slice_(self.sSFA_layout, sf_stage))
        # grouped W4A4: the producer warp's lanes also arrive (no-inc) after their cp.async
        # copies of A's scales; swap-AB: one consumer warpgroup takes each stage (K tiles
        # round-robin), else every consumer warp reads every stage
        groups = self.num_wg if self.swap_ab else 1
        mainloop = roles.mainloop_pipeline(
            self.warps, self.stages, tx_bytes, storage.mbar.data_ptr(),
            consumer_warps=4 if self.swap_ab else self.num_wg * 4, consumer_groups=groups,
            producer_cp_async=self.grouped and not self.w4a16)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        return storage, mainloop

    def _smem_tensors(self, storage) -> SmemTensors:
        def swizzled(region, layout):
            return region.get_tensor(layout.outer, swizzle=layout.inner)

        sSFA = storage.sSFA.get_tensor(self.sSFA_layout) if not self.w4a16 else None
        if self.w4a16 and not self.swap_ab:  # TMA puts A straight into WGMMA's layout
            sA = swizzled(storage.sA, self.sA_layout)
            sA16 = sA
        else:
            sA = storage.sA.get_tensor(self.sA_layout)
            sA16 = swizzled(storage.sA16, self.sA16_layout)
        sB = storage.sB.get_tensor(self.sB_layout)
        sSFB = storage.sSFB.get_tensor(self.sSFB_layout)
        if self.rs_packed:
            return SmemTensors(sA, sA16, sB, None, sSFA, sSFB, None, None)
        if self.swap_ab:
            red = cute.recast_ptr(storage.sA16.data_ptr(), dtype=cutlass.Float32)
            return SmemTensors(sA, sA16, sB, None, sSFA, sSFB, None, red)
        sC = None if self.direct_store else swizzled(storage.sC, self.sC_layout)
        return SmemTensors(sA, sA16, sB, swizzled(storage.sB16, self.sB16_layout), sSFA, sSFB,
                           sC, None)

    def _scale(self, p: Sm90Params):
        """What the epilogue multiplies the accumulator (split-K: the sum of the partials)
        by: the conversion offset times alpha (grouped: alpha[group], per unit)."""
        scale = cutlass.Float32(self.acc_scale)
        if cutlass.const_expr(not self.grouped):
            scale = scale * p.mAlpha[0]
        return scale

    @cute.jit
    def _store(self, thr_mma, acc, scale, p: Sm90Params, tile_shape: cutlass.Constexpr, ti, tj,
               w, unit, slot, rows, cols):
        """Output tile ``(ti, tj)`` of ``p.gD`` cut into ``tile_shape`` tiles, from this
        thread's accumulator, masked to ``rows x cols``; split-K: this thread's partial and
        counter ``slot`` of the unit's tile, the last split storing the sum."""
        gD_t = cute.local_tile(p.gD, d_tile(tile_shape, self.n_mode, self.ops),
                               (None, None, None))
        n_tile = (ti, tj)[self.n_mode]
        nv = None
        if cutlass.const_expr(p.nv is not None):  # plan(): n_mode 1, no split-K
            nv = NvTile(p.nv, ti * tile_shape[0], slot, thr_mma.size)
        fused = fused_tile(self.schedule, self.n_mode, p.mBias, n_tile * tile_shape[self.n_mode],
                           nv)
        if cutlass.const_expr(self.split_k > 1):
            assert cute.size(acc) == self.split_values, (cute.size(acc), self.split_values)
            store_split_k(thr_mma, acc, scale, p.mWork, p.mCount, p.units.total // self.split_k,
                          unit // self.split_k, slot, self.split_slots, w.split, self.split_k,
                          gD_t[(None, None, ti, tj, 0)], tile_shape, rows, cols,
                          self.out_dtype, fused)
        else:
            store_direct(thr_mma, acc, scale, gD_t[(None, None, ti, tj, 0)], tile_shape,
                         rows, cols, self.epi_dtype, fused)

    # ------------------------------------------------------------------ producer warp
    @cute.jit
    def load(self, mainloop, p: Sm90Params, s: SmemTensors):
        """Producer warp: for each work unit, its K tiles of A, B and the scales."""
        tm, tn, tk = self.tile_m, self.tile_n, self.tile_k
        a_cols = tk if self.w4a16 else tk // 2
        tAsA, tAgA = loads.tma_views(p.tma_a, s.sA, p.gA, (tm, a_cols))
        b_box = cute.shape(_stage0(self.sB_layout))  # rs_packed: whole packed units
        if cutlass.const_expr(not self.rs_packed):
            b_box = (tn, tk // 2)
        tBsB, tBgB = loads.tma_views(p.tma_b, s.sB, p.gB, b_box)
        box_b = cute.shape(cute.slice_(self.sSFB_layout, (None,) * 4 + (0,)))
        tSFBs, tSFBg = loads.tma_views(p.tma_sfb, s.sSFB, p.gSFB, box_b)
        if cutlass.const_expr(not self.w4a16 and not self.grouped):
            box_a = cute.shape(cute.slice_(self.sSFA_layout, (None,) * 4 + (0,)))
            tSFAs, tSFAg = loads.tma_views(p.tma_sfa, s.sSFA, p.gSFA, box_a)
        def per_unit(w):
            mt, nt = w.m, w.n
            if cutlass.const_expr(self.grouped):  # A's rows from the group's offset
                _, tAgA_u = loads.tma_views(p.tma_a, s.sA, cute.domain_offset((w.row0, 0), p.gA),
                                            (tm, a_cols))
                return (tAgA_u, nt, (nt * tn) // SF_ATOM_ROWS // self.sfb_row_blocks, w.l,
                        w.row0)
            if cutlass.const_expr(self.transposed):  # the scheduler's M tiles are B's rows
                mt, nt = w.n, w.m
            return (mt, nt, (mt * tm) // SF_ATOM_ROWS // self.sfa_row_blocks,
                    (nt * tn) // SF_ATOM_ROWS // self.sfb_row_blocks)

        def issue(u, kk, st, bar):
            if cutlass.const_expr(self.grouped):
                self._issue_grouped(p, s, u, kk, st, bar, tAsA, tBsB, tBgB, tSFBs, tSFBg)
                return
            mt, nt, rb_a, rb_b = u
            cute.copy(p.tma_a, tAgA[(None, mt, kk)], tAsA[(None, st)], tma_bar_ptr=bar)
            if cutlass.const_expr(self.rs_packed):
                cute.copy(p.tma_b, tBgB[(None, 0, 0, kk, nt)], tBsB[(None, st)],
                          tma_bar_ptr=bar)
            else:
                cute.copy(p.tma_b, tBgB[(None, nt, kk)], tBsB[(None, st)], tma_bar_ptr=bar)
            cute.copy(p.tma_sfb, tSFBg[(None, 0, 0, kk, rb_b)], tSFBs[(None, st)],
                      tma_bar_ptr=bar)
            if cutlass.const_expr(not self.w4a16):
                cute.copy(p.tma_sfa, tSFAg[(None, 0, 0, kk, rb_a)], tSFAs[(None, st)],
                          tma_bar_ptr=bar)

        loads.producer_loop(mainloop, self.stages, p.units, per_unit, issue)

    def _issue_grouped(self, p: Sm90Params, s: SmemTensors, u, kk, st, bar, tAsA, tBsB, tBgB,
                       tSFBs, tSFBg):
        """One stage of a grouped unit: its activation rows, its group's weight and scales;
        W4A4 also the activation rows' scales, row by row (a group starts at any row)."""
        tAgA_u, nt, rb_b, g, row0 = u
        cute.copy(p.tma_a, tAgA_u[(None, 0, kk)], tAsA[(None, st)], tma_bar_ptr=bar)
        cute.copy(p.tma_b, tBgB[(None, 0, 0, kk, nt, g)], tBsB[(None, st)], tma_bar_ptr=bar)
        cute.copy(p.tma_sfb, tSFBg[(None, 0, 0, kk, rb_b, g)], tSFBs[(None, st)],
                  tma_bar_ptr=bar)
        if cutlass.const_expr(not self.w4a16):
            k_blocks = self.fmt.atom_cols(p.gA.shape[1])  # scale atoms along K (A: K/2 B)
            loads.load_sf_rows_cp_async(p.gSFA, s.sSFA, st, row0, p.m, kk, k_blocks,
                                        self.tile_m, self.tile_k, cute.arch.lane_idx(),
                                        self.fmt)
            cute.arch.cp_async_mbarrier_arrive_noinc(bar)

    # ------------------------------------------------------------------ consumer warpgroups
    @cute.jit
    def consume_ss(self, mainloop, p: Sm90Params, s: SmemTensors, ctid, mma_warp):
        """Shared-memory sourced mainloop and epilogue, per work unit (``ctid``, ``mma_warp``:
        this thread's and warp's index among the consumers)."""
        tm, tn = self.tile_m, self.tile_n
        tiled_mma = self.tiled_mma
        wg = ctid // WARPGROUP
        thr_mma = tiled_mma.get_slice(wg * WARPGROUP)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(s.sA16))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(s.sB16))
        gD_t = cute.local_tile(p.gD, (tm, tn), (None, None, None))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(gD_t[(None, None, 0, 0, 0)]).shape,
                                    cutlass.Float32)
        sync = pipeline.NamedBarrier(barrier_id=int(Barrier.ALL_MMA),
                                     num_threads=self.num_mma_threads)
        if cutlass.const_expr(not self.direct_store):
            epi = smem_epilogue(self._r2s_copy(), tiled_mma, ctid, s.sC, acc, self.epi_dtype,
                                (tm, tn), self.epi_tile)
        else:
            epi = None
        c = SsConsumer(mainloop, s, ctid, mma_warp, tCrA, tCrB, gD_t, acc, sync, epi,
                       self._scale(p))
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for_each_unit(p.units, functools.partial(self._ss_unit, p, c), (release, read))

    @cute.jit
    def _ss_unit(self, p: Sm90Params, c: SsConsumer, w: WorkTile, unit, carry):
        """One work unit of the shared-memory sourced mainloop and its epilogue; ``carry``:
        the (release, read) pipeline states (in this order: the loop's carried values in
        the order of the hand-written loop before it, whose SASS ptxas made)."""
        release, read = carry
        tm, tn = self.tile_m, self.tile_n
        tiled_mma = self.tiled_mma
        s, acc, mainloop, ctid = c.smem, c.acc, c.mainloop, c.ctid
        num_k_blocks = cute.size(c.tCrA, mode=[2])
        rows_a = p.m - w.m * tm
        rows_b = p.n - w.n * tn
        sf_row_a = (w.m * tm) % SF_ATOM_ROWS if tm < SF_ATOM_ROWS else 0
        sf_row_b = (w.n * tn) % SF_ATOM_ROWS if tn < SF_ATOM_ROWS else 0
        acc.fill(0.0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        for kt in cutlass.range(w.k_count, unroll=1):
            buf = kt % 2
            mainloop.consumer_wait(read)
            if cutlass.const_expr(not self.w4a16):
                self.convert(s.sA, s.sSFA, s.sA16, read.index, buf, rows_a, sf_row_a, tm,
                             ctid, True)
            self.convert(s.sB, s.sSFB, s.sB16, read.index, buf, rows_b, sf_row_b, tn,
                         ctid, False)
            if cutlass.const_expr(not self.w4a16):
                mainloop.consumer_release(read)
            cute.arch.fence_proxy("async.shared", space="cta")
            warpgroup.wait_group(0)
            if cutlass.const_expr(self.w4a16):
                if kt > 0:
                    mainloop.consumer_release(release)
                    release.advance()
            c.sync.arrive_and_wait()
            a_idx = read.index if self.w4a16 else buf
            warpgroup.fence()
            for kb in cutlass.range_constexpr(num_k_blocks):
                cute.gemm(tiled_mma, acc, c.tCrA[(None, None, kb, a_idx)],
                          c.tCrB[(None, None, kb, buf)], acc)
            warpgroup.commit_group()
            read.advance()
        release = self._finish_unit(mainloop, release, w.k_count)
        if cutlass.const_expr(self.direct_store):
            self._store(tiled_mma.get_slice(ctid), acc, c.scale, p, (tm, tn), w.m, w.n, w,
                        unit, ctid, rows_a, rows_b)
        else:
            store_smem_tma(c.epi, p.tma_c, c.gD_t[(None, None, w.m, w.n, 0)], s.sC,
                           c.scale, self.epi_tile,
                           self.epi_stages, c.sync, c.mma_warp == 0, self.epi_dtype)
        return release, read

    @cute.jit
    def _finish_unit(self, mainloop, release, k_count):
        """After a unit's last K tile: wait for its WGMMAs; W4A16, whose WGMMAs read A from
        the stage itself, releases the unit's last stage then."""
        warpgroup.wait_group(0)
        if cutlass.const_expr(self.w4a16):
            if k_count > 0:
                mainloop.consumer_release(release)
                release.advance()
        return release

    def _r2s_copy(self):
        """Register -> shared copy of the accumulator in the WGMMA's C layout."""
        row = tensor_utils.LayoutEnum.ROW_MAJOR
        atom_r2s = sm90_utils.sm90_get_smem_store_op(row, elem_ty_d=self.epi_dtype,
                                                     elem_ty_acc=cutlass.Float32)
        atom_c = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4),
                                     self.epi_dtype)
        return cute.make_tiled_copy_S(atom_r2s,
                                      cute.make_tiled_copy_C_atom(atom_c, self.tiled_mma))

    @cute.jit
    def convert(self, sQ, sSF, sH, stage, buf, rows_valid, sf_row, rows, ctid,
                skip_rows: cutlass.Constexpr):
        """Packed FP4 stage + its scale factors -> 16-bit buffer ``buf`` (rows x tile_k).

        Thread ``t`` owns chunk ``t % kc`` (one scale block) of rows ``t // kc + i *
        per_pass``. All
        shared-memory loads are issued first so that their latencies overlap; rows past the
        matrix are zero-filled by TMA (harmless), and with ``skip_rows`` whole passes past
        ``rows_valid`` are not converted (their accumulator rows are never stored).
        ``sf_row`` is the tile's first row inside its 128-row scale atom.
        """
        tk = self.tile_k
        words = self.fmt.block // 8  # 32-bit words of packed codes per chunk
        kc = tk // self.fmt.block  # chunks (one scale block each) per row
        per_pass = self.num_mma_threads // kc
        n_pass = rows // per_pass
        r0 = ctid // kc
        c = ctid % kc
        q_stage = cute.recast_tensor(sQ[(None, None, stage)], cutlass.Uint32)
        sf = sSF[(None, None, None, None, stage)].iterator
        if cutlass.const_expr(rows < SF_ATOM_ROWS):  # the tile's rows inside its atom
            sf = sf + sf_atom_offset(sf_row, 0)
        sf = cute.make_tensor(sf, sf_layout.stage_rows_layout(rows, self.sf_cols_blocks))
        h_buf = sH[(None, None, buf)]
        rQ = cute.make_rmem_tensor((words, n_pass), cutlass.Uint32)
        rS = cute.make_rmem_tensor((n_pass,), cutlass.Uint8)
        for i in cutlass.range_constexpr(n_pass):
            r = r0 + i * per_pass
            for w in cutlass.range_constexpr(words):
                rQ[w, i] = q_stage[(r, words * c + w)]
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
        block = self.fmt.block
        scale = scale_word(rS[i])
        rH = cute.make_rmem_tensor((1, block), self.mma_dtype)
        rH32 = cute.recast_tensor(rH, cutlass.Uint32)
        for w in cutlass.range_constexpr(block // 8):
            o = convert_word(rQ[w, i], scale, bf16)
            for j in cutlass.range_constexpr(4):
                rH32[4 * w + j] = o[j]
        cute.autovec_copy(rH, cute.local_tile(h_buf, (1, block), (r, c)))


class Sm90GroupedGemm(GroupedLaunch, Sm90Gemm):
    """Grouped (MoE) W4A16 GEMM for sm_90a: the ``rs_packed`` kernel of :class:`Sm90Gemm`
    with a :class:`~cute_fp4.kernels.scheduler.GroupedScheduler` (``Scheduler.grouped``),
    launched through the grouped signature (kernels/launch.py ``GroupedLaunch``)."""

    b_row_align = 64  # each group's packed weight has packed_rows(N) rows


__all__ = ["Sm90Gemm", "Sm90GroupedGemm", "Sm90Params"]
