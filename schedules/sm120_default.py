"""The default SM120 schedule: 128x128x128, 8 cooperative MMA warps, auto stages.

A 128x128x128 NVFP4 stage holds 8 KiB of A, 8 KiB of B and 2 KiB of scale factors; with a
whole-tile BF16 epilogue buffer (32 KiB) three stages fit in 99 KiB. This is the shape
CUTLASS ships as its SM120 default, and the baseline every other schedule changes one
thing of.
"""

from cute_fp4.schedule import Schedule, Tile

SCHEDULE = Schedule(target="sm_120a", tile=Tile(128, 128, 128))
