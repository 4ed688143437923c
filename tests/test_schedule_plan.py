"""Schedules and plan(): construction, hashing, shared-memory accounting, refusals."""

from __future__ import annotations

import dataclasses

import pytest

from cute_fp4 import catalogue
from cute_fp4.errors import InputError, ScheduleError
from cute_fp4.plan import _align, max_stages, plan, smem_regions
from cute_fp4.schedule import (
    Epilogue,
    OutDtype,
    Problem,
    Raster,
    Schedule,
    SFLoad,
    Tile,
    WarpRoles,
)

CATALOGUE = catalogue.all_schedules()
REFUSED = {"sm100_style_256x128x256"}


def test_schedule_is_frozen_hashable_and_derivable():
    s = Schedule(tile=Tile(128, 128, 64))
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.stages = 2
    t = s.replace(roles=WarpRoles.PINGPONG, raster=Raster.ALONG_N, out_dtype="fp16",
                  epi_tile=(64, 32), tile=(128, 64, 128))
    assert t.warps.roles is WarpRoles.PINGPONG and t.scheduler.raster is Raster.ALONG_N
    assert t.epilogue == Epilogue(OutDtype.FP16, (64, 32)) and t.tile == Tile(128, 64, 128)
    assert len({s, t, s.replace(name="other")}) == 2  # names take no part in equality
    assert s.key() == Schedule(tile=Tile(128, 128, 64), name="x").key() != t.key()


@pytest.mark.parametrize("bad", [
    lambda: Tile(0, 128, 128), lambda: Schedule(stages=0), lambda: Schedule(split_k=-1),
    lambda: Schedule(target="sm_75"), lambda: Schedule(tile=(128, 128, 128)),
    lambda: Epilogue(tile=(64,)), lambda: Problem(k=-1), lambda: Problem(a_format="int4"),
])
def test_bad_schedules_raise_typed_errors(bad):
    with pytest.raises(InputError):
        bad()


def test_target_aliases():
    assert Schedule(target="sm120").target == "sm_120a"
    assert Schedule(target="121").target == "sm_121a"
    assert Schedule(target="sm_90a").arch.smem_per_block == 232_448


def least_stages(s) -> int:
    """The fewest stages a catalogue schedule may plan: a pipeline of two; the stream
    kernel's ring is two batches of ``stages`` K units (planning/stream.py: RING), so one
    unit per batch double-buffers."""
    return 1 if s.mainloop.value == "stream" else 2


@pytest.mark.parametrize("s", CATALOGUE, ids=lambda s: s.name)
def test_catalogue_plans(s):
    p = plan(s)
    if s.name in REFUSED:
        assert not p.ok
        return
    assert p.ok, p.reasons
    assert p.stages >= least_stages(s), f"{s.name}: {p.stages} stage(s)"
    assert p.smem_bytes <= s.arch.smem_per_block
    assert p.smem_bytes == sum(_align(r.bytes) for r in p.regions)
    # auto is maximal (one more stage would not fit), except the stream kernel's, whose
    # stages are the batch of K units a warp's ring holds (planning/stream.py)
    if s.stages is None and s.mainloop.value != "stream":
        more = sum(_align(r.bytes) for r in smem_regions(s, p.problem, p.stages + 1))
        assert more > s.arch.smem_per_block
    assert s.doc, f"{s.name} has no docstring saying what it changes and why"


def test_catalogue_has_ten_sm120_schedules_and_sm90_ones():
    assert len([s for s in catalogue.all_schedules("sm120") if s.name not in REFUSED]) >= 10


@pytest.mark.parametrize("tile, epi, smem, stages", [
    ((128, 128, 128), None, 89_088, 3),  # matches the compiled reference point (notes)
    ((128, 128, 128), (64, 32), 91_136, 4),
    ((128, 128, 64), None, 99_328, 7),
    ((128, 128, 256), (64, 32), 91_136, 2),
])
def test_sm120_accounting_reference_points(tile, epi, smem, stages):
    p = plan(Schedule(tile=Tile(*tile), epilogue=Epilogue(tile=epi)))
    assert (p.smem_bytes, p.stages) == (smem, stages)


def test_single_stage_trap_warns():
    p = plan(Schedule(tile=Tile(128, 128, 256)))
    assert p.ok and p.stages == 1
    assert any("single stage" in w and "64x32" in w for w in p.warnings)


def test_oversize_schedule_refused_with_numbers():
    p = plan(catalogue.get("sm100_style_256x128x256"))
    text = " ".join(p.reasons)
    assert "121,856 B" in text and "101,376 B" in text and "sm_120a" in text
    with pytest.raises(ScheduleError) as e:
        p.raise_if_invalid()
    assert e.value.reasons == p.reasons


def test_too_many_explicit_stages_suggests_fixes():
    p = plan(Schedule(stages=4))
    assert not p.ok
    assert p.reasons[0] == ("needs 107,520 B of shared memory per block for 4 stages; "
                            "sm_120a allows 101,376 B: use stages <= 3 or a 64x32 epilogue "
                            "tile (4 stages fit)")


