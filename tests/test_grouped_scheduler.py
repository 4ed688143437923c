"""The grouped tile scheduler's arithmetic (kernels/scheduler.py) on the CPU: the very
``group_of_tile`` and ``group_rows`` the kernels run, with the warp's 32 lanes as arrays,
must enumerate every group's row tiles exactly once, in order, for the routings MoE layers
produce; and for offset tables that break the contract (past the end, negative, decreasing,
not starting at 0) every unit must stay inside the ``total_M`` rows of A and D."""

import random

import numpy as np
import pytest

from cute_fp4.kernels.scheduler import GROUPS_PER_LANE, group_of_tile, group_rows
from cute_fp4.planning.common import MAX_GROUPS

LANES = 32


def lane_prefix(offsets: list[int], tile_m: int, m_total: int | None = None
                ) -> list[np.ndarray]:
    """What ``GroupedScheduler.prepare`` leaves in each lane: inclusive prefix sums of row
    tiles per group (each group's rows from ``group_rows``), lane ``l`` holding groups
    ``8 l .. 8 l + 7`` (past the last group the prefix stays at the total)."""
    m_total = offsets[-1] if m_total is None else m_total
    groups = len(offsets) - 1
    tiles = []
    for g in range(groups):
        lo, hi = group_rows(offsets[g], offsets[g + 1], m_total)
        tiles.append(-(-(hi - lo) // tile_m))
    tiles += [0] * (MAX_GROUPS - groups)
    incl = np.cumsum(tiles)
    return [np.array([incl[lane * GROUPS_PER_LANE + j] for lane in range(LANES)])
            for j in range(GROUPS_PER_LANE)]


def coords(t: int, prefix: list[np.ndarray]) -> tuple[int, int]:
    g, first = group_of_tile(
        t, prefix, lambda x: np.full(LANES, int(np.sum(x))),
        lambda x, src: np.full(LANES, x[src[0]]), np.where, np.maximum)
    assert len(set(g.tolist())) == 1 and len(set(first.tolist())) == 1  # warp-uniform
    return int(g[0]), int(first[0])


def unit_rows(t: int, offsets: list[int], prefix, tile_m: int, m_total: int):
    """(group, first row, valid rows) of row tile ``t``, as ``GroupedScheduler.coords``."""
    g, first = coords(t, prefix)
    lo, hi = group_rows(offsets[g], offsets[g + 1], m_total)
    row0 = lo + (t - first) * tile_m
    return g, row0, hi - row0


def expected(offsets: list[int], tile_m: int) -> list[tuple[int, int]]:
    """(group, row tile inside the group) of every row tile, in order."""
    out = []
    for g in range(len(offsets) - 1):
        out += [(g, i) for i in range(-(-(offsets[g + 1] - offsets[g]) // tile_m))]
    return out


def offsets_of(counts: list[int]) -> list[int]:
    return [0, *np.cumsum(counts).tolist()]


ROUTINGS = {
    "ragged": [3, 0, 17, 128, 1, 0, 0, 255, 64],
    "empty_ends": [0, 5, 9, 0],
    "one_each": [1] * 128,
    "all_to_one": [0] * 100 + [4096] + [0] * 155,
    "single": [0] * 255 + [1],
    "max_groups": [7] * MAX_GROUPS,
}


@pytest.mark.parametrize("tile_m", [16, 64, 128])
@pytest.mark.parametrize("name", sorted(ROUTINGS))
def test_every_tile_once_in_order(name, tile_m):
    offs = offsets_of(ROUTINGS[name])
    prefix = lane_prefix(offs, tile_m)
    want = expected(offs, tile_m)
    got = []
    for t in range(len(want)):
        g, first = coords(t, prefix)
        got.append((g, t - first))
    assert got == want


def test_random_routings():
    rng = random.Random(3)
    for _ in range(50):
        groups = rng.randint(1, MAX_GROUPS)
        counts = [rng.choice([0, 0, 1, rng.randint(0, 300)]) for _ in range(groups)]
        offs = offsets_of(counts)
        tile_m = rng.choice([16, 32, 64, 128, 256])
        prefix = lane_prefix(offs, tile_m)
        want = expected(offs, tile_m)
        for t in rng.sample(range(len(want)), min(len(want), 40)) if want else []:
            g, first = coords(t, prefix)
            assert (g, t - first) == want[t]


def test_wrong_prefix_is_caught():
    """The check can fail: a prefix off by one tile maps a tile to the wrong group."""
    offs = offsets_of([3, 5, 2])
    prefix = lane_prefix(offs, 1)
    prefix[0] = prefix[0] + np.where(np.arange(LANES) == 0, 1, 0)
    got = [coords(t, prefix) for t in range(10)]
    assert [(g, t - f) for t, (g, f) in enumerate(got)] != expected(offs, 1)


# offset tables that break the contract (total_M = 300): what a router bug produces
BAD_OFFSETS = {
    "last_past_end": [0, 100, 200, 600],  # offsets[E] 300 rows past total_M
    "middle_past_end": [0, 100, 5000, 300],
    "negative": [0, 100, -50, 300],
    "first_negative": [-200, 100, 200, 300],
    "decreasing": [0, 250, 40, 300],
    "first_not_zero": [37, 100, 200, 300],
    "all_past_end": [400, 500, 600, 700],
    "int32_extremes": [-2**31, 2**31 - 1, -2**31, 2**31 - 1],
    "last_short": [0, 100, 200, 250],  # rows 250..300 written by no group (allowed)
}


@pytest.mark.parametrize("tile_m", [16, 64, 128])
@pytest.mark.parametrize("name", sorted(BAD_OFFSETS))
def test_bad_offsets_stay_inside_the_rows(name, tile_m):
    """Every unit of a bad table reads and writes only rows 0 .. total_M, each group's
    units cover its clamped range ``group_rows`` exactly once, and a group whose range is
    empty after the clamp has no unit."""
    m_total = 300
    offs = BAD_OFFSETS[name]
    prefix = lane_prefix(offs, tile_m, m_total)
    units = int(prefix[-1][-1])
    covered: dict[int, list[int]] = {}
    for t in range(units):
        g, row0, rows = unit_rows(t, offs, prefix, tile_m, m_total)
        assert 0 <= row0 < m_total and 0 < rows and row0 + min(rows, tile_m) <= m_total, \
            (name, t, g, row0, rows)
        covered.setdefault(g, []).extend(range(row0, row0 + min(rows, tile_m)))
    for g in range(len(offs) - 1):
        lo, hi = group_rows(offs[g], offs[g + 1], m_total)
        assert 0 <= lo <= hi <= m_total
        assert covered.get(g, []) == list(range(lo, hi)), (name, g)


def test_valid_offsets_are_unchanged_by_the_clamp():
    rng = random.Random(5)
    for _ in range(200):
        counts = [rng.choice([0, 1, rng.randint(0, 500)]) for _ in range(rng.randint(1, 20))]
        offs = offsets_of(counts)
        for g in range(len(counts)):
            assert group_rows(offs[g], offs[g + 1], offs[-1]) == (offs[g], offs[g + 1])


def test_the_bad_offset_check_can_fail():
    """Without the clamp (raw offsets), the same tables send units outside the rows."""
    offs, m_total, tile_m = BAD_OFFSETS["last_past_end"], 300, 64
    raw = [(offs[g], offs[g + 1]) for g in range(3)]
    assert any(hi > m_total for _, hi in raw)
    lo, hi = group_rows(*raw[2], m_total)
    assert (lo, hi) == (200, 300) and -(-(hi - lo) // tile_m) < -(-(raw[2][1] - lo) // tile_m)
