"""Planning rules of the ``stream`` mainloop (kernels/stream.py), for every family that has
warp-level 16-bit ``mma.sync`` (sm_90a, sm_120a, sm_121a).

The CTA is four warps (or eight: ``Warps(mma=(8, 1))``, :func:`k_warps`) over one 64-row
block of the packed weight (``tile.n`` = 64) and ``tile.m`` (8 or 16) activation rows;
``tile.k`` is the packed unit (64). The warps take the block's K units in turn, each
streaming its units (2,048 bytes of weight and 256 of scale words) through a two-batch
cp.async ring of its own in shared memory (``Q | S``);
activation pairs come from global memory (L1). ``stages`` is the number of K units in one
batch of a warp's ring (between one and two batches in flight per warp); ``None`` takes
:data:`AUTO_UNITS`. After the K loop the ``Q`` region holds the warps' partial sums (8 KiB
per 8 activation rows). K is split over ``split_k`` CTAs per output tile and reduced in
the kernel.

Grouped (``Scheduler(grouped=True, persistent=False)``, MoE experts at decode): one CTA
per (expert row tile of ``tile.m`` rows, 64-row block of that expert's weight) for the
experts that have rows, no split of K (the grouped launch has no split-K workspace;
``planning.common.check_grouped``); an expert with more rows than ``tile.m`` gets more row
tiles (each streams its weight block again: the grouped rs_packed kernels serve those).

Refused: 4-bit activations (W4A4 runs on the activation's exact BF16 block values, see
``cute_fp4.quant``), other tiles and warp layouts, persistent schedulers, an epilogue tile
(results are stored from registers), K not a multiple of 64.
"""

from __future__ import annotations

from cute_fp4.planning.common import WARP, FamilyRules, Region, ceil_div
from cute_fp4.schedule import (
    Mainloop,
    Problem,
    Schedule,
    Scheduler,
    SFLoad,
    Tile,
    WarpRoles,
    Warps,
)

FAMILIES = ("sm90", "sm120")  # families whose kernels take the stream mainloop
TILE_M = (8, 16)  # activation rows: one or two m16n8k16 N blocks
UNIT_K = 64  # K elements per packed unit (cute_fp4.packed.UNIT_K)
ROWS = 64  # weight rows per CTA: four row groups of 16 (one packed unit)
WARPS = 4  # warps of a CTA by default (four 16-row groups' MMAs; the store's warps)
K_WARPS = (4, 8)  # warps taking the block's K units in turn: ``Warps(mma=(w, 1))``
MAX_UNITS = 8  # K units in flight per warp at most (registers: 4 words per unit)
AUTO_UNITS = 2  # ... when ``stages`` is None


def streaming(s: Schedule) -> bool:
    return s.mainloop is Mainloop.STREAM


def k_warps(s: Schedule) -> int:
    """Warps of the CTA, each taking every ``k_warps``-th K unit of the block (four store
    the result; with eight, twice the decode work and loads in flight per CTA, for grids
    of few CTAs)."""
    return s.warps.mma[0]


def units_in_flight(s: Schedule) -> int:
    """K units each warp loads before decoding the first."""
    return s.stages or AUTO_UNITS


RING = 2  # batches per warp's ring
UNIT_Q = 2048  # weight bytes per unit (64 rows x 64 K)
UNIT_S = 256  # scale bytes per unit in a warp's ring (8 lanes quads x 4 pairs x 8 bytes)


def stage_bytes(s: Schedule, p: Problem) -> dict[str, int]:
    """Bytes of one batch of the CTA's rings: the weight and its scale words."""
    units = units_in_flight(s)
    return {"Q": k_warps(s) * UNIT_Q * units, "S": k_warps(s) * UNIT_S * units}


def regions(s: Schedule, p: Problem, stages: int) -> tuple[Region, ...]:
    """The rings at ``stages`` K units per batch (plan's stage count: :func:`auto_stages`,
    or a candidate when it looks for the most that fit)."""
    w = k_warps(s)
    return (Region("Q", RING * w * UNIT_Q * stages, f"{RING} x {w} warps x {stages} "
                   "units x 2,048 B packed weight; then the partial sums"),
            Region("S", RING * w * UNIT_S * stages, f"{RING} x {w} warps x {stages} "
                   "units x 256 B scale words"))


