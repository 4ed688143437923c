"""The default Hopper schedule: 128x256x64, two consumer warpgroups stacked along M.

FP4 tiles (and their scale atoms) arrive by TMA into a deep staged pipeline; the consumer
warpgroups convert each K tile to 16-bit in a double-buffered, 128-byte-swizzled shared
buffer and run WGMMA 64x256x16 with FP32 accumulation while the next tile converts. The
wide N keeps the WGMMA issue rate high for large M.
"""

from cute_fp4.schedule import Schedule, Tile, Warps

SCHEDULE = Schedule(target="sm_90a", tile=Tile(128, 256, 64), warps=Warps(mma=(2, 1)))
