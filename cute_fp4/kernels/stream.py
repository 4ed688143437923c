"""Weight-streaming decode GEMM (``mainloop=stream``): one kernel for sm_90a and sm_120a.

``D^T[N, M] = B[N, K] @ A[M, K]^T`` for small M (decode), with B the fragment-order packed
NVFP4 weight (:mod:`cute_fp4.packed`) and A 16-bit activations. At decode a GEMM's time is
the time to read the weight, so this kernel is built to keep the memory system full:

* no producer warp and no barrier: every warp streams its own bytes. A CTA is four warps
  over one 64-row block of the packed weight; warp ``w`` owns rows ``16 w .. 16 w + 15``,
  whose 64-element K unit is 512 contiguous bytes (one 16-byte copy per lane, coalesced)
  and, for each of its two rows per lane (``g``, ``g + 8``), one 32-bit word of four
  UE4M3 scales (each read once per 16 elements);
* the copies are ``cp.async`` into a ring of two batches of ``stages`` K units per warp in
  shared memory: the warp issues batch ``b + 1``, waits for batch ``b`` (its own copies:
  ``cp.async.wait_group 1``, no barrier, since a lane reads back only the bytes it copied)
  and decodes it while ``b + 1`` is in flight. Between one and two batches (``stages`` x
  512 bytes each) are in flight per warp at all times, whatever ptxas makes of the
  registers (plain loads into registers were sunk next to their uses by ptxas: about one
  unit in flight per warp);
* the weight is decoded in registers by the register-sourced SM90 kernel's exact decode
  (``sm90_rs_wide.decode_fragment``: PRMT table lookups and one 16-bit multiply by the
  scale per pair of elements) into the A fragment of warp-level ``mma.sync.m16n8k16``
  (the WGMMA register fragment and the ``mma.sync`` one are the same per warp, which is why
  the packed layout serves both); the activation pairs of the B fragment come from global
  memory (L1-resident: every warp of the grid reads the same few kilobytes). Rows of an
  activation tile past M read row M - 1; their columns of D are never stored;
* K is split over ``split_k`` CTAs per output tile (``kernels/scheduler.py``: balanced
  ranges of 64-element units), and the partials are reduced in the kernel, in split order,
  by the last CTA of a tile to arrive (``epilogue.store_split_k``: the same bits on every
  run, no second kernel).

What differs per target is only the code ptxas makes of the same PTX: ``mma.sync`` BF16/FP16
(HMMA), PRMT, LOP3 and the 16-bit multiply exist on sm_90a and sm_120a alike.

Constraints:
* W4A16 only (16-bit A, BF16 or FP16; the MMA runs A's type); B the fragment-order packed
  weight, K a multiple of 64, rows padded to 64 (``cute_fp4.packed``); N a multiple of 8.
* Tile: 64 weight rows x ``tile.m`` (8 or 16) activation rows x one 64-element K unit;
  four warps; 1 <= ``stages`` (K units in flight per warp) <= 8.
* Scale factors: UE4M3 (sign bit ignored) in the 128x4 blocked layout.
* One CTA per (64 rows, activation tile, split): not persistent, not grouped.
"""


from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass.cute.nvgpu import cpasync

from cute_fp4.kernels import roles
from cute_fp4.kernels.epilogue import store_direct, store_split_k
from cute_fp4.kernels.launch import GemmLaunch, GemmTensors, PointerTypes, out_dtype
from cute_fp4.kernels.scheduler import TileScheduler
from cute_fp4.kernels.sm90_rs_wide import decode_fragment, decode_tables, scale_halves
from cute_fp4.packed import UNIT_BYTES, UNIT_K, UNIT_ROWS
from cute_fp4.plan import plan
from cute_fp4.planning.stream import RING, WARPS
from cute_fp4.schedule import Problem, Schedule

LANE_WORDS = 4  # 32-bit weight words per lane and K unit (16 bytes: four K blocks of 16)
WARP_WORDS = 32 * LANE_WORDS  # one warp's 16 rows of a unit
UNIT_WORDS = UNIT_BYTES // 4
SF_ATOM_WORDS = 128  # a 512-byte scale atom (128 rows x 4 K blocks) in 32-bit words


