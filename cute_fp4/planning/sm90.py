"""Planning rules of the SM90 family (sm_90a): FP4 dequantized in the kernel, 16-bit WGMMA.

Two kernels (``cute_fp4/kernels/sm90.py``, ``sm90_swapab.py``), one CTA shape: warpgroup 0
is the producer (its warp 0 issues the TMA loads), the other warpgroups consume. Shared
memory ``barriers | A | B | SFA | SFB | A16 | B16 | C``: a full/empty mbarrier pair per
stage (conversion buffers and the epilogue synchronise on named barriers), scale factors
in whole 512-byte atoms (128 rows x 4 columns, also for 64-row tiles), two 16-bit
conversion buffers per operand, and C staging for 16-bit outputs only: 32-bit results
(FP32 output, split-K partials) are stored from registers. With ``swap_ab`` the weight is
converted in registers, the activation gets two 16-bit buffers per consumer warpgroup,
and D^T is stored from registers (no C).

Refused here, besides shapes the kernels would compute wrongly: pingpong warp roles,
scale factors by cp.async (both kernels load them by TMA), and settings a kernel would
silently ignore: an epilogue tile where results are stored from registers, and a
persistent scheduler, raster order or group size with ``swap_ab`` (its grid maps one CTA
to each tile directly).

``mainloop=rs_packed`` (kernels/sm90_rs_wide.py): ``barriers | A | B | SFA | SFB | A16``:
A is the 16-bit activation tile TMA'd into WGMMA's B layout (W4A16), or packed NVFP4
converted per stage into one 16-bit buffer ``A16`` (W4A4); B is the fragment-order packed
weight; D^T is stored from registers (no C).
"""

from __future__ import annotations

from cute_fp4.planning.common import (
    SF_ATOM_ROWS,
    WARPGROUP,
    FamilyRules,
    Region,
    RegisterSplit,
    c_elem_bytes,
    check_cta_threads,
    epilogue_tile,
    mainloop_regions,
    operand_stage_bytes,
    register_split,
    sf_stage_bytes,
    staged_c_region,
)
from cute_fp4.schedule import Mainloop, Problem, Schedule, Scheduler, SFLoad, WarpRoles

CONVERT_STAGES = 2  # 16-bit conversion buffers per operand (double-buffered)
PRODUCER_REGS = 40  # setmaxnreg budget of the producer warpgroup
MMA_REGS_MAX = 240  # and the most the consumer warpgroups take
SWAP_AB_TILE_M = (8, 16, 32, 64)  # activation rows: WGMMA's N
MAX_WG_N = 256  # WGMMA N per warpgroup
RS_PACKED_TILE_K = (64, 128)  # rs_packed: K per stage (whole 64-element packed units)
RS_PACKED_ACC_COLUMNS = 256  # rs_packed: 64-row blocks x activation columns per warpgroup


# ----------------------------------------------------------------------------- accounting

def stage_bytes(s: Schedule, p: Problem) -> dict[str, int]:
    """Bytes of one mainloop stage: A, B and whole 512-byte scale atoms (W4A16: no SFA)."""
    t = s.tile
    return {**operand_stage_bytes(s, p),
            "SFA": 0 if p.w4a16 else sf_stage_bytes(t.m, t.k, p.fmt),
            "SFB": sf_stage_bytes(t.n, t.k, p.fmt)}


