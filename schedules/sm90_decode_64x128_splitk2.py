"""Hopper decode with narrower tiles: 64x128x128, split-K 2.

Twice the N tiles of sm90_decode and half the K split: the same ~128 work units for
N = 8192, but each unit reads longer contiguous K runs of the weight and the host reduces
only two partials.
"""

from cute_fp4.schedule import Schedule, Tile, Warps

SCHEDULE = Schedule(target="sm_90a", tile=Tile(64, 128, 128), warps=Warps(mma=(1, 1)),
                    split_k=2)
