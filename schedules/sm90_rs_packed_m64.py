"""Hopper W4A16, small M (decode to ~64 rows): packed-weight register-sourced mainloop.

The activation tile is 64 rows (WGMMA N = 64), the weight tile 128 rows (64 per consumer
warpgroup) with K 128 per stage: ~25 KB stages, nine in flight, so about 200 KB of packed
weight are in flight per SM while the two warpgroups decode fragments straight from shared
memory into registers (no 16-bit weight in shared memory, no split-K reduction). At M <= 64
and N = 8192 it launches 64 CTAs; split-K (a schedule variant) fills the other SMs.
"""

from cute_fp4.schedule import Schedule, Tile, Warps

SCHEDULE = Schedule(target="sm_90a", tile=Tile(64, 128, 128), warps=Warps(mma=(2, 1)),
                    mainloop="rs_packed")
