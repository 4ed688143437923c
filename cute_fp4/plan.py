"""Planning: can a schedule be implemented, and exactly how is shared memory spent?

``plan(schedule, problem=None)`` runs a list of small named checks and returns a
:class:`Plan` with the shared-memory breakdown (bytes, per region), the stage counts and,
when the schedule cannot be implemented, the reasons with numbers. It is a pure function
(no DSL, no GPU): the API, the CLI, the tuner and the tests all call it, and the kernels
allocate shared memory with the very same region list (``smem_regions``), so the plan's
total is the kernel's dynamic shared memory, byte for byte (CI checks this).

Shared-memory model (both families): regions are laid out in order, each starting on a
1,024-byte boundary (TMA with 128-byte swizzles needs 1,024-byte aligned buffers):
``barriers | A | B | SFA | SFB | [A16 | B16] | C``. ``A16``/``B16`` exist only on SM90,
where FP4 tiles are converted to BF16 for WGMMA (with ``swap_ab``: ``A16`` only, two
buffers per consumer warpgroup, and no C).
"""

from __future__ import annotations

import dataclasses

from cute_fp4.errors import ScheduleError
from cute_fp4.schedule import Problem, Schedule, WarpRoles
from cute_fp4.targets import Target

ALIGN = 1024  # every region starts on this boundary
SF_VEC = 16  # elements per NVFP4 scale factor
SF_ATOM_ROWS = 128  # scale factors are stored in 128-row x 4-column atoms
MAX_EPI_STAGES = 4
SM90_CONVERT_STAGES = 2  # BF16 conversion buffers (double-buffered)


