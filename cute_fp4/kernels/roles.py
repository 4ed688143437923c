"""Warp roles and barriers shared by every kernel family.

Placement, decided once for all kernels: the producer warp(s) come first, the MMA
(consumer) warps after them; a consumer's index in the MMA layout is its thread index less
``WarpLayout.first_mma_thread``. Where ``setmaxnreg`` can move registers from the producer
to the consumers, the producer side is a whole warpgroup (the instruction works on
warpgroups): SM90 always, SM120 pingpong with 2 x 4 MMA warps. Measured on sm_90a
(2026-12-01, ptxas of DSL 4.8.1): with the producer warpgroup last, ptxas recomputed the
loop-invariant swizzled shared-memory addresses of the 128x256x64 kernel inside its K loop
(436 instructions per K tile against 389 with the producer first).

Named barriers (``bar.sync`` ids, :class:`Barrier`): id 0 is ``__syncthreads``; each MMA
group (SM120 pingpong group, SM90 swap-AB warpgroup) has its own id; one id spans every MMA
thread. Pingpong groups hand each other their mainloop and epilogue turns through four
mbarriers (:class:`Turn`, :func:`turn_wait` / :func:`turn_arrive`), kept in their own
shared-memory region (``TURN_BARRIERS``).

Pipeline arrive counts (:func:`stage_arrivals`) are derived from the roles, never written
by hand: a stage's full barrier expects one arrival of the producer warp's elected thread
(with the TMA transaction bytes), plus one per producer lane when that warp also copies by
cp.async (each lane arrives, no-inc, once its copies land); its empty barrier one arrival
per consumer warp that reads the stage (``PipelineTmaAsync`` releases from one thread of
each consumer warp). :func:`mainloop_pipeline` checks a kernel's own count of its consumer
warps against the roles' at trace time, with an AssertionError naming both.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline

from cute_fp4.plan import Plan

WARP = 32
WARPGROUP = 128


# Programmatic dependent launch (PDL), for every kernel of the package: each is launched
# with ``use_pdl=PDL``, so that its grid can be scheduled while the kernel before it on the
# stream drains (or, where that kernel triggers early, while it runs), and each of its
# threads calls :func:`wait_for_inputs` before its first global-memory access. The
# package's quantize and dequantize kernels trigger their dependents as they start
# (:func:`release_dependents`): their GEMM then launches during them and waits only for
# their memory. Correctness never rests on the trigger: ``griddepcontrol.wait`` returns
# once every prerequisite grid has completed and its writes are visible.
PDL = True


@cute.jit
def wait_for_inputs():
    """``griddepcontrol.wait``: the kernels before this one on the stream have finished and
    their memory is visible (returns at once for a launch without a dependency)."""
    if cutlass.const_expr(PDL):
        cute.arch.griddepcontrol_wait()


@cute.jit
def release_dependents():
    """``griddepcontrol.launch_dependents``: a PDL launch after this kernel may start now
    (it still waits for this kernel's memory in :func:`wait_for_inputs`)."""
    if cutlass.const_expr(PDL):
        cute.arch.griddepcontrol_launch_dependents()


class Barrier(enum.IntEnum):
    """Named-barrier ids. ``MMA_GROUP + g`` for group ``g`` (at most 4 groups)."""

    CTA = 0  # __syncthreads
    MMA_GROUP = 1  # ids 1..4: the threads of one MMA group / consumer warpgroup
    ALL_MMA = 5  # every MMA thread of the CTA


class WarpLayout(NamedTuple):
    """Thread layout of a CTA: the producer warp(s) first, then the consumers."""

    producer_warps: int  # warps [0, producer_warps) load; warp 0 issues the copies
    mma_threads: int  # threads [first_mma_thread, threads) run the MMAs
    threads: int  # CTA size
    regs: tuple[int, int] | None  # setmaxnreg (producer, consumer) registers, or None

    @property
    def producer_warp(self) -> int:
        return 0

    @property
    def first_mma_warp(self) -> int:
        return self.producer_warps

    @property
    def first_mma_thread(self) -> int:
        return self.producer_warps * WARP


def warp_layout(mma_warps: int, producer_warpgroup: bool, pl: Plan) -> WarpLayout:
    """One producer warp, or a whole producer warpgroup when ``producer_warpgroup``, then
    the consumers; the register split is the plan's (``plan.registers``)."""
    producer_warps = WARPGROUP // WARP if producer_warpgroup else 1
    mma_threads = mma_warps * WARP
    threads = mma_threads + producer_warps * WARP
    if threads != pl.threads:
        raise AssertionError(f"kernel launches {threads} threads, plan() counted {pl.threads}")
    regs = pl.registers
    return WarpLayout(producer_warps, mma_threads, threads,
                      None if regs is None else (regs.producer, regs.mma))


@cute.jit
def producer_registers(layout: cutlass.Constexpr):
    """setmaxnreg.dec for the producer side (nothing when ``layout.regs`` is None); call it
    at the top of the producer's branch, :func:`consumer_registers` at the top of the
    consumers'."""
    if cutlass.const_expr(layout.regs is not None):
        cute.arch.setmaxregister_decrease(layout.regs[0])


@cute.jit
def consumer_registers(layout: cutlass.Constexpr):
    """setmaxnreg.inc for the consumer (MMA) side; see :func:`producer_registers`."""
    if cutlass.const_expr(layout.regs is not None):
        cute.arch.setmaxregister_increase(layout.regs[1])


# ----------------------------------------------------------------------------- pipelines

class Arrivals(NamedTuple):
    """Arrive counts of a TMA -> consumers stage: full barrier (producer), empty (consumer)."""

    producer: int
    consumer: int


def stage_arrivals(layout: WarpLayout, consumer_groups: int = 1,
                   producer_cp_async: bool = False) -> Arrivals:
    """The arrivals a stage's barriers expect, from the warp roles: the producer warp's
    elected thread (TMA, with the transaction bytes), plus its :data:`WARP` lanes when it
    also copies by cp.async; one arrival per consumer warp of the ``consumer_groups``
    groups that take the stages in turn (SM120 pingpong groups, SM90 swap-AB warpgroups;
    1: every consumer warp reads every stage)."""
    consumer_warps = layout.mma_threads // WARP
    if consumer_warps % consumer_groups:
        raise AssertionError(f"{consumer_warps} consumer warps do not split into "
                             f"{consumer_groups} groups")
    return Arrivals(1 + (WARP if producer_cp_async else 0), consumer_warps // consumer_groups)


def check_arrivals(what: str, counted: int, derived: int, roles: str) -> None:
    """Trace time: a kernel's own count of arrivals is the roles' (a too-high count hangs
    the barrier, a too-low one releases the stage early)."""
    if counted != derived:
        raise AssertionError(f"{what}: the kernel counts {counted} arrivals per stage, the "
                             f"warp roles give {derived} ({roles})")


def mainloop_pipeline(layout: WarpLayout, stages: int, tx_bytes: int, barriers,
                      consumer_warps: int, consumer_groups: int = 1,
                      producer_cp_async: bool = False) -> pipeline.PipelineTmaAsync:
    """The TMA -> consumers ring of ``stages`` stages on the ``2 * stages`` mbarriers at
    ``barriers`` (full, then empty), with :func:`stage_arrivals`; ``consumer_warps``: the
    warps that release each stage as the kernel's consumer code counts them, checked
    against the roles. ``defer_sync``: the kernel synchronises after its other barriers'
    initialisation."""
    arrivals = stage_arrivals(layout, consumer_groups, producer_cp_async)
    check_arrivals("stage release (empty barrier)", consumer_warps, arrivals.consumer,
                   f"{layout.mma_threads // WARP} consumer warps in {consumer_groups} "
                   "group(s) taking stages in turn")
    return pipeline.PipelineTmaAsync.create(
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, arrivals.producer),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, arrivals.consumer),
        tx_count=tx_bytes,
        barrier_storage=barriers,
        cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        defer_sync=True,
    )


