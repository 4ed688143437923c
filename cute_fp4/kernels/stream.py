"""Weight-streaming decode GEMM (``mainloop=stream``): one kernel for sm_90a and sm_120a.

``D^T[N, M] = B[N, K] @ A[M, K]^T`` for small M (decode), with B the fragment-order packed
NVFP4 weight (:mod:`cute_fp4.packed`) and A 16-bit activations. At decode a GEMM's time is
the time to read the weight, so this kernel is built to keep the memory system full and
to spend few instructions per weight element:

* a CTA is four warps over one 64-row block of the packed weight and one activation tile;
  the warps take the block's K units (64 elements, 2,048 bytes) in turn (warp ``w`` units
  ``w, w + 4, ...`` of the CTA's K range) and each warp computes all 64 rows of its units:
  four 16-row groups (one ``mma.sync.m16n8k16`` A fragment each) share every activation
  fragment it loads. The four partial sums are added through shared memory at the end, in
  warp order;
* no producer warp: each warp streams its own units through a ring of two batches of
  ``stages`` units in shared memory with ``cp.async`` (per lane and unit four 16-byte
  weight copies, coalesced 512-byte runs, and one 8-byte copy of scale words), issuing
  batch ``b + 1`` before it waits for batch ``b`` (``cp.async.wait_group 1`` and a warp
  barrier: no CTA barrier in the loop). One to two batches are always in flight per warp,
  whatever ptxas does with registers (plain loads into registers were sunk next to their
  uses by ptxas in a first version: about one unit in flight per warp);
* the weight is decoded in registers by the register-sourced SM90 kernel's exact decode
  (``sm90_rs_wide.decode_fragment``: PRMT table lookups and one 16-bit multiply by the
  scale per pair of elements) into the A fragments (the WGMMA register fragment and the
  ``mma.sync`` one are the same per warp, which is why the packed layout serves both); each
  scale is read once per 16 elements of its row. The activation pairs of the B fragment
  come from global memory (L1-resident: every CTA reads the same few kilobytes), all of a
  unit's before its first decode, so their latency is paid once per unit; rows of an
  activation tile past M read row M - 1 and their columns of D are never stored;
* across kernel boundaries (programmatic dependent launch, ``roles.PDL``): a CTA fills its
  warps' rings (both batches: weight and scale words only), waits (``griddepcontrol.wait``)
  before it reads an activation, alpha, a split-K counter or anything the kernels before
  it write, then releases its dependents (``griddepcontrol.launch_dependents``), so that
  the next kernel's CTAs become resident and start their own loads while this one streams
  and drains. With the launch's ``early`` flag set (dense only, see Constraints) the ring
  is filled *before* the wait: the weight streams while the kernel before still runs.
  The release comes after the wait so that one kernel at most runs ahead: released
  before it (H100, 2026-12-06), every later GEMM of a chain became resident at once and
  fetched its ring, and 8192^2 took 26.0 us per GEMM with the flag against 22.0 without;
* K is split over ``split_k`` CTAs per output tile (``kernels/scheduler.py``: balanced
  ranges of 64-element units), and the partials are reduced in the kernel, in split order,
  by the last CTA of a tile to arrive (``epilogue.store_split_k``: the same bits on every
  run, no second kernel).

What differs per target is only the code ptxas makes of the same PTX: ``mma.sync`` BF16/FP16
(HMMA), ``cp.async``, PRMT, LOP3 and the 16-bit multiply exist on sm_90a and sm_120a alike.

Constraints:
* W4A16 only (16-bit A, BF16 or FP16; the MMA runs A's type); B the fragment-order packed
  weight, K a multiple of 64, rows padded to 64 (``cute_fp4.packed``); N a multiple of 8.
* Tile: 64 weight rows x ``tile.m`` (8 or 16) activation rows x one 64-element K unit;
  four warps; 1 <= ``stages`` (K units per batch of a warp's ring) <= 8; shared memory
  ``2 x 4 x stages x 2,304`` bytes (at least the 8 KiB per N block the final sum uses).
* Scale factors: UE4M3 (sign bit ignored) in the 128x4 blocked layout.
* Fused epilogue operations (``Epilogue.ops``, ``epilogue.store_direct``): ``bias``
  (float32 ``[N]``, grouped ``[experts, N]``) and ``silu_mul`` with gate/up weight rows
  interleaved in groups of 8 (a thread holds D^T rows ``lane / 4 + {0, 8}`` of its warp's
  16; checked while tracing), the output ``[M, N / 2]``; split-K applies them in the last
  split, to the sum.
* One CTA per (64 rows, activation tile, split): not persistent.
* Weights before the wait (the launch's ``early`` flag, ``kernels/launch.py``; 0 unless
  the caller passes 1): the ring's first two batches of the weight and its scales (and,
  with ``l2_ahead``, later ones asked into L2) are read before ``griddepcontrol.wait``,
  so they may be read while a kernel earlier on the stream is still running: the one just
  before, and any before that one if it released its dependents before its own wait (the
  package's kernels release after theirs; a foreign kernel may not). **Rule: a weight
  read before the wait must not be written by a kernel still in flight earlier on the
  stream.** Its bytes must be final before the launch can start: written before a host
  synchronisation or an event the stream waited on, or before a kernel launched without
  PDL, or one that waits before it releases, that came between the writer and this
  launch (each of those starts only once everything before it has completed). Weights
  loaded, repacked or converted on the stream and then read with the flag on in the same
  breath break it (tests/gpu/test_pdl.py shows the old bytes being read). The flag is for
  weights a layer finished preparing (``cute_fp4.layers``); the activations, alpha,
  bias, offsets and split-K workspace are always read after the wait. Grouped launches
  ignore it: which expert a CTA streams comes from the offsets, which the kernel before
  writes.
* Grouped (``Scheduler(grouped=True)``, :class:`StreamGroupedGemm`, MoE experts at decode):
  the units are a :class:`~cute_fp4.kernels.scheduler.GroupedScheduler`'s, row tiles of
  ``tile.m`` rows of each expert that has rows (offsets clamped to ``[0, M_total]`` and
  monotone, ``scheduler.group_rows``) times the 64-row blocks of that expert's weight, so
  an expert without rows costs nothing but a CTA that reads the offsets and exits (the grid
  is the most units a valid table can make, :func:`grouped_bound`; an invalid table that
  counts more is walked to its end by :func:`~cute_fp4.kernels.scheduler.for_each_unit`,
  each CTA striding by the grid); activation rows are
  read from the expert's first row, rows past its last are never stored; alpha per
  expert; no split of K. An expert with more rows than ``tile.m`` gets one row tile per
  ``tile.m`` rows (each streams its weight block again).
"""

