"""Epilogues shared by every kernel family: accumulator -> alpha -> fused op -> conversion ->
global memory, through shared memory and TMA, or straight from registers (masked).

Both stores take the FP32 accumulator of one output tile and a ``scale`` (alpha, times the
conversion offset of the SM90 mainloops; 1 for split-K partials, which the host scales),
then apply the schedule's fused operation (``op``, a traced function of a TensorSSA of FP32
values; None is the identity: the hook where activations and NVFP4 output with scales
attach), and convert to the stored element type.

* :class:`SmemEpilogue` (16-bit outputs, and SM120 FP32): the tile is cut into epilogue
  tiles; each is gathered from the accumulator, converted, copied register -> shared
  memory with the MMA's own C layout (``stmatrix`` for 16-bit types) into one of
  ``epi_stages`` buffers, and stored by one warp with a TMA bulk tensor store. Which
  accumulator values form which epilogue tile is derived from the layouts while tracing
  (:func:`subtile_sources`; a CPU trace checks every element's position for both
  families, tests/test_epilogue.py).
* :func:`store_direct`: every thread writes its accumulator values to global memory,
  masked against the problem's rows and columns; used for 32-bit results on SM90 and for
  the swap-AB kernel, whose ``gD`` is a transposed view (D^T).
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync


def subtile_sources(r2s, tiled_mma, tile_mn, epi_tile) -> list:
    """Which accumulator values make up each epilogue tile, in store order.

    Returns ``[((epi_m, epi_n), [(d, a), ...]), ...]``: value ``d`` (flat index) of the
    staged epilogue tile ``(epi_m, epi_n)`` is accumulator value ``a`` (flat index of the
    accumulator retiled to ``r2s``). Computed while tracing from thread 0's identity
    partitions (the indices are the same for every thread; the CPU trace,
    tests/test_epilogue.py, checks every thread of both families), so it holds for any
    MMA/copy layout: SM120's warp MMA keeps epilogue sub-tiles in the rest modes, SM90's
    WGMMA folds them into the value mode.
    """
    (tm, tn), (em, en) = tile_mn, epi_tile
    acc = r2s.retile(tiled_mma.get_slice(0).partition_C(cute.make_identity_tensor(tile_mn)))
    epi = r2s.get_slice(0).partition_S(cute.make_identity_tensor(epi_tile))
    where = {tuple(acc[i]): i for i in range(cute.size(acc))}
    plan = []
    for bm in range(tm // em):
        for bn in range(tn // en):
            coords = [(bm * em + epi[d][0], bn * en + epi[d][1]) for d in range(cute.size(epi))]
            missing = [c for c in coords if c not in where]
            if missing:
                raise AssertionError(f"epilogue tile ({bm}, {bn}): thread 0 holds no "
                                     f"accumulator value for {missing[:4]}")
            plan.append(((bm, bn), [(d, where[c]) for d, c in enumerate(coords)]))
    return plan


def _apply(op, values):
    return values if op is None else op(values)


class SmemEpilogue(NamedTuple):
    """Per-thread views of a register -> smem -> TMA epilogue (built by :func:`smem_epilogue`)."""

    plan: list  # subtile_sources(): accumulator values of each epilogue tile
    r2s: object  # tiled register -> shared copy
    tRS_sC: object  # (V, M, N, buffer) shared-memory destination of this thread
    tRS_acc: object  # accumulator retiled to the copy: (V, MMA rows, MMA cols)
    tRS_rD: object  # FP32 staging of one epilogue tile
    tRS_out: object  # converted epilogue tile


def smem_epilogue(r2s, tiled_mma, thread, sC, acc, c_dtype, tile_mn, epi_tile) -> SmemEpilogue:
    """Partitions of ``r2s`` (a tiled copy matching the MMA's C layout) for ``thread``."""
    thr = r2s.get_slice(thread)
    rD_shape = cute.shape(thr.partition_S(sC))[:3]
    return SmemEpilogue(subtile_sources(r2s, tiled_mma, tile_mn, epi_tile), r2s,
                        thr.partition_D(sC), r2s.retile(acc),
                        cute.make_rmem_tensor(rD_shape, cutlass.Float32),
                        cute.make_rmem_tensor(rD_shape, c_dtype))


@cute.jit
def store_smem_tma(e: SmemEpilogue, tma_c, gC_tile, sC, scale, epi_tile: cutlass.Constexpr,
                   epi_stages: cutlass.Constexpr,
                   bar: pipeline.NamedBarrier, is_store_warp, c_dtype: cutlass.Constexpr,
                   op: cutlass.Constexpr = None):
    """Store one output tile: epilogue tiles in row-major order through ``epi_stages``
    shared-memory buffers. Returns once every TMA store has read its buffer, so the next
    tile (or another MMA group sharing ``sC``) may overwrite them."""
    bSG_sC, bSG_gC = cpasync.tma_partition(
        tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2),
        cute.zipped_divide(gC_tile, epi_tile))
    for t in cutlass.range_constexpr(len(e.plan)):
        (epi_m, epi_n), pairs = e.plan[t]
        for q in cutlass.range_constexpr(len(pairs)):
            d, a = pairs[q]
            e.tRS_rD[d] = e.tRS_acc[a]
        e.tRS_out.store(_apply(op, e.tRS_rD.load() * scale).to(c_dtype))
        buf = t % epi_stages
        bar.arrive_and_wait()
        cute.copy(e.r2s, e.tRS_out, e.tRS_sC[(None, None, None, buf)])
        cute.arch.fence_proxy("async.shared", space="cta")
        bar.arrive_and_wait()
        if is_store_warp:
            cute.copy(tma_c, bSG_sC[(None, buf)], bSG_gC[(None, (epi_m, epi_n))])
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(epi_stages - 1, read=True)
    if is_store_warp:
        cute.arch.cp_async_bulk_wait_group(0, read=True)
    bar.arrive_and_wait()


@cute.jit
def store_direct(thr_mma, acc, scale, gD_tile, tile_shape: cutlass.Constexpr, rows, cols,
                 d_dtype: cutlass.Constexpr, op: cutlass.Constexpr = None):
    """Registers -> global memory: the values of this thread's accumulator that fall inside
    ``rows x cols`` (the tile's valid extent), scaled, ``op``-ed and converted."""
    tCcD = thr_mma.partition_C(cute.make_identity_tensor(tile_shape))
    tCgD = thr_mma.partition_C(gD_tile)
    vals = cute.make_rmem_tensor_like(acc, d_dtype)
    vals.store(_apply(op, acc.load() * scale).to(d_dtype))
    for i in cutlass.range_constexpr(cute.size(acc)):
        r, c = tCcD[i]
        if r < rows and c < cols:
            tCgD[i] = vals[i]


__all__ = ["SmemEpilogue", "smem_epilogue", "store_direct", "store_smem_tma",
           "subtile_sources"]
