"""Planning per family: explicit target families, the driver's dispatch, every family's
refusals (each reason with its numbers), the register split, and the catalogue's accounting
pinned to the numbers it had before the rules were split per family."""

from __future__ import annotations

import dataclasses
import importlib
import inspect

import pytest

from cute_fp4 import catalogue, families
from cute_fp4.errors import InputError, ScheduleError
from cute_fp4.plan import RegisterSplit, plan, register_split
from cute_fp4.planning import sm90, sm120
from cute_fp4.schedule import Epilogue, Problem, Schedule, Tile, Warps
from cute_fp4.targets import TARGETS, Family, Target

DRIVER = importlib.import_module("cute_fp4.plan")  # the module (cute_fp4.plan is the function)
SM90 = Schedule(target="sm_90a", tile=Tile(128, 128, 128), warps=Warps(mma=(2, 1)))
SWAP = catalogue.get("sm90_decode_swapab")
SM120 = catalogue.get("sm120_default")


# ----------------------------------------------------------------------------- targets

def test_every_target_states_its_family():
    assert {t.name: t.family for t in TARGETS.values()} == {
        "sm_120a": Family.SM120, "sm_121a": Family.SM120, "sm_90a": Family.SM90}
    # a str enum: catalogue filters and device checks written with strings keep working
    assert Family.SM90 == "sm90" and f"{Family.SM120}" == "sm120"
    assert len(catalogue.all_schedules("sm90")) == len(catalogue.all_schedules(Family.SM90))


def test_unknown_capability_cannot_pass_for_another_family():
    sm100 = dict(name="sm_100a", cc=(10, 0), gpus=("B200",), sm_count=148,
                 smem_per_block=232_448, mma=TARGETS["sm_120a"].mma, sass_mma_prefix="X",
                 peak_tflops=1.0, mem_bw_gbs=1.0)
    with pytest.raises(InputError) as e:
        Target(family=Family.SM120, **sm100)
    assert str(e.value) == ("target sm_100a: compute capability 10.0 is not in family sm120; "
                            "families cover sm120 12.x, sm90 9.x, and no other capability "
                            "is planned")
    with pytest.raises(InputError, match="unknown family 'sm100'; known: sm120, sm90"):
        Target(family="sm100", **sm100)
    with pytest.raises(InputError, match="unknown target 'sm_100a'"):
        Schedule(target="sm_100a")


def test_a_family_without_rules_is_refused_not_planned(monkeypatch):
    monkeypatch.setattr(families, "FAMILIES", tuple(f for f in families.FAMILIES
                                                    if f.name != "sm90"))
    p = plan(SM90)
    assert not p.ok and p.stages == 0 and p.regions == ()
    assert p.reasons == ("sm_90a (compute capability 9.0, family sm90) has no planning "
                         "rules; kernel families: stream, sm120",)
    with pytest.raises(ScheduleError, match="has no planning rules"):
        DRIVER.smem_regions(SM90, Problem(), 2)
    assert plan(SM120).ok  # the other family is untouched


def test_driver_dispatches_and_never_names_a_family():
    assert {f.target_family for f in families.FAMILIES} >= {str(f) for f in Family}
    src = inspect.getsource(DRIVER)
    for needle in ('"sm120"', '"sm90"', ".family ==", ".family !=", "Family.SM120 if"):
        assert needle not in src, needle


# ----------------------------------------------------------------------------- SM120