import functools
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass.cute.nvgpu import cpasync

from cute_fp4.kernels import roles
from cute_fp4.kernels.epilogue import d_tile, fused_tile, store_direct, store_split_k
from cute_fp4.kernels.launch import (
    GemmLaunch,
    GemmTensors,
    GroupedLaunch,
    GroupedTensors,
    PointerTypes,
    out_dtype,
)
from cute_fp4.kernels.scheduler import (
    GroupedScheduler,
    TileScheduler,
    WorkTile,
    for_each_unit,
    this_unit,
)
from cute_fp4.kernels.sm90_rs_wide import (
    byte_selector,
    decode_fragment,
    decode_tables,
    scale_byte_half,
    scale_halves,
    scale_select,
)
from cute_fp4.packed import UNIT_BYTES, UNIT_K, UNIT_ROWS
from cute_fp4.plan import plan
from cute_fp4.planning.stream import RING, k_warps
from cute_fp4.schedule import Problem, Schedule

LANE_WORDS = 4  # 32-bit weight words per lane, row group and K unit (four K blocks of 16)
GROUPS = 4  # 16-row groups of a 64-row block (one mma.sync A fragment each)
CHUNK_WORDS = 32 * LANE_WORDS  # one row group's 16 rows of a unit, 512 bytes
UNIT_WORDS = UNIT_BYTES // 4
SF_ATOM_WORDS = 128  # a 512-byte scale atom (128 rows x 4 K blocks) in 32-bit words
PAIRS = 4  # scale-word pairs per quad of lanes and unit (row group parity x row half)


def unit_word_index(row_block, ku, k_units):
    """Index in 32-bit words of the packed unit (``row_block``, ``ku``); row group ``j``'s
    lane ``l`` words are ``4 l + 128 j .. + 3`` further (:mod:`cute_fp4.packed`)."""
    return (row_block * k_units + ku) * UNIT_WORDS


