"""Planning rules of the SM120 family (sm_120a, sm_121a): block-scaled warp MMA.

The kernel (``cute_fp4/kernels/sm120.py``): MMA warps issue ``m16n8k64`` block-scaled
``mma.sync``; one producer warp (the last warp) loads A, B and the scale factors. Shared
memory ``barriers | A | B | SFA | SFB | C``: a full/empty mbarrier pair per stage plus a
pair per MMA group (pingpong turns), scale factors in whole 128-row atoms, and the C
staging buffers of the epilogue. Pingpong CTAs are padded to whole warpgroups so that
setmaxnreg can move the producer's registers to the MMA warps.

Refused here: swap-AB (an sm_90a kernel), W4A16 (the MMA takes FP4 x FP4 only), and tile,
warp and epilogue shapes the kernel would compute wrongly.
"""

from __future__ import annotations

from cute_fp4.planning.common import (
    SF_ATOM_ROWS,
    WARP,
    FamilyRules,
    Region,
    RegisterSplit,
    check_cta_threads,
    epilogue_tile,
    mainloop_regions,
    operand_stage_bytes,
    register_split,
    sf_stage_bytes,
    staged_c_region,
)
from cute_fp4.schedule import Problem, Schedule, SFLoad, WarpRoles

PRODUCER_REGS = 40  # setmaxnreg budget of the producer warpgroup
MMA_REGS_MAX = 232  # and the most the MMA warps take
MAX_TILE_MN = 128  # accumulators of a larger tile exceed 255 registers per thread


# ----------------------------------------------------------------------------- accounting

def stage_bytes(s: Schedule, p: Problem) -> dict[str, int]:
    """Bytes of one mainloop stage: A, B and their scale factors in 128-row atoms."""
    t = s.tile
    return {**operand_stage_bytes(s, p), "SFA": sf_stage_bytes(t.m, t.k, p.fmt),
            "SFB": sf_stage_bytes(t.n, t.k, p.fmt)}


def regions(s: Schedule, p: Problem, stages: int) -> tuple[Region, ...]:
    """``barriers | A | B | SFA | SFB | C`` for ``stages`` mainloop stages (grouped: no C,
    the tiles are stored from registers, masked at the group's last row)."""
    n_barriers = 2 * stages + 2 * s.warps.groups
    c = staged_c_region(s)
    if s.scheduler.grouped:
        c = Region("C", 0, "none: grouped tiles stored from registers")
    elif s.epilogue.ops:
        c = Region("C", 0, "none: tiles with fused epilogue ops stored from registers")
    return (*mainloop_regions(stage_bytes(s, p), stages, n_barriers), c)


def mma_warps(s: Schedule) -> int:
    """MMA warps of the CTA: ``Warps.mma`` per group, times the groups (2 for pingpong)."""
    wm, wn = s.warps.mma
    return wm * wn * s.warps.groups


def _padded(s: Schedule) -> bool:
    """Pingpong with whole warpgroups of MMA warps gets a whole producer warpgroup too."""
    return s.warps.roles is WarpRoles.PINGPONG and mma_warps(s) % 4 == 0


def threads(s: Schedule) -> int:
    """Threads per CTA: the MMA warps and one producer warp (a producer warpgroup when
    the CTA is padded for setmaxnreg)."""
    return (mma_warps(s) + (4 if _padded(s) else 1)) * WARP


def registers(s: Schedule) -> RegisterSplit | None:
    """The setmaxnreg split of a padded pingpong CTA, None when there is none or it would
    not give the MMA warps more than their launch share."""
    if not _padded(s):
        return None
    split = register_split(threads(s), mma_warps(s) * WARP, PRODUCER_REGS, MMA_REGS_MAX)
    return split if split.gains else None


# ----------------------------------------------------------------------------- checks