def regions(s: Schedule, p: Problem, stages: int) -> tuple[Region, ...]:
    """The mainloop regions, the 16-bit conversion buffers and C, for ``stages`` stages."""
    t = s.tile
    out = mainloop_regions(stage_bytes(s, p), stages, 2 * stages)
    if rs_packed(s):
        if not p.w4a16:  # the activation stage is converted into one 16-bit buffer
            out.append(Region("A16", t.m * t.k * 2, f"1 x FP16 {t.m}x{t.k}"))
        out.append(Region("C", 0, "none: D^T stored from registers"))
        return tuple(out)
    if s.swap_ab:
        # the weight is converted in registers; the activation (WGMMA's B) gets two 16-bit
        # buffers per consumer warpgroup; results are stored from registers
        bufs = CONVERT_STAGES * s.warps.mma[1]
        out.append(Region("A16", bufs * t.m * t.k * 2, f"{bufs} x 16-bit {t.m}x{t.k}"))
        out.append(Region("C", 0, "none: D^T stored from registers"))
        return tuple(out)
    conv = CONVERT_STAGES
    if not p.w4a16:
        out.append(Region("A16", conv * t.m * t.k * 2, f"{conv} x BF16 {t.m}x{t.k}"))
    out.append(Region("B16", conv * t.n * t.k * 2, f"{conv} x BF16 {t.n}x{t.k}"))
    if _direct_store(s):
        what = "fused epilogue ops" if s.epilogue.ops else "32-bit results"
        out.append(Region("C", 0, f"none: {what} stored from registers"))
    else:
        out.append(staged_c_region(s))
    return tuple(out)


def rs_packed(s: Schedule) -> bool:
    """The register-sourced mainloop on a fragment-order packed weight."""
    return s.mainloop is Mainloop.RS_PACKED


def _direct_store(s: Schedule) -> bool:
    """32-bit results (FP32 output, split-K partials) and tiles with fused epilogue ops go
    from registers to global memory."""
    return c_elem_bytes(s) == 4 or bool(s.epilogue.ops)


def consumer_warpgroups(s: Schedule) -> int:
    wm, wn = s.warps.mma
    return wm * wn * s.warps.groups


def threads(s: Schedule) -> int:
    """Threads per CTA: the consumer warpgroups and the producer warpgroup."""
    return (consumer_warpgroups(s) + 1) * WARPGROUP


def registers(s: Schedule) -> RegisterSplit:
    """The setmaxnreg split both SM90 kernels apply (the producer warpgroup gives its
    registers to the consumers)."""
    n = threads(s)
    return register_split(n, n - WARPGROUP, PRODUCER_REGS, MMA_REGS_MAX)


# ----------------------------------------------------------------------------- checks

def check_swap_ab_tile(s: Schedule, p: Problem) -> list[str]:
    t = s.tile
    if s.swap_ab and (t.n != 64 or t.k != 256 or t.m not in SWAP_AB_TILE_M):
        return [f"swap_ab tile {t} must be Mx64x256 with M (activation rows, "
                "WGMMA's N) 8, 16, 32 or 64"]
    return []


def check_swap_ab_warps(s: Schedule, p: Problem) -> list[str]:
    wm, wn = s.warps.mma
    if s.swap_ab and (wm != 1 or not 1 <= wn <= 4):
        return [f"swap_ab takes Warps.mma = (1, W) with W in 1..4 consumer "
                f"warpgroups splitting K, got {s.warps.mma}"]
    return []


