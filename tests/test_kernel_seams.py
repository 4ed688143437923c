"""The seams every kernel shares, on the CPU: the persistent loop (``scheduler.for_each_unit``
run undecorated over Python ints), the pipeline arrive counts derived from the warp roles
and their trace-time check, the named pingpong turns.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cute_fp4.kernels import roles, scheduler
from cute_fp4.kernels.scheduler import WorkTile, this_unit, unit_coords
from cute_fp4.plan import plan
from cute_fp4.schedule import Schedule, WarpRoles, Warps


class _Units:
    """A dense scheduler over Python ints, seen from CTA ``bid`` of ``nctas``."""

    def __init__(self, tiles_m, tiles_n, k_tiles, split_k, bid, nctas):
        self.args = (tiles_m, tiles_n, k_tiles, split_k, 2, True)
        self.total = tiles_m * tiles_n * split_k
        self.split_k, self.k_tiles = split_k, k_tiles
        self.bid, self.nctas = bid, nctas

    def first_unit(self):
        return self.bid, self.nctas

    def coords(self, unit) -> WorkTile:
        return unit_coords(unit, *self.args)


def _undecorated(module, name):
    """``module.name`` as written, without its decorators (the source the DSL traces), so
    it runs on Python ints whatever the DSL did to the decorated function."""
    tree = ast.parse(Path(module.__file__).read_text())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    fn.decorator_list = []
    namespace = dict(vars(module))
    exec(compile(ast.Module([fn], type_ignores=[]), module.__file__, "exec"), namespace)
    return namespace[name]


@pytest.mark.parametrize("nctas", [1, 3, 7, 24, 40])
def test_for_each_unit_walks_every_unit_once_with_its_carry(nctas):
    loop = _undecorated(scheduler, "for_each_unit")
    seen = []
    for bid in range(nctas):
        units = _Units(3, 4, 5, 2, bid, nctas)

        def body(w, unit, carry):
            count, k_sum = carry
            seen.append((unit, w))
            return count + 1, k_sum + w.k_count

        count, k_sum = loop(units, body, (0, 0))
        mine = [u for u in range(bid, units.total, nctas)]
        assert count == len(mine)
        assert k_sum == sum(units.coords(u).k_count for u in mine)
    assert sorted(u for u, _ in seen) == list(range(24))
    tiles = {(w.m, w.n) for _, w in seen}
    assert tiles == {(m, n) for m in range(3) for n in range(4)}
    assert all(w == unit_coords(u, 3, 4, 5, 2, 2, True) for u, w in seen)


def test_this_unit_is_the_ctas_unit():
    units = _Units(2, 2, 4, 1, 3, 4)
    assert this_unit(units) == (3, units.coords(3))


def _layout(mma_warps, producer_warpgroup, threads, regs=None):
    return roles.WarpLayout(4 if producer_warpgroup else 1, mma_warps * 32, threads, regs)


@pytest.mark.parametrize("layout, groups, cp_async, want", [
    (_layout(8, False, 288), 1, False, (1, 8)),  # SM120 cooperative 2 x 4 MMA warps
    (_layout(8, False, 288), 1, True, (33, 8)),  # ... scales by cp.async (or grouped)
    (_layout(16, True, 640), 2, False, (1, 8)),  # SM120 pingpong: a group per stage
    (_layout(8, True, 384), 1, False, (1, 8)),  # SM90 two consumer warpgroups
    (_layout(8, True, 384), 2, False, (1, 4)),  # SM90 swap-AB: a warpgroup per stage
    (_layout(4, True, 256), 1, True, (33, 4)),  # SM90 grouped W4A4
])
def test_stage_arrivals_come_from_the_roles(layout, groups, cp_async, want):
    assert tuple(roles.stage_arrivals(layout, groups, cp_async)) == want


def test_a_hand_count_that_disagrees_with_the_roles_fails_at_trace_time():
    layout = _layout(8, False, 288)
    with pytest.raises(AssertionError, match=r"counts 4 arrivals per stage, the warp roles "
                                             r"give 8 \(8 consumer warps in 1 group"):
        roles.mainloop_pipeline(layout, 3, 1024, None, consumer_warps=4)
    with pytest.raises(AssertionError, match="8 consumer warps do not split into 3 groups"):
        roles.stage_arrivals(layout, 3)


def test_the_kernels_counts_agree_with_the_roles():
    """Each kernel's own count of the warps that release a stage (what its consumer code
    does) is what the roles derive, for the layouts plan() gives."""
    from cute_fp4.kernels.sm120 import Sm120Gemm

    for warps in (Warps(), Warps(roles=WarpRoles.PINGPONG, mma=(2, 4))):
        s = Schedule(warps=warps)
        assert plan(s).ok, plan(s).reasons
        k = Sm120Gemm(s)
        derived = roles.stage_arrivals(k.warps, k.groups, k.sf_cp_async)
        assert derived.consumer == k.group_warps
        assert roles.turn_arrivals(k.warps, k.groups, k.group_threads) == k.group_threads
    with pytest.raises(AssertionError, match="pingpong turn: the kernel counts 128 arrivals"):
        roles.turn_arrivals(_layout(16, True, 640), 2, 128)


def test_pingpong_turns_are_named_pairs():
    assert roles.Turn.MAINLOOP + 2 == roles.Turn.EPILOGUE
    assert roles.TURN_BARRIERS == 2 * len(roles.Turn)