def check_swap_ab(s: Schedule, p: Problem) -> list[str]:
    if s.swap_ab:
        return [f"swap_ab is implemented for sm_90a only, not {s.target}"]
    if s.mainloop.value != "standard":
        return [f"mainloop={s.mainloop.value} is implemented for sm_90a only, not {s.target}"]
    return []


def check_tile_mma(s: Schedule, p: Problem) -> list[str]:
    """The tile is whole m16n8 MMAs per warp."""
    t, (wm, wn) = s.tile, s.warps.mma
    out = []
    if t.m % (16 * wm):
        out.append(f"tile M {t.m} is not a multiple of 16 x {wm} MMA warps along M")
    if t.n % (8 * wn):
        out.append(f"tile N {t.n} is not a multiple of 8 x {wn} MMA warps along N")
    return out


def check_tile_k(s: Schedule, p: Problem) -> list[str]:
    k = s.tile.k
    if k % 64 or k > 256:
        return [f"tile K {k} must be 64, 128, 192 or 256 (the MMA consumes K=64)"]
    return []


def check_tile_sf_atoms(s: Schedule, p: Problem) -> list[str]:
    t = s.tile
    if SF_ATOM_ROWS % t.m or SF_ATOM_ROWS % t.n:
        return [f"tile {t.m}x{t.n}: M and N must be 32, 64 or 128 on SM120 (a tile "
                "must not straddle two 128-row scale atoms)"]
    return []


def check_warps_n(s: Schedule, p: Problem) -> list[str]:
    wn = s.warps.mma[1]
    if wn not in (2, 4):
        return [f"SM120 needs 2 or 4 MMA warps along N (the accumulator's column "
                f"permutation), got {wn}"]
    return []


def check_tile_registers(s: Schedule, p: Problem) -> list[str]:
    t = s.tile
    if t.m > MAX_TILE_MN or t.n > MAX_TILE_MN:
        return [f"tile {t.m}x{t.n} exceeds 128x128: the accumulators of one CTA "
                "would need more than 255 registers per thread on SM120"]
    return []


def check_threads(s: Schedule, p: Problem) -> list[str]:
    return check_cta_threads(threads(s))


def check_epilogue(s: Schedule, p: Problem) -> list[str]:
    """The epilogue tile divides the CTA tile in whole MMA sub-tiles (at least 32 columns,
    so its rows are always the 16 bytes or more that a TMA store needs)."""
    em, en = epilogue_tile(s)
    t = s.tile
    if t.m % em or t.n % en:
        return [f"epilogue tile {em}x{en} does not divide the CTA tile {t.m}x{t.n}"]
    wm, wn = s.warps.mma
    rows, cols = 16 * wm, max(32, 8 * wn)
    if em % rows or en % cols:
        return [f"epilogue tile {em}x{en} must be whole MMA sub-tiles on SM120 with "
                f"{wm}x{wn} MMA warps: M a multiple of {rows}, N a multiple of {cols}"]
    return []


def check_w4a16(s: Schedule, p: Problem) -> list[str]:
    if p.w4a16:
        return ["W4A16 (16-bit A) is not implemented for SM120: quantize A to NVFP4 "
                "(W4A4) or use an sm_90a schedule"]
    return []


def check_grouped_sm120(s: Schedule, p: Problem) -> list[str]:
    """Grouped SM120 schedules load SFA row by row (cp.async, any group offset) and SFB by
    TMA; the sf_load=cp_async variant is not built for them."""
    if s.scheduler.grouped and s.sf_load is SFLoad.CP_ASYNC:
        return ["grouped SM120 schedules load SFB by TMA (and SFA per row by cp.async): "
                "use sf_load='tma'"]
    return []


CHECKS = (check_grouped_sm120, check_swap_ab, check_tile_mma, check_tile_k,
          check_tile_sf_atoms, check_warps_n, check_tile_registers, check_threads,
          check_epilogue, check_w4a16)

RULES = FamilyRules(stage_bytes=stage_bytes, regions=regions, threads=threads,
                    registers=registers, checks=CHECKS)