SM120_REFUSALS = [
    (SM120.replace(grouped=True, sf_load="cp_async"), Problem(64, 128, 256, "nvfp4", 8),
     "grouped SM120 schedules load SFB by TMA (and SFA per row by cp.async): use "
     "sf_load='tma'"),
    (SM120.replace(swap_ab=True), None,
     "swap_ab is implemented for sm_90a only, not sm_120a"),
    (SM120.replace(tile=(96, 128, 128)), None,
     "tile M 96 is not a multiple of 16 x 4 MMA warps along M"),
    (SM120.replace(tile=(128, 120, 128)), None,
     "tile N 120 is not a multiple of 8 x 2 MMA warps along N"),
    (SM120.replace(tile=(128, 128, 96)), None,
     "tile K 96 must be 64, 128, 192 or 256 (the MMA consumes K=64)"),
    (SM120.replace(tile=(128, 48, 128), mma=(4, 2)), None,
     "tile 128x48: M and N must be 32, 64 or 128 on SM120 (a tile must not straddle two "
     "128-row scale atoms)"),
    (SM120.replace(mma=(4, 1)), None,
     "SM120 needs 2 or 4 MMA warps along N (the accumulator's column permutation), got 1"),
    (SM120.replace(tile=(256, 128, 64)), None,
     "tile 256x128 exceeds 128x128: the accumulators of one CTA would need more than 255 "
     "registers per thread on SM120"),
    (SM120.replace(roles="pingpong", mma=(4, 4)), None,
     "1152 threads per CTA exceed 1,024"),
    (SM120.replace(epi_tile=(48, 32)), None,
     "epilogue tile 48x32 does not divide the CTA tile 128x128"),
    (SM120.replace(epi_tile=(32, 32)), None,
     "epilogue tile 32x32 must be whole MMA sub-tiles on SM120 with 4x2 MMA warps: M a "
     "multiple of 64, N a multiple of 32"),
    (SM120, Problem(8, 64, 64, "bf16"),
     "W4A16 (16-bit A) is not implemented for SM120: quantize A to NVFP4 (W4A4) or use an "
     "sm_90a schedule"),
]

# ----------------------------------------------------------------------------- SM90

SM90_REFUSALS = [
    (SM90.replace(grouped=True), Problem(64, 128, 256, "bf16", 8),
     "grouped sm_90a schedules run the rs_packed mainloop (set mainloop='rs_packed'): its "
     "weight tiles are whole per group"),
    (SM90.replace(mainloop="rs_packed", tile=(128, 128, 256)), None,
     "rs_packed tile K 256 must be 64 or 128"),
    (SWAP.replace(tile=(24, 64, 256)), None,
     "swap_ab tile 24x64x256 must be Mx64x256 with M (activation rows, WGMMA's N) 8, 16, 32 "
     "or 64"),
    (SWAP.replace(mma=(2, 1)), None,
     "swap_ab takes Warps.mma = (1, W) with W in 1..4 consumer warpgroups splitting K, got "
     "(2, 1)"),
    (SM90.replace(tile=(64, 128, 128)), None,
     "tile M 64 is not a multiple of 64 x 2 warpgroups along M"),
    (SM90.replace(tile=(128, 512, 64), mma=(2, 1)), None,
     "tile N 512 must be a multiple of 8 x 1 with at most 256 per warpgroup"),
    (SM90.replace(tile=(128, 192, 128)), None,
     "tile N 192 must be 64 or a multiple of 128 (scale-factor atoms cover 128 rows)"),
    (SM90.replace(tile=(128, 128, 32)), None,
     "tile K 32 must be 64, 128, 192 or 256 (whole 4-column scale-factor atoms)"),
    (SM90.replace(tile=(128, 128, 192)), None,
     "the 256 converting threads do not split a 128x192 / 128x192 tile into whole passes "
     "of 16-element chunks"),
    (SM90.replace(tile=(256, 256, 64), mma=(2, 4)), None,
     "1152 threads per CTA exceed 1,024"),
    (SM90.replace(epi_tile=(128, 48)), None,
     "epilogue tile 128x48 does not divide the CTA tile 128x128"),
    (SM90.replace(epi_tile=(64, 32)), None,
     "epilogue tile 64x32 does not fit 2x1 warpgroups on sm_90a: its M must be a multiple "
     "of 128"),
    (SM90.replace(mma=(1, 2), epi_tile=(64, 64)), None,
     "epilogue tile 64x64 does not fit 1x2 warpgroups on sm_90a: its M must be a multiple "
     "of 64 and its N the whole tile N 128"),
    (SM90.replace(epi_tile=(128, 4)), None,
     "epilogue tile N 4 stores rows of under 16 bytes; TMA needs >= 16"),
    (SM90.replace(roles="pingpong"), None,
     "pingpong warp roles are not implemented for sm_90a: use cooperative"),
    (SM90.replace(sf_load="cp_async"), None,
     "sf_load=cp_async is not implemented for sm_90a: its kernels load scale factors by TMA "
     "with A and B; use SFLoad.TMA"),
    (SWAP.replace(sf_load="cp_async"), Problem(1, 4096, 4096),
     "sf_load=cp_async is not implemented for sm_90a: its kernels load scale factors by TMA "
     "with A and B; use SFLoad.TMA"),
    (SM90.replace(out_dtype="fp32", epi_tile=(128, 64)), None,
     "sm_90a stores 32-bit results (FP32 output) from registers: Epilogue.tile 128x64 "
     "would be ignored; leave it None"),
    (SM90.replace(split_k=2, epi_tile=(128, 64)), None,
     "sm_90a stores 32-bit results (split-K partials) from registers: Epilogue.tile 128x64 "
     "would be ignored; leave it None"),
    (SWAP.replace(epi_tile=(16, 64)), None,
     "swap_ab stores D^T from registers: Epilogue.tile 16x64 would be ignored; leave it "
     "None"),
    (SWAP.replace(persistent=True), None,
     "swap_ab launches one CTA per (N tile, M tile, split) and has no persistent loop: set "
     "Scheduler(persistent=False)"),
    (SWAP.replace(raster="n"), None,
     "swap_ab ignores the raster order and group size (got n, 8): its grid maps CTAs to "
     "tiles directly; leave them at m, 8"),
    (SWAP.replace(group_size=16), None,
     "swap_ab ignores the raster order and group size (got m, 16): its grid maps CTAs to "
     "tiles directly; leave them at m, 8"),
]

