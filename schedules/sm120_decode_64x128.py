"""Decode tile 64x128x128: for small M, halve the wasted rows of A.

At M <= 64 a 128-row tile computes at least half zeros. 64-row tiles with a 2x4 warp layout
keep the MMA warps busy on real rows, and the smaller A stage leaves room for more stages
to stream B (the weight), which is all that matters when M is small.
"""

from cute_fp4.schedule import Schedule, Tile, Warps

SCHEDULE = Schedule(target="sm_120a", tile=Tile(64, 128, 128), warps=Warps(mma=(2, 4)))
