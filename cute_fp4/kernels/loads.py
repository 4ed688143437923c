"""Global -> shared loads shared by every kernel family: TMA of A and B, scale factors by TMA
or cp.async.

Scale factors. Both families keep a stage's scales exactly as the global 128x4 blocked
layout has them (:mod:`cute_fp4.formats`): per row atom (128 rows) and K tile, ``tile_k /
atom_k`` consecutive 512-byte atoms (``atom_k`` = 4 x the format's block: 64 K for NVFP4).
The global scale tensor is seen as bytes ``(16, 32, col_block, row_atom)`` and one stage as
``(16, 32, k_atoms, row_atoms)``, so a TMA box copies ``k_atoms x row_atoms`` whole atoms
(:func:`sf_tma_atom`), or the producer warp's 32 lanes copy the same bytes as 16-byte
cp.async chunks (:func:`load_sf_cp_async`).
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync

from cute_fp4.formats import SF_ATOM_BYTES, SF_ATOM_COLS, SF_ATOM_ROWS, sf_atom_offset, sf_offset
from cute_fp4.kernels.scheduler import UnitScheduler, WorkTile, for_each_unit

CHUNK = 16  # bytes per cp.async
WARP = 32


def sf_stage_layout(k_atoms: int, row_atoms: int, stages: int):
    """Byte layout ``(16, 32, k_atom, row_atom, stage)`` of staged scale factors."""
    return cute.make_layout((16, 32, k_atoms, row_atoms, stages))


def sf_global_view(mSF: cute.Tensor, rows, half_k, fmt) -> cute.Tensor:
    """Flat uint8 blocked scales of ``fmt`` -> ``(16, 32, col_block, row_atom)`` bytes;
    grouped scales ``(bytes, groups)`` -> ``(16, 32, col_block, row_atom, group)``."""
    n_cb = fmt.atom_cols(half_k)  # atom column groups (4 scale columns each)
    n_rb = (rows + 127) // 128
    shape = (16, 32, n_cb, n_rb)
    stride = (1, 16, SF_ATOM_BYTES, n_cb * SF_ATOM_BYTES)
    if cutlass.const_expr(cute.rank(mSF) == 2):
        shape, stride = (*shape, mSF.shape[1]), (*stride, mSF.stride[1])
    return cute.make_tensor(mSF.iterator, cute.make_layout(shape, stride=stride))


def sf_tma_atom(mSF_view: cute.Tensor, s_layout):
    """TMA load atom (and its global tensor) of one stage of ``s_layout`` scale atoms."""
    stage = cute.slice_(s_layout, (None, None, None, None, 0))
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mSF_view, stage,
                                       cute.shape(stage))


@cute.jit
def producer_loop(mainloop, stages: cutlass.Constexpr, units: UnitScheduler,
                  per_unit: cutlass.Constexpr, issue: cutlass.Constexpr):
    """The producer warp of every kernel: each K tile of each of this CTA's work units into
    the next stage of ``mainloop``. ``per_unit(work_tile)`` computes what the copies of a
    unit need (once per unit), ``issue(that, k_tile, stage, barrier)`` issues one stage's
    copies, arriving on ``barrier``."""
    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    state = for_each_unit(units, functools.partial(_produce_unit, mainloop, per_unit, issue),
                          state)
    mainloop.producer_tail(state)


@cute.jit
def _produce_unit(mainloop, per_unit: cutlass.Constexpr, issue: cutlass.Constexpr,
                  w: WorkTile, unit, state):
    """:func:`producer_loop`'s body: the K tiles of one unit; returns the advanced state."""
    u = per_unit(w)
    for kk in cutlass.range(w.k_count, unroll=1):
        mainloop.producer_acquire(state)
        bar = mainloop.producer_get_barrier(state)
        issue(u, w.k_begin + kk, state.index, bar)
        mainloop.producer_commit(state)
        state.advance()
    return state


@cute.jit
def tma_views(atom, sX, mX, tile):
    """TMA partitions of a tiled operand: ``(TMA, stage)`` in shared memory and
    ``(TMA, tile coordinates...)`` in global memory (``tile`` covers the leading modes)."""
    gX = cute.local_tile(mX, tile, (None,) * cute.rank(mX))
    n = cute.rank(tile)
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, n),
                                 cute.group_modes(gX, 0, n))


