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
* Scale factors: the problem's block format (``Problem.fmt``, :mod:`cute_fp4.formats`:
  NVFP4's UE4M3, one per 16 K elements), in the cuBLAS 128x4 blocked layout, padded to
  rows -> multiple of 128 and K / block -> multiple of 4, padding zero-filled (or at least
  not NaN: padded scales multiply zero-filled data). Passed flat as uint8. The MMA is the
  format's (``fmt.mma_kind``, :func:`mma_op`). ``scale_vec::2X`` formats (MXFP4) need
  tile K a multiple of 128: a row's scales of two MMA K blocks are one 32-bit word that
  both MMAs take, issued by inline PTX with byte-id 0 / 2
  (``Sm120Mainloop._paired_scales``); ``scale_vec::4X`` ones go through ``cute.gemm``.
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
  each serialized by a pair of mbarriers (``roles.Turn``, in their own region after the
  stages' mbarriers; the groups share the one C buffer). The CTA is
  padded to whole warpgroups so setmaxnreg can hand the producer's registers to the MMA
  warps (168 -> 232 per thread with 2 x 4 MMA warps).
* Compiled signature: the one of every GEMM kernel (kernels/launch.py); ``_launch``
  builds the TMA atoms and launches the kernel with one :class:`Sm120Params` (an absent
  operand is None: no SFA atom for grouped, no scale atoms with ``sf_load=cp_async``, no
  D store atom where D is stored from registers, no workspace without split-K). Work
  units come from kernels/scheduler.py (``for_each_unit``), warp roles, named barriers,
  the pipeline's arrive counts and the pingpong turns from kernels/roles.py, the mainloop
  from kernels/sm120_mainloop.py, the epilogue from kernels/epilogue.py.
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

import functools
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.tensor_utils as tensor_utils
import cutlass.utils
import cutlass.utils.blackwell_helpers as sm120_utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warp

from cute_fp4.formats import BlockFormat
from cute_fp4.kernels import loads, mma_emulation, roles, sf_layout
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
from cute_fp4.kernels.roles import WARP, Barrier, Turn
from cute_fp4.kernels.scheduler import GroupedScheduler, TileScheduler, WorkTile, for_each_unit
from cute_fp4.kernels.sm120_mainloop import MmaFragments, Sm120Mainloop
from cute_fp4.plan import plan
from cute_fp4.schedule import Problem, Raster, Schedule, SFLoad, WarpRoles

ALIGN = 1024

# the SM120 block-scaled MMA of each BlockFormat.mma_kind: (the atom, its emulated build's)
MMA_OPS = {"mxf4nvf4": (warp.MmaMXF4NVF4Op, mma_emulation.LayoutMXF4NVF4Op),
           "mxf4": (warp.MmaMXF4Op, mma_emulation.LayoutMXF4Op)}


def mma_op(fmt: BlockFormat, emulate: bool = False):
    """The warp-level block-scaled MMA atom of ``fmt`` (its emulated build's with
    ``emulate``: the same layouts, admitted on sm_90a, never issued)."""
    op_class = MMA_OPS[fmt.mma_kind][int(emulate)]
    return op_class(getattr(cutlass, fmt.element.dsl_name), cutlass.Float32,
                    getattr(cutlass, fmt.scale.dsl_name))



class Sm120Params(NamedTuple):
    """Kernel arguments: TMA atoms with the tensors they partition, and the work."""

    tma_a: cute.CopyAtom
    mA: cute.Tensor  # A's TMA tensor (uint8 bytes, K/2 per row)
    tma_b: cute.CopyAtom
    mB: cute.Tensor
    tma_sfa: cute.CopyAtom | None  # grouped: None (A's scales by cp.async, row by row)
    mSFA: cute.Tensor | None
    tma_sfb: cute.CopyAtom
    mSFB: cute.Tensor
    tma_c: cute.CopyAtom | None  # the D store atom; None where D is stored from registers
    mC: cute.Tensor  # D's TMA tensor, or D itself where stored from registers
    sfa_bytes: cute.Tensor  # A's and B's flat blocked scale bytes (cp.async loads)
    sfb_bytes: cute.Tensor
    mAlpha: cute.Tensor  # (1,) float32, grouped: (groups,)
    units: TileScheduler | GroupedScheduler
    k_blocks: cutlass.Int32  # atom column groups (fmt.atom_k elements of K) of the scales
    mOffsets: cute.Tensor | None  # grouped: int32 [groups + 1] row offsets; dense: None
    m_rows: cutlass.Int32  # rows of A
    mWork: cute.Tensor | None  # split-K: the workspace (launch.global_tensors); else None
    mCount: cute.Tensor | None
    mBias: cute.Tensor | None  # fused "bias": (N,) or (N, groups) FP32; None without it
    nv: NvOut | None = None  # fused "nvfp4_out": codes, blocked scales, global scale


class Sm120Consumer(NamedTuple):
    """What an MMA group's units share (:meth:`Sm120Gemm.mma_and_store`)."""

    mainloop: pipeline.PipelineTmaAsync
    frags: MmaFragments
    turn_bars: cute.Pointer  # the pingpong turn mbarriers (roles.Turn)
    group: cutlass.Int32  # this MMA group
    gtid: cutlass.Int32  # this thread in its group
    mma_warp: cutlass.Int32  # this warp among the MMA warps
    bar: pipeline.NamedBarrier  # the group's named barrier
    scale: cutlass.Float32  # alpha (dense); grouped: alpha per group, read per unit
    epi: SmemEpilogue | None  # the staged epilogue (None: stored from registers)
    sC: cute.Tensor | None
    gC: cute.Tensor | None
    tma_c: cute.CopyAtom | None  # None where D is stored from registers
    mC: cute.Tensor
    alpha: cute.Tensor
    mWork: cute.Tensor | None  # split-K only
    mCount: cute.Tensor | None
    units: TileScheduler | GroupedScheduler
    mBias: cute.Tensor | None  # fused "bias" only
    nv: NvOut | None = None  # fused "nvfp4_out" only


class Sm120Gemm(Sm120Mainloop, GemmLaunch):
    """NVFP4 x NVFP4 -> BF16/FP16/FP32 GEMM for SM120, configured by a :class:`Schedule`."""

    def __init__(self, schedule: Schedule, problem: Problem | None = None,
                 emulate: bool = False):
        self.schedule = schedule
        # emulate: the MMA as 4 BF16 mma.sync per block-scaled one (kernels/mma_emulation.py),
        # to run this kernel on SM90; nothing else changes
        self.emulate = emulate
        self.problem = problem or Problem()
        self.fmt = self.problem.fmt  # the block format: scale type, block size, MMA kind
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
        # D staged through shared memory and stored by TMA; from registers when grouped,
        # split-K (the C buffer is still allocated: plan() counts it) or with fused ops
        self.staged_c = not self.grouped and not schedule.epilogue.ops
        self.out_dtype = out_dtype(schedule)
        self.split_slots = self.group_threads  # split-K counters per tile (one per thread)
        self.split_values = t.m * t.n // self.group_threads  # accumulator values per thread
        self.w4a16 = False
        self.ptr_types = PointerTypes(cutlass.Uint8, out_dtype(schedule))
        self.sm_count = schedule.arch.sm_count
        self.sf_rows = (sf_layout.sf_smem_rows(t.m), sf_layout.sf_smem_rows(t.n))
        self.smem_bytes = None  # set while tracing
        # mbarriers: a full/empty pair per stage, then the pingpong turns (plan() counts two
        # per MMA group for every schedule; pingpong's two groups use all four)
        self.turn_barriers = 2 * self.groups
        assert not self.pingpong or self.turn_barriers == roles.TURN_BARRIERS

    # ------------------------------------------------------------------ setup (trace time)

    def _setup(self):
        """MMA atom, permutation, shared-memory layouts and the storage struct.

        Called in the host launcher and again at the top of the kernel: CuTe layout values
        belong to the function being traced, so the kernel builds its own copies.
        """
        tm, tn, tk = self.tile_mnk
        fmt = self.fmt
        op = mma_op(fmt, self.emulate)
        perm = sm120_utils.get_permutation_mnk(self.tile_mnk, fmt.block, False)
        self.tiled_mma = cute.make_tiled_mma(
            op, cute.make_layout((*self.warps_mn, 1)), permutation_mnk=perm)
        self.sA_layout = self._operand_layout(tm, tk, cutlass.Float4E2M1FN, self.stages)
        self.sB_layout = self._operand_layout(tn, tk, cutlass.Float4E2M1FN, self.stages)
        # what TMA writes: the same bytes at the same addresses, typed as bytes (K / 2 per
        # row), because Hopper's TMA refuses 4-bit element types (tests/test_sm120_tma_bytes)
        self.sA_tma_layout = self._operand_layout(tm, tk // 2, cutlass.Uint8, self.stages)
        self.sB_tma_layout = self._operand_layout(tn, tk // 2, cutlass.Uint8, self.stages)
        # scales: MMA-order views (the scale type) and the byte stages the loads fill
        self.sSFA_layout = sf_layout.sf_smem_layout(self.sf_rows[0], tk, self.stages, fmt)
        self.sSFB_layout = sf_layout.sf_smem_layout(self.sf_rows[1], tk, self.stages, fmt)
        self.sSFA_view = sf_layout.sf_smem_layout(tm, tk, self.stages, fmt)
        self.sSFB_view = sf_layout.sf_smem_layout(tn, tk, self.stages, fmt)
        k_atoms = tk // fmt.atom_k  # 512-byte scale atoms along K per stage and row atom
        self.sSFA_bytes = loads.sf_stage_layout(k_atoms, self.sf_rows[0] // 128, self.stages)
        self.sSFB_bytes = loads.sf_stage_layout(k_atoms, self.sf_rows[1] // 128, self.stages)
        self.sC_layout = self._operand_layout(*self.epi_tile, self.c_dtype, self.epi_stages)
        self.tx_bytes = (tm + tn) * tk // 2
        if not self.sf_cp_async:
            self.tx_bytes += self.sf_rows[1] * tk // fmt.block
            if not self.grouped:
                self.tx_bytes += self.sf_rows[0] * tk // fmt.block
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
            mainloop_bars: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            turn_bars: cute.struct.MemRange[cutlass.Int64, self.turn_barriers]
            sA: cute.struct.Align[cute.struct.MemRange[
                cutlass.Float4E2M1FN, cute.cosize(self.sA_layout)], ALIGN]
            sB: cute.struct.Align[cute.struct.MemRange[
                cutlass.Float4E2M1FN, cute.cosize(self.sB_layout)], ALIGN]
            sSFA: cute.struct.Align[cute.struct.MemRange[
                u8, cute.cosize(self.sSFA_bytes)], ALIGN]
            sSFB: cute.struct.Align[cute.struct.MemRange[
                u8, cute.cosize(self.sSFB_bytes)], ALIGN]
            if self.staged_c:  # grouped tiles and fused ops are stored from registers
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
        # absent operands are None (the kernel branches on them with const_expr): scale
        # atoms where the scales go by cp.async (grouped: A's, row by row), the D store
        # atom where D is stored from registers (grouped, split-K), the split-K workspace
        # and the group offsets where there are none
        tma_sfa = tma_mSFA = tma_sfb = tma_mSFB = None
        if cutlass.const_expr(not self.sf_cp_async):
            tma_sfb, tma_mSFB = loads.sf_tma_atom(
                loads.sf_global_view(t.mSFB, n, half_k, self.fmt), self.sSFB_bytes)
            if cutlass.const_expr(not self.grouped):
                tma_sfa, tma_mSFA = loads.sf_tma_atom(
                    loads.sf_global_view(t.mSFA, m, half_k, self.fmt), self.sSFA_bytes)
        tma_c, tma_mC = None, t.mD
        offsets = work = count = None
        if cutlass.const_expr(self.grouped):
            offsets = t.mOffsets
            units = GroupedScheduler.create(offsets.shape[0] - 1, m, n, k, self.tile_mnk)
        else:
            if cutlass.const_expr(self.split_k == 1 and self.staged_c):
                tma_c, tma_mC = cpasync.make_tiled_tma_atom(
                    cpasync.CopyBulkTensorTileS2GOp(), t.mD,
                    cute.slice_(self.sC_layout, (None, None, 0)), self.epi_tile)
            else:
                work, count = t.mWork, t.mCount
            units = TileScheduler.create(m, n, k, self.tile_mnk, self.split_k,
                                         self.sched.group_size, self.along_m)
        params = Sm120Params(tma_a, tma_mA, tma_b, tma_mB, tma_sfa, tma_mSFA, tma_sfb, tma_mSFB,
                             tma_c, tma_mC, t.mSFA, t.mSFB, t.mAlpha, units,
                             self.fmt.atom_cols(half_k),
                             offsets, m, work, count, t.mBias if self.ops else None, t.nv)
        self.kernel(params).launch(grid=[units.grid(self.sched.persistent, max_ctas), 1, 1],
                                   block=[self.threads, 1, 1], cluster=[1, 1, 1],
                                   smem=self.smem_bytes, stream=stream,
                                   max_number_threads=[self.threads, 1, 1],
                                   min_blocks_per_mp=1, use_pdl=roles.PDL)

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
    def kernel(self, p: Sm120Params):
        self._setup()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == self.producer_warp:
            for atom in (p.tma_a, p.tma_b, p.tma_sfa, p.tma_sfb, p.tma_c):
                if cutlass.const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)
        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        mainloop = self._make_mainloop_pipeline(storage.mainloop_bars.data_ptr())
        turn_bars = storage.turn_bars.data_ptr()
        roles.init_turns(self.pingpong, turn_bars,
                         roles.turn_arrivals(self.warps, self.groups, self.group_threads),
                         warp_idx)
        cute.arch.sync_threads()
        roles.wait_for_inputs()  # nothing above touches global memory
        p = p._replace(units=p.units.prepare(p.mOffsets))
        if warp_idx < self.warps.first_mma_warp:
            roles.producer_registers(self.warps)
            if warp_idx == self.producer_warp:
                self.load_tiles(storage, mainloop, p)
        else:
            roles.consumer_registers(self.warps)
            self.mma_and_store(storage, mainloop, p, turn_bars, warp_idx)

    def _make_mainloop_pipeline(self, bars):
        # cp.async scale loads add one no-increment arrival per producer lane; each stage is
        # read (and released) by one MMA group: pingpong groups take units in turn
        return roles.mainloop_pipeline(
            self.warps, self.stages, self.tx_bytes, bars, consumer_warps=self.group_warps,
            consumer_groups=self.groups, producer_cp_async=self.sf_cp_async or self.grouped)

    # ------------------------------------------------------------------ producer warp

    @staticmethod
    def _tma_smem(region, layout):
        """A/B stages as the TMA writes them: bytes in ``layout`` (``s*_tma_layout``) over
        the FP4 storage ``region`` that ldmatrix reads through ``s*_layout``."""
        return region.get_tensor(layout.outer, swizzle=layout.inner, dtype=cutlass.Uint8)

    @cute.jit
    def load_tiles(self, storage, mainloop, p: Sm120Params):
        """Producer warp: for each work unit, its K tiles of A, B, SFA, SFB into the ring."""
        tm, tn, tk = self.tile_mnk
        tma_a, mA, tma_b, mB = p.tma_a, p.mA, p.tma_b, p.mB
        tma_sfa, mSFA, tma_sfb, mSFB = p.tma_sfa, p.mSFA, p.tma_sfb, p.mSFB
        sfa_bytes, sfb_bytes, k_blocks, m_rows = p.sfa_bytes, p.sfb_bytes, p.k_blocks, p.m_rows
        tAsA, tAgA = loads.tma_views(tma_a, self._tma_smem(storage.sA, self.sA_tma_layout),
                                     mA, (tm, tk // 2))
        tBsB, tBgB = loads.tma_views(tma_b, self._tma_smem(storage.sB, self.sB_tma_layout),
                                     mB, (tn, tk // 2))
        sSFA = storage.sSFA.get_tensor(self.sSFA_bytes)
        sSFB = storage.sSFB.get_tensor(self.sSFB_bytes)
        sf_box = cute.shape(cute.slice_(self.sSFA_bytes, (None,) * 4 + (0,)))
        if cutlass.const_expr(tma_sfa is not None):
            tAsSFA, tAgSFA = loads.tma_views(tma_sfa, sSFA, mSFA, sf_box)
        if cutlass.const_expr(tma_sfb is not None):
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
                                            tm, tk, lane, self.fmt)
                cute.arch.cp_async_mbarrier_arrive_noinc(bar)
                return
            cm, cn, ra, rb = u
            cute.copy(tma_a, tAgA[(None, cm, kt, 0)], tAsA[(None, s)], tma_bar_ptr=bar)
            cute.copy(tma_b, tBgB[(None, cn, kt, 0)], tBsB[(None, s)], tma_bar_ptr=bar)
            if cutlass.const_expr(self.sf_cp_async):
                loads.load_sf_cp_async(sfa_bytes, sSFA, s, ra, kt, k_blocks, tk, lane, self.fmt)
                loads.load_sf_cp_async(sfb_bytes, sSFB, s, rb, kt, k_blocks, tk, lane, self.fmt)
                cute.arch.cp_async_mbarrier_arrive_noinc(bar)
            else:
                cute.copy(tma_sfa, tAgSFA[(None, 0, 0, kt, ra)], tAsSFA[(None, s)],
                          tma_bar_ptr=bar)
                cute.copy(tma_sfb, tBgSFB[(None, 0, 0, kt, rb)], tBsSFB[(None, s)],
                          tma_bar_ptr=bar)

        loads.producer_loop(mainloop, self.stages, p.units, per_unit, issue)

    # ------------------------------------------------------------------ MMA warps

    @cute.jit
    def mma_and_store(self, storage, mainloop, p: Sm120Params, turn_bars, warp_idx):
        """MMA warps: per work unit, the K mainloop into registers, then the epilogue."""
        units, tma_c, mC, alpha, mWork, mCount = p.units, p.tma_c, p.mC, p.mAlpha, p.mWork, p.mCount
        tidx, _, _ = cute.arch.thread_idx()
        mma_warp = warp_idx - self.warps.first_mma_warp
        group = mma_warp // self.group_warps
        gtid = (tidx - self.warps.first_mma_thread) % self.group_threads
        frags = self._mma_fragments(storage, gtid)
        if cutlass.const_expr(self.staged_c):
            sC = storage.sC.get_tensor(self.sC_layout.outer, swizzle=self.sC_layout.inner)
            gC = cute.local_tile(mC, self.tile_mnk[:2], (None, None, None))
            epi = smem_epilogue(self._r2s_copy(), self.tiled_mma, gtid, sC, frags.acc,
                                self.c_dtype, self.tile_mnk[:2], self.epi_tile)
        else:
            sC, gC, epi = None, None, None
        bar = pipeline.NamedBarrier(barrier_id=int(Barrier.MMA_GROUP) + group,
                                    num_threads=self.group_threads)
        scale = cutlass.Float32(1.0)
        if cutlass.const_expr(not self.grouped):
            scale = alpha[0]
        c = Sm120Consumer(mainloop, frags, turn_bars, group, gtid, mma_warp, bar, scale, epi,
                          sC, gC, tma_c, mC, alpha, mWork, mCount, units, p.mBias, p.nv)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for_each_unit(units, functools.partial(self._mma_unit, c),
                      (state, cutlass.Int32(0), cutlass.Int32(0)))

    @cute.jit
    def _mma_unit(self, c: Sm120Consumer, w: WorkTile, unit, carry):
        """One work unit of an MMA group (pingpong: every other unit is the other group's,
        whose stages it skips): the mainloop, then the epilogue. ``carry``: the pipeline
        state, this group's turn and the unit's step in the CTA's list."""
        state, turn, step = carry
        if step % self.groups == c.group:
            roles.turn_wait(self.pingpong, c.turn_bars, c.group, turn, Turn.MAINLOOP)
            c.frags.acc.fill(0.0)
            # grouped tiles keep their scale rows at the start of the stage's atom
            cm = 0 if cutlass.const_expr(self.grouped) else w.m
            state = self.mainloop(c.mainloop, state, c.frags, w.k_count, cm, w.n)
            roles.turn_arrive(self.pingpong, c.turn_bars, c.group, Turn.MAINLOOP)
            roles.turn_wait(self.pingpong, c.turn_bars, c.group, turn, Turn.EPILOGUE)
            if cutlass.const_expr(self.grouped):
                self._store_grouped(c.frags.acc, c.alpha, c.mC, c.mBias, w, c.gtid, c.nv)
            elif cutlass.const_expr(self.split_k > 1 or not self.staged_c):
                self._store_registers(c.frags.acc, c.scale, c.mC, c.mWork, c.mCount, c.mBias,
                                      c.units, w, unit, c.gtid, c.nv)
            else:
                store_smem_tma(c.epi, c.tma_c, c.gC[(None, None, w.m, w.n, w.split)], c.sC,
                               c.scale, self.epi_tile, self.epi_stages, c.bar,
                               c.mma_warp % self.group_warps == 0, self.c_dtype)
            roles.turn_arrive(self.pingpong, c.turn_bars, c.group, Turn.EPILOGUE)
            turn += 1
        else:
            state = roles.skip_stages(state, w.k_count)
        step += 1
        return state, turn, step

    @cute.jit
    def _store_registers(self, acc, scale, mD, mWork, mCount, mBias, units, w, unit, gtid,
                         nv):
        """A tile from registers (fused ops), or a split-K partial, of which the tile's last
        split stores the sum."""
        tm, tn, _ = self.tile_mnk
        gD = cute.local_tile(mD, d_tile((tm, tn), 1, self.ops), (None, None, None))
        rows, cols = mD.shape[0] - w.m * tm, mD.shape[1] * self.out_cols - w.n * tn
        fused = fused_tile(self.schedule, 1, mBias, w.n * tn, self._nv_tile(nv, w.m * tm, gtid))
        if cutlass.const_expr(self.split_k > 1):
            assert cute.size(acc) == self.split_values, (cute.size(acc), self.split_values)
            store_split_k(self.tiled_mma.get_slice(gtid), acc, scale, mWork, mCount,
                          units.total // self.split_k, unit // self.split_k, gtid,
                          self.split_slots, w.split, self.split_k,
                          gD[(None, None, w.m, w.n, 0)], (tm, tn), rows, cols, self.out_dtype,
                          fused)
        else:
            store_direct(self.tiled_mma.get_slice(gtid), acc, scale,
                         gD[(None, None, w.m, w.n, 0)], (tm, tn), rows, cols, self.out_dtype,
                         fused)

    @cute.jit
    def _store_grouped(self, acc, alpha, mD, mBias, w, gtid, nv):
        """A grouped tile from registers: rows ``w.row0 ..`` of D, masked at the group's
        last row (the rows after it belong to the next group) and at N."""
        tm, tn, _ = self.tile_mnk
        gD = cute.local_tile(cute.domain_offset((w.row0, 0, 0), mD),
                             d_tile((tm, tn), 1, self.ops), (None, None, None))
        bias = mBias[(None, w.l)] if cutlass.const_expr("bias" in self.ops) else None
        store_direct(self.tiled_mma.get_slice(gtid), acc, alpha[w.l],
                     gD[(None, None, 0, w.n, 0)], (tm, tn), w.rows,
                     mD.shape[1] * self.out_cols - w.n * tn, self.c_dtype,
                     fused_tile(self.schedule, 1, bias, w.n * tn,
                                self._nv_tile(nv, w.row0, gtid)))

    def _nv_tile(self, nv, row0, gtid) -> NvTile | None:
        """``"nvfp4_out"``: where a tile whose first row is ``row0`` goes (None without)."""
        if nv is None:
            return None
        return NvTile(nv, row0, gtid, self.tiled_mma.size)

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


class Sm120GroupedGemm(GroupedLaunch, Sm120Gemm):
    """Grouped (MoE) NVFP4 GEMM for SM120: :class:`Sm120Gemm` with a
    :class:`~cute_fp4.kernels.scheduler.GroupedScheduler` (``Scheduler.grouped``), launched
    through the grouped signature (kernels/launch.py ``GroupedLaunch``)."""

    b_row_align = 1  # plain [N, K/2] weights per group


__all__ = ["MmaFragments", "Sm120Consumer", "Sm120Gemm", "Sm120GroupedGemm", "Sm120Params"]
