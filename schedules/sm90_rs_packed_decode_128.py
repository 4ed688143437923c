"""Hopper W4A16 decode (M <= 16), packed weight: 16 activation rows x 128 weight rows over two
consumer warpgroups.

Half the weight rows of sm90_rs_packed_decode, so twice the tiles: with the in-kernel
split-K reduction the decode heuristic (cute_fp4.api.decode_split) fills the SMs with
fewer, longer splits. Measured on H200 at M = 1 (perf/results/2026-12-01-h200-decode.md):
8192 x 8192 split 2 and 4096 x 4096 split 4 beat the 256-row tile's best split; at
28672 x 4096 the 256-row tile wins (224 tiles of 128 rows take two waves).
"""

from cute_fp4.schedule import Schedule, Tile, Warps

SCHEDULE = Schedule(target="sm_90a", tile=Tile(16, 128, 128), warps=Warps(mma=(2, 1)),
                    mainloop="rs_packed")
