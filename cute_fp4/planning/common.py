"""What every family's planning rules share: regions, alignment, the epilogue tile, the
setmaxnreg register split, and the checks that do not depend on the family.

Pure arithmetic on schedules and problems (no DSL, no GPU). The family modules
(``sm120.py``, ``sm90.py``) build on these; the driver (``cute_fp4.plan``) only dispatches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

from cute_fp4.errors import InputError
from cute_fp4.formats import NVFP4, SF_ATOM_ROWS, BlockFormat, Operand
from cute_fp4.schedule import Mainloop, Problem, Schedule, gated_op

ALIGN = 1024  # every region starts on this boundary (TMA's 128-byte swizzles need it)
MAX_EPI_STAGES = 4
MAX_SPLIT_K = 16
MAX_CTA_THREADS = 1024
WARP = 32  # threads per warp
WARPGROUP = 128  # threads per warpgroup (setmaxnreg acts on whole warpgroups)
REG_FILE = 65536  # 32-bit registers per SM (one CTA per SM)
MAX_THREAD_REGS = 255  # registers a thread can address
MAX_GROUPS = 256  # groups of a grouped GEMM: 8 tile-count prefixes per lane of a warp

Check = Callable[[Schedule, Problem], list[str]]  # returns reasons with numbers, [] if fine


def align(x: int, a: int = ALIGN) -> int:
    """``x`` rounded up to a multiple of ``a``."""
    return -(-x // a) * a


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class Region:
    """One shared-memory region of a kernel: its name, the bytes used, and how they add up."""

    name: str
    bytes: int  # bytes used (the kernel aligns each region's start to ALIGN)
    note: str = ""


# ----------------------------------------------------------------------------- accounting

def epilogue_tile(schedule: Schedule) -> tuple[int, int]:
    """The tile the epilogue stores at a time: ``Epilogue.tile``, else the CTA tile."""
    t = schedule.tile
    return schedule.epilogue.tile or (t.m, t.n)


def epi_stages(schedule: Schedule) -> int:
    """Epilogue buffers: one per epilogue tile of the CTA tile, at most MAX_EPI_STAGES."""
    t = schedule.tile
    em, en = epilogue_tile(schedule)
    return max(1, min(MAX_EPI_STAGES, (t.m // em) * (t.n // en)))


def c_elem_bytes(schedule: Schedule) -> int:
    """Bytes per element of the C staging buffer: split-K stages FP32 partials."""
    if schedule.split_k > 1:
        return 4
    return schedule.epilogue.out_dtype.nbytes


def operand_stage_bytes(schedule: Schedule, problem: Problem) -> dict[str, int]:
    """Bytes of one mainloop stage of A and B (packed FP4; a W4A16 A is 16-bit)."""
    t = schedule.tile
    a = t.m * t.k * 2 if problem.w4a16 else t.m * t.k // 2
    return {"A": a, "B": t.n * t.k // 2}


def sf_stage_bytes(rows: int, tile_k: int, fmt: BlockFormat) -> int:
    """Bytes of one stage of scale factors for ``rows`` rows: whole 128-row atoms of
    ``fmt``'s scales (one byte per ``fmt.block`` elements of ``tile_k``)."""
    return align(rows, SF_ATOM_ROWS) * (tile_k // fmt.block)


def mainloop_regions(per: dict[str, int], stages: int, n_barriers: int) -> list[Region]:
    """``barriers | A | B | SFA | SFB`` for ``stages`` stages of ``per`` bytes (operands of
    0 bytes have no region)."""
    regions = [Region("barriers", 8 * n_barriers, f"{n_barriers} mbarriers")]
    for op in ("A", "B", "SFA", "SFB"):
        if per[op]:
            regions.append(Region(op, per[op] * stages, f"{stages} x {per[op]:,} B"))
    return regions


def staged_c_region(schedule: Schedule) -> Region:
    """The C staging buffers: ``epi_stages`` epilogue tiles of the staged element type."""
    em, en = epilogue_tile(schedule)
    ob, n = c_elem_bytes(schedule), epi_stages(schedule)
    return Region("C", n * em * en * ob, f"{n} x {em}x{en}x{ob} B")


# ----------------------------------------------------------------------------- registers

class RegisterSplit(NamedTuple):
    """setmaxnreg budgets of a warp-specialized CTA, in registers per thread."""

    entry: int  # every thread's share at launch (the CTA's allocation / threads)
    producer: int  # the load warpgroup(s) decrease to this
    mma: int  # the MMA warpgroups increase to this

    @property
    def gains(self) -> bool:
        """True when the MMA warps end with more registers than they launched with."""
        return self.mma > self.entry


def register_split(threads: int, mma_threads: int, producer_regs: int,
                   max_regs: int) -> RegisterSplit:
    """The setmaxnreg split of a CTA of ``threads`` threads whose last ``threads -
    mma_threads`` (the load warps) drop to ``producer_regs`` registers per thread.

    At launch every thread holds ``entry`` = REG_FILE / threads, capped at 255 and rounded
    down to a multiple of 8 (one CTA per SM). ``setmaxnreg.inc`` draws from the CTA's own
    pool (PTX ISA: it blocks until enough registers are there), which holds only what the
    CTA was allocated at launch: ``entry * threads``. The MMA threads share that pool less
    the producer's ``producer_regs`` each, rounded down to a multiple of 8 and capped at
    ``max_regs``. Example: 384 threads, 256 of them MMA, producer 40: entry 168, MMA
    ``(168 * 384 - 128 * 40) / 256 = 232``.
    """
    producer_threads = threads - mma_threads
    if mma_threads <= 0 or producer_threads <= 0 or threads % WARPGROUP \
            or mma_threads % WARPGROUP:
        raise InputError(f"setmaxnreg needs whole warpgroups of MMA and producer threads; "
                         f"got {threads} threads with {mma_threads} MMA threads")
    entry = min(MAX_THREAD_REGS, REG_FILE // threads) // 8 * 8
    pool = entry * threads - producer_threads * producer_regs
    return RegisterSplit(entry, producer_regs, min(max_regs, pool // mma_threads // 8 * 8))


# ----------------------------------------------------------------------------- shared checks

def check_cta_threads(threads: int) -> list[str]:
    """A CTA holds at most 1,024 threads."""
    if threads > MAX_CTA_THREADS:
        return [f"{threads} threads per CTA exceed {MAX_CTA_THREADS:,}"]
    return []


def check_split_k_limit(s: Schedule, p: Problem) -> list[str]:
    if s.split_k > MAX_SPLIT_K:
        return [f"split_k {s.split_k} exceeds {MAX_SPLIT_K}"]
    return []


def check_problem_k(s: Schedule, p: Problem) -> list[str]:
    if p.k and p.k % 32:
        return [f"K = {p.k} is not a multiple of 32: packed FP4 rows must be a multiple of "
                "16 bytes for TMA"]
    return []


def check_split_k_tiles(s: Schedule, p: Problem) -> list[str]:
    """Every K split needs at least one K tile."""
    if p.k and s.split_k > 1:
        k_tiles = ceil_div(p.k, s.tile.k)
        if s.split_k > k_tiles:
            return [f"split_k {s.split_k} exceeds the {k_tiles} K tiles of "
                    f"K = {p.k} with tile K {s.tile.k}"]
    return []


def check_problem_n(s: Schedule, p: Problem) -> list[str]:
    if p.n and p.n % 8:
        return [f"N = {p.n} is not a multiple of 8: output rows must be 16-byte aligned"]
    return []


def check_grouped(s: Schedule, p: Problem) -> list[str]:
    """Grouped schedules take grouped problems (and the reverse), up to MAX_GROUPS groups,
    without split-K (each unit stores its rows of one group)."""
    grouped = s.scheduler.grouped
    if p.groups and not grouped:
        return [f"a grouped problem ({p.groups} groups) needs a grouped schedule "
                "(Scheduler(grouped=True)); this one computes one dense GEMM"]
    out = []
    if grouped and p.groups > MAX_GROUPS:
        out.append(f"{p.groups} groups exceed the grouped scheduler's {MAX_GROUPS} (it keeps "
                   f"{MAX_GROUPS // WARP} tile-count prefixes per lane of a warp)")
    if grouped and s.split_k > 1:
        out.append(f"grouped schedules do not split K (split_k {s.split_k}): use 1")
    return out


def silu_group(s: Schedule) -> int:
    """Rows per gate (and per up) group of a ``silu_mul`` weight: the N distance at which the
    kernel's MMA gives a thread both values of a pair (``epilogue.silu_mul_pairs`` checks it
    while tracing), its kernel family's (``cute_fp4.families``). A thread's C values come in
    8-wide groups along N for WGMMA and for the D^T tiles (rows ``lane / 4 + {0, 8}``); the
    SM120 tiled MMA's N permutation (32-column steps of (8, 2, 2):(1, 16, 8)) gives every
    SM120 tile and warp layout pairs 32 apart."""
    from cute_fp4.families import family_of

    return family_of(s).silu_group


NV_OUT_COLS = 32  # nvfp4_out: output columns a multiple of this (16-byte rows of codes)


def check_epilogue_ops(s: Schedule, p: Problem) -> list[str]:
    """``silu_mul`` pairs gate and up groups of :func:`silu_group` rows, so N is a multiple
    of twice that (the output has N / 2 columns). ``nvfp4_out`` (:func:`check_nvfp4_out`)."""
    g = silu_group(s)
    out = []
    gated = gated_op(s.epilogue.ops)
    if gated and p.n and p.n % (2 * g):
        out.append(f"N = {p.n} is not a multiple of {2 * g}: {gated} on {s.target} takes "
                   f"the weight's rows as gate/up groups of {g} "
                   "(cute_fp4.fused.interleave_gate_up) and stores N / 2 columns")
    if "nvfp4_out" in s.epilogue.ops:
        out += check_nvfp4_out(s, p)
    return out


def check_nvfp4_out(s: Schedule, p: Problem) -> list[str]:
    """``nvfp4_out`` needs a tile whose rows are output rows (the 16 columns of a block are
    the 4 lanes of a quad, reduced by shuffles: ``epilogue.nvfp4_blocks``), every thread of
    a tile storing at once (no split-K, whose last split is per thread), and output rows of
    packed codes in 16-byte multiples (N_out % 32)."""
    out = []
    if s.swap_ab or s.mainloop is not Mainloop.STANDARD:
        kind = "swap-AB" if s.swap_ab else f"mainloop={s.mainloop.value}"
        out.append(f"nvfp4_out is not built for the D^T tiles of {kind} kernels: a thread "
                   "holds output rows lane / 4 + {0, 8} of one column, so a block of 16 "
                   "output columns spans the rows of 16 threads in other warps; use a "
                   "normal-orientation schedule")
    warps_n = s.warps.mma[1]
    if s.arch.family == "sm120" and s.mainloop is Mainloop.STANDARD and warps_n > 2:
        out.append(f"nvfp4_out needs at most 2 MMA warps along N on {s.target}, got "
                   f"{warps_n}: the MMA's 32-column permutation step over {warps_n} warps "
                   f"gives a warp {32 // warps_n} columns of each 16-column block (the "
                   "block's amax is reduced by shuffles within a warp)")
    if s.split_k > 1:
        out.append(f"nvfp4_out does not take split-K (split_k {s.split_k}): the last split "
                   "of a tile is decided per thread, and a block's amax needs the 4 lanes "
                   "that hold it")
    cols = p.n // 2 if gated_op(s.epilogue.ops) else p.n
    if p.n and cols % NV_OUT_COLS:
        out.append(f"nvfp4_out: {cols} output columns are not a multiple of {NV_OUT_COLS} "
                   f"(blocks of 16 and rows of {cols} / 2 bytes of codes, 16-byte aligned)")
    return out


def check_block_format(s: Schedule, p: Problem) -> list[str]:
    """Where a format other than NVFP4 runs: SM120's block-scaled MMA (W4A4, the format's own
    MMA kind) and the decodes of the packed weight (sm_90a ``rs_packed``, ``stream`` on
    both families; W4A16 with BF16 activations). A mainloop that stages scale atoms takes
    whole atoms per K tile (``fmt.atom_k`` of K: 128 for MXFP4's blocks of 32)."""
    fmt = p.fmt
    if fmt is NVFP4:
        return []
    out = []
    sm120_mma = s.arch.family == "sm120" and s.mainloop is Mainloop.STANDARD
    if s.arch.family == "sm90" and (s.mainloop is Mainloop.STANDARD or s.swap_ab):
        out.append(f"{fmt} weights are not built for the sm_90a "
                   f"{'swap-AB' if s.swap_ab else 'shared-memory'} conversion (UE4M3 scales "
                   f"only): use mainloop=rs_packed or stream with the packed weight")
    if p.w4a16 and p.a_format is not Operand.BF16 and not sm120_mma:
        out.append(f"{fmt} weights decode to BF16 only ({fmt.scale.name} scales span "
                   f"{fmt.scale.min_positive:.3g} .. {fmt.scale.max:.3g}, beyond FP16's "
                   f"range): use bfloat16 activations, got {p.a_format}")
    if not p.w4a16 and not sm120_mma:
        out.append(f"W4A4 with {fmt} activations runs SM120's block-scaled MMA "
                   f"(kind::{fmt.mma_kind}) only; on {s.target} pass BF16 activations "
                   "(W4A16)")
    if s.mainloop is not Mainloop.STREAM and s.tile.k % fmt.atom_k:
        out.append(f"tile K {s.tile.k} is not a multiple of {fmt.atom_k}: a stage holds "
                   f"whole 512-byte scale atoms, which cover {fmt.atom_k} elements of K in "
                   f"{fmt} (blocks of {fmt.block})")
    return out


# run after the family's own checks, for every family
COMMON_CHECKS: tuple[Check, ...] = (check_split_k_limit, check_problem_k, check_split_k_tiles,
                                    check_problem_n, check_grouped, check_epilogue_ops,
                                    check_block_format)


class FamilyRules(NamedTuple):
    """What a family module gives the driver: accounting, CTA shape and its refusals."""

    stage_bytes: Callable[[Schedule, Problem], dict[str, int]]  # per stage: A, B, SFA, SFB
    regions: Callable[[Schedule, Problem, int], tuple[Region, ...]]  # for a stage count
    threads: Callable[[Schedule], int]  # threads per CTA the kernel launches
    registers: Callable[[Schedule], RegisterSplit | None]  # setmaxnreg split, None: none
    checks: tuple[Check, ...]  # the family's checks, in the order reasons are reported
    # the stage count of a kernel that stages nothing in shared memory (None: as many
    # stages as fit, searched by the driver)
    auto_stages: Callable[[Schedule, Problem], int] | None = None


__all__ = ["ALIGN", "MAX_GROUPS", "SF_ATOM_ROWS", "MAX_EPI_STAGES", "Region",
           "RegisterSplit", "register_split", "FamilyRules", "COMMON_CHECKS", "align", "ceil_div",
           "epilogue_tile", "epi_stages", "c_elem_bytes", "silu_group", "NV_OUT_COLS",
           "check_nvfp4_out"]