def scale_word_index(row, ku, k_units):
    """Index in 32-bit words, in the blocked scales, of the four UE4M3 scales of weight row
    ``row`` for K unit ``ku`` (``k_units`` units per row). Plain integer arithmetic: the
    kernel and the CPU tests run it."""
    return ((row // 128) * k_units + ku) * SF_ATOM_WORDS + (row % 32) * 4 + (row % 128) // 32


def weight_word_index(row_block, ku, k_units, warp, lane):
    """Index in 32-bit words of lane ``lane``'s first word of warp ``warp``'s 16 rows of
    the packed unit (``row_block``, ``ku``): four consecutive words, K blocks 0..3."""
    return (row_block * k_units + ku) * UNIT_WORDS + warp * WARP_WORDS + lane * LANE_WORDS


class StreamParams(NamedTuple):
    """Kernel arguments."""

    mA32: cute.Tensor  # activations [M, K] as 32-bit words (pairs of 16-bit values)
    mQ: cute.Tensor  # the packed weight as flat 32-bit words
    mS: cute.Tensor  # B's blocked scales as flat 32-bit words
    gD: cute.Tensor  # D^T: (N, M, 1)
    mAlpha: cute.Tensor
    units: TileScheduler  # (row blocks, activation tiles, 64-element K units, split_k)
    m: cutlass.Int32
    n: cutlass.Int32
    mWork: cute.Tensor  # split-K workspace: FP32 partials (without split-K: unused)
    mCount: cute.Tensor  # split-K header and arrival counters (without: unused)


class StreamGemm(GemmLaunch):
    """W4A16 decode GEMM on the packed weight (``mainloop=stream``), sm_90a and sm_120a."""

    def __init__(self, schedule: Schedule, problem: Problem):
        pl = plan(schedule, problem).raise_if_invalid()
        self.schedule, self.problem = schedule, problem
        self.tile_m = schedule.tile.m
        self.n_blocks = self.tile_m // 8  # m16n8k16 N blocks per activation tile
        self.batch = pl.stages  # K units per batch of a warp's ring
        self.w4a16 = True
        self.mma_dtype = cutlass.BFloat16 if problem.a_format == "bf16" else cutlass.Float16
        self.split_k = schedule.split_k
        self.out_dtype = out_dtype(schedule)
        self.sm_count = schedule.arch.sm_count
        self.threads = pl.threads
        self.plan_smem_bytes = pl.smem_bytes
        self.smem_bytes = None  # set while tracing
        # split-K: one counter per output tile and thread; 4 FP32 values per N block
        self.split_slots = self.threads
        self.split_values = 4 * self.n_blocks
        self.ptr_types = PointerTypes(self.mma_dtype, self.out_dtype)

    def _setup(self):
        """The rings' shared storage: per warp, ``RING`` batches of ``batch`` units of 32
        lanes x (4 weight words) and x (2 scale words)."""
        ring = (LANE_WORDS, 32, self.batch, RING, WARPS)
        self.sQ_layout = cute.make_layout(ring)
        self.sS_layout = cute.make_layout((2, 32, self.batch, RING, WARPS))

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
        return cute.make_tiled_mma(op, (WARPS, 1, 1))

    # ------------------------------------------------------------------ host launcher
    @cute.jit
    def _launch(self, t: GemmTensors, max_ctas: cutlass.Int32, stream):
        self._setup()
        m, n = t.mD.shape[0], t.mD.shape[1]
        half_k = t.mB.shape[1]
        k_units = half_k // (UNIT_K // 2)
        rows = (n + UNIT_ROWS - 1) // UNIT_ROWS * UNIT_ROWS
        mQ = cute.make_tensor(cute.recast_ptr(t.mB.iterator, dtype=cutlass.Uint32),
                              cute.make_layout(rows * k_units * UNIT_WORDS))
        mS = cute.make_tensor(cute.recast_ptr(t.mSFB.iterator, dtype=cutlass.Uint32),
                              cute.make_layout(cute.size(t.mSFB) // 4))
        ld_a = cute.assume(cutlass.Int64(half_k), divby=16)
        mA32 = cute.make_tensor(cute.recast_ptr(t.mA.iterator, dtype=cutlass.Uint32),
                                cute.make_layout((m, half_k), stride=(ld_a, 1)))
        gD = cute.make_tensor(t.mD.iterator, cute.make_layout(
            (n, m, 1), stride=(1, t.mD.stride[0], t.mD.stride[2])))
        units = TileScheduler.create(n, m, half_k * 2, (UNIT_ROWS, self.tile_m, UNIT_K),
                                     self.split_k)
        params = StreamParams(mA32, mQ, mS, gD, t.mAlpha, units, m, n, t.mWork, t.mCount)
        self.kernel(params).launch(grid=[units.total, 1, 1], block=[self.threads, 1, 1],
                                   smem=self.smem_bytes, stream=stream, use_pdl=roles.PDL)

    # ------------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(self, p: StreamParams):
        self._setup()
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(self.sQ_layout)[(None, lane, None, None, warp)]
        sS = storage.sS.get_tensor(self.sS_layout)[(None, lane, None, None, warp)]
        tiled_mma = self._tiled_mma()
        thr_mma = tiled_mma.get_slice(tidx)
        tm = self.tile_m
        frA = tiled_mma.make_fragment_A(
            thr_mma.partition_A(cute.make_identity_tensor((UNIT_ROWS, 16))).shape)
        frB = tiled_mma.make_fragment_B(
            thr_mma.partition_B(cute.make_identity_tensor((tm, 16))).shape)
        gD_t = cute.local_tile(p.gD, (UNIT_ROWS, tm), (None, None, None))
        acc = cute.make_rmem_tensor(
            thr_mma.partition_C(gD_t[(None, None, 0, 0, 0)]).shape, cutlass.Float32)
        acc.fill(0.0)
        tables = decode_tables(self.mma_dtype is cutlass.BFloat16)
        w = p.units.coords(bid)
        k_units = p.units.k_tiles
        row = w.m * UNIT_ROWS + warp * 16 + lane // 4  # this lane's rows: row, row + 8
        a_rows = []  # the activation row of each N block (rows past M read row M - 1)
        for nb in cutlass.range_constexpr(self.n_blocks):
            a_rows.append(cutlass.min(w.n * tm + nb * 8 + lane // 4, p.m - 1))
        ring = (p, sQ, sS, w, k_units, warp, lane, row)
        roles.wait_for_inputs()
        n_batches = (w.k_count + self.batch - 1) // self.batch
        self._issue(ring, 0)
        for b in cutlass.range(n_batches, unroll=1):
            if b + 1 < n_batches:
                self._issue(ring, b + 1)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(1)
            for i in cutlass.range_constexpr(self.batch):
                if b * self.batch + i < w.k_count:
                    self._unit(ring, b % RING, i, w.k_begin + b * self.batch + i, a_rows,
                               tables, tiled_mma, frA, frB, acc)
        self._store(p, thr_mma, acc, gD_t, w, bid, tidx)

    @cute.jit
    def _issue(self, ring, b):
        """cp.async of batch ``b`` of this warp's units (the weight words and both rows'
        scale words of each unit of the split that exists) into ring slot ``b % RING``."""
        p, sQ, sS, w, k_units, warp, lane, row = ring
        q_atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cutlass.Uint32,
            num_bits_per_copy=128)
        s_atom = cute.make_copy_atom(cpasync.CopyG2SOp(), cutlass.Uint32, num_bits_per_copy=32)
        for i in cutlass.range_constexpr(self.batch):
            if b * self.batch + i < w.k_count:
                ku = w.k_begin + b * self.batch + i
                at = cute.assume(weight_word_index(w.m, ku, k_units, warp, lane),
                                 divby=LANE_WORDS)
                cute.copy(q_atom, cute.make_tensor(p.mQ.iterator + at,
                                                   cute.make_layout(LANE_WORDS)),
                          sQ[(None, i, b % RING)])
                for h in cutlass.range_constexpr(2):
                    src = cute.make_tensor(
                        p.mS.iterator + scale_word_index(row + 8 * h, ku, k_units),
                        cute.make_layout(1))
                    dst = cute.make_tensor(sS[(None, i, b % RING)].iterator + h,
                                           cute.make_layout(1))
                    cute.copy(s_atom, src, dst)
        if b == 0:
            cute.arch.cp_async_commit_group()

    @cute.jit
    def _unit(self, ring, slot, i, ku, a_rows, tables, tiled_mma, frA, frB, acc):
        """One K unit (ring ``slot``, position ``i``): four K blocks of 16, each decoded into
        the A fragment and multiplied with the activation pairs of every N block."""
        p, sQ, sS, w, k_units, warp, lane, row = ring
        bf16 = self.mma_dtype is cutlass.BFloat16
        q = cute.make_rmem_tensor((LANE_WORDS,), cutlass.Uint32)
        cute.autovec_copy(sQ[(None, i, slot)], q)
        sw = cute.make_rmem_tensor((2,), cutlass.Uint32)
        cute.autovec_copy(sS[(None, i, slot)], sw)
        halves = [[scale_halves(sw[h], bool(odd), bf16) for odd in (0, 1)] for h in (0, 1)]
        a32 = cute.recast_tensor(frA, cutlass.Uint32)
        b32 = cute.recast_tensor(frB, cutlass.Uint32)
        c = lane % 4
        for kb in cutlass.range_constexpr(4):
            col = ku * (UNIT_K // 2) + kb * 8 + c  # the pair at K 16 kb + 2c of this unit
            for nb in cutlass.range_constexpr(self.n_blocks):
                b32[2 * nb] = p.mA32[a_rows[nb], col]
                b32[2 * nb + 1] = p.mA32[a_rows[nb], col + 4]
            o = decode_fragment(q[kb], halves[0][kb % 2], halves[1][kb % 2], kb, tables, bf16)
            for j in cutlass.range_constexpr(4):
                a32[j] = o[j]
            cute.gemm(tiled_mma, acc, frA, frB, acc)

    @cute.jit
    def _store(self, p: StreamParams, thr_mma, acc, gD_t, w, unit, tidx):
        """D^T tile (row block, activation tile) from registers, times alpha; split-K: this
        thread's partial, the tile's last split storing the sum."""
        tile = (UNIT_ROWS, self.tile_m)
        rows = p.n - w.m * UNIT_ROWS
        cols = p.m - w.n * self.tile_m
        dst = gD_t[(None, None, w.m, w.n, 0)]
        alpha = p.mAlpha[0]
        if cutlass.const_expr(self.split_k > 1):
            store_split_k(thr_mma, acc, alpha, p.mWork, p.mCount,
                          p.units.total // self.split_k, unit // self.split_k, tidx,
                          self.split_slots, w.split, self.split_k, dst, tile, rows, cols,
                          self.out_dtype)
        else:
            store_direct(thr_mma, acc, alpha, dst, tile, rows, cols, self.out_dtype)


__all__ = ["StreamGemm", "StreamParams", "scale_word_index", "weight_word_index"]