@cute.jit
def load_sf_cp_async(sf_bytes, sSF, stage, row_atom, k_tile, k_blocks, tile_k, lane,
                     fmt: cutlass.Constexpr):
    """One stage of scale factors of ``fmt`` (one 128-row atom, ``tile_k / atom_k`` atoms
    along K) by cp.async; ``k_blocks``: the scale tensor's atoms along K.

    In the blocked layout those bytes are one contiguous run of ``128 * tile_k / block``
    bytes, in the very order the stage keeps them, so each lane copies 16-byte chunks
    ``lane, lane + 32, ...``. Atoms past the end of the scale tensor re-read atom 0 of the
    row atom (finite scales; the matching A/B data are zero-filled by TMA).
    """
    per_block = SF_ATOM_BYTES // CHUNK  # 32 chunks per atom
    stage_bytes = SF_ATOM_ROWS * tile_k // fmt.block
    n_chunks = stage_bytes // CHUNK
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                               cutlass.Uint8, num_bits_per_copy=128)
    row_base = row_atom * k_blocks * SF_ATOM_BYTES
    s_base = stage * stage_bytes
    s_ptr = sSF.iterator
    for i in cutlass.range_constexpr(n_chunks // WARP):
        c = lane + i * WARP
        kb = k_tile * (tile_k // fmt.atom_k) + c // per_block
        kb = cutlass.select_(kb < k_blocks, kb, 0)
        src_off = cute.assume(row_base + kb * SF_ATOM_BYTES + (c % per_block) * CHUNK,
                              divby=CHUNK)
        dst_off = cute.assume(s_base + c * CHUNK, divby=CHUNK)
        src = cute.make_tensor(sf_bytes.iterator + src_off, cute.make_layout(CHUNK))
        dst = cute.make_tensor(s_ptr + dst_off, cute.make_layout(CHUNK))
        cute.copy(atom, src, dst)


@cute.jit
def load_sf_rows_cp_async(sf_bytes, sSF, stage, row0, m_rows, k_tile, k_blocks, tile_m,
                          tile_k, lane, fmt: cutlass.Constexpr):
    """One stage of scale factors of ``fmt`` of ``tile_m`` rows starting at any row ``row0``
    (grouped GEMMs: a group's rows start anywhere in the 128-row atoms), by 4-byte cp.async.

    A row's four scales of one atom column group (``atom_k`` elements of K) are 4
    contiguous bytes in the blocked layout; each goes to where a whole-atom copy would put
    tile row ``r`` (local rows ``0 .. tile_m``, atom ``j`` of the stage). Rows past
    ``m_rows`` re-read the last row and atoms past the end re-read atom 0 (finite scales
    for zero-filled data).
    """
    per_row = tile_k // fmt.atom_k  # atoms of 4 scales per stage and row
    n_chunks = tile_m * per_row
    row_atoms = (tile_m + SF_ATOM_ROWS - 1) // SF_ATOM_ROWS  # the stage's 128-row atoms
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(), cutlass.Uint8, num_bits_per_copy=32)
    s_base = stage * (per_row * row_atoms * SF_ATOM_BYTES)
    for i in cutlass.range_constexpr(n_chunks // WARP):
        c = lane + i * WARP
        r, j = c % tile_m, c // tile_m
        row = cutlass.min(row0 + r, m_rows - 1)
        kb = k_tile * per_row + j
        kb = cutlass.select_(kb < k_blocks, kb, 0)
        src_off = cute.assume(sf_offset(row, kb * SF_ATOM_COLS, k_blocks), divby=4)
        dst_off = cute.assume(
            s_base + (j + per_row * (r // SF_ATOM_ROWS)) * SF_ATOM_BYTES
            + sf_atom_offset(r % SF_ATOM_ROWS, 0), divby=4)
        src = cute.make_tensor(sf_bytes.iterator + src_off, cute.make_layout(4))
        dst = cute.make_tensor(sSF.iterator + dst_off, cute.make_layout(4))
        cute.copy(atom, src, dst)


__all__ = ["load_sf_cp_async", "load_sf_rows_cp_async", "producer_loop", "sf_global_view",
           "sf_stage_layout", "sf_tma_atom", "tma_views"]