def test_one_tile_two_budgets():
    # the same tile and epilogue: Hopper's 227 KiB hold more stages than SM120's 99 KiB
    s120 = Schedule(tile=Tile(128, 128, 64), epilogue=Epilogue(tile=(64, 32)))
    s90 = s120.replace(target="sm_90a", mma=(2, 1))
    assert max_stages(s90, Problem()) > 0 and plan(s90).smem_limit == 232_448
    assert plan(s120).smem_limit == 101_376


@pytest.mark.parametrize("problem, needle", [
    (Problem(8, 64, 48), "K = 48 is not a multiple of 32"),
    (Problem(8, 60, 64), "N = 60 is not a multiple of 8"),
    (Problem(8, 64, 64, "bf16"), "W4A16 (16-bit A) is not implemented for SM120"),
])
def test_problem_checks(problem, needle):
    p = plan(Schedule(), problem)
    assert any(needle in r for r in p.reasons), p.reasons


def test_split_k_beyond_k_tiles_refused():
    p = plan(Schedule(split_k=8), Problem(1, 64, 512))
    assert any("split_k 8 exceeds the 4 K tiles" in r for r in p.reasons)


def test_tile_checks():
    assert not plan(Schedule(tile=Tile(128, 128, 96))).ok
    assert not plan(Schedule(tile=Tile(96, 128, 128))).ok
    assert not plan(Schedule(epilogue=Epilogue(tile=(48, 32)))).ok


def test_sf_load_and_roles_are_fields():
    base = catalogue.get("sm120_default")
    assert catalogue.get("sm120_sf_cp_async") == base.replace(sf_load=SFLoad.CP_ASYNC)


def test_swap_ab_plan_accounting_and_checks():
    s = catalogue.get("sm90_decode_swapab")
    assert s.swap_ab and "swap_ab" in s.label() and "swap_ab" in s.key()
    # schedules without swap-AB keep their key (and compile-cache entries)
    assert "swap_ab" not in catalogue.get("sm90_decode").key()
    for fmt in ("nvfp4", "bf16"):
        p = Problem(a_format=fmt)
        pl = plan(s, p)
        assert pl.ok and pl.stages >= 8, pl.summary()
        names = [r.name for r in pl.regions]
        assert "B16" not in names and names[-2:] == ["A16", "C"]
        a16 = dict((r.name, r.bytes) for r in pl.regions)["A16"]
        assert a16 == 2 * s.warps.mma[1] * s.tile.m * s.tile.k * 2
        assert pl.smem_bytes == sum(_align(r.bytes) for r in pl.regions) <= pl.smem_limit
    for bad, needle in [(s.replace(tile=(16, 128, 256)), "Mx64x256"),
                        (s.replace(tile=(24, 64, 256)), "Mx64x256"),
                        (s.replace(tile=(16, 64, 128)), "Mx64x256"),
                        (s.replace(mma=(2, 1)), "Warps.mma = (1, W)"),
                        (dataclasses.replace(s, target="sm_120a"), "sm_90a only")]:
        pl = plan(bad)
        assert not pl.ok and any(needle in r for r in pl.reasons), pl.reasons


def test_sm90_heuristic_picks_swap_ab_for_small_m():
    from cute_fp4.api import heuristic

    for m, tm in ((1, 8), (7, 8), (16, 16), (32, 32)):
        s = heuristic("sm90", m, 8192, 8192)
        assert s.swap_ab and s.tile.m == tm and s.split_k == 1 and plan(s).ok
    assert heuristic("sm90", 1, 4096, 14336).split_k == 2
    assert heuristic("sm90", 1, 6144, 4096).split_k == 1
    assert not heuristic("sm90", 64, 8192, 8192).swap_ab
    assert not heuristic("sm90", 4096, 8192, 8192).swap_ab
    # split-K fills the SMs where the weight has few tiles (measured on H200, M = 1)
    assert heuristic("sm90", 1, 1024, 4096).split_k == 4
    assert heuristic("sm90", 1, 4096, 4096).split_k == 2


def test_decode_split_cost_model():
    from cute_fp4.api import DECODE_MIN_K_TILES, decode_split, heuristic

    # one wave of 128 units of 16 K tiles beats 32 units of 64 K tiles, and a second wave
    # of units beats nothing: the busiest CTA's K tiles plus a unit's overhead decide
    assert decode_split(32, 64, 132)[1] == 4
    assert decode_split(112, 32, 132)[1] == 1  # 7 waves of 4 K tiles cost more than 1 of 32
    for tiles, k_tiles in ((1, 4), (8, 32), (500, 7)):
        _, split, _ = decode_split(tiles, k_tiles, 132)
        assert split == 1 or k_tiles // split >= DECODE_MIN_K_TILES
    # the rs_packed decode schedule (M 9..16 on a packed weight; M <= 8 streams)
    picks = {(n, k): heuristic("sm90", 16, n, k, packed=True)
             for n, k in ((8192, 8192), (28672, 4096), (1024, 4096))}
    assert picks[8192, 8192].tile.n == 128 and picks[8192, 8192].split_k == 2
    assert picks[28672, 4096].tile.n == 256 and picks[28672, 4096].split_k == 1
    assert picks[1024, 4096].split_k == 8
    assert all(plan(s, (16, n, k, "bf16")).ok for (n, k), s in picks.items())
    assert heuristic("sm90", 8, 8192, 8192, packed=True).mainloop.value == "stream"
