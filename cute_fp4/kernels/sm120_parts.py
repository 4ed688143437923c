"""Pieces of the SM120 GEMM (sm120.py): work units, scale loads by cp.async, turn barriers,
and the epilogue. Device-side helpers are plain functions called while tracing."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync, warp

from cute_fp4.kernels import sf_layout
from cute_fp4.schedule import OutDtype, Schedule

CHUNK = 16  # bytes per cp.async
WARP = 32


def c_dtype_of(schedule: Schedule):
    """Element type the kernel stores: the output dtype, or FP32 partials with split-K."""
    if schedule.split_k > 1:
        return cutlass.Float32
    return {OutDtype.BF16: cutlass.BFloat16, OutDtype.FP16: cutlass.Float16,
            OutDtype.FP32: cutlass.Float32}[schedule.epilogue.out_dtype]


class WorkUnits:
    """Output tiles x K splits, walked in grouped raster order.

    Unit ``u`` is split ``u % split_k`` of tile ``u // split_k``; tiles go ``group_size``
    at a time along the raster direction (M for ``along_m``), then step across. Split
    ``s`` owns K tiles ``[s * k_tiles // split_k, (s + 1) * k_tiles // split_k)``: never
    empty when ``split_k <= k_tiles`` (plan() checks it), zeros are stored otherwise.
    """

    def __init__(self, tiles_m, tiles_n, k_tiles, k_blocks, split_k=1, group_size=1,
                 along_m=True):
        self.tiles_m, self.tiles_n, self.k_tiles = tiles_m, tiles_n, k_tiles
        self.k_blocks = k_blocks  # 64-wide K blocks of the (padded) scale tensor
        self.split_k, self.group_size, self.along_m = split_k, group_size, along_m
        self.total = tiles_m * tiles_n * split_k

    def __extract_mlir_values__(self):
        return [cutlass.Int32(v).ir_value() for v in
                (self.tiles_m, self.tiles_n, self.k_tiles, self.k_blocks)]

    def __new_from_mlir_values__(self, values):
        return WorkUnits(*(cutlass.Int32(v) for v in values), self.split_k,
                         self.group_size, self.along_m)

    @staticmethod
    def create(m, n, k, tile_mnk, split_k):
        tm, tn, tk = tile_mnk
        return WorkUnits((m + tm - 1) // tm, (n + tn - 1) // tn, (k + tk - 1) // tk,
                         (k + 63) // 64, split_k)

    def coords(self, unit):
        """(tile m, tile n, split, first K tile, number of K tiles) of ``unit``."""
        return unit_coords(unit, self.tiles_m, self.tiles_n, self.k_tiles, self.split_k,
                           self.group_size, self.along_m, cutlass.min)


def unit_coords(unit, tiles_m, tiles_n, k_tiles, split_k, group_size, along_m, minimum=min):
    """Work unit -> (tile m, tile n, split, first K tile, K tiles); plain arithmetic, so the
    kernel (DSL integers, ``minimum=cutlass.min``) and CPU tests (ints) share it."""
    split = unit % split_k
    t = unit // split_k
    major, minor = (tiles_m, tiles_n) if along_m else (tiles_n, tiles_m)
    span = group_size * minor
    first = (t // span) * group_size
    rows = minimum(major - first, group_size)
    r = t % span
    a, b = first + r % rows, r // rows
    cm, cn = (a, b) if along_m else (b, a)
    k0 = split * k_tiles // split_k
    k1 = (split + 1) * k_tiles // split_k
    return cm, cn, split, k0, k1 - k0


# ----------------------------------------------------------------------------- producer

@cute.jit
def load_sf_cp_async(sf_bytes, sSF, stage, row_atom, k_tile, k_blocks, tile_k, lane):
    """One stage of scale factors (a 128-row atom, ``tile_k / 64`` K blocks) by cp.async.

    In the blocked layout those bytes are one contiguous run of ``tile_k * 8`` bytes, in
    the very order the stage keeps them, so each lane copies 16-byte chunks
    ``lane, lane + 32, ...``. K blocks past the end of the scale tensor re-read block 0 of
    the row atom (finite scales; the matching A/B data are zero-filled by TMA).
    """
    per_block = sf_layout.ATOM_BYTES // CHUNK  # 32 chunks per K block
    n_chunks = tile_k * 8 // CHUNK
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                               cutlass.Uint8, num_bits_per_copy=128)
    row_base = row_atom * k_blocks * sf_layout.ATOM_BYTES
    s_base = stage * (tile_k * 8)
    s_ptr = cute.recast_ptr(sSF.iterator, dtype=cutlass.Uint8)
    for i in cutlass.range_constexpr(n_chunks // WARP):
        c = lane + i * WARP
        kb = k_tile * (tile_k // 64) + c // per_block
        kb = cutlass.select_(kb < k_blocks, kb, 0)
        src_off = cute.assume(row_base + kb * sf_layout.ATOM_BYTES + (c % per_block) * CHUNK,
                              divby=CHUNK)
        dst_off = cute.assume(s_base + c * CHUNK, divby=CHUNK)
        src = cute.make_tensor(sf_bytes.iterator + src_off, cute.make_layout(CHUNK))
        dst = cute.make_tensor(s_ptr + dst_off, cute.make_layout(CHUNK))
        cute.copy(atom, src, dst)


# ----------------------------------------------------------------------------- pingpong

@cute.jit
def turn_wait(enabled, bars, group, turn, base):
    """Wait until this group may run its ``turn``-th mainloop (base 0) / epilogue (base 2).

    Group 0 starts first; group g then waits for the other group's matching arrival.
    """
    if cutlass.const_expr(enabled):
        if group == 0:
            if turn > 0:
                cute.arch.mbarrier_wait(bars + base, (turn - 1) % 2)
        else:
            cute.arch.mbarrier_wait(bars + base + 1, turn % 2)


@cute.jit
def turn_arrive(enabled, bars, group, base):
    """Hand the turn to the other group (every thread of this group arrives)."""
    if cutlass.const_expr(enabled):
        cute.arch.mbarrier_arrive(bars + base + 1 - group)


@cute.jit
def skip_stages(state, count):
    """Advance a consumer's pipeline state past ``count`` stages another group consumes."""
    for _ in cutlass.range(count, unroll=1):
        state.advance()
    return state


# ----------------------------------------------------------------------------- epilogue

def _r2s_copy(k):
    """Register -> shared copy of the accumulator, matching the tiled MMA's C layout.

    The tiler always comes from the 16-bit stmatrix atom: tiled from a one-value
    universal atom (FP32 output, split-K partials) the copy's (V, M, N) modes no longer
    line up with the accumulator's, and the epilogue would store the wrong elements.
    """
    tiler_atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 2), cutlass.BFloat16)
    if cutlass.const_expr(k.c_dtype.width == 16):
        atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 2), k.c_dtype)
    else:
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), k.c_dtype)
    return cute.make_tiled_copy_S(atom, cute.make_tiled_copy_C_atom(tiler_atom, k.tiled_mma))


