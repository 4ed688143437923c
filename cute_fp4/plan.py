"""Planning: can a schedule be implemented, and exactly how is shared memory spent?

``plan(schedule, problem=None)`` runs small named checks and returns a :class:`Plan` with
the shared-memory breakdown (bytes, per region), the stage counts, the CTA's threads and
setmaxnreg register split and, when the schedule cannot be implemented, the reasons with
numbers. It is a pure function (no DSL, no GPU): the API, the CLI, the tuner and the tests
all call it, and the kernels allocate shared memory with the very same region list
(``smem_regions``), so the plan's total is the kernel's dynamic shared memory, byte for
byte (CI checks this).

This module is the driver: the rules live in one module per kernel family
(``cute_fp4/planning/sm120.py``, ``sm90.py``, ``stream.py``, over ``common.py``), named by
the family's row of ``cute_fp4.families``; a schedule no family runs is refused, never
planned by another's. The driver
searches the stage count, runs the family's checks and then the shared ones, and words the
shared-memory refusal.

Shared-memory model (both families): regions are laid out in order, each starting on a
1,024-byte boundary (TMA with 128-byte swizzles needs 1,024-byte aligned buffers):
``barriers | A | B | SFA | SFB | [A16 | B16] | C``. ``A16``/``B16`` exist only on SM90,
where FP4 tiles are converted to BF16 for WGMMA (with ``swap_ab``: ``A16`` only, two
buffers per consumer warpgroup, and no C).
"""

from __future__ import annotations

import dataclasses

from cute_fp4 import families
from cute_fp4.errors import ScheduleError
from cute_fp4.planning.common import (
    ALIGN,
    COMMON_CHECKS,
    MAX_EPI_STAGES,
    SF_ATOM_ROWS,
    FamilyRules,
    Region,
    RegisterSplit,
    c_elem_bytes,
    epi_stages,
    epilogue_tile,
    register_split,
    silu_group,
)
from cute_fp4.planning.common import align as _align
from cute_fp4.schedule import Problem, Schedule, WarpRoles
from cute_fp4.targets import Target


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
    threads: int = 0  # threads per CTA the kernel launches (0: no rules for the family)
    registers: RegisterSplit | None = None  # setmaxnreg split, None when the kernel has none

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
        if self.threads:
            regs = self.registers
            split = (f", setmaxnreg {regs.entry} -> producer {regs.producer}, MMA {regs.mma} "
                     "registers per thread" if regs else "")
            lines.append(f"threads   {self.threads} per CTA{split}")
        lines += [f"warning   {w}" for w in self.warnings]
        lines += [f"REFUSED   {r}" for r in self.reasons]
        return "\n".join(lines)


# ----------------------------------------------------------------------------- dispatch

def schedule_rules(schedule: Schedule) -> FamilyRules | None:
    """The rules ``schedule`` is planned by: its kernel family's (``families.family_of``;
    the ``stream`` mainloop's is one kernel for several target families, and
    planning/stream.py checks which), None when no family runs it."""
    for fam in families.FAMILIES:
        if fam.runs(schedule):
            return families.resolve(fam.rules)
    return None


def _rules(schedule: Schedule) -> FamilyRules:
    rules = schedule_rules(schedule)
    if rules is None:
        raise ScheduleError(_no_rules_reason(schedule.arch))
    return rules


def _no_rules_reason(t: Target) -> str:
    return (f"{t.name} (compute capability {t.cc[0]}.{t.cc[1]}, family {t.family}) has no "
            f"planning rules; kernel families: "
            f"{', '.join(f.name for f in families.FAMILIES)}")


# ----------------------------------------------------------------------------- accounting

def stage_bytes(schedule: Schedule, problem: Problem) -> dict[str, int]:
    """Bytes one mainloop stage holds in shared memory, per operand (A, B, SFA, SFB)."""
    return _rules(schedule).stage_bytes(schedule, problem)


def smem_regions(schedule: Schedule, problem: Problem, stages: int) -> tuple[Region, ...]:
    """The shared-memory regions of a kernel with ``stages`` mainloop stages, in order."""
    return _rules(schedule).regions(schedule, problem, stages)


def max_stages(schedule: Schedule, problem: Problem) -> int:
    """The largest stage count whose regions fit the target (0 if not even one)."""
    limit = schedule.arch.smem_per_block
    s = 0
    while s < 32 and sum(_align(r.bytes) for r in smem_regions(schedule, problem, s + 1)) <= limit:
        s += 1
    return s


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


def _single_stage_warnings(s: Schedule, fit: int) -> list[str]:
    if s.stages or fit != 1:
        return []
    em, en = epilogue_tile(s)
    return [f"auto stages left a single stage (no load/MMA overlap) with a {em}x{en} "
            "epilogue tile; a 64x32 epilogue tile frees shared memory for a second stage"]


def _unplanned(s: Schedule, p: Problem) -> Plan:
    """The refusal of a schedule no kernel family runs (so none plans it)."""
    return Plan(schedule=s, problem=p, target=s.arch, stages=0, epi_stages=epi_stages(s),
                epi_tile=epilogue_tile(s), stage_bytes={}, regions=(),
                reasons=(_no_rules_reason(s.arch),))


def plan(schedule: Schedule | str, problem: Problem | tuple | None = None) -> Plan:
    """Check ``schedule`` (and ``problem`` when given) and account for shared memory.

    ``schedule`` may be a catalogue name and ``problem`` an ``(m, n, k)`` tuple.
    The shared-memory check runs even when another check fails, so a refusal always
    carries the byte counts when memory is also a problem. Without a problem, a schedule
    that takes only 16-bit activations (grouped sm_90a) is planned for BF16 A.
    """
    from cute_fp4 import catalogue

    schedule, problem = catalogue.resolve(schedule, problem)
    if problem is None:  # any problem: NVFP4 A, or 16-bit A for a W4A16-only schedule
        first = _plan(schedule, Problem())
        if first.ok:
            return first
        w4a16 = _plan(schedule, Problem(a_format="bf16"))
        return w4a16 if w4a16.ok else first
    return _plan(schedule, problem)


def _plan(s: Schedule, p: Problem) -> Plan:
    rules = schedule_rules(s)
    if rules is None:
        return _unplanned(s, p)
    most = max_stages(s, p)
    fit = rules.auto_stages(s, p) if rules.auto_stages else most
    stages = s.stages or fit
    # shared memory first: it is the refusal users of SM100-sized tiles need to see; its
    # hint names the most stages that fit (a family's own auto count may be fewer, or not fit)
    reasons = _smem_reasons(s, p, stages, most)
    reasons += [r for check in (*rules.checks, *COMMON_CHECKS) for r in check(s, p)]
    return Plan(schedule=s, problem=p, target=s.arch, stages=stages,
                epi_stages=epi_stages(s), epi_tile=epilogue_tile(s),
                stage_bytes=rules.stage_bytes(s, p),
                regions=rules.regions(s, p, max(stages, 1)),
                reasons=tuple(reasons), warnings=tuple(_single_stage_warnings(s, fit)),
                threads=rules.threads(s), registers=rules.registers(s))


__all__ = ["Plan", "Region", "RegisterSplit", "plan", "smem_regions",
           "stage_bytes", "max_stages", "epilogue_tile", "c_elem_bytes", "register_split",
           "schedule_rules", "WarpRoles", "ALIGN", "SF_ATOM_ROWS",
           "MAX_EPI_STAGES", "silu_group"]
