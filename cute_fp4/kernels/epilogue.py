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
  ``epi_stages`` buffers, and stored by one warp with a TMA bulk tensor store. The
  accumulator's rest modes are (V, MMA rows, MMA columns) in tile order, so epilogue tile
  (i, j) holds the MMA sub-tiles ``[i * per_m, (i + 1) * per_m) x [j * per_n, ...)``
  (a CPU trace checks every element's position for both families, tests/test_epilogue.py).
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


def _apply(op, values):
    return values if op is None else op(values)


class SmemEpilogue(NamedTuple):
    """Per-thread views of a register -> smem -> TMA epilogue (built by :func:`smem_epilogue`)."""

    r2s: object  # tiled register -> shared copy
    tRS_sC: object  # (V, M, N, buffer) shared-memory destination of this thread
    tRS_acc: object  # accumulator retiled to the copy: (V, MMA rows, MMA cols)
    tRS_rD: object  # FP32 staging of one epilogue tile
    tRS_out: object  # converted epilogue tile


def smem_epilogue(r2s, thread, sC, acc, c_dtype) -> SmemEpilogue:
    """Partitions of ``r2s`` (a tiled copy matching the MMA's C layout) for ``thread``."""
    thr = r2s.get_slice(thread)
    rD_shape = cute.shape(thr.partition_S(sC))[:3]
    return SmemEpilogue(r2s, thr.partition_D(sC), r2s.retile(acc),
                        cute.make_rmem_tensor(rD_shape, cutlass.Float32),
                        cute.make_rmem_tensor(rD_shape, c_dtype))


@cute.jit
def store_smem_tma(e: SmemEpilogue, tma_c, gC_tile, sC, scale, tile_mn: cutlass.Constexpr,
                   epi_tile: cutlass.Constexpr, epi_stages: cutlass.Constexpr,
                   bar: pipeline.NamedBarrier, is_store_warp, c_dtype: cutlass.Constexpr,
                   op: cutlass.Constexpr = None):
    """Store one output tile: epilogue tiles in row-major order through ``epi_stages``
    shared-memory buffers. Returns once every TMA store has read its buffer, so the next
    tile (or another MMA group sharing ``sC``) may overwrite them."""
    tm, tn = tile_mn
    em, en = epi_tile
    bSG_sC, bSG_gC = cpasync.tma_partition(
        tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2),
        cute.zipped_divide(gC_tile, epi_tile))
    per_m = em // (tm // cute.size(e.tRS_acc, mode=[1]))
    per_n = en // (tn // cute.size(e.tRS_acc, mode=[2]))
    rest_n = tn // en
    for epi_m in cutlass.range_constexpr(tm // em):
        for epi_n in cutlass.range_constexpr(rest_n):
            for j in cutlass.range_constexpr(per_n):
                for i in cutlass.range_constexpr(per_m):
                    src = e.tRS_acc[(None, epi_m * per_m + i, epi_n * per_n + j)]
                    dst = e.tRS_rD[(None, i, j)]
                    for v in cutlass.range_constexpr(cute.size(dst)):
                        dst[v] = src[v]
            e.tRS_out.store(_apply(op, e.tRS_rD.load() * scale).to(c_dtype))
            buf = (epi_m * rest_n + epi_n) % epi_stages
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


__all__ = ["SmemEpilogue", "smem_epilogue", "store_direct", "store_smem_tma"]