@cute.jit
def epilogue_store(k, acc, sC, tma_c, gC, alpha, gtid, is_store_warp, group):
    """Accumulator -> (alpha, convert) -> shared memory -> TMA store, one epilogue tile at
    a time through ``k.epi_stages`` buffers; returns with every store read out of smem."""
    tm, tn, _ = k.tile_mnk
    em, en = k.epi_tile
    r2s = _r2s_copy(k)
    thr = r2s.get_slice(gtid)
    tRS_sC = thr.partition_D(sC)
    tRS_acc = r2s.retile(acc)
    rD_shape = cute.shape(thr.partition_S(sC))[:3]
    tRS_rD = cute.make_rmem_tensor(rD_shape, cutlass.Float32)
    tRS_out = cute.make_rmem_tensor(rD_shape, k.c_dtype)
    bSG_sC, bSG_gC = cpasync.tma_partition(
        tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2),
        cute.zipped_divide(gC, k.epi_tile))
    bar = pipeline.NamedBarrier(barrier_id=1 + group, num_threads=k.group_threads)
    scale = cutlass.Float32(1.0)
    if cutlass.const_expr(k.split_k == 1):
        scale = alpha[0]
    mma_m = tm // cute.size(tRS_acc, mode=[1])
    mma_n = tn // cute.size(tRS_acc, mode=[2])
    per_m, per_n = em // mma_m, en // mma_n
    rest_m, rest_n = tm // em, tn // en
    for epi_m in cutlass.range_constexpr(rest_m):
        for epi_n in cutlass.range_constexpr(rest_n):
            for j in cutlass.range_constexpr(per_n):
                for i in cutlass.range_constexpr(per_m):
                    src = tRS_acc[(None, epi_m * per_m + i, epi_n * per_n + j)]
                    dst = tRS_rD[(None, i, j)]
                    for e in cutlass.range_constexpr(cute.size(dst)):
                        dst[e] = src[e]
            tRS_out.store((tRS_rD.load() * scale).to(k.c_dtype))
            buf = (epi_m * rest_n + epi_n) % k.epi_stages
            bar.arrive_and_wait()
            cute.copy(r2s, tRS_out, tRS_sC[(None, None, None, buf)])
            cute.arch.fence_proxy("async.shared", space="cta")
            bar.arrive_and_wait()
            if is_store_warp:
                cute.copy(tma_c, bSG_sC[(None, buf)], bSG_gC[(None, (epi_m, epi_n))])
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(k.epi_stages - 1, read=True)
    if is_store_warp:
        cute.arch.cp_async_bulk_wait_group(0, read=True)
    bar.arrive_and_wait()