def threads(s: Schedule) -> int:
    return k_warps(s) * WARP


def registers(s: Schedule) -> None:
    return None  # no setmaxnreg: every warp does the same work


def auto_stages(s: Schedule, p: Problem) -> int:
    return units_in_flight(s)


def check_family(s: Schedule, p: Problem) -> list[str]:
    if s.arch.family not in FAMILIES:
        return [f"mainloop=stream is implemented for {', '.join(FAMILIES)}, not {s.target}"]
    return []


def check_activation(s: Schedule, p: Problem) -> list[str]:
    if not p.w4a16:
        return ["mainloop=stream takes 16-bit activations (W4A16); W4A4 runs it on the "
                "activation's exact BF16 block values (cute_fp4.quant.quantize_values)"]
    return []


def check_shape(s: Schedule, p: Problem) -> list[str]:
    t, out = s.tile, []
    if t.m not in TILE_M or t.n != ROWS or t.k != UNIT_K:
        out.append(f"mainloop=stream takes tile (M, N, K) = ({' or '.join(map(str, TILE_M))}, "
                   f"{ROWS}, {UNIT_K}), got {t}")
    if s.warps not in tuple(Warps(mma=(w, 1)) for w in K_WARPS):
        out.append(f"mainloop=stream runs {WARPS} warps of 16 weight rows (or {K_WARPS[-1]} "
                   f"over the K units), cooperative: Warps(mma=({WARPS}, 1)) or "
                   f"Warps(mma=({K_WARPS[-1]}, 1)), got {s.warps.roles.value} {s.warps.mma}")
    if s.stages is not None and not 1 <= s.stages <= MAX_UNITS:
        out.append(f"mainloop=stream: stages (K units in flight per warp) {s.stages} must be "
                   f"1..{MAX_UNITS}")
    if p.k and p.k % UNIT_K:
        out.append(f"K = {p.k} is not a multiple of {UNIT_K}: the packed weight cuts K into "
                   f"{UNIT_K}-element units")
    return out


def check_split(s: Schedule, p: Problem) -> list[str]:
    if p.k and s.split_k > ceil_div(p.k, UNIT_K):
        return [f"split_k {s.split_k} exceeds the {ceil_div(p.k, UNIT_K)} K units of K = {p.k}"]
    return []


def check_fixed_choices(s: Schedule, p: Problem) -> list[str]:
    """Settings the kernel has no use for: refused rather than silently ignored."""
    out = []
    if s.scheduler != Scheduler(persistent=False, grouped=s.scheduler.grouped):
        out.append("mainloop=stream launches one CTA per (64 rows, activation tile, split): "
                   "use Scheduler(persistent=False) (grouped: Scheduler(persistent=False, "
                   "grouped=True)) with the default raster and group size")
    if s.epilogue.tile is not None:
        out.append("mainloop=stream stores results from registers: leave the epilogue tile "
                   "unset")
    if s.sf_load is not SFLoad.TMA or s.swap_ab:
        out.append("mainloop=stream loads scales itself and computes D^T already: leave "
                   "sf_load and swap_ab at their defaults")
    return out


CHECKS = (check_family, check_activation, check_shape, check_split, check_fixed_choices)

RULES = FamilyRules(stage_bytes=stage_bytes, regions=regions, threads=threads,
                    registers=registers, checks=CHECKS, auto_stages=auto_stages)

def stream_schedule(target: str = "sm_90a", tile_m: int = 16, split_k: int = 1,
                    stages: int | None = None, name: str = "", doc: str = "",
                    grouped: bool = False, warps: int = WARPS) -> Schedule:
    """A ``stream`` schedule for ``target`` (any family of :data:`FAMILIES`); ``grouped``:
    the MoE variant (experts' rows from device offsets, no split of K); ``warps``: the
    CTA's warps over the K units (:data:`K_WARPS`)."""
    return Schedule(target=target, tile=Tile(tile_m, ROWS, UNIT_K),
                    warps=Warps(roles=WarpRoles.COOPERATIVE, mma=(warps, 1)),
                    scheduler=Scheduler(persistent=False, grouped=grouped),
                    mainloop=Mainloop.STREAM, split_k=split_k, stages=stages, name=name,
                    doc=doc)
