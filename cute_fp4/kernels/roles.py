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
mbarriers (:func:`turn_wait` / :func:`turn_arrive`).
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import cutlass
import cutlass.cute as cute

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


# ----------------------------------------------------------------------------- pingpong

@cute.jit
def init_turns(enabled: cutlass.Constexpr, bars, group_threads: cutlass.Constexpr, warp_idx):
    """Pingpong: mbarriers [mainloop turn g0, g1, epilogue turn g0, g1]."""
    if cutlass.const_expr(enabled):
        if warp_idx == 0:
            with cute.arch.elect_one():
                for i in cutlass.range_constexpr(4):
                    cute.arch.mbarrier_init(bars + i, group_threads)
    cute.arch.mbarrier_init_fence()


@cute.jit
def turn_wait(enabled: cutlass.Constexpr, bars, group, turn, base: cutlass.Constexpr):
    """Wait until this group may run its ``turn``-th mainloop (base 0) / epilogue (base 2).

    Group 0 starts first; group g then waits for the other group's matching arrival.
    """
    if cutlass.const_expr(enabled):
        if group == 0:
            if turn > 0:
                cute.arch.mbarrier_wait(bars + base, (turn - 1) % 2)
        else:
            cute.arch.mbarrier_wait(bars + base + 1, turn % 2)


@cute.jit
def turn_arrive(enabled: cutlass.Constexpr, bars, group, base: cutlass.Constexpr):
    """Hand the turn to the other group (every thread of this group arrives)."""
    if cutlass.const_expr(enabled):
        cute.arch.mbarrier_arrive(bars + base + 1 - group)


@cute.jit
def skip_stages(state, count):
    """Advance a consumer's pipeline state past ``count`` stages other consumers take."""
    for _ in cutlass.range(count, unroll=1):
        state.advance()
    return state


__all__ = ["WARP", "WARPGROUP", "Barrier", "WarpLayout", "consumer_registers", "init_turns",
           "producer_registers", "skip_stages", "turn_arrive", "turn_wait", "warp_layout"]
