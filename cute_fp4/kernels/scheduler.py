"""Work units: which output tile and which K range a CTA computes, for every kernel family.

A GEMM's work is ``tiles_m x tiles_n`` output tiles, each cut into ``split_k`` K ranges: one
*work unit* is one (tile, split). Every kernel walks units the same way: unit
``u = first_unit(), first_unit() + stride(), ...`` while ``u < total``. A one-CTA-per-unit
launch has ``grid = total`` (each CTA does exactly one unit); a persistent launch has
``grid = min(total, max_ctas)`` and each CTA strides through the list.

One split-K rule for all kernels: unit ``u`` is split ``u % split_k`` of tile
``u // split_k`` (splits of a tile are adjacent, so they run at the same time and their
partials land in the workspace together), and split ``s`` owns the K tiles
``[s * k_tiles // split_k, (s + 1) * k_tiles // split_k)``: balanced, never empty while
``split_k <= k_tiles``; an empty range stores a zero partial.

Tiles go ``group_size`` at a time along the raster direction (M for ``along_m``: consecutive
units share a column block of B), then step across; see :func:`unit_coords`.

The seam for grouped (MoE) GEMMs is :class:`WorkTile` plus the two-method protocol
``total`` / ``coords(unit)``: a grouped scheduler keeps a per-group problem table on the
device and returns the group index in ``WorkTile.l`` and tile coordinates inside that
group; the kernels only ever read a ``WorkTile``.

``unit_coords`` is plain integer arithmetic, so the kernels (DSL integers) and the CPU
tests (Python ints) run the very same function.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute


class WorkTile(NamedTuple):
    """One work unit: output tile (``m``, ``n``) of problem ``l``, split ``split``, and its
    K tiles ``[k_begin, k_begin + k_count)``."""

    m: object
    n: object
    l: object  # noqa: E741 - the batch / group mode, CuTe's L
    split: object
    k_begin: object
    k_count: object


def unit_coords(unit, tiles_m, tiles_n, k_tiles, split_k, group_size, along_m,
                minimum=min) -> WorkTile:
    """Work unit -> :class:`WorkTile` (``l`` = 0: one problem)."""
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
    return WorkTile(cm, cn, 0, split, k0, k1 - k0)


class TileScheduler:
    """Dense tile scheduler: output tiles x K splits in grouped raster order.

    Runtime sizes (``tiles_m``, ``tiles_n``, ``k_tiles``) travel into the kernel as DSL
    values; ``split_k``, ``group_size`` and ``along_m`` are static schedule choices.
    """

    def __init__(self, tiles_m, tiles_n, k_tiles, split_k: int = 1, group_size: int = 1,
                 along_m: bool = True):
        self.tiles_m, self.tiles_n, self.k_tiles = tiles_m, tiles_n, k_tiles
        self.split_k, self.group_size, self.along_m = split_k, group_size, along_m
        self.total = tiles_m * tiles_n * split_k

    # DSL protocol: the kernel receives the scheduler as three Int32 values.
    def __extract_mlir_values__(self):
        return [cutlass.Int32(v).ir_value() for v in (self.tiles_m, self.tiles_n, self.k_tiles)]

    def __new_from_mlir_values__(self, values):
        return TileScheduler(*(cutlass.Int32(v) for v in values), self.split_k,
                             self.group_size, self.along_m)

    @staticmethod
    def create(m, n, k, tile_mnk, split_k: int = 1, group_size: int = 1,
               along_m: bool = True) -> TileScheduler:
        """Scheduler for an ``m x n x k`` problem and a CTA tile ``tile_mnk``."""
        tm, tn, tk = tile_mnk
        return TileScheduler((m + tm - 1) // tm, (n + tn - 1) // tn, (k + tk - 1) // tk,
                             split_k, group_size, along_m)

    def grid(self, persistent: bool, max_ctas):
        """CTAs to launch: one per unit, or at most ``max_ctas`` persistent ones."""
        if cutlass.const_expr(persistent):
            return cutlass.min(self.total, max_ctas)
        return self.total

    def coords(self, unit) -> WorkTile:
        return unit_coords(unit, self.tiles_m, self.tiles_n, self.k_tiles, self.split_k,
                           self.group_size, self.along_m, cutlass.min)

    @staticmethod
    def first_unit():
        """This CTA's first unit and the stride between its units (device side)."""
        bid, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()
        return bid, nctas


__all__ = ["TileScheduler", "WorkTile", "unit_coords"]