def scale_pair_index(row_block, ku, k_units, pair, quad):
    """Index in 32-bit words, in the blocked scales, of scale-word pair ``pair`` of lane
    quad ``quad`` (``g``) for scale atom ``ku`` (of ``k_units`` along K: the K unit itself
    for NVFP4, whose atom covers 64 K; ``StreamGemm._scale_atom``) of a 64-row block: the
    four scales (one word) of row ``16 j + 8 h + g`` of the block for row groups ``j =
    pair % 2`` (first word) and ``j + 2`` (second word), ``h = pair // 2``. In the 128x4
    layout those two rows are adjacent words. Plain integer arithmetic: the kernel and the
    CPU tests run it.
    """
    r = 16 * (pair % 2) + 8 * (pair // 2) + quad  # the row's place in its 32-row slab
    return (((row_block // 2) * k_units + ku) * SF_ATOM_WORDS + r * 4 + 2 * (row_block % 2))


def scale_word_of(group, half):
    """Which of a quad's eight scale words (``pair`` major, see :func:`scale_pair_index`)
    holds row ``16 group + 8 half + g``'s scales."""
    return 2 * (group % 2 + 2 * half) + group // 2


class StreamParams(NamedTuple):
    """Kernel arguments."""

    mA32: cute.Tensor  # activations [M, K] as 32-bit words (pairs of 16-bit values)
    mQ: cute.Tensor  # the packed weight as flat 32-bit words
    mS: cute.Tensor  # B's blocked scales as flat 32-bit words
    gD: cute.Tensor  # D^T: (output columns, M, 1) (N, or N / 2 with "silu_mul")
    mAlpha: cute.Tensor
    units: TileScheduler | GroupedScheduler  # dense: (row blocks, activation tiles, K
    # units, split_k); grouped: (expert row tiles x row blocks) from the offsets
    m: cutlass.Int32
    n: cutlass.Int32
    mWork: cute.Tensor | None  # split-K workspace: FP32 partials (without split-K: None)
    mCount: cute.Tensor | None  # split-K header and arrival counters (without: None)
    mOffsets: cute.Tensor | None = None  # grouped: int32 [experts + 1]; dense: None
    mBias: cute.Tensor | None = None  # fused "bias": (N,), grouped (N, experts); else None
    early: cutlass.Int32 | None = None  # dense: 1 reads the weight before the wait; grouped:
    # None (the experts come from the offsets, after the wait)


class Block(NamedTuple):
    """What one CTA computes, dense or grouped: 64-row block ``blk`` of expert ``g``'s
    packed weight (``mQ``, ``mS``: that expert's words), its K units ``[k_begin, k_begin
    + k_count)``, activation rows ``row0 .. row0 + rows`` (rows >= 1; a tile's rows past
    them read row ``row0 + rows - 1`` and are never stored), and where D^T's tile is."""

    mQ: cute.Tensor
    mS: cute.Tensor
    blk: cutlass.Int32
    g: cutlass.Int32
    k_begin: cutlass.Int32
    k_count: cutlass.Int32
    row0: cutlass.Int32
    rows: cutlass.Int32
    unit: cutlass.Int32
    split: cutlass.Int32


class StreamGemm(GemmLaunch):
    """W4A16 decode GEMM on the packed weight (``mainloop=stream``), sm_90a and sm_120a."""

    def __init__(self, schedule: Schedule, problem: Problem):
        pl = plan(schedule, problem).raise_if_invalid()
        self.schedule, self.problem = schedule, problem
        self.fmt = problem.fmt  # the weight's block format (its scales' decode)
        self.units_per_atom = self.fmt.atom_k // UNIT_K  # K units per scale word
        self.tile_m = schedule.tile.m
        self.n_blocks = self.tile_m // 8  # m16n8k16 N blocks per activation tile
        self.batch = pl.stages  # K units per batch of a warp's ring
        self.w4a16 = True
        self.grouped = schedule.scheduler.grouped
        self.mma_dtype = cutlass.BFloat16 if problem.a_format == "bf16" else cutlass.Float16
        self.split_k = schedule.split_k
        self.out_dtype = out_dtype(schedule)
        self.sm_count = schedule.arch.sm_count
        self.threads = pl.threads
        self.k_warps = k_warps(schedule)  # warps over the K units; the first GROUPS store
        self.plan_smem_bytes = pl.smem_bytes
        self.smem_bytes = None  # set while tracing
        # split-K: one counter per output tile and thread; 4 FP32 values per N block
        self.split_slots = GROUPS * 32  # the storing warps' threads
        self.split_values = 4 * self.n_blocks
        self.ptr_types = PointerTypes(self.mma_dtype, self.out_dtype)

    # static choices of the K loop (class attributes, so a probe subclass can vary them):
    ring = RING  # batches in each warp's ring: ring - 1 are in flight while one is decoded
    act_hoist = True  # a unit's activation pairs loaded before its first decode (H200,
    # 1 x 8192 x 8192: 19.9 us against 22.3 loaded per K block, L1TEX stalls 41% -> 30%)
    dual_acc = False  # even and odd units of a batch into two accumulator sets (added last)
    group_major = True  # a unit's MMAs row group by row group (K blocks inner)
    l2_ahead = 0  # batches of the CTA's units asked into L2 (cp.async.bulk.prefetch.L2) ahead
    # of the ring, by one thread; 0: none
    release = True  # griddepcontrol.launch_dependents once the ring's first loads are issued
    min_ctas = None  # CTAs per SM the launch bounds ask ptxas to fit (registers); None: none

    def _setup(self):
        """The rings' shared storage: per warp, ``RING`` batches of ``batch`` units of
        (4 words, 32 lanes, 4 row groups) weight words and (2 words, 4 pairs, 8 quads)
        scale words. After the K loop the weight region holds the warps' partial sums."""
        w = self.k_warps
        self.sQ_layout = cute.make_layout((LANE_WORDS, 32, GROUPS, self.batch, self.ring, w))
        self.sS_layout = cute.make_layout((2, PAIRS, 8, self.batch, self.ring, w))
        self.red_layout = cute.make_layout((4 * self.n_blocks, 32, GROUPS, w))
        assert cute.cosize(self.red_layout) <= cute.cosize(self.sQ_layout)

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[cutlass.Uint32,
                                                       cute.cosize(self.sQ_layout)], 1024]
            sS: cute.struct.Align[cute.struct.MemRange[cutlass.Uint32,
                                                       cute.cosize(self.sS_layout)], 1024]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        if self.smem_bytes != self.plan_smem_bytes:
            raise AssertionError(f"kernel allocates {self.smem_bytes} B of shared memory, "
                                 f"plan() counted {self.plan_smem_bytes} B")

    def _tiled_mma(self):
        op = cute.nvgpu.warp.MmaF16BF16Op(self.mma_dtype, cutlass.Float32, (16, 8, 16))
        return cute.make_tiled_mma(op, (GROUPS, 1, 1))  # the storing warps

    # ------------------------------------------------------------------ host launcher
    @cute.jit
    def _launch(self, t: GemmTensors | GroupedTensors, max_ctas: cutlass.Int32, stream):
        self._setup()
        m, n = t.mD.shape[0], t.mB.shape[0]  # n: the weight's rows (the GEMM's N)
        nd = t.mD.shape[1]  # the output's columns: N, or N / 2 with "silu_mul"
        half_k = t.mB.shape[1]
        k_units = half_k // (UNIT_K // 2)
        row_blocks = (n + UNIT_ROWS - 1) // UNIT_ROWS
        # one expert's words (grouped: the kernel offsets the pointers by the expert)
        mQ = cute.make_tensor(cute.recast_ptr(t.mB.iterator, dtype=cutlass.Uint32),
                              cute.make_layout(expert_words(n, half_k)))
        mS = cute.make_tensor(cute.recast_ptr(t.mSFB.iterator, dtype=cutlass.Uint32),
                              cute.make_layout(t.mSFB.shape[0] // 4))
        ld_a = cute.assume(cutlass.Int64(half_k), divby=16)
        mA32 = cute.make_tensor(cute.recast_ptr(t.mA.iterator, dtype=cutlass.Uint32),
                                cute.make_layout((m, half_k), stride=(ld_a, 1)))
        bias = t.mBias if "bias" in self.ops else None  # absent: None
        if cutlass.const_expr(self.grouped):
            gD = cute.make_tensor(t.mD.iterator, cute.make_layout(
                (nd, m, 1), stride=(1, t.mD.stride[0], 0)))
            groups = t.mOffsets.shape[0] - 1
            units = GroupedScheduler(groups, row_blocks, k_units, self.tile_m, m,
                                     grouped_bound(m, groups, self.tile_m, row_blocks,
                                                   cutlass.min))
            params = StreamParams(mA32, mQ, mS, gD, t.mAlpha, units, m, n, None, None,
                                  t.mOffsets, bias)
        else:
            gD = cute.make_tensor(t.mD.iterator, cute.make_layout(
                (nd, m, 1), stride=(1, t.mD.stride[0], t.mD.stride[2])))
            units = TileScheduler.create(n, m, half_k * 2, (UNIT_ROWS, self.tile_m, UNIT_K),
                                         self.split_k)
            work = (t.mWork, t.mCount) if self.split_k > 1 else (None, None)  # absent: None
            params = StreamParams(mA32, mQ, mS, gD, t.mAlpha, units, m, n, *work, None, bias,
                                  t.early)
        # launch bounds: ptxas fits min_ctas CTAs per SM in the registers; the carveout is
        # given (all shared memory: the rings) so that no device is asked while compiling
        bounds = ({} if self.min_ctas is None else
                  {"min_blocks_per_mp": self.min_ctas, "preferred_smem_carveout": 100})
        self.kernel(params).launch(grid=[units.grid(False, max_ctas), 1, 1],
                                   block=[self.threads, 1, 1], smem=self.smem_bytes,
                                   stream=stream, use_pdl=roles.PDL, **bounds)

    # ------------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(self, p: StreamParams):
        self._setup()
        if cutlass.const_expr(self.grouped):
            roles.wait_for_inputs()  # the offsets may come from the kernel before
            # one unit per CTA from a valid table (the grid is its most units; CTAs past
            # the routed ones exit at once); an invalid one that counts more (overlapping
            # experts) is walked to its end, every CTA striding by the grid
            for_each_unit(p.units.prepare(p.mOffsets),
                          functools.partial(self._grouped_unit, p), cutlass.Int32(0))
        else:
            unit, w = this_unit(p.units)  # one CTA per unit
            row0 = w.n * self.tile_m
            self._block(p, Block(p.mQ, p.mS, w.m, 0, w.k_begin, w.k_count, row0, p.m - row0,
                                 unit, w.split))

    @cute.jit
    def _grouped_unit(self, p: StreamParams, w: WorkTile, unit, carry):
        """Grouped: unit ``unit``, row tile ``w.m`` of expert ``w.l`` times its weight's
        64-row block ``w.n``; ``carry`` is unused (nothing passes between units)."""
        g = w.l
        # whole units (512 words) and scale atoms (128 words) per expert
        q_off = cute.assume(cutlass.Int64(g) * cute.size(p.mQ), divby=UNIT_WORDS)
        s_off = cute.assume(cutlass.Int64(g) * cute.size(p.mS), divby=SF_ATOM_WORDS)
        mQ = cute.make_tensor(p.mQ.iterator + q_off, p.mQ.layout)
        mS = cute.make_tensor(p.mS.iterator + s_off, p.mS.layout)
        self._block(p, Block(mQ, mS, w.n, g, 0, p.units.k_tiles, w.row0, w.rows, unit, 0))
        cute.arch.barrier()  # a next unit's rings overwrite the partial sums just read
        return carry

    @cute.jit
    def _block(self, p: StreamParams, blk: Block):
        """One 64-row block of the weight times one activation tile over the block's K
        units: the warps' rings, their partial sums, the store."""
        tidx, _, _ = cute.arch.thread_idx()
        warp = tidx // 32
        lane = tidx % 32
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sQ_all = storage.sQ.get_tensor(self.sQ_layout)
        sQ = sQ_all[(None, lane, None, None, None, warp)]  # (word, group, unit, slot)
        sS = storage.sS.get_tensor(self.sS_layout)[(None, None, None, None, None, warp)]
        mma1 = self._warp_mma()
        thr1 = mma1.get_slice(lane)
        tm = self.tile_m
        frA = mma1.make_fragment_A(thr1.partition_A(cute.make_identity_tensor((16, 16))).shape)
        frB = mma1.make_fragment_B(thr1.partition_B(cute.make_identity_tensor((tm, 16))).shape)
        acc_shape = thr1.partition_C(cute.make_identity_tensor((16, tm))).shape
        accs = []
        sets = 2 if cutlass.const_expr(self.dual_acc and self.batch > 1) else 1
        for _ in cutlass.range_constexpr(GROUPS * sets):
            a = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
            a.fill(0.0)
            accs.append(a)
        tables = decode_tables(self.mma_dtype is cutlass.BFloat16, self.fmt)
        k_units = p.units.k_tiles
        # this warp's units of the CTA's range: k_begin + warp + 4 t, t < mine
        w = self.k_warps
        mine = (blk.k_count - warp + w - 1) // w
        x_rows = []  # each N block's activation row (rows past the block's read its last)
        for nb in cutlass.range_constexpr(self.n_blocks):
            x_rows.append(blk.row0 + cutlass.min(nb * 8 + lane // 4, blk.rows - 1))
        ring = (blk, sQ, sS, k_units, warp, lane, mine)
        n_batches = (mine + self.batch - 1) // self.batch
        if cutlass.const_expr(not self.grouped):
            if p.early == 0:
                roles.wait_for_inputs()  # (grouped: waited for the offsets already)
        # the whole ring: weight and scale words only, before the wait when p.early is set
        for b in cutlass.range_constexpr(self.ring):
            self._issue(ring, b)  # (issues nothing past the warp's last unit)
            cute.arch.cp_async_commit_group()
        self._prefetch_l2(blk, k_units, tidx, self.ring, self.ring + self.l2_ahead)
        if cutlass.const_expr(not self.grouped):
            roles.wait_for_inputs()  # activations, alpha and split-K counters after this
        if cutlass.const_expr(self.release):
            # this CTA's first loads are out and the kernels before it are done: the next
            # kernel may start (and, with its flag, read its weight) while this one
            # streams; after the wait, so that at most one kernel runs ahead of this one
            roles.release_dependents()
        for b in cutlass.range(n_batches, unroll=1):
            cute.arch.cp_async_wait_group(self.ring - 1)  # batch b has landed
            cute.arch.sync_warp()  # the quad's scale words, copied by its four lanes
            for i in cutlass.range_constexpr(self.batch):
                t = b * self.batch + i
                if t < mine:
                    mine_accs = accs[GROUPS * (i % sets): GROUPS * (i % sets + 1)]
                    self._unit(p, ring, b % self.ring, i, blk.k_begin + warp + w * t,
                               x_rows, tables, mma1, frA, frB, mine_accs)
            cute.arch.sync_warp()  # every lane is done with slot b % ring: refill it
            if b + self.ring < n_batches:
                self._issue(ring, b + self.ring)
            cute.arch.cp_async_commit_group()
            self._prefetch_l2(blk, k_units, tidx, b + self.ring + self.l2_ahead,
                              b + self.ring + self.l2_ahead + 1)
        cute.arch.cp_async_wait_group(0)
        if cutlass.const_expr(sets > 1):
            for j in cutlass.range_constexpr(GROUPS):
                for v in cutlass.range_constexpr(cute.size(accs[j])):
                    accs[j][v] = accs[j][v] + accs[GROUPS + j][v]
        red = self._share(sQ_all, accs, warp, lane)
        tiled_mma = self._tiled_mma()
        if cutlass.const_expr(self.k_warps == GROUPS):
            self._store(p, tiled_mma.get_slice(tidx), self._sum(red, accs, warp, lane), blk,
                        tidx)
        else:  # warp w < GROUPS sums and stores row group w
            if warp < GROUPS:
                self._store(p, tiled_mma.get_slice(tidx), self._sum(red, accs, warp, lane),
                            blk, tidx)

    def _warp_mma(self):
        op = cute.nvgpu.warp.MmaF16BF16Op(self.mma_dtype, cutlass.Float32, (16, 8, 16))
        return cute.make_tiled_mma(op)

    @cute.jit
    def _issue(self, ring, b):
        """cp.async of batch ``b`` of this warp's units (those that exist) into ring slot
        ``b % RING``: per lane and unit its 16 bytes of each row group and its quad's scale
        pair ``lane % 4``."""
        blk, sQ, sS, k_units, warp, lane, mine = ring
        q_atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cutlass.Uint32,
            num_bits_per_copy=128)
        s_atom = cute.make_copy_atom(cpasync.CopyG2SOp(), cutlass.Uint32, num_bits_per_copy=64)
        slot = b % self.ring
        for i in cutlass.range_constexpr(self.batch):
            t = b * self.batch + i
            if t < mine:
                ku = blk.k_begin + warp + self.k_warps * t
                base = unit_word_index(blk.blk, ku, k_units) + lane * LANE_WORDS
                for j in cutlass.range_constexpr(GROUPS):
                    at = cute.assume(base + j * CHUNK_WORDS, divby=LANE_WORDS)
                    cute.copy(q_atom, cute.make_tensor(blk.mQ.iterator + at,
                                                       cute.make_layout(LANE_WORDS)),
                              sQ[(None, j, i, slot)])
                atom, k_atoms = self._scale_atom(ku, k_units)
                at = cute.assume(scale_pair_index(blk.blk, atom, k_atoms, lane % 4, lane // 4),
                                 divby=2)
                cute.copy(s_atom, cute.make_tensor(blk.mS.iterator + at, cute.make_layout(2)),
                          sS[(None, lane % 4, lane // 4, i, slot)])

    def _scale_atoms(self, ku, units):
        """Scale atoms (of one 128-row atom row) that the ``units`` K units from ``ku``
        span: the units for NVFP4, an atom per two units for MXFP4."""
        if self.units_per_atom == 1:
            return units
        per = self.units_per_atom
        return (ku + units - 1) // per - ku // per + 1

    def _scale_atom(self, ku, k_units):
        """(scale atom of K unit ``ku``, atoms along K) of the weight's blocked scales: the
        unit's own for NVFP4, one per two units for MXFP4."""
        if self.units_per_atom == 1:
            return ku, k_units
        per = self.units_per_atom
        return ku // per, (k_units + (per - 1)) // per

    @cute.jit
    def _prefetch_l2(self, blk: Block, k_units, tidx, first, last):
        """``l2_ahead``: thread 0 asks L2 for the CTA's K units of batches ``[first, last)``
        (a batch of the warps is ``k_warps * batch`` consecutive units of the block's
        range: one contiguous run of weight bytes and one of scale atoms, which the row
        block shares with its neighbour) with ``cp.async.bulk.prefetch.L2``, clamped to the
        CTA's range. Nothing is written; the ring's cp.async then finds the lines in L2."""
        if cutlass.const_expr(self.l2_ahead > 0):
            per = self.k_warps * self.batch
            u0 = cutlass.min(first * per, blk.k_count)
            u1 = cutlass.min(last * per, blk.k_count)
            if tidx == 0 and u1 > u0:
                ku = blk.k_begin + u0
                q = blk.mQ.iterator + cute.assume(unit_word_index(blk.blk, ku, k_units),
                                                  divby=UNIT_WORDS)
                atom, k_atoms = self._scale_atom(ku, k_units)
                sf = blk.mS.iterator + cute.assume(
                    ((blk.blk // 2) * k_atoms + atom) * SF_ATOM_WORDS, divby=SF_ATOM_WORDS)
                prefetch_l2(q, (u1 - u0) * UNIT_BYTES)
                prefetch_l2(sf, self._scale_atoms(ku, u1 - u0) * SF_ATOM_WORDS * 4)

    @cute.jit
    def _unit(self, p: StreamParams, ring, slot, i, ku, x_rows, tables, mma1, frA, frB, accs):
        """One K unit (ring ``slot``, position ``i``) of all four row groups: per K block of
        16, the activation fragment once, then each group's A fragment decoded and
        multiplied into its accumulator."""
        blk, sQ, sS, k_units, warp, lane, mine = ring
        bf16 = self.mma_dtype is cutlass.BFloat16
        sw = cute.make_rmem_tensor((2 * PAIRS,), cutlass.Uint32)
        cute.autovec_copy(sS[(None, None, lane // 4, i, slot)], sw)
        sel = None
        if cutlass.const_expr(self.units_per_atom > 1):  # MXFP4: this unit's half of the word
            # a warp's units are k_begin + warp + 4 t: one parity per warp and block; K
            # blocks 0, 1 take byte 2 parity, 2, 3 the next (scale_select's odd)
            parity = cutlass.Uint32((blk.k_begin + warp) & 1)
            sel = [byte_selector(2 * parity + odd) for odd in range(2)]
        a32 = cute.recast_tensor(frA, cutlass.Uint32)
        col = ku * (UNIT_K // 2) + lane % 4  # the pair at K 2c of this unit, in words
        frBs = []  # act_hoist: each K block's B fragment, all loaded before any decode
        if cutlass.const_expr(self.act_hoist):
            for kb in cutlass.range_constexpr(4):
                fb = cute.make_rmem_tensor_like(frB)
                b32 = cute.recast_tensor(fb, cutlass.Uint32)
                for nb in cutlass.range_constexpr(self.n_blocks):
                    b32[2 * nb], b32[2 * nb + 1] = activation_pair(p.mA32, x_rows[nb], col,
                                                                   kb)
                frBs.append(fb)

        def mma(j, kb, word):  # group j's A fragment of K block kb, into its accumulator
            fb = frB
            if cutlass.const_expr(self.act_hoist):
                fb = frBs[kb]
            else:
                b32 = cute.recast_tensor(frB, cutlass.Uint32)
                for nb in cutlass.range_constexpr(self.n_blocks):
                    b32[2 * nb], b32[2 * nb + 1] = activation_pair(p.mA32, x_rows[nb], col,
                                                                   kb)
            odd, half = scale_select(self.fmt, kb)
            if cutlass.const_expr(sel is None):
                s_lo = scale_halves(sw[scale_word_of(j, 0)], odd, bf16, self.fmt)
                s_hi = scale_halves(sw[scale_word_of(j, 1)], odd, bf16, self.fmt)
            else:  # half 0 (scale_select): the unit's byte, picked at run time
                s_lo = scale_byte_half(sw[scale_word_of(j, 0)], sel[odd], bf16, self.fmt)
                s_hi = scale_byte_half(sw[scale_word_of(j, 1)], sel[odd], bf16, self.fmt)
            o = decode_fragment(word, s_lo, s_hi, half, tables, bf16, self.fmt)
            for r in cutlass.range_constexpr(4):
                a32[r] = o[r]
            cute.gemm(mma1, accs[j], frA, fb, accs[j])

        if cutlass.const_expr(self.group_major and self.act_hoist):
            # one row group's four words at a time (4 registers live, not 16); each
            # accumulator still takes its K blocks in order: the same bits
            for j in cutlass.range_constexpr(GROUPS):
                words = cute.make_rmem_tensor((LANE_WORDS,), cutlass.Uint32)
                cute.autovec_copy(sQ[(None, j, i, slot)], words)
                for kb in cutlass.range_constexpr(4):
                    mma(j, kb, words[kb])
        else:
            q = []
            for j in cutlass.range_constexpr(GROUPS):
                words = cute.make_rmem_tensor((LANE_WORDS,), cutlass.Uint32)
                cute.autovec_copy(sQ[(None, j, i, slot)], words)
                q.append(words)
            for kb in cutlass.range_constexpr(4):
                for j in cutlass.range_constexpr(GROUPS):
                    mma(j, kb, q[j][kb])

    @cute.jit
    def _share(self, sQ_all, accs, warp, lane):
        """Every warp's partial sums of the block into shared memory (the rings' space, once
        every warp is done with them): ``red[(value, lane, group, warp)]``."""
        red = cute.make_tensor(cute.recast_ptr(sQ_all.iterator, dtype=cutlass.Float32),
                               self.red_layout)
        cute.arch.barrier()  # every warp is done with the rings
        for j in cutlass.range_constexpr(GROUPS):
            cute.autovec_copy(accs[j], red[(None, lane, j, warp)])
        cute.arch.barrier()
        return red

    @cute.jit
    def _sum(self, red, accs, warp, lane):
        """Row group ``warp``'s sum over the warps' partials (added in warp order: the same
        bits on every run), in the accumulator layout of the four-warp MMA the epilogue
        stores (warps below GROUPS only)."""
        acc = cute.make_rmem_tensor(accs[0].shape, cutlass.Float32)
        part = cute.make_rmem_tensor(accs[0].shape, cutlass.Float32)
        acc.fill(0.0)
        for src in cutlass.range_constexpr(self.k_warps):
            cute.autovec_copy(red[(None, lane, warp, src)], part)
            for v in cutlass.range_constexpr(cute.size(acc)):
                acc[v] = acc[v] + part[v]
        return acc

    @cute.jit
    def _store(self, p: StreamParams, thr_mma, acc, blk: Block, tidx):
        """D^T tile (row block, activation rows) from registers, times alpha (grouped: the
        expert's), with the fused epilogue operations (the tile's mode 0 is the GEMM's N:
        bias of the block's rows, grouped the expert's; "silu_mul" stores a tile of 32
        output rows); split-K: this thread's partial, the tile's last split storing the
        sum."""
        tile = (UNIT_ROWS, self.tile_m)
        out_tile = d_tile(tile, 0, self.ops)
        rows = p.n - blk.blk * UNIT_ROWS
        bias = None
        if cutlass.const_expr(self.grouped):
            gD_t = cute.local_tile(cute.domain_offset((0, blk.row0, 0), p.gD), out_tile,
                                   (None, None, None))
            dst = gD_t[(None, None, blk.blk, 0, 0)]
            alpha = p.mAlpha[blk.g]
            if cutlass.const_expr("bias" in self.ops):
                bias = p.mBias[(None, blk.g)]
        else:
            gD_t = cute.local_tile(p.gD, out_tile, (None, None, None))
            dst = gD_t[(None, None, blk.blk, blk.row0 // self.tile_m, 0)]
            alpha = p.mAlpha[0]
            bias = p.mBias
        fused = fused_tile(self.schedule, 0, bias, blk.blk * UNIT_ROWS)
        if cutlass.const_expr(self.split_k > 1):
            store_split_k(thr_mma, acc, alpha, p.mWork, p.mCount,
                          p.units.total // self.split_k, blk.unit // self.split_k, tidx,
                          self.split_slots, blk.split, self.split_k, dst, tile, rows, blk.rows,
                          self.out_dtype, fused)
        else:
            store_direct(thr_mma, acc, alpha, dst, tile, rows, blk.rows, self.out_dtype,
                         fused)


class StreamGroupedGemm(GroupedLaunch, StreamGemm):
    """Grouped (MoE) W4A16 decode GEMM on a packed expert stack (``mainloop=stream``,
    ``Scheduler(grouped=True)``): :class:`StreamGemm`'s kernel with its units from a
    :class:`~cute_fp4.kernels.scheduler.GroupedScheduler` (row tiles of ``tile.m`` rows of
    each expert that has rows, times the 64-row blocks of its weight), launched through the
    grouped signature (kernels/launch.py ``GroupedLaunch``)."""

    b_row_align = UNIT_ROWS  # each expert's packed weight has packed_rows(N) rows


@cute.jit
def prefetch_l2(ptr, size):
    """``cp.async.bulk.prefetch.L2.global [ptr], size``: ``size`` bytes (a multiple of 16)
    from global memory into L2, asynchronously, best effort (sm_90a and sm_120a)."""
    cute.arch.inline_ptx("cp.async.bulk.prefetch.L2.global [{$r0}], {$r1};",
                         read_only_args=[ptr.toint(), cutlass.Int32(size)])


def activation_pair(mA32, row, col, kb):
    """The two 32-bit words (pairs of 16-bit activations) of K block ``kb`` that a lane's B
    fragment takes from activation row ``row``: K pairs ``col`` and ``col + 4`` of the
    block (``col``: the unit's first pair of this lane, in words)."""
    return mA32[row, col + kb * 8], mA32[row, col + kb * 8 + 4]


def expert_words(n, half_k):
    """32-bit words of one expert's packed weight (``n`` rows padded to whole 64-row
    blocks, ``half_k`` bytes per row): the stride between experts in a packed stack.
    Plain integer arithmetic: the launcher and the CPU tests run it."""
    return (n + UNIT_ROWS - 1) // UNIT_ROWS * (half_k // (UNIT_K // 2)) * UNIT_WORDS


def grouped_bound(m_total, groups, tile_m: int, tiles_n, minimum=min):
    """CTAs of a grouped launch: the most units a valid offset table can make. At most
    ``min(groups, m_total)`` experts have rows, and ``sum ceil(r_e / tile_m) <= (m_total +
    e (tile_m - 1)) / tile_m`` over ``e`` such experts; times the row blocks. (With 8
    routed experts of one row each and ``tile_m`` 8: exactly the 8 x row blocks units.)
    Plain integer arithmetic: the launcher (DSL integers) and the CPU tests run it."""
    busy = minimum(groups, m_total)
    return tiles_n * ((m_total + busy * (tile_m - 1)) // tile_m)


__all__ = ["Block", "StreamGemm", "StreamGroupedGemm", "StreamParams", "expert_words",
           "grouped_bound",
           "scale_pair_index", "scale_word_of", "unit_word_index"]