# ----------------------------------------------------------------------------- pingpong

def turn_arrivals(layout: WarpLayout, groups: int, group_threads: int) -> int:
    """Arrivals a turn mbarrier expects: every thread of the group handing the turn over
    (:func:`turn_arrive`), from the roles; ``group_threads``, the kernel's own count of a
    group's threads, is checked against it at trace time."""
    derived = layout.mma_threads // groups
    check_arrivals("pingpong turn", group_threads, derived,
                   f"{layout.mma_threads} MMA threads in {groups} groups")
    return derived


class Turn(enum.IntEnum):
    """Pingpong turns, each a pair of mbarriers in the ``TURN_BARRIERS`` region: mbarrier
    ``turn + g`` says that group ``g`` may take its next ``turn`` (the other group
    arrives on it when it hands the turn over)."""

    MAINLOOP = 0  # mbarriers 0, 1: the K mainloop (the groups share the stages' order)
    EPILOGUE = 2  # mbarriers 2, 3: the epilogue (the groups share the one C buffer)


TURN_BARRIERS = 4  # mbarriers of the pingpong turns


@cute.jit
def init_turns(enabled: cutlass.Constexpr, bars, group_threads: cutlass.Constexpr, warp_idx):
    """Pingpong: the :data:`TURN_BARRIERS` mbarriers at ``bars`` (see :class:`Turn`), each
    expecting ``group_threads`` arrivals (:func:`turn_arrivals`)."""
    if cutlass.const_expr(enabled):
        if warp_idx == 0:
            with cute.arch.elect_one():
                for i in cutlass.range_constexpr(TURN_BARRIERS):
                    cute.arch.mbarrier_init(bars + i, group_threads)
    cute.arch.mbarrier_init_fence()


@cute.jit
def turn_wait(enabled: cutlass.Constexpr, bars, group, turn, base: cutlass.Constexpr):
    """Wait until this group may run its ``turn``-th mainloop (``base`` =
    ``Turn.MAINLOOP``) / epilogue (``Turn.EPILOGUE``).

    Group 0 starts first; group g then waits for the other group's matching arrival.
    """
    if cutlass.const_expr(enabled):
        if group == 0:
            if turn > 0:
                cute.arch.mbarrier_wait(bars + int(base), (turn - 1) % 2)
        else:
            cute.arch.mbarrier_wait(bars + int(base) + 1, turn % 2)


@cute.jit
def turn_arrive(enabled: cutlass.Constexpr, bars, group, base: cutlass.Constexpr):
    """Hand the turn ``base`` (a :class:`Turn`) to the other group (every thread of this
    group arrives)."""
    if cutlass.const_expr(enabled):
        cute.arch.mbarrier_arrive(bars + int(base) + 1 - group)


@cute.jit
def skip_stages(state, count):
    """Advance a consumer's pipeline state past ``count`` stages other consumers take."""
    for _ in cutlass.range(count, unroll=1):
        state.advance()
    return state


__all__ = ["TURN_BARRIERS", "WARP", "WARPGROUP", "Arrivals", "Barrier", "Turn", "WarpLayout",
           "check_arrivals", "consumer_registers", "init_turns", "mainloop_pipeline",
           "producer_registers", "skip_stages", "stage_arrivals", "turn_arrivals", "turn_arrive",
           "turn_wait",
           "warp_layout"]