def _align(x: int, a: int = ALIGN) -> int:
    return -(-x // a) * a


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class Region:
    name: str
    bytes: int  # bytes used
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Plan:
    """What ``plan()`` found. ``ok`` is False when ``reasons`` is not empty."""

    schedule: Schedule
    problem: Problem
    target: Target
    stages: int  # mainloop (A/B/SF) stages; 0 when nothing fits
    epi_stages: int
    epi_tile: tuple[int, int]
    stage_bytes: dict[str, int]  # per-stage bytes of A, B, SFA, SFB
    regions: tuple[Region, ...]
    reasons: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.reasons

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory the kernel allocates (regions aligned, in order)."""
        return sum(_align(r.bytes) for r in self.regions)

    @property
    def smem_limit(self) -> int:
        return self.target.smem_per_block

    def raise_if_invalid(self) -> Plan:
        if self.reasons:
            name = self.schedule.name or self.schedule.label()
            raise ScheduleError(f"schedule {name} cannot be implemented: "
                                + "; ".join(self.reasons), self.reasons)
        return self

    def summary(self) -> str:
        """A printable breakdown, one region a line."""
        s = self.schedule
        lines = [f"schedule  {s.name or '-'}: {s.label()}",
                 f"stages    {self.stages} mainloop, {self.epi_stages} epilogue "
                 f"(epilogue tile {self.epi_tile[0]}x{self.epi_tile[1]})",
                 "per stage " + ", ".join(f"{k} {v:,} B" for k, v in self.stage_bytes.items())]
        for r in self.regions:
            pad = _align(r.bytes) - r.bytes
            extra = f" (+{pad:,} B alignment)" if pad else ""
            lines.append(f"  {r.name:<9}{r.bytes:>9,} B{extra}  {r.note}")
        lines.append(f"total     {self.smem_bytes:,} B of {self.smem_limit:,} B "
                     f"({self.target.name})")
        lines += [f"warning   {w}" for w in self.warnings]
        lines += [f"REFUSED   {r}" for r in self.reasons]
        return "\n".join(lines)


# ----------------------------------------------------------------------------- accounting

def epilogue_tile(schedule: Schedule) -> tuple[int, int]:
    t = schedule.tile
    return schedule.epilogue.tile or (t.m, t.n)


def stage_bytes(schedule: Schedule, problem: Problem) -> dict[str, int]:
    """Bytes one mainloop stage holds in shared memory, per operand."""
    t = schedule.tile
    sf_cols = t.k // SF_VEC
    out = {}
    if problem.w4a16:
        out["A"] = t.m * t.k * 2
    else:
        out["A"] = t.m * t.k // 2
    out["B"] = t.n * t.k // 2
    if schedule.arch.family == "sm120":
        # The SM120 scale-factor smem layout is built from 128-row atoms.
        out["SFA"] = _align(t.m, SF_ATOM_ROWS) * sf_cols
        out["SFB"] = _align(t.n, SF_ATOM_ROWS) * sf_cols
    else:
        # SM90 TMA-loads whole 512-byte scale atoms (128 rows x 4 columns), also for
        # 64-row tiles (which then use half of the atom).
        out["SFA"] = 0 if problem.w4a16 else _align(t.m, SF_ATOM_ROWS) * sf_cols
        out["SFB"] = _align(t.n, SF_ATOM_ROWS) * sf_cols
    return out


def c_elem_bytes(schedule: Schedule) -> int:
    """Bytes per element of the C staging buffer: split-K stages FP32 partials."""
    if schedule.split_k > 1:
        return 4
    return schedule.epilogue.out_dtype.nbytes


def smem_regions(schedule: Schedule, problem: Problem, stages: int) -> tuple[Region, ...]:
    """The shared-memory regions of a kernel with ``stages`` mainloop stages, in order."""
    t = schedule.tile
    per = stage_bytes(schedule, problem)
    em, en = epilogue_tile(schedule)
    epi_stages = _epi_stages(schedule)
    if schedule.arch.family == "sm90":
        # full/empty mbarrier per stage; conversion buffers and the epilogue use named barriers
        n_barriers = 2 * stages
    else:
        n_barriers = 2 * stages + 2 * schedule.warps.groups
    regions = [Region("barriers", 8 * n_barriers, f"{n_barriers} mbarriers")]
    for op in ("A", "B", "SFA", "SFB"):
        if per[op]:
            regions.append(Region(op, per[op] * stages, f"{stages} x {per[op]:,} B"))
    if schedule.arch.family == "sm90" and schedule.swap_ab:
        # swap-AB: the weight is converted in registers; the activation (WGMMA's B) gets
        # two 16-bit buffers per consumer warpgroup; results are stored from registers
        bufs = SM90_CONVERT_STAGES * schedule.warps.mma[1]
        regions.append(Region("A16", bufs * t.m * t.k * 2, f"{bufs} x 16-bit {t.m}x{t.k}"))
        regions.append(Region("C", 0, "none: D^T stored from registers"))
        return tuple(regions)
    if schedule.arch.family == "sm90":
        conv = SM90_CONVERT_STAGES
        if not problem.w4a16:
            regions.append(Region("A16", conv * t.m * t.k * 2, f"{conv} x BF16 {t.m}x{t.k}"))
        regions.append(Region("B16", conv * t.n * t.k * 2, f"{conv} x BF16 {t.n}x{t.k}"))
    ob = c_elem_bytes(schedule)
    if schedule.arch.family == "sm90" and ob == 4:
        # SM90 stores 32-bit results (FP32 output, split-K partials) from registers
        regions.append(Region("C", 0, "none: 32-bit results stored from registers"))
    else:
        regions.append(Region("C", epi_stages * em * en * ob,
                              f"{epi_stages} x {em}x{en}x{ob} B"))
    return tuple(regions)


def _epi_stages(schedule: Schedule) -> int:
    t = schedule.tile
    em, en = epilogue_tile(schedule)
    return max(1, min(MAX_EPI_STAGES, (t.m // em) * (t.n // en)))


def max_stages(schedule: Schedule, problem: Problem) -> int:
    """The largest stage count whose regions fit the target (0 if not even one)."""
    limit = schedule.arch.smem_per_block
    s = 0
    while s < 32 and sum(_align(r.bytes) for r in smem_regions(schedule, problem, s + 1)) <= limit:
        s += 1
    return s


# ----------------------------------------------------------------------------- checks
# Each check takes (schedule, problem) and returns a list of reasons (empty when fine).

def _check_tile(s: Schedule, p: Problem) -> list[str]:
    t, (wm, wn) = s.tile, s.warps.mma
    out = []
    if s.swap_ab:
        if s.arch.family != "sm90":
            return [f"swap_ab is implemented for sm_90a only, not {s.target}"]
        if t.n != 64 or t.k != 256 or t.m not in (8, 16, 32, 64):
            out.append(f"swap_ab tile {t} must be Mx64x256 with M (activation rows, "
                       "WGMMA's N) 8, 16, 32 or 64")
        if wm != 1 or not 1 <= wn <= 4:
            out.append(f"swap_ab takes Warps.mma = (1, W) with W in 1..4 consumer "
                       f"warpgroups splitting K, got {s.warps.mma}")
        return out
    if s.arch.family == "sm120":
        if t.m % (16 * wm):
            out.append(f"tile M {t.m} is not a multiple of 16 x {wm} MMA warps along M")
        if t.n % (8 * wn):
            out.append(f"tile N {t.n} is not a multiple of 8 x {wn} MMA warps along N")
        if t.k % 64 or t.k > 256:
            out.append(f"tile K {t.k} must be 64, 128, 192 or 256 (the MMA consumes K=64)")
        if SF_ATOM_ROWS % t.m or SF_ATOM_ROWS % t.n:
            out.append(f"tile {t.m}x{t.n}: M and N must be 32, 64 or 128 on SM120 (a tile "
                       "must not straddle two 128-row scale atoms)")
        if wn not in (2, 4):
            out.append(f"SM120 needs 2 or 4 MMA warps along N (the accumulator's column "
                       f"permutation), got {wn}")
        if t.m > 128 or t.n > 128:
            out.append(f"tile {t.m}x{t.n} exceeds 128x128: the accumulators of one CTA "
                       "would need more than 255 registers per thread on SM120")
    else:
        if t.m % (64 * wm):
            out.append(f"tile M {t.m} is not a multiple of 64 x {wm} warpgroups along M")
        if t.n % (8 * wn) or t.n // wn > 256:
            out.append(f"tile N {t.n} must be a multiple of 8 x {wn} with at most 256 "
                       "per warpgroup")
        for dim, v in (("M", t.m), ("N", t.n)):
            if v != 64 and v % SF_ATOM_ROWS:
                out.append(f"tile {dim} {v} must be 64 or a multiple of 128 (scale-factor "
                           "atoms cover 128 rows)")
        if t.k % 64 or t.k > 256:
            out.append(f"tile K {t.k} must be 64, 128, 192 or 256 (whole 4-column "
                       "scale-factor atoms)")
        threads, chunks = 128 * wm * wn, t.k // SF_VEC
        a_split = p.w4a16 or (t.m * chunks) % threads == 0  # W4A16 converts only B
        if not out and (threads % chunks or not a_split or (t.n * chunks) % threads):
            out.append(f"the {threads} converting threads do not split a {t.m}x{t.k} / "
                       f"{t.n}x{t.k} tile into whole passes of 16-element chunks")
    return out


def _check_warps(s: Schedule, p: Problem) -> list[str]:
    wm, wn = s.warps.mma
    per_group = wm * wn * (4 if s.arch.family == "sm90" else 1)
    threads = (per_group * s.warps.groups + (4 if s.arch.family == "sm90" else 1)) * 32
    if threads > 1024:
        return [f"{threads} threads per CTA exceed 1,024"]
    return []


def _check_epilogue(s: Schedule, p: Problem) -> list[str]:
    if s.swap_ab:
        return []  # D^T is stored from registers; no epilogue tile
    em, en = epilogue_tile(s)
    t = s.tile
    if t.m % em or t.n % en:
        return [f"epilogue tile {em}x{en} does not divide the CTA tile {t.m}x{t.n}"]
    if s.arch.family == "sm120":
        wm, wn = s.warps.mma
        rows, cols = 16 * wm, max(32, 8 * wn)
        if em % rows or en % cols:
            return [f"epilogue tile {em}x{en} must be whole MMA sub-tiles on SM120 with "
                    f"{wm}x{wn} MMA warps: M a multiple of {rows}, N a multiple of {cols}"]
    if s.arch.family == "sm90" and c_elem_bytes(s) == 2:
        wm, wn = s.warps.mma
        if em % (64 * wm) or (wn > 1 and en != t.n):
            return [f"epilogue tile {em}x{en} does not fit {wm}x{wn} warpgroups on sm_90a: "
                    f"its M must be a multiple of {64 * wm}"
                    + (f" and its N the whole tile N {t.n}" if wn > 1 else "")]
    if en * c_elem_bytes(s) < 16:
        return [f"epilogue tile N {en} stores rows of under 16 bytes; TMA needs >= 16"]
    return []


def _check_features(s: Schedule, p: Problem) -> list[str]:
    out = []
    fam = s.arch.family
    if fam == "sm120" and p.w4a16:
        out.append("W4A16 (16-bit A) is not implemented for SM120: quantize A to NVFP4 "
                   "(W4A4) or use an sm_90a schedule")
    if fam == "sm90" and s.warps.roles is WarpRoles.PINGPONG:
        out.append("pingpong warp roles are not implemented for sm_90a: use cooperative")
    if s.split_k > 16:
        out.append(f"split_k {s.split_k} exceeds 16")
    return out


def _check_problem(s: Schedule, p: Problem) -> list[str]:
    out = []
    if p.k and p.k % 32:
        out.append(f"K = {p.k} is not a multiple of 32: packed FP4 rows must be a multiple of "
                   "16 bytes for TMA")
    if p.k and s.split_k > 1:
        k_tiles = _ceil_div(p.k, s.tile.k)
        if s.split_k > k_tiles:
            out.append(f"split_k {s.split_k} exceeds the {k_tiles} K tiles of "
                       f"K = {p.k} with tile K {s.tile.k}")
    if p.n and p.n % 8:
        out.append(f"N = {p.n} is not a multiple of 8: output rows must be 16-byte aligned")
    return out


CHECKS = (_check_tile, _check_warps, _check_epilogue, _check_features, _check_problem)


def _smem_reasons(s: Schedule, p: Problem, stages: int, fit: int) -> list[str]:
    need = sum(_align(r.bytes) for r in smem_regions(s, p, max(stages, 1)))
    limit = s.arch.smem_per_block
    if need <= limit:
        return []
    hints = []
    if fit >= 1:
        hints.append(f"use stages <= {fit}")
    em, en = epilogue_tile(s)
    if (em, en) != (64, 32) and s.tile.m % 64 == 0 and s.tile.n % 32 == 0:
        small = s.replace(epi_tile=(64, 32), stages=None)
        fit_small = max_stages(small, p)
        if fit_small >= max(2, stages if s.stages else 2):
            hints.append(f"a 64x32 epilogue tile ({fit_small} stages fit)")
    if not hints:
        hints.append("use a smaller tile")
    what = f"{stages} stages" if s.stages else "even 1 stage"
    return [f"needs {need:,} B of shared memory per block for {what}; {s.target} allows "
            f"{limit:,} B: " + " or ".join(hints)]


def plan(schedule: Schedule | str, problem: Problem | tuple | None = None) -> Plan:
    """Check ``schedule`` (and ``problem`` when given) and account for shared memory.

    ``schedule`` may be a catalogue name and ``problem`` an ``(m, n, k)`` tuple.
    The shared-memory check runs even when another check fails, so a refusal always
    carries the byte counts when memory is also a problem.
    """
    from cute_fp4.catalogue import resolve

    schedule, problem = resolve(schedule, problem)
    p = problem or Problem()
    s = schedule
    fit = max_stages(s, p)
    stages = s.stages or fit
    # shared memory first: it is the refusal users of SM100-sized tiles need to see
    reasons = _smem_reasons(s, p, stages, fit) + [r for check in CHECKS for r in check(s, p)]
    warnings = []
    if not s.stages and fit == 1:
        em, en = epilogue_tile(s)
        warnings.append(f"auto stages left a single stage (no load/MMA overlap) with a "
                        f"{em}x{en} epilogue tile; a 64x32 epilogue tile frees shared "
                        "memory for a second stage")
    return Plan(schedule=s, problem=p, target=s.arch, stages=stages,
                epi_stages=_epi_stages(s), epi_tile=epilogue_tile(s),
                stage_bytes=stage_bytes(s, p), regions=smem_regions(s, p, max(stages, 1)),
                reasons=tuple(reasons), warnings=tuple(warnings))


def can_implement(schedule: Schedule, problem: Problem | None = None) -> tuple[bool, tuple]:
    """``(ok, reasons)``: the short form of :func:`plan`."""
    pl = plan(schedule, problem)
    return pl.ok, pl.reasons


__all__ = ["Plan", "Region", "plan", "can_implement", "smem_regions", "stage_bytes",
           "max_stages", "epilogue_tile", "WarpRoles"]