def check_rs_packed(s: Schedule, p: Problem) -> list[str]:
    """What the rs_packed mainloop implements: tile N (weight rows) 128 or 256 over
    ``Warps.mma = (W, 1)`` (W = 1, 2, 4) warpgroups of 64 or 128 rows each, tile M (activation rows,
    WGMMA's N) a multiple of 8 up to 256 whose accumulators fit (64-row blocks x tile M
    <= 256 per warpgroup: 128 FP32 registers), tile K 64 or 128, not swap_ab (it is the
    swapped form already), K a multiple of 64 (the packed weight's 64-element units)."""
    if not rs_packed(s):
        return []
    t, (wm, wn) = s.tile, s.warps.mma
    out = []
    if s.swap_ab:
        out.append("mainloop=rs_packed already runs the weight as WGMMA's A operand and "
                   "stores D^T: leave swap_ab False")
    if wn != 1 or wm not in (1, 2, 4) or t.n not in (128, 256) or t.n // wm not in (64, 128):
        out.append(f"rs_packed takes tile N (weight rows) 128 or 256 over Warps.mma = "
                   f"(W, 1) warpgroups of 64 or 128 rows, got tile N {t.n} and "
                   f"Warps.mma {s.warps.mma}")
    elif (t.n // wm // 64) * t.m > RS_PACKED_ACC_COLUMNS:
        out.append(f"rs_packed: {t.n // wm // 64} x 64 weight rows x {t.m} activation "
                   f"columns per warpgroup need {(t.n // wm // 64) * t.m // 2} FP32 "
                   f"accumulator registers per thread; at most "
                   f"{RS_PACKED_ACC_COLUMNS // 2}")
    if t.m % 8 or not 8 <= t.m <= MAX_WG_N:
        out.append(f"rs_packed tile M {t.m} (activation rows, WGMMA's N) must be a "
                   "multiple of 8 from 8 to 256")
    if t.k not in RS_PACKED_TILE_K:
        out.append(f"rs_packed tile K {t.k} must be 64 or 128")
    if p.k and p.k % 64:
        out.append(f"K = {p.k} is not a multiple of 64: the packed weight is cut into "
                   "64-element K units (use the plain weight and mainloop=standard)")
    if not p.w4a16 and not out:
        out += _rs_packed_w4a4(s, p)
    return out


def _rs_packed_w4a4(s: Schedule, p: Problem) -> list[str]:
    """W4A4: the activation stage is converted by every consumer thread in whole passes of
    block-sized chunks (Sm90Gemm.convert), its scale atoms whole (tile M 64 or 128k)."""
    t, (wm, _) = s.tile, s.warps.mma
    n_threads, chunks = WARPGROUP * wm, t.k // p.fmt.block
    out = []
    if t.m != 64 and t.m % SF_ATOM_ROWS:
        out.append(f"rs_packed W4A4 tile M {t.m} must be 64 or a multiple of 128 (the "
                   "activation's scale atoms cover 128 rows)")
    if n_threads % chunks or (t.m * chunks) % n_threads:
        out.append(f"rs_packed W4A4: the {n_threads} converting threads do not split a "
                   f"{t.m}x{t.k} activation tile into whole passes of {p.fmt.block}-element "
                   "chunks")
    return out


def check_tile(s: Schedule, p: Problem) -> list[str]:
    """The WGMMA tile: 64-row warpgroups, N per warpgroup, whole scale atoms along M, N, K."""
    if s.swap_ab or rs_packed(s):
        return []
    t, (wm, wn) = s.tile, s.warps.mma
    out = []
    if t.m % (64 * wm):
        out.append(f"tile M {t.m} is not a multiple of 64 x {wm} warpgroups along M")
    if t.n % (8 * wn) or t.n // wn > MAX_WG_N:
        out.append(f"tile N {t.n} must be a multiple of 8 x {wn} with at most 256 "
                   "per warpgroup")
    for dim, v in (("M", t.m), ("N", t.n)):
        if v != 64 and v % SF_ATOM_ROWS:
            out.append(f"tile {dim} {v} must be 64 or a multiple of 128 (scale-factor "
                       "atoms cover 128 rows)")
    if t.k % 64 or t.k > 256:
        out.append(f"tile K {t.k} must be 64, 128, 192 or 256 (whole 4-column "
                   "scale-factor atoms)")
    return out


def check_conversion_split(s: Schedule, p: Problem) -> list[str]:
    """The consumer threads convert a tile in whole passes of block-sized chunks (one scale
    each; checked only on a tile that passes ``check_tile``)."""
    if s.swap_ab or rs_packed(s) or check_tile(s, p):
        return []
    t, (wm, wn) = s.tile, s.warps.mma
    n_threads, chunks = WARPGROUP * wm * wn, t.k // p.fmt.block
    a_split = p.w4a16 or (t.m * chunks) % n_threads == 0  # W4A16 converts only B
    if n_threads % chunks or not a_split or (t.n * chunks) % n_threads:
        return [f"the {n_threads} converting threads do not split a {t.m}x{t.k} / "
                f"{t.n}x{t.k} tile into whole passes of {p.fmt.block}-element chunks"]
    return []


def check_threads(s: Schedule, p: Problem) -> list[str]:
    return check_cta_threads(threads(s))


def check_epilogue(s: Schedule, p: Problem) -> list[str]:
    """The epilogue tile divides the CTA tile; 16-bit outputs are staged per warpgroup
    rows (and the whole tile N with several warpgroups along N); rows >= 16 bytes."""
    if s.swap_ab or rs_packed(s):
        return []  # D^T is stored from registers; no epilogue tile
    em, en = epilogue_tile(s)
    t = s.tile
    if t.m % em or t.n % en:
        return [f"epilogue tile {em}x{en} does not divide the CTA tile {t.m}x{t.n}"]
    if c_elem_bytes(s) == 2:
        wm, wn = s.warps.mma
        if em % (64 * wm) or (wn > 1 and en != t.n):
            return [f"epilogue tile {em}x{en} does not fit {wm}x{wn} warpgroups on sm_90a: "
                    f"its M must be a multiple of {64 * wm}"
                    + (f" and its N the whole tile N {t.n}" if wn > 1 else "")]
    if en * c_elem_bytes(s) < 16:
        return [f"epilogue tile N {en} stores rows of under 16 bytes; TMA needs >= 16"]
    return []


def check_roles(s: Schedule, p: Problem) -> list[str]:
    if s.warps.roles is WarpRoles.PINGPONG:
        return ["pingpong warp roles are not implemented for sm_90a: use cooperative"]
    return []


def check_sf_load(s: Schedule, p: Problem) -> list[str]:
    """Both SM90 kernels load the scale factors by TMA, on A and B's barrier."""
    if s.sf_load is not SFLoad.TMA:
        return [f"sf_load={s.sf_load.value} is not implemented for {s.target}: its kernels "
                "load scale factors by TMA with A and B; use SFLoad.TMA"]
    return []


def check_epilogue_tile_used(s: Schedule, p: Problem) -> list[str]:
    """An epilogue tile where results never go through shared memory would be ignored."""
    if s.epilogue.tile is None:
        return []
    em, en = s.epilogue.tile
    if s.swap_ab or rs_packed(s):
        what = f"{'swap_ab' if s.swap_ab else 'rs_packed'} stores D^T from registers"
    elif _direct_store(s):
        kind = ("tiles with fused epilogue ops" if s.epilogue.ops else "32-bit results "
                f"({'split-K partials' if s.split_k > 1 else 'FP32 output'})")
        what = f"{s.target} stores {kind} from registers"
    else:
        return []
    return [f"{what}: Epilogue.tile {em}x{en} would be ignored; leave it None"]


def check_swap_ab_scheduler(s: Schedule, p: Problem) -> list[str]:
    """swap_ab launches one CTA per (N tile, M tile, split): no persistent loop, and no
    raster order or grouping to apply."""
    if not s.swap_ab:
        return []
    sch, default = s.scheduler, Scheduler()
    out = []
    if sch.persistent:
        out.append("swap_ab launches one CTA per (N tile, M tile, split) and has no "
                   "persistent loop: set Scheduler(persistent=False)")
    if sch.raster is not default.raster or sch.group_size != default.group_size:
        out.append(f"swap_ab ignores the raster order and group size (got "
                   f"{sch.raster.value}, {sch.group_size}): its grid maps CTAs to tiles "
                   f"directly; leave them at {default.raster.value}, {default.group_size}")
    return out


def check_grouped_sm90(s: Schedule, p: Problem) -> list[str]:
    """Grouped sm_90a schedules run the rs_packed mainloop (W4A16; W4A4 where its tile rules
    allow, A's scales copied row by row)."""
    if not s.scheduler.grouped:
        return []
    out = []
    if not rs_packed(s):
        out.append("grouped sm_90a schedules run the rs_packed mainloop (set "
                   "mainloop='rs_packed'): its weight tiles are whole per group")
    return out


CHECKS = (check_grouped_sm90, check_rs_packed, check_swap_ab_tile, check_swap_ab_warps, check_tile,
          check_conversion_split, check_threads, check_epilogue, check_roles, check_sf_load,
          check_epilogue_tile_used, check_swap_ab_scheduler)

RULES = FamilyRules(stage_bytes=stage_bytes, regions=regions, threads=threads,
                    registers=registers, checks=CHECKS)