# ----------------------------------------------------------------------------- both

COMMON_REFUSALS = [
    case for s in (SM120, SM90) for case in [
        (s, Problem(8, 64, 48), "K = 48 is not a multiple of 32: packed FP4 rows must be a "
                                "multiple of 16 bytes for TMA"),
        (s, Problem(8, 60, 64), "N = 60 is not a multiple of 8: output rows must be 16-byte "
                                "aligned"),
        (s.replace(split_k=8), Problem(1, 64, 512),
         "split_k 8 exceeds the 4 K tiles of K = 512 with tile K 128"),
        (s.replace(split_k=17), None, "split_k 17 exceeds 16"),
        (s, Problem(64, 128, 256, "bf16" if s is SM90 else "nvfp4", 8),
         "a grouped problem (8 groups) needs a grouped schedule (Scheduler(grouped=True)); "
         "this one computes one dense GEMM"),
        (s.replace(grouped=True), Problem(64, 128, 256, "bf16" if s is SM90 else "nvfp4",
                                          257),
         "257 groups exceed the grouped scheduler's 256 (it keeps 8 tile-count prefixes per "
         "lane of a warp)"),
        (s.replace(grouped=True, split_k=2), None,
         "grouped schedules do not split K (split_k 2): use 1"),
    ]
]


def _id(case):
    s, p, reason = case
    return f"{s.target}:{reason[:40]}"


@pytest.mark.parametrize("case", SM120_REFUSALS + SM90_REFUSALS + COMMON_REFUSALS, ids=_id)
def test_refusal_reasons_with_numbers(case):
    s, p, reason = case
    pl = plan(s, p)
    assert not pl.ok
    assert reason in pl.reasons, pl.reasons
    with pytest.raises(ScheduleError) as e:
        pl.raise_if_invalid()
    assert reason in e.value.reasons


def test_each_refused_setting_is_accepted_without_it():
    # the refusals above are about the one setting: the base schedules plan ok
    assert plan(SM120).ok and plan(SM90).ok and plan(SWAP).ok
    assert plan(SM90.replace(out_dtype="fp32")).ok  # FP32 without an epilogue tile
    assert plan(SWAP.replace(split_k=2), Problem(1, 4096, 8192)).ok


def test_every_family_check_is_exercised():
    # each named check of each family gives the reason of at least one case above
    for mod, cases in ((sm120, SM120_REFUSALS), (sm90, SM90_REFUSALS)):
        assert mod.RULES.checks == mod.CHECKS
        for check in mod.CHECKS:
            hit = [r for s, p, r in cases if r in check(s, p or Problem())]
            assert hit, f"{mod.__name__}.{check.__name__} refuses nothing in the tests"


# ----------------------------------------------------------------------------- catalogue

