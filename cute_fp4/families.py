"""The kernel families, one row each: which schedules a family runs and what implements
them. Everything that depends on the family reads its row here (``compile`` the kernel
class and the tensor-core opcode a compile report must find, ``plan`` the planning rules,
the epilogue's gate/up group); what "auto" runs on each GPU family is the other table,
``tuning.AUTO``. A new kernel family is a row here plus its files (a kernel module under
``kernels/``, a planning module under ``planning/``, catalogue schedules): ``docs/
extending.md`` walks one through.

Implementations are named as ``"module:attribute"`` and imported when first used, so this
table (and ``import cute_fp4``) loads no CuTe DSL.

Rows are matched in order: a schedule runs the first row whose ``mainloop`` (None: any) and
``target_family`` (None: any) it has. The ``stream`` mainloop is one kernel for every target
family it plans for, so its row comes first.
"""

from __future__ import annotations

import dataclasses
import importlib

from cute_fp4.errors import ScheduleError
from cute_fp4.schedule import Mainloop, Schedule


@dataclasses.dataclass(frozen=True)
class KernelFamily:
    """One kernel family (module docstring)."""

    name: str
    kernel: str  # "module:Class" of its dense kernel class
    grouped_kernel: str  # of its grouped (MoE) kernel class
    rules: str  # "module:RULES": its planning rules (planning.common.FamilyRules)
    mma: str | None  # tensor-core SASS opcode prefix its kernels hold; None: the target's
    silu_group: int  # rows per gate/up group its fused SiLU-and-mul pairs (fused.py)
    mainloop: Mainloop | None = None  # the schedules it runs: this mainloop ...
    target_family: str | None = None  # ... on this target family (None: any)
    emulated: bool = False  # has an emulated-MMA build for SM90 GPUs (kernels/mma_emulation)

    def runs(self, schedule: Schedule) -> bool:
        return ((self.mainloop is None or schedule.mainloop is self.mainloop)
                and (self.target_family is None or schedule.arch.family == self.target_family))

    def sass_mma(self, schedule: Schedule) -> str:
        return self.mma or schedule.arch.sass_mma_prefix


FAMILIES: tuple[KernelFamily, ...] = (
    # the weight-streaming decode kernel: warp-level BF16/FP16 mma.sync on the packed
    # weight decoded in registers, one kernel for sm_90a and SM12x
    KernelFamily("stream", "cute_fp4.kernels.stream:StreamGemm",
                 "cute_fp4.kernels.stream:StreamGroupedGemm",
                 "cute_fp4.planning.stream:RULES", "HMMA", silu_group=8,
                 mainloop=Mainloop.STREAM),
    # SM120/SM121: warp-level block-scaled MMA (mma.sync kind::mxf4nvf4.block_scale),
    # whose N permutation pairs gate and up columns 32 apart
    KernelFamily("sm120", "cute_fp4.kernels.sm120:Sm120Gemm",
                 "cute_fp4.kernels.sm120:Sm120GroupedGemm",
                 "cute_fp4.planning.sm120:RULES", None, silu_group=32,
                 target_family="sm120", emulated=True),
    # SM90: FP4 converted to 16-bit in the kernel, then WGMMA (shared-memory or
    # register-sourced)
    KernelFamily("sm90", "cute_fp4.kernels.sm90:Sm90Gemm",
                 "cute_fp4.kernels.sm90:Sm90GroupedGemm",
                 "cute_fp4.planning.sm90:RULES", None, silu_group=8, target_family="sm90"),
)


def family_of(schedule: Schedule) -> KernelFamily:
    """The row that runs ``schedule``; ScheduleError naming the families when none does."""
    for fam in FAMILIES:
        if fam.runs(schedule):
            return fam
    t = schedule.arch
    raise ScheduleError(f"{t.name} (compute capability {t.cc[0]}.{t.cc[1]}, family "
                        f"{t.family}) has no kernel family; families: "
                        f"{', '.join(f.name for f in FAMILIES)}")


def resolve(ref: str):
    """The object a row names (``"module:attribute"``), imported now. The kernel classes
    are resolved by the host layer (``compile.kernel_class``), the planning rules by the
    planner (``plan``): this table itself imports neither."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


__all__ = ["FAMILIES", "KernelFamily", "family_of", "resolve"]
