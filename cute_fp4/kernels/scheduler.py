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

Grouped (MoE) GEMMs use the same protocol (``prepare``, ``total``, ``coords(unit)``,
``first_unit``) through :class:`GroupedScheduler`: group ``g`` owns rows
``lo(g) .. hi(g)`` of A and D, from a device offset table (no host sync) clamped to the
``m_total`` rows there are (:func:`group_rows`), cut into ``ceil(rows / tile_m)`` row tiles
times ``tiles_n`` column tiles; the group index is ``WorkTile.l`` and the tile's first row
and valid row count are ``WorkTile.row0`` / ``WorkTile.rows``. The kernels only ever read a
``WorkTile``, so whatever the offsets hold (past the end, negative, decreasing), no unit
reads a row of A or writes a row of D outside ``0 .. m_total``.

``unit_coords`` is plain integer arithmetic, so the kernels (DSL integers) and the CPU
tests (Python ints) run the very same function.

The protocol every scheduler follows is :class:`UnitScheduler`; the one persistent loop of
every kernel is :func:`for_each_unit` (a kernel never writes ``while unit < total``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol, TypeVar, Union

import cutlass
import cutlass.cute as cute
from cutlass.cutlass_dsl import extract_mlir_values, new_from_mlir_values

from cute_fp4.planning.common import MAX_GROUPS

# An index of a work tile: a DSL integer in a kernel, a Python int in the CPU tests (the
# same functions compute both).
Index = Union[cutlass.Int32, int]  # noqa: UP007 - a runtime alias of DSL classes


class WorkTile(NamedTuple):
    """One work unit: output tile (``m``, ``n``) of problem ``l``, split ``split``, and its
    K tiles ``[k_begin, k_begin + k_count)``. Grouped GEMMs also give the tile's first row
    in A and D (``row0``) and how many of its rows belong to group ``l`` (``rows``); a
    dense scheduler leaves them None."""

    m: Index
    n: Index
    l: Index  # noqa: E741 - the batch / group mode, CuTe's L
    split: Index
    k_begin: Index
    k_count: Index
    row0: Index | None = None
    rows: Index | None = None


class UnitScheduler(Protocol):
    """What a kernel reads of a scheduler (:class:`TileScheduler`, :class:`GroupedScheduler`).

    Host side: ``grid(persistent, max_ctas)`` CTAs. Device side: ``prepare(offsets)`` once
    (a scheduler that needs no setup returns itself), then ``total`` units, numbered
    ``0 .. total``, walked from ``first_unit()`` by its stride (:func:`for_each_unit`), each
    read as a :class:`WorkTile` by ``coords(unit)``. ``split_k`` splits per output tile
    (adjacent units), ``k_tiles`` K tiles per tile."""

    total: Index
    split_k: int
    k_tiles: Index

    def grid(self, persistent: bool, max_ctas: Index) -> Index: ...

    def prepare(self, offsets=None) -> UnitScheduler: ...

    def coords(self, unit: Index) -> WorkTile: ...

    def first_unit(self) -> tuple[Index, Index]: ...


Carry = TypeVar("Carry")


@cute.jit
def for_each_unit(units: UnitScheduler, body: cutlass.Constexpr, carry):
    """The persistent loop of every kernel: ``carry = body(work_tile, unit, carry)`` for
    each unit of this CTA (``first_unit()``, then by the stride, while below ``total``);
    returns the last ``carry``. ``carry`` holds every DSL value the body changes from one
    unit to the next (pipeline states, counters): the body must return what it advanced,
    a value it only mutated in place would not leave the loop. ``body`` is traced inline:
    a ``cute.jit`` function or method bound to what it reads with ``functools.partial``
    (a nested closure with a DSL loop inside loses the closure's values when the DSL
    rewrites that loop, DSL 4.8.1). The carry's order is the loop's carried values'
    order, which ptxas' scheduling can depend on (the SM90 consumers keep their
    hand-written loops' (release, read) and their SASS)."""
    unit, nctas = units.first_unit()
    while unit < units.total:
        carry = body(units.coords(unit), unit, carry)
        unit += nctas
    return carry


def this_unit(units: UnitScheduler) -> tuple[Index, WorkTile]:
    """The one unit of a one-CTA-per-unit launch (``grid == total``): (unit, work tile)."""
    unit, _ = units.first_unit()
    return unit, units.coords(unit)


UnitBody = Callable[[WorkTile, Index, Carry], Carry]  # what for_each_unit calls


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

    def prepare(self, offsets=None) -> TileScheduler:
        """Device-side setup before the first ``coords`` (none for dense GEMMs)."""
        return self

    def coords(self, unit) -> WorkTile:
        return unit_coords(unit, self.tiles_m, self.tiles_n, self.k_tiles, self.split_k,
                           self.group_size, self.along_m, cutlass.min)

    @staticmethod
    def first_unit():
        """This CTA's first unit and the stride between its units (device side)."""
        bid, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()
        return bid, nctas


GROUPS_PER_LANE = MAX_GROUPS // 32  # tile-count prefixes each lane keeps in registers


def clamp_row(offset, m_total, minimum=min, maximum=max):
    """A group offset clamped to the rows there are: ``0 <= clamp_row <= m_total``."""
    return minimum(maximum(offset, 0), m_total)


def group_rows(lo_offset, hi_offset, m_total, minimum=min, maximum=max):
    """Group ``g``'s rows ``[lo, hi)`` from ``offsets[g]`` and ``offsets[g + 1]``: both
    clamped to ``[0, m_total]`` and ``hi >= lo`` (a decreasing offset gives an empty group),
    so that no offset table, however wrong, sends a unit outside A or D. A valid table
    (``0 = offsets[0] <= ... <= offsets[E] = m_total``) is unchanged. Five integer
    operations; the kernels (DSL integers) and the CPU tests (Python ints) run this
    function."""
    lo = clamp_row(lo_offset, m_total, minimum, maximum)
    return lo, maximum(clamp_row(hi_offset, m_total, minimum, maximum), lo)


def group_of_tile(t, prefix, lane_sum, lane_get, select, maximum=max):
    """Group of row tile ``t`` and that group's first row tile, from the inclusive prefix
    sums of row tiles per group, ``GROUPS_PER_LANE`` per lane (lane ``l`` holds groups
    ``8 l .. 8 l + 7``). The group is the number of prefixes <= ``t`` over the warp (an empty
    group repeats the prefix before it, so it is skipped); its first tile is the prefix of
    the group before it. ``lane_sum(x)``: ``x`` summed over the warp; ``lane_get(x, lane)``:
    lane ``lane``'s ``x``; ``select(p, a, b)``. Plain arithmetic over these, so the kernels
    (warp reductions and shuffles) and the CPU tests (arrays of 32 lanes) run this very
    function."""
    count = 0
    for v in prefix:
        count = count + select(v <= t, 1, 0)
    g = lane_sum(count)
    before = maximum(g - 1, 0)
    j = before % GROUPS_PER_LANE
    picked = prefix[0]
    for jj in range(1, GROUPS_PER_LANE):
        picked = select(j == jj, prefix[jj], picked)
    first = lane_get(picked, before // GROUPS_PER_LANE)
    return g, select(g > 0, first, 0)


def _select_i32(pred, a, b):
    return cutlass.select_(pred, cutlass.Int32(a), cutlass.Int32(b))


class GroupedScheduler:
    """Work units of a grouped GEMM (one GEMM per group, rows from a device offset table).

    Unit ``u``: row tile ``t = u // tiles_n`` of the groups' concatenated row tiles, column
    tile ``u % tiles_n`` (consecutive units share the activation rows). :meth:`prepare`
    (every warp, once, on the device) loads ``offsets`` and keeps each lane's eight
    inclusive prefix sums of row tiles per group in registers; :meth:`coords` then finds a
    unit's group with one warp reduction and one shuffle (no loop, no shared memory). Both
    take a group's rows through :func:`group_rows` (clamped to ``[0, m_total]``, never
    negative), so the unit count and every unit's rows stay inside A and D whatever the
    offsets hold. At most :data:`MAX_GROUPS` groups. The host cannot know the unit count
    without reading the offsets, so the grid is sized for the worst case of a valid table
    (every group adding a partial tile) and CTAs past the real count exit at once; an
    invalid table that counts more units (overlapping groups) is still walked to the end,
    every CTA striding by the grid.
    """

    def __init__(self, groups, tiles_n, k_tiles, tile_m: int, m_total, bound=None,
                 offsets=None, prefix=None, total=None):
        self.groups, self.tiles_n, self.k_tiles = groups, tiles_n, k_tiles
        self.tile_m, self.m_total, self.bound = tile_m, m_total, bound
        self.offsets, self.prefix, self.total = offsets, prefix, total
        self.split_k = 1

    # DSL protocol: four Int32 values into the kernel; a prepared scheduler (passed to
    # device functions) also carries its unit count, prefixes and the offsets tensor.
    def __extract_mlir_values__(self):
        vals = [cutlass.Int32(v).ir_value()
                for v in (self.groups, self.tiles_n, self.k_tiles, self.m_total)]
        if self.prefix is not None:
            vals += [cutlass.Int32(v).ir_value() for v in (self.total, *self.prefix)]
            vals += extract_mlir_values(self.offsets)
        return vals

    def __new_from_mlir_values__(self, values):
        base = [cutlass.Int32(v) for v in values[:3]]
        m_total = cutlass.Int32(values[3])
        if self.prefix is None:
            return type(self)(*base, self.tile_m, m_total)
        n = 5 + GROUPS_PER_LANE
        return type(self)(*base, self.tile_m, m_total, None,
                                new_from_mlir_values(self.offsets, values[n:]),
                                [cutlass.Int32(v) for v in values[5:n]],
                                cutlass.Int32(values[4]))

    @classmethod
    def create(cls, groups, m_total, n, k, tile_mnk) -> GroupedScheduler:
        """Scheduler of ``groups`` GEMMs over ``m_total`` rows, ``n x k`` each."""
        tm, tn, tk = tile_mnk
        tiles_n = (n + tn - 1) // tn
        bound = tiles_n * ((m_total + tm - 1) // tm + groups)
        return cls(groups, tiles_n, (k + tk - 1) // tk, tm, m_total, bound)

    def grid(self, persistent: bool, max_ctas):
        """CTAs to launch: enough for the worst case of unit counts (see the class doc)."""
        if cutlass.const_expr(persistent):
            return cutlass.min(self.bound, max_ctas)
        return self.bound

    def rows(self, lo_offset, hi_offset):
        """A group's rows ``[lo, hi)`` from its two offsets (:func:`group_rows`: clamped)."""
        return group_rows(lo_offset, hi_offset, self.m_total, cutlass.min, cutlass.max)

    def prepare(self, offsets) -> GroupedScheduler:
        """Every lane: its groups' inclusive prefix sums of row tiles, and the unit count."""
        lane = cute.arch.lane_idx()
        first = lane * GROUPS_PER_LANE
        prev = offsets[cutlass.min(first, self.groups)]
        run = cutlass.Int32(0)
        local = []
        for j in range(GROUPS_PER_LANE):
            nxt = offsets[cutlass.min(first + j + 1, self.groups)]
            lo, hi = self.rows(prev, nxt)
            run = run + (hi - lo + self.tile_m - 1) // self.tile_m
            local.append(run)
            prev = nxt
        scan = run
        for d in (1, 2, 4, 8, 16):
            up = cute.arch.shuffle_sync_up(scan, d)
            scan = scan + cutlass.select_(lane >= d, up, 0)
        base = scan - run
        total_tiles = cute.arch.shuffle_sync(scan, 31)
        return type(self)(self.groups, self.tiles_n, self.k_tiles, self.tile_m, self.m_total,
                          self.bound, offsets, [base + v for v in local],
                          total_tiles * self.tiles_n)

    def coords(self, unit) -> WorkTile:
        t = unit // self.tiles_n
        g, first = group_of_tile(
            t, self.prefix, lambda x: cute.arch.warp_redux_sync(cutlass.Int32(x), "add"),
            cute.arch.shuffle_sync, _select_i32, cutlass.max)
        mt = t - first
        lo, hi = self.rows(self.offsets[g], self.offsets[g + 1])
        row0 = lo + mt * self.tile_m
        return WorkTile(mt, unit - t * self.tiles_n, g, 0, 0, self.k_tiles, row0, hi - row0)

    first_unit = staticmethod(TileScheduler.first_unit)


__all__ = ["GROUPS_PER_LANE", "MAX_GROUPS", "GroupedScheduler", "Index", "TileScheduler",
           "UnitBody", "UnitScheduler", "WorkTile", "clamp_row", "for_each_unit",
           "group_of_tile", "group_rows", "this_unit", "unit_coords"]