# (stages, smem bytes, epilogue tile) per schedule and A format, as plan() gave them before
# the rules were split per family (git 93a5dbc); the split must not move a byte. A regression
# guard (docs/testing.md, "Frozen figures"): a planner change that moves a row on purpose
# updates it from `cute-fp4 plan NAME --json` and says so; a new schedule adds its rows.
ACCOUNTING = {
    ("sm120_128x64", "nvfp4"): (5, 89_088, (128, 64)),
    ("sm120_decode_64x128", "nvfp4"): (5, 89_088, (64, 128)),
    ("sm120_decode_splitk4", "nvfp4"): (4, 91_136, (64, 128)),
    ("sm120_default", "nvfp4"): (3, 89_088, (128, 128)),
    ("sm120_epi64x32", "nvfp4"): (4, 91_136, (64, 32)),
    ("sm120_k256_epi64x32", "nvfp4"): (2, 91_136, (64, 32)),
    ("sm120_grouped", "nvfp4"): (5, 93_184, (128, 128)),
    ("sm120_grouped_decode", "nvfp4"): (8, 99_328, (32, 128)),
    ("sm120_k64_deep", "nvfp4"): (7, 99_328, (128, 128)),
    ("sm120_nonpersistent", "nvfp4"): (3, 89_088, (128, 128)),
    ("sm120_pingpong", "nvfp4"): (3, 89_088, (128, 128)),
    ("sm120_raster_n", "nvfp4"): (3, 89_088, (128, 128)),
    ("sm120_sf_cp_async", "nvfp4"): (3, 89_088, (128, 128)),
    ("sm120_stream_decode", "bf16"): (2, 36_864, (8, 64)),
    ("sm120_stream_grouped_decode", "bf16"): (2, 36_864, (8, 64)),
    ("sm90_128x128x64", "nvfp4"): (14, 228_352, (128, 128)),
    ("sm90_128x128x64", "bf16"): (7, 214_016, (128, 128)),
    ("sm90_decode", "nvfp4"): (12, 224_256, (64, 256)),
    ("sm90_decode", "bf16"): (9, 223_232, (64, 256)),
    ("sm90_decode_64x128_splitk2", "nvfp4"): (9, 228_352, (64, 128)),
    ("sm90_decode_64x128_splitk2", "bf16"): (6, 220_160, (64, 128)),
    ("sm90_decode_swapab", "nvfp4"): (13, 220_160, (16, 64)),
    ("sm90_decode_swapab", "bf16"): (10, 218_112, (16, 64)),
    ("sm90_default", "nvfp4"): (4, 220_160, (128, 256)),
    ("sm90_default", "bf16"): (3, 208_896, (128, 256)),
    ("sm90_grouped", "bf16"): (7, 205_824, (192, 128)),
    ("sm90_grouped_decode", "bf16"): (10, 226_304, (16, 256)),
    ("sm90_grouped_large", "nvfp4"): (14, 227_328, (256, 128)),
    ("sm90_grouped_large", "bf16"): (6, 225_280, (256, 128)),
    ("sm90_nonpersistent_fp32", "nvfp4"): (5, 224_256, (128, 128)),
    ("sm90_nonpersistent_fp32", "bf16"): (3, 192_512, (128, 128)),
    ("sm90_rs_packed", "nvfp4"): (14, 227_328, (256, 128)),
    ("sm90_rs_packed", "bf16"): (6, 225_280, (256, 128)),
    ("sm90_rs_packed_decode", "bf16"): (10, 226_304, (16, 256)),
    ("sm90_rs_packed_decode_128", "bf16"): (17, 227_328, (16, 128)),
    ("sm90_rs_packed_m64", "nvfp4"): (15, 232_448, (64, 128)),
    ("sm90_rs_packed_m64", "bf16"): (9, 231_424, (64, 128)),
    ("sm90_rs_packed_w256", "nvfp4"): (7, 227_328, (128, 256)),
    ("sm90_rs_packed_w256", "bf16"): (4, 205_824, (128, 256)),
    ("sm90_stream_decode", "bf16"): (2, 36_864, (8, 64)),
    ("sm90_stream_grouped_decode", "bf16"): (1, 18_432, (8, 64)),
    ("sm90_stream_grouped_decode_long_k", "bf16"): (2, 36_864, (8, 64)),
    # MXFP4 (weights; "mxfp4": W4A4 both, "bf16+mxfp4": W4A16): half NVFP4's scale bytes
    ("sm120_mxfp4", "mxfp4"): (3, 87_040, (128, 128)),
    ("sm120_mxfp4_grouped", "mxfp4"): (5, 89_088, (128, 128)),
    ("sm120_mxfp4_stream_decode", "bf16+mxfp4"): (2, 36_864, (8, 64)),
    ("sm90_mxfp4_grouped", "bf16+mxfp4"): (5, 208_896, (128, 128)),
    ("sm90_mxfp4_rs_packed", "bf16+mxfp4"): (4, 201_728, (128, 256)),
    ("sm90_mxfp4_stream_decode", "bf16+mxfp4"): (2, 36_864, (8, 64)),
    ("sm90_mxfp4_stream_grouped_decode", "bf16+mxfp4"): (1, 18_432, (8, 64)),
    ("sm90_mxfp4_stream_grouped_decode_deep", "bf16+mxfp4"): (4, 73_728, (8, 64)),
    ("sm90_mxfp4_stream_grouped_decode_w8", "bf16+mxfp4"): (1, 36_864, (8, 64)),
}


