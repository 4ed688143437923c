"""Hopper W4A16 at large M: register-sourced WGMMA on the fragment-order packed weight.

The weight (repacked once, cute_fp4.packed) is WGMMA's A operand: each consumer warpgroup
owns 64 of the tile's 128 weight rows, loads its fragment bytes with one 16-byte shared
load per 64 K elements and decodes them in registers (exact E2M1 x UE4M3 -> BF16), the
decode of each 32-wide K group overlapping the WGMMAs of the previous one. The 256
activation rows (WGMMA N = 256, the widest instruction: the most MMA work per decoded
weight byte) are TMA'd straight into WGMMA's swizzled B layout in natural K order, so W4A16
has no activation conversion pass at all (the shared-memory sourced default converts the
whole weight tile to BF16 in shared memory every K tile). K 64 per stage keeps ~37 KB
stages, six of them in flight; D^T is stored from registers. Persistent, grouped raster.
"""

from cute_fp4.schedule import Schedule, Tile, Warps

SCHEDULE = Schedule(target="sm_90a", tile=Tile(256, 128, 64), warps=Warps(mma=(2, 1)),
                    mainloop="rs_packed")
