"""The grouped tile scheduler's arithmetic (kernels/scheduler.py) on the CPU: the very
``group_of_tile`` the kernels run, with the warp's 32 lanes as arrays, must enumerate every
group's row tiles exactly once, in order, for the routings MoE layers produce."""

import random

import numpy as np
import pytest

from cute_fp4.kernels.scheduler import GROUPS_PER_LANE, group_of_tile
from cute_fp4.planning.common import MAX_GROUPS

LANES = 32


def lane_prefix(offsets: list[int], tile_m: int) -> list[np.ndarray]:
    """What ``GroupedScheduler.prepare`` leaves in each lane: inclusive prefix sums of row
    tiles per group, lane ``l`` holding groups ``8 l .. 8 l + 7`` (past the last group the
    prefix stays at the total)."""
    groups = len(offsets) - 1
    tiles = [-(-(offsets[g + 1] - offsets[g]) // tile_m) for g in range(groups)]
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