def problem_of(fmt: str) -> Problem:
    """The problem of an ACCOUNTING format key: an A format (NVFP4 weights), "mxfp4" (A
    and B MXFP4) or "<A>+<B>"."""
    a, _, b = fmt.partition("+")
    return Problem(a_format=a, b_format=b or ("mxfp4" if a == "mxfp4" else "nvfp4"))


@pytest.mark.parametrize("key", sorted(ACCOUNTING), ids=lambda k: f"{k[0]}-{k[1]}")
def test_catalogue_accounting_unchanged_on_every_target(key):
    name, fmt = key
    s = catalogue.get(name)
    for t in TARGETS.values():
        if t.family is not s.arch.family:
            continue
        pl = plan(s.replace(target=t.name), problem_of(fmt))
        assert pl.ok, pl.reasons
        assert (pl.stages, pl.smem_bytes, pl.epi_tile) == ACCOUNTING[key], t.name


def test_accounting_covers_the_whole_catalogue():
    accepted = {s.name for s in catalogue.all_schedules() if s.name != "sm100_style_256x128x256"}
    assert {name for name, _ in ACCOUNTING} == accepted


# ----------------------------------------------------------------------------- registers

@pytest.mark.parametrize("args, split", [
    ((384, 256, 40, 232), RegisterSplit(168, 40, 232)),  # SM120 pingpong 2 x (2x2) warps
    ((640, 512, 40, 232), RegisterSplit(96, 40, 104)),  # SM120 pingpong 2 x (4x2) warps
    ((256, 128, 40, 240), RegisterSplit(248, 40, 240)),  # SM90, one consumer warpgroup
    ((384, 256, 40, 240), RegisterSplit(168, 40, 232)),  # SM90, two
    ((640, 512, 40, 240), RegisterSplit(96, 40, 104)),  # SM90, four (swap-AB W = 4)
])
def test_register_split_reference_points(args, split):
    assert register_split(*args) == split


def test_register_split_never_asks_for_more_than_the_cta_holds():
    # setmaxnreg.inc blocks until the CTA's pool has the registers: the split must fit the
    # launch allocation (entry x threads), or the MMA warps would wait forever
    for threads in range(256, 1025, 128):
        for mma_threads in range(128, threads, 128):
            r = register_split(threads, mma_threads, 40, 240)
            used = (threads - mma_threads) * r.producer + mma_threads * r.mma
            assert used <= r.entry * threads and r.mma % 8 == 0 and r.entry <= 255


@pytest.mark.parametrize("args", [(288, 256, 40, 232), (256, 256, 40, 232), (384, 200, 40, 232)])
def test_register_split_needs_whole_warpgroups(args):
    with pytest.raises(InputError, match="whole warpgroups"):
        register_split(*args)


def test_plans_carry_threads_and_register_split():
    plans = {n: plan(catalogue.get(n)) for n in
             ("sm120_default", "sm120_pingpong", "sm90_default", "sm90_decode_64x128_splitk2",
              "sm90_decode_swapab")}
    assert {n: (p.threads, p.registers) for n, p in plans.items()} == {
        "sm120_default": (288, None),  # 8 MMA warps + the producer warp: no setmaxnreg
        "sm120_pingpong": (384, RegisterSplit(168, 40, 232)),
        "sm90_default": (384, RegisterSplit(168, 40, 232)),
        "sm90_decode_64x128_splitk2": (256, RegisterSplit(248, 40, 240)),
        "sm90_decode_swapab": (384, RegisterSplit(168, 40, 232)),
    }
    assert "threads   384 per CTA, setmaxnreg 168 -> producer 40, MMA 232" in \
        plans["sm120_pingpong"].summary()


def test_plan_is_a_frozen_value():
    pl = plan(SM120)
    with pytest.raises(dataclasses.FrozenInstanceError):
        pl.stages = 1
    assert plan(SM120) == pl and plan(SM120.replace(epilogue=Epilogue(tile=(64, 32)))) != pl
